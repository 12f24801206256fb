"""What ``Checkpointer.remove`` may delete: one checkpoint, never what holds checkpoints.

A group's deletion is a tree deletion, so a path passed by mistake (the run's directory, a
parent of the checkpoint, ``s3://bucket/prefix``) would take every checkpoint under it, the
``latest`` pointer and files fastckpt never wrote. ``check_removable`` lets through only:

* a file with a fastckpt manifest (also one whose manifest is damaged, and a sidecar whose
  file is gone), a ``torch.save`` zip, or a file ``ls`` lists damaged by ``foreign.damage``
  (cut short, or emptied under a checkpoint's name): the files ``ls`` lists;
* a fastckpt group: published (its manifest), or an attempt that was never published (rank
  markers, or files whose own manifests name it their group), or a directory holding nothing
  but temp files (a save into it that never finished);
* a checkpoint directory written without fastckpt that it recognises: torch.distributed.checkpoint
  (``.metadata``, Lightning's FSDP checkpoints and Megatron's ``torch_dist`` among them), a
  DeepSpeed tag (its ``*model_states.pt``) and a Megatron iteration (``iter_N`` with ``mp_rank_*``);

and never a directory that holds another checkpoint or a ``latest`` pointer below it. A path
where nothing is stays a no-op (a second ``remove``, retention's race with another rank).
"""

from __future__ import annotations

import os
import posixpath
import re

from ..errors import ConfigError, CorruptCheckpointError
from ..io.atomic import is_tmp
from ..storage.homes import Location
from ..storage.types import TargetNotFoundError
from ..urls import nameable
from . import foreign
from .discovery import DCP_METADATA, scan
from .membership import group_dir
from .protocol import GROUP_MANIFEST, MARKER_DIR, SIDECAR

MEGATRON_ITERATION = re.compile(r"iter_\d+$")
LOOKED_AT = 8  # files of an unmarked directory whose manifests are read to see whether it is a group


def refuse_root(loc: Location) -> None:
    """Refuse a target's root (``/``, a bucket): never one checkpoint, and never listed to find
    that out (a listing of ``/`` walks the whole file system) nor deleted with ``whole``.

    Raises:
        ConfigError: naming the root and what to pass instead.
    """
    if not loc.key:
        what = "a bucket (or host)" if "://" in loc.url else "the file system"
        raise ConfigError(f"remove({loc.url!r}): it is the root of {what}, never one checkpoint, so remove() "
                          "refuses it before looking inside. Pass the checkpoint to delete (a file or group "
                          "directory that fastckpt ls lists under it)")


def check_removable(loc: Location) -> None:
    """Return when ``loc`` is one checkpoint, or nothing is there.

    Raises:
        ConfigError: ``loc`` is something else (nothing is deleted): naming what it is and what
            to pass instead; a target's root first (``refuse_root``), unlisted.
    """
    refuse_root(loc)
    target, key = loc.target, loc.key
    prefix = f"{key}/" if key else ""
    try:
        listed = target.list(prefix)
    except TargetNotFoundError:
        listed = []
    rels = [k[len(prefix):] for k in listed if nameable(k)]  # a name fastckpt refuses (a\b.txt) is no checkpoint
    if not listed:  # a file (an object store's "directory" exists only through what it holds), or nothing
        if key and target.exists(key):
            _refuse_file(loc)
        return
    if rels and all(is_tmp(posixpath.basename(r)) for r in rels):  # a save into it that never finished
        return
    inner = _inner_checkpoint(rels)
    what = _checkpoint_dir(loc, rels)
    if what is not None and inner is None:
        return
    raise ConfigError(f"remove({loc.url!r}): it is {'not a checkpoint but a directory' if what is None else what} "
                      f"{_holding(loc, inner)}; remove() deletes one checkpoint and never a directory that holds "
                      "checkpoints. Pass the checkpoint to delete (a file or group directory that fastckpt ls lists "
                      "under it), or delete the directory yourself if you mean to.")


def _refuse_file(loc: Location) -> None:
    """Refuse the file ``loc`` unless it is a checkpoint of its own. A group's manifest is one file
    of its group, though no checkpoint file itself: deleting it alone unpublishes the group.

    Raises:
        ConfigError: naming what the file is and what to pass instead.
    """
    whole = _whole_of(loc)
    if (whole is None or posixpath.basename(loc.key) != GROUP_MANIFEST) and not _checkpoint_file(loc):
        raise ConfigError(f"remove({loc.url!r}): it is not a checkpoint: a file with no fastckpt manifest that "
                          "is no torch.save file either, so remove() does not delete it. Pass a checkpoint (a "
                          "file or group that fastckpt ls lists), or delete this file yourself if you mean to.")
    if whole is not None:
        raise ConfigError(f"remove({loc.url!r}): it is one file of {whole[0]}, {whole[1]}: deleting it alone "
                          "would leave that checkpoint damaged (and a resume that takes it would fail), so "
                          f"remove() does not. Pass {whole[1]} to delete the whole checkpoint")


