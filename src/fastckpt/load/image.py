"""A checkpoint read into memory from the process's heap, each large record in its own piece.

Why: memory the heap just freed is already mapped, so filling it again is a copy, while fresh
pages cost a page fault each (0.2-0.4 s per GiB on the VMs measured, more than the copy).
``torch.load`` allocates every storage from the heap; a second load in the same process reuses
what the first one freed. A read into one fresh mapping (``io.image.FlatImage``) pays the faults
every time. So the loader reads a torch zip whose records are page aligned (fastckpt lays out
large records so) into a ``HeapImage``: every record of at least ``OWN_BYTES`` gets memory of
its own from torch's allocator, and the bytes between them (zip headers, the pickle, small
records) pieces of their own. The records' storages are views of their pieces, so a loaded
tensor holds only its own piece, and frees it as ``torch.load``'s tensors do: when, and whether,
freed memory goes back to the system is the allocator's choice, the same as for ``torch.load``.

The layout (which bytes are records) comes from the zip's central directory, read before the
rest: wrong or damaged entries only cost a copy (``__getitem__`` copies a record that crosses
pieces), never the bytes, which the checksum covers wherever they land.

That parse (and, for ``load(into=...)``, the pickle's) runs before the checksum is known, so a
damaged byte there can make it raise anything. Whatever it raises is judged by the bytes it read
(``_unparsed``): the manifest lists the digest of every 16 MiB checksum block, and the few blocks
holding the directory and the pickle are read and hashed only then, on the error path, so a load
whose metadata parses pays nothing for it. A damaged block is corruption naming the file; intact
ones make the error genuine (``into=`` that does not match the file: ``ConfigError``).
"""

from __future__ import annotations

import bisect
import ctypes
import struct
from collections.abc import Callable

import torch

from ..errors import ConfigError, CorruptCheckpointError
from ..format.align import ALIGN, round_up
from ..format.checksum import BLOCK_BYTES, block_digest
from ..format.manifest import EOCD_SIG, TAIL_BYTES, listed_blocks, manifest_in
from ..format.ranges import RangeReader
from .into import plan

ZIP_MAGIC = b"PK\x03\x04"
OWN_BYTES = 64 << 10  # a record this large gets a piece of its own
#: Fewer bytes than this per zip entry: the layout packed the records at 64 bytes (a page pays
#: from 256 KiB per record, ``format.layout.choose_align``), so skip reading the directory.
MIN_AVERAGE = 256 << 10


