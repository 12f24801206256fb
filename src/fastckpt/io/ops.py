"""The system-call seam. Every byte fastckpt writes or reads on a local or POSIX file system goes
through a FileOps, and so does every rename, unlink and fsync.

Tests substitute a fault-injecting FileOps (``fastckpt.testing.FaultyOps``) to prove that
ENOSPC, EIO, short writes, fsync failures and failed renames never damage a checkpoint.
Methods are called from the training thread (commit, rename) and from I/O worker threads
(pwrite, pread, fsync); implementations must be thread-safe.

The two loops that turn short transfers into whole ones live here too, so that there is
exactly one of each: ``pwrite_all`` and ``pread_exact``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from typing import Self

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
#: How fastckpt opens a file to read it. Non-blocking, which changes nothing for a regular file:
#: a named pipe standing where a file, manifest or pointer should be reads as empty (damage)
#: instead of blocking the reader until something writes to it.
READ = os.O_RDONLY | os.O_NONBLOCK


_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value
_mmap_fn, _munmap, _mincore = _LIBC.mmap, _LIBC.munmap, _LIBC.mincore
_mmap_fn.restype, _mmap_fn.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                                       ctypes.c_int, ctypes.c_long]
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_LOW_BIT = bytes(i & 1 for i in range(256))
_IOV_MAX = 1024  # buffers one preadv takes (POSIX's minimum for IOV_MAX is 16; Linux's is 1024)
#: Nanoseconds between two final-file times (``final_mtime_ns``): 2 µs, so that they stay apart in
#: a float ``st_mtime`` rounded to microseconds, which is what Lightning compares (a ``datetime``)
FINAL_MTIME_STEP_NS = 2_000
_final_lock = threading.Lock()
_final_ns = 0


def final_mtime_ns() -> int:
    """The modification time for a file about to become final at its path: now, on the fine
    clock, and later than every time this process gave before (``FINAL_MTIME_STEP_NS``).

    Why: readers take "the newest" file by mtime (Lightning's ``ckpt_path="last"``), but the
    kernel dates a write by its coarse clock, a tick of milliseconds: two files made final one
    after another (two ``last.ckpt``s of two ``ModelCheckpoint``s) got the same mtime, and the
    reader picked either. Every file fastckpt makes final on a file system (a direct write, a
    copy to a POSIX home) is dated by this, just before its rename, so their mtimes follow the
    order they became final in."""
    global _final_ns
    with _final_lock:
        _final_ns = max(time.time_ns(), _final_ns + FINAL_MTIME_STEP_NS)
        return _final_ns


def malloc_trim() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where
    the C library has no such call."""
    fn = getattr(_LIBC, "malloc_trim", None)
    if fn is None:
        return False
    fn(0)
    return True


def resident_bytes(fd: int, offset: int, n: int) -> int:
    """How many of the ``n`` bytes of ``fd`` from ``offset`` lie in pages the page cache holds,
    counted up to the first page it does not (``mincore`` on a mapping that is never touched:
    no I/O). ``n`` when the system cannot tell, so that the caller's ``RWF_NOWAIT`` decides."""
    if n <= 0:
        return 0
    with Residency(fd, offset, n) as res:
        return res.resident(offset, n)


class Residency:
    """Which pages of ``[offset, offset + n)`` of an open file the page cache holds, from one
    mapping of that range that is never touched (no I/O). A read asks it once per chunk: a
    mapping made and removed per question takes the process's memory-map lock for writing each
    time, which stalls the page faults of the threads filling fresh memory (measured: 124 such
    questions cost a 1 GiB load 0.1 s)."""

    def __init__(self, fd: int, offset: int, n: int) -> None:
        self._start = offset - offset % _PAGE
        self._len = max(_PAGE, offset + n - self._start)
        addr = _mmap_fn(None, self._len, mmap.PROT_READ, mmap.MAP_SHARED, fd, self._start)
        self._addr = None if addr in (None, _MAP_FAILED) else addr

    def resident(self, offset: int, n: int) -> int:
        """Bytes from ``offset`` (inside the range) in resident pages, up to the first that is not."""
        if n <= 0:
            return 0
        if self._addr is None:
            return n
        start = offset - offset % _PAGE
        length = offset + n - start
        vec = ctypes.create_string_buffer((length + _PAGE - 1) // _PAGE)
        if _mincore(self._addr + start - self._start, length, vec) != 0:
            return n
        missing = vec.raw.translate(_LOW_BIT).find(0)  # a page is resident when its low bit is set
        return n if missing < 0 else max(0, min(n, missing * _PAGE - (offset - start)))

    def close(self) -> None:
        if self._addr is not None:
            _munmap(self._addr, self._len)
            self._addr = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileOps:
    """Thin wrapper over the POSIX calls fastckpt uses (the default implementation)."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buf: memoryview | list[memoryview], offset: int) -> int:
        """One read into ``buf``, or into several buffers in order (one system call: an O_DIRECT
        read into many pieces goes to the device as one request, not one per piece)."""
        return os.preadv(fd, buf if isinstance(buf, list) else [buf], offset)

    def preadv_cached(self, fd: int, buf: memoryview, offset: int, residency: Residency | None = None) -> int:
        """Read only what the page cache holds now: the bytes read, 0 when the first page is not
        cached or the system cannot tell (the caller reads from the device). ``residency``: a
        ``Residency`` of the file to ask (else one is made for this read).

        The read stops before the first page that is not resident (``resident_bytes``), because
        ``RWF_NOWAIT`` alone is not "no I/O": a read that reaches a missing page returns early
        but starts the kernel's readahead of it (8 MiB on a cold file here), so an O_DIRECT
        load would read those bytes twice and fill the cache with them."""
        if not _RWF_NOWAIT:
            return 0
        n = residency.resident(offset, len(buf)) if residency is not None else resident_bytes(fd, offset, len(buf))
        if n == 0:
            return 0
        try:
            return os.preadv(fd, [buf[:n]], offset, _RWF_NOWAIT)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return 0
            raise

    def reopen(self, fd: int, flags: int) -> int:
        """The file open on ``fd`` opened again with ``flags`` (not through its path: a rename
        over the path since does not matter). Raises OSError where /proc is not mounted."""
        return os.open(f"/proc/self/fd/{fd}", flags)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)

    def map_private(self, fd: int, size: int) -> mmap.mmap:
        """The file's first ``size`` bytes mapped copy-on-write (``MAP_PRIVATE``): reads come from
        the page cache without a copy, writes to the mapping never reach the file."""
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def scandir(self, path: str) -> list[os.DirEntry]:
        """The entries of the directory ``path`` (a listing, so a test can refuse one: EACCES)."""
        with os.scandir(path) as it:
            return list(it)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def exchange(self, a: str, b: str) -> None:
        """Swap two paths (directories) in one atomic step: Linux ``renameat2(RENAME_EXCHANGE)``.

        Raises:
            OSError: ENOSYS where the C library lacks ``renameat2``; EINVAL where the file
                system cannot exchange (e.g. some network file systems).
        """
        fn = getattr(_LIBC, "renameat2", None)
        if fn is None:
            raise OSError(errno.ENOSYS, "renameat2() is not available in this C library", a)
        if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), a, None, b)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def utime(self, path: str, ns: int) -> None:
        """Set ``path``'s access and modification times to ``ns`` (nanoseconds since the epoch)."""
        os.utime(path, ns=(ns, ns))

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_small(self, path: str, data: bytes) -> None:
        """Write a small file completely and fsync it (manifests, markers, pointers)."""
        fd = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            pwrite_all(self, fd, memoryview(data), 0, path)
            self.fsync(fd)
        finally:
            self.close(fd)

    def read_small(self, path: str) -> bytes | None:
        """A small file's bytes (manifests, markers, pointers), or None when it does not exist."""
        try:
            fd = self.open(path, READ)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            pread_exact(self, fd, memoryview(buf), 0, size, path)
            return bytes(buf)
        finally:
            self.close(fd)


def pwrite_all(ops: FileOps, fd: int, view: memoryview, offset: int, path: str) -> None:
    """Write all of ``view`` at ``offset``, continuing after short writes; no progress is EIO."""
    done = 0
    while done < len(view):
        n = ops.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"write of {path} made no progress at offset {offset + done}")
        done += n


def pread_exact(ops: FileOps, fd: int, view: memoryview | list[memoryview], offset: int, n: int, path: str) -> None:
    """Fill ``view[:n]`` from ``offset`` (``view`` may be longer: O_DIRECT reads whole blocks), or
    the first ``n`` bytes of a list of views, in order, with as few reads as the system allows.

    Raises:
        OSError: EIO when the file ends first (it is shorter than the caller was told).
    """
    views = list(view) if isinstance(view, list) else [view]
    got = 0
    while got < n:
        r = ops.preadv(fd, views[:_IOV_MAX] if len(views) != 1 else views[0], offset + got)
        if r <= 0:
            raise OSError(errno.EIO, f"{path} ended at byte {offset + got}, but bytes [{offset}, {offset + n}) "
                                     "were expected")
        got += r
        while views and r >= len(views[0]):  # drop what is filled, start inside the next view
            r -= len(views.pop(0))
        if views and r:
            views[0] = views[0][r:]
