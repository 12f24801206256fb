"""Where a checkpoint lives: the one place that maps a path or URL to its ``Target`` and key.

A local path's home is a ``PosixTarget`` rooted at the path's parent directory (deletions and
the directory pruning that follows them never reach above it); a URL's home is an
``FsspecTarget`` rooted at its bucket (``s3://bucket``), one per bucket, kept for reuse because
it holds connections. Every other layer asks ``Homes.resolve`` instead of branching on the kind
of name.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from ..config import DEFAULT_RETRY_DEADLINE_S, check_storage_options
from ..errors import ConfigError
from ..exits import stop_pools
from ..io.atomic import Reaper
from ..io.ops import FileOps
from ..urls import canonical, is_url, local_path, normalize, split_url
from .base import Target
from .places import Place
from .s3_options import store_tag
from .types import RetryCallback


@dataclass(frozen=True)
class Location:
    """A checkpoint name resolved: ``key`` in ``target`` ('' is the target's root)."""

    target: Target
    key: str

    @property
    def url(self) -> str:
        return self.target.url_of(self.key) if self.key else self.target.url

    def place(self) -> Place:
        return Place(self.target, self.key)


class Homes:
    """Resolves names to Locations, sharing options, the FileOps seam and worker threads.

    Args:
        storage_options: fsspec options for URL homes (credentials, endpoint).
        retry_deadline_s, parallelism, on_retry: see ``Target``.
        ops: the FileOps every local read and write goes through.
        odirect: POSIX homes copy and read with O_DIRECT where honoured.
        executor: worker threads shared by POSIX homes (the Checkpointer's I/O pool).

    ``reaper`` removes the files that copies to POSIX homes replaced (``io.atomic.Staged``); the
    Checkpointer's writer shares it.
    """

    def __init__(self, storage_options: dict | None = None, *, retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
                 parallelism: int = 4, on_retry: RetryCallback | None = None, ops: FileOps | None = None,
                 odirect: bool = True, executor: Executor | None = None) -> None:
        check_storage_options(storage_options)  # fastckpt.latest(url, storage_options=...) too, not at the first URL
        self._opts = storage_options
        self._common = {"retry_deadline_s": retry_deadline_s, "parallelism": parallelism, "on_retry": on_retry,
                        "ops": ops or FileOps()}  # passed to every Target this makes
        self.reaper = Reaper(self._common["ops"])
        self._odirect, self._shared = odirect, executor
        self._lock = threading.Lock()
        self._remote: dict[str, Target] = {}
        self._own: ThreadPoolExecutor | None = None  # for POSIX homes when no executor is shared

    def resolve(self, name: str | os.PathLike) -> Location:
        """The Location of a path or URL (normalised here)."""
        name = normalize(name)
        if is_url(name):
            root, key = split_url(name)
            with self._lock:
                if root not in self._remote:
                    self._remote[root] = open_target(root, self._opts, **self._common)
                return Location(self._remote[root], key)
        from .posix import PosixTarget

        parent, base = os.path.split(name)
        return Location(PosixTarget(parent or os.sep, odirect=self._odirect, executor=self._executor(),
                                    create_root=True, unlink_later=self.reaper.unlink_later, **self._common), base)

    def store_of(self, name: str) -> str:
        """Which store ``name`` (normalised) is at, for its burst-buffer place (``s3_options.store_tag``):
        ``""`` for a directory and a URL at the default endpoint."""
        return store_tag(name, self._opts) if is_url(name) else ""

    def _executor(self) -> Executor:
        if self._shared is not None:
            return self._shared
        with self._lock:
            if self._own is None:
                self._own = ThreadPoolExecutor(self._common["parallelism"], thread_name_prefix="fastckpt-homes")
            return self._own

    def close(self, wait: bool = True) -> None:
        """End the worker threads (they are made again if needed); without ``wait``, at once:
        queued transfers are cancelled, and running ones and removals are not waited for."""
        with self._lock:
            targets, own, self._own = list(self._remote.values()), self._own, None
        for t in targets:
            t.close(wait)
        stop_pools([own] if own is not None else [], wait)
        self.reaper.close(wait)


def open_target(url_or_path: str | os.PathLike, storage_options: dict | None = None, *,
                retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S, parallelism: int = 4,
                on_retry: RetryCallback | None = None, ops: FileOps | None = None,
                executor: Executor | None = None) -> Target:
    """The ``Target`` for a directory (``/mnt/lustre/ckpt``, ``file:///...``) or a URL
    (``s3://bucket/prefix``, any other fsspec protocol).

    Args:
        url_or_path: the target root.
        storage_options: fsspec options (URL targets only), e.g. ``{"endpoint_url": ...}``.
        retry_deadline_s, parallelism, on_retry, ops, executor: see ``Target``.

    Raises:
        ConfigError: ``storage_options`` given for a directory, or a URL typo (``urls.canonical``).
    """
    s = canonical(url_or_path)  # S3://bucket: the scheme fsspec knows is s3
    kwargs = {"retry_deadline_s": retry_deadline_s, "parallelism": parallelism, "on_retry": on_retry, "ops": ops,
              "executor": executor}
    if not is_url(s):
        if storage_options:
            raise ConfigError(f"storage_options apply to URL targets only, not to the directory {s!r}: "
                              "drop them, or give an s3://... URL")
        from .posix import PosixTarget

        return PosixTarget(local_path(s), **kwargs)  # type: ignore[arg-type]
    from .fsspec import FsspecTarget

    return FsspecTarget(s, storage_options, **kwargs)  # type: ignore[arg-type]
