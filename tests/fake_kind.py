"""A third engine kind, `engines.kind: fake`, registered from outside supervisor/kinds/
(`HOLDFAST_KINDS=tests.fake_kind:KIND`): its own policy section (`engines.fake`), its
start command (tests/fake_kind_engine.py, a small aiohttp server), readiness and health by
`GET /health`, and a probe of its own that reads the engine's load from `GET /load`."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from supervisor.kinds.base import Kind, Probe, Reports
from supervisor.policy import Policy
from supervisor.units import Engine, Incarnation


class FakeSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    greeting: str = "hello"  # the first word of every answer
    load: int = 0  # the in-flight requests the engine says it has on GET /load


async def watch_load(e: Engine, inc: Incarnation, p: Policy, reports: Reports) -> None:
    """The engine's load from GET /load, every heartbeat interval."""
    interval = p.heartbeat.interval_ms / 1000.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        while not inc.handled and e.inc is inc:
            try:
                async with http.get(f"http://127.0.0.1:{e.port}/load") as r:
                    if r.status == 200:
                        reports.on_load(e, inc, int((await r.json())["in_flight"]), 0)
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(interval)


class Fake(Kind):
    name = "fake"
    section = FakeSpec
    warms = False

    def resolve(self, p: Policy) -> Policy:
        s: FakeSpec = self.settings(p)
        command = ["{python}", "-m", "tests.fake_kind_engine", "--port", "{port}"]
        command += ["--greeting", s.greeting, "--load", str(s.load)]
        engines = msgspec.structs.replace(p.engines, command=command, health="http")
        return msgspec.structs.replace(p, engines=engines)

    def errors(self, p: Policy, *, schema_only: bool) -> list[str]:
        s: FakeSpec = self.settings(p)
        return [] if s.greeting.isidentifier() else ["$.engines.fake.greeting: must be a word"]

    def own_probes(self, p: Policy) -> tuple[Probe, ...]:
        return (watch_load,)


KIND = Fake()
