"""`python -m supervisor.fleet elect ...`: run one node's elector and print what it does.

One JSON line per change: `{"t": <monotonic s>, "event": ..., "node": ..., "role": ...,
"epoch": ..., "leader": ..., "lease_deadline": ...}`; SIGTERM or SIGINT leave the cluster
(the lease is revoked, so another node takes over at once). Exit 2 when joining is refused.

Example:
  python -m supervisor.fleet elect --etcd 127.0.0.1:2379 --cluster demo --node n1 \\
      --fingerprint abc123
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

import msgspec
import structlog

from supervisor.fleet.election import Elector
from supervisor.fleet.etcd import EtcdClient
from supervisor.fleet.roles import Change, StepDown
from supervisor.fleet_spec import ClusterSpec, cluster_errors


def _print(elector: Elector, change: Change) -> None:
    deadline = change.lease_deadline if isinstance(change, StepDown) else None
    line = {
        "t": time.monotonic(),
        "event": str(change),
        "node": elector.spec.node,
        "role": elector.role.value,
        "epoch": elector.epoch,
        "cluster_epoch": elector.cluster_epoch,
        "leader": elector.view.leader_node,
        "lease_deadline": deadline,
        "error": str(elector.error) if elector.error else None,
    }
    print(json.dumps(line), flush=True)


async def _elect(spec: ClusterSpec, fingerprint: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with (
        EtcdClient(spec.etcd, timeout_s=spec.renew_s) as etcd,
        Elector(etcd, spec, fingerprint, on_change=_print) as elector,
    ):
        failed = asyncio.create_task(elector.wait_for(lambda e: False, timeout=float("inf")))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            stopped.cancel()
            await asyncio.gather(failed, stopped, return_exceptions=True)
        if elector.error is not None:
            print(f"refused: {elector.error}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m supervisor.fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    elect = sub.add_parser("elect", help="run one node's elector, print its changes")
    elect.add_argument("--etcd", required=True, help="endpoints, comma-separated HOST:PORT")
    elect.add_argument("--cluster", required=True)
    elect.add_argument("--node", required=True)
    elect.add_argument("--fingerprint", required=True, help="the model's cache fingerprint")
    elect.add_argument("--ttl", type=int, dest="ttl_s", help="lease TTL, s (default 2)")
    elect.add_argument("--priority", type=int, help="higher runs (default 0)")
    elect.add_argument("--prefix", help="key prefix (default holdfast)")
    args = parser.parse_args(argv)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    given = {k: getattr(args, k) for k in ("ttl_s", "priority", "prefix")}
    spec = msgspec.convert(
        {"name": args.cluster, "etcd": args.etcd.split(","), "node": args.node}
        | {k: v for k, v in given.items() if v is not None},
        ClusterSpec,
    )
    errors = cluster_errors(spec, 0.0)
    if errors:
        parser.error("; ".join(errors))
    return asyncio.run(_elect(spec, args.fingerprint))


if __name__ == "__main__":
    sys.exit(main())
