"""Whether uploads of a single file run behind its saves.

A queued upload of a single file is dropped when a newer save of the same path arrives (its
bytes in the burst buffer are replaced anyway: ``Replicator.submit``), unless it keeps them
under a version link (``save.versions``: with ``replicate_in_order`` and "all", where the burst
buffer makes hard links). While uploads run behind the saves, a file saved every step
(Lightning's ``last.ckpt``) is dropped again and again: none of its saves reaches the path until
the uploads catch up, and the file there stays the one from before, or none. Waiting in order
without version links cannot help (each save waits for those before it), so the run is told,
once per such streak: resume from ``latest()``, which names the newest file that did land, not
from that path by name.

A drop while an upload of the same path that keeps its own bytes is queued or running (a version
link, ``save.versions``: the oldest queued save of it) is not counted: that upload lands in its
turn, so the file at the path moves on, trailing the saves by the backlog, and nothing starves.
Counted, they made the WARNING fire on every backlog of a Lightning run (FastCkptIO's settings)
and say what did not happen.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("fastckpt")

WARN_AT = 3  # saves of one path dropped in a row before the WARNING


class Behind:
    """Saves of each single file dropped in a row for newer ones, since one of them landed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped: dict[str, int] = {}  # only paths with a streak: a landed upload removes its entry

    def dropped(self, path: str) -> None:
        """A save of ``path`` was dropped for a newer one before its upload started."""
        with self._lock:
            n = self._dropped[path] = self._dropped.get(path, 0) + 1
        if n == WARN_AT:
            log.warning("fastckpt: %s was saved %d times in a row before an upload of it started, each dropped for "
                        "the next: uploads run behind the saves, so the file at that path stays older than the newest "
                        "checkpoint (or absent) until they catch up. Resume from fastckpt.latest() of its directory "
                        "(Lightning: ckpt_path=io.latest(dirpath)), not from this path by name; or save less often, "
                        "or give the uploads more bandwidth (replicate_workers)", path, n)

    def landed(self, path: str) -> None:
        """An upload of ``path`` is durable: the streak ends."""
        with self._lock:
            self._dropped.pop(path, None)
