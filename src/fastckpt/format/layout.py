"""torch.save-compatible files, laid out for fast writes.

The metadata (pickle, zip headers) comes from ``torch.save`` itself under
``torch.serialization.skip_data()``; torch seeks over the storages' bytes, so the layout costs
no copy, and the seeks it makes are where the storages' bytes go. fastckpt then fills the
storages at those offsets and appends its manifest as the zip archive comment, so every file is
a plain ``torch.load``-able zip that also carries its own checksum.

Alignment: every record of a file starts on one boundary, recorded by torch in the file's
``.storage_alignment`` record (``torch.load`` with ``calculate_storage_offsets`` computes the
offsets from it, so one file cannot mix two). Page alignment (``ALIGN``, 4 KiB), as GPUDirect
Storage writes of single records need, is used whenever it costs at most ``PAD_BUDGET`` of the
payload; a state of many small tensors is packed at torch's default 64 bytes instead, so its
file is no larger than torch.save's. The writer does not need either: it writes the whole file
image in page-aligned chunks.

``Planner`` keeps the layouts of the last few state structures: a state whose ``walk.scan``
signature (keys, values, tensor shapes, strides, dtypes, storage sharing) equals one seen before
reuses that layout, so the metadata pass (about 60 us per tensor) leaves the save's hot path.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import io
import threading
import zipfile
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.serialization import config as _ser_config

from ..errors import UnsupportedObjectError
from .align import ALIGN
from .manifest import EOCD_LEN, EOCD_SIG
from .ranges import RangeReader
from .segments import Segments
from .walk import Scan, check_tensors, dtype_aliases, find_unpicklable, pickling_order, scan

SMALL_ALIGN = 64  # torch.save's default storage alignment
#: Page alignment is used when its padding adds at most this fraction to the payload.
PAD_BUDGET = 1 / 64
CACHED_LAYOUTS = 4  # state structures a Planner remembers


class StorageRecord(NamedTuple):
    """One storage of the object and where its bytes go in the file."""

    key: str
    offset: int
    nbytes: int
    storage: torch.UntypedStorage


@dataclass(frozen=True)
class FileLayout:
    """The file minus the storages' bytes: metadata segments, storage slots, sizes.

    ``data_size`` is the size of the zip without comment; the checksum covers
    ``[0, covered_bytes)``, which is everything but the comment-length field and the comment.
    ``align``: the boundary every storage record starts on; ``cuda``: some storage is on a
    CUDA device.
    """

    segments: Segments
    storages: tuple[StorageRecord, ...]
    data_size: int
    align: int = ALIGN
    payload_bytes: int = -1  # computed from ``storages`` when not given
    cuda: bool = False

    def __post_init__(self) -> None:
        if self.payload_bytes < 0:
            object.__setattr__(self, "payload_bytes", sum(s.nbytes for s in self.storages))

    @property
    def covered_bytes(self) -> int:
        return self.data_size - 2


@dataclass(frozen=True)
class Template:
    """A layout without its storages, as ``Planner`` keeps it: the records' offsets and sizes in
    arrays (no object per storage; record ``i`` is torch's ``data/i``)."""

    segments: Segments
    offsets: array
    sizes: array
    data_size: int
    align: int
    payload_bytes: int

    @classmethod
    def of(cls, layout: FileLayout) -> Template:
        return cls(layout.segments, array("q", [r.offset for r in layout.storages]),
                   array("q", [r.nbytes for r in layout.storages]), layout.data_size, layout.align,
                   layout.payload_bytes)

    def bind(self, storages: tuple[torch.UntypedStorage, ...], cuda: bool) -> FileLayout:
        """The layout with ``storages`` (same sizes, same order) in its slots."""
        if len(storages) != len(self.offsets):
            raise ValueError(f"{len(storages)} storages for a layout of {len(self.offsets)}")
        recs = tuple(map(StorageRecord, map(str, range(len(storages))), self.offsets, self.sizes, storages))
        return FileLayout(self.segments, recs, self.data_size, self.align, self.payload_bytes, cuda)


def choose_align(sizes: list[int], page_aligned: bool | None = None) -> int:
    """``ALIGN`` when asked, or when page padding adds at most ``PAD_BUDGET`` to the payload.

    Each record may cost up to a page of padding (its zip header and the previous record's data
    descriptor sit between the records), so page alignment pays when the storages average at
    least ``ALIGN / PAD_BUDGET`` (256 KiB).
    """
    if page_aligned is not None:
        return ALIGN if page_aligned else SMALL_ALIGN
    return ALIGN if len(sizes) * ALIGN <= sum(sizes) * PAD_BUDGET else SMALL_ALIGN


class _SeekOnlySink(io.RawIOBase):
    """File-like sink that keeps written bytes as ``Segments`` and records the spans torch seeks
    over (``skips``: the storages' bytes, in the order torch writes its records). Lean: torch
    calls ``write`` about five times per storage, and each contiguous run of writes is appended
    to one buffer, with no object per write or per run."""

    def __init__(self) -> None:
        self.pos = 0
        self._end = 0  # the end before the current run of writes; ``end`` is the true one
        self.skips: list[tuple[int, int]] = []
        self._blob = bytearray()
        self._offsets, self._starts = array("q"), array("q")
        self._run_end = -1  # the file offset the current run of writes has reached

    @property
    def end(self) -> int:
        return max(self._end, self.pos)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        if self.pos != self._run_end:  # a new run starts here
            self._offsets.append(self.pos)
            self._starts.append(len(self._blob))
        n = len(self._blob)
        self._blob += b  # a copy: torch hands out a view of a buffer it reuses
        n = len(self._blob) - n
        self.pos = self._run_end = self.pos + n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        end = self.end
        new = (0, self.pos, end)[whence] + offset
        if self.pos == end and new > end:
            self.skips.append((end, new - end))
        self.pos, self._end = new, max(end, new)
        return new

    def tell(self) -> int:
        return self.pos

    def segments(self) -> Segments:
        """What was written, in write order."""
        return Segments(bytes(self._blob), self._offsets, self._starts)

    def tail(self) -> tuple[int, bytes]:
        """The file offset and bytes of the last segment that ends where the file ends (torch
        writes the archive's trailer last), else of the one that ends last; from the sink's own
        bytes, so a large layout's compressed metadata is not inflated for it."""
        starts, offsets, size = self._starts, self._offsets, len(self._blob)

        def span(i: int) -> tuple[int, int]:
            return starts[i], starts[i + 1] if i + 1 < len(starts) else size

        def end(i: int) -> int:
            lo, hi = span(i)
            return offsets[i] + hi - lo

        last = len(offsets) - 1
        if end(last) != self.end:
            last = max(range(len(offsets)), key=end)
        lo, hi = span(last)
        return offsets[last], bytes(self._blob[lo:hi])


def _sparse_reader(segments: Segments | list[tuple[int, bytes]], size: int) -> RangeReader:
    """A file over a sparse image (segments, zeros elsewhere), for torch's zip reader."""
    segments = sorted(segments, key=lambda s: s[0])  # stable: in write order where they start alike
    starts = [off for off, _ in segments]

    def fetch(lo: int, hi: int) -> bytes:
        out = bytearray(hi - lo)
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(segments) and segments[i][0] < hi:
            off, data = segments[i]
            a, b = max(lo, off), min(hi, off + len(data))
            if a < b:
                out[a - lo : b - lo] = data[a - off : b - off]
            i += 1
        return bytes(out)

    return RangeReader(size, fetch)


def _offsets_from_skips(sink: _SeekOnlySink, sizes: list[int]) -> list[int] | None:
    """Record offsets from the spans torch skipped (one per non-empty storage, in key order);
    None if they do not line up with ``sizes``. An empty storage gets the previous end."""
    skips = iter(sink.skips)
    out, end = [], 0
    for n in sizes:
        if n:
            off, skipped = next(skips, (-1, -1))
            if skipped != n:
                return None
            end = off + n
            out.append(off)
        else:
            out.append(end)
    return out if next(skips, None) is None else None


def _offsets_from_zip(segments: Segments | list[tuple[int, bytes]], size: int, sizes: list[int]) -> list[int] | None:
    """Record offsets read back from the zip directory with torch's own reader (the slow way);
    None when the records do not match ``sizes``."""
    with zipfile.ZipFile(_sparse_reader(segments, size)) as zf:  # type: ignore[arg-type]
        found = {}
        for info in zf.infolist():
            head, _, key = info.filename.rpartition("/")
            if head.endswith("data") and key.isdigit():
                found[int(key)] = info.file_size
    if found != dict(enumerate(sizes)):
        return None
    reader = torch._C.PyTorchFileReader(_sparse_reader(segments, size))
    return [reader.get_record_offset(f"data/{i}") for i in range(len(sizes))]


def _metadata(obj: object, align: int) -> _SeekOnlySink:
    """torch.save's metadata pass: the archive without the storages' bytes."""
    sink = _SeekOnlySink()
    old_align = _ser_config.save.storage_alignment
    _ser_config.save.storage_alignment = align
    try:
        with torch.serialization.skip_data():
            torch.save(obj, sink)
    except Exception as exc:
        if (aliased := dtype_aliases(obj)) is not None:
            raise UnsupportedObjectError(f"cannot save {aliased}.") from exc
        where = find_unpicklable(obj)
        fix = ("dequantize() it, or save it with torch.save" if "qtensor" in str(exc) else "drop or convert that entry")
        raise UnsupportedObjectError(
            f"cannot save {where}: {exc}. Only tensors, containers and plain Python values can be saved; {fix}."
        ) from exc
    finally:
        _ser_config.save.storage_alignment = old_align
    return sink


def plan(obj: object, *, page_aligned: bool | None = None, scanned: Scan | None = None) -> FileLayout:
    """Lay out ``obj`` as a torch.save zip without touching the tensors' bytes.

    Args:
        page_aligned: True: every record on a 4 KiB boundary (the gds tier); False: packed at
            64 bytes; None: ``choose_align``.
        scanned: ``walk.scan(obj)``, when the caller has it.

    Raises:
        UnsupportedObjectError: something in ``obj`` cannot be saved; the message names the key.
    """
    scanned = scanned or scan(obj)
    if scanned is None:
        check_tensors(obj)
        try:
            storages = tuple(pickling_order(obj))
        except Exception:
            _metadata(obj, ALIGN)  # torch.save fails too: raises the error naming the culprit
            raise
        cuda = any(st.device.type == "cuda" for st in storages)
    else:
        storages, cuda = scanned.storages, scanned.cuda
    sizes = [st.nbytes() for st in storages]
    align = choose_align(sizes, page_aligned)
    sink = _metadata(obj, align)
    segments = sink.segments()
    offsets = _offsets_from_skips(sink, sizes) or _offsets_from_zip(segments, sink.end, sizes)
    if offsets is None:
        raise UnsupportedObjectError(
            f"torch.save wrote other storages than the {len(sizes)} fastckpt found (or of other sizes); "
            "the object holds a tensor type fastckpt does not support yet."
        )
    for i, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
        if n and off % align:
            raise UnsupportedObjectError(f"storage data/{i} is not {align}-aligned in the file")
    tail_off, tail = sink.tail()
    if tail_off + len(tail) != sink.end or tail[-EOCD_LEN : -EOCD_LEN + 4] != EOCD_SIG:
        raise UnsupportedObjectError("torch.save did not end the archive with a plain zip trailer")
    recs = tuple(StorageRecord(str(i), off, n, st) for i, (off, n, st) in enumerate(zip(offsets, sizes, storages)))
    return FileLayout(segments, recs, sink.end, align, sum(sizes), cuda)


class Planner:
    """``plan`` with memory: a state whose signature equals one of the last ``CACHED_LAYOUTS``
    structures planned reuses that layout (thread-safe; one per Checkpointer)."""

    def __init__(self, cached: int = CACHED_LAYOUTS) -> None:
        self._cached = cached
        self._lock = threading.Lock()
        self._layouts: list[tuple[tuple, bool | None, Template]] = []  # newest last
        self.hits = 0

    def plan(self, obj: object, *, page_aligned: bool | None = None) -> FileLayout:
        """See ``plan``."""
        with _gc_paused():  # the walk and a reuse: an object or more per tensor
            found = scan(obj)
            reused = self._reuse(found, page_aligned) if found is not None else None
        if reused is not None:
            return reused
        if found is None:
            return plan(obj, page_aligned=page_aligned)
        layout = plan(obj, page_aligned=page_aligned, scanned=found)
        template = Template.of(layout)
        with self._lock:
            self._layouts.append((found.signature, page_aligned, template))
            del self._layouts[: -self._cached]
        return layout

    def _reuse(self, found: Scan, page_aligned: bool | None) -> FileLayout | None:
        """The cached layout of ``found``'s structure bound to its storages, or None."""
        with self._lock:
            for i, (sig, aligned, template) in enumerate(self._layouts):
                if aligned == page_aligned and sig == found.signature:
                    self._layouts.append(self._layouts.pop(i))
                    self.hits += 1
                    return template.bind(found.storages, found.cuda)
        return None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic collector off while a save walks its state and binds a cached layout (the
    caller's thread): an object or more per tensor, whose collections traversed the whole heap at
    100,000 tensors (blocked 0.66 s, paused 0.49 s). Not during torch's metadata pass, whose
    garbage it must collect; a collector the caller turned off stays off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
