"""How one chunk of ``engine.read_file`` reaches its image's pieces.

A chunk's bytes come from the page cache as far as it holds them (``read_part``: through the
buffered twin of the O_DIRECT file, asking one ``Residency`` mapping where the cached pages
are), the rest from the device with O_DIRECT. A cold run of pieces that O_DIRECT can fill goes
to the device as one request (``preadv`` over them all: one read per record, one after another,
measured two thirds as fast for a 64 MiB file of 127 records). A piece that O_DIRECT cannot fill
(``io.image.needs_bounce``: a tensor of the caller's) goes through the thread's bounce buffer.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

from ..format.align import ALIGN, round_up
from .image import Bounce, aligned_share, needs_bounce
from .ops import FileOps, Residency, pread_exact

HOT_BYTES = 2 << 20  # what a read from the page cache hashes at a time
BOUNCE_BYTES = 4 << 20  # per reading thread, for pieces O_DIRECT cannot fill
Part = tuple[int, int, memoryview]  # file offset, bytes, memory (``Image.pieces``)


def alloc_aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (as O_DIRECT needs), at least one page."""
    return mmap.mmap(-1, max(ALIGN, round_up(nbytes)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def read_part(ops: FileOps, fd: int, cached: int, chunk: memoryview, off: int, n: int, path: str,
              residency: Residency | None = None, feed: Callable[[memoryview], None] | None = None) -> None:
    """Fill ``chunk[:n]`` with the file's bytes from ``off``: from the page cache as far as it
    holds them (through ``cached``, when >= 0; ``residency`` of it, if given, says where), the
    rest from ``fd``. ``feed`` gets the bytes in order, those from the cache ``HOT_BYTES`` at a
    time: hashed while they are still in the CPU's caches."""
    got = fed = read_cached(ops, cached, chunk, off, n, residency, feed) if cached >= 0 else 0
    if got < n:
        got -= got % ALIGN  # O_DIRECT continues from a page boundary
        pread_exact(ops, fd, chunk[got:], off + got, n - got, path)
    if feed is not None and fed < n:
        feed(chunk[fed:n])


def read_cached(ops: FileOps, cached: int, view: memoryview, off: int, n: int, residency: Residency | None,
                feed: Callable[[memoryview], None] | None) -> int:
    """Fill ``view`` from the page cache (the buffered ``cached``) from ``off`` as far as it holds
    the bytes, up to ``n``: the bytes read, each fed ``HOT_BYTES`` at a time (any memory will do)."""
    step, got = (HOT_BYTES if feed is not None else n), 0
    while got < n and (r := ops.preadv_cached(cached, view[got : min(n, got + step)], off + got, residency)) > 0:
        if feed is not None:
            feed(view[got : got + r])
        got += r
    return got


class PartReader:
    """Fills pieces of one open file (``fd``, O_DIRECT when ``direct``; ``cached``: its buffered
    twin, or -1; ``res``: a ``Residency`` of the twin). Thread-safe; ``close`` frees the bounce
    buffers once the read is over."""

    def __init__(self, ops: FileOps, fd: int, cached: int, path: str, direct: bool, res: Residency | None) -> None:
        self._ops, self._fd, self._cached, self._path, self._direct, self._res = ops, fd, cached, path, direct, res
        self._bounce = Bounce(BOUNCE_BYTES)

    def _part(self, chunk: memoryview, off: int, n: int, feed: Callable[[memoryview], None] | None = None) -> None:
        read_part(self._ops, self._fd, self._cached, chunk, off, n, self._path, self._res, feed)

    def fill(self, parts: list[Part], feed: Callable[[memoryview], None]) -> None:
        """Fill ``parts`` (consecutive, in file order); ``feed`` gets every byte in order."""
        odd = [self._direct and needs_bounce(at, count, view) for at, count, view in parts]
        cold = self._direct and bool(parts) and (self._res is None or self._res.resident(parts[0][0], 1) == 0)
        i = 0
        while i < len(parts):
            at, count, view = parts[i]
            j = i + 1
            while cold and not odd[i] and j < len(parts) and not odd[j]:
                j += 1
            if odd[i]:  # what the cache holds straight into the memory, the rest through the bounce buffer
                got = read_cached(self._ops, self._cached, view, at, count, self._res, feed) if self._cached >= 0 else 0
                if got < count:
                    self._bounce.read_through(self._part, view[got:], at + got, count - got, feed)
            elif j - i > 1:  # not cached: one request, however many pieces hold it
                run = parts[i:j]
                pread_exact(self._ops, self._fd, [aligned_share(c, v, True) for _, c, v in run], at,
                            sum(c for _, c, _ in run), self._path)
                for _, c, v in run:
                    feed(v[:c])
            else:
                self._part(aligned_share(count, view, self._direct), at, count, feed)
            i = j

    def block(self, off: int, n: int) -> bytes:
        """``n`` bytes from ``off`` (a page), read as the chunks read: for ``io.image.BlockFetch``."""
        buf = alloc_aligned(n)
        with memoryview(buf) as view:
            self._part(aligned_share(n, view, self._direct), off, n)
            data = bytes(view[:n])
        buf.close()
        return data

    def close(self) -> None:
        self._bounce.close()
