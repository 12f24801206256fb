"""A directory-like place in a ``Target``: where a group's small files (markers, manifest) and a
directory's ``latest`` pointer live. The group protocol (``commit/``) goes through a ``Place``,
so the same code commits a group on a local disk, a Lustre mount and S3.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import posixpath
import time
from collections.abc import Iterator

from .base import Target
from .posix import PosixTarget
from .types import TargetNotFoundError

log = logging.getLogger("fastckpt")
LOCK_WAIT_S = 60.0  # how long ``exclusive`` waits for another process's hold before it goes on without


class Place:
    """A key prefix in a ``Target``. ``rel`` names are '/'-separated, relative to it.

    Args:
        target: the target.
        key: the prefix ('' for the target's root).
    """

    def __init__(self, target: Target, key: str) -> None:
        self.target = target
        self.key = key.strip("/")
        self.label = target.url_of(self.key) if self.key else target.url

    def _k(self, rel: str) -> str:
        return f"{self.key}/{rel}" if self.key else rel

    def put(self, rel: str, data: bytes) -> None:
        """Publish a small file atomically (replacing an existing one)."""
        self.target.put_bytes(self._k(rel), data)

    def put_new(self, rel: str, data: bytes) -> bytes | None:
        """Publish a small file unless ``rel`` exists: None when this call did, else the bytes
        there (``Target.put_new``: atomic on a file system)."""
        return self.target.put_new(self._k(rel), data)

    def get(self, rel: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        try:
            return self.target.get_bytes(self._k(rel))
        except TargetNotFoundError:
            return None

    def manifest(self, rel: str) -> dict | None:
        """The manifest in the tail of the file ``rel`` (``Target.read_manifest``); None without one."""
        return self.target.read_manifest(self._k(rel))

    def names(self, rel_dir: str) -> list[str]:
        """The file names directly in ``rel_dir`` (no temp files); [] when it is missing."""
        prefix = self._k(rel_dir).rstrip("/") + "/"
        try:
            keys = self.target.list(prefix, max_depth=0)
        except TargetNotFoundError:
            return []
        return sorted({k[len(prefix):] for k in keys if "/" not in k[len(prefix):]})

    def files(self) -> list[str]:
        """Every file below this place (no temp files), relative to it; [] when it is missing."""
        prefix = f"{self.key}/" if self.key else ""
        try:
            return [k[len(prefix):] for k in self.target.list(prefix)]
        except TargetNotFoundError:
            return []

    def link(self, rel: str, to: Place, to_rel: str) -> None:
        """Give the file ``rel`` the second name ``to_rel`` in ``to`` (same target; see
        ``Target.link``)."""
        self.target.link(self._k(rel), to._k(to_rel))

    def swap(self, other: Place) -> None:
        """Exchange this directory and ``other`` atomically (see ``Target.exchange``)."""
        self.target.exchange(self.key, other.key)

    def delete_all(self) -> None:
        """Remove this place and everything in it; a missing one is fine."""
        self.target.delete_tree(self.key)

    def size(self, rel: str) -> int:
        """The file's size, -1 when it does not exist."""
        try:
            return self.target.size(self._k(rel))
        except TargetNotFoundError:
            return -1

    def is_link(self, rel: str) -> bool:
        """Whether ``rel`` is a symbolic link."""
        return self.target.is_link(self._k(rel))

    def delete(self, rel: str) -> None:
        """Remove a file; a missing one is fine."""
        self.target.delete(self._k(rel))

    def parent(self) -> Place:
        """The place that holds this one (where the ``latest`` pointer goes)."""
        return Place(self.target, posixpath.dirname(self.key))

    def child(self, name: str) -> Place:
        """A place inside this one."""
        return Place(self.target, self._k(name))

    def url(self, rel: str = "") -> str:
        """The path or URL of ``rel`` inside this place."""
        k = self._k(rel) if rel else self.key
        return self.target.url_of(k) if k else self.target.url

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Hold this directory against other processes holding it (``latest``'s read-compare-write):
        ``dir_lock`` on a mounted file system. Nothing at an object store (it has no lock:
        docs/groups.md): the caller goes on unlocked."""
        if isinstance(self.target, PosixTarget):
            return dir_lock(os.path.join(self.target.root, *self.key.split("/")))
        return contextlib.nullcontext()


@contextlib.contextmanager
def dir_lock(path: str, shared: bool = False) -> Iterator[None]:
    """An ``flock`` of the directory ``path``, exclusive or ``shared``, waited for at most
    ``LOCK_WAIT_S``; where the file system refuses one (a Lustre mount without ``-o flock``), or
    another process held it that long, the caller goes on without (as before the lock). Held per
    open descriptor: other threads of this process are held off too.

    A save's rename into the burst buffer holds its directory shared (saves never wait for one
    another), and a prefetch's compare-then-rename of its download there exclusive
    (``load.prefetch``): the download never lands on a save renamed in after its comparison."""
    fd = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        _flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, time.monotonic() + LOCK_WAIT_S)
    except OSError as exc:
        (log.warning if isinstance(exc, BlockingIOError) else log.debug)(
            "fastckpt: no lock on %s (%s): going on without one", path,
            f"another process held it for {LOCK_WAIT_S:.0f} s" if isinstance(exc, BlockingIOError) else exc)
        if fd is not None:
            os.close(fd)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with the descriptor


def _flock(fd: int, how: int, deadline: float) -> None:
    delay = 0.001
    while True:
        try:
            return fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
