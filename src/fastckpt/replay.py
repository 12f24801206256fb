"""The Monitor's overhead rule replayed from an event log (``runstate``, and through it ``fastckpt
report`` and ``serve-metrics``): one save per ``snapshot`` event, or per ``Checkpointer.one_save()``
block, as the Monitor counts it (``fastckpt.onesave``).

A block's files name it on their ``snapshot`` events (``block``); the block logs a ``one_save``
event when it ends (a zero span then, after its files' events in start order too). The replay sums
the files' blocked time (their ``snapshot`` phases) and bytes and counts the block once, at that
event, its start the first file's. A log written before blocks were logged has no ``block``: each
file is a save there, as before.

A lazy save's ``snapshot`` (``detail`` ``events.LAZY``) is counted at its ``fence`` event, as the
Monitor counts it (``save.lazy``): its blocked time the snapshot's plus the fence event's span (the
fence's wait); a fence after the block of a lazy file ended adds its wait to that counted block.

The clock starts where the Monitor's does, when the Checkpointer was built: its session's ``start``
event records that time (``started_at``), which may be long before its first save (the model's
build, a restore, the steps before it). A log written before fastckpt recorded it starts the clock
at the session's first save, as before (its overhead reads higher than the job's).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from .events import LAZY, Event
from .monitor import BlockedWindow, crossing

DEFAULT_BUDGET = 0.02  # a log's Checkpointer's, when its log does not say (written before ``start`` events)
DEFAULT_WINDOW_S = 3600.0
_OPEN_BLOCKS_KEPT = 16  # per Checkpointer (rank, session): blocks whose one_save event has not come, newest kept
_UNFENCED_KEPT = 1024  # lazy saves whose fence event has not come, over all ranks
_FENCING_KEPT = 64  # ended blocks waiting for the fence events of their lazy files, over all ranks


@dataclass(frozen=True)
class OverheadPoint:
    """The Monitor's numbers after one save: run and window overhead, and the alarm state."""

    t: float
    overhead: float
    window_overhead: float
    over_budget: bool


@dataclass(frozen=True)
class BlockSave:
    """The files of one ``one_save()`` block seen so far: one save."""

    start: float
    blocked_s: float
    bytes: int
    files: int
    lazy: int = 0  # its lazy files whose fence event has not come yet


