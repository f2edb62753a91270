"""PNG plots of a run (matplotlib, Agg): load and errors over time with the faults marked,
and the recovery-time distribution per fault."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from chaos.load import RequestRow  # noqa: E402
from chaos.metrics import TrialRow, expected  # noqa: E402

BIN_S = 1.0
MANY_FAULTS = 40  # more than this: fault ticks instead of lines across the panels


def timeline(path: Path, rows: Sequence[RequestRow], trials: Sequence[TrialRow]) -> None:
    t0 = min((r.start for r in rows), default=0.0)
    span = max((r.end for r in rows), default=t0) - t0
    bins = max(1, math.ceil(span / BIN_S))
    ok, failed = [0.0] * bins, [0.0] * bins
    for row in rows:
        slot = min(bins - 1, int((row.end - t0) / BIN_S))
        (ok if row.ok else failed)[slot] += 1 / BIN_S
    xs = [i * BIN_S for i in range(bins)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 6), sharex=True, height_ratios=[2, 1])
    top.plot(xs, ok, color="tab:blue", lw=1, label="ok requests/s")
    top.plot(xs, failed, color="tab:red", lw=1.2, label="failed requests/s")
    bottom.scatter(
        [r.start - t0 for r in rows],
        [max(r.latency_ms, 0.1) for r in rows],
        s=3,
        c=["tab:blue" if r.ok else "tab:red" for r in rows],
        alpha=0.6,
        linewidths=0,
    )
    bottom.set_yscale("log")
    bottom.set_ylabel("latency ms")
    bottom.set_xlabel("seconds since the first request")
    _mark_faults(top, bottom, trials, t0)
    top.set_ylabel("requests/s")
    top.set_title("load and errors; faults marked")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mark_faults(top: Axes, bottom: Axes, trials: Sequence[TrialRow], t0: float) -> None:
    """A dashed line per fault; past MANY_FAULTS, a tick along the top of the load panel."""
    colors = _colors(trials)
    many = len(trials) > MANY_FAULTS
    seen: set[str] = set()
    for trial in trials:
        label = trial.fault if trial.fault not in seen else None
        seen.add(trial.fault)
        x, color, lw = trial.injected - t0, colors[trial.fault], 1.0 if many else 0.8
        if many:
            top.axvline(x, ymin=0.92, color=color, lw=lw, label=label)
            continue
        top.axvline(x, ls="--", color=color, lw=lw, label=label)
        bottom.axvline(x, ls="--", color=color, lw=lw)


def recovery(path: Path, trials: Sequence[TrialRow]) -> None:
    faults = sorted({t.fault for t in trials})
    metrics = ("recovery_ms", "detection_ms", "promotion_ms")
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(15, max(3.0, 0.45 * len(faults) + 1.5)), sharey=True
    )
    rng = random.Random(0)
    for axis, metric in zip(axes, metrics, strict=True):
        for y, fault in enumerate(faults):
            _distribution(axis, y, [getattr(t, metric) for t in trials if t.fault == fault], rng)
            missing = sum(1 for t in trials if t.fault == fault and getattr(t, metric) is None)
            if missing and expected(metric, fault):
                axis.annotate(
                    f"{missing} timeout",
                    (1.0, y),
                    xycoords=("axes fraction", "data"),
                    ha="right",
                    va="center",
                    color="tab:red",
                    fontsize=7,
                )
        axis.set_xscale("log")
        axis.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 10 20 50 100 ...
        axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.tick_params(axis="x", labelsize=7)
        axis.set_xlabel(f"{metric} (log scale)")
        axis.set_yticks(range(len(faults)), faults)
        axis.grid(axis="x", which="both", alpha=0.3)
    axes[0].set_title("recovery time per fault", loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _distribution(axis: Axes, y: int, data: list[float | None], rng: random.Random) -> None:
    """A box and the jittered points of one fault's measurements, on row `y`."""
    points = [max(v, 0.01) for v in data if v is not None]
    if not points:
        return
    axis.boxplot(points, positions=[y], orientation="horizontal", widths=0.5, showfliers=False)
    jitter = [y + rng.uniform(-0.15, 0.15) for _ in points]
    axis.scatter(points, jitter, s=10, alpha=0.7, color="tab:orange", zorder=3)


def _colors(trials: Sequence[TrialRow]) -> dict[str, str]:
    palette = plt.get_cmap("tab20")
    faults = sorted({t.fault for t in trials})
    return {fault: matplotlib.colors.to_hex(palette(i % 20)) for i, fault in enumerate(faults)}
