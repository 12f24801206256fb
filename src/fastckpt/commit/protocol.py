"""The group commit protocol's files: rank markers, the group manifest, the ``latest`` pointer,
and (without a store) the attempt and outcome records. Everything goes through a ``Place``
(``storage.places``), so the protocol is the same on a local disk, a parallel file system and S3.

A group (several files from one or several ranks under one directory) is complete only when
its manifest ``fastckpt-manifest.json`` exists; it names the files of exactly one attempt, each
with its size and checksum. Each rank leaves a marker ``.fastckpt/rank-NNNNN.json`` listing its
durable files and the attempt they belong to: the commit itself goes through the store when
there is one (``store.py``), and the markers are the crash trail that names missing ranks.
Without a store, rank 0 names each attempt in ``.fastckpt/attempt.json`` (a random id every
rank echoes in its marker, with the id it replaced and rank 0's session) and publishes the
manifest once every rank's marker of that attempt is there; ``.fastckpt/outcome.json`` tells
the other ranks an attempt that ended without a manifest. A single file at a URL is published
by its sidecar ``NAME.fastckpt.json`` (see ``save/replicator.py``). docs/groups.md describes
the whole protocol.
"""

from __future__ import annotations

import errno
import hashlib
import json
import posixpath
import threading
import time

from ..errors import ConfigError, CorruptCheckpointError, GroupRemovedError, IncompleteCheckpointError
from ..format.manifest import FORMAT_VERSION, check_group_manifest, check_manifest, file_order, with_digest
from ..storage.homes import Location
from ..storage.places import Place
from ..storage.types import TargetNotFoundError
from .names import GROUP_MANIFEST, LATEST, MARKER_DIR, NEXT_DIGEST_CHARS, NEXT_TAG, SIDECAR, stays_inside
from .order import group_order, holds

ATTEMPT_NAME = "attempt.json"  # without a store: the attempt rank 0 started, in MARKER_DIR
ATTEMPT = f"{MARKER_DIR}/{ATTEMPT_NAME}"
OUTCOME = f"{MARKER_DIR}/outcome.json"  # without a store: an attempt that ended unpublished

_latest_lock = threading.Lock()  # commits of several groups publish from concurrent threads


def marker_rel(rank: int) -> str:
    return f"{MARKER_DIR}/rank-{rank:05d}.json"


def write_marker(place: Place, rank: int, world_size: int, files: dict, token: str | None = None,
                 superseded: bool = False, steps: dict | None = None) -> None:
    """Publish this rank's marker: its durable files of this attempt (or that it gave up), its steps (pairing.py)."""
    body = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size, "files": files, **(steps or {}),
            "written_at": time.time(), "attempt": token, **({"superseded": True} if superseded else {})}
    place.put(marker_rel(rank), json.dumps(body, sort_keys=True).encode())


def marker_ranks(place: Place, names: list[str] | None = None) -> dict[int, str]:
    """rank -> marker name, from one listing of the marker directory (``names``, if given)."""
    return {int(n[5:-5]): f"{MARKER_DIR}/{n}" for n in (place.names(MARKER_DIR) if names is None else names)
            if n.startswith("rank-") and n.endswith(".json") and n[5:-5].isdigit()}


def write_failure(place: Place, rank: int, token: str | None, why: str, seen: str | None = None) -> None:
    """Without a store: this rank's save into attempt ``token`` failed (rank 0 ends the attempt).
    ``token`` None: rank 0 has not started it yet; ``seen`` is the attempt ``attempt.json``
    named (one that ended, or none), which rank 0's next attempt replaces. Not a marker:
    ``marker_ranks`` and the readers that name missing ranks never see it."""
    body = {"rank": rank, "attempt": token, "seen": seen, "why": why, "written_at": time.time()}
    place.put(f"{MARKER_DIR}/failed-{rank:05d}.json", json.dumps(body).encode())


def attempt_id(place: Place) -> str | None:
    """The attempt id in ``attempt.json`` (None when there is none), ended or not."""
    return (read_record(place, ATTEMPT) or {}).get("attempt")


def failure_ranks(names: list[str]) -> dict[int, str]:
    """rank -> failure record name (``write_failure``), from a listing of the marker directory."""
    return {int(n[7:-5]): f"{MARKER_DIR}/{n}" for n in names
            if n.startswith("failed-") and n.endswith(".json") and n[7:-5].isdigit()}


