"""The metadata a torch.save wrote, as a cached layout keeps it between saves.

A state of 100,000 small tensors has 100,000 segments and 27 MB of metadata (a zip header, a
directory entry and a pickle entry per record), while its data is 1.6 MB. A layout lives as long
as its Checkpointer, so that metadata would stay in memory beside the staging buffer that holds
the same bytes. Large metadata is therefore kept zlib-compressed (these headers compress about
7 x) and inflated only when a staging buffer does not hold this layout's metadata already:
``serial`` names the bytes, and ``save.snapshot`` skips rewriting a buffer that holds them.
"""

from __future__ import annotations

import itertools
import zlib
from array import array
from collections.abc import Iterator

#: Metadata above this size is kept compressed (a state of a few hundred tensors has tens of KiB).
PACK_ABOVE = 1 << 20
INFLATE_BYTES = 1 << 20  # inflated at a time
_serials = itertools.count(1)


class Segments:
    """The metadata torch.save wrote, in write order (a later segment may overwrite an earlier
    one): one byte string and two arrays, not an object per segment (per-segment objects, made
    while torch's metadata pass churns through its own temporaries, kept 140 MB of the heap
    resident for 27 MB of bytes). Iterates as ``(file offset, bytes)``.

    ``serial`` is unique to these bytes within the process: a staging buffer that records it
    after a copy of them (``StagingBuffer.holds``) need not be given them again.
    """

    __slots__ = ("_data", "_packed", "offsets", "serial", "size", "starts")

    def __init__(self, blob: bytes, offsets: array, starts: array) -> None:
        self._packed = len(blob) > PACK_ABOVE
        self._data = zlib.compress(blob, 1) if self._packed else blob
        self.offsets, self.starts, self.size = offsets, starts, len(blob)
        self.serial = next(_serials)

    @property
    def blob(self) -> bytes:
        """The metadata bytes, inflated when kept compressed."""
        return zlib.decompress(self._data, bufsize=self.size) if self._packed else self._data

    @property
    def kept_bytes(self) -> int:
        """What the metadata costs in memory while it is cached (compressed or not)."""
        return len(self._data)

    def __len__(self) -> int:
        return len(self.offsets)

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        starts, end = self.starts, self.size
        data = self._inflated() if self._packed else _Window(iter((memoryview(self._data),)))
        for i, off in enumerate(self.offsets):
            yield off, data.take(starts[i], starts[i + 1] if i + 1 < len(starts) else end)

    def _inflated(self) -> _Window:
        """The metadata inflated a piece at a time, not into one string of ``size`` bytes: a
        temporary that large would stay in the process's heap after it is freed."""
        z = zlib.decompressobj()

        def pieces() -> Iterator[memoryview]:
            tail = self._data
            while tail:
                piece = z.decompress(tail, INFLATE_BYTES)
                tail = z.unconsumed_tail
                yield memoryview(piece)
            rest = z.flush()
            if rest:
                yield memoryview(rest)

        return _Window(pieces())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Segments) and (self.blob, self.offsets, self.starts) == (
            other.blob, other.offsets, other.starts)

    __hash__ = None  # type: ignore[assignment]  (equal by value, and arrays are mutable)


class _Window:
    """Consecutive spans of a byte stream given as pieces. A span inside one piece is a view of it
    (which keeps the piece alive as long as it is used: the GDS writer's writes are asynchronous);
    one across pieces is a copy."""

    def __init__(self, pieces: Iterator[memoryview]) -> None:
        self._pieces, self._piece, self._at = pieces, memoryview(b""), 0  # ``_at``: where _piece starts

    def take(self, lo: int, hi: int) -> memoryview:
        if hi <= lo:
            return memoryview(b"")
        while lo >= self._at + len(self._piece):
            self._next()
        a = lo - self._at
        if hi <= self._at + len(self._piece):
            return self._piece[a : hi - self._at]
        parts = [bytes(self._piece[a:])]
        while hi > self._at + len(self._piece):
            self._next()
            parts.append(bytes(self._piece[: hi - self._at]))
        return memoryview(b"".join(parts))

    def _next(self) -> None:
        self._at += len(self._piece)
        self._piece = next(self._pieces)
