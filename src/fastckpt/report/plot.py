"""The report's figure (matplotlib, Agg backend, imported only here and only when drawing).

Three panels sharing a wall-clock x axis: the save phases of every rank as a timeline (one
lane per phase in each rank's band), the overhead curve against the budget line, and the
blocked time and durable time of each save.
"""

from __future__ import annotations

import datetime as dt

from ..runstate import RunState
from .summary import Summary

PHASES = ("snapshot", "write", "commit", "replicate")
COLORS = {"snapshot": "#d62728", "write": "#1f77b4", "commit": "#2ca02c", "replicate": "#9467bd",
          "queued": "#bbbbbb"}


def _pyplot():  # noqa: ANN202
    try:
        import matplotlib
    except ImportError as exc:
        raise ModuleNotFoundError("fastckpt report draws with matplotlib: pip install 'fastckpt[report]' "
                                  "(or use --json / the text summary without -o)", name=exc.name) from exc
    matplotlib.use("Agg", force=True)  # no display needed; never opens a window
    import matplotlib.pyplot as plt

    return plt


def _when(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t)


def render_png(run: RunState, summary: Summary, path: str, *, dpi: int = 100) -> None:
    """Draw the run and write a PNG to ``path``."""
    plt = _pyplot()
    import matplotlib.dates as mdates

    ranks = run.ranks()
    fig, (ax_t, ax_o, ax_s) = plt.subplots(3, 1, figsize=(12, 4 + 0.8 * len(ranks) + 5), sharex=True,
                                           gridspec_kw={"height_ratios": [1 + 0.4 * len(ranks), 1.2, 1.2]})
    saves = run.saves()
    lane_h = 1.0 / (len(PHASES) + 1)
    for i, rank in enumerate(ranks):
        for s in (s for s in saves if s.rank == rank):
            for p in s.phases:
                lane = PHASES.index(p.name) if p.name in PHASES else None
                if lane is None:
                    continue
                y = i + 1 - (lane + 1) * lane_h
                start = mdates.date2num(_when(p.start))
                width = max(p.end - p.start, 1e-4) / 86400.0
                ax_t.broken_barh([(start, width)], (y, lane_h * 0.8), facecolors=COLORS[p.name],
                                 edgecolors="black" if p.error else "none")
    ax_t.set_yticks([i + 0.5 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax_t.set_ylim(0, max(len(ranks), 1))
    ax_t.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[p]) for p in PHASES], labels=list(PHASES),
                loc="upper left", ncol=len(PHASES), fontsize="small")
    ax_t.set_title(f"save phases per rank: {summary.saves} saves, {summary.bytes / 1e9:.3f} GB")

    for rank in ranks:
        pts = run.overhead_points(rank)
        if pts:
            x = [_when(p.t) for p in pts]
            ax_o.plot(x, [p.overhead * 100 for p in pts], marker=".", label=f"rank {rank} run")
            ax_o.plot(x, [p.window_overhead * 100 for p in pts], linestyle="--", label=f"rank {rank} window")
            fired = [(_when(p.t), p.overhead * 100) for prev, p in zip([None, *pts], pts)
                     if p.over_budget and (prev is None or not prev.over_budget)]
            if fired:
                ax_o.scatter(*zip(*fired), color="red", marker="v", zorder=3, label=f"rank {rank} alarm")
    ax_o.axhline(summary.budget * 100, color="red", linewidth=1, label=f"budget {summary.budget:.0%}")
    ax_o.set_ylabel("overhead (%)")
    ax_o.set_ylim(bottom=0)
    ax_o.legend(loc="upper right", fontsize="small")
    ax_o.set_title("overhead: blocked time / wall time (the Monitor's rule, replayed from the log)")

    for rank in ranks:
        mine = [s for s in saves if s.rank == rank and s.error is None]
        ax_s.plot([_when(s.start) for s in mine], [s.blocked_s * 1e3 for s in mine], "o", label=f"rank {rank} blocked")
        dur = [s for s in mine if s.durable_s is not None]
        ax_s.plot([_when(s.start) for s in dur], [s.durable_s * 1e3 for s in dur], "x", label=f"rank {rank} durable")
    ax_s.set_ylabel("ms after the save call")
    ax_s.set_yscale("symlog", linthresh=1.0)
    ax_s.legend(loc="upper right", fontsize="small")
    ax_s.set_title("per save: blocked (stall) and durable at its path")
    locator = mdates.AutoDateLocator()
    ax_s.xaxis.set_major_locator(locator)
    ax_s.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax_s.set_xlabel("wall-clock time (local)")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, format="png")
    plt.close(fig)
