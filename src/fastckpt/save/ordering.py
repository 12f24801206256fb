"""The call order that single files become final in with ``replicate_in_order=True``.

Why: a reader that picks "the newest" file by its modification time (Lightning's
``ckpt_path="last"``), or trusts a file that names another one (``last.ckpt``'s
``best_model_path``), assumes what a plain ``torch.save`` loop gives: each file is final at its
path only after every file saved before it. The Replicator copies ``replicate_workers`` files at
once, and with several burst-buffer drives a later save's local write can end first, so without
this a later file can land first and a kill then leaves it naming one that never arrived.

How: ``Saver`` registers every single file it sends through the burst buffer while ``save()``
runs (on the training thread, so the keys follow the calls), and the registration ends when that
save's handle future resolves, however it does (replicated, failed, cancelled, superseded, or
refused by a closed Replicator). A replica job then starts only when no earlier registration is
still open; an earlier save whose local write is still running counts. Waiting jobs stay queued
and occupy no worker thread (``Replicator._next`` skips them), so none can deadlock; each file's
own copy stays parallel (chunked or multipart).

A single file written straight to its path (it skipped a full burst buffer, or ran out of room
there mid-write) takes its place the same way (``Turn``): its writer thread waits for its turn
just before the rename that makes it final. No deadlock: the key is taken as the write is queued
(one lock), so every earlier save's write is ahead of it on its writer thread or runs on another
drive's, and each waits only for earlier keys. A failed earlier save ends its registration like
any other outcome, so it never holds later files back.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future


class CallOrder:
    """Open registrations, by call order; every method is called with ``cv``'s lock held or takes it."""

    def __init__(self, cv: threading.Condition) -> None:
        self._cv = cv
        self._next = 0
        self._open: set[int] = set()

    def hold(self, until: Future) -> int:
        """Register a save now; the registration ends when ``until`` resolves. Returns its key."""
        with self._cv:
            key = self._next
            self._next += 1
            self._open.add(key)
        until.add_done_callback(lambda _: self._release(key))
        return key

    def _release(self, key: int) -> None:
        with self._cv:
            self._open.discard(key)
            self._cv.notify_all()  # a later job may start now

    def ready(self, key: int | None) -> bool:
        """Whether the job registered as ``key`` may start: no earlier save is still open."""
        return key is None or not any(k < key for k in self._open)

    def wait(self, key: int | None) -> None:
        """Block until ``key`` is ``ready`` (a direct write's rename, ``Turn.wait``)."""
        with self._cv:
            while not self.ready(key):
                self._cv.wait()


class Turn:
    """One single-file save's place in the call order, whichever way it is written: ``take``
    registers it (as its write is queued), ``until`` ends the registration when the save's
    handle resolves, ``end`` at once (the save raised, or was skipped)."""

    def __init__(self, order: CallOrder) -> None:
        self._order, self._ended, self._lock = order, Future(), threading.Lock()
        self.key: int | None = None

    def take(self) -> None:
        self.key = self._order.hold(self._ended)

    def until(self, fut: Future) -> None:
        fut.add_done_callback(lambda _: self.end())

    def end(self) -> None:
        with self._lock:
            if not self._ended.done():
                self._ended.set_result(None)

    def wait(self) -> None:
        """Wait until every single file saved before this one is final at its path, or failed."""
        self._order.wait(self.key)
