"""engines.kv_adopt: the serving engines' KV caches live in the keeper, each with a ledger
of its streams, and a standby keeps only a small cache. When the primary dies (kill -9) or
stops (SIGSTOP: fenced once its heartbeats are missed), the standby promoted takes over
the dead primary's cache, and each cut stream's continuation computes nothing of what
its client was sent: its first token was sampled already (by the dead primary, or by the
promoted engine's prefill of the last token the dead one sampled, run as it takes the
cache over), and the client's stream equals the same request run without a fault.

Real `supervisor run`, engines and keeper on the tiny checkpoint; sizes in tokens."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.engines.harness import Event, Supervisor, get
from tests.supervisor.proxy.test_router_streams import (
    CUT_AFTER,
    ENGINE,
    PROMPT,
    TOKENS,
    boot,
    chunks,
    get_text,
    migrations,
    stream,
    token_ids,
)
from tests.supervisor.proxy.test_router_warm import engine_metric

ENGINES = {"command": ENGINE, "ready_timeout_s": 120, "stop_grace_s": 5.0, "kv_adopt": True}


def lines(log: Path) -> list[dict[str, Any]]:
    """An engine's JSON log, line by line (what is not JSON left out)."""
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def until(done: Callable[[], bool], timeout: float = 60) -> None:
    """Until `done()` (another process's log, with nothing to wait on: polled, under a
    deadline far above any machine's pace)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "never came"
        time.sleep(0.02)


def sent_before_cut(events: list[bytes]) -> int:
    """Token ids the client had before the stream moved (the router's `: migrated`)."""
    cut = next(i for i, e in enumerate(events) if e.startswith(b": migrated"))
    return len(token_ids(events[:cut]))


def adopted(sup: Supervisor, stop: int) -> Event:
    """A stream cut by `stop` (a signal) sent to the primary after CUT_AFTER chunks, the
    standby promoted over the dead one's cache, the stream equal to its fault-free twin
    and its continuation a prefill of one token."""
    sup.wait_pair()
    reference = token_ids(list(stream(sup.router, prompt_token_ids=PROMPT, max_tokens=TOKENS)))
    primary = get(f"{sup.api}/primary")[1]
    standby = get(f"{sup.api}/standby")[1][0]
    before = engine_metric(standby["port"], "holdfast_engine_reused_prompt_tokens_total")
    # the standby holds the primary's cache ahead (engine/kvahead.py): its promotion
    # then asks the keeper nothing
    log = sup.run / "logs" / f"{standby['name']}.0.log"
    held = {"event": "kv cache held ahead", "key": f"kv/{primary['name']}"}
    until(lambda: any(held.items() <= x.items() for x in lines(log)))
    mark = sup.tap.mark()
    events: list[bytes] = []
    for data in stream(sup.router, prompt_token_ids=PROMPT, max_tokens=TOKENS):
        events.append(data)
        if len(events) == CUT_AFTER:
            os.kill(primary["pid"], stop)
    promoted = sup.wait(lambda e: e.event == "promoted", timeout=30, after=mark)
    assert promoted.name == standby["name"]
    assert promoted.data["kv_from"] == primary["name"]
    assert events[-1] == b"[DONE]" and token_ids(events) == reference
    assert any(e.startswith(b": migrated") for e in events), "the stream was not cut"
    # the continuation's prompt is PROMPT and what was sent: all of it came from the dead
    # primary's cache, but its last token when the client lacked more than LEDGER_STEPS
    # the dead one had sampled (made, not yet sent; the ledger names the last few)
    reused = engine_metric(standby["port"], "holdfast_engine_reused_prompt_tokens_total")
    assert len(PROMPT) + sent_before_cut(events) - (reused - before) in (0, 1)
    taken = sup.wait(lambda e: e.event in ("kv-adopted", "kv-not-adopted"), after=mark)
    assert (taken.name, taken.event, taken.data["streams"]) == (standby["name"], "kv-adopted", 1)
    migrated = sup.wait(lambda e: e.event == "migrated", timeout=10, after=mark)
    assert migrated.data["continued"] == "adopted"
    assert migrated.data["kept"] == reused - before
    assert migrations(sup)["stalls"] == 1
    stalls = get_text(f"{sup.api}/metrics")
    line = 'holdfast_supervisor_router_stream_stall_seconds_count{continued="adopted"} 1.0'
    assert line in stalls.splitlines()
    said = [x for x in lines(log) if x.get("event") == "kv cache adopted"]
    assert [x["ahead"] for x in said] == [True] and "not adopted" not in log.read_text()
    assert len(chunks(events)) > CUT_AFTER
    return promoted


def test_a_killed_primarys_stream_continues_from_its_kv_cache(
    tmp_path: Path, tiny_model: Path
) -> None:
    sup = boot(tmp_path, tiny_model, engines=ENGINES)
    try:
        adopted(sup, signal.SIGKILL)
    finally:
        sup.stop(signal.SIGKILL)


def test_a_stopped_primary_is_fenced_before_its_kv_cache_is_adopted(
    tmp_path: Path, tiny_model: Path
) -> None:
    sup = boot(tmp_path, tiny_model, engines=ENGINES)
    try:
        mark = sup.tap.mark()
        promoted = adopted(sup, signal.SIGSTOP)
        fenced = sup.wait(lambda e: e.event == "fenced", timeout=5, after=mark)
        assert fenced.name == promoted.data["previous"] == promoted.data["kv_from"]
        order = sup.tap.events
        assert order.index(fenced) < order.index(promoted)
    finally:
        sup.stop(signal.SIGKILL)
