"""``PosixTarget``: replication to a directory (a Lustre or NFS mount, or any local path).

Publishing is the same recipe as the local commit (``fastckpt.commit``): write a hidden temp
name beside the final one, fsync it, rename it over the final name, fsync the directory. All
system calls on the target go through a ``FileOps`` so that tests can inject ENOSPC, EIO,
failed fsyncs or renames (``fastckpt.testing.FaultyOps``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable

from .commit import discard, is_tmp, tmp_name
from .errors import ReplicationError
from .io.engine import pwrite_all
from .io.ops import FileOps
from .targets import (
    DEFAULT_RETRY_DEADLINE_S,
    Expected,
    RetryCallback,
    Target,
    TargetNotFoundError,
    TargetPermissionError,
    TokenBucket,
    _Progress,
    check_key,
    storage_error,
)

_FIXES = {
    errno.ENOSPC: "free space on the target (or prune old checkpoints there), or choose a larger target",
    errno.EDQUOT: "the disk quota is exhausted: free space or ask for a larger quota",
    errno.EROFS: "the file system is mounted read-only: remount it read-write or choose another target",
    errno.EACCES: "fix the directory's owner/mode, or run as a user who may write there",
    errno.EPERM: "fix the directory's owner/mode, or run as a user who may write there",
    errno.EIO: "the storage reported an I/O error: check the mount (dmesg) and the storage system's health",
}


class PosixTarget(Target):
    """A ``Target`` rooted at an existing directory.

    Args:
        root: the directory. It must exist: a missing root usually means a mount is missing,
            and creating it would silently fill the node's own disk. Subdirectories under it
            are created as needed.
        ops: the system-call layer (default: the real one).
        retry_deadline_s, parallelism, on_retry: see ``Target``.
    """

    def __init__(self, root: str | os.PathLike, *, ops: FileOps | None = None,
                 retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S, parallelism: int = 4,
                 on_retry: RetryCallback | None = None) -> None:
        super().__init__(retry_deadline_s=retry_deadline_s, parallelism=parallelism, on_retry=on_retry)
        self.root = os.path.abspath(os.fspath(root))
        self.ops = ops or FileOps()

    @property
    def url(self) -> str:
        return self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _check_root(self) -> None:
        if not os.path.isdir(self.root):
            raise storage_error(TargetNotFoundError, f"target directory {self.root} does not exist (or is not a "
                                f"directory): mount the file system, create it (mkdir -p {self.root}) or fix the "
                                "target path", err_no=errno.ENOENT)

    def _permanent(self, exc: BaseException, what: str) -> ReplicationError | None:
        if not isinstance(exc, OSError):
            return None
        code = exc.errno
        if code in (errno.ENOENT, errno.ENOTDIR):
            return storage_error(TargetNotFoundError, f"{what}: {exc}", exc)
        cls = TargetPermissionError if code in (errno.EACCES, errno.EPERM) else ReplicationError
        fix = _FIXES.get(code, "check the target file system")  # type: ignore[arg-type]
        return storage_error(cls, f"{what}: {exc.strerror or exc} ({self.root}); {fix}", exc)

    # ------------------------------------------------------------------ writing
    def _put_file(self, local_path: str, key: str, size: int, limiter: TokenBucket | None, chunk_bytes: int,
                  progress: _Progress, expect: Expected | None) -> int:
        # A file system returns no checksum of what it stored: verified stays False (read back).
        what = f"copy of {local_path} to {self.url_of(key)}"
        dest = self._path(key)
        self._check_root()
        buf = memoryview(bytearray(min(chunk_bytes, max(size, 1))))
        src = os.open(local_path, os.O_RDONLY)
        try:
            def copy() -> int:
                reported = progress.done  # a retry starts over: report only bytes beyond the last attempt

                def write(fd: int) -> None:
                    nonlocal reported
                    off = 0
                    while off < size:
                        n = os.preadv(src, [buf[:min(chunk_bytes, size - off)]], off)
                        if n <= 0:
                            raise storage_error(ReplicationError, f"{what}: {local_path} shrank to {off} bytes "
                                                f"while being copied (expected {size})", err_no=errno.EIO)
                        if limiter is not None:
                            limiter.consume(n)
                        _write_all(self.ops, fd, buf[:n], off)
                        off += n
                        if off > reported:
                            progress.add(off - reported)
                            reported = off

                self._publish(dest, write)
                return 1

            return self._retry(what, copy, progress=progress)
        finally:
            os.close(src)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        self._check_root()
        view = memoryview(data)
        self._retry(f"publish of {self.url_of(key)}", lambda: self._publish(dest, lambda fd: _write_all(
            self.ops, fd, view, 0)))

    def _publish(self, dest: str, write: Callable[[int], None]) -> None:
        """Temp file beside ``dest``, ``write(fd)``, fsync, rename, directory fsync; the temp
        file is removed on any failure."""
        parent = os.path.dirname(dest)
        tmp = tmp_name(dest)
        self.ops.makedirs(parent)
        try:
            fd = self.ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # a concurrent delete() pruned the directory just now
            self.ops.makedirs(parent)
            fd = self.ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write(fd)
                self.ops.fsync(fd)
            finally:
                self.ops.close(fd)
            self.ops.replace(tmp, dest)
        except BaseException:
            discard(self.ops, tmp)
            raise
        self.ops.fsync_dir(parent)

    # ------------------------------------------------------------------ reading
    def verify(self, key: str, expected_size: int, expected_xxh3: str, covered: int | None = None, *,
               bandwidth_Bps: float | TokenBucket | None = None) -> None:
        """``Target.verify``, after dropping the file's cached pages: an NFS or Lustre client
        would otherwise answer from the copy it cached while writing, not from the storage."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except OSError:
            fd = -1  # missing or unreadable: the verification below reports it
        if fd >= 0:
            try:
                with contextlib.suppress(OSError):  # a hint; a file system may not support it
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        super().verify(key, expected_size, expected_xxh3, covered, bandwidth_Bps=bandwidth_Bps)

    def get_bytes(self, key: str) -> bytes:
        return self.read_range(key, 0, self.size(key))

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        path = self._path(key)

        def read() -> bytes:
            fd = self.ops.open(path, os.O_RDONLY)
            try:
                buf = bytearray(length)
                view, got = memoryview(buf), 0
                while got < length:
                    n = self.ops.preadv(fd, view[got:], offset + got)
                    if n <= 0:
                        raise storage_error(ReplicationError, f"{path} ended at byte {offset + got}, but bytes "
                                            f"[{offset}, {offset + length}) were asked for", err_no=errno.EIO)
                    got += n
                return buf  # type: ignore[return-value]  (bytes-like; a copy would double memory)
            finally:
                self.ops.close(fd)

        return self._retry(f"read of {path}", read)

    def size(self, key: str) -> int:
        path = self._path(key)
        return self._retry(f"stat of {path}", lambda: os.stat(path).st_size)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._retry(f"stat of {path}", lambda: os.path.isfile(path))

    def _walk_base(self, prefix: str) -> str:
        """The deepest directory ``prefix`` names: the only one worth walking."""
        return os.path.join(self.root, *prefix.split("/")[:-1]) if "/" in prefix else self.root

    def list(self, prefix: str = "") -> list[str]:
        self._check_root()
        out = []
        for d, dirs, files in os.walk(self._walk_base(prefix)):
            dirs[:] = [x for x in dirs if not is_tmp(x)]
            rel = os.path.relpath(d, self.root)
            for f in files:
                key = f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}"
                if key.startswith(prefix) and not is_tmp(f):
                    out.append(key)
        return sorted(out)

    def delete(self, key: str) -> None:
        path = self._path(key)

        def unlink() -> None:
            try:
                self.ops.unlink(path)
            except FileNotFoundError:
                return
            # Prune directories the deletion emptied (retention removes whole checkpoints).
            d = os.path.dirname(path)
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:  # not empty, or a concurrent writer: leave it
                    break
                d = os.path.dirname(d)

        self._retry(f"delete of {path}", unlink)

    def clean_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        self._check_root()
        cutoff = time.time() - older_than_s
        removed = 0
        for d, _dirs, files in os.walk(self._walk_base(prefix)):
            for f in files:
                p = os.path.join(d, f)
                key = os.path.relpath(p, self.root).replace(os.sep, "/")
                if is_tmp(f) and key.startswith(prefix) and os.lstat(p).st_mtime < cutoff:
                    discard(self.ops, p)
                    removed += 1
        return removed


def _write_all(ops: FileOps, fd: int, view: memoryview, offset: int) -> None:
    pwrite_all(ops, fd, view, offset, f"fd {fd}")
