"""Atomic publication: temp files, renames, manifests, rank markers, the latest pointer.

A single-file checkpoint carries its manifest inside (the zip comment) and becomes visible
by one rename. A group (several files from one or several ranks under one directory) is
complete only when its manifest ``fastckpt-manifest.json`` exists; each rank first leaves a
marker ``.fastckpt/rank-NNNNN.json`` listing its durable files, and the coordinator (rank 0)
publishes the manifest once every rank's marker is there, then points ``latest`` at it.
Markers are files so that completeness can be checked by any process, after any crash,
without collectives (which must never run on background threads).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from .errors import CommitTimeoutError, CorruptCheckpointError, IncompleteCheckpointError
from .format import FORMAT_VERSION, parse_tail
from .io.ops import FileOps
from .places import Place, as_place

GROUP_MANIFEST = "fastckpt-manifest.json"
MARKER_DIR = ".fastckpt"
LATEST = "latest"
SIDECAR = ".fastckpt.json"  # a single file's publication record at a URL: NAME.fastckpt.json
TMP_TAG = ".fastckpt-tmp-"
TAIL_BYTES = 65536 + 22


_HOST = socket.gethostname().replace(os.sep, "_")


def tmp_name(path: str) -> str:
    """A hidden temp name beside ``path``, unique per attempt, naming its host and process."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TMP_TAG}{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}")


