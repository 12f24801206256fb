"""Zero-copy deserialisation of a checkpoint file already in memory.

A ``load.image.HeapImage`` is its own "overall storage" (the path torch uses for ``mmap=True``):
each record's storage is a view of the heap piece it was read into. One buffer (an object
store's read, a mapped file, a file of small records) is handed to torch's loader through
``_Records``, so every tensor is a view of that buffer: no second copy either. Each
record that spans whole pages gets a storage of its own over its part of the buffer
(``_Records``), and when that storage dies its pages go back to the system, so dropping some
tensors of a loaded state frees their memory as it would after ``torch.load``; the buffer is
unmapped once the last of its records is gone.
"""

from __future__ import annotations

import io
import mmap
import pickle
import weakref
from collections.abc import Callable

import torch

from ..errors import ConfigError
from ..format.align import ALIGN
from ..format.ranges import RangeReader
from .image import ZIP_MAGIC, HeapImage


def deserialize(buf, size: int, map_location: object, weights_only: bool, path: str) -> object:  # noqa: ANN001
    """The object saved in the file image ``buf[:size]``: a ``HeapImage``, or one buffer (a
    torch.save zip; a legacy, non-zip torch file is loaded through ``torch.load`` from a copy).

    Raises:
        ConfigError: the file is a TorchScript archive (``torch.load`` hands those to
            ``torch.jit.load``; unpickled here they failed as damage, or on ``__torch__``).
    """
    if not isinstance(buf, HeapImage) and bytes(memoryview(buf)[:4]) != ZIP_MAGIC:
        return torch.load(io.BytesIO(memoryview(buf)[:size]), map_location=map_location, weights_only=weights_only)
    fetch, records = fetcher(buf), (buf if isinstance(buf, HeapImage) else _Records(buf))
    reader = torch._C.PyTorchFileReader(RangeReader(size, fetch))
    if reader.has_record("constants.pkl"):  # torch.load's own test (``_is_torchscript_zip``), one name looked up
        raise ConfigError(f"{path} is a TorchScript archive (written by torch.jit.save), not a torch.save "
                          f"checkpoint: load it with torch.jit.load({path!r}).")
    module = torch.serialization._weights_only_unpickler if weights_only else pickle
    try:
        return torch.serialization._load(reader, map_location, module, overall_storage=records)
    except pickle.UnpicklingError as exc:
        if weights_only:  # the stock unpickler raises it on a malformed pickle: no object to opt in to
            exc.add_note(f"{path} holds objects that weights_only=True refuses. If you trust this file, "
                         "load it with weights_only=False.")
        raise


def fetcher(buf) -> Callable[[int, int], bytes]:  # noqa: ANN001
    """``fetch(lo, hi)``: the bytes ``[lo, hi)`` of a file image (a ``HeapImage``, or one buffer)."""
    if isinstance(buf, HeapImage):
        return buf.fetch
    view = memoryview(buf)
    return lambda lo, hi: bytes(view[lo:hi])


class _Records:
    """What torch's ``_load`` slices each record's storage from (``overall_storage[lo:hi]``).

    A record with at least one whole page inside it gets its own storage, over its own
    memoryview of the buffer; when torch lets go of that storage (its last tensor died, or
    ``map_location`` copied it elsewhere), ``_give_back`` drops those pages (``MADV_DONTNEED``).
    Smaller records are slices of one storage over the whole buffer, as before: they have no
    page of their own to give back.
    """

    def __init__(self, buf: mmap.mmap) -> None:
        self._buf, self._view = buf, memoryview(buf)
        self._whole: torch.UntypedStorage | None = None
        self._pages = hasattr(buf, "madvise")  # its pages can be given back

    def __getitem__(self, span: slice) -> torch.UntypedStorage:
        lo, hi = span.start, span.stop
        # a damaged pickle may name a record past the buffer's end: the slice below stops there,
        # and so must the pages given back (madvise raised "start out of bounds" in a finalizer)
        first, end = -(-lo // ALIGN) * ALIGN, min(hi, len(self._view)) // ALIGN * ALIGN
        if end <= first or not self._pages:
            if self._whole is None:
                self._whole = torch.frombuffer(self._buf, dtype=torch.uint8).untyped_storage()
            return self._whole[lo:hi]
        piece = self._view[lo:hi]
        storage = torch.frombuffer(piece, dtype=torch.uint8).untyped_storage()
        weakref.finalize(piece, _give_back, self._buf, first, end - first).atexit = False  # exit unmaps all
        return storage


def _give_back(buf: mmap.mmap, offset: int, length: int) -> None:
    buf.madvise(mmap.MADV_DONTNEED, offset, length)
