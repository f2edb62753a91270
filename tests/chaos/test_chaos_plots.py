"""The plots show what the report says, readably: recovery.png leaves out what the report's
tables leave out (a kill-supervisor's "detection", a skipped trial); in timeline.png the
title stands clear of the fault markers, and requests/s and tokens/s have panels of their
own."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.collections import PathCollection

from chaos.load import RequestRow
from chaos.metrics import TrialRow, values
from chaos.plots import recovery_figure, timeline_figure

TRIALS = [
    TrialRow(0, "main", "kill-primary", "e1", 1, 100.0, 101.0, 2.0, 1.0, recovery_ms=300.0),
    TrialRow(1, "main", "kill-primary", "e2", 2, 102.0, 103.0, 3.0, 1.5, recovery_ms=320.0),
    TrialRow(2, "main", "kill-supervisor", "main", 3, 104.0, 110.0, 944.0, None, 5000.0),
    TrialRow(3, "main", "kill-batch", "", None, 111.0, 111.0, None, None, outcome="skipped"),
]


def _points(axis: plt.Axes) -> list[tuple[float, float]]:
    return [
        (float(x), float(y))
        for c in axis.collections
        if isinstance(c, PathCollection)
        for x, y in c.get_offsets()
    ]


def test_recovery_plots_the_figures_the_report_tabulates() -> None:
    fig = recovery_figure(TRIALS)
    try:
        rows = [t.get_text() for t in fig.axes[0].get_yticklabels()]  # (a shared y axis)
        assert rows == ["kill-batch", "kill-primary", "kill-supervisor"]
        for axis in fig.axes:
            metric = axis.get_xlabel().split()[0]
            for y, fault in enumerate(rows):
                plotted = sorted(x for x, py in _points(axis) if round(py) == y)
                table = sorted(values([t for t in TRIALS if t.fault == fault], metric))
                assert plotted == [max(v, 0.01) for v in table], (metric, fault)
    finally:
        plt.close(fig)


def test_timeline_title_clears_the_faults_and_rates_have_their_own_panels() -> None:
    rows = [
        RequestRow(100 + i / 10, 100.05 + i / 10, 200, 1, "e1", 1, tokens=16) for i in range(120)
    ]
    fig = timeline_figure(rows, TRIALS[:3])
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        title = fig.texts[0] if fig.texts else fig.axes[0].title
        title_box = title.get_window_extent(renderer)
        for axis in fig.axes:  # every marker's top, in pixels, below the title's bottom
            for c in axis.collections:
                if not isinstance(c, PathCollection) or not len(c.get_offsets()):
                    continue
                shown = c.get_offset_transform().transform(c.get_offsets())
                radius = max(c.get_sizes()) ** 0.5 / 2 * fig.dpi / 72
                assert max(y for _, y in shown) + radius < title_box.y0, axis.get_ylabel()
        requests_axes = [a for a in fig.axes if any(ln.get_label() == "ok" for ln in a.lines)]
        tokens_axes = [a for a in fig.axes if a.get_ylabel() == "output tokens/s"]
        assert len(requests_axes) == len(tokens_axes) == 1
        req, tok = requests_axes[0], tokens_axes[0]
        assert not req.get_window_extent(renderer).overlaps(tok.get_window_extent(renderer))
    finally:
        plt.close(fig)
