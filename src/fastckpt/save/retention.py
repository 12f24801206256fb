"""Retention and every deletion: how many checkpoints to keep in the burst buffer and at the
durable home, and ``remove``.

A checkpoint enters the lists only once it is verified at its durable home, so a local copy
is never deleted before its replica is verified, and the newest verified checkpoint is never
deleted (both limits are >= 1). Deletions wait for nothing: only finished checkpoints are
listed; ``Checkpointer.remove`` waits for saves in flight before it calls ``remove`` here.
Each deletion goes through the checkpoint's home (``storage.homes``) and removes its
publication record first (``commit.protocol.delete_checkpoint``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ..commit.protocol import delete_checkpoint
from ..storage.homes import Homes

log = logging.getLogger("fastckpt")


class Retention:
    """Args:
        keep_local, keep_persistent: the options of the same names.
        homes: resolves names to their targets.
        local_copies: the burst-buffer copies of a name (several with striped ``local_dir``s: a
            group's files may live on every drive).
    """

    def __init__(self, keep_local: int | None, keep_persistent: int | None, homes: Homes,
                 local_copies: Callable[[str], list[str]]) -> None:
        self._keep_local, self._keep_persistent = keep_local, keep_persistent
        self._homes, self._local_copies = homes, local_copies
        self._local: deque[str] = deque()
        self._persistent: deque[str] = deque()
        self._lock = threading.Lock()

    def durable(self, path: str, has_local: bool, owns_persistent: bool) -> None:
        """``path`` (a file or group) is verified at its durable home; trim both lists."""
        with self._lock:
            drop_local = _push(self._local, path, self._keep_local) if has_local else []
            drop_persistent = _push(self._persistent, path, self._keep_persistent) if owns_persistent else []
        for p in drop_local:
            self._run(self._delete_local, p, "burst-buffer copy")
        for p in drop_persistent:
            self._run(self._delete_persistent, p, "persistent copy")

    def remove(self, path: str) -> None:
        """Delete both copies of ``path`` (a file or a group) now and stop tracking it."""
        with self._lock:
            for q in (self._local, self._persistent):
                if path in q:
                    q.remove(path)
        self._delete_local(path)
        self._delete_persistent(path)

    def _delete_local(self, path: str) -> None:
        for local in self._local_copies(path):
            delete_checkpoint(self._homes.resolve(local))

    def _delete_persistent(self, path: str) -> None:
        delete_checkpoint(self._homes.resolve(path))

    @staticmethod
    def _run(fn: Callable[[str], None], path: str, what: str) -> None:
        try:
            fn(path)
            log.info("fastckpt: retention removed the %s of %s", what, path)
        except FileNotFoundError:  # another rank sharing this burst buffer removed it first
            log.debug("fastckpt: the %s of %s was already removed", what, path)
        except OSError as exc:  # retention must not fail a save; say so and go on
            log.warning("fastckpt: retention could not remove the %s of %s: %s", what, path, exc)


def _push(queue: deque[str], path: str, keep: int | None) -> list[str]:
    """Make ``path`` the newest entry; return the oldest ones beyond ``keep`` (removed)."""
    if keep is None:
        return []
    if path in queue:
        queue.remove(path)
    queue.append(path)
    return [queue.popleft() for _ in range(len(queue) - keep)]
