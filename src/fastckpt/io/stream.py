"""Streaming copies and read-backs with bounded memory: one reusable aligned chunk buffer per
worker thread, on the caller's executor (replication to a POSIX home, verification)."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from ..format import checksum
from ..format.align import ALIGN
from .engine import alloc_aligned, block_digests, open_for_read, open_for_write, round_up, run_chunks
from .ops import READ, FileOps, pread_exact, pwrite_all

log = logging.getLogger(__name__)

_tls = threading.local()


def _chunk_buffer(nbytes: int) -> memoryview:
    """A per-thread reusable aligned buffer for streaming copies."""
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < nbytes:
        _tls.buf = buf = alloc_aligned(nbytes)
    return memoryview(buf)[:nbytes]


@dataclass(frozen=True)
class CopyResult:
    """What ``copy_file`` did.

    Attributes:
        checksum: of ``[0, covered)`` of the source bytes, as read.
        read_back: of the same range read back from the destination with O_DIRECT, chunk by
            chunk as each was written; None when not asked for or the destination is not
            O_DIRECT (then a page-cache read proves nothing: read it back separately).
        odirect, odirect_reason: whether the destination was written with O_DIRECT, and why not.
    """

    path: str
    bytes: int
    checksum: str
    read_back: str | None
    odirect: bool
    odirect_reason: str | None


def copy_file(
    ops: FileOps,
    pool: Executor,
    src: str,
    dst: str,
    size: int,
    covered: int,
    *,
    chunk_bytes: int,
    odirect: bool = True,
    throttle: Callable[[int], object] | None = None,
    read_back: bool = False,
) -> CopyResult:
    """Stream ``src`` to ``dst`` in parallel chunks, hashing ``[0, covered)`` on the way, fsync.

    ``read_back``: each worker reads its chunk back from ``dst`` right after writing it, with
    O_DIRECT (from the device, past the page cache), and hashes it: verification overlaps the
    copy instead of following it. ``throttle`` is charged for those reads too.

    Memory is one chunk per worker thread. The caller compares the returned checksums with
    the manifest before publishing ``dst``.
    """
    rfd, _ = open_for_read(ops, src, odirect)
    try:
        wfd, direct, reason = open_for_write(ops, dst, odirect)
        try:
            pairs, back = _copy_chunks(ops, pool, src, dst, size, covered, rfd, wfd, direct, chunk_bytes, throttle,
                                       read_back)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            # accepted O_DIRECT at open, refused it on write (as write_file handles): go buffered
            ops.close(wfd)
            wfd = -1  # closed: if the re-open fails, the finally below must not close it again
            wfd, direct = ops.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), False
            reason = "filesystem refused O_DIRECT writes (EINVAL)"
            pairs, back = _copy_chunks(ops, pool, src, dst, size, covered, rfd, wfd, direct, chunk_bytes, throttle,
                                       read_back)
        finally:
            if wfd >= 0:
                ops.close(wfd)
    finally:
        ops.close(rfd)
    return CopyResult(dst, size, checksum.combine(d for d, _ in pairs), back, direct, reason)


def _copy_chunks(ops: FileOps, pool: Executor, src: str, dst: str, size: int, covered: int, rfd: int, wfd: int,
                 direct: bool, chunk_bytes: int, throttle: Callable[[int], object] | None,
                 read_back: bool) -> tuple[list[tuple[int, int]], int | None]:
    """``copy_file``'s chunks into ``wfd`` (and fsync): each chunk's block digests as read, and
    as read back when ``read_back`` on an O_DIRECT destination (else 0); the read-back checksum."""
    vfd = -1
    try:
        if read_back and direct:
            vfd, back_direct = open_for_read(ops, dst, True)
            if not back_direct:  # cannot happen when the write side got O_DIRECT; be safe
                ops.close(vfd)
                vfd = -1

        def one(off: int, n: int) -> list[tuple[int, int]]:
            view = _chunk_buffer(round_up(n))
            pread_exact(ops, rfd, view, off, n, src)
            digests = block_digests(view, off, n, covered)
            if throttle is not None:
                throttle(n)  # the bandwidth cap (replicate_bandwidth_Bps)
            pwrite_all(ops, wfd, view[: round_up(n) if direct else n], off, dst)
            if vfd < 0:
                return [(d, 0) for d in digests]
            if throttle is not None:
                throttle(n)
            pread_exact(ops, vfd, view, off, n, dst)
            return list(zip(digests, block_digests(view, off, n, covered), strict=True))

        pairs = run_chunks(pool, size, chunk_bytes, one)
        if direct and size % ALIGN:
            ops.ftruncate(wfd, size)
        ops.fsync(wfd)
        return pairs, checksum.combine(b for _, b in pairs) if vfd >= 0 else None
    finally:
        if vfd >= 0:
            ops.close(vfd)


def checksum_file(ops: FileOps, pool: Executor, path: str, size: int, covered: int, *,
                  chunk_bytes: int, odirect: bool = True, throttle: Callable[[int], object] | None = None) -> str:
    """Checksum ``[0, covered)`` of a file with bounded memory (one chunk per worker thread).

    With O_DIRECT the bytes come from the device, not the page cache: a real read-back.
    """
    fd, _ = open_for_read(ops, path, odirect)
    try:
        def one(off: int, n: int) -> list[int]:
            view = _chunk_buffer(round_up(n))
            if throttle is not None:
                throttle(n)
            pread_exact(ops, fd, view, off, n, path)
            return block_digests(view, off, n, covered)

        return checksum.combine(run_chunks(pool, covered, chunk_bytes, one))
    finally:
        ops.close(fd)


def drop_cache(ops: FileOps, path: str) -> None:
    """Evict a file's cached pages (a hint), so that the next read comes from storage, not from
    memory: a read-back that proves what the device holds. A missing file is left to the read."""
    try:
        fd = ops.open(path, READ)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:  # a hint: a file system may not support it
        log.debug("posix_fadvise(DONTNEED) not supported for %s", path)
    finally:
        ops.close(fd)
