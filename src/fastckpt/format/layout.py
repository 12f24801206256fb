"""torch.save-compatible files, laid out for fast writes.

The metadata (pickle, zip headers) comes from ``torch.save`` itself under
``torch.serialization.skip_data()`` with every storage record aligned to 4 KiB; torch seeks
over the storages' bytes, so the layout costs no copy. fastckpt then fills the storages at
their record offsets (read back from the zip directory with torch's own reader) and appends
its manifest as the zip archive comment, so every file is a plain ``torch.load``-able zip
that also carries its own checksum. Storage keys are derived by pickling the object once
more with torch's storage-identity rule, and checked against the records torch wrote.
"""

from __future__ import annotations

import bisect
import collections
import io
import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.serialization import config as _ser_config

from ..errors import UnsupportedObjectError
from .manifest import EOCD_LEN, EOCD_SIG

ALIGN = 4096  # every storage record starts on a page boundary, as O_DIRECT and GDS need


@dataclass(frozen=True)
class StorageRecord:
    """One storage of the object and where its bytes go in the file."""

    key: str
    offset: int
    nbytes: int
    storage: torch.UntypedStorage
    where: str  # the first key path that refers to it, for messages


@dataclass(frozen=True)
class FileLayout:
    """The file minus the storages' bytes: metadata segments, storage slots, sizes.

    ``data_size`` is the size of the zip without comment; the checksum covers
    ``[0, covered_bytes)``, which is everything but the comment-length field and the comment.
    """

    segments: tuple[tuple[int, bytes], ...]
    storages: tuple[StorageRecord, ...]
    data_size: int

    @property
    def covered_bytes(self) -> int:
        return self.data_size - 2

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages)


class _SeekOnlySink(io.RawIOBase):
    """File-like sink that keeps written bytes as segments and seeks over skipped data."""

    def __init__(self) -> None:
        self.pos = 0
        self.end = 0
        self.segments: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        data = bytes(b)
        if self.segments and self.segments[-1][0] + len(self.segments[-1][1]) == self.pos:
            off, prev = self.segments[-1]
            self.segments[-1] = (off, prev + data)
        else:
            self.segments.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.end}[whence]
        self.pos = base + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


class _SparseReader(io.RawIOBase):
    """Reads a sparse image (segments, zeros elsewhere) for torch's zip reader."""

    def __init__(self, segments: list[tuple[int, bytes]], size: int) -> None:
        self._segments = segments  # in increasing offset order, not overlapping
        self._starts = [off for off, _ in segments]
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._size - self._pos
        n = max(0, min(n, self._size - self._pos))
        out = bytearray(n)
        lo, hi = self._pos, self._pos + n
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._segments) and self._segments[i][0] < hi:
            off, data = self._segments[i]
            a, b = max(lo, off), min(hi, off + len(data))
            if a < b:
                out[a - lo : b - lo] = data[a - off : b - off]
            i += 1
        self._pos = hi
        return bytes(out)

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class _StorageOrder(pickle.Pickler):
    """Pickles to nowhere, recording storages in first-seen order: torch's key order."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=2)
        self.order: list[torch.UntypedStorage] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj):  # noqa: ANN001 (pickle protocol)
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            st = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
            if st._cdata not in self._seen:
                self._seen[st._cdata] = len(self.order)
                self.order.append(st)
            return ("s", self._seen[st._cdata])
        return None


_PLAIN = (int, float, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)


def _fast_order(obj: object) -> list[torch.UntypedStorage] | None:
    """Storages in pickling order for plain states (dicts, lists, tuples, plain tensors, scalars).

    Pickle visits dict items, list and tuple elements in order, and a plain tensor reduces to
    its storage first, so a walk gives torch's key order without a second pickling pass.
    Anything else (custom objects, tensor subclasses, sparse tensors...) returns None: the
    caller then pickles to find the order.
    """
    order: list[torch.UntypedStorage] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        t = type(o)
        if t is dict or t is collections.OrderedDict:
            stack.extend(reversed(list(o.values())))  # type: ignore[union-attr]
            if not all(type(k) in _PLAIN for k in o):  # type: ignore[union-attr]
                return None
        elif t is list or t is tuple:
            stack.extend(reversed(o))  # type: ignore[arg-type]
        elif t is torch.Tensor or t is torch.nn.Parameter:
            if o.layout != torch.strided or o.__dict__ or o.is_quantized:  # type: ignore[union-attr]
                return None
            st = o.untyped_storage()  # type: ignore[union-attr]
            if st._cdata not in seen:
                seen.add(st._cdata)
                order.append(st)
        elif t not in _PLAIN:
            return None
    return order


def _record_sizes(reader: io.RawIOBase) -> dict[int, int]:
    """data/N record sizes from the zip's central directory."""
    with zipfile.ZipFile(reader) as zf:  # type: ignore[arg-type]
        out = {}
        for info in zf.infolist():
            head, _, key = info.filename.rpartition("/")
            if head.endswith("data") and key.isdigit():
                out[int(key)] = info.file_size
        return out


