"""The numbers of a run, from its event logs: saves, bytes, blocked and durable percentiles,
overhead, alarms, replication lag, failures (docs/report.md says how each is computed)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..eventlog import error_type
from ..events import Event
from ..runstate import RunState, SaveTrace
from ..units import fmt_bytes

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
_NAMED = 3  # unfinished saves named on the text's line (--json: all)
# where a rank's budget comes from (``RunState.budget_of``), as the text says it
_SOURCES = {"given": "--overhead-budget", "job": "the job's", "default": "the default: its log records none"}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def seconds(s: float | None) -> str:
    """0.0123 -> '12.3 ms', 4.5 -> '4.50 s'."""
    if s is None:
        return "n/a"
    return f"{s * 1e3:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"


@dataclass(frozen=True)
class Distribution:
    """Count, mean, p50/p90/p99 and max of some seconds (None fields: no values)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, None, None, None, None, None)
        qs = [percentile(values, q) for _, q in QUANTILES]
        return cls(len(values), sum(values) / len(values), *qs, max(values))

    def text(self) -> str:
        if not self.count:
            return "none"
        return (f"p50 {seconds(self.p50)}, p90 {seconds(self.p90)}, p99 {seconds(self.p99)}, "
                f"max {seconds(self.max)} ({self.count})")


def _saves(traces: Iterable[SaveTrace]) -> list[list[SaveTrace]]:
    """The saves, as the Monitor counts them: each file alone, but the files of one ``one_save()``
    block (their ``snapshot`` events name it) together, in order of their first file's start."""
    out: dict[object, list[SaveTrace]] = {}
    for s in traces:
        out.setdefault((s.rank, s.session, s.block) if s.block is not None else id(s), []).append(s)
    return list(out.values())


@dataclass(frozen=True)
class RankSummary:
    """One rank's overhead: the Monitor's rule replayed after its last save, and over the log."""

    rank: int
    saves: int
    blocked_s: float
    overhead: float | None  # the Monitor's run overhead after the last save (None: < 2 saves)
    max_window_overhead: float | None
    log_overhead: float | None  # blocked / each session's (last event end - first save start), summed
    alarms: int
    budget: float  # the alarm's, replayed: --overhead-budget, else its job's (``RunState.budget_of``)
    budget_source: str  # "given" (--overhead-budget), "job" (the log's start event), "default" (a log without)


@dataclass(frozen=True)
class Summary:
    """Everything ``fastckpt report`` prints (and ``--json`` writes)."""

    logs: tuple[str, ...]
    events: int
    ranks: tuple[RankSummary, ...]
    span_s: float
    saves: int  # a one_save() block of files is one (the counts below, durable to failed, are of files)
    files: int
    tiers: dict[str, int]
    bytes: int
    durable: int
    superseded: int
    pending: int
    abandoned: int  # left open by a job that died, then was resumed with the same log
    failed: int
    blocked_s: Distribution
    durable_s: Distribution
    replication_lag_s: Distribution
    budget: float  # the lowest rank's (each rank's: ``ranks``)
    budget_source: str
    alarms: int
    failures: dict[str, int]  # "phase: ExceptionType" -> count
    retries: int
    group_commits: int
    loads: Distribution
    load_ranks: int  # the ranks that loaded
    loaded_bytes: int
    unfinished: int  # lazy saves whose fence event never came (not pending, not abandoned: their copy never ended)
    unfinished_saves: tuple[str, ...]  # each: "rank R PATH reached PHASE", its last logged phase

    def text(self) -> str:
        """The summary as the lines the CLI prints."""
        tiers = ', '.join(f'{t} {n}' for t, n in sorted(self.tiers.items())) or 'none'
        files = "" if self.files == self.saves else f"{self.files} files: "  # one_save() blocks of files
        if not self.files:  # a log of loads only (a job that resumed, then died before its first save)
            return (f"no saves: {self.loads.count} loads by {self.load_ranks} rank(s) over {self.span_s:.1f} s, "
                    f"{fmt_bytes(self.loaded_bytes)} read\n{self._last_line()}")
        lines = [f"{self.saves} saves ({files}{tiers}) "
                 f"by {len(self.ranks)} rank(s) over {self.span_s:.1f} s, {fmt_bytes(self.bytes)} committed; "
                 f"{self.durable} durable, {self.superseded} superseded, {self.pending} pending, "
                 f"{self.abandoned} abandoned, {f'{self.unfinished} unfinished, ' if self.unfinished else ''}"
                 f"{self.failed} failed",
                 f"blocked: {self.blocked_s.text()}",
                 f"durable after: {self.durable_s.text()}",
                 f"replication lag: {self.replication_lag_s.text()}"]
        if self.unfinished:
            more = f" and {self.unfinished - _NAMED} more" if self.unfinished > _NAMED else ""
            lines.append(f"unfinished: {', '.join(self.unfinished_saves[:_NAMED])}{more} (lazy saves whose fence "
                         "event never came: the job was killed, or is still before its fence)")
        for r in self.ranks:
            over = "n/a (fewer than 2 saves)" if r.overhead is None else f"{r.overhead:.2%}"
            win = "" if r.max_window_overhead is None else f", window max {r.max_window_overhead:.2%}"
            log = "" if r.log_overhead is None else f", over the log {r.log_overhead:.2%}"
            lines.append(f"rank {r.rank}: overhead {over}{win}{log} (budget {r.budget:.1%}: "
                         f"{_SOURCES[r.budget_source]}), "
                         f"{r.alarms} alarm(s), {r.saves} saves blocked {r.blocked_s:.3f} s")
        return "\n".join([*lines, self._last_line()])

    def _last_line(self) -> str:
        fails = ", ".join(f"{k} x{n}" for k, n in sorted(self.failures.items())) or "none"
        return (f"failures: {fails}; retries: {self.retries}; group commits: {self.group_commits}; "
                f"loads: {self.loads.text()}")


