"""Zero-copy deserialisation of a checkpoint file already in memory.

The verified buffer is handed to torch's own zip loader as the "overall storage" (the path
torch uses for ``mmap=True``), so every tensor is a view of that buffer: no second copy.
"""

from __future__ import annotations

import io
import pickle

import torch

from ..format.ranges import RangeReader

ZIP_MAGIC = b"PK\x03\x04"


def deserialize(buf, size: int, map_location: object, weights_only: bool, path: str) -> object:  # noqa: ANN001
    """The object saved in the file image ``buf[:size]`` (a torch.save zip; a legacy, non-zip
    torch file is loaded through ``torch.load`` from a copy)."""
    if bytes(memoryview(buf)[:4]) != ZIP_MAGIC:
        return torch.load(io.BytesIO(memoryview(buf)[:size]), map_location=map_location, weights_only=weights_only)
    storage = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
    view = memoryview(buf)
    reader = torch._C.PyTorchFileReader(RangeReader(size, lambda lo, hi: bytes(view[lo:hi])))
    module = torch.serialization._weights_only_unpickler if weights_only else pickle
    try:
        return torch.serialization._load(reader, map_location, module, overall_storage=storage)
    except pickle.UnpicklingError as exc:
        exc.add_note(f"{path} holds objects that weights_only=True refuses. If you trust this file, "
                     "load it with weights_only=False.")
        raise
