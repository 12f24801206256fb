"""Several files that are one checkpoint, counted as one save by the overhead monitor.

A framework's checkpoint is often several files (Megatron: a tensor file and an objects file per
rank and an index; DeepSpeed: model and optimizer files). Saved one by one, each was a "save" for
the ``Monitor``: the first checkpoint of a run raised the overhead alarm (its files, milliseconds
apart, gave the "interval"), and the advice sized the interval between two files of one checkpoint.
``Checkpointer.one_save()`` opens a ``OneSave`` on the calling thread; the monitor sums what its
saves blocked into it and counts it once (docs/overhead.md). Its files' ``snapshot`` events name it
(``block``), and it logs a ``one_save`` event when it ends, so the event log's readers count it once too.
"""

from __future__ import annotations

import os

CALLER = object()  # record_blocked's batch: the one the calling thread has open


class OneSave:
    """Files saved in one ``Checkpointer.one_save()``: one save for the monitor (blocked time and
    bytes summed, the interval from its first file's start), counted when it closes; a lazy
    file whose copy ends later adds its blocked time to it then (or counts it, if none did).
    ``id`` names it on its files' events; ``logged`` holds what they logged: (first path, its
    tier, bytes, files), for the ``one_save`` event it ends with."""

    def __init__(self) -> None:
        self.open, self.recorded, self.skipped = True, False, 0
        self.start: float | None = None
        self.blocked, self.nbytes = 0.0, 0
        self.id = os.urandom(6).hex()  # random: blocks of several Checkpointers in one log never meet
        self.logged: tuple[str, str, int, int] | None = None

    def add(self, start: float, blocked_s: float, nbytes: int) -> None:
        self.start = start if self.start is None else min(self.start, start)
        self.blocked += blocked_s
        self.nbytes += nbytes

    def log(self, path: str, tier: str, nbytes: int) -> None:
        """A file's ``snapshot`` event is emitted (on the thread that opened the block)."""
        p, t, b, n = self.logged or (path, tier, 0, 0)
        self.logged = (p, t, b + nbytes, n + 1)