def sweep_stale_tmp(ops: FileOps, directory: str) -> int:
    """Remove temp files in ``directory`` left by dead processes of this host; return the count.

    A killed save leaves its temp file behind (never a visible checkpoint). Files of live
    processes and of other hosts are left alone: only this host can tell a process is gone.
    """
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if TMP_TAG not in name:
            continue
        try:
            host, pid, _ = name.split(TMP_TAG, 1)[1].rsplit(".", 2)
            pid_n = int(pid)
        except ValueError:
            continue
        if host != _HOST or pid_n == os.getpid():
            continue
        try:
            os.kill(pid_n, 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        discard(ops, os.path.join(directory, name))
        removed += 1
    return removed


def is_tmp(name: str) -> bool:
    return TMP_TAG in name


def publish_bytes(ops: FileOps, path: str, data: bytes) -> None:
    """Write a small file atomically: temp, fsync, rename, directory fsync."""
    tmp = tmp_name(path)
    try:
        ops.write_small(tmp, data)
        ops.replace(tmp, path)
    except BaseException:
        discard(ops, tmp)
        raise
    ops.fsync_dir(os.path.dirname(path) or ".")


def discard(ops: FileOps, path: str) -> None:
    """Remove a temp file after a failure; a missing file is fine, other errors are logged."""
    try:
        ops.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the original failure matters more; leave a trace of this one
        import logging

        logging.getLogger(__name__).warning("could not remove temp file %s: %s", path, exc)


def marker_path(group_dir: str, rank: int) -> str:
    return os.path.join(group_dir, MARKER_DIR, f"rank-{rank:05d}.json")


STALE_MARKER_S = 60.0  # without a shared store, markers older than the attempt by this much are stale


def attempt_token(group_dir: str, world_size: int) -> str | None:
    """A token every rank of one attempt at ``group_dir`` agrees on, or None without a store.

    Each rank adds 1 to a per-group counter in torch.distributed's key-value store (safe from
    any thread, not a collective) at its first touch of the group: attempt k collects the
    counts k*W+1 .. (k+1)*W. Without an initialised process group there is no store; then
    markers are told apart by time (``STALE_MARKER_S``) and by the files' checksums.
    """
    store = _default_store() if world_size > 1 else None
    if store is None:
        return None
    n = store.add(f"fastckpt/attempt/{group_dir}", 1)  # group_dir is normalised (absolute path or URL)
    return str((n - 1) // world_size)


def write_marker(ops: FileOps | None, group_dir: str | Place, rank: int, world_size: int, files: dict,
                 token: str | None = None, started_at: float | None = None, superseded: bool = False) -> None:
    """Publish this rank's marker: its durable files of this attempt (or that it gave up)."""
    body = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size, "files": files,
            "written_at": time.time(), "attempt": token, "started_at": started_at}
    if superseded:
        body["superseded"] = True
    as_place(group_dir, ops).put(f"{MARKER_DIR}/rank-{rank:05d}.json", json.dumps(body, sort_keys=True).encode())


def read_markers(group_dir: str | Place) -> dict[int, dict]:
    place = as_place(group_dir)
    out: dict[int, dict] = {}
    for name in place.names(MARKER_DIR):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        data = place.get(f"{MARKER_DIR}/{name}")
        if data is not None:
            body = json.loads(data)
            out[int(body["rank"])] = body
    return out


def missing_ranks(group_dir: str | Place, world_size: int) -> list[int]:
    got = read_markers(group_dir)
    return [r for r in range(world_size) if r not in got or got[r]["world_size"] != world_size]


def _current(marker: dict, world_size: int, token: str | None, not_before: float) -> bool:
    return (marker["world_size"] == world_size and marker.get("attempt") == token
            and float(marker.get("written_at", 0.0)) >= not_before)


def wait_for_markers(group_dir: str | Place, world_size: int, timeout_s: float, stop: threading.Event,
                     token: str | None = None, not_before: float = 0.0) -> dict[int, dict]:
    """Poll the marker directory until every rank is there (backoff up to 0.5 s).

    Other ranks are other processes, perhaps on other nodes: their marker files are the only
    signal, so this polls; ``stop`` (set by ``close``) ends the wait early.

    Raises:
        CommitTimeoutError: naming the ranks that never committed.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        markers = {r: m for r, m in read_markers(group_dir).items() if _current(m, world_size, token, not_before)}
        if all(r in markers for r in range(world_size)) or any(m.get("superseded") for m in markers.values()):
            return markers
        if time.monotonic() >= deadline or stop.is_set():
            missing = [r for r in range(world_size) if r not in markers]
            raise CommitTimeoutError(
                f"checkpoint group {as_place(group_dir).label} not committed: ranks {missing} of {world_size} did "
                f"not commit within {timeout_s:.0f} s. The group stays incomplete (readers skip it); "
                "check those ranks' logs, or raise commit_timeout_s for slow storage."
            )
        stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


_latest_lock = threading.Lock()  # commits of several groups publish from concurrent threads


def group_order(manifest: dict) -> float:
    """When a group was committed, for ordering: rank 0's ``commit`` call, else its publish.

    Commits overlap (step N may wait for a slow rank while step N+1 completes), so the time of
    publication does not follow the order of the steps; the time of the request does.
    """
    return float(manifest.get("requested_at", manifest.get("committed_at", 0.0)))


def _pointed(parent: Place) -> tuple[str, float] | None:
    """What ``parent/latest`` names, if that is a complete checkpoint, and its order.

    The name is a group directory (complete once its manifest exists) or, at a URL, a single
    file (complete once its sidecar exists; see ``replicate.py``).
    """
    try:
        name = (parent.get(LATEST) or b"").decode().strip()
        if not name or "/" in name or name in (".", ".."):
            return None
        m = read_group_manifest(parent.child(name))
        if m is not None:
            return name, group_order(m)
        side = parent.get(name + SIDECAR)
        if side is not None:
            return name, float(json.loads(side).get("written_at", 0.0))
    except (OSError, ValueError, CorruptCheckpointError):  # unreadable or corrupt: it may be replaced
        return None
    return None


def _pointed_order(parent: Place) -> float:
    """The order of the checkpoint ``parent/latest`` names; -inf when there is none to keep."""
    found = _pointed(parent)
    return found[1] if found is not None else float("-inf")


def pointed_name(parent: Place) -> str | None:
    """The name in ``parent/latest`` when it is a complete checkpoint; None when stale or absent."""
    found = _pointed(parent)
    return found[0] if found is not None else None


def publish_file_pointer(parent: Place, name: str, manifest: dict) -> bool:
    """Point ``parent/latest`` at the single file ``name`` just published; only ever forward.

    Called after the file's publication record, so the pointer never names a partial
    checkpoint. Returns whether the pointer moved (it stays when it names a newer checkpoint).
    """
    with _latest_lock:
        if _pointed_order(parent) > float(manifest.get("written_at", 0.0)):
            return False
        parent.put(LATEST, name.encode())
        return True


def publish_group(ops: FileOps | None, group_dir: str | Place, world_size: int, markers: dict[int, dict], extra: dict,
                  requested_at: float | None = None, token: str | None = None, move_latest: bool = True) -> dict:
    """Check every rank's files, then publish the group manifest and (``move_latest``) the
    latest pointer.

    The pointer moves only forward: it is left alone when it names a group committed later
    (see ``group_order``).
    """
    place = as_place(group_dir, ops)
    files: dict[str, dict] = {}
    for r in sorted(markers):
        for rel, info in markers[r]["files"].items():
            size = place.size(rel)
            if size != info["size"]:
                raise IncompleteCheckpointError(
                    f"group {place.label}: rank {r} committed {rel} with {info['size']} bytes but the "
                    f"file has {size}; not publishing this checkpoint."
                )
            files[rel] = dict(info, rank=r)
    manifest = {"format": FORMAT_VERSION, "kind": "group", "world_size": world_size,
                "tag": place.label.rstrip("/").rsplit("/", 1)[-1], "ranks": sorted(markers),
                "attempt": token, "files": files, "committed_at": time.time(), **extra}
    if requested_at is not None:
        manifest["requested_at"] = requested_at
    place.put(GROUP_MANIFEST, json.dumps(manifest, sort_keys=True, indent=1).encode())
    if not move_latest:
        return manifest
    parent = place.parent()
    with _latest_lock:
        if _pointed_order(parent) <= group_order(manifest):
            parent.put(LATEST, manifest["tag"].encode())
    return manifest


def read_group_manifest(group_dir: str | Place) -> dict | None:
    place = as_place(group_dir)
    data = place.get(GROUP_MANIFEST)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{place.label}/{GROUP_MANIFEST} does not parse: {exc}") from exc


def read_file_manifest(path: str) -> dict | None:
    """The manifest inside a fastckpt file, None for a plain torch.save file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - TAIL_BYTES))
        tail = f.read()
    try:
        return parse_tail(tail, size)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{path}: {exc}. Restore from another copy or an earlier "
                                     "checkpoint (fastckpt.latest(...)).") from exc


