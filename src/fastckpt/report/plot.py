"""The report's figure (matplotlib, Agg backend, imported only here and only when drawing).

Three panels sharing a wall-clock x axis: the save phases of every rank as a timeline (one
lane per phase in each rank's band), the overhead curve against the budget line, and the
blocked time and durable time of each save.
"""

from __future__ import annotations

import datetime as dt
from typing import BinaryIO

from ..runstate import Phase, RunState
from ..units import fmt_bytes
from .summary import Summary

PHASES = ("snapshot", "write", "commit", "replicate")
COLORS = {"snapshot": "#d62728", "write": "#1f77b4", "commit": "#2ca02c", "replicate": "#9467bd",
          "queued": "#bbbbbb"}


def pyplot():  # noqa: ANN202
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


def _date_nums(ts: list[float]) -> list[float]:
    """matplotlib date numbers of ``_when(t)`` for many ``t``: one date2num per call, not per
    value (per value it took most of the drawing time), unless the UTC offset changes between
    the first and the last (a DST switch in the run)."""
    import matplotlib.dates as mdates

    if not ts:
        return []
    lo, hi = min(ts), max(ts)
    off_lo, off_hi = (mdates.date2num(_when(t)) - t / 86400.0 for t in (lo, hi))
    if abs(off_lo - off_hi) > 1e-9:
        return [mdates.date2num(_when(t)) for t in ts]
    return [t / 86400.0 + off_lo for t in ts]


def render_png(run: RunState, summary: Summary, path: str | BinaryIO, *, dpi: int = 100) -> None:
    """Draw the run and write a PNG to ``path`` (a file name, or a binary file object)."""
    plt = pyplot()
    import matplotlib.dates as mdates

    ranks = run.ranks()
    fig, (ax_t, ax_o, ax_s) = plt.subplots(3, 1, figsize=(12, 4 + 0.8 * len(ranks) + 5), sharex=True,
                                           gridspec_kw={"height_ratios": [1 + 0.4 * len(ranks), 1.2, 1.2]})
    saves = run.saves()
    lane_h = 1.0 / (len(PHASES) + 1)
    # one collection per rank, phase and outcome, not one artist per phase: a long run's log has
    # hundreds of thousands of phases, and an artist each took matplotlib hours to draw
    bars: dict[tuple[int, str, bool], list[Phase]] = {}
    index = {rank: i for i, rank in enumerate(ranks)}
    for s in saves:
        for p in s.phases:
            if p.name in PHASES:
                bars.setdefault((index[s.rank], p.name, p.error is not None), []).append(p)
    for (i, name, failed), phases in bars.items():
        y = i + 1 - (PHASES.index(name) + 1) * lane_h
        starts = _date_nums([p.start for p in phases])
        xranges = [(x, max(p.end - p.start, 1e-4) / 86400.0) for x, p in zip(starts, phases)]
        ax_t.broken_barh(xranges, (y, lane_h * 0.8), facecolors=COLORS[name],
                         edgecolors="black" if failed else "none")
    ax_t.set_yticks([i + 0.5 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax_t.set_ylim(0, max(len(ranks), 1))
    ax_t.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[p]) for p in PHASES], labels=list(PHASES),
                loc="upper left", ncol=len(PHASES), fontsize="small")
    ax_t.set_title(f"save phases per rank: {summary.saves} saves, {fmt_bytes(summary.bytes)}")

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