def _rank_summary(run: RunState, rank: int, saves: list) -> RankSummary:
    mine = [s for s in saves if s.rank == rank and s.phase("snapshot").error is None]
    pts = run.overhead_points(rank)
    blocked = sum(s.blocked_s for s in mine)
    # each session from its first save to its last event (a group commit's included), summed: a
    # resumed job appends to the killed one's log, and the time between the two is no run time
    first: dict = {}
    last: dict = {}
    for s in mine:
        first[s.session] = min(first.get(s.session, s.start), s.start)
    for k, end in [(s.session, p.end) for s in saves if s.rank == rank for p in s.phases] + \
            [(e.session, e.end) for e in run.group_commits if e.rank == rank]:
        last[k] = max(last.get(k, end), end)
    span = sum(max(last[k] - t0, 0.0) for k, t0 in first.items() if k in last)
    return RankSummary(rank, len(_saves(mine)), blocked, pts[-1].overhead if pts else None,
                       max(p.window_overhead for p in pts) if pts else None,
                       blocked / span if span > 0 and len(_saves(mine)) > 1 else None, run.alarms(rank),
                       *run.budget_of(rank))


def summarize(run: RunState, logs: Sequence[str] = ()) -> Summary:
    """The Summary of everything fed to ``run``."""
    saves = run.saves()
    ok = [s for s in saves if s.error is None]
    failures = Counter(f"{e.name}: {error_type(e.error or '')}" for e in run.failures)
    lags = [lag for s in ok if (lag := s.replication_lag_s) is not None]
    loaded = [e for e in run.loads if e.error is None]
    unfenced = [s for s in ok if s.unfenced]
    span = (run.last_end - run.first_start) if run.first_start is not None else 0.0
    return Summary(
        tuple(logs), sum(run.events.values()), tuple(_rank_summary(run, r, saves) for r in run.ranks()), span,
        len(_saves(saves)), len(saves), dict(Counter(s.tier for s in saves)), sum(s.bytes for s in ok),
        sum(s.durable_at is not None for s in ok), sum(s.superseded for s in ok),
        sum(s.durable_at is None and not s.superseded and not s.abandoned and not s.unfenced for s in ok),
        sum(s.abandoned and not s.unfenced for s in ok), len(saves) - len(ok),
        Distribution.of([sum(f.blocked_s for f in save) for save in _saves(s for s in saves
                                                                           if s.phase("snapshot").error is None)]),
        Distribution.of([d for s in ok if (d := s.durable_s) is not None]), Distribution.of(lags), *run.budget_of(),
        sum(run.alarms(r) for r in run.ranks()), dict(failures), len(run.retries),
        _published(run.group_commits), Distribution.of([e.duration_s for e in loaded]), len({e.rank for e in loaded}),
        sum(e.bytes for e in loaded), len(unfenced),
        tuple(f"rank {s.rank} {s.path} reached {s.phases[-1].name}" for s in unfenced))


def _published(commits: Iterable[Event]) -> int:
    """The groups published: every rank that took part logs a commit of each, so the rank that
    logged the most of them counts (a log of some ranks only still counts theirs)."""
    return max(Counter(e.rank for e in commits).values(), default=0)
