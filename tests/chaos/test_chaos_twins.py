"""What the answers' token ids and version labels prove: an answer labelled with one
version that carries another's tokens is unlike its twins; answers that do not name their
version, or name one that never served, are counted; and the load records each answer's
labels as the router sent them (a real aiohttp server on a loopback socket)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from chaos.checks import parse_check
from chaos.load import LoadGenerator, RequestRow
from chaos.metrics import TrialRow, evaluate, run_figures, with_requests
from chaos.report import Results, RunMeta, markdown
from chaos.scenario import FAULTS, ClientLoad

META = RunMeta("t", "chaos run t.yaml", "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "m", True)
VERSION = "X-Holdfast-Model-Version"


def _answer(
    start: float,
    prompt: int,
    version: str,
    digest: str,
    *,
    streamed: bool = True,
    fingerprint: str | None = None,
) -> RequestRow:
    """A whole answer; a collected one's fingerprint names its version unless given."""
    if fingerprint is None:
        fingerprint = "" if streamed else version
    return RequestRow(
        start,
        start + 0.1,
        200,
        1,
        "e1",
        1,
        streamed=streamed,
        prompt=prompt,
        digest=digest,
        version=version,
        fingerprint=fingerprint,
    )


def test_an_answer_with_the_other_versions_tokens_is_unlike_its_twins() -> None:
    rows = [_answer(100.0 + i, 0, "va", "a0", streamed=i % 2 == 0) for i in range(4)]
    rows += [_answer(110.0 + i, 0, "vb", "b0", streamed=i % 2 == 0) for i in range(4)]
    rows += [_answer(120.0 + i, 1, v, f"{v}1") for i, v in enumerate(("va", "vb", "va"))]
    run = run_figures(rows, [], None, {"va", "vb"})
    assert (run.twin_mismatches, run.twin_versions_alike, run.versions) == (0, 0, 2)
    # labelled va, made (in part) of vb's tokens: a stream continued on the other version
    mixed = _answer(112.5, 0, "va", "b0")
    trial = TrialRow(0, "main", "update", "update:update", None, 112.0, 118.0, None, None)
    run = run_figures([*rows, mixed], [trial], None, {"va", "vb"})
    assert run.twin_mismatches == 1
    assert with_requests(trial, [*rows, mixed], None, [trial]).twin_mismatches == 1
    assert not evaluate(parse_check("twin_mismatches == 0", faults=FAULTS), [trial], run).passed


def test_two_versions_that_answer_alike_say_a_mix_could_not_be_seen() -> None:
    rows = [_answer(100.0, 0, "va", "same"), _answer(101.0, 0, "vb", "same")]
    rows += [_answer(102.0, 1, "va", "x"), _answer(103.0, 1, "vb", "y")]
    run = run_figures(rows, [], None, {"va", "vb"})
    assert run.twin_versions_alike == 1
    check = parse_check("twin_versions_alike == 0", faults=FAULTS)
    assert not evaluate(check, [], run).passed


def test_answers_without_their_version_or_of_a_version_never_served_are_counted() -> None:
    rows = [
        _answer(100.0, 0, "va", "a"),  # labelled
        _answer(101.0, 0, "va", "a", streamed=False),  # header and fingerprint agree
        _answer(102.0, 0, "", "a"),  # no header
        _answer(103.0, 0, "va", "a", streamed=False, fingerprint=""),  # no fingerprint
        _answer(104.0, 0, "va", "a", streamed=False, fingerprint="vz"),  # another one
        _answer(105.0, 0, "vbad", "a"),  # a version that never served
        RequestRow(106.0, 106.1, 502, 3, "", None, "bad gateway"),  # failed: no answer
    ]
    trial = TrialRow(0, "main", "update", "update:update", None, 101.5, 110.0, None, None)
    run = run_figures(rows, [trial], None, {"va", "vb"})
    assert (run.unlabelled_answers, run.unserved_versions) == (3, 1)
    assert with_requests(trial, rows, None, [trial]).unlabelled_answers == 3
    assert run_figures(rows[:2], [], None, set()).unserved_versions == 2  # nothing known served
    text = " ".join(markdown(Results(META, run, [], [trial], rows, [])).split())
    assert "3 answers without their version, 1 of a version never served" in text
    assert "served (as /cluster said): va, vb" in text


class Router:
    """Answers like the router: its labels, token ids that depend on the prompt alone, a
    collected answer's system_fingerprint."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = [sum(body["prompt_token_ids"]) % 256 + i for i in range(body["max_tokens"])]
        headers = {"X-Holdfast-Engine": "e3", "X-Holdfast-Epoch": "2", VERSION: "vb"}
        if not body.get("stream"):
            whole = {
                "choices": [{"token_ids": ids}],
                "usage": {"completion_tokens": len(ids)},
                "system_fingerprint": "vb",
            }
            return web.json_response(whole, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in ids:
            await resp.write(f"data: {json.dumps({'choices': [{'token_ids': [i]}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_the_load_records_each_answers_version_and_twins_of_both_kinds() -> None:
    async def main() -> list[RequestRow]:
        app = web.Application()
        app.router.add_post("/v1/completions", Router().handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        spec = ClientLoad(
            concurrency=4,
            rate=None,
            max_tokens=5,
            max_requests=60,
            stream=True,
            stream_fraction=0.5,
            twins="all",
            twin_prompts=3,
        )
        gen = LoadGenerator(f"http://127.0.0.1:{port}", spec, seed=2)
        await gen.run(asyncio.Event(), duration_s=20.0)
        await runner.cleanup()
        return gen.rows

    rows = asyncio.run(main())
    assert len(rows) == 60 and all(r.ok for r in rows)
    assert {r.streamed for r in rows} == {True, False}
    assert all(r.version == "vb" and r.engine == "e3" and r.epoch == 2 for r in rows)
    assert {r.fingerprint for r in rows if not r.streamed} == {"vb"}
    assert all(0 <= r.prompt < 3 and r.digest for r in rows)
    by_prompt = {(r.prompt, r.digest) for r in rows}  # streamed or not, one answer a prompt
    assert len(by_prompt) == len({r.prompt for r in rows})
    run = run_figures(rows, [], None, {"vb"})
    assert (run.unlabelled_answers, run.unserved_versions, run.twin_mismatches) == (0, 0, 0)
