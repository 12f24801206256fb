"""Overhead accounting and the budget alarm.

overhead = total time the training thread was blocked in saves / wall time since the
Checkpointer started, over the whole run and over a sliding window. The check runs after
each save from the second save on (one save has no interval to measure against; the files of
one ``one_save()`` are one save: ``onesave``). Crossing above the budget logs one WARNING with
the numbers and the advice, calls the user's callback and raises the flag in ``stats()``;
dropping back below re-arms the alarm.

The advice (the snapshot bandwidth, or the save interval, that would meet the budget) is given
in two significant figures, rounded up, in units that fit. It needs the interval between saves,
so it is computed only once ``ADVICE_INTERVALS`` intervals are measured: an alarm that fires
earlier says so, and the advice follows in one more WARNING when that many intervals are in,
if the overhead is still above the budget (the callback is not called again).
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .onesave import CALLER, OneSave
from .units import in_unit

if TYPE_CHECKING:
    from .save.stripes import DirStats

log = logging.getLogger("fastckpt")
ADVICE_INTERVALS = 3  # intervals between saves measured before the alarm sizes a fix


def sig(x: float, digits: int = 2, *, up: bool = False) -> float:
    """``x`` to ``digits`` significant figures; ``up``: rounded up (a threshold a user can meet)."""
    if x <= 0 or not math.isfinite(x):
        return x
    scale = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    q = round(x / scale, 9)
    return round((math.ceil(q) if up else round(q)) * scale, 12)


def fmt_rate(bps: float, *, up: bool = False) -> str:
    """Bytes per second in SI units, two significant figures: ``'5.3 GB/s'``."""
    value, unit = in_unit(bps, (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0)),
                          lambda v: sig(v, up=up))
    return f"{value:g} {unit}"


def fmt_duration(s: float, *, up: bool = False) -> str:
    """Seconds in ms, s, min or h, two significant figures: ``'35 ms'``, ``'2.1 min'``."""
    value, unit = in_unit(s, (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3)), lambda v: sig(v, up=up))
    return f"{value:g} {unit}"


@dataclass(frozen=True)
class OverheadReport:
    """What the alarm knows when it fires (also passed to ``on_overhead_exceeded``)."""

    overhead: float
    window_overhead: float
    budget: float
    saves: int
    wall_s: float
    blocked_s: float
    mean_interval_s: float
    mean_blocked_s: float
    mean_bytes: float
    needed_snapshot_Bps: float
    min_interval_s: float
    mean_waited_s: float = 0.0  # of mean_blocked_s: waiting for a staging buffer older saves held (their writes)

    @property
    def intervals(self) -> int:
        """Intervals between saves measured (saves - 1)."""
        return self.saves - 1

    def advice(self) -> str:
        head = (f"checkpoint overhead {self.overhead:.1%} of wall time (window {self.window_overhead:.1%}) "
                f"is above the {self.budget:.1%} budget: {self.saves} saves blocked "
                f"{fmt_duration(self.blocked_s)} in {fmt_duration(self.wall_s)} (mean "
                f"{fmt_duration(self.mean_blocked_s)} per save every {fmt_duration(self.mean_interval_s)}).")
        if self.intervals < ADVICE_INTERVALS:
            return (f"{head} Too early to size a fix from {self.intervals} interval(s) between saves: the "
                    f"advice follows after {ADVICE_INTERVALS} if the overhead stays above the budget.")
        every = f"save every >= {fmt_duration(self.min_interval_s, up=True)}"
        if self.mean_waited_s >= self.mean_blocked_s / 2:  # backpressure, not the copy
            return (f"{head} Of that, {fmt_duration(self.mean_waited_s)} per save waited for a staging buffer that "
                    "the save before still held while it was written. To meet it, write faster (a local_dir burst "
                    "buffer on NVMe, a faster tier), add staging_buffers (one more copy of the state in host memory "
                    f"each), or {every}.")
        return (f"{head} To meet it, snapshot at >= {fmt_rate(self.needed_snapshot_Bps, up=True)} (the copy into "
                f"host memory; save(..., lazy=True) overlaps it with compute), or {every}.")


@dataclass(frozen=True)
class Stats:
    """A snapshot of the monitor (``Checkpointer.stats()``)."""

    saves: int
    skipped: int
    bytes: int
    blocked_s: float
    wall_s: float
    overhead: float
    window_overhead: float
    overhead_budget: float
    over_budget: bool
    alarms: int
    last_blocked_s: float | None
    last_durable_s: float | None
    pending: int
    replication_lag_s: float | None = None
    rpo_s: float | None = None
    replication_pending: int = 0
    replication_failures: int = 0
    last_restore_s: float | None = None  # the RTO of the newest load(): call to deserialised state
    last_restore_from: str | None = None  # where that load read from: "local", "path" or "remote"
    local_dirs: tuple[DirStats, ...] = ()  # each burst-buffer directory: bytes, write time, bandwidth, queue


def crossing(over: bool, share: float, budget: float) -> tuple[bool, bool]:
    """The alarm after a save, one rule for the live ``Monitor`` and its replay: (above the
    budget now, crossed above it just now). It fires once per crossing and re-arms below."""
    return share > budget, share > budget and not over


class BlockedWindow:
    """The blocked share of the last ``window_s`` seconds, one rule for the live ``Monitor`` and
    its replay from an event log: each save's blocked time counts as the span from its start (a
    save blocked longer than the window fills it), the part inside the window. The window reaches
    back at least to the end of the save before the newest (the one that ended second last), so
    it always spans a whole interval between saves: saves further apart than ``window_s`` count
    one save's blocked time over their interval, not over the window (docs/overhead.md)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._recent: list[tuple[float, float]] = []  # (start, blocked), in start order
        self._sum = 0.0  # _recent's blocked seconds, kept as it changes (summing each time was quadratic)

    def add(self, start: float, blocked: float) -> None:
        """Saves may be recorded out of start order (a lazy save's copy ends after a later save);
        blocked time added to a save recorded already (same ``start``) extends that save."""
        i = bisect.bisect_left(self._recent, (start,))
        if i < len(self._recent) and self._recent[i][0] == start:
            self._recent[i] = (start, self._recent[i][1] + blocked)
        else:
            self._recent.insert(i, (start, blocked))
        self._sum += blocked

    def share(self, now: float, t0: float) -> float:
        """The share at ``now``; ``t0``: when the run began (a run shorter than the window counts
        from there)."""
        ends = heapq.nlargest(2, (s + b for s, b in self._recent))
        # the second-last end only grows: a save dropped here is never inside a later window
        cut = min(now - self.window_s, ends[-1]) if len(ends) > 1 else now - self.window_s
        gone = 0
        while gone < len(self._recent) and sum(self._recent[gone]) < cut:
            self._sum -= self._recent[gone][1]
            gone += 1
        del self._recent[:gone]
        if not self._recent:
            self._sum = 0.0  # no rounding left over
        before = 0.0
        for s, b in self._recent:  # the saves that began before the window: the oldest few
            if s >= cut:
                break
            before += min(b, cut - s)
        span = now - max(cut, t0)
        return min(max(self._sum - before, 0.0) / span, 1.0) if span > 0 else 0.0


