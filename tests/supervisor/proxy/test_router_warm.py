"""Streams' pasts kept warm on the next standby: while a stream runs, the router sends its
past to the standby promoted next every `router.warm_every` tokens; when the primary is
killed, the continuation there computes only the tokens after the last past kept, and the
client's stream is the same as without the fault. With `warm_every: 0` nothing is kept and
the continuation computes the whole past.

Real `supervisor run` and engines on the tiny checkpoint; sizes in tokens."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.policy import RouterSpec
from supervisor.primary import PrimaryView, Target
from supervisor.proxy import warming
from supervisor.proxy.migration import COMPLETIONS, Stream
from supervisor.proxy.router import Router
from tests.engines.harness import get
from tests.supervisor.proxy.test_router_streams import (
    PROMPT,
    TOKENS,
    boot,
    cut_stream,
    get_text,
    stream,
    token_ids,
)


def engine_metric(port: int, name: str) -> float:
    for line in get_text(f"http://127.0.0.1:{port}/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on engine :{port}/metrics")


def until_metric(port: int, name: str, ok: Callable[[float], bool], timeout: float = 60) -> None:
    """Until the engine's metric `name` satisfies `ok` (another process's state, with
    nothing to wait on: polled, under a deadline far above any machine's pace)."""
    deadline = time.monotonic() + timeout
    while not ok(engine_metric(port, name)):
        assert time.monotonic() < deadline, f"{name} on :{port} never got there"
        time.sleep(0.02)


