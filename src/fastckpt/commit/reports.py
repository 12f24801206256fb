"""The saves one rank started, reported to the other ranks through torch.distributed's store.

Where rank 0 alone saves (Lightning's DDP), a save that returned on rank 0 is written by its
background threads while training goes on. If another rank fails, the launcher kills every
rank within seconds (Lightning's subprocess launcher: within about 5 s of the failed rank's
exit; torchrun likewise), while rank 0's training thread is stuck in the next collective and
never reaches its own flush: the save is lost. So the failed rank holds its exit until rank 0's
saves have ended (``wait``). Rank 0's training thread cannot say when: only the threads that end
its saves can, and store calls (unlike collectives) are safe from any thread.

Keys, under ``fastckpt/reports/<n>/`` (``n``: one number per fit, from ``FITS``, which the
saving rank draws and hands to the others, so a launch never reads a dead one's counts):

  ``started``   the saving rank adds 1 as each save returns (its training thread)
  ``ended``     it adds 1 as each save ends: durable, failed, skipped or never written (the
                thread that ended it: ``SaveHandle.add_done_callback``)
  ``ended/<m>`` set when ``ended`` reaches m, so a waiter blocks on one key instead of polling;
                the two newest are kept, the older deleted
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from ..records import SaveHandle
from .waits import WAIT_SLICE_S, Waits, store_errors

log = logging.getLogger("fastckpt")
FITS = "fastckpt/reports/fits"
RECHECK_S = WAIT_SLICE_S  # each c10d wait that times out logs two lines: counted again at this pace


class SaveReports:
    """One fit's reports (see the module docstring). Order of calls: every rank ``agree``s
    (the training thread, where the framework's broadcast is safe); the saving rank calls
    ``started`` for each save; a rank that fails calls ``wait`` before it exits.

    Args:
        store: a ``torch.distributed.Store`` every rank shares.
        number: this fit's number (``agree``).
    """

    def __init__(self, store: object, number: int) -> None:
        self._store, self._prefix = store, f"fastckpt/reports/{number}/"
        self._broken = False

    @classmethod
    def agree(cls, store: object | None, saver: bool, share: Callable[[int | None], int | None]) -> SaveReports | None:
        """Every rank: the saving rank (``saver``) draws a fit number from ``store`` and ``share``
        (the framework's broadcast from it, a collective) hands it to every rank. None without a
        store."""
        number = store.add(FITS, 1) if saver and store is not None else None
        number = share(number)
        return cls(store, number) if store is not None and number is not None else None

    def started(self, handle: SaveHandle) -> None:
        """The saving rank, as ``handle``'s save returns: count it, and report it once it ends."""
        if self._call(lambda s: s.add(self._prefix + "started", 1)) is not None:
            handle.add_done_callback(self._ended)

    def _ended(self, handle: SaveHandle) -> None:
        """The thread that ended ``handle``'s save (a writer, the replicator): report it."""
        m = self._call(lambda s: s.add(self._prefix + "ended", 1))
        if m is not None:
            self._call(lambda s: s.set(f"{self._prefix}ended/{m}", b"1"))
            if m > 2:
                self._call(lambda s: s.delete_key(f"{self._prefix}ended/{m - 2}"))

    def _call(self, call: Callable[[object], object]) -> object | None:
        """``call(store)``; None, with one WARNING, once the store stopped answering: saves go on
        unreported (a failed rank then exits without waiting for them)."""
        if self._broken:
            return None
        try:
            return call(self._store)
        except store_errors()[1] as exc:
            self._broken = True
            log.warning("fastckpt: could not report this rank's saves to the other ranks through the "
                        "torch.distributed store (%s): a rank that fails now exits without waiting for them", exc)
            return None

    def _counts(self) -> tuple[int, int] | None:
        """(saves started, saves ended) so far, or None (``_call``)."""
        return self._call(lambda s: (s.add(self._prefix + "started", 0), s.add(self._prefix + "ended", 0)))

    def wait(self, timeout_s: float | None) -> int:
        """A rank that failed, before it exits: block until every save the saving rank started has
        ended, up to ``timeout_s`` (None: as long as they take). Returns how many had not ended
        (0: none; a WARNING says so otherwise)."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        waits, stop, told = Waits.of(self._store), threading.Event(), False
        while (counts := self._counts()) is not None and counts[1] < counts[0]:
            n, m = counts
            if time.monotonic() >= deadline:
                log.warning("fastckpt: gave up waiting for %d checkpoint save(s) rank 0 started (close_timeout_s=%s): "
                            "they may be lost when the launcher stops rank 0", n - m, timeout_s)
                return n - m
            if not told:
                told = True
                log.warning("fastckpt: waiting (close_timeout_s=%s) for %d checkpoint save(s) rank 0 started to end "
                            "before this rank exits: the launcher then stops rank 0 too", timeout_s, n - m)
            try:  # the n-th save to end sets ended/<n>, whichever it is; counted again each RECHECK_S, as
                # saves started and ended since the count may have deleted ended/<n> (only two are kept)
                waits.wait(f"{self._prefix}ended/{n}", min(deadline, time.monotonic() + RECHECK_S), stop, WAIT_SLICE_S)
            except store_errors()[1] as exc:  # the store's host (rank 0) is gone: nothing left to wait for
                log.warning("fastckpt: stopped waiting for rank 0's saves: the store stopped answering (%s)", exc)
                return n - m
        return 0
