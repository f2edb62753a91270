"""Real engine processes over HTTP: attach vs disk parity, TP 2 vs 1, bad requests."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProc
from prometheus_client.parser import text_string_to_metric_families

from engine.launch import EngineProcess
from engine.server import ENDED_EARLY
from holdfast_contract.wire import free_port

PROMPTS = [[1, 2, 3], [200, 17, 5, 9, 77, 3, 12], [42]]
ENDED = ENDED_EARLY  # logged once the generation of a client that left stops


def post(
    url: str,
    body: bytes | dict[str, Any],
    path: str = "/v1/completions",
) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw, status, headers = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, dict(e.headers)
    text = raw.decode()
    return status, headers, (json.loads(text) if text.startswith("{") else text)


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    status, _, body = post(url, {"prompt_token_ids": prompt, "max_tokens": 12, **extra})
    assert status == 200, body
    return body["choices"][0]


@pytest.fixture(scope="module")
def daemon_sock(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A float32 `cachedaemon serve` of the tiny checkpoint, for the whole module."""
    run = tmp_path_factory.mktemp("run")
    args = ["serve", "--model", str(tiny_model), "--runtime-dir", str(run), "--dtype", "float32"]
    daemon = DaemonProc(args)
    try:
        daemon.wait_serving()
        yield run / "daemon-0.sock"
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def engines(tiny_model: Path, daemon_sock: Path) -> Iterator[dict[str, EngineProcess]]:
    common = ["--model", str(tiny_model), "--dtype", "float32"]
    disk = [*common, "--allow-disk-fallback"]
    tp = [*disk, "--world-size", "2", "--dist-init", f"tcp://127.0.0.1:{free_port()}"]
    procs = {
        "disk": EngineProcess([*disk, "--name", "disk"]),
        "tp0": EngineProcess([*tp, "--rank", "0", "--name", "tp"]),
        "tp1": EngineProcess([*tp, "--rank", "1"]),
        "attached": EngineProcess([*common, "--daemons", str(daemon_sock), "--name", "attached"]),
    }
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_attached_engine_generates_the_same_tokens_as_disk(
    engines: dict[str, EngineProcess],
) -> None:
    assert engines["attached"].ready is not None
    assert engines["attached"].ready["weights"] == "daemon"
    assert engines["disk"].ready is not None and engines["disk"].ready["weights"] == "disk"
    for prompt in PROMPTS:
        got = complete(engines["attached"].url, prompt, ignore_eos=True)
        want = complete(engines["disk"].url, prompt, ignore_eos=True)
        assert len(got["token_ids"]) == 12
        assert got["token_ids"] == want["token_ids"]


