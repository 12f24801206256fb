"""``Checkpointer.load``: find the best copy, read it whole, verify it, deserialise it.

Copies are tried in order: the burst-buffer copy in ``local_dir`` (when there is one, and it is
of the same save as the copy at the path), then the path itself. Each copy is read through its
home's ``Target`` (``storage.homes``): a file on a mounted file system in parallel through one
open descriptor (O_DIRECT where honoured), an object with parallel ranged reads; either way
the checksum of the covered bytes is computed while the bytes arrive. A copy that fails to read
or verify falls back to the next one with a warning. A file of a group is loaded only once its
group is published. With ``prefetch=True`` a remote file is first downloaded into the burst
buffer, so the next load is local.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..commit.discovery import require_complete_group
from ..errors import CorruptCheckpointError
from ..storage.homes import Homes, Location
from .deserialize import deserialize

log = logging.getLogger("fastckpt")


@dataclass(frozen=True)
class Loaded:
    """What a load returned and where from (``where``: "local", "path", "remote" or
    "remote (prefetched)"), for the load event and ``stats().last_restore_from``."""

    obj: object
    url: str
    size: int
    where: str


class Loader:
    """Args:
        homes: resolves names to their targets.
        local_path: where the burst-buffer copy of a name lives (None without local_dir).
        chunk_bytes: bytes per parallel read.
    """

    def __init__(self, homes: Homes, local_path: Callable[[str], str | None], chunk_bytes: int) -> None:
        self._homes, self._local_path, self._chunk = homes, local_path, chunk_bytes

    def load(self, path: str, map_location: object, weights_only: bool, prefetch: bool) -> Loaded:
        """Load ``path`` (normalised), preferring its verified burst-buffer copy.

        Raises:
            CorruptCheckpointError: the bytes do not match the recorded checksum (every copy).
            IncompleteCheckpointError: the file's group was never committed.
        """
        home = self._homes.resolve(path)
        candidates = self._candidates(path, home)
        if prefetch and not home.target.mounted and not candidates[:-1] and self._local_path(path):
            local = self._homes.resolve(self._local_path(path))  # type: ignore[arg-type]
            os.makedirs(os.path.dirname(local.url), exist_ok=True)
            home.target.download(home.key, local.url)
            obj, size = self._verified(local, map_location, weights_only)
            return Loaded(obj, path, size, "remote (prefetched)")
        for i, (loc, where) in enumerate(candidates):
            try:
                obj, size = self._verified(loc, map_location, weights_only)
                return Loaded(obj, loc.url, size, where)
            except (CorruptCheckpointError, OSError) as exc:
                if i + 1 == len(candidates):
                    raise
                log.warning("fastckpt: %s unusable (%s); falling back to %s", loc.url, exc, candidates[i + 1][0].url)
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _candidates(self, path: str, home: Location) -> list[tuple[Location, str]]:
        where = "path" if home.target.mounted else "remote"
        local_name = self._local_path(path)
        if local_name is None or not os.path.exists(local_name):
            return [(home, where)]
        local = self._homes.resolve(local_name)
        if home.target.mounted and home.target.exists(home.key) and self._other_save(local, home):
            return [(home, where)]  # the local copy is of a save that never reached path (it failed)
        return [(local, "local"), (home, where)]

    @staticmethod
    def _other_save(local: Location, home: Location) -> bool:
        """True when both copies carry readable manifests with different checksums."""
        try:
            a, b = local.target.read_manifest(local.key), home.target.read_manifest(home.key)
        except (OSError, ValueError):  # unreadable: let the verified load decide
            return False
        return bool(a and b) and a.get("checksum") != b.get("checksum")

    def _verified(self, loc: Location, map_location: object, weights_only: bool) -> tuple[object, int]:
        res = loc.target.read_object(loc.key, chunk_bytes=self._chunk)
        if res.manifest is None:
            log.info("fastckpt: %s has no fastckpt manifest; loading it unverified", loc.url)
        else:
            require_complete_group(self._homes, loc.url, res.manifest)
            want = res.manifest["checksum"]["value"]
            if res.checksum != want:
                raise CorruptCheckpointError(
                    f"{loc.url} is corrupt: checksum {res.checksum} != {want} recorded when it was written. "
                    "Restore from another copy or an earlier checkpoint (fastckpt.latest(...)).")
        return deserialize(res.buffer, res.size, map_location, weights_only, loc.url), res.size
