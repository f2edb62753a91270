"""`chaos run SCENARIO.yaml`: faults under load, a report, and an exit code from the checks."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
from pathlib import Path

import msgspec

from chaos import report
from chaos.checks import RUN_METRICS, STATS, TRIAL_METRICS
from chaos.errors import ChaosError, ScenarioError
from chaos.preflight import preflight
from chaos.report import Results
from chaos.runner import RunOptions, run, write_report
from chaos.scenario import FAULTS, Plan, load_scenario
from holdfast_contract import logs

EPILOG = """\
examples:
  chaos run chaos/scenarios/smoke.yaml --out /tmp/chaos-smoke
  chaos run chaos/scenarios/soak.yaml --max-faults 300 --out bench/results/soak
  chaos run my.yaml --policy policies/demo.yaml --attach     # a supervisor already running it
  chaos validate chaos/scenarios/gpu.yaml --schema-only   # anywhere: model files not looked for
  chaos report /tmp/chaos-smoke        # report.md and plots again from its results.json

exit status: 0 every check passed; 1 a check failed or the run stopped early;
2 the scenario or its policy is unusable (nothing was started); 130 interrupted (Ctrl-C).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaos",
        description="Inject faults into a supervised engine pool under load and measure recovery.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser(
        "run",
        help="run a scenario and write its report",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _run_arguments(run_p)
    val_p = sub.add_parser(
        "validate",
        help="check a scenario and its policies, start nothing",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _plan_arguments(val_p)
    val_p.add_argument(
        "--schema-only",
        action="store_true",
        help="check the scenario and its policies' shape and rules, not the model files",
    )
    sub.add_parser("kinds", help="list fault kinds, metrics and statistics")
    rep_p = sub.add_parser("report", help="write report.md and the plots again from results.json")
    rep_p.add_argument("dir", type=Path, help="a run's --out dir (holds results.json)")
    return parser


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", type=Path, help="scenario YAML (see chaos/scenarios/)")
    parser.add_argument(
        "--policy", type=Path, help="policy YAML for every stage, instead of the scenario's own"
    )
    parser.add_argument("--trials", type=int, help="trials per fault, instead of the scenario's")
    parser.add_argument("--seed", type=int, help="seed for the fault order and the load")
    parser.add_argument(
        "--max-faults",
        type=int,
        help="stop after the first N faults of the drawn order (a shorter soak)",
    )


def _run_arguments(run_p: argparse.ArgumentParser) -> None:
    _plan_arguments(run_p)
    run_p.add_argument(
        "--out", type=Path, default=Path("chaos-out"), help="report dir (default: ./chaos-out)"
    )
    run_p.add_argument(
        "--attach",
        action="store_true",
        help="drive a supervisor that already runs --policy instead of starting one",
    )
    run_p.add_argument("--no-progress", action="store_true", help="no progress bar")
    run_p.add_argument("-v", "--verbose", action="store_true", help="log every fault and event")


def main(argv: list[str] | None = None) -> int:
    """`chaos ...`; a reader that stops early (`chaos kinds | head`) ends it quietly, as it
    ends any Unix tool, with SIGPIPE's exit status."""
    try:
        try:
            code = _main(argv)
        finally:  # also on `--help`'s SystemExit
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 128 + signal.SIGPIPE
    return code


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "kinds":
        return _kinds()
    if args.command == "report":
        return _rerender(args.dir)
    try:
        plan = load_scenario(
            args.scenario, trials=args.trials, seed=args.seed, max_faults=args.max_faults
        )
        if args.command == "validate":
            preflight(plan, args.policy, schema_only=args.schema_only)
            print(f"{args.scenario}: ok, {plan.total_faults} faults, {len(plan.checks)} checks")
            return 0
        opts = RunOptions(
            out=args.out,
            command=shlex.join(["chaos", *(argv if argv is not None else sys.argv[1:])]),
            policy=args.policy,
            attach=args.attach,
            progress=not args.no_progress,
        )
        preflight(plan, opts.policy, attached=opts.attach)
        if plan.scenario.fleet is not None and opts.attach:
            raise ChaosError("a fleet scenario builds its own fleet; drop --attach")
    except ScenarioError as exc:
        count = len(exc.problems)
        print(f"chaos: {count} problem{'s' if count > 1 else ''}:", file=sys.stderr)
        print("\n".join(f"  {p}" for p in exc.problems), file=sys.stderr)
        return 2
    except ChaosError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    logs.setup("console", "info" if args.verbose else "warning")
    if plan.scenario.fleet is not None:
        return _fleet(plan, opts)
    results, interrupted = asyncio.run(_until_signalled(plan, opts))
    _summary(results, args.out)
    if interrupted:
        return 130
    passed = results.meta.complete and all(c.passed for c in results.checks)
    return 0 if passed else 1


async def _until_signalled(plan: Plan, opts: RunOptions) -> tuple[Results, bool]:
    """SIGINT (Ctrl-C, even where a shell started us with it ignored) and SIGTERM stop the
    faults and the load; the run still stops every process and writes its partial report."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await run(plan, opts)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _fleet(plan: Plan, opts: RunOptions) -> int:
    """A fleet scenario runs through the fleet harness (chaos/fleet/), not the single-node
    runner: namespaces, etcd and a supervisor per node (needs root, iproute2 and etcd)."""
    from chaos.fleet.net import missing
    from chaos.fleet.scenario_run import run_scenario

    why = missing()
    if why is not None:
        print(f"chaos: a fleet scenario {why}", file=sys.stderr)
        return 2
    if opts.policy is not None:
        plan = msgspec.structs.replace(
            plan,
            scenario=msgspec.structs.replace(
                plan.scenario,
                stages=[msgspec.structs.replace(s, policy=str(opts.policy.resolve()))
                        for s in plan.scenario.stages],
            ),
        )  # fmt: skip
    report, passed = run_scenario(plan, opts.command, opts.out)
    for check in report.checks:
        print(f"{'pass' if check.passed else 'FAIL'}  {check.check}  (value {check.value})")
    for name, stage in report.stages.items():
        for error in stage.errors:
            print(f"stage {name}: {error}")
    print(f"report: {opts.out / 'report.md'}")
    return 0 if passed else 1


def _summary(results: Results, out: Path) -> None:
    for check in results.checks:
        value = report.num(check.value)
        print(f"{'pass' if check.passed else 'FAIL'}  {check.check}  (value {value})")
    if results.meta.note:
        print(f"note: {results.meta.note}")
    print(f"report: {out / 'report.md'}")


def _rerender(out: Path) -> int:
    try:
        results = msgspec.json.decode((out / "results.json").read_bytes(), type=Results)
    except (OSError, msgspec.DecodeError) as exc:
        print(
            f"chaos: cannot read {out / 'results.json'}: {exc}; pass a run's --out dir",
            file=sys.stderr,
        )
        return 2
    write_report(out, results)
    print(f"report: {out / 'report.md'}")
    return 0


def _kinds() -> int:
    print("fault kinds:")
    for kind, what in FAULTS.items():
        print(f"  {kind:26} {what}")
    print("per-fault metrics ([fault.]metric.stat):")
    for metric, what in TRIAL_METRICS.items():
        print(f"  {metric:26} {what}")
    print("whole-run metrics:")
    for metric, what in RUN_METRICS.items():
        print(f"  {metric:26} {what}")
    print(f"statistics: {', '.join(STATS)}")
    return 0
