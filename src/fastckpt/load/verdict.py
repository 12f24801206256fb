"""Which copy a load tries first: how the burst-buffer copy of a path relates to its home's
(``compare``, for ``Loader._candidates``), read cheaply, before any copy is read whole.

On a mounted file system the home file's own manifest says which save it holds. At a URL a
single file's sidecar says which save was published there, and the manifest in the object's
own tail which save the object holds now: a plain writer (Lightning's ``TorchCheckpointIO``,
``aws s3 cp``, a restore tool) replaces the object and leaves the sidecar, so a sidecar naming
our save is checked against the object (``_held``) before the local copy is read instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ..commit.foreign import torch_zip
from ..format.manifest import file_order
from ..storage.homes import Location
from ..storage.retry import capped
from ..storage.types import TargetNotFoundError, TargetUnavailableError
from .fallback import SAME_SAVE_CHECK_S, home_sidecar

log = logging.getLogger("fastckpt")
#: How the burst-buffer copy relates to the home's (``compare``)
SAME, OTHER, OLDER, HOME_FIRST = "same", "other", "older", "home first"
#: ``Loader._in_group``: the checksum a group's file at a URL has in its group's published manifest
InGroup = Callable[[Location, dict | None], dict | None]


def compare(local: Location, home: Location, in_group: InGroup) -> str:
    """How the burst-buffer copy relates to the home's, read cheaply: on a mounted file system
    the home file's own manifest (``_file_manifest``), at a URL its sidecar or its group's
    manifest (one small GET, retried for ``SAME_SAVE_CHECK_S`` at most), and for a single file
    whose sidecar names our save (or which has none) the object's own manifest (``_held``).

    ``SAME``: the same save (equal checksums), or a home that cannot say which save it holds
    (missing, unreachable): the local copy first, as the verified load then decides; a damaged
    sidecar says nothing (the object's bytes decide, as without one). ``OTHER``: the home holds
    another save (a complete zip without a manifest on a file system that its group does not
    publish ours at; one cut short or zeroed is ours, damaged: ``HOME_FIRST``); ``OLDER``:
    another, and ours is older (``file_order``), or ours has no manifest while the home's has
    (a plain file prefetched before the path was saved with fastckpt, or a copy cut short: no
    save's only copy), so a prefetch may replace it. ``HOME_FIRST``: see ``_file_manifest``.
    """
    try:
        ours = local.target.read_manifest(local.key)
    except (OSError, ValueError):  # a damaged local copy: the load falls back from it, with a warning
        return SAME
    try:
        if home.target.mounted:
            theirs = _file_manifest(home)
            if isinstance(theirs, str):
                return theirs
            if theirs is None:  # a complete plain zip replaced ours there (torch.save, DeepSpeed); else ours,
                if torch_zip(home.target, home.key) is None:  # damaged
                    return HOME_FIRST
                mine = {"checksum": {"value": ours["checksum"]["value"]}} if ours else None  # its group names
                return SAME if mine and in_group(home, ours) == mine else OTHER  # ours: the zip is damage
            if ours and theirs.get("group") and theirs["checksum"] != ours["checksum"] and \
                    in_group(home, theirs) == {"checksum": {"value": ours["checksum"]["value"]}}:
                return SAME  # another of the group's files moved over the home's: ours is the one published
        else:
            theirs = home_sidecar(home, SAME_SAVE_CHECK_S) or in_group(home, ours)  # (None: damaged too)
            if theirs is None and ours is None:
                return _plain_copies(local, home)
            if ours and not ours.get("group") and (theirs is None or _same(ours, theirs)):
                with capped(SAME_SAVE_CHECK_S):  # as the sidecar's read: a store not answering soon leaves ours first
                    return _held(home, ours)  # the sidecar says what was published, not what the object holds
    except (OSError, ValueError):  # unreachable, or a damaged group manifest: the home cannot say
        return SAME
    if ours is None and theirs is not None:
        log.warning("fastckpt: burst-buffer copy %s unusable: it has no fastckpt manifest while %s has one (a "
                    "plain file prefetched before the path was saved with fastckpt, or a copy cut short); "
                    "loading %s", local.url, home.url, home.url)
        return OLDER
    if theirs is None or _same(ours, theirs):
        return SAME
    return OLDER if file_order(ours) <= file_order(theirs) else OTHER


def _held(home: Location, ours: dict) -> str:
    """How the burst-buffer copy of a single file (its manifest ``ours``) relates to the object
    at its URL now, by the manifest in the object's own tail (a HEAD and one ranged GET): a
    plain writer (Lightning's ``TorchCheckpointIO``, ``aws s3 cp``, a restore tool) replaces
    the object and leaves the sidecar, which then names our save still. ``SAME``: the object
    holds our save, or cannot say (missing, not answering); a complete plain zip is ``OTHER``,
    a damaged one ``HOME_FIRST`` (as on a mounted file system); another save is ``OLDER``
    (ours is older) or ``OTHER`` (an older save restored over ours: the object is loaded, and
    ``load.published`` warns that it is not the save its sidecar published)."""
    theirs = _file_manifest(home)
    if isinstance(theirs, str):
        return theirs
    if theirs is None:
        return OTHER if torch_zip(home.target, home.key) is not None else HOME_FIRST
    if _same(ours, theirs):
        return SAME
    return OLDER if file_order(ours) <= file_order(theirs) else OTHER


def _file_manifest(home: Location) -> dict | None | str:
    """The manifest of the file or object at ``home`` (None: it has none), or ``SAME`` when the home
    cannot say (the file is missing, or the storage does not answer). A file's size and tail are read
    through one descriptor, so a save renamed over the file meanwhile gives the old or the new
    one; a read that fails anyway (EIO, a stale NFS handle after such a rename, a trailer torn or
    damaged) is tried once more, and then gives ``HOME_FIRST``: the file is there, and its load
    verifies itself, so it is read before the local copy, never skipped for it (which could be
    of an older save)."""
    failed: BaseException | None = None
    for _ in range(2):
        try:
            if home.target.mounted and not home.target.exists(home.key):  # an object's read says so itself
                return SAME
            return home.target.read_manifest(home.key)
        except (TargetNotFoundError, TargetUnavailableError):  # deleted since, or not answering
            return SAME
        except (OSError, ValueError) as exc:
            failed = exc
    log.warning("fastckpt: cannot read which save %s holds (%s): loading it before the burst-buffer copy, "
                "which is the fallback", home.url, failed)
    return HOME_FIRST


def _same(ours: dict, theirs: dict) -> bool:
    return ours["checksum"]["value"] == theirs["checksum"]["value"]


def _plain_copies(local: Location, home: Location) -> str:
    """``SAME`` or ``OLDER`` for two files without a manifest at a URL (a plain torch.save file and
    its download by a prefetch). No checksum exists and no ETag is kept locally, so what both sides
    have decides: the same size, and the home's written no later than the local copy (the
    download, written after what it copied). A store's clock ahead of this node's only makes a copy
    look older (the home is loaded: correct, slower); one behind by more than the time between the
    download and a re-save of the same size is the case this misses."""
    size, date = home.target.size(home.key), home.target.modified(home.key)
    mine = os.stat(local.url)
    return SAME if size == mine.st_size and date <= mine.st_mtime else OLDER
