"""Checkpoints at a URL (s3://...): find the newest, load with verification, delete.

A single file at a URL is a checkpoint once its sidecar ``NAME.fastckpt.json`` exists (the
replicator publishes it after verifying the upload); a group once its manifest exists.
"""

from __future__ import annotations

import json
import logging
import mmap
import posixpath

from . import checksum
from . import commit as C
from .errors import CorruptCheckpointError
from .format import parse_tail
from .places import TargetPlace
from .replicate import SIDECAR, TargetCache
from .restore import deserialize

log = logging.getLogger("fastckpt")


def scan_remote(targets: TargetCache, url: str) -> list[C.Found]:
    """Every complete checkpoint under ``url``, oldest first."""
    target, prefix = targets.get(url)
    base = f"{prefix}/" if prefix else ""
    found: list[C.Found] = []
    for key in target.list(base):
        if key.endswith("/" + C.GROUP_MANIFEST) or key == C.GROUP_MANIFEST:
            m = json.loads(target.get_bytes(key))
            found.append(C.Found(target.url_of(posixpath.dirname(key)), "group", C.group_order(m), m))
        elif key.endswith(SIDECAR):
            m = json.loads(target.get_bytes(key))
            found.append(C.Found(target.url_of(key[: -len(SIDECAR)]), "file", float(m.get("written_at", 0.0)), m))
    found.sort(key=lambda f: (f.time, f.path))
    return found


def latest_remote(targets: TargetCache, url: str) -> str | None:
    """The newest complete checkpoint under ``url``.

    ``url/latest`` answers in a few requests when it names a complete checkpoint: the replicator
    (single files) and group commits move it forward after publishing, so it names the newest
    checkpoint directly inside ``url``. Without a valid pointer (none written yet, or the
    checkpoint it names was deleted) a listing of everything under ``url`` decides.
    """
    target, prefix = targets.get(url)
    name = C.pointed_name(TargetPlace(target, prefix))
    if name is not None:
        return target.url_of(f"{prefix}/{name}" if prefix else name)
    found = scan_remote(targets, url)
    return found[-1].path if found else None


def load_remote(targets: TargetCache, url: str, map_location: object,
                weights_only: bool, chunk_bytes: int) -> object:
    """Read ``url`` in parallel ranged GETs into memory, verify, deserialise (zero-copy)."""
    target, key = targets.get(url)
    size = target.size(key)
    tail = target.read_range(key, max(0, size - C.TAIL_BYTES), min(size, C.TAIL_BYTES))
    manifest = parse_tail(tail, size)
    if manifest is not None and manifest.get("group"):
        rel = manifest.get("group_rel") or posixpath.basename(key)
        group_key = key[: -len(rel) - 1] if key.endswith("/" + rel) else posixpath.dirname(key)
        place = TargetPlace(target, group_key)
        if C.read_group_manifest(place) is None:
            raise C.incomplete_group_error(place, None)
    buf = mmap.mmap(-1, max(size, 1))
    view = memoryview(buf)
    covered = manifest["covered"] if manifest else size

    def fetch(offset: int, length: int) -> list[int]:
        data = target.read_range(key, offset, length)
        view[offset : offset + length] = data
        lim = max(0, min(length, covered - offset))
        return [checksum.block_digest(view[offset + b : offset + min(b + checksum.BLOCK_BYTES, lim)])
                for b in range(0, lim, checksum.BLOCK_BYTES)]

    digests = [d for ds in target._map_ranges(size, chunk_bytes, fetch) for d in ds]
    if manifest is not None:
        got, want = checksum.combine(digests), manifest["checksum"]["value"]
        if got != want:
            raise CorruptCheckpointError(f"{url} is corrupt: checksum {got} != {want} recorded when it was "
                                         "written. Restore from another copy or an earlier checkpoint.")
    else:
        log.info("fastckpt: %s has no fastckpt manifest; loading it unverified", url)
    view.release()
    return deserialize(buf, size, map_location, weights_only, url)


def delete_remote(targets: TargetCache, url: str) -> None:
    """Delete a checkpoint at a URL: its publication record first, then its bytes."""
    target, key = targets.get(url)
    if target.exists(key + SIDECAR) or target.exists(key):
        target.delete(key + SIDECAR)
        target.delete(key)
        return
    keys = target.list(key.rstrip("/") + "/")
    manifest = f"{key.rstrip('/')}/{C.GROUP_MANIFEST}"
    if manifest in keys:
        target.delete(manifest)
    for k in keys:
        if k != manifest:
            target.delete(k)