def _checkpoint_file(loc: Location) -> bool:
    try:
        if loc.target.read_manifest(loc.key):
            return True
        # damaged by ls's own rule: an operator removes what ls reported, and a plain or empty log stays refused
        return foreign.torch_zip(loc.target, loc.key) is not None or foreign.damage(loc.target, loc.key) is not None
    except CorruptCheckpointError:  # a fastckpt file whose manifest is damaged: ls lists it, so it may go
        return True


def _whole_of(loc: Location) -> tuple[str, str] | None:
    """(what, its URL) when the file ``loc`` is one file of a checkpoint made of several: a fastckpt
    group (its manifest names it; a file without one, damaged or not fastckpt's, in a folder that
    holds a group's manifest or commit markers), a DeepSpeed tag, a Megatron iteration
    (``iter_N/mp_rank_*/``), a torch.distributed.checkpoint. A fastckpt file whose manifest names
    no group is a checkpoint of its own, wherever it lies."""
    try:
        manifest = loc.target.read_manifest(loc.key)
    except (OSError, CorruptCheckpointError):
        manifest = None
    if manifest:  # a fastckpt file: of the group its manifest names, else a checkpoint of its own (an
        return None if (group := group_dir(loc.url, manifest)) is None else ("the fastckpt group", group)  # ema.pt
    folder = posixpath.dirname(loc.url)
    if posixpath.basename(folder) in ("", folder) or folder.endswith("://"):  # at a root: in no checkpoint
        return None
    if _beside(loc, GROUP_MANIFEST) or _beside(loc, f"{MARKER_DIR}/"):
        return "the fastckpt group", folder
    if foreign.DEEPSPEED_FILE.match(posixpath.basename(loc.url)):
        return "the DeepSpeed tag", folder
    if posixpath.basename(folder).startswith("mp_rank_") and MEGATRON_ITERATION.match(
            posixpath.basename(up := posixpath.dirname(folder))):
        return "the Megatron iteration", up
    if _beside(loc, DCP_METADATA):
        return "the torch.distributed.checkpoint", folder
    return None


def _beside(loc: Location, name: str) -> bool:
    """Whether the folder holding the file ``loc`` holds ``name`` (a folder with something in it, for
    ``name`` ending in '/'). A local file's target is rooted at its folder; a URL's at its bucket."""
    if "://" not in loc.url:
        path = os.path.join(os.path.dirname(loc.url), name)
        return bool(os.path.isdir(path) and os.listdir(path)) if name.endswith("/") else os.path.lexists(path)
    key = posixpath.join(posixpath.dirname(loc.key), name)
    return bool(loc.target.list(key)) if name.endswith("/") else loc.target.exists(key)


def _inner_checkpoint(rels: list[str]) -> str | None:
    """A ``latest`` pointer or another checkpoint's publication record below the directory's top."""
    for r in rels:
        d, base = posixpath.split(r)
        if base == "latest" or (d and (base in (GROUP_MANIFEST, DCP_METADATA) or r.endswith(SIDECAR))):
            return r
    return None


def _checkpoint_dir(loc: Location, rels: list[str]) -> str | None:
    """What checkpoint the directory ``loc`` (its keys ``rels``) is, or None."""
    if GROUP_MANIFEST in rels:
        return "a fastckpt group"
    if any(r.startswith(f"{MARKER_DIR}/") for r in rels):
        return "an unpublished fastckpt group"
    if DCP_METADATA in rels:
        return "a torch.distributed.checkpoint"
    if any("/" not in r and foreign.DEEPSPEED_FILE.match(r) for r in rels):
        return "a DeepSpeed tag"
    if MEGATRON_ITERATION.match(posixpath.basename(loc.key)) and any(r.startswith("mp_rank_") for r in rels):
        return "a Megatron iteration"
    for r in [r for r in rels if not is_tmp(posixpath.basename(r))][:LOOKED_AT]:
        try:
            manifest = loc.target.read_manifest(posixpath.join(loc.key, r) if loc.key else r)
        except (OSError, CorruptCheckpointError):
            continue
        if manifest and group_dir(loc.url + "/" + r, manifest) == loc.url:
            return "an unpublished fastckpt group"
    return None


def _holding(loc: Location, inner: str | None) -> str:
    """What the directory holds, for the error: its checkpoints, else what makes it no checkpoint."""
    try:
        found = [f.path for f in scan(loc) if f.path != loc.url]
    except (OSError, ValueError):  # the message must not fail: say less
        found = []
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        return f"holding {len(found)} checkpoint{'s' * (len(found) != 1)} ({shown})"
    if inner is not None:
        return f"holding {inner}, another checkpoint's record or a latest pointer"
    return "holding no checkpoint fastckpt recognises"
