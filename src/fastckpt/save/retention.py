"""Retention and every deletion: how many checkpoints to keep in the burst buffer and at the
durable home, and ``remove``.

A checkpoint enters the lists only once it is verified at its durable home, so a local copy
is never deleted before its replica is verified, and the newest verified checkpoint is never
deleted (both limits are >= 1). Deletions wait for nothing: only finished checkpoints are
listed, a name being saved again leaves the lists until that save is durable, and
``Checkpointer.remove`` waits for saves in flight before it calls ``remove`` here. Each
deletion goes through the checkpoint's home (``storage.homes``) and removes its publication
record first (``commit.protocol.delete_checkpoint``).

The burst buffer outlives the process: a restarted job finds the copies its earlier runs left
there. The first time a checkpoint in a directory becomes durable, the local list takes in,
oldest first, the other checkpoints in that directory's burst-buffer copy whose copy at the
durable home is the same save (same checksum; a group's local copy is complete only once it
was published): its groups of earlier steps, and the single files this rank wrote. A group
whose step is unknown or not below the one just saved is left alone: a job resumed from an
older checkpoint saves those tags again, and another rank may be writing into them. So
``keep_local`` bounds the burst buffer across restarts, and a local copy that never reached
its home (the job was killed first) is never deleted. ``keep_persistent`` counts the
checkpoints this process saved: what earlier runs left at the durable home is the user's.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections import deque
from collections.abc import Callable

from ..commit.discovery import scan
from ..commit.foreign import tag_step
from ..commit.protocol import delete_checkpoint, read_group_manifest
from ..storage.homes import Homes
from ..urls import join

log = logging.getLogger("fastckpt")


class Retention:
    """Args:
        keep_local, keep_persistent: the options of the same names.
        homes: resolves names to their targets.
        local_copies: the burst-buffer copies of a name (several with striped ``local_dir``s: a
            group's files may live on every drive).
        rank: this process's rank: of the single files earlier runs left, only its own count.
    """

    def __init__(self, keep_local: int | None, keep_persistent: int | None, homes: Homes,
                 local_copies: Callable[[str], list[str]], rank: int = 0) -> None:
        self._keep_local, self._keep_persistent, self._rank = keep_local, keep_persistent, rank
        self._homes, self._local_copies = homes, local_copies
        self._local: deque[str] = deque()
        self._persistent: deque[str] = deque()
        self._lock = threading.Lock()
        self._looked: set[str] = set()  # directories whose earlier burst-buffer copies were taken in
        self._busy: set[str] = set()  # names being saved again (a save that fails leaves its name here)

    def durable(self, path: str, has_local: bool, owns_persistent: bool) -> None:
        """``path`` (a file or group) is verified at its durable home; trim both lists."""
        earlier = self._earlier_local(path) if has_local and self._keep_local is not None else []
        with self._lock:
            self._busy.discard(path)
            self._local.extendleft(reversed([p for p in earlier if p not in self._local and p not in self._busy]))
            drop_local = _push(self._local, path, self._keep_local) if has_local else []
            drop_persistent = _push(self._persistent, path, self._keep_persistent) if owns_persistent else []
        for p in drop_local:
            self._run(self._delete_local, p, "burst-buffer copy")
        for p in drop_persistent:
            self._run(self._delete_persistent, p, "persistent copy")

    def replacing(self, path: str) -> None:
        """A new save of ``path`` (a file or group) began: until it is durable, no trim may delete
        the copies it is replacing (a group's burst-buffer directory is the one it writes into)."""
        with self._lock:
            self._forget(path)
            self._busy.add(path)

    def _forget(self, path: str) -> None:
        for q in (self._local, self._persistent):
            if path in q:
                q.remove(path)

    def remove(self, path: str) -> None:
        """Delete both copies of ``path`` (a file or a group) now and stop tracking it."""
        with self._lock:
            self._forget(path)
        self._delete_local(path)
        self._delete_persistent(path)

    def _earlier_local(self, path: str) -> list[str]:
        """Once per directory: the checkpoints beside ``path`` that earlier runs left in the burst
        buffer and that are safe at their home, oldest first."""
        parent = posixpath.dirname(path)
        with self._lock:
            if parent in self._looked:
                return []
            self._looked.add(parent)
        try:
            found = [(f, rel) for mirror in self._local_copies(parent)
                     for f in scan(self._homes.resolve(mirror), max_depth=1)
                     if "/" not in (rel := posixpath.relpath(f.path, mirror))]
            found.sort(key=lambda fr: fr[0].time)
            mine = _step(read_group_manifest(self._homes.resolve(path).place()) or {}, path) \
                if any(f.kind == "group" for f, _ in found) else None
            earlier = [name for f, rel in found if (name := join(parent, rel)) != path and not f.foreign
                       and (self._earlier_group(f.manifest, rel, mine) if f.kind == "group"
                            else f.manifest.get("rank", 0) == self._rank and self._same_at_home(name, f.manifest))]
        except (OSError, ValueError) as exc:  # retention must not fail a save: say so, count none of them
            log.warning("fastckpt: retention could not look at what earlier runs left in the burst buffer "
                        "beside %s: %s", path, exc)
            return []
        if earlier:
            log.info("fastckpt: keep_local=%d also counts %d burst-buffer copies that earlier runs left beside %s",
                     self._keep_local, len(earlier), path)
        return earlier

    @staticmethod
    def _earlier_group(manifest: dict, rel: str, mine: int | None) -> bool:
        """A group of an earlier run counts only if its step is below the one just durable: a
        job resumed from an older checkpoint saves the later tags again, and another rank may
        already be writing into their burst-buffer directory when this one would delete it."""
        theirs = _step(manifest, rel)
        return mine is not None and theirs is not None and theirs < mine

    def _same_at_home(self, name: str, local_manifest: dict) -> bool:
        """Whether the durable home holds the save that ``local_manifest`` describes."""
        home = self._homes.resolve(name)
        try:
            m = home.target.read_manifest(home.key)
        except (OSError, ValueError):  # absent (never replicated) or unreadable: keep the local copy
            return False
        return bool(m) and m.get("checksum") == local_manifest.get("checksum")

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


def _step(manifest: dict, name: str) -> int | None:
    """A group's step: ``commit(step=...)``, else the number its tag ends with (global_step1200)."""
    step = manifest.get("step")
    return step if isinstance(step, int) else tag_step(name)


def _push(queue: deque[str], path: str, keep: int | None) -> list[str]:
    """Make ``path`` the newest entry; return the oldest ones beyond ``keep`` (removed)."""
    if keep is None:
        return []
    if path in queue:
        queue.remove(path)
    queue.append(path)
    return [queue.popleft() for _ in range(len(queue) - keep)]
