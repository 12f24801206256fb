"""``fastckpt report``'s parts: the run's numbers (summary), the figure (plot, matplotlib:
the optional extra ``fastckpt[report]``) and the HTML page (page). docs/report.md."""

from __future__ import annotations

from collections.abc import Sequence

from ..eventlog import read_events
from ..runstate import RunState
from .summary import Distribution, RankSummary, Summary, percentile, summarize

__all__ = ["Distribution", "RankSummary", "Summary", "load_run", "percentile", "summarize"]


def load_run(logs: Sequence[str], budget: float | None = None,
             window_s: float | None = None) -> tuple[RunState, Summary]:
    """Read event logs (one per rank, or several ranks' in one) and summarise the run; the alarm is
    replayed against ``budget`` and ``window_s``, or (None) each job's, from its log (``RunState``)."""
    run = RunState(budget, window_s)
    for ev in read_events(logs):
        run.feed(ev)
    return run, summarize(run, logs)
