"""PNG plots of a run (matplotlib, Agg): load and errors over time with the faults marked,
and the recovery-time distribution per fault, of the same figures as the report's tables."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from chaos.load import RequestRow  # noqa: E402
from chaos.metrics import StageSpan, TrialRow, values  # noqa: E402

MANY_FAULTS = 40  # more than this: markers only, no line across the panel per fault
TARGET_BINS = 300  # a run of any length gets about this many bins
BIN_STEPS = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)
MARKERS = ("v", "^", "o", "s", "D", "P", "X", "*", "<", ">", "p", "h", "8", "d")
STAGE_SHADES = ("#e8f0fb", "#f6efe3")


def bin_seconds(span: float) -> float:
    """The smallest round bin that gives at most TARGET_BINS bins over `span` seconds."""
    return next((b for b in BIN_STEPS if span / b <= TARGET_BINS), BIN_STEPS[-1])


def timeline(
    path: Path,
    rows: Sequence[RequestRow],
    trials: Sequence[TrialRow],
    stages: Sequence[StageSpan] = (),
) -> None:
    """The timeline figure (`timeline_figure`) as a PNG at `path`."""
    fig = timeline_figure(rows, trials, stages)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_figure(
    rows: Sequence[RequestRow], trials: Sequence[TrialRow], stages: Sequence[StageSpan] = ()
) -> Figure:
    """Panels over one time axis: the faults (a row per kind), requests/s (ok and failed),
    output tokens/s, and every request's latency; bins between stages left blank, stages
    shaded."""
    t0 = min([r.start for r in rows] + [s.start for s in stages], default=0.0)
    span = max((r.end for r in rows), default=t0) - t0
    step = bin_seconds(span)
    xs, ok, failed, tokens = _rates(rows, stages, t0, span, step)
    kinds = sorted({t.fault for t in trials if t.outcome == "injected"})
    fig, (faults, reqs, toks, lat) = plt.subplots(
        4,
        1,
        figsize=(14, 8.5 + 0.12 * len(kinds)),
        sharex=True,
        height_ratios=[0.4 + 0.12 * len(kinds), 1.6, 1.0, 1.0],
    )
    fig.suptitle("load and errors; stages shaded, faults marked by kind")
    reqs.plot(xs, ok, color="tab:blue", lw=1, label="ok")
    reqs.plot(xs, failed, color="tab:red", lw=1.2, label="failed")
    reqs.set_ylabel("requests/s")
    reqs.set_ylim(bottom=0)
    reqs.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7)
    toks.plot(xs, tokens, color="tab:green", lw=0.8)
    toks.set_ylabel("output tokens/s")
    toks.set_ylim(bottom=0)
    _latency(lat, rows, t0)
    lat.set_xlabel(f"seconds since the first request ({step:g} s bins)")
    _shade_stages((faults, reqs, toks, lat), stages, t0)
    _mark_faults(faults, (reqs, toks, lat), trials, kinds, t0)
    fig.tight_layout()
    return fig


def _latency(axis: Axes, rows: Sequence[RequestRow], t0: float) -> None:
    """Every request at its start: ok blue, shed orange, failed red; log scale."""
    axis.scatter(
        [r.start - t0 for r in rows],
        [max(r.latency_ms, 0.1) for r in rows],
        s=3,
        c=["tab:blue" if r.ok else ("tab:orange" if r.shed else "tab:red") for r in rows],
        alpha=0.6,
        linewidths=0,
    )
    axis.set_yscale("log")
    axis.set_ylabel("latency ms")


def _rates(
    rows: Sequence[RequestRow], stages: Sequence[StageSpan], t0: float, span: float, step: float
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per bin: ok/s, failed/s, tokens/s; NaN (a gap, not a zero) for bins outside every
    stage, so the switch from one stage to the next does not read as an outage."""
    bins = max(1, math.ceil(span / step))
    ok, failed, tokens = [0.0] * bins, [0.0] * bins, [0.0] * bins
    for row in rows:
        slot = min(bins - 1, int((row.end - t0) / step))
        if row.ok:
            ok[slot] += 1 / step
            tokens[slot] += row.tokens / step
        elif row.failed:
            failed[slot] += 1 / step
    xs = [(i + 0.5) * step for i in range(bins)]
    if stages:
        for i, x in enumerate(xs):
            if not any(s.start - t0 <= x + step / 2 and x - step / 2 <= s.end - t0 for s in stages):
                ok[i] = failed[i] = tokens[i] = math.nan
    return xs, ok, failed, tokens