def read_marker(place: Place, rel: str) -> dict | None:
    data = place.get(rel)
    return None if data is None else json.loads(data)


def read_markers(place: Place) -> dict[int, dict]:
    bodies = {rank: read_marker(place, rel) for rank, rel in marker_ranks(place).items()}
    return {rank: body for rank, body in bodies.items() if body is not None}


def write_record(place: Place, rel: str, **body: object) -> None:
    """The attempt or outcome record (``ATTEMPT``, ``OUTCOME``) of the storage protocol."""
    place.put(rel, json.dumps(dict(body, written_at=time.time()), sort_keys=True).encode())


def read_record(place: Place, rel: str) -> dict | None:
    try:
        return None if (data := place.get(rel)) is None else json.loads(data)
    except ValueError:  # written by put (atomic): only a foreign file could be damaged
        return None


def read_group_manifest(place: Place) -> dict | None:
    try:
        data = place.get(GROUP_MANIFEST)
    except OSError as exc:
        if exc.errno != errno.EISDIR:
            raise
        raise CorruptCheckpointError(f"{place.url(GROUP_MANIFEST)} is a directory, not the group's manifest: the "
                                     "group is damaged. Move the directory away; restore the group or load an "
                                     "earlier one.") from exc
    if data is None:
        return None
    try:
        return check_group_manifest(json.loads(data))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{place.url(GROUP_MANIFEST)} is damaged: {exc}{_restore(place)}") from exc
    except ValueError as exc:
        raise CorruptCheckpointError(f"{place.url(GROUP_MANIFEST)} does not parse: {exc}{_restore(place)}") from exc


def _restore(place: Place) -> str:
    """The way forward from a group whose manifest is damaged: none of its files can be checked."""
    parent = posixpath.dirname(place.url().rstrip("/"))
    return (". None of the group's files can be checked against it, so the group cannot be loaded: restore the "
            "manifest from another copy of the group (a replica, the burst buffer of the node that saved it), or "
            f"resume from the checkpoint before it, which `fastckpt latest {parent}` prints (it passes over a "
            "group whose manifest is damaged)")


def _followable(name: str) -> bool:
    return bool(name) and not any(c in name for c in "/\\\x00") and not name.startswith(".")


def pointable(parent: Place, name: str) -> bool:
    """Whether ``latest`` in ``parent`` naming ``name`` leads to it (``_pointed`` follows it): not a hidden
    name, one with a separator or with blanks at its ends (the pointer is read stripped), nor a link."""
    return _followable(name) and name == name.strip() and not parent.is_link(name)


def _pointed(parent: Place, strict: bool = False) -> tuple[str, float] | None:
    """What ``parent/latest`` names, if that is a complete checkpoint, and its order.

    The name is a group directory (complete once its manifest exists) or a single file
    (complete once its sidecar exists, at a URL, and its object still does: one HEAD, since
    another tool may delete the object and leave the sidecar, e.g. a plain run's top-k removal).
    ``strict``: a read that fails (EIO, a directory standing there) raises, never taken for none."""
    try:
        name = (parent.get(LATEST) or b"").decode().strip()
        if not pointable(parent, name):
            return None  # garbage, or a name leading out of the directory: never followed
        m = read_group_manifest(parent.child(name))
        if m is not None:
            return name, group_order(m)
        side = json.loads(parent.get(name + SIDECAR) or b"null")  # not an object: none, or damaged (the scan judges)
        return (name, file_order(side)) if isinstance(side, dict) and parent.size(name) >= 0 else None
    except OSError:  # unreadable: it may be replaced
        if strict:
            raise
        return None
    except (ValueError, CorruptCheckpointError):  # corrupt: it may be replaced
        return None


def never_latest(place: Place, manifest: dict) -> bool:
    """Whether the published group ``place`` is one whose commit died between its manifest and
    its ``latest`` move: the parent's pointer names an older complete checkpoint, though this
    group was committed to move it (``moved_latest`` is absent: ``commit(move_latest=False)``
    records False). Its commit never returned, and ``latest()`` never answered it."""
    if manifest.get("moved_latest", True) is False:
        return False
    found = _pointed(place.parent())
    return found is not None and found[0] != manifest.get("tag") and found[1] < group_order(manifest)


def pointed_name(parent: Place) -> str | None:
    """The name in ``parent/latest`` when it is a complete checkpoint; None when stale or absent."""
    found = _pointed(parent)
    return found[0] if found is not None else None


