"""Where a read puts a file's bytes: a file image in memory, one buffer or several pieces.

``read_file`` fills an image chunk by chunk from its worker threads. ``FlatImage`` is one
page-aligned buffer (an anonymous mapping, fresh pages every read). A caller may build its own
image instead (``read_file(into=...)``: ``load.image.HeapImage`` puts each large record of a
torch zip in memory of its own, from the process's heap), so the engine only asks an image for
the memory behind a range of the file (``pieces``) and for a few bytes of it (``fetch``).

The protocol (``Image``), in call order, all from the reading thread except ``pieces``:
  1. the caller's ``into(fetch, size)`` builds it (``fetch`` reads the file, before the image
     is filled), or the engine makes a ``FlatImage``;
  2. ``pieces(off, n)``, from the workers, once per chunk: the memory of ``[off, off + n)``;
  3. ``fetch(lo, hi)``: bytes of the filled image (the manifest in the tail);
  4. ``memory``: what ``ReadResult.buffer`` hands on; ``release()`` ends the engine's use.
A piece that starts on a page of the file and of memory, with room for whole pages, is read
straight into with O_DIRECT; any other (``needs_bounce``: a tensor of the caller's, which torch
aligns to 64 bytes, ``load(..., into=...)``) is read through a small page-aligned buffer of the
reading thread's (``Bounce``) and copied.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable
from typing import Protocol

import xxhash

from ..format import checksum
from ..format.align import ALIGN, round_up


class Image(Protocol):
    size: int

    def pieces(self, off: int, n: int) -> list[tuple[int, int, memoryview]]:
        """``(file offset, bytes of the range in it, memory)`` in file order; the memory may be
        longer than the bytes (room to round an O_DIRECT read up to a page), never shorter."""
        ...

    def fetch(self, lo: int, hi: int) -> bytes: ...

    @property
    def memory(self) -> object: ...

    def release(self) -> None: ...


class FlatImage:
    """The whole file in one page-aligned buffer: ``memory`` is the mmap itself."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.size, self._buf, self._view = size, buf, memoryview(buf)

    def pieces(self, off: int, n: int) -> list[tuple[int, int, memoryview]]:
        return [(off, n, self._view[off:])]

    def fetch(self, lo: int, hi: int) -> bytes:
        return bytes(self._view[lo:hi])

    @property
    def memory(self) -> mmap.mmap:
        return self._buf

    def release(self) -> None:
        self._view.release()


class BlockFetch:
    """``fetch(lo, hi)`` over ``read(off, n)``, which reads whole aligned 64 KiB blocks, each
    once, consecutive ones not read yet in one request: the few scattered reads that find an
    image's layout (a zip's directory) cost a handful of block reads, on a device or from an
    object store, and a long range (a large pickle, a checksum block to verify) one request.
    ``known``: ``(offset, bytes)`` the caller has read already (an object's tail), served
    without a read."""

    BLOCK = 64 << 10

    def __init__(self, read: Callable[[int, int], bytes], size: int, known: tuple[int, bytes] = (0, b"")) -> None:
        self._read, self._size, self._blocks, self._known = read, size, {}, known

    def fetch(self, lo: int, hi: int) -> bytes:
        at, data = self._known
        hi = min(hi, self._size)
        if at <= lo and hi <= at + len(data):
            return data[lo - at : hi - at]
        wanted = range(lo - lo % self.BLOCK, hi, self.BLOCK)
        missing = [b for b in wanted if b not in self._blocks]
        while missing:
            n = next((i for i in range(1, len(missing)) if missing[i] != missing[i - 1] + self.BLOCK), len(missing))
            start, end = missing[0], min(missing[n - 1] + self.BLOCK, self._size)
            got = self._read(start, end - start)
            for b in missing[:n]:
                self._blocks[b] = got[b - start : b - start + self.BLOCK]
            missing = missing[n:]
        return b"".join(self._blocks[b][max(lo, b) - b : min(hi, b + self.BLOCK) - b] for b in wanted)


