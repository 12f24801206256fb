"""Retention: how many checkpoints to keep in the burst buffer and at the durable home.

A checkpoint enters the lists only once it is verified at its durable home, so a local copy
is never deleted before its replica is verified, and the newest verified checkpoint is never
deleted (both limits are >= 1). Deletions wait for nothing: only finished checkpoints are
listed; ``Checkpointer.remove`` is the one that waits for saves in flight.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("fastckpt")


class Retention:
    def __init__(self, keep_local: int | None, keep_persistent: int | None,
                 delete_local: Callable[[str], None], delete_persistent: Callable[[str], None]) -> None:
        self._keep_local, self._keep_persistent = keep_local, keep_persistent
        self._delete_local, self._delete_persistent = delete_local, delete_persistent
        self._local: deque[str] = deque()
        self._persistent: deque[str] = deque()
        self._lock = threading.Lock()

    def durable(self, path: str, has_local: bool, owns_persistent: bool) -> None:
        """``path`` (a file or group) is verified at its durable home; trim both lists."""
        drop_local, drop_persistent = [], []
        with self._lock:
            if has_local and self._keep_local is not None:
                if path in self._local:
                    self._local.remove(path)
                self._local.append(path)
                while len(self._local) > self._keep_local:
                    drop_local.append(self._local.popleft())
            if owns_persistent and self._keep_persistent is not None:
                if path in self._persistent:
                    self._persistent.remove(path)
                self._persistent.append(path)
                while len(self._persistent) > self._keep_persistent:
                    drop_persistent.append(self._persistent.popleft())
        for p in drop_local:
            self._run(self._delete_local, p, "burst-buffer copy")
        for p in drop_persistent:
            self._run(self._delete_persistent, p, "persistent copy")

    def forget(self, path: str) -> None:
        with self._lock:
            for q in (self._local, self._persistent):
                if path in q:
                    q.remove(path)

    @staticmethod
    def _run(fn: Callable[[str], None], path: str, what: str) -> None:
        try:
            fn(path)
            log.info("fastckpt: retention removed the %s of %s", what, path)
        except OSError as exc:  # retention must not fail a save; say so and go on
            log.warning("fastckpt: retention could not remove the %s of %s: %s", what, path, exc)
