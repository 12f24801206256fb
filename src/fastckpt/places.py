"""Where a group's small files live: a local (or shared POSIX) directory or a target prefix.

The group protocol (commit.py) reads and writes markers, manifests and the latest pointer
through a ``Place``, so the same code commits a group on a Lustre mount and on S3.
"""

from __future__ import annotations

import os
import posixpath
from typing import Protocol

from .io.ops import FileOps


class Place(Protocol):
    """A directory-like place. ``rel`` names are '/'-separated, relative to it."""

    label: str

    def put(self, rel: str, data: bytes) -> None:
        """Publish a small file atomically (replacing an existing one)."""

    def get(self, rel: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""

    def names(self, rel_dir: str) -> list[str]:
        """The file names directly in ``rel_dir`` (no temp files); [] when it is missing."""

    def size(self, rel: str) -> int:
        """The file's size, -1 when it does not exist."""

    def delete(self, rel: str) -> None:
        """Remove a file; a missing one is fine."""

    def parent(self) -> Place:
        """The place that holds this one (where the ``latest`` pointer goes)."""

    def child(self, name: str) -> Place:
        """A place inside this one."""


class LocalPlace:
    def __init__(self, path: str, ops: FileOps | None = None) -> None:
        self.path = os.path.normpath(path)
        self.ops = ops or FileOps()
        self.label = self.path

    def put(self, rel: str, data: bytes) -> None:
        from .commit import publish_bytes

        full = os.path.join(self.path, rel)
        self.ops.makedirs(os.path.dirname(full))
        publish_bytes(self.ops, full, data)

    def get(self, rel: str) -> bytes | None:
        try:
            with open(os.path.join(self.path, rel), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def names(self, rel_dir: str) -> list[str]:
        from .commit import is_tmp

        try:
            return sorted(n for n in os.listdir(os.path.join(self.path, rel_dir)) if not is_tmp(n))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, rel: str) -> int:
        try:
            return os.path.getsize(os.path.join(self.path, rel))
        except FileNotFoundError:
            return -1

    def delete(self, rel: str) -> None:
        try:
            self.ops.unlink(os.path.join(self.path, rel))
        except FileNotFoundError:
            pass

    def parent(self) -> LocalPlace:
        return LocalPlace(os.path.dirname(self.path), self.ops)

    def child(self, name: str) -> LocalPlace:
        return LocalPlace(os.path.join(self.path, name), self.ops)


class TargetPlace:
    """A key prefix in a ``Target`` (``targets.py``)."""

    def __init__(self, target, key: str) -> None:  # noqa: ANN001 (a targets.Target)
        self.target = target
        self.key = key.strip("/")
        self.label = target.url_of(self.key) if self.key else target.url

    def _k(self, rel: str) -> str:
        return f"{self.key}/{rel}" if self.key else rel

    def put(self, rel: str, data: bytes) -> None:
        self.target.put_bytes(self._k(rel), data)

    def get(self, rel: str) -> bytes | None:
        from .targets import TargetNotFoundError

        try:
            return self.target.get_bytes(self._k(rel))
        except TargetNotFoundError:
            return None

    def names(self, rel_dir: str) -> list[str]:
        prefix = self._k(rel_dir).rstrip("/") + "/"
        return sorted({k[len(prefix):] for k in self.target.list(prefix) if "/" not in k[len(prefix):]})

    def size(self, rel: str) -> int:
        from .targets import TargetNotFoundError

        try:
            return self.target.size(self._k(rel))
        except TargetNotFoundError:
            return -1

    def delete(self, rel: str) -> None:
        self.target.delete(self._k(rel))

    def parent(self) -> TargetPlace:
        return TargetPlace(self.target, posixpath.dirname(self.key))

    def child(self, name: str) -> TargetPlace:
        return TargetPlace(self.target, self._k(name))


def as_place(where: str | Place, ops: FileOps | None = None) -> Place:
    return LocalPlace(where, ops) if isinstance(where, (str, os.PathLike)) else where


def is_url(path: str) -> bool:
    """An fsspec URL (``s3://bucket/key``); ``file://`` and plain paths are local."""
    return "://" in path and not path.startswith("file://")


def normalize(path: str | os.PathLike) -> str:
    """Absolute path for a local path, the URL itself (no trailing '/') for a URL."""
    s = os.fspath(path)
    if is_url(s):
        return s.rstrip("/")
    return os.path.abspath(s.removeprefix("file://"))


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``s3://bucket``, ``a/b``): the target root and the key."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    return f"{scheme}://{bucket}", key.strip("/")


def mirror_path(local_dir: str, dest: str) -> str:
    """Where the burst-buffer copy of ``dest`` (path or URL) lives under ``local_dir``."""
    if is_url(dest):
        scheme, rest = dest.split("://", 1)
        return os.path.join(local_dir, scheme, rest.strip("/"))
    return os.path.join(local_dir, os.path.abspath(dest).lstrip(os.sep))