def block_digests(view: memoryview, off: int, n: int, covered: int) -> list[int]:
    """Block digests of ``view[:n]`` (file bytes from ``off``) that fall inside ``[0, covered)``."""
    lim = max(0, min(n, covered - off))
    return [checksum.block_digest(view[b : min(b + checksum.BLOCK_BYTES, lim)])
            for b in range(0, lim, checksum.BLOCK_BYTES)]


def image_digests(image: Image, off: int, n: int, covered: int) -> list[int]:
    """Block digests of the file bytes ``[off, off + n)`` held in ``image`` that fall inside
    ``[0, covered)``; ``off`` is on a block boundary. A block that spans pieces is hashed as one
    stream over them (``BlockStream``: the same digest as over contiguous bytes)."""
    stream = BlockStream(off, min(off + n, covered))
    for _, count, view in image.pieces(off, n):
        stream.feed(view[:count])
    return stream.digests()


class BlockStream:
    """Block digests of file bytes ``feed`` gets in order, from ``off`` (a block boundary) up to
    ``limit``: a reader hashes each part as soon as it has it (the same digests as over the
    contiguous bytes; bytes past ``limit`` are ignored)."""

    def __init__(self, off: int, limit: int) -> None:
        self._pos, self._limit, self._hash, self._out = off, limit, xxhash.xxh3_64(), []

    def feed(self, part: memoryview) -> None:
        while len(part) and self._pos < self._limit:
            take = min(len(part), checksum.BLOCK_BYTES - self._pos % checksum.BLOCK_BYTES, self._limit - self._pos)
            self._hash.update(part[:take])
            self._pos, part = self._pos + take, part[take:]
            if self._pos % checksum.BLOCK_BYTES == 0 or self._pos == self._limit:
                self._out.append(self._hash.intdigest())
                self._hash = xxhash.xxh3_64()

    def digests(self) -> list[int]:
        if self._pos < self._limit:
            raise AssertionError(f"fed up to byte {self._pos}, not {self._limit}")
        return self._out


def aligned_share(count: int, view: memoryview, direct: bool) -> memoryview:
    """The memory a read of ``count`` bytes fills: rounded up to whole pages for O_DIRECT, as
    far as ``view`` has room (the last page of a file is short)."""
    want = round_up(count) if direct else count
    return view[: min(want, len(view))]


def needs_bounce(at: int, count: int, view: memoryview) -> bool:
    """Whether O_DIRECT cannot read file bytes ``[at, at + count)`` straight into ``view``: the
    range or the memory is not on a page, or the memory has no room for the last whole page."""
    return bool(at % ALIGN or len(view) < round_up(count) or _address(view) % ALIGN)


def _address(view: memoryview) -> int:
    """Where writable ``view`` starts in memory (an empty view: 0)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


class Bounce:
    """One page-aligned buffer of ``nbytes`` per reading thread, made at its first use and
    unmapped by ``close``; ``read_through`` moves a piece that ``needs_bounce`` through it."""

    def __init__(self, nbytes: int = 4 << 20) -> None:
        self._nbytes, self._local, self._lock, self._made = nbytes, threading.local(), threading.Lock(), []

    def _buffer(self) -> memoryview:
        view = getattr(self._local, "view", None)
        if view is None:
            buf = mmap.mmap(-1, self._nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = self._local.view = memoryview(buf)
            with self._lock:
                self._made.append((buf, view))
        return view

    def read_through(self, read: Callable[[memoryview, int, int], None], view: memoryview, at: int, count: int,
                     feed: Callable[[memoryview], None]) -> None:
        """Fill ``view[:count]`` with file bytes from ``at``: ``read(buffer, offset, n)`` fills
        ``buffer`` from a page-aligned ``offset``, a buffer at a time; ``feed`` gets the bytes in
        order (hashed while the buffer is in the CPU's caches)."""
        bounce, pos = self._buffer(), 0
        src, dst = _address(bounce), _address(view)
        while pos < count:
            head = (at + pos) % ALIGN
            n = min(count - pos, len(bounce) - head)
            read(bounce[: round_up(head + n)], at + pos - head, head + n)
            feed(bounce[head : head + n])
            ctypes.memmove(dst + pos, src + head, n)  # releases the GIL (a slice assignment holds it)
            pos += n

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, []
        for buf, view in made:
            view.release()
            buf.close()
