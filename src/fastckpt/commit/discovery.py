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

Checkpoints written without fastckpt count too, marked ``foreign`` (they load unverified: no
checksum was recorded): a complete ``torch.save`` zip (plain ``torch.save``, Lightning's
``TorchCheckpointIO``; recognised by its end-of-central-directory record, ``format.foreign``),
and the DeepSpeed tag directory that DeepSpeed's own ``latest`` file names (DeepSpeed's per-rank
files never count on their own). So a run that switches to fastckpt resumes from the checkpoints
it already has. A fastckpt file copied in by another tool (``aws s3 cp``, ``rsync``) without its
sidecar counts by the manifest in its own zip comment, and is verified when loaded.

Hidden names (``.x``) and temp files are never checkpoints. Checkpoints are ordered by their
commit request (groups) or write time (files; foreign ones by their modification time), not by
name. When foreign checkpoints are among them and every candidate records a step (a group's
``step=``, a file's top-level ``global_step``, ``iteration`` or ``step``, a DeepSpeed tag's
number), they are ordered by step first.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..storage.homes import Homes, Location
from ..storage.places import Place
from ..storage.types import BucketNotFoundError, TargetNotFoundError
from ..urls import join
from . import foreign
from .protocol import (
    GROUP_MANIFEST,
    MARKER_DIR,
    NEXT_TAG,
    SIDECAR,
    group_order,
    incomplete_group_error,
    pointed_name,
    read_group_manifest,
    read_sidecar,
)

log = logging.getLogger("fastckpt")
MAX_DEPTH = 4
RESCANS = 3  # listings a scan makes at most when checkpoints it listed vanish before it reads them
T = TypeVar("T")


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: its path or URL, ``kind`` ("file" or "group"), its order and manifest.

    ``foreign``: what wrote it, when not fastckpt (``"torch.save"``, ``"DeepSpeed"``): it has no
    fastckpt manifest (``manifest`` is empty) and loads unverified. ``step``: the training step it
    records, when that was read (ordering among foreign checkpoints needs it).
    """

    path: str
    kind: str
    time: float
    manifest: dict
    foreign: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class Damaged:
    """A checkpoint whose publication record (a group's manifest, a file's own manifest or
    sidecar) is damaged: never a candidate, but an operator's listing must show it."""

    path: str
    kind: str
    problem: str


def scan(loc: Location, max_depth: int = MAX_DEPTH, damaged: list[Damaged] | None = None) -> list[Found]:
    """Every complete checkpoint under ``loc``, oldest first.

    ``damaged``: when given, each checkpoint skipped for a damaged manifest is appended to it
    (``fastckpt ls`` and ``verify`` report them; ``latest`` only skips them).

    A checkpoint listed but gone when read (retention deleted it once a newer save was durable,
    which the listing may have missed: keep one, and the scan would find none) makes the scan
    list again, ``RESCANS`` times at most.
    """
    for _ in range(RESCANS):
        seen: list[Damaged] = []
        gone: list[str] = []
        found = _scan(loc, max_depth, seen, gone)
        if not gone:
            break
        log.debug("fastckpt: %s vanished while %s was scanned: listing it again", gone, loc.url)
    if damaged is not None:
        damaged.extend(seen)
    return found


def _scan(loc: Location, max_depth: int, damaged: list[Damaged], gone: list[str]) -> list[Found]:
    prefix = f"{loc.key}/" if loc.key else ""
    try:
        keys = loc.target.list(prefix, max_depth=max_depth + 1)  # +1: the markers of the deepest groups
    except BucketNotFoundError:
        raise  # a typo in the URL or a deleted bucket: never "nothing saved yet, start fresh"
    except TargetNotFoundError:
        return []
    rels = [k[len(prefix):] for k in keys]
    groups = {d for r in rels if posixpath.basename(r) == GROUP_MANIFEST  # not a re-save's staging directory
              for d in [posixpath.dirname(r)] if not _hidden(d)}
    marked = {r.split(f"/{MARKER_DIR}/")[0] for r in rels if f"/{MARKER_DIR}/" in f"/{r}"}
    marked = {"" if m.startswith(f"{MARKER_DIR}/") else m for m in marked}
    found: list[Found] = []
    for g in sorted(groups):
        m = _damaged_is_none(read_group_manifest, loc.place().child(g) if g else loc.place(),
                             damaged, join(loc.url, g), "group", gone)
        if m is not None:
            found.append(Found(join(loc.url, g), "group", group_order(m), m))
    ds_tags = {t for r in rels if posixpath.basename(r) == "latest" and not _hidden(r)
               for t in [foreign.deepspeed_tag(loc.target, prefix, r, set(rels))] if t and t not in groups}
    inside = groups | marked | ds_tags
    sidecars = {r[: -len(SIDECAR)] for r in rels if r.endswith(SIDECAR)}
    others: list[Found] = []
    for rel in rels:
        if rel.count("/") > max_depth or _hidden(rel) or any(rel.startswith(f"{g}/") or not g for g in inside):
            continue
        if rel.endswith(SIDECAR):
            side = _damaged_is_none(read_sidecar, Location(loc.target, prefix + rel[: -len(SIDECAR)]),
                                    damaged, join(loc.url, rel[: -len(SIDECAR)]), "file", gone)
            if side is not None:  # None: deleted since the listing (retention), or damaged
                found.append(Found(join(loc.url, rel[: -len(SIDECAR)]), "file", float(side.get("written_at", 0.0)),
                                   side))
        elif rel not in sidecars and posixpath.basename(rel) != "latest":
            f = _file(loc, prefix, rel, damaged, gone)
            if f is not None:
                (others if f.foreign else found).append(f)
    for t in sorted(ds_tags):  # ordered by when DeepSpeed's latest file named it
        written = loc.target.modified(prefix + posixpath.join(posixpath.dirname(t), "latest"))
        others.append(Found(join(loc.url, t), "group", written, {}, "DeepSpeed", foreign.tag_step(t)))
    return _ordered(loc, prefix, found, others)


