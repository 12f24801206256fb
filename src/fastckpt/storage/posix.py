"""``PosixTarget``: a directory as a durable home (a Lustre or NFS mount, or any local path).

Publishing is the one recipe of ``io.atomic``: a hidden temp name beside the final one, fsync, rename over the
final name, fsync the directory. With ``expect`` (the replicator's copies of committed checkpoints) the copy runs
in parallel chunks and every chunk is read back with O_DIRECT right after it is written (from the device, not the
page cache) and hashed: the file is renamed into place only when the bytes read back hash to the manifest's
checksum, so a file visible here is complete and verified (``mounted``), and only if ``expect.publishing`` then
allows it. Just before the rename the temp file is dated as final (``Staged.stamp``), so files copied one after
another keep that order by mtime. All system calls go through a ``FileOps`` so that tests can inject ENOSPC, EIO,
failed fsyncs or renames (``fastckpt.testing.FaultyOps``).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor

from ..config import DEFAULT_RETRY_DEADLINE_S
from ..errors import CorruptCheckpointError, ReplicationError
from ..format import checksum
from ..io import atomic
from ..io.engine import ImageFactory, ReadResult, map_file, read_file
from ..io.ops import READ, FileOps, pread_exact, pwrite_all
from ..io.stream import checksum_file, copy_file, drop_cache
from ..units import MiB
from ..urls import check_key
from . import posix_errors, posix_walk, reads
from .base import T, Target
from .retry import retry_call
from .types import (
    Expected,
    Listing,
    Progress,
    RetryCallback,
    TargetNotFoundError,
    TokenBucket,
    source_changed,
    storage_error,
)

log = logging.getLogger(__name__)
VERIFY_ATTEMPTS = 3  # copies that read back wrong before the destination is declared faulty

class PosixTarget(Target):
    """A ``Target`` rooted at an existing directory.

    Args:
        root: the directory. It must exist (unless ``create_root``): a missing root usually
            means a mount is missing, and creating it would silently fill the node's own disk.
            Subdirectories under it are created as needed.
        create_root: writes create a missing root (``storage.homes`` roots a target at a
            checkpoint's own parent directory, which a save creates as ``torch.save``'s caller
            would).
        ops: the system-call layer (default: the real one).
        odirect: copy, verify and read with O_DIRECT where the file system honours it.
        retry_deadline_s, parallelism, on_retry: see ``Target``.
        unlink_later: removes a file a copy replaced off the copying thread (``io.atomic.Staged``).
    """

    mounted = True

    def __init__(self, root: str | os.PathLike, *, ops: FileOps | None = None, odirect: bool = True,
                 retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S, parallelism: int = 4,
                 on_retry: RetryCallback | None = None, executor: Executor | None = None,
                 create_root: bool = False, unlink_later: Callable[[str], None] | None = None) -> None:
        super().__init__(retry_deadline_s=retry_deadline_s, parallelism=parallelism, on_retry=on_retry, ops=ops,
                         executor=executor)
        self.root = os.path.abspath(os.fspath(root))
        self.odirect, self.create_root, self._unlink_later = odirect, create_root, unlink_later

    @property
    def url(self) -> str:
        return self.root

    def url_of(self, key: str) -> str:
        return self._path(key)

    def is_link(self, key: str) -> bool:
        return os.path.islink(self._path(key))

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _check_root(self, writing_for: str | None = None) -> None:
        """The root must be a directory; ``writing_for`` (the write, for messages) creates it
        first where ``create_root`` allows."""
        if writing_for is not None and self.create_root:
            self._retry(f"{writing_for} (creating {self.root})", lambda: self.ops.makedirs(self.root))
        if not os.path.isdir(self.root):
            raise storage_error(TargetNotFoundError, f"target directory {self.root} does not exist (or is not a "
                                f"directory): mount the file system, create it (mkdir -p {self.root}) or fix the "
                                "target path", err_no=errno.ENOENT)

    def _permanent(self, exc: BaseException, what: str) -> ReplicationError | None:
        return posix_errors.permanent(exc, what, self.root)

    def _read(self, what: str, fn: Callable[[], T], *, deadline_s: float | None = None) -> T:
        """``fn`` retried as ``_retry`` does, its permanent errors a read's (``posix_errors``)."""
        return retry_call(fn, what=what, url=self.url, on_retry=self.on_retry, is_transient=self._is_transient,
                          deadline_s=self.retry_deadline_s if deadline_s is None else deadline_s,
                          permanent=lambda exc, what: posix_errors.permanent_read(exc, what, self.root))

    # ------------------------------------------------------------------ writing
    def _put_file(self, local_path: str, key: str, size: int, limiter: TokenBucket | None, chunk_bytes: int,
                  progress: Progress, expect: Expected | None) -> int:
        what = f"copy of {local_path} to {self.url_of(key)}"
        self._check_root(writing_for=what)
        atomic.sweep_once(self.ops, os.path.dirname(self._path(key)))  # temp files of killed copies
        if expect is not None:
            progress.copies = self._retry(what, lambda: self._copy_verified(local_path, key, expect, limiter,
                                                                            chunk_bytes, what), progress=progress)
            progress.verified = progress.read_back = True
            progress.add(size)
            return 1
        buf = memoryview(bytearray(min(chunk_bytes, max(size, 1))))

        def copy() -> int:
            reported = progress.done  # a retry starts over: report only bytes beyond the last attempt
            src = self.ops.open(local_path, READ)

            def write(fd: int) -> None:
                nonlocal reported
                for off in range(0, size, chunk_bytes):
                    n = min(chunk_bytes, size - off)
                    pread_exact(self.ops, src, buf, off, n, local_path)
                    if limiter is not None:
                        limiter.consume(n)
                    pwrite_all(self.ops, fd, buf[:n], off, self.url_of(key))
                    if off + n > reported:
                        progress.add(off + n - reported)
                        reported = off + n

            try:
                self._publish(self._path(key), write)
            finally:
                self.ops.close(src)
            return 1

        return self._retry(what, copy, progress=progress)

    def _copy_verified(self, local_path: str, key: str, expect: Expected, limiter: TokenBucket | None,
                       chunk_bytes: int, what: str) -> int:
        """Parallel copy with an O_DIRECT read-back of every chunk; renamed into place only when
        both the bytes read from ``local_path`` and those read back match ``expect``. Returns
        the number of copies made."""
        dest = self._path(key)
        chunk = -(-max(chunk_bytes, checksum.BLOCK_BYTES) // checksum.BLOCK_BYTES) * checksum.BLOCK_BYTES
        throttle = limiter.consume if limiter is not None else None
        self.ops.makedirs(os.path.dirname(dest))
        for attempt in range(1, VERIFY_ATTEMPTS + 1):
            try:
                with atomic.replacing(self.ops, dest, self._unlink_later) as st:
                    res = copy_file(self.ops, self._executor(), local_path, st.tmp, expect.size, expect.covered,
                                    chunk_bytes=chunk, odirect=self.odirect, throttle=throttle, read_back=True)
                    if res.checksum != expect.xxh3:
                        raise source_changed(local_path, f"read back checksum {res.checksum}, expected "
                                             f"{expect.xxh3}")
                    back = res.read_back
                    if back is None:  # not O_DIRECT: read it back after the fsync, past the page cache
                        drop_cache(self.ops, st.tmp)
                        back = checksum_file(self.ops, self._executor(), st.tmp, expect.size, expect.covered,
                                             chunk_bytes=chunk, odirect=self.odirect, throttle=throttle)
                    if back != expect.xxh3:
                        log.warning("%s: copy %d read back as %s, expected %s; copying again", what, attempt,
                                    back, expect.xxh3)
                        raise _CopyAgain  # the temp file is discarded on the way out
                    expect.publishing()  # raises: not to be published (its Checkpointer closed, a newer save...)
                    st.stamp()  # its mtime: now, not its last write's (``io.ops.final_mtime_ns``)
                return attempt
            except _CopyAgain:
                continue
            except FileNotFoundError as exc:  # its folder removed meanwhile: say so, and which copy is kept
                raise posix_errors.folder_gone(exc, what, dest, local_path)  # noqa: B904 (it chains exc)
        raise CorruptCheckpointError(f"{dest}: {VERIFY_ATTEMPTS} copies all read back with the wrong checksum; "
                                     "the destination storage is corrupting data")

    def put_bytes(self, key: str, data: bytes) -> None:
        self._put_small(key, data, "publish", atomic.publish_bytes)

    def put_new(self, key: str, data: bytes) -> bytes | None:
        return self._put_small(key, data, "creation", atomic.create_bytes)

    def _put_small(self, key: str, data: bytes, what: str, write: Callable[[FileOps, str, bytes], T]) -> T:
        """``write`` a small file (a pointer, a manifest) at ``key``; this process's first write into a
        directory sweeps it first (the temp files of writes killed before their rename: docs/faults.md)."""
        dest = self._path(key)
        self._check_root(writing_for=f"{what} of {dest}")

        def put() -> T:
            self.ops.makedirs(os.path.dirname(dest))
            atomic.sweep_once(self.ops, os.path.dirname(dest))
            return write(self.ops, dest, data)

        return self._retry(f"{what} of {dest}", put)

    def exchange(self, key_a: str, key_b: str) -> None:
        """``Target.exchange``: ``renameat2(RENAME_EXCHANGE)``, then the parent directory's fsync."""
        a, b = self._path(key_a), self._path(key_b)
        self._retry(f"exchange of {a} and {b}", lambda: self.ops.exchange(a, b))
        self._retry(f"fsync of {os.path.dirname(a)}", lambda: self.ops.fsync_dir(os.path.dirname(a)))

    def link(self, src: str, dst: str) -> None:
        """``Target.link``: a hard link (an existing ``dst`` is left as it is)."""
        s, d = self._path(src), self._path(dst)

        def link() -> None:
            self.ops.makedirs(os.path.dirname(d))
            try:
                self.ops.link(s, d)
            except FileExistsError:
                return

        self._retry(f"link of {s} to {d}", link)

    def _publish(self, dest: str, write: Callable[[int], None]) -> None:
        """``io.atomic``'s recipe with ``write(fd)`` filling the temp file."""
        parent = os.path.dirname(dest)
        self.ops.makedirs(parent)
        with atomic.replacing(self.ops, dest, self._unlink_later) as st:
            try:
                fd = self.ops.open(st.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # a concurrent delete_tree() removed the directory just now
                self.ops.makedirs(parent)
                fd = self.ops.open(st.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write(fd)
                self.ops.fsync(fd)
            finally:
                self.ops.close(fd)
            st.stamp()

    # ------------------------------------------------------------------ reading
    def _read_back(self, key: str, covered: int, limiter: TokenBucket | None) -> str:
        """Parallel O_DIRECT chunks with bounded memory, after dropping the file's cached pages
        (an NFS or Lustre client would otherwise answer from the copy it cached while writing)."""
        path = self._path(key)
        drop_cache(self.ops, path)
        throttle = limiter.consume if limiter is not None else None
        return self._retry(f"read-back of {path}", lambda: checksum_file(
            self.ops, self._executor(), path, covered, covered, chunk_bytes=reads.READ_CHUNK_BYTES,
            odirect=self.odirect, throttle=throttle))

    def read_object(self, key: str, *, chunk_bytes: int = 64 * MiB, mapped: bool = False,
                    into: ImageFactory | None = None) -> ReadResult:
        """The whole file through one descriptor: read in parallel (``io.engine.read_file``), or
        mapped copy-on-write (``map_file``). A concurrent replace gives it the old or the new one."""
        path, pool, n, ops, direct = self._path(key), self._executor(), chunk_bytes, self.ops, self.odirect
        read = map_file if mapped else lambda *args, **kw: read_file(*args, into=into, **kw)
        return self._read(f"{'map' if mapped else 'read'} of {path}", lambda: read(ops, pool, path, chunk_bytes=n,
                                                                                    odirect=direct))

    def get_bytes(self, key: str, *, deadline_s: float | None = None) -> bytes:
        path = self._path(key)

        def read() -> bytes:
            data = self.ops.read_small(path)
            if data is None:
                raise FileNotFoundError(errno.ENOENT, "no such file", path)
            return data

        return self._read(f"read of {path}", read, deadline_s=deadline_s)

    def read_range(self, key: str, offset: int, length: int, *, version: str | None = None) -> bytes:
        path = self._path(key)  # a file has no versions to ask for: read_object reads through one descriptor

        def read() -> bytes:
            fd = self.ops.open(path, READ)
            try:
                buf = bytearray(length)
                pread_exact(self.ops, fd, memoryview(buf), offset, length, path)
                return buf  # type: ignore[return-value]  (bytes-like; a copy would double memory)
            finally:
                self.ops.close(fd)

        return self._read(f"read of {path}", read)

    def _size_and_tail(self, key: str) -> tuple[int, str | None, bytes]:
        path = self._path(key)  # one descriptor for both (reads.file_tail): a replace gives old or new, whole
        return self._read(f"read of {path}", lambda: reads.file_tail(self.ops, path))

    def size(self, key: str) -> int:
        return self._read(f"stat of {self._path(key)}", lambda: os.stat(self._path(key)).st_size)

    def modified(self, key: str) -> float:
        return self._read(f"stat of {self._path(key)}", lambda: os.stat(self._path(key)).st_mtime)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._read(f"stat of {path}", lambda: os.path.isfile(path))

    def list(self, prefix: str = "", *, max_depth: int | None = None) -> list[str]:
        self._check_root()
        return posix_walk.keys(self.ops, self.root, prefix, max_depth)

    def listing(self, prefix: str = "", *, max_depth: int | None = None) -> Listing:
        self._check_root()
        unlisted: list[tuple[str, OSError]] = []
        got = posix_walk.keys(self.ops, self.root, prefix, max_depth, unlisted)
        return Listing(got, tuple((posix_walk.key_of(self.root, d), exc) for d, exc in unlisted))

    def dirs(self, prefix: str) -> list[str]:
        self._check_root()
        return posix_walk.dirs(self.root, prefix)

    def delete(self, key: str) -> None:
        path = self._path(key)

        def unlink() -> None:
            try:
                self.ops.unlink(path)
            except FileNotFoundError:
                return
            # Prune directories the deletion emptied, up to the root (retention removes whole checkpoints).
            d = os.path.dirname(path)
            while d.startswith(self.root.rstrip(os.sep) + os.sep):
                try:
                    self.ops.rmdir(d)
                except OSError:  # not empty, or a concurrent writer: leave it
                    break
                d = os.path.dirname(d)

        self._retry(f"delete of {path}", unlink)

    def delete_tree(self, prefix: str, first: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> None:
        """``Target.delete_tree``; the removal of the ``first`` keys is made durable (directory
        fsync) before anything else goes, and then everything in the directory goes, temp files
        of dead writers included, the ``last`` folders' after the rest. A symlink is removed,
        never followed; emptied parent directories are pruned up to the root."""
        top = self._path(prefix)
        if os.path.islink(top) or not os.path.isdir(top):
            self.delete(prefix)
            return
        for rel in first:
            self.delete(f"{prefix}/{rel}")
        if first:
            self._retry(f"fsync of {top}", lambda: self.ops.fsync_dir(top))
        for d, names, rmdir in posix_walk.deletion_order(top, last):
            for name in names:
                atomic.discard(self.ops, os.path.join(d, name))
            if rmdir:
                self._retry(f"delete of {d}", lambda d=d: self.ops.rmdir(d))
        self.delete(prefix)  # prunes the parents the removal emptied (the directory itself is gone)

    def clean_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        self._check_root()
        cutoff = time.time() - older_than_s
        removed = 0
        for p in posix_walk.temp_files(self.ops, self.root, prefix):
            if os.lstat(p).st_mtime < cutoff:
                atomic.discard(self.ops, p)
                removed += 1
        return removed


class _CopyAgain(Exception):
    """A verified copy read back wrong: ``_copy_verified`` starts the next attempt."""
