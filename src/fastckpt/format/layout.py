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
import io
import threading
import zipfile
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.serialization import config as _ser_config

from ..errors import UnsupportedObjectError
from .manifest import EOCD_LEN, EOCD_SIG
from .ranges import RangeReader
from .walk import Scan, check_tensors, find_unpicklable, pickling_order, scan

ALIGN = 4096  # page alignment, as O_DIRECT and GDS need
SMALL_ALIGN = 64  # torch.save's default storage alignment
#: Page alignment is used when its padding adds at most this fraction to the payload.
PAD_BUDGET = 1 / 64
CACHED_LAYOUTS = 4  # state structures a Planner remembers


class StorageRecord(NamedTuple):
    """One storage of the object and where its bytes go in the file (``storage`` is None in a
    cached template)."""

    key: str
    offset: int
    nbytes: int
    storage: torch.UntypedStorage | None


@dataclass(frozen=True)
class FileLayout:
    """The file minus the storages' bytes: metadata segments, storage slots, sizes.

    ``data_size`` is the size of the zip without comment; the checksum covers
    ``[0, covered_bytes)``, which is everything but the comment-length field and the comment.
    ``align``: the boundary every storage record starts on; ``cuda``: some storage is on a
    CUDA device.
    """

    segments: tuple[tuple[int, bytes], ...]
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

    def bind(self, storages: tuple[torch.UntypedStorage, ...], cuda: bool) -> FileLayout:
        """This layout with ``storages`` (same sizes, same order) in its slots."""
        recs = tuple(StorageRecord(r.key, r.offset, r.nbytes, st)
                     for r, st in zip(self.storages, storages, strict=True))
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
    """File-like sink that keeps written bytes as segments and records the spans torch seeks
    over (``skips``: the storages' bytes, in the order torch writes its records). Lean: torch
    calls ``write`` about five times per storage."""

    def __init__(self) -> None:
        self.pos = 0
        self._end = 0  # the end before the current run of writes; ``end`` is the true one
        self.skips: list[tuple[int, int]] = []
        self._segments: list[tuple[int, bytes]] = []
        self._run: list[bytes] = []  # pieces of the contiguous run being written
        self._run_start = self._run_end = 0

    @property
    def end(self) -> int:
        return max(self._end, self.pos)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        if self.pos != self._run_end:
            self._flush()
            self._run_start = self.pos
        data = bytes(b)  # torch hands out a view of a buffer it reuses
        self._run.append(data)
        self.pos = self._run_end = self.pos + len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        end = self.end
        new = (0, self.pos, end)[whence] + offset
        if self.pos == end and new > end:
            self.skips.append((end, new - end))
        self.pos, self._end = new, max(end, new)
        return new

    def tell(self) -> int:
        return self.pos

    def _flush(self) -> None:
        if self._run:
            self._segments.append((self._run_start, b"".join(self._run)))
            self._run = []

    def segments(self) -> list[tuple[int, bytes]]:
        """What was written, in write order (a later segment may overwrite an earlier one)."""
        self._flush()
        return self._segments


def _sparse_reader(segments: list[tuple[int, bytes]], size: int) -> RangeReader:
    """A file over a sparse image (segments, zeros elsewhere), for torch's zip reader."""
    segments = sorted(segments)
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


def _offsets_from_zip(segments: list[tuple[int, bytes]], size: int, sizes: list[int]) -> list[int] | None:
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
        raise UnsupportedObjectError(
            f"cannot save {find_unpicklable(obj)}: {exc}. Only tensors, containers and plain Python values "
            "can be saved; drop or convert that entry."
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
    tail_off, tail = max(segments, key=lambda s: s[0] + len(s[1]))
    if tail_off + len(tail) != sink.end or tail[-EOCD_LEN : -EOCD_LEN + 4] != EOCD_SIG:
        raise UnsupportedObjectError("torch.save did not end the archive with a plain zip trailer")
    recs = tuple(StorageRecord(str(i), off, n, st) for i, (off, n, st) in enumerate(zip(offsets, sizes, storages)))
    return FileLayout(tuple(segments), recs, sink.end, align, sum(sizes), cuda)


class Planner:
    """``plan`` with memory: a state whose signature equals one of the last ``CACHED_LAYOUTS``
    structures planned reuses that layout (thread-safe; one per Checkpointer)."""

    def __init__(self, cached: int = CACHED_LAYOUTS) -> None:
        self._cached = cached
        self._lock = threading.Lock()
        self._layouts: list[tuple[tuple, bool | None, FileLayout]] = []  # newest last
        self.hits = 0

    def plan(self, obj: object, *, page_aligned: bool | None = None) -> FileLayout:
        """See ``plan``."""
        found = scan(obj)
        if found is None:
            return plan(obj, page_aligned=page_aligned)
        with self._lock:
            for i, (sig, aligned, layout) in enumerate(self._layouts):
                if aligned == page_aligned and sig == found.signature:
                    self._layouts.append(self._layouts.pop(i))
                    self.hits += 1
                    return layout.bind(found.storages, found.cuda)
        layout = plan(obj, page_aligned=page_aligned, scanned=found)
        template = layout.bind((None,) * len(layout.storages), False)  # type: ignore[arg-type]  (holds no storage)
        with self._lock:
            self._layouts.append((found.signature, page_aligned, template))
            del self._layouts[: -self._cached]
        return layout
