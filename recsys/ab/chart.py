"""The cumulative-lift chart: per metric, relative lift by day with its two intervals."""

from __future__ import annotations

import math
from pathlib import Path

from recsys.ab.analysis import Analysis


def lift_chart(analysis: Analysis, path: Path) -> Path:
    """Write one panel per metric: lift, fixed-horizon and always-valid intervals over days."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    names = [analysis.primary, *sorted(n for n in analysis.metrics if n != analysis.primary)]
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False, constrained_layout=True
    )
    for ax, name in zip(axes.flat, names, strict=False):
        points = analysis.metrics[name].daily
        x = list(range(1, len(points) + 1))
        pct = [100 * p.rel for p in points]
        ax.fill_between(x, [100 * p.seq_rel_low for p in points],
                        [100 * p.seq_rel_high for p in points],
                        alpha=0.18, color="tab:blue", label="always-valid")  # fmt: skip
        ax.fill_between(x, [100 * p.rel_low for p in points], [100 * p.rel_high for p in points],
                        alpha=0.35, color="tab:orange", label="fixed-horizon")  # fmt: skip
        ax.plot(x, pct, color="black", marker="o", markersize=3, label="lift")
        ax.axhline(0, color="grey", linewidth=0.8)
        title = f"{name} (primary)" if name == analysis.primary else name
        ax.set_title(f"{title}: {analysis.treatment} vs {analysis.control}")
        ax.set_xlabel("day of experiment (cumulative)")
        ax.set_ylabel("relative lift, %")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(loc="best", fontsize=8)
    fig.suptitle(analysis.decision.line(analysis.experiment), fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
