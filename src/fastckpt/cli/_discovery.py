"""What is on disk (or in a bucket): checkpoints, their files and what each file must hold.

Built on the core's discovery (``scan``, ``scan_remote``, the manifests), which ``_compat``
imports. A checkpoint is complete once its manifest is published: a group's
``fastckpt-manifest.json``; a single file's own manifest (in its zip comment) on a local
filesystem, its sidecar ``NAME.fastckpt.json`` at a URL. A group directory with rank markers
and no manifest is incomplete (a commit that never finished).
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from dataclasses import dataclass

from ..errors import CorruptCheckpointError, FastCkptError
from . import _compat as core

STEP_KEYS = ("step", "global_step", "iteration")  # fastckpt groups, Lightning, Megatron


@dataclass(frozen=True)
class Entry:
    """One checkpoint as ``ls`` shows it. ``status``: complete, incomplete, local only, or
    replicated (complete at the home and in the burst buffer)."""

    path: str
    name: str
    kind: str
    status: str
    step: int | None
    bytes: int | None
    files: int
    time: float | None
    latest: bool = False

    @property
    def age_s(self) -> float | None:
        return None if self.time is None else max(0.0, time.time() - self.time)


@dataclass(frozen=True)
class FileSpec:
    """A file ``verify`` checks: where, the size and checksum recorded when it was committed
    (None where only the file's own manifest records them)."""

    path: str
    size: int | None
    checksum: str | None


def targets(storage_options: dict | None) -> core.TargetCache:
    return core.TargetCache(storage_options, 60.0, 8)


def _remote_json(cache: core.TargetCache, url: str) -> dict | None:
    target, key = cache.get(url)
    try:
        return json.loads(target.get_bytes(key))
    except core.TargetNotFoundError:
        return None


def group_manifest(path: str, storage_options: dict | None = None) -> dict | None:
    """The group manifest of ``path`` (a group directory or URL prefix), None if there is none."""
    if core.is_url(path):
        return _remote_json(targets(storage_options), f"{path.rstrip('/')}/{core.GROUP_MANIFEST}")
    return core.read_group_manifest(path) if os.path.isdir(path) else None


def checkpoint_files(path: str, storage_options: dict | None = None) -> tuple[list[FileSpec], dict]:
    """The files of the checkpoint at ``path`` and its manifest.

    Raises:
        FastCkptError: ``path`` is not a complete fastckpt checkpoint (says what it is).
    """
    m = group_manifest(path, storage_options)
    if m is not None:
        base = path.rstrip("/")
        return [FileSpec(f"{base}/{rel}", int(f["size"]), f.get("checksum"))
                for rel, f in sorted(m.get("files", {}).items())], m
    if core.is_url(path):
        m = _remote_json(targets(storage_options), path + core.SIDECAR)
    elif os.path.isfile(path):
        m = core.read_file_manifest(path)
    if not m:
        raise FastCkptError(f"{path} is not a complete fastckpt checkpoint: no {core.GROUP_MANIFEST} there"
                            + ("" if os.path.isdir(path) else ", and no fastckpt manifest for a single file")
                            + ". `fastckpt ls` on its parent shows what is there.")
    return [FileSpec(path, None, m["checksum"]["value"])], m


def step_of(manifest: dict, loaded: dict[str, object] | None = None) -> int | None:
    """The training step a checkpoint records: its manifest's, else a loaded file's."""
    for key in STEP_KEYS:
        if isinstance(manifest.get(key), int):
            return manifest[key]
    for obj in (loaded or {}).values():
        if isinstance(obj, dict):
            for key in STEP_KEYS:
                if isinstance(obj.get(key), int):
                    return obj[key]
    return None


def _found_entry(f: core.Found, root: str, status: str, sizer) -> Entry:  # noqa: ANN001
    name = f.path[len(root):].lstrip("/") or posixpath.basename(f.path)
    if f.kind == "group":
        files = f.manifest.get("files", {})
        size = sum(int(v["size"]) for v in files.values())
        return Entry(f.path, name, "group", status, step_of(f.manifest), size, len(files), f.time)
    return Entry(f.path, name, "file", status, step_of(f.manifest), sizer(f.path), 1, f.time)


def _local_size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _incomplete_local(root: str, max_depth: int = 4) -> list[Entry]:
    out: list[Entry] = []
    for d, dirs, names in os.walk(root):
        depth = d[len(root):].count(os.sep)
        if core.MARKER_DIR in dirs and core.GROUP_MANIFEST not in names:
            mtime = os.path.getmtime(os.path.join(d, core.MARKER_DIR))
            data = [n for n in names if not core.is_tmp(n)]
            out.append(Entry(d, os.path.relpath(d, root), "group", "incomplete", None,
                             sum(_local_size(os.path.join(d, n)) or 0 for n in data), len(data), mtime))
        dirs[:] = [x for x in dirs if not x.startswith(".") and depth < max_depth]
    return out


def _incomplete_remote(cache: core.TargetCache, url: str) -> list[Entry]:
    """Group prefixes under ``url`` with rank markers and no manifest."""
    target, prefix = cache.get(url)
    keys = target.list(f"{prefix}/" if prefix else "")
    marker = f"/{core.MARKER_DIR}/"
    groups: dict[str, list[str]] = {k.split(marker)[0]: [] for k in keys if marker in f"/{k}"}
    for k in keys:
        if marker in f"/{k}":
            continue
        parent = posixpath.dirname(k)
        while parent and parent not in groups:  # the group a data file belongs to, if any
            parent = posixpath.dirname(parent)
        if parent:
            groups[parent].append(k)
    return [Entry(target.url_of(g), g[len(prefix):].lstrip("/"), "group", "incomplete", None, None, len(members),
                  None)
            for g, members in groups.items() if not any(m.endswith("/" + core.GROUP_MANIFEST) for m in members)]


def _local_copies(mirror: str) -> list[Entry]:
    """Checkpoints in a burst buffer: single files with their manifest, and group directories
    whose files carry manifests naming the group (a group's own manifest is published at
    its home only)."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    out: list[Entry] = []
    for d, dirs, names in os.walk(mirror):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        for n in names:
            if core.is_tmp(n) or n.startswith("."):
                continue
            p = os.path.join(d, n)
            try:
                m = core.read_file_manifest(p)
            except (OSError, CorruptCheckpointError):
                continue
            if not m:
                continue
            if m.get("group"):
                groups.setdefault(d, []).append((p, m))
            else:
                out.append(Entry(p, os.path.relpath(p, mirror), "file", "local only", None, _local_size(p), 1,
                                 float(m.get("written_at", 0.0))))
    for d, files in groups.items():
        out.append(Entry(d, os.path.relpath(d, mirror), "group", "local only", None,
                         sum(_local_size(p) or 0 for p, _ in files), len(files),
                         max(float(m.get("written_at", 0.0)) for _, m in files)))
    return out


def list_checkpoints(root: str, storage_options: dict | None = None, local_dir: str | None = None) -> list[Entry]:
    """Every checkpoint under ``root`` (a directory or URL), oldest first, incomplete ones
    too; with ``local_dir`` each is marked replicated or local only by its burst-buffer copy."""
    from .. import latest  # noqa: PLC0415

    root = core.normalize(root)
    if core.is_url(root):
        cache = targets(storage_options)
        target, _ = cache.get(root)
        found = core.scan_remote(cache, root)
        entries = [_found_entry(f, root, "complete", lambda p: target.size(cache.get(p)[1])) for f in found]
        entries += _incomplete_remote(cache, root)
    else:
        entries = [_found_entry(f, root, "complete", _local_size) for f in core.scan(root)]
        entries += _incomplete_local(root)
    if local_dir is not None:
        home = {e.name: i for i, e in enumerate(entries)}
        for local in _local_copies(core.mirror_path(local_dir, root)):
            i = home.get(local.name)
            if i is None:
                entries.append(local)
            elif entries[i].status == "complete":
                entries[i] = Entry(**{**entries[i].__dict__, "status": "replicated"})
    newest = latest(root, storage_options)
    entries = [Entry(**{**e.__dict__, "latest": e.path.rstrip("/") == (newest or "").rstrip("/")}) for e in entries]
    return sorted(entries, key=lambda e: (e.time or 0.0, e.name))


def file_covered(spec: FileSpec, storage_options: dict | None) -> tuple[int, int, dict]:
    """(size, covered, the file's own manifest) read from its tail.

    Raises:
        CorruptCheckpointError: the tail holds no fastckpt manifest, or a damaged one.
        FileNotFoundError: the file is missing (locally or at the URL).
    """
    if core.is_url(spec.path):
        target, key = targets(storage_options).get(spec.path)
        size = target.size(key)
        start = max(0, size - core.TAIL_BYTES)
        m = core.parse_tail(target.read_range(key, start, size - start), size)
    else:
        size = os.path.getsize(spec.path)
        m = core.read_file_manifest(spec.path)
    if not m:
        raise CorruptCheckpointError(f"{spec.path} has no fastckpt manifest: it cannot be verified")
    return size, int(m["covered"]), m