def test_streamed_tokens_equal_the_whole_completion(engines: dict[str, EngineProcess]) -> None:
    url = engines["attached"].url
    status, headers, text = post(
        url, {"prompt_token_ids": PROMPTS[1], "max_tokens": 12, "stream": True, "ignore_eos": True}
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [t for c in chunks for t in c["token_ids"]] == complete(
        url, PROMPTS[1], ignore_eos=True
    )["token_ids"]
    assert chunks[-1]["finish_reason"] == "length"


def leave_a_stream(url: str, body: dict[str, Any]) -> None:
    """Start a streamed completion, read until its first token event, and hang up."""
    where = urllib.parse.urlparse(url)
    data = json.dumps({**body, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.create_connection((where.hostname, where.port), timeout=60) as s:
        s.sendall(head.encode() + data)
        seen = b""
        while b"data: " not in seen:
            chunk = s.recv(65536)
            assert chunk, seen
            seen += chunk


def in_flight(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    [line] = [x for x in text.splitlines() if x.startswith("holdfast_engine_in_flight ")]
    return float(line.split()[1])


def leave_a_request(url: str, body: dict[str, Any]) -> None:
    """Send a (non-streamed) completion; hang up once the engine has it in flight."""
    where = urllib.parse.urlparse(url)
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.create_connection((where.hostname, where.port), timeout=60) as s:
        s.sendall(head.encode() + data)
        deadline = time.monotonic() + 30
        while in_flight(url) < 1:  # through a router too: it forwards /metrics to the primary
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.005)


def assert_leaving_stops(
    proc: EngineProcess, leave: Callable[[str, dict[str, Any]], None], max_tokens: int = 500
) -> None:
    """A client that `leave`s a long request: its generation ends cancelled, short of it."""
    before = len(proc.events(ENDED))
    leave(proc.url, {"prompt_token_ids": [7], "max_tokens": max_tokens, "ignore_eos": True})
    ended = proc.wait_events(ENDED, before + 1)
    assert len(ended) == before + 1, proc.log[-3000:]
    assert ended[-1]["reason"] == "cancelled" and ended[-1]["tokens"] < max_tokens, ended[-1]


def test_a_client_that_hangs_up_before_the_reply_stops_its_generation(
    engines: dict[str, EngineProcess],
) -> None:
    assert_leaving_stops(engines["disk"], leave_a_request)  # 500 tokens: about 0.5 s here
    assert complete(engines["disk"].url, [1, 2])["token_ids"]


@pytest.mark.parametrize("which", ["attached", "tp0"])
def test_a_stream_client_that_leaves_stops_its_generation(
    engines: dict[str, EngineProcess], which: str
) -> None:
    """On tp 2 both ranks stop at the same step: the next request still matches tp 1."""
    assert_leaving_stops(engines[which], leave_a_stream)
    for prompt in PROMPTS:
        got = complete(engines[which].url, prompt, ignore_eos=True)
        assert (
            got["token_ids"] == complete(engines["disk"].url, prompt, ignore_eos=True)["token_ids"]
        )


def test_tp2_gives_the_same_tokens_and_close_logprobs(engines: dict[str, EngineProcess]) -> None:
    for prompt in PROMPTS:
        got = complete(engines["tp0"].url, prompt, logprobs=5, ignore_eos=True)
        want = complete(engines["disk"].url, prompt, logprobs=5, ignore_eos=True)
        assert got["token_ids"] == want["token_ids"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(
            want["logprobs"]["token_logprobs"], abs=1e-4
        )
        for g, w in zip(
            got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"], strict=True
        ):
            assert g.keys() == w.keys()
            assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)


def test_responses_say_who_answered(engines: dict[str, EngineProcess]) -> None:
    status, headers, body = post(engines["tp0"].url, {"prompt_token_ids": [1], "max_tokens": 1})
    assert status == 200
    assert headers["X-Holdfast-Engine"] == "tp" and headers["X-Holdfast-Epoch"] == "0"
    with urllib.request.urlopen(engines["attached"].url + "/health", timeout=10) as resp:
        health = json.loads(resp.read())
    assert health["state"] == "serving" and health["name"] == "attached"


BAD = [
    (b"{not json", "malformed JSON"),
    ({"max_tokens": 4}, "send exactly one of `prompt`"),
    ({"prompt_token_ids": [1, 256], "max_tokens": 4}, "outside the vocabulary [0, 256): [256]"),
    ({"prompt_token_ids": [1] * 510, "max_tokens": 8}, "exceeds the context length 512"),
    ({"prompt_token_ids": [1], "max_tokens": 5000}, "must be in 1..1024"),
    ({"prompt_token_ids": [1], "max_tokens": "many"}, "Expected `int | null`"),
]


@pytest.mark.parametrize(("body", "message"), BAD)
def test_bad_requests_get_400_and_the_engine_keeps_serving(
    engines: dict[str, EngineProcess], body: bytes | dict[str, Any], message: str
) -> None:
    url = engines["disk"].url
    status, _, reply = post(url, body)
    assert status == 400
    assert message in reply["error"]["message"]
    assert complete(url, [1, 2])["token_ids"]


def test_metrics_count_requests_and_startup_phases(engines: dict[str, EngineProcess]) -> None:
    complete(engines["attached"].url, [3, 4])
    with urllib.request.urlopen(engines["attached"].url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["holdfast_engine_requests"].type == "counter"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("holdfast_engine_requests_total", (("code", "200"),))] >= 1
    assert samples[("holdfast_engine_generated_tokens_total", ())] >= 1
    assert samples[("holdfast_engine_startup_ms", ())] > 0
    for phase in ("imports", "context_init", "build", "attach", "warmup"):
        assert ("holdfast_engine_startup_phase_ms", (("phase", phase),)) in samples
    info = ("name", "attached"), ("role", "primary"), ("weights", "daemon")
    assert samples[("holdfast_engine_info", info)] == 1
    assert {s.labels["state"] for s in families["holdfast_engine_kv_blocks"].samples} == {
        "used",
        "kept",
        "free",
    }


def test_no_daemon_exits_nonzero_naming_the_socket(tiny_model: Path, tmp_path: Path) -> None:
    sock = tmp_path / "daemon-0.sock"
    proc = EngineProcess(["--model", str(tiny_model), "--daemons", str(sock)])
    assert proc.wait_exit(60) != 0
    assert f"no daemon answers on {sock}" in proc.log
    assert "--allow-disk-fallback" in proc.log


def test_a_daemon_of_another_dtype_is_a_mismatch_naming_the_field(
    tiny_model: Path, daemon_sock: Path
) -> None:
    proc = EngineProcess(["--model", str(tiny_model), "--daemons", str(daemon_sock)])
    assert proc.wait_exit(60) == 2
    assert "fields that differ: dtype;" in proc.log, proc.log
    assert "match --dtype" in proc.log
    assert "--allow-disk-fallback" in proc.log


def test_a_tp_group_stops_together(tiny_model: Path) -> None:
    """SIGTERM on rank 0 stops its follower cleanly; a follower whose rank 0 died exits 3."""
    common = ["--model", str(tiny_model), "--allow-disk-fallback", "--world-size", "2"]
    pairs = []
    for _ in range(2):
        tp = [*common, "--dist-init", f"tcp://127.0.0.1:{free_port()}"]
        lead = EngineProcess([*tp, "--rank", "0"])
        pairs.append((lead, EngineProcess([*tp, "--rank", "1"], port=lead.port)))
    try:
        for lead, follower in pairs:
            lead.wait_ready()
            follower.wait_ready()
        (term_lead, term_follower), (kill_lead, kill_follower) = pairs
        term_lead.proc.terminate()
        kill_lead.proc.kill()
        assert (term_lead.wait_exit(30), term_follower.wait_exit(30)) == (0, 0)
        assert kill_follower.wait_exit(30) == 3
        assert "rank 0 is gone" in kill_follower.log
    finally:
        for pair in pairs:
            for p in pair:
                p.stop()


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    [line] = [x for x in text.splitlines() if x.startswith(f"holdfast_engine_{name} ")]
    return float(line.split()[1])


def test_concurrent_requests_on_tp2_equal_each_alone_on_tp1(
    engines: dict[str, EngineProcess],
) -> None:
    """Batched across two gloo ranks: every request's tokens are those it gets alone."""
    prompts = [[(5 * i + j) % 250 + 1 for j in range(1 + 3 * i)] for i in range(8)]
    alone = [complete(engines["disk"].url, p, ignore_eos=True)["token_ids"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        batched = list(
            pool.map(lambda p: complete(engines["tp0"].url, p, ignore_eos=True), prompts)
        )
    assert [c["token_ids"] for c in batched] == alone
    assert metric(engines["tp0"].url, "steps_total") > 0


def test_a_stream_client_that_leaves_frees_its_slot_and_blocks(
    engines: dict[str, EngineProcess],
) -> None:
    url = engines["attached"].url
    assert_leaving_stops(engines["attached"], leave_a_stream)
    assert metric(url, "running") == 0
    assert metric(url, 'kv_blocks{state="used"}') == 0


def test_a_full_engine_answers_503_with_retry_after(tiny_model: Path) -> None:
    """One request runs, one waits; the next is shed with 503 + Retry-After, not queued
    forever, and the two accepted ones complete with their own tokens."""
    flags = ["--model", str(tiny_model), "--dtype", "float32", "--allow-disk-fallback"]
    proc = EngineProcess([*flags, "--max-batch", "1", "--max-waiting", "1"])
    try:
        proc.wait_ready()
        url = proc.url
        long_body = {"prompt_token_ids": [7], "max_tokens": 480, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, url, {**long_body, "stream": True})
            deadline = time.monotonic() + 30
            while metric(url, "running") < 1:
                assert time.monotonic() < deadline, "the first request never ran"
            waiting = pool.submit(complete, url, [3, 4, 5], ignore_eos=True)
            while metric(url, "waiting") < 1:
                assert time.monotonic() < deadline, "the second request never queued"
            status, headers, body = post(url, {"prompt_token_ids": [9], "max_tokens": 4})
            assert status == 503, body
            assert headers["Retry-After"] == "1"
            assert (
                body["error"]["type"] == "overloaded"
                and "--max-waiting" in body["error"]["message"]
            )
            assert running.result(60)[0] == 200
            queued = waiting.result(60)["token_ids"]
        assert queued == complete(url, [3, 4, 5], ignore_eos=True)["token_ids"]
        assert metric(url, "waiting") == 0 and metric(url, "running") == 0
    finally:
        proc.stop()