def _shade_stages(axes: Sequence[Axes], stages: Sequence[StageSpan], t0: float) -> None:
    for i, stage in enumerate(stages):
        for axis in axes:
            axis.axvspan(
                stage.start - t0, stage.end - t0, color=STAGE_SHADES[i % 2], zorder=0, lw=0
            )
        axes[0].annotate(
            f"stage {stage.name}",
            (stage.start - t0, 1.0),
            xycoords=("data", "axes fraction"),
            va="top",
            fontsize=7,
            color="0.35",
        )


def _mark_faults(
    strip: Axes, panels: Sequence[Axes], trials: Sequence[TrialRow], kinds: list[str], t0: float
) -> None:
    """Each injected fault as a marker in the fault strip, one row (colour, shape) per kind,
    named with its count; up to MANY_FAULTS also a thin line down the other panels."""
    palette = plt.get_cmap("tab20")
    labels = []
    for i, kind in enumerate(kinds):
        mine = [t.injected - t0 for t in trials if t.fault == kind and t.outcome == "injected"]
        color, marker = palette(i % 20), MARKERS[i % len(MARKERS)]
        strip.scatter(
            mine,
            [i] * len(mine),
            marker=marker,
            color=color,
            edgecolors="black",
            linewidths=0.4,
            s=28,
            zorder=4,
        )
        labels.append(f"{kind} ({len(mine)})")
        if len(trials) <= MANY_FAULTS:
            for x in mine:
                for panel in panels:
                    panel.axvline(x, ls=":", color=color, lw=0.7, zorder=1)
    strip.set_yticks(range(len(kinds)), labels, fontsize=7)
    strip.set_ylim(-0.7, len(kinds) - 0.3)
    strip.invert_yaxis()
    strip.grid(axis="y", alpha=0.3)
    strip.set_ylabel("faults")


def recovery(path: Path, trials: Sequence[TrialRow]) -> None:
    """The recovery figure (`recovery_figure`) as a PNG at `path`."""
    fig = recovery_figure(trials)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recovery_figure(trials: Sequence[TrialRow]) -> Figure:
    """Per fault (a row each), the distribution of recovery_ms, detection_ms and
    promotion_ms, one panel each."""
    faults = sorted({t.fault for t in trials})
    metrics = ("recovery_ms", "detection_ms", "promotion_ms")
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(15, max(3.0, 0.45 * len(faults) + 1.5)), sharey=True
    )
    rng = random.Random(0)
    for axis, metric in zip(axes, metrics, strict=True):
        for y, fault in enumerate(faults):
            # the report's figures (`values`): no skipped trial, no kill-supervisor detection
            data = values([t for t in trials if t.fault == fault], metric)
            _distribution(axis, y, [v for v in data if not math.isinf(v)], rng)
            missing = sum(1 for v in data if math.isinf(v))
            if missing:
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
    return fig


def _distribution(axis: Axes, y: int, data: list[float], rng: random.Random) -> None:
    """A box and the jittered points of one fault's measurements, on row `y`."""
    points = [max(v, 0.01) for v in data]
    if not points:
        return
    axis.boxplot(points, positions=[y], orientation="horizontal", widths=0.5, showfliers=False)
    jitter = [y + rng.uniform(-0.15, 0.15) for _ in points]
    axis.scatter(points, jitter, s=10, alpha=0.7, color="tab:orange", zorder=3)
