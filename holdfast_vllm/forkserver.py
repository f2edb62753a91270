"""A fork server for vLLM API servers: one process pays for vLLM's imports, each engine is a
fork of it.

    python -m holdfast_vllm.forkserver --socket /run/holdfast/vllm-forkserver.sock

It runs in the vLLM venv. It imports what `python -m vllm.entrypoints.openai.api_server`
imports, and what that server's EngineCore imports, then serves the requests of
`holdfast_contract.forkserver` with holdfast_fork's server (the same requests, fds,
owner watch and exit reports as the reference engine's fork server; no spares). Each fork
runs the API server module as `python -m` would, with the flags the request carries.

With `HOLDFAST_VLLM_FORK=1` in the request's environment (the supervisor sets it for every
vLLM engine) the API server forks its EngineCore too (holdfast_vllm.core_fork.fork_engine_core):
then neither process of an engine imports vLLM, and a start is the engine's own work only
(config, building the model, the attach, the KV cache). Without it the EngineCore is
spawned as vLLM does on the CPU and imports vLLM again.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

MODULE = "vllm.entrypoints.openai.api_server"
# the API server's imports, then what its EngineCore imports when it starts with the worker
# inside EngineCore (--distributed-executor-backend uni), on any platform. None of them may
# initialize CUDA, which a fork could then not use: main() checks.
PRELOAD = (
    MODULE,
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "holdfast_vllm.loader",
)
# the CPU worker, only where vLLM's platform is the CPU: importing it patches torch for a
# machine without an accelerator (vllm.v1.worker.cpu.shm makes Tensor.pin_memory a no-op and
# replaces torch.cuda's Stream and Event), and every fork of a CUDA machine's server would
# inherit that (its sampler's Triton kernel then died on a seeds tensor that was no device
# memory, on an H100)
CPU_PRELOAD = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner")
# what a CUDA engine imports later, as it builds its worker, model runner and attention
# backend and loads its compiled graph (Inductor, Triton), only where vLLM's platform is
# CUDA. Should one of them initialize CUDA or replace one of TORCH_KEPT here, the server
# starts again without them (main), as it was before they were added
CUDA_PRELOAD = (
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.vllm_flash_attn",
    "vllm.v1.sample.sampler",
    "vllm.compilation.backends",
    "vllm.compilation.caching",
    "vllm.compilation.piecewise_backend",
    "vllm.compilation.cuda_graph",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "triton",
)
NO_CUDA_PRELOAD = "HOLDFAST_VLLM_NO_CUDA_PRELOAD"  # set when main() starts again without it
# what a CUDA engine needs of torch as torch made it; main() refuses to serve on a non-CPU
# platform when the imports replaced one of them by what an exec'd engine would not have
TORCH_KEPT = (
    ("Tensor", "pin_memory"),
    ("cuda", "Stream"),
    ("cuda", "Event"),
    ("cuda", "current_stream"),
    ("cuda", "set_stream"),
    ("accelerator", "synchronize"),
)

log = structlog.get_logger("holdfast_vllm.forkserver")


def preload() -> tuple[float, list[str]]:
    """Import PRELOAD, and CPU_PRELOAD or CUDA_PRELOAD by vLLM's platform; the seconds taken
    and what could not be imported (a vLLM version without one of them: its forks import
    it themselves, slower)."""
    t0 = time.perf_counter()
    missing = []
    names = list(PRELOAD)
    importlib.import_module(MODULE)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        names += CPU_PRELOAD
    elif current_platform.is_cuda() and os.environ.get(NO_CUDA_PRELOAD) != "1":
        names += CUDA_PRELOAD
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name}: {e}")
    return time.perf_counter() - t0, missing


def torch_as_found() -> dict[str, object]:
    """torch's TORCH_KEPT attributes as they are now (imports torch)."""
    import torch

    return {f"torch.{a}.{b}": getattr(getattr(torch, a), b, None) for a, b in TORCH_KEPT}


# modules whose patches of torch every vLLM engine has, exec'd or forked, on every platform:
# vllm.utils.torch_utils wraps torch.cuda.set_stream to keep track of the current stream (an
# H100's fork server that counted it refused to serve)
EVERY_ENGINE = ("vllm.utils.torch_utils",)


def torch_replaced(before: dict[str, object]) -> list[str]:
    """Which of torch's TORCH_KEPT attributes differ from `before` (torch_as_found()), by
    what a module other than EVERY_ENGINE put there."""
    return [
        name
        for name, now in torch_as_found().items()
        if now is not before[name] and getattr(now, "__module__", None) not in EVERY_ENGINE
    ]


def warm(model: str) -> tuple[float, list[str]]:
    """Load `model`'s tokenizer, and the chat template its API server looks up, into vLLM's
    own caches (the lru_caches of vllm.tokenizers.registry and
    vllm.transformers_utils.processor), asked with the arguments an API server started
    with `--model model` and no tokenizer flags asks them with: each fork then finds them
    loaded. A forked API server on an H100 loaded its tokenizer before its EngineCore
    started and again, through the processor, after it was ready. An engine started with
    other tokenizer flags misses these caches and loads its own, as without them. The
    seconds taken and what could not be warmed."""
    from types import SimpleNamespace

    t0 = time.perf_counter()
    failed = []
    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(
            SimpleNamespace(  # the ModelConfig fields it reads, as vLLM's defaults set them
                skip_tokenizer_init=False,
                hf_config=None,
                tokenizer=model,
                runner_type="generate",
                tokenizer_mode="auto",
                tokenizer_revision=None,
                trust_remote_code=False,
            )
        )
    except Exception as e:  # the fork then loads it itself
        return time.perf_counter() - t0, [f"tokenizer: {type(e).__name__}: {e}"]
    try:
        from vllm.renderers.hf import resolve_chat_template

        model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type")
        config = SimpleNamespace(
            model=model,
            tokenizer=model,
            tokenizer_revision=None,
            revision=None,
            code_revision=None,
            trust_remote_code=False,
            hf_config=SimpleNamespace(model_type=model_type),
        )
        resolve_chat_template(tokenizer, None, None, model_config=config)
    except Exception as e:
        failed.append(f"chat template: {type(e).__name__}: {e}")
    return time.perf_counter() - t0, failed