def incomplete_group_error(group_dir: str | Place, world_size: int | None) -> IncompleteCheckpointError:
    markers = read_markers(group_dir)
    ws = world_size or max((m["world_size"] for m in markers.values()), default=0)
    missing = [r for r in range(ws) if r not in markers]
    what = f"ranks {missing} of {ws} never committed" if missing else "its manifest was never published"
    return IncompleteCheckpointError(
        f"checkpoint {as_place(group_dir).label} is incomplete: {what} (no {GROUP_MANIFEST}). "
        "Load an earlier checkpoint: fastckpt.latest(<parent dir>) returns the newest complete one."
    )


@dataclass(frozen=True)
class Found:
    path: str
    kind: str  # "file" or "group"
    time: float
    manifest: dict


def _file_candidate(path: str) -> Found | None:
    try:
        m = read_file_manifest(path)
    except (OSError, CorruptCheckpointError):
        return None
    if not m or m.get("group"):
        return None
    return Found(path, "file", float(m.get("written_at", 0.0)), m)


def scan(root: str, max_depth: int = 4) -> list[Found]:
    """Every complete checkpoint under ``root`` (files and groups), oldest first."""
    found: list[Found] = []

    def visit(d: str, depth: int) -> None:
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return
        names = {e.name for e in entries}
        if GROUP_MANIFEST in names:
            m = read_group_manifest(d)
            if m is not None:
                found.append(Found(d, "group", group_order(m), m))
            return
        if MARKER_DIR in names:
            return  # an incomplete group: skip it and what is inside
        for e in entries:
            if is_tmp(e.name) or e.name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=False):
                if depth < max_depth:
                    visit(e.path, depth + 1)
            elif e.is_file():
                c = _file_candidate(e.path)
                if c is not None:
                    found.append(c)

    visit(root, 0)
    found.sort(key=lambda f: (f.time, f.path))
    return found


def latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (a file or a group directory), or None."""
    found = scan(root)
    return found[-1].path if found else None


def _outcome_key(group: str, token: str) -> str:
    return f"fastckpt/outcome/{group}/{token}"


def announce_outcome(group: str, token: str | None, superseded: bool = False) -> None:
    """Rank 0: record in the key-value store that this attempt was published (or dropped).

    The other ranks may never see the manifest itself: rank 0 can delete the group or start a
    newer attempt at it (a re-save of the same tag) before their next poll.
    """
    store = _default_store() if token is not None else None
    if store is not None:
        store.set(_outcome_key(group, token), b"superseded" if superseded else b"published")  # type: ignore[arg-type]


def _outcome(group: str | None, token: str | None) -> bytes | None:
    store = _default_store() if group is not None and token is not None else None
    if store is None:
        return None
    key = _outcome_key(group, token)  # type: ignore[arg-type]
    return bytes(store.get(key)) if store.check([key]) else None


def _default_store():  # noqa: ANN202 (a torch.distributed Store, or None)
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, AttributeError):
        return None


def wait_for_manifest(group_dir: str | Place, timeout_s: float, stop: threading.Event,
                      token: str | None = None, mine: dict | None = None, group: str | None = None) -> dict:
    """Poll until the coordinator publishes this attempt's manifest (non-coordinator ranks).

    A manifest counts only if it carries this attempt's token and lists this rank's files
    with the checksums just written (an older attempt's manifest does not). With a store and
    ``group``, rank 0's ``announce_outcome`` also ends the wait: the attempt was published and
    then deleted or replaced before this rank looked (returned with ``retired``).
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        m = read_group_manifest(group_dir)
        if m is not None and m.get("attempt") == token and all(
                m["files"].get(rel, {}).get("checksum") == info["checksum"] for rel, info in (mine or {}).items()):
            return m
        outcome = _outcome(group, token)
        if outcome == b"superseded":
            return {"superseded": True, "files": {}}
        if outcome == b"published":
            return {"files": dict(mine or {}), "attempt": token, "retired": True}
        if any(mk.get("superseded") and mk.get("attempt") == token for mk in read_markers(group_dir).values()):
            return {"superseded": True, "files": {}}  # a rank dropped this attempt: it will not be published
        if time.monotonic() >= deadline or stop.is_set():
            raise CommitTimeoutError(
                f"checkpoint group {as_place(group_dir).label}: rank 0 did not publish {GROUP_MANIFEST} within "
                f"{timeout_s:.0f} s; some rank did not commit (see rank 0's error)."
            )
        stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


def remove_group(ops: FileOps, group_dir: str) -> None:
    """Delete a group: manifest first (it becomes invisible at once), then its files."""
    import shutil

    manifest = os.path.join(group_dir, GROUP_MANIFEST)
    if os.path.exists(manifest):
        ops.unlink(manifest)
        ops.fsync_dir(group_dir)
    shutil.rmtree(group_dir)
