"""The reference engine's fork server: `python -m engine.forkserver --socket PATH`.

It imports everything an engine imports (torch, aiohttp, the model code; never CUDA), then
serves `holdfast_contract.forkserver`'s requests with holdfast_fork's server: each engine is
a fork that runs `python -m engine` from the request's flags on, its startup clock started
at the fork. After forking an engine of one rank it forks a spare for the next request like
it (engine.spare). This module imports without torch; only `preload` loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from engine import spare
from engine.errors import EngineError
from holdfast_contract.forkserver import Spawn
from holdfast_fork.errors import ForkError
from holdfast_fork.listener import bind
from holdfast_fork.server import Server
from holdfast_fork.spares import Spares

log = structlog.get_logger("engine.forkserver")

PRELOAD = ("engine.app", "engine.model", "engine.runner", "engine.weights", "engine.hf")


def run_engine(argv: list[str], t0: float, spare_ms: float) -> int:
    """`python -m engine` with `argv`, its startup clock started at `t0`."""
    sys.argv = [sys.executable, "-m", "engine", *argv]
    from engine.cli import main

    try:
        return main(argv, t0=t0, spare_ms=spare_ms)
    except SystemExit as e:  # argparse: --help, or a usage error
        return e.code if isinstance(e.code, int) else 2


def spares(mode: str) -> Spares:
    """The reference engine's spares (engine.spare), made as `--spares` says."""
    return Spares(
        key=functools.partial(spare.key, mode=mode), warm=functools.partial(spare.warm, mode=mode)
    )


def keep_tokenizer(spawn: Spawn) -> None:
    """After a request: its model's tokenizer read here (engine.tokenizer keeps it), so
    each later fork of an engine of that model finds it read (0.1 s of llama-8b's start)."""
    cfg = spare.config(spawn)
    if cfg is not None:
        from engine.tokenizer import load_tokenizer

        load_tokenizer(Path(spawn.cwd) / cfg.model, keep=True)  # the engine's dir: its cwd


def prepare_kernels(kernels: list[Any]) -> None:
    """What a fork would otherwise do at its first Triton launch without needing the GPU,
    done once here for every fork: hash Triton's own library into its cache key (reads
    the whole library: slow), import the compiler modules its first compile imports, and hash each
    kernel's source. A launch after the fork then only loads the compiled kernel from
    Triton's disk cache. Older or newer Triton without these names: skipped, just slower."""
    with contextlib.suppress(ImportError, AttributeError):
        from triton.runtime.cache import triton_key

        triton_key()
    for name in ("triton.compiler.compiler", "triton.experimental.gluon"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for k in kernels:
        with contextlib.suppress(AttributeError, RuntimeError):
            _ = k.cache_key


def preload() -> float:
    """Import what an engine imports; seconds taken. CUDA must stay uninitialized."""
    t0 = time.perf_counter()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as e:  # engine.hf needs the `hf` extra; engines import it lazily
            if name != "engine.hf":
                raise EngineError(f"cannot preload {name}: {e}") from e
    import torch

    from engine import fused, gemv, paged_decode, sampling

    if paged_decode.triton_ready():  # loading Triton's library holds the GIL for long: here,
        prepare_kernels(
            [
                paged_decode._kernel(),
                gemv._kernel(),
                *fused._kernels().values(),
                *sampling._kernels().values(),
            ]
        )  # not in an
        # engine whose heartbeats would stall; none of it touches the GPU
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise EngineError("CUDA was initialized while preloading; forks could not use it")
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.forkserver",
        description="Import the engine once; fork a ready-to-run engine per request.",
        epilog="example:\n  python -m engine.forkserver --socket /tmp/run/forkserver.sock",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--socket", required=True, type=Path, help="unix socket to listen on")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument(
        "--spares",
        choices=spare.MODES,
        default="auto",
        help="after forking an engine of one rank, fork a spare that makes its CUDA context "
        "and loads its kernels ahead, for the next request like it (auto: CUDA devices only; "
        "ready: any device, and the spare also attaches the weights, allocates the KV cache, "
        "warms up and captures its CUDA graphs, so a claim only starts serving)",
    )
    args = p.parse_args(argv)
    from holdfast_contract import logs

    logs.setup(args.log_format)
    try:
        seconds = preload()
        server = Server(bind(args.socket), run_engine, spares(args.spares), keep_tokenizer)
    except (EngineError, ForkError) as e:
        print(f"engine.forkserver: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("forkserver ready", socket=str(args.socket), preload_s=round(seconds, 3))
    try:
        server.loop()
    finally:
        server.close_spares()
        args.socket.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
