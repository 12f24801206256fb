"""The lazy saves that no ``fence()`` has taken yet, and when each one's blocked time is counted.

``Checkpointer.save(lazy=True)`` returns before the state's bytes are copied (``save.saver``); the copy runs on
the snapshot thread. The save is counted (``Monitor.record_blocked``) once its blocked time is final: at the
``fence()`` that waited for its copy (the wait added to the first save the fence takes), or when its copy ends
if no fence took it first. Then it logs a ``fence`` event, so that the readers of the events (the metrics
exporter, the log's replay) count the same blocked time as ``stats()``: its span is the wait it added (zero
for none), ``detail`` ``saved_at=<its snapshot's start>`` names the save, and its ``snapshot`` event's
``detail`` is ``LAZY`` (``events``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..monitor import Monitor
from .snapshot import Unfenced, order_before


class LazyCopies:
    """The Saver's lazy saves until each is counted. ``emit`` is the Checkpointer's (an event per counted save)."""

    def __init__(self, monitor: Monitor, emit: Callable[..., None]) -> None:
        self._monitor, self._emit = monitor, emit
        self._lock = threading.Lock()
        self._lazy: list[Unfenced] = []

    def add(self, entry: Unfenced) -> None:
        """A lazy save whose copy (``entry.copy``) was queued: a fence from now on waits for it."""
        with self._lock:
            self._lazy.append(entry)

    def watch(self, entry: Unfenced, counted: Future) -> None:
        """Count ``entry`` when its copy ends, unless a fence took it first (once its snapshot event was
        emitted: the fence event follows it); ``counted`` then gets the copy's outcome."""
        entry.copy.add_done_callback(functools.partial(self._copied, entry, counted))  # type: ignore[union-attr]

    def _copied(self, entry: Unfenced, counted: Future, copy: Future) -> None:
        """A lazy copy ended (snapshot thread). If no fence took it yet: let its snapshot go, so a
        loop that never fences (it waits on handles instead) does not hold one state per save,
        and count the save now, with the time its call blocked (a fence after this waits for
        nothing; a CUDA copy's events stay for it). Then ``counted`` gets the copy's outcome:
        the save is counted before its writer, and so its handle, can go on."""
        try:
            with self._lock:
                if all(e is not entry for e in self._lazy):
                    return  # a fence took it: the fence counts it, with its wait
                entry.copy = None
                if not copy.cancelled() and copy.exception() is None:  # failed: the write stage re-raises it
                    entry.cuda_events = copy.result().cuda_events
                if not entry.cuda_events:
                    self._lazy.remove(entry)
            self._counted(entry, 0.0)
        finally:
            if copy.cancelled():  # by a close() that gave up waiting: the writer must not wait for ever
                counted.cancel()
            elif (exc := copy.exception()) is not None:
                counted.set_exception(exc)
            else:
                counted.set_result(copy.result())

    def fence(self) -> float:
        """Wait until every lazy save has copied its tensors; return the seconds waited (counted
        as blocked time). A failed copy surfaces through its save's handle."""
        with self._lock:
            lazy, self._lazy = self._lazy, []
        t0 = time.monotonic()
        for e in lazy:
            if e.copy is not None and not e.copy.cancelled() and e.copy.exception() is None:  # failed: writer raises
                e.cuda_events = e.copy.result().cuda_events
            order_before(e.cuda_events)  # CUDA: the next kernels wait for the copy on the GPU
        waited = time.monotonic() - t0
        for i, e in enumerate(e for e in lazy if e.copy is not None):  # the others were counted when they ended
            self._counted(e, waited if i == 0 else 0.0)
        return waited

    def _counted(self, e: Unfenced, added: float) -> None:
        """Count the save ``e``, ``added`` seconds of a fence's wait on top of its call's, and log its fence event."""
        self._monitor.record_blocked(e.t_call, e.blocked + added, e.nbytes, e.batch)
        self._emit("fence", e.path, 0, time.time() - added, e.tier, detail=f"saved_at={e.w_call!r}", group=e.group,
                   block=None if e.batch is None else e.batch.id)
