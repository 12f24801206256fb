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


class OverheadReplay:
    """``Monitor.record_blocked`` replayed from an event log (``runstate``): the same rule."""

    def __init__(self, budget: float, window_s: float, keep: int | None = None) -> None:
        self.budget, self.window_s = budget, window_s
        self.t0: float | None = None
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


def parse_start(detail: str | None) -> tuple[float | None, float | None]:
    """A ``start`` event's ``detail`` (``events.start_detail``) -> the job's (overhead_budget,
    overhead_window_s); None for one it does not hold as a valid value."""
    def value(key: str, ok: Callable[[float], bool]) -> float | None:
        m = re.search(rf"\b{key}=(\S+)", detail or "")
        try:
            v = float(m.group(1)) if m else None
        except ValueError:
            return None
        return v if v is not None and math.isfinite(v) and ok(v) else None

    return value("overhead_budget", lambda b: 0 < b < 1), value("overhead_window_s", lambda w: w > 0)


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
        self._blocks, self._unfenced = Blocks(), LazySnapshots()

    def options(self, rank: int) -> tuple[float, float]:
        """The budget and window ``rank``'s alarm is replayed with: those given, else its job's."""
        budget, window_s = self.logged.get(rank, (None, None))
        return self.budget or budget or DEFAULT_BUDGET, self.window_s or window_s or DEFAULT_WINDOW_S

    def new(self, rank: int) -> OverheadReplay:
        return OverheadReplay(*self.options(rank), self._keep)

    def started(self, ev: Event) -> None:
        """A ``start`` event: the options of the rank's new Checkpointer, for its replay from now on."""
        self.logged[ev.rank] = parse_start(ev.detail)
        self.new_session(ev.rank)

    def feed(self, ev: Event) -> None:
        """A ``snapshot`` that succeeded (a save, or a file of a block), a block's ``one_save``, or a
        lazy save's ``fence``."""
        counted = True
        if ev.name == "snapshot" and ev.block is not None:
            return self._blocks.add(ev)  # counted when its block ends
        if ev.name == "snapshot" and ev.detail == LAZY:  # counted at its fence event
            for old in self._unfenced.hold(ev):
                self._record(old.rank, old.start, old.duration_s, old.end)
            return
        if ev.name == "snapshot":
            start, blocked = ev.start, ev.duration_s
        elif ev.name == "fence" and ev.block is not None and self._blocks.fenced(ev):
            return  # its block is still open: counted when it ends
        elif ev.name == "fence" and (lazy := self._unfenced.fenced(ev)) is not None:
            start, blocked = lazy.start, lazy.duration_s + ev.duration_s
        elif ev.name == "fence":  # its block was counted, or its snapshot is before the log's start: the wait adds
            start, blocked, counted = saved_at(ev) or ev.start, ev.duration_s, False
        elif (block := self._blocks.close(ev)) is not None:
            start, blocked = block.start, block.blocked_s
        else:
            return
        self._record(ev.rank, start, blocked, ev.end, counted)

    def _record(self, rank: int, start: float, blocked: float, now: float, counted: bool = True) -> None:
        if rank not in self.replays:
            self.replays[rank] = self.new(rank)
        self.replays[rank].record(start, blocked, now, counted)

    def new_session(self, rank: int) -> None:
        """A rank's new Checkpointer, so a new Monitor; but the curve and the alarm count go on."""
        old = self.replays.get(rank)
        if old is not None:
            self.replays[rank] = new = self.new(rank)
            new.points, new.alarms = old.points, old.alarms