def _damaged_is_none(read: Callable[[T], dict | None], where: T, damaged: list[Damaged], path: str,
                     kind: str, gone: list[str]) -> dict | None:
    """``read(where)``: a publication record (a group's manifest, a file's sidecar) listed just
    now; None when it is damaged, which makes that checkpoint no candidate, and says so (in
    ``damaged`` too), or gone since the listing (in ``gone``)."""
    try:
        got = read(where)
    except CorruptCheckpointError as exc:
        log.warning("fastckpt: skipping a damaged checkpoint: %s", exc)
        damaged.append(Damaged(path, kind, str(exc)))
        return None
    if got is None:
        gone.append(path)
    return got


def _file(loc: Location, prefix: str, rel: str, damaged: list[Damaged], gone: list[str]) -> Found | None:
    """A single file: fastckpt's (its manifest: verified on a mounted target, and on any target
    once copied in whole), or a complete torch.save zip written without fastckpt; else None."""
    if foreign.DEEPSPEED_FILE.match(posixpath.basename(rel)):
        return None
    try:
        m = loc.target.read_manifest(prefix + rel)
        if m:
            return None if m.get("group") else Found(join(loc.url, rel), "file", float(m.get("written_at", 0.0)), m)
        record = foreign.torch_zip(loc.target, prefix + rel)
        if record is None:
            if foreign.cut_zip(loc.target, prefix + rel):  # no silent skip: a checkpoint cut short
                damaged.append(Damaged(join(loc.url, rel), "file", f"{join(loc.url, rel)} is truncated: it is a zip "
                                       "(a torch.save or fastckpt file) without the end record every zip ends with"))
            return None
        return Found(join(loc.url, rel), "file", loc.target.modified(prefix + rel), {}, "torch.save",
                     foreign.pickle_step(loc.target, prefix + rel, record))
    except CorruptCheckpointError as exc:  # a damaged manifest: not a candidate, but no silent one either
        damaged.append(Damaged(join(loc.url, rel), "file", str(exc)))
        return None
    except FileNotFoundError:  # gone since the listing
        gone.append(join(loc.url, rel))
        return None
    except OSError:  # unreadable: not a candidate
        return None


def _ordered(loc: Location, prefix: str, own: list[Found], others: list[Found]) -> list[Found]:
    """Oldest first: by time, or, with foreign checkpoints among them and a step for every one,
    by step, then time."""
    own = _one_copy_each(own)
    if others:
        own = [replace(f, step=_step(loc, prefix, f)) for f in own]
    found = own + others
    by_step = bool(others) and all(f.step is not None for f in found)
    found.sort(key=lambda f: (f.step if by_step else 0, f.time, f.path))
    return found


def _one_copy_each(own: list[Found]) -> list[Found]:
    """One entry per save. Two copies of one save carry the same manifest: a burst-buffer copy
    inside the scanned root (a ``local_dir`` under the checkpoint directory) or a file copied
    within it. The copy nearest the root stands for the save (the burst-buffer copy, deeper
    by its mirrored path, is never named by ``latest``)."""
    best: dict[str, Found] = {}
    for f in own:
        key = f"{f.kind} {json.dumps(f.manifest, sort_keys=True, default=str)}"
        have = best.get(key)
        if have is None or (f.path.count("/"), f.path) < (have.path.count("/"), have.path):
            best[key] = f
    return list(best.values())


def _step(loc: Location, prefix: str, f: Found) -> int | None:
    if f.kind == "group":
        step = f.manifest.get("step")
        return step if isinstance(step, int) else None
    key = prefix + f.path[len(loc.url):].lstrip("/")
    try:
        return foreign.pickle_step(loc.target, key)
    except OSError:
        return None


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
    if not found:
        return None
    if found[-1].foreign:
        log.warning("fastckpt: the newest checkpoint under %s, %s, was written by %s, not fastckpt: it loads "
                    "unverified (no checksum was recorded); fastckpt's next save there supersedes it",
                    loc.url, found[-1].path, found[-1].foreign)
    return found[-1].path


