"""The Monitor's overhead rule replayed from an event log (``runstate``, and through it ``fastckpt
report`` and ``serve-metrics``): one save per ``snapshot`` event, or per ``Checkpointer.one_save()``
block, as the Monitor counts it (``fastckpt.onesave``).

A block's files name it on their ``snapshot`` events (``block``); the block logs a ``one_save``
event when it ends (a zero span then, after its files' events in start order too). The replay sums
the files' blocked time (their ``snapshot`` phases) and bytes and counts the block once, at that
event, its start the first file's. A log written before blocks were logged has no ``block``: each
file is a save there, as before.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from .events import Event
from .monitor import BlockedWindow, crossing

_OPEN_BLOCKS_KEPT = 16  # per Checkpointer (rank, session): blocks whose one_save event has not come, newest kept


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
                                        b.files + 1)
        while len(mine) > _OPEN_BLOCKS_KEPT:
            mine.popitem(last=False)

    def close(self, ev: Event) -> BlockSave | None:
        """The block a ``one_save`` event ends: its files summed (None: none of them is in the log)."""
        mine = self._open.get((ev.rank, ev.session))
        if mine is None:
            return None
        b = mine.pop(str(ev.block), None)
        if not mine:
            del self._open[(ev.rank, ev.session)]
        return b


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

    def record(self, start: float, blocked: float, now: float) -> None:
        self.t0 = start if self.t0 is None else self.t0
        self.count += 1
        self.blocked += blocked
        self._window.add(start, blocked)
        if self.count < 2:
            return
        overhead = self.blocked / (now - self.t0) if now > self.t0 else 0.0
        window = self.window(now)
        self.over, crossed = crossing(self.over, max(overhead, window), self.budget)
        self.alarms += crossed
        self.points.append(OverheadPoint(now, overhead, window, self.over))


class RankOverheads:
    """Each rank's ``OverheadReplay``, fed the log's ``snapshot`` and ``one_save`` events.

    Args:
        budget: the overhead budget the alarm is replayed against.
        window_s: the sliding window of the overhead (the Checkpointer's ``overhead_window_s``).
        keep: the newest points of each curve to keep (None: all).
    """

    def __init__(self, budget: float, window_s: float, keep: int | None = None) -> None:
        self.budget, self.window_s, self._keep = budget, window_s, keep
        self.replays: dict[int, OverheadReplay] = {}
        self._blocks = Blocks()

    def new(self) -> OverheadReplay:
        return OverheadReplay(self.budget, self.window_s, self._keep)

    def feed(self, ev: Event) -> None:
        """A ``snapshot`` that succeeded (a save, or a file of a block), or a block's ``one_save``."""
        if ev.name == "snapshot" and ev.block is not None:
            return self._blocks.add(ev)  # counted when its block ends
        if ev.name == "snapshot":
            start, blocked = ev.start, ev.duration_s
        elif (block := self._blocks.close(ev)) is not None:
            start, blocked = block.start, block.blocked_s
        else:
            return
        self.replays.setdefault(ev.rank, self.new()).record(start, blocked, ev.end)

    def new_session(self, rank: int) -> None:
        """A rank's new Checkpointer, so a new Monitor; but the curve and the alarm count go on."""
        old = self.replays.get(rank)
        if old is not None:
            self.replays[rank] = new = self.new()
            new.points, new.alarms = old.points, old.alarms