def latest_reached(place: Place, manifest: dict, strict: bool = False) -> bool:
    """Whether ``latest`` beside the published group ``place`` names it or a newer checkpoint:
    rank 0 moved it there (or past it, committing a later group meanwhile). Newer by the rule
    rank 0's ``move_pointer`` applies (``order.holds``): a pointer dated far ahead of this host's
    clock (a skewed node's) is one it would have moved, so it tells nothing. This host's clock, not
    rank 0's at publication: a rank reads at its deadline, often minutes later, after a newer
    commit dated correctly. ``strict``: as ``_pointed``."""
    found = _pointed(place.parent(), strict)
    return found is not None and (found[0] == manifest.get("tag")
                                  or holds(found[1], group_order(manifest)))


def move_pointer(parent: Place, name: str, order: float) -> bool:
    """Point ``parent/latest`` at ``name`` (just published, of the given order); only forward.

    Called after the checkpoint's publication (manifest or sidecar), so the pointer never names
    a partial checkpoint. Returns whether it was written: not when it names ``name`` already (a re-save:
    its publication was then its last step that could fail) or a newer checkpoint (unless dated more than
    ``AHEAD_S`` after this host's clock: ``order.holds``)."""
    with _latest_lock, parent.exclusive():  # another process may move it too: docs/groups.md
        found = _pointed(parent)
        if found is not None and (found[0] == name or holds(found[1], order)):
            return False
        parent.put(LATEST, name.encode())
        return True


def build_manifest(place: Place, world_size: int, entries: dict[int, dict], extra: dict,
                   requested_at: float | None, token: str | None, check_sizes: bool = True,
                   files_at: Place | None = None) -> dict:
    """The manifest of one attempt at the group ``place``: every rank's files (``entries``:
    rank -> marker or store entry, each with ``files``), the attempt and ``extra``.

    Args:
        check_sizes: stat every file (in ``files_at``, default ``place``) against its entry.

    Raises:
        IncompleteCheckpointError: with ``check_sizes``, a file's size is not what its rank
            committed (it was replaced or truncated since); GroupRemovedError when it is gone.
    """
    files: dict[str, dict] = {}
    at = files_at or place
    for r in sorted(entries):
        for rel, info in member_files(entries[r], f"{place.label} (rank {r}'s files)").items():
            size = at.size(rel) if check_sizes else info["size"]
            if size != info["size"]:  # a file is gone only when remove() deleted the group
                what = "is gone: the group was removed (Checkpointer.remove)" if size < 0 else f"has {size}"
                raise (GroupRemovedError if size < 0 else IncompleteCheckpointError)(
                    f"group {place.label}: rank {r} committed {rel} with {info['size']} bytes but the "
                    f"file {what}; not publishing this checkpoint.")
            files[rel] = {"size": info["size"], "checksum": info["checksum"], "rank": r}
    if not files:  # published, it would be an empty checkpoint that latest() names over the real ones
        raise ConfigError(f"group {place.label}: no rank saved a file into it, so there is nothing to commit. Save "
                          "into it first (save(state, path, group=...) with the same group), or check that commit() "
                          "names the group the saves named.")
    manifest = {"kind": "group", "world_size": world_size,  # with_digest adds its format
                "tag": place.label.rstrip("/").rsplit("/", 1)[-1], "ranks": sorted(entries),
                "attempt": token, "files": files, "committed_at": time.time(), **extra}
    return with_digest({**manifest, "requested_at": requested_at} if requested_at is not None else manifest)


def manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(with_digest(manifest), sort_keys=True, separators=(",", ":")).encode()


def member_files(manifest: dict, where: str) -> dict[str, dict]:
    """A group manifest's (or marker's) files, each name checked to stay inside the group: a
    relative, '/'-separated path without '.', '..' or empty parts.

    Raises:
        CorruptCheckpointError: naming ``where`` and the entry that would lead out of it.
    """
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"{where}: its manifest has no file list")
    for rel in files:
        if not stays_inside(rel):
            raise CorruptCheckpointError(f"{where}: its manifest names {rel!r}, which leads out of the checkpoint; "
                                         "not following it (the manifest is damaged or was edited)")
    return files


def publish_group(place: Place, world_size: int, markers: dict[int, dict], extra: dict,
                  requested_at: float | None = None, token: str | None = None, move_latest: bool = True) -> dict:
    """Check every rank's files (raising as ``build_manifest``), then publish the group manifest
    and (``move_latest``) move the latest pointer."""
    manifest = build_manifest(place, world_size, markers, extra, requested_at, token)
    place.put(GROUP_MANIFEST, manifest_bytes(manifest))
    if move_latest:
        move_pointer(place.parent(), manifest["tag"], group_order(manifest))
    return manifest


