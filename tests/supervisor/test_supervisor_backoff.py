"""Restart backoff (tenacity's exponential wait with jitter) and restart intensity."""

from __future__ import annotations

from supervisor.backoff import RestartBook
from supervisor.policy import RestartSpec


def test_intensity_quarantines_past_the_limit_and_forgets_old_restarts() -> None:
    book = RestartBook(RestartSpec(max_restarts=3, window_s=10.0))
    assert [book.record(now=t) for t in (0.0, 1.0, 2.0)] == [False, False, False]
    assert book.record(now=3.0) is True  # the 4th within 10 s
    assert book.recent(now=12.5) == 1  # only t=3.0 is still inside the window
    assert book.record(now=12.5) is False
    assert book.total == 5


def test_delay_grows_exponentially_with_jitter_and_is_capped() -> None:
    spec = RestartSpec(
        initial_s=0.1, max_s=1.0, multiplier=2.0, jitter_s=0.05, max_restarts=100, window_s=60.0
    )
    book = RestartBook(spec)
    delays = []
    for t in range(8):
        book.record(now=t * 0.001)
        delays.append(book.delay(now=t * 0.001))
    assert 0.1 <= delays[0] <= 0.15
    assert 0.2 <= delays[1] <= 0.25
    assert 0.4 <= delays[2] <= 0.45
    assert all(d <= 1.05 for d in delays) and delays[-1] >= 1.0  # max_s, plus the jitter
    book.reset()
    assert book.recent() == 0 and 0.1 <= book.delay() <= 0.15