class Blocks:
    """The files of ``one_save()`` blocks, summed per (rank, session, block) until the block's
    ``one_save`` event closes it. Kept per (rank, session): a job killed in a block leaves it open,
    so each Checkpointer keeps its newest few; a cap over all of them dropped open blocks of the
    ranks of a job larger than it (every rank has one open at each checkpoint)."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, str | None], OrderedDict[str, BlockSave]] = {}

    def add(self, ev: Event) -> None:
        """A ``snapshot`` of a file saved in a block (``ev.block`` set)."""
        mine = self._open.setdefault((ev.rank, ev.session), OrderedDict())
        b = mine.get(str(ev.block)) or BlockSave(ev.start, 0.0, 0, 0)
        mine[str(ev.block)] = BlockSave(min(b.start, ev.start), b.blocked_s + ev.duration_s, b.bytes + ev.bytes,
                                        b.files + 1, b.lazy + (ev.detail == LAZY))
        while len(mine) > _OPEN_BLOCKS_KEPT:
            mine.popitem(last=False)

    def fenced(self, ev: Event) -> bool:
        """A ``fence`` event of a lazy file of a block: its wait is added to the block if it is open (True)."""
        b = self._open.get((ev.rank, ev.session), {}).get(str(ev.block))
        if b is not None:
            self._open[(ev.rank, ev.session)][str(ev.block)] = fence_block(b, ev)
        return b is not None

    def close(self, ev: Event) -> BlockSave | None:
        """The block a ``one_save`` event ends: its files summed (None: none of them is in the log)."""
        mine = self._open.get((ev.rank, ev.session))
        if mine is None:
            return None
        b = mine.pop(str(ev.block), None)
        if not mine:
            del self._open[(ev.rank, ev.session)]
        return b


def fence_block(b: BlockSave, ev: Event) -> BlockSave:
    """``b`` with the ``fence`` event of one of its lazy files: its wait added, that file no longer waited for."""
    return BlockSave(b.start, b.blocked_s + ev.duration_s, b.bytes, b.files, max(0, b.lazy - 1))


def saved_at(ev: Event) -> float | None:
    """The save call a ``superseded`` or ``fence`` event names (its snapshot's start), if it does."""
    m = re.match(r"saved_at=(\S+)", ev.detail or "")
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


class LazySnapshots:
    """Lazy saves (their ``snapshot``'s ``detail`` is ``LAZY``) whose ``fence`` event has not come,
    per (rank, session, path, start): the newest ``_UNFENCED_KEPT`` (a job killed before its fence
    leaves its last ones); ``hold`` gives back an older one, to be counted as it is."""

    def __init__(self) -> None:
        self._held: OrderedDict[tuple[int, str | None, str, float], Event] = OrderedDict()

    def hold(self, ev: Event) -> list[Event]:
        self._held[(ev.rank, ev.session, ev.path, ev.start)] = ev
        return [self._held.popitem(last=False)[1] for _ in range(len(self._held) - _UNFENCED_KEPT)]

    def fenced(self, ev: Event) -> Event | None:
        """The snapshot of the lazy save a ``fence`` event counts (None: not held)."""
        return self._held.pop((ev.rank, ev.session, ev.path, saved_at(ev) or 0.0), None)


@dataclass(frozen=True)
class Counted:
    """What one event adds to its rank's saves, as the Monitor counts them (``SaveCounter``)."""

    rank: int
    tier: str
    start: float  # the save's: its call's (a block's: its first file's)
    now: float  # when it is counted: the event's end
    added_s: float  # blocked seconds this adds
    blocked_s: float  # the save's blocked seconds, all told so far
    new: bool  # a save counted now (False: more blocked time of one counted already)
    final: bool  # its blocked time grows no more (a histogram observes it now)


class SaveCounter:
    """The one rule by which the log's readers count saves and their blocked time, as the Monitor
    does: the overhead replay (``RankOverheads``, for ``fastckpt report`` and ``serve-metrics``)
    and the exporter's histograms (``metrics.sink``) both feed it each event and take what it
    counted. A save is counted (``new``) at its ``snapshot`` event; a lazy one at its ``fence``
    event; a ``one_save()`` block at its ``one_save`` event. A block's lazy file fenced after the
    block ended adds its wait (not ``new``); the block is ``final`` once every such file's fence
    came (a block of a job killed before then, once ``_FENCING_KEPT`` newer ones wait: as it is)."""

    def __init__(self) -> None:
        self._blocks, self._unfenced = Blocks(), LazySnapshots()
        # ended blocks whose lazy files' fence events have not all come: final once they have
        self._fencing: OrderedDict[tuple[int, str | None, str | None], tuple[str, BlockSave]] = OrderedDict()

    def feed(self, ev: Event) -> list[Counted]:
        """A ``snapshot`` that succeeded (a save, or a file of a block), a block's ``one_save``, or a
        lazy save's ``fence``; any other event counts nothing."""
        if ev.name == "snapshot" and ev.error is None and ev.block is not None:
            self._blocks.add(ev)  # counted when its block ends
        elif ev.name == "snapshot" and ev.error is None and ev.detail == LAZY:  # counted at its fence event
            return [_as_is(old.rank, old.tier, old.start, old.duration_s, old.end) for old in self._unfenced.hold(ev)]
        elif ev.name == "snapshot" and ev.error is None:
            return [_as_is(ev.rank, ev.tier, ev.start, ev.duration_s, ev.end)]
        elif ev.name == "one_save" and (block := self._blocks.close(ev)) is not None:
            return self._ended((ev.rank, ev.session, ev.block), ev, block)
        elif ev.name == "fence":
            return self._fenced(ev)
        return []

    def _fenced(self, ev: Event) -> list[Counted]:
        if ev.block is not None and self._blocks.fenced(ev):
            return []  # its block is still open: counted when it ends
        key = (ev.rank, ev.session, ev.block)
        if ev.block is not None and (held := self._fencing.get(key)) is not None:
            b = fence_block(held[1], ev)
            if b.lazy:
                self._fencing[key] = (held[0], b)
            else:
                del self._fencing[key]
            return [Counted(ev.rank, held[0], b.start, ev.end, ev.duration_s, b.blocked_s, False, not b.lazy)]
        if ev.block is None and (lazy := self._unfenced.fenced(ev)) is not None:
            return [_as_is(ev.rank, lazy.tier, lazy.start, lazy.duration_s + ev.duration_s, ev.end)]
        # its block was final, or its snapshot is before the log's start: the wait adds to the overhead
        return [Counted(ev.rank, ev.tier, saved_at(ev) or ev.start, ev.end, ev.duration_s, ev.duration_s, False,
                        False)]

    def _ended(self, key: tuple[int, str | None, str | None], ev: Event, block: BlockSave) -> list[Counted]:
        """A block that ended: counted; final unless its lazy files' fence events are still to come."""
        out = [Counted(ev.rank, ev.tier, block.start, ev.end, block.blocked_s, block.blocked_s, True, not block.lazy)]
        if block.lazy:
            self._fencing[key] = (ev.tier, block)
        while len(self._fencing) > _FENCING_KEPT:  # a job killed before its fence: final as it is
            (rank, _, _), (tier, b) = self._fencing.popitem(last=False)
            out.append(Counted(rank, tier, b.start, ev.end, 0.0, b.blocked_s, False, True))
        return out


def _as_is(rank: int, tier: str, start: float, blocked_s: float, now: float) -> Counted:
    """A save counted once, its blocked time final."""
    return Counted(rank, tier, start, now, blocked_s, blocked_s, True, True)


class OverheadReplay:
    """``Monitor.record_blocked`` replayed from an event log (``runstate``): the same rule."""

    def __init__(self, budget: float, window_s: float, keep: int | None = None, t0: float | None = None) -> None:
        """``t0``: when the Checkpointer was built (its ``start`` event's ``started_at``); None: at the first save."""
        self.budget, self.window_s = budget, window_s
        self.t0 = t0
        self.count = 0
        self.blocked = 0.0
        self.over = False
        self.alarms = 0
        self.points: deque[OverheadPoint] = deque(maxlen=keep)  # keep: the newest only (a live exporter)
        self._window = BlockedWindow(window_s)

    def window(self, now: float) -> float:
        return self._window.share(now, self.t0 if self.t0 is not None else now)

    def record(self, start: float, blocked: float, now: float, counted: bool = True) -> None:
        """A save (``counted``), or ``blocked`` seconds more of the one counted at ``start``."""
        self.t0 = start if self.t0 is None else self.t0
        self.count += counted
        self.blocked += blocked
        self._window.add(start, blocked)
        if self.count < 2:
            return
        overhead = self.blocked / (now - self.t0) if now > self.t0 else 0.0
        window = self.window(now)
        self.over, crossed = crossing(self.over, max(overhead, window), self.budget)
        self.alarms += crossed
        self.points.append(OverheadPoint(now, overhead, window, self.over))


def parse_start(detail: str | None) -> tuple[float | None, float | None, float | None]:
    """A ``start`` event's ``detail`` (``events.start_detail``) -> the job's (overhead_budget,
    overhead_window_s, started_at); None for one it does not hold as a valid value (a log written
    before fastckpt recorded ``started_at`` holds none)."""
    def value(key: str, ok: Callable[[float], bool]) -> float | None:
        m = re.search(rf"\b{key}=(\S+)", detail or "")
        try:
            v = float(m.group(1)) if m else None
        except ValueError:
            return None
        return v if v is not None and math.isfinite(v) and ok(v) else None

    return (value("overhead_budget", lambda b: 0 < b < 1), value("overhead_window_s", lambda w: w > 0),
            value("started_at", lambda t: t > 0))


class RankOverheads:
    """Each rank's ``OverheadReplay``, fed the log's ``snapshot`` and ``one_save`` events.

    Args:
        budget: the overhead budget the alarm is replayed against (None: each rank's job's, from
            its ``start`` event; ``DEFAULT_BUDGET`` for a log without).
        window_s: the sliding window of the overhead (the Checkpointer's ``overhead_window_s``;
            None: the job's, as ``budget``).
        keep: the newest points of each curve to keep (None: all).
    """

    def __init__(self, budget: float | None, window_s: float | None, keep: int | None = None) -> None:
        self.budget, self.window_s, self._keep = budget, window_s, keep
        self.replays: dict[int, OverheadReplay] = {}
        self.logged: dict[int, tuple[float | None, float | None]] = {}  # rank -> its newest start event's options
        self._built: dict[int, float] = {}  # rank -> when its session's Checkpointer was built (its start event)
        self._counter = SaveCounter()

    def options(self, rank: int) -> tuple[float, float]:
        """The budget and window ``rank``'s alarm is replayed with: those given, else its job's."""
        budget, window_s = self.logged.get(rank, (None, None))
        return self.budget or budget or DEFAULT_BUDGET, self.window_s or window_s or DEFAULT_WINDOW_S

    def budget_of(self, rank: int) -> tuple[float, str]:
        """``rank``'s budget (``options``) and where it comes from: "given", "job" (its ``start``) or "default"."""
        logged = self.logged.get(rank, (None, None))[0]
        return self.options(rank)[0], "given" if self.budget else "job" if logged else "default"

    def new(self, rank: int) -> OverheadReplay:
        return OverheadReplay(*self.options(rank), self._keep, self._built.get(rank))

    def started(self, ev: Event) -> None:
        """A ``start`` event: the options of the rank's new Checkpointer, and when it was built (the
        clock of its replay), for its replay from now on."""
        budget, window_s, built = parse_start(ev.detail)
        self.logged[ev.rank] = (budget, window_s)
        self._restart(ev.rank, built)

    def feed(self, ev: Event) -> None:
        """An event of the log; ``SaveCounter`` says what it counts."""
        for c in self._counter.feed(ev):
            self._record(c.rank, c.start, c.added_s, c.now, c.new)

    def _record(self, rank: int, start: float, blocked: float, now: float, counted: bool = True) -> None:
        if rank not in self.replays:
            self.replays[rank] = self.new(rank)
        self.replays[rank].record(start, blocked, now, counted)

    def new_session(self, rank: int) -> None:
        """A rank's new Checkpointer, so a new Monitor; but the curve and the alarm count go on. Its
        clock starts at its first save, unless its ``start`` event (fed next) says when it was built."""
        self._restart(rank, None)

    def _restart(self, rank: int, built: float | None) -> None:
        if built is None:
            self._built.pop(rank, None)
        else:
            self._built[rank] = built
        old = self.replays.get(rank)
        if old is not None:
            self.replays[rank] = new = self.new(rank)
            new.points, new.alarms = old.points, old.alarms