def current_markers(place: Place) -> dict[int, dict]:
    """The markers of the newest attempt at ``place`` (the one of the newest marker): a rank's
    marker of an older attempt stays until it commits again, and does not count."""
    markers = read_markers(place)
    newest = max(markers.values(), key=lambda m: float(m.get("written_at", 0.0)), default={})
    return {r: m for r, m in markers.items() if m.get("attempt") == newest.get("attempt")}


def incomplete_group_error(place: Place, world_size: int | None) -> IncompleteCheckpointError:
    markers = current_markers(place)
    ws = world_size or max((m["world_size"] for m in markers.values()), default=0)
    missing = [r for r in range(ws) if r not in markers]
    what = f"ranks {missing} of {ws} never committed" if missing else \
        "it has no published manifest (its commit never finished, or it is being removed)"
    return IncompleteCheckpointError(
        f"checkpoint {place.label} is incomplete: {what} (no {GROUP_MANIFEST}). "
        "Load an earlier checkpoint: fastckpt.latest(<parent dir>) returns the newest complete one.")


def publish_file(loc: Location, manifest: dict) -> None:
    """A single file is durable and verified at ``loc``: publish it and, where the directory
    keeps its pointer for files, move the pointer.

    On an object store the sidecar is its publication (written last, after verification), and
    the directory's ``latest`` follows it unless it names a group: a directory of groups keeps
    its pointer for them (it is DeepSpeed's and Megatron's ``latest``: a file saved beside the
    tags, such as ``save_16bit_model``'s, must not take it over). On a mounted file system the
    rename already published the file, and files never write a pointer: a scan finds them.
    """
    parent, name = loc.place().parent(), posixpath.basename(loc.key)
    if loc.target.mounted:
        return
    parent.put(name + SIDECAR, json.dumps(manifest, sort_keys=True).encode())
    current = (parent.get(LATEST) or b"").decode(errors="replace").strip()  # not text: no group, replaced
    if _followable(current) and read_group_manifest(parent.child(current)) is not None:
        return
    move_pointer(parent, name, file_order(manifest))


def read_sidecar(loc: Location, deadline_s: float | None = None) -> dict | None:
    """The manifest the single file at ``loc`` (a URL) was published with, from its sidecar; None
    when it has none (not published yet, or deleted). ``deadline_s``: see ``Target.get_bytes``.

    Raises:
        CorruptCheckpointError: the sidecar does not parse as a manifest.
    """
    try:
        data = loc.target.get_bytes(loc.key + SIDECAR, deadline_s=deadline_s)
    except TargetNotFoundError:
        return None
    try:
        return check_manifest(json.loads(data))
    except (ValueError, CorruptCheckpointError) as exc:
        raise CorruptCheckpointError(f"{loc.url}{SIDECAR} is damaged: {exc}") from exc


def staged_place(home: Place, old: dict | None) -> Place:
    """Where a new attempt at the published group ``home`` is written: hidden beside it, named
    after the attempt it replaces (``old``, its manifest; None: damaged), so every rank picks the
    same one, and the next re-save (it may start once this one is published) never writes into
    the directory rank 0 still deletes: ``.TAG.fastckpt-next-<digest>``."""
    seed = "damaged" if old is None else f"{old.get('attempt')}:{float(old.get('committed_at', 0.0))!r}"
    digest = hashlib.sha1(seed.encode()).hexdigest()[:NEXT_DIGEST_CHARS]  # (names.GROUP_NAME_MAX: what fits)
    return home.parent().child(f".{posixpath.basename(home.key)}{NEXT_TAG}-{digest}")


def staged_places(home: Place) -> list[Place]:
    """Every re-save directory of ``home`` (and ``.TAG.fastckpt-next``, earlier versions' one
    name for all), also one a crash left empty or holding only temp files."""
    parent, prefix = home.parent(), f".{posixpath.basename(home.key)}{NEXT_TAG}"
    start = parent.key + "/" if parent.key else ""
    try:
        names = [k[len(start):] for k in parent.target.dirs(start + prefix)]
    except TargetNotFoundError:
        return []
    return [parent.child(n) for n in names if n == prefix or n.startswith(prefix + "-")]

