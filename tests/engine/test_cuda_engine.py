"""The reference engine on real GPUs: attached from cuda-vmm daemons, fp8-block, NCCL tensor
parallel, and under the supervisor (failover, daemon death with the pool held in escrow)."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cachedaemon import protocol
from engine.launch import EngineProcess
from holdfast_contract.wire import free_port
from tests.conftest import Daemons, ForkServerProc
from tests.engine.test_engine_serve import assert_leaving_stops, leave_a_stream
from tests.engines.harness import Load, Supervisor, topic, write_policy

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cuda.bindings")

PROMPTS = [[1, 2, 3], [200, 17, 5, 9, 77, 3, 12], [42]]
TWO_GPUS = torch.cuda.device_count() >= 2
needs_two = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")

# daemon flags per pool config; every daemon serves from cuda-vmm on GPU 0
DAEMONS = {
    "bf16": ["--device", "cuda:0", "--dtype", "bfloat16"],
    "fp8": ["--device", "cuda:0", "--dtype", "bfloat16", "--quantization", "fp8-block"],
    "f32": ["--device", "cuda:0", "--dtype", "float32"],
}


@pytest.fixture(scope="module")
def socks(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_daemons: Daemons
) -> dict[str, str]:
    """One run dir per daemon config; the tp2 run dir holds one daemon per rank and GPU."""
    out: dict[str, str] = {}
    for name, flags in DAEMONS.items():
        run = tmp_path_factory.mktemp(name)
        module_daemons(tiny_model, run, *flags, wait=False).wait_serving(120)
        out[name] = str(run / "daemon-0.sock")
        reply, _ = protocol.call(out[name], protocol.StatusRequest())
        assert isinstance(reply, protocol.StatusReply)
        assert (reply.backend, reply.device) == ("cuda-vmm", "cuda:0")
    if TWO_GPUS:
        run = tmp_path_factory.mktemp("tp2")
        common = ["--dtype", "float32", "--tp-size", "2"]
        for rank in (0, 1):
            module_daemons(
                tiny_model, run, *common, "--tp-rank", str(rank), "--device", f"cuda:{rank}"
            )
        out["tp2"] = f"{run}/daemon-0.sock,{run}/daemon-1.sock"
    return out


@pytest.fixture(scope="module")
def engines(
    tiny_model: Path, socks: dict[str, str], forkserver: ForkServerProc
) -> Iterator[dict[str, EngineProcess]]:
    model = ["--model", str(tiny_model)]
    gpu = [*model, "--device", "cuda:0"]
    specs = {
        "bf16": [*gpu, "--dtype", "bfloat16", "--daemons", socks["bf16"]],
        "bf16-disk": [*gpu, "--dtype", "bfloat16", "--allow-disk-fallback"],
        "fp8": [*gpu, "--dtype", "bfloat16", "--quantization", "fp8-block"]
        + ["--daemons", socks["fp8"]],
        "fp8-disk": [*gpu, "--dtype", "bfloat16", "--quantization", "fp8-block"]
        + ["--allow-disk-fallback"],
        "f32": [*gpu, "--dtype", "float32", "--daemons", socks["f32"]],
        "cpu-f32": [*model, "--device", "cpu", "--dtype", "float32", "--allow-disk-fallback"],
    }
    procs = {name: EngineProcess([*flags, "--name", name]) for name, flags in specs.items()}
    procs["bf16-forked"] = EngineProcess(specs["bf16"], forkserver=forkserver.sock)
    if TWO_GPUS:
        tp = [*model, "--dtype", "float32", "--world-size", "2", "--daemons", socks["tp2"]]
        tp += ["--dist-init", f"tcp://127.0.0.1:{free_port()}"]
        procs["tp0"] = EngineProcess([*tp, "--rank", "0", "--device", "cuda:0", "--name", "tp"])
        procs["tp1"] = EngineProcess(
            [*tp, "--rank", "1", "--device", "cuda:1"], port=procs["tp0"].port
        )
    try:
        for p in procs.values():
            p.wait_ready(180)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = json.dumps({"prompt_token_ids": prompt, "max_tokens": 12, **extra}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        choice: dict[str, Any] = json.loads(resp.read())["choices"][0]
    return choice


def ready(p: EngineProcess) -> dict[str, object]:
    assert p.ready is not None
    return p.ready


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_attached_engine_on_cuda_gives_the_tokens_of_a_disk_load(
    engines: dict[str, EngineProcess], name: str
) -> None:
    assert ready(engines[name])["weights"] == "daemon"
    assert ready(engines[f"{name}-disk"])["weights"] == "disk"
    for prompt in PROMPTS:
        got = complete(engines[name].url, prompt, ignore_eos=True)
        want = complete(engines[f"{name}-disk"].url, prompt, ignore_eos=True)
        assert len(got["token_ids"]) == 12 and got["token_ids"] == want["token_ids"]


def test_engine_forked_on_cuda_gives_the_tokens_of_an_execd_one(
    engines: dict[str, EngineProcess],
) -> None:
    forked, execd = ready(engines["bf16-forked"]), ready(engines["bf16"])
    assert forked["weights"] == "daemon"
    phases = forked["phases"]
    assert isinstance(phases, dict) and phases["context_init"] > 0  # CUDA began in the fork
    for prompt in PROMPTS:
        got = complete(engines["bf16-forked"].url, prompt, ignore_eos=True)
        assert (
            got["token_ids"] == complete(engines["bf16"].url, prompt, ignore_eos=True)["token_ids"]
        )
    assert execd["weights"] == "daemon"


def test_forked_restarts_on_cuda_take_the_warm_spare(
    tiny_model: Path, socks: dict[str, str], engines: dict[str, EngineProcess], tmp_path: Path
) -> None:
    """A fork server's spares (--spares auto: on for CUDA), bf16 then fp8: each second
    start of a kind is handed to the spare its first start made, and serves the tokens of
    an exec'd engine; a start with other settings forks afresh and replaces the spare."""
    server = ForkServerProc(tmp_path / "forkserver.sock")
    gpu = ["--model", str(tiny_model), "--device", "cuda:0", "--dtype", "bfloat16"]
    flags = {
        "bf16": [*gpu, "--daemons", socks["bf16"]],
        "fp8": [*gpu, "--quantization", "fp8-block", "--daemons", socks["fp8"]],
    }
    started: list[EngineProcess] = []
    try:
        server.wait_ready()
        for n, name in enumerate(["bf16", "bf16", "fp8", "fp8"]):
            e = EngineProcess(flags[name], forkserver=server.sock)
            started.append(e)
            phases = e.wait_ready(180)["phases"]
            assert (phases["spare"] > 0) == (n % 2 == 1), (name, n, phases)
            for prompt in PROMPTS:
                got = complete(e.url, prompt, ignore_eos=True)["token_ids"]
                assert got == complete(engines[name].url, prompt, ignore_eos=True)["token_ids"]
            server.wait_for('"event": "spare warm"', 180, count=n + 1)
        assert "another request's settings" in server.log  # fp8 replaced bf16's spare
    finally:
        for e in started:
            e.stop()
        server.stop()