class HeapImage:
    """A file of ``size`` bytes in heap pieces that start at ``starts`` (file offsets, the first
    0); ``__getitem__`` gives torch's loader the storage of a record (``overall_storage``)."""

    def __init__(self, size: int, spans: list[tuple[int, int]],
                 own: dict[int, torch.UntypedStorage] | None = None) -> None:
        self.size = size
        self.starts: list[int] = []
        self._pieces: list[tuple[torch.UntypedStorage, int, memoryview]] = []  # storage, pad, memory
        own, pos = own or {}, 0
        for off, n in spans:
            if off > pos:
                self._add(pos, off - pos)
            pos = min(size, off + (n if off in own else round_up(n)))
            self._add(off, pos - off, own.get(off))
        if pos < size or not self.starts:
            self._add(pos, size - pos)

    def _add(self, off: int, n: int, storage: torch.UntypedStorage | None = None) -> None:
        """A piece for ``n`` bytes from ``off``: heap memory with room for whole pages (O_DIRECT
        fills whole pages), or ``storage``, a tensor's of ``load(into=...)``, exactly ``n`` bytes
        (the engine reads it through a bounce buffer)."""
        if storage is None:
            room = round_up(n)
            base = torch.empty(room + ALIGN, dtype=torch.uint8).untyped_storage()
            pad = -base.data_ptr() % ALIGN
        elif n > storage.nbytes():  # ``load.into.plan`` matched the sizes: only a bug gets here
            raise CorruptCheckpointError(f"a piece of {n} bytes at byte {off} does not fit the {storage.nbytes()} "
                                         "bytes of the tensor given for it")
        else:
            room, base, pad = n, storage, 0
        view = memoryview((ctypes.c_char * room).from_address(base.data_ptr() + pad)).cast("B")
        self.starts.append(off)
        self._pieces.append((base, pad, view))

    def _end(self, i: int) -> int:
        return self.starts[i + 1] if i + 1 < len(self.starts) else self.size

    def pieces(self, off: int, n: int) -> list[tuple[int, int, memoryview]]:
        out, i, hi = [], bisect.bisect_right(self.starts, off) - 1, off + n
        while off < hi:
            start, end = self.starts[i], min(self._end(i), hi)
            out.append((off, end - off, self._pieces[i][2][off - start :]))
            off, i = end, i + 1
        return out

    def fetch(self, lo: int, hi: int) -> bytes:
        return b"".join(bytes(view[:count]) for _, count, view in self.pieces(lo, min(hi, self.size) - lo))

    def __getitem__(self, span: slice) -> torch.UntypedStorage:
        lo, hi = span.start, span.stop
        i = bisect.bisect_right(self.starts, lo) - 1
        if hi <= self._end(i):
            base, pad, _ = self._pieces[i]
            return base[pad + lo - self.starts[i] : pad + hi - self.starts[i]]
        out = torch.empty(hi - lo, dtype=torch.uint8).untyped_storage()  # spans pieces: a damaged directory
        with memoryview((ctypes.c_char * (hi - lo)).from_address(out.data_ptr())).cast("B") as view:
            view[:] = self.fetch(lo, hi)
        return out

    @property
    def memory(self) -> HeapImage:
        return self

    def release(self) -> None:
        """The engine is done filling; the image stays readable (``fetch``) until it is dropped,
        then the loaded storages alone keep their pieces."""


def heap_image(fetch: Callable[[int, int], bytes], size: int, into: object = None,
               weights_only: bool = True, where: str = "the file") -> HeapImage | None:
    """The heap image for a torch zip of ``size`` bytes whose large records are page aligned;
    None for any other file (read into one buffer, as before). ``into``: the tensors of
    ``load(into=...)``; each record that can be read into one of them (``load.into.plan``, from
    the file's pickle loaded onto the meta device) gets that tensor's memory as its piece.
    ``where``: the file, for messages.

    Raises:
        ConfigError: ``into`` does not match the saved object (``load.into.check``), and the
            bytes that say so are intact.
        CorruptCheckpointError: naming ``where``: its directory or pickle is damaged.
    """
    reads = _Reads(fetch)
    if size < OWN_BYTES or reads(0, 4) != ZIP_MAGIC:
        return None
    tail = reads(max(0, size - TAIL_BYTES), size)
    at = tail.rfind(EOCD_SIG)
    if at < 0 or at + 12 > len(tail):
        return None
    (entries,) = struct.unpack_from("<H", tail, at + 10)
    if entries in (0, 0xFFFF) or size // entries < MIN_AVERAGE:
        return None  # small records (packed at 64 bytes), or a zip64 directory: one buffer
    spans: list[tuple[int, int]] = []
    try:
        reader = torch._C.PyTorchFileReader(RangeReader(size, reads))
        spans = record_spans(reader, size)
        if not spans:
            return None
        return HeapImage(size, spans, _own(reader, spans, into, weights_only) if into is not None else None)
    except OSError:
        raise  # the read itself failed: the target's retries and the loader's fallback handle that
    except Exception as exc:  # noqa: BLE001 (any failure to parse: judged by the bytes it read)
        return _unparsed(exc, reads, size, tail, spans, where)


class _Reads:
    """``fetch`` that remembers the ranges it gave: the bytes a parse of the metadata read."""

    def __init__(self, fetch: Callable[[int, int], bytes]) -> None:
        self.fetch, self.ranges = fetch, []

    def __call__(self, lo: int, hi: int) -> bytes:
        self.ranges.append((lo, hi))
        return self.fetch(lo, hi)


