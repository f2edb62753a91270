"""`supervisor` (also `python -m supervisor`): run, validate, status, promote, evict, restart,
stop, update, rollback."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from holdfast_contract import logs
from holdfast_contract.control import (
    CrewStatus,
    EvictReq,
    PromoteReq,
    RestartReq,
    StatusReq,
    StopReq,
    Wanted,
)
from holdfast_contract.errors import HoldfastError
from supervisor.control import request
from supervisor.errors import ControlError, PolicyError
from supervisor.policy import Policy
from supervisor.policy_file import load_policy
from supervisor.update import cli as update_cli
from supervisor.update import memory

EXAMPLES = """examples:
  supervisor run                          # the demo policy: tiny CPU model, 1+1+1 engines
  supervisor run policies/h200.yaml
  supervisor validate policies/tp2.yaml
  supervisor validate --schema-only policies/*.yaml   # written for another machine
  supervisor status --json
  supervisor status --cluster --policy node-a.yaml      # every node of its cluster
  supervisor promote e2 --policy policies/h200.yaml
  supervisor evict batch-1 --runtime-dir /tmp/holdfast-demo
  supervisor restart batch-1
  supervisor update --model /models/tiny-v2 --wait  # a rolling model update
  supervisor rollback
  supervisor stop
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="supervisor",
        description="Supervise cache daemons and a crew of engines: one "
        "primary, warm standbys, batch engines; fail over in milliseconds.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser(
        "run",
        help="run a policy until SIGINT/SIGTERM or `supervisor stop`",
        description="Run a policy until SIGINT/SIGTERM or `supervisor stop`. With a "
        "`cluster:` section the node joins its cluster through etcd: one node leads and "
        "serves; the others' routers forward to it (docs/fleet.md). Exits 1 if the "
        "cluster refuses it (node name taken, another model).",
        epilog="example: supervisor run policies/demo.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("policy", nargs="?", help="policy YAML (default: the demo policy)")
    val = sub.add_parser(
        "validate",
        help="check policies; print every error with its path",
        description="Check policies; print every error with its path (exit 2). Without "
        "--schema-only, also whether a rolling update could hold two pools at once on each "
        "device (`update memory:`, with the numbers: both pools sized from the checkpoint's "
        "headers, the engines' memory_mb, the device's total or devices.capacity_mb); a "
        "policy that does not fit is still valid (exit 0), its updates are refused.",
        epilog="example: supervisor validate --schema-only policies/*.yaml",
    )
    val.add_argument("policy", nargs="*", help="policy YAML files (default: the demo policy)")
    val.add_argument(
        "--schema-only",
        action="store_true",
        help="check keys, types and rules between them, not this machine "
        "(skips whether model.path holds a checkpoint)",
    )
    control = [*update_cli.add_parsers(sub)]
    for name, text in (
        (
            "status",
            "show the cluster: epoch, primary, engines (and what is wanted of each), daemons",
        ),
        ("promote", "make a ready standby the primary (fences the old one)"),
        ("evict", "evict a batch engine until `restart NAME`"),
        ("restart", "kill and restart an engine (clears quarantine)"),
        ("stop", "stop the supervisor and everything it runs"),
    ):
        c = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=f"example: supervisor {name}"
            + (" e2" if name in ("promote", "restart") else "")
            + (" batch-1" if name == "evict" else "")
            + " --runtime-dir /tmp/holdfast-demo",
        )
        if name in ("promote", "evict", "restart"):
            c.add_argument("name", help="engine name, as `supervisor status` lists it")
        if name == "status":
            c.add_argument("--json", action="store_true", help="print JSON instead of a table")
            c.add_argument(
                "--cluster",
                action="store_true",
                help="with a `cluster:` policy: every node of the cluster, its role, epoch "
                "and lease age. Read from this node's health API (GET /cluster at "
                "api.listen of --policy, or --api), which lists the nodes registered in "
                "etcd; each node's role, epoch and lease age come from that node's own "
                "health API (its address from its registration)",
            )
            c.add_argument("--api", help="with --cluster: this node's health API, HOST:PORT")
        control.append(c)
    for c in control:
        where = c.add_mutually_exclusive_group()
        where.add_argument("--policy", help="find the runtime dir from this policy")
        where.add_argument("--runtime-dir", help="the supervisor's runtime dir")
    return p


def _endpoint(args: argparse.Namespace) -> str:
    run = args.runtime_dir or load_policy(args.policy).cache.runtime_dir
    try:
        is_dir = stat.S_ISDIR(os.stat(run).st_mode)
    except FileNotFoundError:
        is_dir = True  # not there: `request` says no supervisor runs on it
    except NotADirectoryError:
        is_dir = False
    if not is_dir:
        fix = (
            "give --runtime-dir the dir `supervisor run` uses (its policy's "
            "cache.runtime_dir), or pass --policy"
            if args.runtime_dir
            else f"set cache.runtime_dir in {args.policy or 'the policy'} to a directory"
        )
        raise ControlError(f"runtime dir {run} is not a directory; {fix}")
    if os.path.exists(os.path.join(run, "control")) and not _lock_held(run):
        raise ControlError(
            f"no supervisor runs on {run}: none holds its lock (supervisor.lock), and the "
            "sockets there are a killed one's; start one with `supervisor run` (it clears "
            "them), or pass the right --policy/--runtime-dir"
        )
    return f"ipc://{run}/control"


def _lock_held(run: str) -> bool:
    """Whether a live process holds the flock on `<run>/supervisor.lock`, as /proc/locks
    lists it (the kernel drops it when its holder dies, however it dies). Asked without
    taking the lock, so a supervisor starting at this moment is never refused; True when
    it cannot be told."""
    try:
        st = os.stat(os.path.join(run, "supervisor.lock"))
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:
        return True
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(
        fields[1] == "FLOCK" and inode in fields
        for fields in (line.split() for line in table.splitlines())
        if len(fields) > 5
    )


def _print_status(st: CrewStatus, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.encode(st).decode() + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    served = f", version {st.version}" if st.version else ""
    t = Table(title=f"epoch {st.epoch}, primary {st.primary or '-'}{served}")
    for col in ("name", "role", "state", "version", "pid", "port", "restarts", "heartbeat ms"):
        t.add_column(col)
    t.add_column("load")
    for e in st.engines:
        age = "-" if e.heartbeat_age_ms is None else f"{e.heartbeat_age_ms:.0f}"
        t.add_row(
            e.name,
            e.role,
            e.state,
            e.version or "-",
            str(e.pid or "-"),
            str(e.port or "-"),
            str(e.restarts),
            age,
            str(e.in_flight),
        )
    d = Table(title="cache daemons")
    for col in ("rank", "state", "pid", "pool bytes", "adoptions", "fingerprint"):
        d.add_column(col)
    for x in st.daemons:
        d.add_row(
            str(x.rank),
            x.state,
            str(x.pid or "-"),
            str(x.pool_bytes),
            str(x.adoptions),
            x.fingerprint[:16],
        )
    console = Console()
    changed = [x for x in st.daemons if x.checkpoint_changed]
    console.print(t)
    now = time.time()
    for e in st.engines:  # (one line each: the table has no room for them)
        if e.wanted is not None and e.wanted.reason != "policy":
            console.print(
                _why(e.name, e.wanted, now), highlight=False, markup=False, soft_wrap=True
            )
    console.print(d)
    if st.update is not None:
        console.print(update_cli.line(st.update), highlight=False, markup=False, soft_wrap=True)
    for x in changed:
        console.print(
            f"daemon {x.rank}: the checkpoint changed on disk since its pool was loaded "
            f"({'; '.join(x.checkpoint_changed)}); engines started now refuse the pool or "
            "load from disk until the daemon loads it again",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def _why(name: str, w: Wanted, now: float) -> str:
    """What the rules want of engine `name` and why, when more than the policy says so:
    `batch-1 wanted running: backoff, 1.2 s left: restart backoff (restart.*)`."""
    left = f", {max(0.0, w.until - now):.1f} s left" if w.until is not None else ""
    return f"{name} wanted {w.state}: {w.reason}{left}: {w.detail}"


def _command(args: argparse.Namespace) -> int:
    if getattr(args, "cluster", False):
        from supervisor.fleet.status import print_cluster

        api = args.api or load_policy(args.policy).api.listen
        return print_cluster(api, bool(args.json))
    endpoint = _endpoint(args)
    if args.cmd in ("update", "refit", "rollback"):
        return update_cli.command(args, endpoint, request)
    reqs = {"status": StatusReq, "stop": StopReq}
    named = {"promote": PromoteReq, "evict": EvictReq, "restart": RestartReq}
    req = reqs[args.cmd]() if args.cmd in reqs else named[args.cmd](name=args.name)
    reply = request(endpoint, req)
    if not reply.ok:
        print(f"supervisor: {reply.message}", file=sys.stderr)
        return 1
    if reply.status is not None:
        _print_status(reply.status, bool(getattr(args, "json", False)))
    elif reply.message:
        print(reply.message)
    return 0


def _validate(paths: list[str], schema_only: bool) -> int:
    """Check each policy; 2 if any is invalid (each error printed with its path)."""
    code = 0
    todo: list[str | None] = [*paths] if paths else [None]  # none given: the demo policy
    for path in todo:
        try:
            policy = load_policy(path, schema_only=schema_only)
        except PolicyError as e:
            _print_policy_error(e)
            code = 2
            continue
        print(
            f"{policy.source}: ok{', schema only' if schema_only else ''} (model "
            f"{policy.model.path or policy.model.preset}, 1 primary + "
            f"{policy.engines.standby} standby + "
            f"{sum(b.count for b in policy.engines.batch)} batch, runtime dir "
            f"{policy.cache.runtime_dir})"
        )
        if not schema_only:
            for line in memory.report(policy, _checkpoint(policy)):
                print(f"  {line}")
    return code


def _checkpoint(policy: Policy) -> Path | None:
    """The policy's checkpoint dir: model.path, or its preset's once generated."""
    if policy.model.path is not None:
        return Path(policy.model.path)
    from supervisor.service import generated, models_cache

    out = models_cache() / f"{policy.model.preset}-seed{policy.model.seed}"
    return out if generated(out) else None


def _print_policy_error(e: PolicyError) -> None:
    print(f"{e.source}: invalid policy", file=sys.stderr)
    for line in e.errors:
        print(f"  {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """`supervisor ...`; a reader that stops early (`supervisor status | head`) ends it
    quietly, as it ends any Unix tool, with SIGPIPE's exit status."""
    try:
        try:
            code = _main(argv)
        finally:  # also on `--help`'s SystemExit
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 128 + signal.SIGPIPE
    return code


def _main(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "validate":
            return _validate(args.policy, args.schema_only)
        if args.cmd == "run":
            policy = load_policy(args.policy)
            logs.setup(policy.log.format, policy.log.level)
            from supervisor.service import Service

            return asyncio.run(Service(policy).run())
        return _command(args)
    except PolicyError as e:
        _print_policy_error(e)
        return 2
    except HoldfastError as e:
        print(f"supervisor: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