def test_fp8_pool_is_used_on_cuda(engines: dict[str, EngineProcess]) -> None:
    fp8 = complete(engines["fp8"].url, PROMPTS[1], logprobs=1, ignore_eos=True)
    bf16 = complete(engines["bf16"].url, PROMPTS[1], logprobs=1, ignore_eos=True)
    assert fp8["logprobs"]["token_logprobs"] != bf16["logprobs"]["token_logprobs"]


def assert_same_generation(got: dict[str, object], want: dict[str, object], tol: float) -> None:
    assert got["token_ids"] == want["token_ids"]
    g, w = got["logprobs"], want["logprobs"]
    assert isinstance(g, dict) and isinstance(w, dict)
    assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=tol)


def test_cuda_float32_engine_agrees_with_the_cpu_engine(engines: dict[str, EngineProcess]) -> None:
    for prompt in PROMPTS:
        got = complete(engines["f32"].url, prompt, logprobs=5, ignore_eos=True)
        want = complete(engines["cpu-f32"].url, prompt, logprobs=5, ignore_eos=True)
        assert_same_generation(got, want, 1e-3)


@needs_two
def test_tp2_over_nccl_attached_gives_the_tokens_of_tp1(engines: dict[str, EngineProcess]) -> None:
    assert ready(engines["tp0"])["weights"] == "daemon"
    for prompt in PROMPTS:
        got = complete(engines["tp0"].url, prompt, logprobs=5, ignore_eos=True)
        want = complete(engines["f32"].url, prompt, logprobs=5, ignore_eos=True)
        assert_same_generation(got, want, 1e-3)