def _unparsed(exc: Exception, reads: _Reads, size: int, tail: bytes, spans: list[tuple[int, int]],
              where: str) -> HeapImage | None:
    """What a load does when parsing the metadata raised ``exc``: corruption if a checksum block
    it read is damaged; ``exc`` itself if it is ``into=``'s mismatch and those blocks are intact.
    Otherwise (a plain torch file, or one too large to list its block digests: nothing to judge
    by yet) the file is read without ``into``'s memory: its checksum, then ``load.into.place``
    (which finds a genuine mismatch again), or torch's loader for a plain file, say what is wrong."""
    intact = _intact(reads, size, tail, where)
    if intact is False:
        raise CorruptCheckpointError(
            f"{where} is corrupt: its zip directory or pickle does not parse ({type(exc).__name__}: {exc}), and the "
            "bytes it was read from do not match the checksums recorded when it was written. Restore from another "
            "copy or an earlier checkpoint (fastckpt.latest(...)).") from exc
    if intact and isinstance(exc, ConfigError):
        raise exc
    return HeapImage(size, spans) if spans else None


def _intact(reads: _Reads, size: int, tail: bytes, where: str) -> bool | None:
    """Whether every checksum block holding a byte ``reads`` gave matches the digest the file's
    manifest lists for it; None when there is nothing to compare with (no manifest, no list)."""
    manifest = manifest_in(tail, size, where, lambda: reads.fetch(0, 4))
    try:
        digests = listed_blocks(manifest) if manifest is not None else None
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    if digests is None:
        return None
    covered = manifest["covered"]  # type: ignore[index]
    blocks = sorted({b for lo, hi in reads.ranges if lo < min(hi, covered)
                     for b in range(lo // BLOCK_BYTES, (min(hi, covered) - 1) // BLOCK_BYTES + 1)})
    return all(block_digest(reads.fetch(b * BLOCK_BYTES, min((b + 1) * BLOCK_BYTES, covered))) == digests[b]
               for b in blocks)


def _own(reader: torch._C.PyTorchFileReader, spans: list[tuple[int, int]], into: object,
         weights_only: bool) -> dict[int, torch.UntypedStorage]:
    """The records to read into ``into``'s tensors: the saved object loaded onto the meta device
    (its pickle only, with torch's safe unpickler; each storage carries its record's offset),
    matched against ``into``."""
    if not weights_only:  # a trusted pickle's code runs only once its file is verified: copy into ``into``
        return {}
    meta = torch.serialization._load(_Directory(reader), "meta", torch.serialization._weights_only_unpickler)
    return plan(into, meta, dict(spans))


class _Directory:
    """A ``PyTorchFileReader`` whose records' offsets come from the central directory alone, as
    ``record_spans`` takes them: the meta pass then reads the pickle, not every record's local
    header (a block read from the device each, before the parallel read starts)."""

    def __init__(self, reader: torch._C.PyTorchFileReader) -> None:
        self._reader, self._align = reader, _alignment(reader)

    def get_record_offset(self, name: str) -> int:
        r = self._reader
        return r.get_record_offset_no_read(r.get_record_header_offset(name), name, r.get_record_size(name), self._align)

    def __getattr__(self, name: str) -> object:
        return getattr(self._reader, name)


def record_spans(reader: torch._C.PyTorchFileReader, size: int) -> list[tuple[int, int]]:
    """``(offset, bytes)`` of the page-aligned storage records of at least ``OWN_BYTES``, in file
    order, from the central directory alone; [] when the layout is not one to split."""
    align = _alignment(reader)
    if align % ALIGN:
        return []
    spans, end = [], 0
    for name in reader.get_all_records():
        if name.startswith("data/") and (n := reader.get_record_size(name)) >= OWN_BYTES:
            spans.append((reader.get_record_offset_no_read(reader.get_record_header_offset(name), name, n, align), n))
    spans.sort()
    for off, n in spans:
        if off % ALIGN or off < end or off + n > size:
            return []  # not the layout torch's writer makes: do not trust it
        end = off + n
    return spans


def _alignment(reader: torch._C.PyTorchFileReader) -> int:
    """The alignment of the file's storage records (torch's writer records it; 64 before that)."""
    return int(reader.get_record(".storage_alignment")) if reader.has_record(".storage_alignment") else 64
