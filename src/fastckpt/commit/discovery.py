"""Finding checkpoints: the one ``latest`` rule, for directories and URLs alike.

``latest(root)``: the checkpoint ``root/latest`` names, when that is complete (group commits
and published single files move it forward, never back); otherwise, when the pointer is stale or
missing, the newest complete checkpoint a scan finds. A scan lists the root down to
``MAX_DEPTH`` directories and counts:

* a group directory once its ``fastckpt-manifest.json`` exists (its files are not separate
  checkpoints; a directory with rank markers but no manifest is an incomplete group, skipped
  with everything inside it);
* a single file once it is published: by its sidecar ``NAME.fastckpt.json`` at a URL, or, on a
  target where a visible file is already verified (POSIX: copies are verified before their
  rename), by the fastckpt manifest in its own zip comment.

Hidden names (``.x``) and temp files are never checkpoints. Checkpoints are ordered by their
commit request (groups) or write time (files), not by name.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..storage.homes import Homes, Location
from ..storage.types import TargetNotFoundError
from ..urls import join
from .protocol import (
    GROUP_MANIFEST,
    MARKER_DIR,
    SIDECAR,
    group_order,
    incomplete_group_error,
    pointed_name,
    read_group_manifest,
)

MAX_DEPTH = 4


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: its path or URL, ``kind`` ("file" or "group"), its order and manifest."""

    path: str
    kind: str
    time: float
    manifest: dict


def scan(loc: Location, max_depth: int = MAX_DEPTH) -> list[Found]:
    """Every complete checkpoint under ``loc``, oldest first."""
    prefix = f"{loc.key}/" if loc.key else ""
    try:
        keys = loc.target.list(prefix, max_depth=max_depth + 1)  # +1: the markers of the deepest groups
    except TargetNotFoundError:
        return []
    rels = [k[len(prefix):] for k in keys]
    groups = {posixpath.dirname(r) for r in rels if posixpath.basename(r) == GROUP_MANIFEST}
    marked = {r.split(f"/{MARKER_DIR}/")[0] for r in rels if f"/{MARKER_DIR}/" in f"/{r}"}
    marked = {"" if m.startswith(f"{MARKER_DIR}/") else m for m in marked}
    found: list[Found] = []
    for g in sorted(groups):
        m = read_group_manifest(loc.place().child(g) if g else loc.place())
        if m is not None:
            found.append(Found(join(loc.url, g), "group", group_order(m), m))
    inside = groups | marked
    for rel in rels:
        if rel.count("/") > max_depth or _hidden(rel) or any(rel.startswith(f"{g}/") or not g for g in inside):
            continue
        if rel.endswith(SIDECAR):
            side = json.loads(loc.target.get_bytes(prefix + rel))
            found.append(Found(join(loc.url, rel[: -len(SIDECAR)]), "file", float(side.get("written_at", 0.0)), side))
        elif loc.target.mounted:
            try:
                m = loc.target.read_manifest(prefix + rel)
            except (OSError, CorruptCheckpointError):
                continue
            if m and not m.get("group"):
                found.append(Found(join(loc.url, rel), "file", float(m.get("written_at", 0.0)), m))
    found.sort(key=lambda f: (f.time, f.path))
    return found


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def latest(homes: Homes, root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (a directory or URL), or None (see the
    module docstring for the rule)."""
    loc = homes.resolve(root)
    name = pointed_name(loc.place())
    if name is not None:
        return join(loc.url, name)
    found = scan(loc)
    return found[-1].path if found else None


def require_complete_group(homes: Homes, url: str, manifest: dict) -> None:
    """A file that belongs to a group may be loaded only once the group is published, and only
    if it is the file the group's manifest names (same checksum): a file left by another
    attempt at the same tag never loads as part of the published group.

    Raises:
        IncompleteCheckpointError: naming the group and the ranks that never committed, or the
            attempt the file does not belong to.
    """
    if not manifest.get("group"):
        return
    rel = manifest.get("group_rel") or posixpath.basename(url)
    group = url[: -len(rel) - 1] if url.endswith("/" + rel) else posixpath.dirname(url)
    place = homes.resolve(group).place()
    published = read_group_manifest(place)
    if published is None:
        raise incomplete_group_error(place, None)
    entry = published.get("files", {}).get(rel)
    if entry is None or entry.get("checksum") != manifest["checksum"]["value"]:
        raise IncompleteCheckpointError(
            f"{url} is not part of checkpoint group {place.label} as published: its manifest "
            f"{'does not name it' if entry is None else 'names another version of it'} (the file was left by "
            "another attempt at this tag). Load the group's published files, or fastckpt.latest(<parent dir>).")
