"""Zero-copy deserialisation of a checkpoint file already in memory.

The verified buffer is handed to torch's own zip loader as the "overall storage" (the path
torch uses for ``mmap=True``), so every tensor is a view of that buffer: no second copy.
"""

from __future__ import annotations

import io
import pickle

import torch

ZIP_MAGIC = b"PK\x03\x04"


class _MemReader(io.RawIOBase):
    """A read-only file over the first ``size`` bytes of a buffer, for torch's zip reader."""

    def __init__(self, view: memoryview, size: int) -> None:
        self._view, self._size, self._pos = view, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._size}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        data = bytes(self._view[self._pos : end])
        self._pos = max(self._pos, end)
        return data

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def deserialize(buf, size: int, map_location: object, weights_only: bool, path: str) -> object:  # noqa: ANN001
    """The object saved in the file image ``buf[:size]`` (a torch.save zip; a legacy, non-zip
    torch file is loaded through ``torch.load`` from a copy)."""
    if bytes(memoryview(buf)[:4]) != ZIP_MAGIC:
        return torch.load(io.BytesIO(memoryview(buf)[:size]), map_location=map_location, weights_only=weights_only)
    storage = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
    reader = torch._C.PyTorchFileReader(_MemReader(memoryview(buf), size))
    module = torch.serialization._weights_only_unpickler if weights_only else pickle
    try:
        return torch.serialization._load(reader, map_location, module, overall_storage=storage)
    except pickle.UnpicklingError as exc:
        exc.add_note(f"{path} holds objects that weights_only=True refuses. If you trust this file, "
                     "load it with weights_only=False.")
        raise