@pytest.mark.parametrize("every", [8, 0])
def test_a_killed_primarys_stream_continues_from_what_the_standby_kept(
    tmp_path: Path, tiny_model: Path, every: int
) -> None:
    sup = boot(tmp_path, tiny_model, router={"warm_every": every})
    try:
        sup.wait_pair()
        reference = list(stream(sup.router, prompt_token_ids=PROMPT, max_tokens=TOKENS))
        standby = get(f"{sup.api}/standby")[1][0]
        # the reference stream ended: the standby was told to forget its past
        until_metric(standby["port"], "holdfast_engine_kept_prefixes", lambda n: n == 0)
        mark = sup.tap.mark()
        events = cut_stream(sup, prompt_token_ids=PROMPT, max_tokens=TOKENS)
        promoted = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
        assert promoted.name == standby["name"]
        assert events[-1] == b"[DONE]" and token_ids(events) == token_ids(reference)
        reused = engine_metric(standby["port"], "holdfast_engine_reused_prompt_tokens_total")
        if every:
            # kept at least once after the first 8 tokens: the continuation's prefill
            # skipped the prompt and those
            assert reused >= len(PROMPT) + every
        else:
            assert reused == 0
        router = get_text(f"{sup.api}/metrics")
        line = 'holdfast_supervisor_router_warm_requests_total{outcome="kept"}'
        sent = [float(ln.split()[-1]) for ln in router.splitlines() if ln.startswith(line)]
        assert (sent[0] > 0) == bool(every)
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_token_id_prompt_is_kept_on_the_standby_before_its_first_token(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A prompt of token ids goes to the heir as the request arrives: killed in a stream's
    first tokens (`warm_every` far off), the primary leaves a continuation that computes
    only what came after the prompt, and the client's stream is the same as without the
    fault. A machine busy enough that the whole answer came while the test waited for the
    standby's metric leaves nothing to migrate: the test asks again, on the next pair."""
    sup = boot(tmp_path, tiny_model, router={"warm_every": 1000})
    try:
        sup.wait_pair()
        reference = list(stream(sup.router, prompt_token_ids=PROMPT, max_tokens=TOKENS))
        kept = "holdfast_engine_kept_prefixes"
        for _ in range(3):
            standby = get(f"{sup.api}/standby")[1][0]
            until_metric(standby["port"], kept, lambda n: n == 0)  # earlier pasts forgotten
            mark, events = sup.tap.mark(), []
            for data in stream(sup.router, prompt_token_ids=PROMPT, max_tokens=TOKENS):
                events.append(data)
                if len(events) == 1:  # the prompt only: no past was due yet
                    until_metric(standby["port"], kept, lambda n: n >= 1)  # this prompt's
                    os.kill(get(f"{sup.api}/primary")[1]["pid"], signal.SIGKILL)
            if b": migrated" in events:
                break
            heir = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark).name
            sup.wait(lambda e, heir=heir: e.event == "ready" and e.name != heir, 180, mark)
        else:
            raise AssertionError("the answer was whole before the kill 3 times")
        assert events.count(b": migrated") == 1
        assert events[-1] == b"[DONE]" and token_ids(events) == token_ids(reference)
        reused = engine_metric(standby["port"], "holdfast_engine_reused_prompt_tokens_total")
        assert reused == len(PROMPT)  # the prompt, and not one token more
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_new_heir_gets_no_past_while_a_cut_stream_waits_for_its_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a failover the new heir's first warm is every stream's whole past: it waits
    until no cut stream is still waiting for its continuation's first token, then all go.
    (The heirs here are closed ports: the warm requests fail, which is only counted. A cut
    holds warming back however long this machine takes between the steps.)"""
    monkeypatch.setattr(warming, "RESUMING_S", math.inf)

    def closed_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    async def main() -> None:
        view = PrimaryView()
        router = Router(RouterSpec(warm_every=4), view)
        streams = [Stream(COMPLETIONS, {}) for _ in range(2)]
        for st in streams:
            st.prompt_ids, st.emitted = [1, 2, 3], [5] * 8
        view.heir = Target("e2", closed_port(), 2)
        for st in streams:
            router.warmer.heard(st)
        assert all(st.warming for st in streams)
        await asyncio.gather(*router.warmer._tasks)
        assert router.warmer.failed == 2 and not any(st.warming for st in streams)
        view.heir = Target("e3", closed_port(), 3)  # e2 promoted; both streams cut
        first, second = streams
        for st in streams:
            st.cut_at = time.monotonic()
        first.cut_at = 0.0  # its first token after the cut came
        first.emitted.append(6)
        router.warmer.heard(first)
        assert not first.warming and not second.warming
        second.cut_at = 0.0
        second.emitted.append(6)
        router.warmer.heard(second)
        assert first.warming and second.warming
        await asyncio.gather(*router.warmer._tasks)
        assert router.warmer.failed == 4
        await router.client().close()

    asyncio.run(main())


def test_a_stream_that_ends_while_its_past_is_on_its_way_is_forgotten_after_it() -> None:
    """A stream that ends while a warm request of its past is still under way on the heir:
    the forget goes only once that request was answered, so the heir, which keeps the past
    when its prefill ends, does not keep it for good. (The heir here is a real HTTP server
    that answers the second warm request only when the test lets it.)"""
    from aiohttp import web

    async def main() -> None:
        arrived: list[dict[str, object]] = []
        second, release = asyncio.Event(), asyncio.Event()

        async def warm(request: web.Request) -> web.Response:
            body = await request.json()
            arrived.append(body)
            if len(arrived) == 2:
                second.set()
                await release.wait()
            return web.json_response({})

        runner, port = await heir_serving(warm)
        view = PrimaryView()
        router = Router(RouterSpec(warm_every=4), view)
        view.heir = Target("e2", port, 2)
        st = Stream(COMPLETIONS, {"prompt_token_ids": [1, 2, 3]})
        router.warmer.arrived(st)  # the prompt: kept at once
        await asyncio.gather(*list(router.warmer._tasks))
        assert st.warmed == 3
        st.prompt_ids, st.emitted = [1, 2, 3], [5] * 4
        router.warmer.heard(st)  # the past of 7 tokens: its answer held
        await second.wait()
        router.warmer.ended(st)
        assert len(router.warmer._tasks) == 1  # the held warm only: no forget beside it
        release.set()
        while router.warmer._tasks:
            await asyncio.gather(*list(router.warmer._tasks))
        assert [sorted(b) for b in arrived] == [["key", "prompt"]] * 2 + [["forget", "key"]]
        assert arrived[2] == {"key": st.warm_key, "forget": True} and st.warmed == 0
        await router.client().close()
        await runner.cleanup()

    asyncio.run(main())


def test_a_heir_refitted_to_new_weights_gets_every_past_again_before_it_counts_as_warm() -> None:
    """A standby refitted to new weights gave back every past it kept (engine/refit.py):
    named again as the heir on its new version, it is another place for the warming. The
    next chunk of any stream sends every stream's whole past there at once; until those
    are kept, `warm_on` (what a retrying refit's switch waits for) says no, and a
    continuation there names no key. (The heir is a real HTTP server answering 200.)"""

    async def main() -> None:
        runner, port, arrived = await recording_heir()
        view = PrimaryView()
        router = Router(RouterSpec(warm_every=4), view)
        old = Target("e2", port, 2, version="v1")
        view.heir = old
        streams = [Stream(COMPLETIONS, {}) for _ in range(3)]
        for st in streams:
            st.prompt_ids, st.emitted = [1, 2, 3], [5] * 8
        for st in streams:
            router.warmer.heard(st)
        await asyncio.gather(*list(router.warmer._tasks))
        assert len(arrived) == 3 and view.warm_on(old)
        assert all(router.warmer.key_for(st, old) == st.warm_key for st in streams)

        new = Target("e2", port, 2, version="v2")  # the same engine, refitted
        view.heir = new
        assert not view.warm_on(new)
        assert all(router.warmer.key_for(st, new) == "" for st in streams)
        streams[1].emitted.append(6)  # one chunk of one stream: every past goes again
        router.warmer.heard(streams[1])
        assert all(st.warming for st in streams)
        await asyncio.gather(*list(router.warmer._tasks))
        assert len(arrived) == 6
        assert [len(b["prompt"]) for b in arrived[3:]] == [11, 12, 11]  # type: ignore[arg-type]
        assert view.warm_on(new)
        assert all(router.warmer.key_for(st, new) == st.warm_key for st in streams)
        await router.client().close()
        await runner.cleanup()

    asyncio.run(main())


def test_a_new_heir_does_not_hide_the_past_the_last_heir_keeps() -> None:
    """A retrying refit's switch: the streams' pasts are kept on the refitted heir (e1),
    which is promoted; the old primary (e2) cuts its streams and, refitted, stands by as
    the next heir. When a chunk of another stream names e2 the heir before the router has
    seen a cut (on a loaded machine it sees it late), the cut stream's continuation on e1
    still names its key and the tokens e1 keeps. (The heirs are real HTTP servers.)"""

    async def main() -> None:
        runner, port, _ = await recording_heir()
        view = PrimaryView()
        router = Router(RouterSpec(warm_every=4), view)
        e1 = Target("e1", port, 2, version="v2")
        view.heir = e1
        cut, other = Stream(COMPLETIONS, {}), Stream(COMPLETIONS, {})
        for st in (cut, other):
            st.prompt_ids, st.emitted = [1, 2, 3], [5] * 8
            router.warmer.heard(st)
        await asyncio.gather(*list(router.warmer._tasks))
        assert view.warm_on(e1) and router.warmer.kept(cut, e1) == 11

        view.heir = Target("e2", port + 1, 0, version="v2")  # the old primary, refitted
        other.emitted.append(6)
        router.warmer.heard(other)  # every stream's past is due on the new heir
        assert cut.warmed_on != warming._kept_by(e1)
        assert router.warmer.key_for(cut, e1) == cut.warm_key
        assert router.warmer.kept(cut, e1) == 11
        for t in list(router.warmer._tasks):
            t.cancel()  # nothing answers on port + 1
        await asyncio.gather(*list(router.warmer._tasks), return_exceptions=True)
        await router.client().close()
        await runner.cleanup()

    asyncio.run(main())


async def heir_serving(
    warm: Callable[[Any], Awaitable[Any]],
) -> tuple[Any, int]:
    """A real HTTP server answering POST /holdfast/warm with `warm`: its runner and port."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post(warming.PATH, warm)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


async def recording_heir() -> tuple[Any, int, list[dict[str, object]]]:
    """`heir_serving` answering 200 to every warm request: its runner, its port, and the
    bodies it was sent, in order."""
    from aiohttp import web

    arrived: list[dict[str, object]] = []

    async def warm(request: web.Request) -> web.Response:
        arrived.append(await request.json())
        return web.json_response({})

    runner, port = await heir_serving(warm)
    return runner, port, arrived


def test_a_refits_switch_waits_for_every_stream_kept_to_within_warm_every() -> None:
    """`warm_on`, what a retrying refit's switch waits for: every stream under way counts,
    one heard while no heir was named and one that has sent no chunk yet too, and a past
    kept long ago (the prompt alone) is not warm, nor is a first past still on its way.
    (The heir is a real HTTP server.)"""

    async def main() -> None:
        runner, port, _ = await recording_heir()
        view = PrimaryView()
        router = Router(RouterSpec(warm_every=4), view)
        heard = Stream(COMPLETIONS, {"max_tokens": 100})
        fresh = Stream(COMPLETIONS, {"prompt_token_ids": [1, 2], "max_tokens": 100})
        heard.prompt_ids, heard.emitted = [1, 2, 3], [5] * 8
        router.warmer.heard(heard)  # no heir named yet: nothing goes, but it is under way
        router.warmer.arrived(fresh)
        heir = Target("e2", port, 2, version="v2")
        view.heir = heir
        assert not view.warm_on(heir)  # nothing kept there: not vacuously warm
        heard.emitted.append(6)
        router.warmer.heard(heard)
        await asyncio.gather(*list(router.warmer._tasks))
        assert router.warmer.kept(heard, heir) == 12
        assert not view.warm_on(heir)  # the fresh stream's prompt is not there yet
        router.warmer.arrived(fresh)
        # on its way is not kept: a continuation coming before its prefill runs takes
        # its place, and would find nothing there
        assert fresh.warming and not view.warm_on(heir)
        await asyncio.gather(*list(router.warmer._tasks))
        assert view.warm_on(heir)
        heard.emitted += [7] * 4  # another past of `heard` on its way: what is kept stays
        router.warmer.heard(heard)
        assert heard.warming and view.warm_on(heir)
        await asyncio.gather(*list(router.warmer._tasks))
        assert router.warmer.kept(heard, heir) == 16
        heard.emitted += [7] * 5  # 5 tokens past what is kept: more than warm_every
        assert not view.warm_on(heir)
        await router.client().close()
        await runner.cleanup()

    asyncio.run(main())


def test_streams_of_the_superseded_primary_are_kept_on_the_new_one_until_cut() -> None:
    """Between a retrying refit's switch and the old primary's cut, the new primary is the
    heir (`Roster.warm_through_cut`): the old primary's streams go on being kept there,
    and streams that already run there send nothing. (The new primary is a real HTTP
    server counting the warm requests.)"""

    async def main() -> None:
        runner, port, arrived = await recording_heir()
        view = PrimaryView()
        router = Router(RouterSpec(warm_every=4), view)
        new = Target("e2", port, 3, version="v2")
        view.target, view.heir = new, Target("e2", port, 0, version="v2")
        old_stream, new_stream = Stream(COMPLETIONS, {}), Stream(COMPLETIONS, {})
        old_stream.epoch, new_stream.epoch = 2, 3  # on the superseded primary, and on e2
        for st in (old_stream, new_stream):
            st.prompt_ids, st.emitted = [1, 2, 3], [5] * 8
            router.warmer.heard(st)
        await asyncio.gather(*list(router.warmer._tasks))
        assert [len(b["prompt"]) for b in arrived] == [11]  # type: ignore[arg-type]
        assert router.warmer.kept(old_stream, new) == 11
        assert router.warmer.key_for(old_stream, new) == old_stream.warm_key
        router.warmer.arrived(Stream(COMPLETIONS, {"prompt_token_ids": [1, 2]}))  # goes to e2
        await asyncio.gather(*list(router.warmer._tasks))
        assert len(arrived) == 1
        await router.client().close()
        await runner.cleanup()

    asyncio.run(main())
