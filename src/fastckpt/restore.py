"""Loading: parallel aligned reads, checksum verification, zero-copy deserialisation.

The file is read in parallel into one page-aligned buffer, verified against the manifest
inside it, and handed to torch's own zip loader as the "overall storage" (the path torch
uses for ``mmap=True``), so every tensor is a view of that buffer: no second copy.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from concurrent.futures import Executor

import torch

from . import commit as C
from .errors import CorruptCheckpointError
from .io.engine import read_file
from .io.ops import FileOps

log = logging.getLogger("fastckpt")


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
    storage = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
    reader = torch._C.PyTorchFileReader(_MemReader(memoryview(buf), size))
    module = torch.serialization._weights_only_unpickler if weights_only else pickle
    try:
        return torch.serialization._load(reader, map_location, module, overall_storage=storage)
    except pickle.UnpicklingError as exc:
        exc.add_note(f"{path} holds objects that weights_only=True refuses. If you trust this file, "
                     "load it with weights_only=False.")
        raise


def verify_and_load(ops: FileOps, pool: Executor, path: str, map_location: object,
                    weights_only: bool, chunk_bytes: int, odirect: bool) -> object:
    """Load one file; a fastckpt file is verified, a plain torch.save file is loaded as is.

    Raises:
        CorruptCheckpointError: checksum or size mismatch (names the file).
        IncompleteCheckpointError: the file's group was never committed.
    """
    manifest = C.read_file_manifest(path)
    if manifest is None:
        log.info("fastckpt: %s has no fastckpt manifest; loading it with torch.load unverified", path)
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    if manifest.get("group"):
        rel = manifest.get("group_rel") or os.path.basename(path)
        group_dir = path[: -len(rel) - 1] if path.endswith(os.sep + rel) else os.path.dirname(path)
        if C.read_group_manifest(group_dir) is None:
            raise C.incomplete_group_error(group_dir, None)
    size = os.path.getsize(path)
    res = read_file(ops, pool, path, size, manifest["covered"], chunk_bytes=chunk_bytes, odirect=odirect)
    want = manifest["checksum"]["value"]
    if res.checksum != want:
        raise CorruptCheckpointError(
            f"{path} is corrupt: checksum {res.checksum} != {want} recorded when it was written. "
            "Restore from another copy or an earlier checkpoint (fastckpt.latest(...)).")
    return deserialize(res.buffer, size, map_location, weights_only, path)


def load_file(ops: FileOps, pool: Executor, candidates: list[str], map_location: object,
              weights_only: bool, chunk_bytes: int, odirect: bool) -> tuple[object, str]:
    """Try each copy in order (burst buffer first); a corrupt copy falls back to the next."""
    last: BaseException | None = None
    for i, path in enumerate(candidates):
        try:
            return verify_and_load(ops, pool, path, map_location, weights_only, chunk_bytes, odirect), path
        except (CorruptCheckpointError, OSError) as exc:
            if i + 1 == len(candidates):
                raise
            log.warning("fastckpt: %s unusable (%s); falling back to %s", path, exc, candidates[i + 1])
            last = exc
    raise last or FileNotFoundError(candidates)


def _other_save(local: str, path: str) -> bool:
    """True when both copies carry readable manifests with different checksums."""
    try:
        a, b = C.read_file_manifest(local), C.read_file_manifest(path)
    except (OSError, ValueError):  # unreadable: let the verified load decide
        return False
    return bool(a and b) and a.get("checksum") != b.get("checksum")


def load_any(ops: FileOps, pool: Executor, targets, path: str, local: str | None, map_location: object,  # noqa: ANN001
             weights_only: bool, prefetch: bool, chunk_bytes: int, odirect: bool) -> tuple[object, str, str]:
    """Load ``path`` (a file or URL), preferring its verified burst-buffer copy ``local``.

    Returns the object, the copy used and where it came from ("local", "path", "remote").
    """
    from .places import is_url

    if is_url(path):
        from .remote import load_remote

        if local and os.path.exists(local):
            try:
                obj, used = load_file(ops, pool, [local], map_location, weights_only, chunk_bytes, odirect)
                return obj, used, "local"
            except (OSError, ValueError) as exc:
                log.warning("fastckpt: burst-buffer copy %s unusable (%s); reading %s", local, exc, path)
        if prefetch and local:
            target, key = targets.get(path)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            target.download(key, local)
            obj, used = load_file(ops, pool, [local], map_location, weights_only, chunk_bytes, odirect)
            return obj, path, "remote (prefetched)"
        return load_remote(targets, path, map_location, weights_only, chunk_bytes), path, "remote"
    candidates = [p for p in (local, path) if p and os.path.exists(p)]
    if len(candidates) == 2 and _other_save(local, path):  # type: ignore[arg-type]
        candidates = [path]  # the local copy is of a save that never reached path (it failed)
    obj, used = load_file(ops, pool, candidates or [path], map_location, weights_only, chunk_bytes, odirect)
    return obj, used, "local" if used == local else "path"