class Monitor:
    def __init__(self, budget: float, window_s: float, callback: Callable[[OverheadReport], None] | None = None,
                 waited: Callable[[], float] | None = None) -> None:
        """``waited``: seconds saves have waited so far for staging buffers held by older saves."""
        self.budget = budget
        self._waited = waited
        self.window_s = window_s
        self._callback = callback
        self._lock = threading.Lock()
        self._t0 = time.monotonic()  # the overhead's clock starts here, when the Checkpointer is built
        self.started_at = time.time()  # the same moment on the wall clock: the event log records it (``start_detail``)
        self._window = BlockedWindow(window_s)
        self.count = 0
        self.skipped = 0
        self.bytes = 0
        self.blocked_total = 0.0
        self.first_start: float | None = None
        self.over = False
        self.advised = False  # this crossing's alarm has given its advice
        self.alarms = 0
        self.last_blocked: float | None = None
        self.last_durable: float | None = None
        self._newest_durable_call: float | None = None  # wall time
        self._local = threading.local()  # .batch: the OneSave this thread has open

    def current(self) -> OneSave | None:
        """The ``one_save()`` the calling thread has open, or None."""
        return getattr(self._local, "batch", None)

    @contextlib.contextmanager
    def one_save(self, emit: Callable[..., None] | None = None) -> Iterator[OneSave]:
        """See ``Checkpointer.one_save``; nested in an open one, it is part of that one. ``emit``
        (the Checkpointer's): where the block logs its ``one_save`` event when it ends, after being
        counted, if any of its files logged a ``snapshot`` (``tagging``)."""
        if (outer := self.current()) is not None:
            yield outer
            return
        batch = self._local.batch = OneSave()
        try:
            yield batch
        finally:
            self._local.batch = None
            with self._lock:
                batch.open = False
                self.skipped += batch.skipped
                # nothing counted yet (only lazy saves, whose copies run on): the first one counts it
                done = batch.recorded = batch.start is not None
                if done:
                    report, crossed = self._account(batch.start, batch.blocked, batch.nbytes, True)  # type: ignore
            if done:
                self._announce(report, crossed)
            if emit is not None and batch.logged is not None:  # a zero span at its end: read_events sorts by start
                path, tier, nbytes, files = batch.logged
                emit("one_save", path, nbytes, time.time(), tier, detail=f"files={files}", block=batch.id)

    def tagging(self, emit: Callable[..., None]) -> Callable[..., None]:
        """``emit`` that names, on each ``snapshot`` event, the ``one_save()`` block the calling
        thread has open (snapshots are emitted on the thread that saves) and logs the file in it; a
        save that failed at the call (its snapshot event carries the error) is in no block."""

        def tagged(name: str, path: str, nbytes: int, start: float, tier: str, *args: object,
                   **kw: object) -> None:
            if name == "snapshot" and kw.get("error") is None and (batch := self.current()) is not None:
                batch.log(path, tier, nbytes)
                kw["block"] = batch.id
            emit(name, path, nbytes, start, tier, *args, **kw)

        return tagged

    def record_blocked(self, start: float, blocked_s: float, nbytes: int,
                       batch: OneSave | None | object = CALLER) -> None:
        """Called on the training thread when a save returns or fences, or on the snapshot thread
        when the copy of a lazy save that no fence took yet ends (``start`` is monotonic).
        ``batch``: the ``one_save()`` the save was made in (default: the calling thread's)."""
        batch = self.current() if batch is CALLER else batch
        with self._lock:
            if isinstance(batch, OneSave):
                if batch.open:  # counted when it closes
                    batch.add(start, blocked_s, nbytes)
                    return
                counted, batch.recorded = not batch.recorded, True  # a lazy save's copy that ended after it closed
                batch.add(start, blocked_s, nbytes)
                report, crossed = self._account(batch.start, batch.blocked, nbytes, counted,  # type: ignore[arg-type]
                                                None if counted else blocked_s)
            else:
                report, crossed = self._account(start, blocked_s, nbytes, True)
        self._announce(report, crossed)

    def _account(self, start: float, blocked_s: float, nbytes: int, counted: bool,
                 added: float | None = None) -> tuple[OverheadReport | None, bool]:
        """Under the lock: one save (``counted``), or ``added`` seconds more of one counted already
        (``blocked_s``: that save's, all told)."""
        now = time.monotonic()
        report, crossed = None, False
        self.count += counted
        self.bytes += nbytes
        self.blocked_total += blocked_s if added is None else added
        self.last_blocked = blocked_s
        self.first_start = self.first_start if self.first_start is not None else start
        self._window.add(start, blocked_s if added is None else added)
        if self.count < 2:
            return None, False
        wall = now - self._t0
        overhead = self.blocked_total / wall
        window = self._window.share(now, self._t0)
        self.over, crossed = crossing(self.over, max(overhead, window), self.budget)
        if crossed:
            self.advised = False
            self.alarms += 1
        if self.over and not self.advised and (crossed or self.count - 1 >= ADVICE_INTERVALS):
            report = self._report(start, wall, overhead, window)
            self.advised = report.intervals >= ADVICE_INTERVALS
        return report, crossed

    def _announce(self, report: OverheadReport | None, crossed: bool) -> None:
        """Outside the lock: the alarm's WARNING and the user's callback."""
        if report is not None:
            log.warning("fastckpt: %s", report.advice())
            if crossed and self._callback is not None:
                try:
                    self._callback(report)
                except Exception as exc:  # noqa: BLE001 (as a raising sink loses its event only: docs/overhead.md)
                    log.error("fastckpt: on_overhead_exceeded raised %r on this alarm; the save that crossed the "
                              "budget goes on and is written (fix the callback)", exc, exc_info=exc)

    def _report(self, start: float, wall: float, overhead: float, window: float) -> OverheadReport:
        interval = (start - (self.first_start or start)) / (self.count - 1)
        mean_b = self.blocked_total / self.count
        mean_bytes = self.bytes / self.count
        waited = self._waited() / self.count if self._waited is not None else 0.0
        return OverheadReport(overhead, window, self.budget, self.count, wall, self.blocked_total, interval, mean_b,
                              mean_bytes, mean_bytes / max(self.budget * interval, 1e-9), mean_b / self.budget, waited)

    def record_skipped(self) -> None:
        """A save skipped (``when_busy="skip"``); in a ``one_save()``, one for all its files."""
        batch = self.current()
        with self._lock:
            if batch is not None:
                batch.skipped = 1
            else:
                self.skipped += 1

    def record_durable(self, durable_s: float | None, call_wall: float | None = None) -> None:
        """A checkpoint became durable where it is kept (its path, or its replica), ``durable_s``
        after its save (or commit) was called; its state is the one saved at wall time
        ``call_wall`` (the RPO counts from there). ``durable_s`` None: its replication recorded it
        (a group's commit with a burst buffer); ``call_wall`` None: the RPO does not move (a
        group's file before its group is published)."""
        with self._lock:
            if durable_s is not None:
                self.last_durable = durable_s
            if call_wall is not None:
                self._newest_durable_call = max(self._newest_durable_call or 0.0, call_wall)

    def rpo_s(self) -> float | None:
        """Seconds of training a node loss would cost now: since the call of the newest save that
        is durable where it is kept; None before the first."""
        with self._lock:
            newest = self._newest_durable_call
        return None if newest is None else time.time() - newest

    def stats(self, pending: int, **extra: object) -> Stats:
        now, extra["rpo_s"] = time.monotonic(), self.rpo_s()
        with self._lock:
            wall = now - self._t0
            return Stats(self.count, self.skipped, self.bytes, self.blocked_total, wall,
                         self.blocked_total / wall if wall > 0 else 0.0, self._window.share(now, self._t0),
                         self.budget, self.over, self.alarms, self.last_blocked,
                         self.last_durable, pending, **extra)