@pytest.mark.parametrize("name", ["f32", pytest.param("tp0", marks=needs_two)])
def test_a_stream_client_that_leaves_stops_its_generation_on_cuda(
    engines: dict[str, EngineProcess], name: str
) -> None:
    """Over NCCL both ranks stop at the same step: the next requests still match tp 1."""
    proc = engines[name]
    assert_leaving_stops(proc, leave_a_stream)
    for prompt in PROMPTS:
        got = complete(proc.url, prompt, logprobs=5, ignore_eos=True)
        want = complete(engines["f32"].url, prompt, logprobs=5, ignore_eos=True)
        assert_same_generation(got, want, 1e-3)


@needs_two
def test_nccl_group_stops_together(tiny_model: Path) -> None:
    """SIGTERM on rank 0 stops its follower cleanly; a follower whose rank 0 died exits."""
    common = ["--model", str(tiny_model), "--allow-disk-fallback", "--world-size", "2"]
    pairs = []
    for _ in range(2):
        tp = [*common, "--dist-init", f"tcp://127.0.0.1:{free_port()}"]
        lead = EngineProcess([*tp, "--rank", "0", "--device", "cuda:0"])
        follower = EngineProcess([*tp, "--rank", "1", "--device", "cuda:1"], port=lead.port)
        pairs.append((lead, follower))
    try:
        for lead, follower in pairs:
            lead.wait_ready(180)
            follower.wait_ready(180)
        (term_lead, term_follower), (kill_lead, kill_follower) = pairs
        term_lead.proc.terminate()
        kill_lead.proc.kill()
        assert (term_lead.wait_exit(30), term_follower.wait_exit(30)) == (0, 0)
        assert kill_follower.wait_exit(60) != 0
    finally:
        for pair in pairs:
            for p in pair:
                p.stop()


def test_supervisor_on_cuda_fails_over_and_survives_a_daemon_kill(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Primary kill -9 promotes the standby; daemon kill -9 leaves the engines serving from
    the GPU pool the keeper holds, and the hot spare adopts it."""
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        model={"dtype": "bfloat16"},
        devices={"ids": ["cuda:0"]},
        cache={"runtime_dir": str(tmp_path / "run"), "backend": "cuda-vmm"},
        engines={
            "command": ["{python}", "-m", "engine", "--device", "{device}"],
            "ready_timeout_s": 180,
        },
        heartbeat={"interval_ms": 100, "miss_limit": 5},
    )
    sup = Supervisor(policy)
    try:
        first = sup.wait_pair(240)
        daemon = sup.status()["daemons"][0]
        assert daemon["state"] == "serving"
        load = Load(sup.router, clients=4, prompt=None, prompt_token_ids=[1, 2], max_tokens=4)
        try:
            load.wait_ok(10, timeout=60)
            sup.kill_primary(first)
            load.wait_ok(10, timeout=60)
            mark = sup.tap.mark()
            os.kill(daemon["pid"], signal.SIGKILL)
            back = sup.wait(topic("daemon.0.serving"), timeout=120, after=mark)
            load.wait_ok(10, timeout=60)
        finally:
            load.stop()
        assert load.failures == [] and load.ok >= 30
        assert back.data["adopted"] is True
        assert back.data["fingerprint"] == daemon["fingerprint"]
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