def group_dir(url: str, manifest: dict) -> str | None:
    """The group directory ``url`` (a file with ``manifest``) belongs to where it lies, or None
    when it is a standalone file.

    A group file's manifest names its group (the directory's name, ``group``) and its place in
    it (``group_rel``). The file is in its group when the directory that place leads back to,
    or any directory above the file, has that name or is the group's re-save directory
    ``.NAME.fastckpt-next-<digest>``: then the group decides whether it loads (published, and naming this
    file). A copy elsewhere (DeepSpeed's ``ds_to_universal`` copies ``mp_rank_*`` files into
    ``TAG_universal/``; a user copies a shard out) is a file on its own, which the checksum in
    its manifest verifies whole, unless it lies where a published group names another file
    (``group_entry``).
    """
    name = manifest.get("group")
    if not name:
        return None
    rel = manifest.get("group_rel") or posixpath.basename(url)
    def named(d: str) -> bool:  # the group's directory, or one of its re-save directories
        base = posixpath.basename(d)
        return base == name or base == f".{name}{NEXT_TAG}" or base.startswith(f".{name}{NEXT_TAG}-")

    if url.endswith("/" + rel) and named(url[: -len(rel) - 1]):
        return url[: -len(rel) - 1]
    d, up = url, posixpath.dirname(url)
    while up != d:
        if named(up):
            return up
        d, up = up, posixpath.dirname(up)
    return None


@dataclass(frozen=True)
class InGroup:
    """Where a group's file stands in the group it lies in (``group_entry``)."""
    place: Place  # the group's directory
    published: dict | None  # its published manifest; None before it is published
    entry: dict | None  # what that manifest names at the file's path (else where the file was written)
    moved: bool  # ``entry`` is for the file's path, which is not where the file was written


def group_entry(homes: Homes, url: str, manifest: dict) -> InGroup | None:
    """For a group's file: the group it lies in and what that group names where the file lies.

    That is its own group (``group_dir``), looked up first at the file's path under it, then at
    the place the file was written (``group_rel``: a copy elsewhere in the group, which its
    checksum verifies). A group file outside its own group (copied into another step's directory)
    lies in a published group when the directory as far above it as ``group_rel`` is deep, or its
    parent, has a manifest naming the file's path. None for a file in no group."""
    rel = manifest.get("group_rel") or posixpath.basename(url)
    group = group_dir(url, manifest)
    if group is None:
        if not manifest.get("group"):
            return None
        ups = {posixpath.dirname(url), url[: -len(rel) - 1] if url.endswith("/" + rel) else ""}
        for up in sorted(u for u in ups if u):
            place = homes.resolve(up).place()
            published = read_group_manifest(place)
            entry = ((published or {}).get("files") or {}).get(url[len(up) + 1:])
            if entry is not None:
                return InGroup(place, published, entry, moved=True)
        return None
    place = homes.resolve(group).place()
    published = read_group_manifest(place)
    files, here = (published or {}).get("files") or {}, url[len(group) + 1:]
    if here in files:
        return InGroup(place, published, files[here], moved=here != rel)
    return InGroup(place, published, files.get(rel), moved=False)


def require_complete_group(homes: Homes, url: str, manifest: dict) -> None:
    """A file in its group (``group_dir``) may be loaded only once the group is published, and
    only if it is the file the group's manifest names (same checksum): a file left by another
    attempt at the same tag never loads as part of the published group. A file lying where a
    published group names another file (moved or copied over it, from this group or another)
    never loads as that file.

    Raises:
        IncompleteCheckpointError: naming the group and the ranks that never committed, or the
            attempt the file does not belong to.
        CorruptCheckpointError: the file lies where its group names another file.
    """
    found = group_entry(homes, url, manifest)
    if found is None:
        return
    label, entry = found.place.label, found.entry
    if found.published is None:
        raise incomplete_group_error(found.place, None)
    if entry is not None and entry.get("checksum") == manifest["checksum"]["value"]:
        return
    if found.moved:
        raise CorruptCheckpointError(
            f"{url} is not the file checkpoint group {label} published at this path: it was written as "
            f"{manifest.get('group_rel')!r} of group {manifest.get('group')!r} and moved or copied here, over the "
            "group's own file. Restore that file from another copy (the burst buffer, a replica), or load an "
            "earlier checkpoint (fastckpt.latest(<parent dir>)).")
    raise IncompleteCheckpointError(
        f"{url} is not part of checkpoint group {label} as published: its manifest "
        f"{'does not name it' if entry is None else 'names another version of it'} (the file was left by "
        "another attempt at this tag). Load the group's published files, or fastckpt.latest(<parent dir>).")
