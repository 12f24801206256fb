"""Whether a group's file loads as part of its group: which group it lies in (``group_dir``),
what that group's published manifest names at its path (``group_entry``), and the check every
load of a group's file makes (``require_complete_group``). docs/groups.md, "Attempts"."""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..storage.homes import Homes
from ..storage.places import Place
from .protocol import NEXT_TAG, incomplete_group_error, read_group_manifest


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


class NotPublishedError(IncompleteCheckpointError):
    """A group's file that its group's published manifest does not name (another attempt's);
    ``group``: that group's directory; ``seen``: that manifest's attempt and commit time, to tell
    whether the group changed since."""

    def __init__(self, message: str, group: str, seen: tuple[object, object]) -> None:
        super().__init__(message)
        self.group, self.seen = group, seen


@dataclass(frozen=True)
class InGroup:
    """Where a group's file stands in the group it lies in (``group_entry``)."""
    place: Place  # the group's directory
    dir: str  # its URL
    published: dict | None  # its published manifest; None before it is published
    entry: dict | None  # what that manifest names at the file's path (else where the file was written)
    moved: bool  # ``entry`` is for the file's path, which is not where the file was written


MAX_UP = 8  # directories above a group's file copied out of its group searched for the group it now lies in


def _ancestors(url: str) -> list[str]:
    """The directories above ``url``, nearest first, ``MAX_UP`` at most, none above its bucket."""
    floor = url.index("://") + 3 if "://" in url else 1
    out, d = [], posixpath.dirname(url)
    while len(d) > floor and len(out) < MAX_UP:
        out.append(d)
        d, up = posixpath.dirname(d), d
        if d == up:
            break
    return out


def naming_group(homes: Homes, url: str, read: Callable[[Place], dict | None]) -> InGroup | None:
    """The nearest published group above ``url`` (``read``: how its manifest is read) and its
    entry for ``url``, for a file that cannot say its group itself (missing, or cut short before
    its manifest); None when that group does not name it, or no group is published above it."""
    for up in _ancestors(url):
        place = homes.resolve(up).place()
        if (published := read(place)) is not None:
            entry = (published.get("files") or {}).get(url[len(up) + 1:])
            return None if not isinstance(entry, dict) else InGroup(place, up, published, entry, moved=False)
    return None


def group_entry(homes: Homes, url: str, manifest: dict, pinned: Mapping[str, dict] | None = None,
                read: Callable[[Place], dict | None] | None = None) -> InGroup | None:
    """For a group's file: the group it lies in and what that group names where the file lies.

    That is its own group (``group_dir``), looked up first at the file's path under it, then at
    the place the file was written (``group_rel``: a copy elsewhere in the group, which its
    checksum verifies). A file not where it was written lies in the nearest published group
    below that one: a copy of the whole group under a directory of the group's name is the group
    the copy's own manifest publishes. A group file outside its own group (copied into
    another step's directory, at any depth) lies in the nearest directory above it with a
    published manifest, and is judged as that group's file where that manifest names its path.
    None for a file in no group.

    ``pinned``: group directory -> the manifest to judge by instead of its published one now
    (``Checkpointer.reading``). ``read``: how a group manifest is read (``read_group_manifest``;
    a load's memo of them: ``load.fallback.HomeGroups``)."""
    rel = manifest.get("group_rel") or posixpath.basename(url)
    group = group_dir(url, manifest)

    def published_at(d: str) -> tuple[Place, dict | None]:
        place = homes.resolve(d).place()
        return place, pinned[d] if pinned and d in pinned else (read or read_group_manifest)(place)

    if group is None:
        if not manifest.get("group"):
            return None
        for up in _ancestors(url):
            place, published = published_at(up)
            if published is not None:
                entry = (published.get("files") or {}).get(url[len(up) + 1:])
                return None if entry is None else InGroup(place, up, published, entry, moved=True)
        return None
    found = None
    if not url.endswith(f"{group}/{rel}"):  # not where it was written: a copy of the group below may hold it
        below = [up for up in _ancestors(url) if up.startswith(group + "/")]
        found = next(((up, *at) for up in below if (at := published_at(up))[1] is not None), None)
    group, place, published = found or (group, *published_at(group))
    files, here = (published or {}).get("files") or {}, url[len(group) + 1:]
    if here in files:
        return InGroup(place, group, published, files[here], moved=here != rel)
    return InGroup(place, group, published, files.get(rel), moved=False)


def require_complete_group(homes: Homes, url: str, manifest: dict, pinned: Mapping[str, dict] | None = None) -> None:
    """A file in its group (``group_dir``) may be loaded only once the group is published, and
    only if it is the file the group's manifest names (same checksum): a file left by another
    attempt at the same tag never loads as part of the published group. A file lying where a
    published group names another file (moved or copied over it, from this group or another)
    never loads as that file. ``pinned``: as ``group_entry``.

    Raises:
        IncompleteCheckpointError: naming the group and the ranks that never committed, or the
            attempt the file does not belong to.
        CorruptCheckpointError: the file lies where its group names another file.
    """
    found = group_entry(homes, url, manifest, pinned)
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
    raise NotPublishedError(
        f"{url} is not part of checkpoint group {label} as published: its manifest "
        f"{'does not name it' if entry is None else 'names another version of it'} (the file was left by "
        "another attempt at this tag). Load the group's published files, or fastckpt.latest(<parent dir>).",
        found.dir, (found.published.get("attempt"), found.published.get("committed_at")))
