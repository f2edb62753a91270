"""One request at a time, behind the same `submit` as the batching engine.

For `--model-impl hf`: a transformers model generates one request at a time on one worker
thread; requests beyond the one running wait in a bounded queue (503 past it). /metrics
shows max_batch 1 for such an engine.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Protocol

from engine.batcher import Post
from engine.errors import BadRequest, QueueFull
from engine.job import Generation, Job, OnStep, Stats, Step


class OneAtATime(Protocol):
    kind: str

    def run(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> Generation: ...

    def embed(self, batch: list[list[int]]) -> list[list[float]]: ...

    def follow(self) -> int: ...

    def stop_followers(self) -> None: ...


class SerialEngine:
    def __init__(self, model: OneAtATime, max_waiting: int) -> None:
        self.model, self.kind, self.max_waiting = model, model.kind, max_waiting
        self.post: Post = lambda fn: fn()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0

    def start(self) -> None:
        """The worker thread starts with the first request."""

    def submit(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> concurrent.futures.Future[Generation]:
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise QueueFull(
                    f"{self._waiting} requests already wait (the engine's --max-waiting); "
                    "retry later"
                )
            self._waiting += 1
        post = self.post

        def step(s: Step) -> None:
            if on_step is not None:
                post(lambda: on_step(s))

        def work() -> Generation:
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                return self.model.run(job, step, cancel)
            finally:
                with self._lock:
                    self._running -= 1

        return self._executor.submit(work)

    def run(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> Generation:
        return self.submit(job, on_step, cancel).result()

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        return self._executor.submit(self.model.embed, batch).result()

    warms = False  # keeps no prefix: each request runs the model over its whole input

    def warm(self, key: str, prompt: tuple[int, ...]) -> concurrent.futures.Future[Generation]:
        raise BadRequest("this engine keeps no prefix warm (a transformers model, one at a time)")

    def forget(self, key: str) -> bool:
        return False

    def wake(self) -> None:
        """Nothing to wake: a cancelled request stops at its next step by itself."""

    def stats(self) -> Stats:
        with self._lock:
            return Stats(self._running, self._waiting, 0, 0, 1, 0.0, 0)

    def follow(self) -> int:
        return self.model.follow()

    def stop_followers(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.model.stop_followers()