def _walk(obj: object, path: str, depth: int = 0) -> Iterator[tuple[str, object]]:
    yield path, obj
    if depth > 64:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}[{k!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]", depth + 1)


def _find_unpicklable(obj: object) -> str:
    """The deepest key path whose value cannot be pickled (for the error message)."""
    worst = "state"
    for path, value in _walk(obj, "state"):
        if isinstance(value, (dict, list, tuple, torch.Tensor)):
            continue
        try:
            pickle.dumps(value, protocol=2)
        except Exception:  # noqa: BLE001 (we only look for the culprit; the caller re-raises)
            return path
    return worst


def _check_tensors(obj: object) -> dict[int, str]:
    """Reject tensors whose bytes cannot be written; map storage id -> first key path."""
    where: dict[int, str] = {}
    for path, value in _walk(obj, "state"):
        if not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "meta":
            raise UnsupportedObjectError(
                f"{path} is a tensor on the meta device: it has no data to save. "
                "Materialise it (e.g. model.to_empty(device=...) and initialise) before saving."
            )
        if value.is_sparse or value.layout != torch.strided:
            continue  # pickled through its strided components
        try:
            st = value.untyped_storage()
        except Exception as exc:  # noqa: BLE001
            raise UnsupportedObjectError(
                f"{path} ({type(value).__name__}) has no plain storage fastckpt can copy; "
                "convert it to a regular tensor before saving."
            ) from exc
        where.setdefault(st._cdata, path)
    return where


def plan(obj: object) -> FileLayout:
    """Lay out ``obj`` as a torch.save zip without touching the tensors' bytes.

    Raises:
        UnsupportedObjectError: something in ``obj`` cannot be saved; the message names the key.
    """
    where = _check_tensors(obj)
    sink = _SeekOnlySink()
    old_align = _ser_config.save.storage_alignment
    _ser_config.save.storage_alignment = ALIGN
    try:
        with torch.serialization.skip_data():
            torch.save(obj, sink)
    except Exception as exc:
        culprit = _find_unpicklable(obj)
        raise UnsupportedObjectError(
            f"cannot save {culprit}: {exc}. Only tensors, containers and plain Python values "
            "can be saved; drop or convert that entry."
        ) from exc
    finally:
        _ser_config.save.storage_alignment = old_align
    sizes = _record_sizes(_SparseReader(sink.segments, sink.end))
    found = _fast_order(obj)
    if found is None or [st.nbytes() for st in found] != [sizes.get(i) for i in range(len(found))] \
            or len(found) != len(sizes):
        pickler = _StorageOrder()
        pickler.dump(obj)
        found = pickler.order
    if len(sizes) != len(found) or any(sizes.get(i) != st.nbytes() for i, st in enumerate(found)):
        raise UnsupportedObjectError(
            f"torch.save wrote {len(sizes)} storages but fastckpt found {len(found)} (or their sizes "
            "differ); the object holds a tensor type fastckpt does not support yet."
        )
    reader = torch._C.PyTorchFileReader(_SparseReader(sink.segments, sink.end))
    storages = []
    for i, st in enumerate(found):
        off = reader.get_record_offset(f"data/{i}")
        if off % ALIGN:
            raise UnsupportedObjectError(f"storage data/{i} is not {ALIGN}-aligned in the file")
        storages.append(StorageRecord(str(i), off, st.nbytes(), st, where.get(st._cdata, f"data/{i}")))
    tail_off, tail = sink.segments[-1]
    if tail_off + len(tail) != sink.end or tail[-EOCD_LEN:-EOCD_LEN + 4] != EOCD_SIG:
        raise UnsupportedObjectError("torch.save did not end the archive with a plain zip trailer")
    return FileLayout(tuple(sink.segments), tuple(storages), sink.end)
