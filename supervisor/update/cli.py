"""`supervisor update --model DIR`, `supervisor refit --model DIR` and `supervisor
rollback`: a rolling model update, or a refit in place, over the control socket
(supervisor/update/rollout.py and refit.py do them; docs/update.md)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from holdfast_contract.control import (
    ControlReply,
    ControlRequest,
    RefitReq,
    RollbackReq,
    StatusReq,
    UpdateReq,
    UpdateStatus,
)
from holdfast_contract.formats import DTYPES, QUANTIZATIONS

Request = Callable[[str, ControlRequest], ControlReply]
DONE = frozenset({"finished", "rolled-back"})
UPDATE = """Update the served model without a stop: the next version's cache daemons load
DIR beside the pool that serves, standbys of the new version start on it and warm (and
answer update.smoke, if the policy names one), then the primary's place passes to one of
them in one fenced, epoch-raising step. Requests in flight on the old primary finish
there (update.drain_s); the old standbys retire, batch engines restart on the new pool,
and the old pool is freed after update.keep_old_s (until then `supervisor rollback`
switches back). A new version not ready within update.ready_timeout_s, or that fails its
smoke request, is rolled back with nothing lost. Refused before anything changes: an
update under way, a DIR that is no checkpoint, or one of another architecture or other
shapes, and a second pool that does not fit beside the one that serves: on each device,
both pools (the new one sized from DIR's safetensors headers), the engines' memory_mb and
the new version's engines against devices.capacity_mb, or what the device has (GPU:
nvidia-smi; CPU: /proc/meminfo, cgroup limit). The reply says it with the numbers. With
update.free_standby_kv, an update that fits only so stops the old standbys first (no
standby to fail over to until the switch). Every answer names its version
(X-Holdfast-Model-Version); docs/update.md."""
REFIT = """Switch every engine to new weights of the same names and shapes without a restart
(a trainer's step): the next generation of cache daemons loads DIR beside the pool that
serves; the standbys map it in place of the old one at once; the primary's place passes
to a refitted standby in one fenced, epoch-raising step; the old primary finishes its
requests in flight on the old weights (update.drain_s), then refits and stands by again;
batch engines refit once their requests are done. An answer is never made by two
versions. An engine that cannot refit in time restarts on the new pool. The old pool is
freed after update.keep_old_s. Refused before anything changes: an update or refit under
way, engines that do not refit in place (another kind, tensor parallel), a DIR of other
names or shapes, a second pool that does not fit in memory (the reply has the numbers)."""
ROLLBACK = """Before the switch: stop the new version (its engines and pool; the old version
served throughout). After it, while the old pool is kept (update.keep_old_s): switch back
to it the way an update switches."""


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> list[argparse.ArgumentParser]:
    """The `update` and `rollback` subcommands; the parsers made (they take the runtime
    dir's flags like every control command)."""
    up = sub.add_parser(
        "update",
        help="roll the crew over to another checkpoint of the same model, without a stop",
        description=UPDATE,
        epilog="example: supervisor update --model /models/tiny-v2 --wait --policy policies/demo.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument(
        "--model", required=True, metavar="DIR", help="the next version's checkpoint dir"
    )
    up.add_argument("--dtype", choices=DTYPES, help="hold it as (default: as now)")
    up.add_argument("--quantization", choices=QUANTIZATIONS, help="(default: as now)")
    up.add_argument(
        "--wait",
        action="store_true",
        help="until the update finished (exit 0) or was rolled back (exit 1)",
    )
    fit = sub.add_parser(
        "refit",
        help="switch every engine to new weights of the same shapes in place, without a restart",
        description=REFIT,
        epilog="example: supervisor refit --model /ckpt/step-1200 --wait --policy policies/demo.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fit.add_argument(
        "--model", required=True, metavar="DIR", help="the new weights' checkpoint dir"
    )
    fit.add_argument(
        "--wait",
        action="store_true",
        help="until every engine serves them (exit 0) or the refit was rolled back (exit 1)",
    )
    back = sub.add_parser(
        "rollback",
        help="undo the update under way, or the last one while its old pool is kept",
        description=ROLLBACK,
        epilog="example: supervisor rollback --runtime-dir /tmp/holdfast-demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    back.add_argument("--wait", action="store_true", help="until it is done (exit 0)")
    return [up, fit, back]


def command(args: argparse.Namespace, endpoint: str, request: Request) -> int:
    """Send the update or the rollback; with --wait, follow it to its end."""
    req: ControlRequest = (
        UpdateReq(os.path.abspath(args.model), args.dtype, args.quantization)
        if args.cmd == "update"
        else RefitReq(os.path.abspath(args.model))
        if args.cmd == "refit"
        else RollbackReq()
    )
    reply = request(endpoint, req)
    if not reply.ok:
        print(f"supervisor: {reply.message}", file=sys.stderr)
        return 1
    print(reply.message)
    if not args.wait:
        return 0
    st = _until_done(endpoint, request)
    print(f"{st.kind} {st.state}: version {st.version_to or st.version_from}{_detail(st)}")
    wanted = "rolled-back" if args.cmd == "rollback" else "finished"
    return 0 if st.state == wanted else 1


def _until_done(endpoint: str, request: Request) -> UpdateStatus:
    """The update's status once it finished or was rolled back (asked twice a second)."""
    while True:
        status = request(endpoint, StatusReq()).status
        st = status.update if status is not None else None
        if st is not None and st.state in DONE:
            return st
        time.sleep(0.5)


def line(st: UpdateStatus) -> str:
    """The update's line under `supervisor status`'s tables."""
    to = f" to version {st.version_to}" if st.version_to else ""
    keep = ""
    if st.keep_until is not None and st.state == "keeping":
        keep = f", old pool freed in {max(0.0, st.keep_until - time.time()):.0f} s"
    return f"{st.kind} {st.state}: {st.model}{to} (from {st.version_from}){keep}{_detail(st)}"


def _detail(st: UpdateStatus) -> str:
    return f": {st.detail}" if st.detail else ""