def cuda_initialized() -> bool:
    """Whether this process has a CUDA context (torch's view), which forks must not inherit."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def cuda_driver_initialized() -> bool | None:
    """Whether the CUDA driver was initialized (cuInit) in this process, by anything, torch
    or not; None without a driver. Asking does not initialize it: cuDeviceGetCount answers
    CUDA_ERROR_NOT_INITIALIZED until cuInit ran. Logged at start: a driver that the imports
    initialized here is one way forks go wrong (not the one seen on an H100, where it was
    not initialized and the CPU worker's torch patches were: CPU_PRELOAD)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int()
    return bool(lib.cuDeviceGetCount(ctypes.byref(count)) == 0)


def run_api_server(argv: list[str], t0: float, spare_ms: float) -> int:
    """In a fork: vLLM's API server with `argv`, as `python -m MODULE argv...` runs it."""
    import os

    from holdfast_vllm import core_fork

    if os.environ.get(core_fork.FORK_ENV) == "1":  # vLLM loaded its plugins here already,
        core_fork.fork_engine_core()  # in this server, whose environment did not ask it
    sys.argv = [MODULE, *argv]  # run_module puts the module's file first, as -m does
    try:
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            return 0
        return e.code if isinstance(e.code, int) else 1
    return 0


def again_without_cuda_preload(driver: bool | None, replaced: list[str]) -> None:
    """This server, started again in place (same pid) without CUDA_PRELOAD, which did what
    a fork cannot inherit."""
    what = [*(["the CUDA driver"] if driver else []), *replaced] or ["a CUDA context"]
    log.warning("starting again without the CUDA preload", initialized_or_replaced=what)
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[NO_CUDA_PRELOAD] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "holdfast_vllm.forkserver", *sys.argv[1:]])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m holdfast_vllm.forkserver",
        description="Import vLLM's API server once; fork one per request.",
        epilog="example:\n  python -m holdfast_vllm.forkserver --socket /tmp/run/vllm.sock",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--socket", required=True, type=Path, help="unix socket to listen on")
    p.add_argument(
        "--warm-model",
        metavar="DIR",
        help="load this checkpoint's tokenizer and chat template before forking (warm())",
    )
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    args = p.parse_args(argv)
    from holdfast_contract import logs
    from holdfast_fork.errors import ForkError
    from holdfast_fork.listener import bind
    from holdfast_fork.server import Server

    logs.setup(args.log_format)
    # torch.cuda.is_available() (which imports ask) from NVML, not from cudaGetDeviceCount:
    # that one runs cuInit, and a fork of a process whose driver is initialized cannot use
    # CUDA
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        torch_before = torch_as_found()
        seconds, missing = preload()
    except ImportError as e:
        print(
            f"holdfast_vllm.forkserver: error: cannot import {MODULE} ({e}); run it with the "
            "python of a venv that has vLLM (bash scripts/install-vllm.sh)",
            file=sys.stderr,
        )
        return 2
    for what in missing:
        log.warning("not preloaded", module=what)
    from vllm.platforms import current_platform

    cuda_preload = current_platform.is_cuda() and os.environ.get(NO_CUDA_PRELOAD) != "1"
    driver = cuda_driver_initialized()
    replaced = torch_replaced(torch_before)
    if cuda_preload and (cuda_initialized() or driver or replaced):
        again_without_cuda_preload(driver, replaced)  # does not return
    if cuda_initialized() or driver:
        what = "a CUDA context" if cuda_initialized() else "the CUDA driver (cuInit)"
        print(
            f"holdfast_vllm.forkserver: error: importing vLLM initialized {what} here, which "
            "a forked engine cannot use; set engines.forkserver: false in the policy",
            file=sys.stderr,
        )
        return 2
    if replaced and not current_platform.is_cpu():
        print(
            f"holdfast_vllm.forkserver: error: importing vLLM replaced {', '.join(replaced)} "
            f"here, which a forked engine on {current_platform.device_name} would run with; "
            "set engines.forkserver: false in the policy",
            file=sys.stderr,
        )
        return 2
    warm_s, not_warmed = warm(args.warm_model) if args.warm_model else (0.0, [])
    for what in not_warmed:
        log.warning("not warmed", what=what)
    try:
        server = Server(bind(args.socket), run_api_server)
    except ForkError as e:
        print(f"holdfast_vllm.forkserver: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info(
        "forkserver ready",
        socket=str(args.socket),
        preload_s=round(seconds, 3),
        cuda_preload=cuda_preload,
        warm_s=round(warm_s, 3),
        cuda_driver_initialized=driver,
        platform=current_platform.device_name,
        torch_replaced=",".join(replaced) or "none",
    )
    try:
        server.loop()
    finally:
        args.socket.unlink(missing_ok=True)
        # nothing is left to save, and finalizing an interpreter that has imported vLLM
        # takes seconds (a stop would wait them out, then SIGKILL): leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
