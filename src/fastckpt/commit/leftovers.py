"""What an attempt that replication's coalescing dropped leaves at the group's home.

A dropped attempt is never published, but its markers and outcome (``.fastckpt/``) were written
at the home, and with them the tag's directory: ``ls`` listed it as incomplete for good, and a
DeepSpeed user listing the tags saw it. Each rank deletes its own files of it copied home so far
(``removal.drop_copies``). With a store (or a single rank) rank 0 ends a dropped attempt only
once every rank announced its files, each after its uploads ended, and every rank learns the
outcome through the store: rank 0 then deletes the rest. Without a store rank 0 ends it on the
first marker that says dropped, while another rank may still upload its file of it and will
read the outcome from those records: they stay (docs/burst-buffer.md).

A group published at its home is never touched (a dropped re-save was written beside it, in its
staged place, which goes), nor one this rank began another attempt at since.

A commit refused because no rank saved into the group (a retried commit, a typo in its name)
opened its attempt first: the re-save directory ``.TAG.fastckpt-next-<digest>``, or the new
name's directory, holding only the attempt's records. ``refused`` deletes it, so ``ls`` and
``verify`` never list it as incomplete; of a directory holding any file only the marker goes.

Opening it also took the burst-buffer copy's manifest away: the copy stayed whole, but loads
then read the group from its home and retention took the copy for an unpublished leftover.
A rank that saves nothing into an attempt (``set_aside`` with ``writes`` False) moves the
manifest to ``KEPT`` instead, and a refusal on rank 0 moves it back (``put_back``). A save into
the copy (``writes``) deletes both, so ``KEPT`` exists only while nothing was written into the
copy since it was complete; each step holds the copy's directory lock (``Place.exclusive``), so
a restore never lands between a save's deletions. Killed in between, the copy is only without
its manifest, as before: slower, never wrong. The copies of the other ranks' nodes (they are
not told why rank 0 refused) stay without it: loads judge them by the home's manifest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading

from ..errors import ConfigError
from ..storage.places import Place
from .attempt import Attempt
from .names import GROUP_MANIFEST, MARKER_DIR
from .protocol import read_group_manifest
from .removal import drop_copies, drop_marker

log = logging.getLogger("fastckpt")
KEPT = f"{MARKER_DIR}/kept-{GROUP_MANIFEST}"  # a burst-buffer copy's manifest, set aside by ``set_aside``


def dropped(att: Attempt, recs: list, rank: int, world: int, lock: threading.Lock,
            attempts: tuple[dict[str, Attempt], dict[str, tuple]]) -> None:
    """Replication dropped ``att`` (``recs``: this rank's saves into it): its files go, and on rank 0
    with a store (or alone) its records. ``lock``, ``attempts``: the Coordinator's, open and committing."""
    drop_copies(att, recs)
    if rank != 0 or (world > 1 and att.channel is None):
        return
    with lock:  # held through the deletion: a new attempt at the group (``begin``) waits for it
        now = attempts[0].get(att.group) or attempts[1].get(att.group, (None,))[0]
        if now is not None and now is not att:  # a new attempt at the group owns the records there
            return
        try:
            if att.staged or read_group_manifest(att.home) is None:
                att.place.target.delete_tree(att.place.key, last=(MARKER_DIR,))
        except Exception as exc:  # noqa: BLE001 (a leftover must not fail a commit: say so and go on)
            log.warning("fastckpt: could not delete what the dropped attempt at %s left: %s", att.place.label, exc)


def refused(att: Attempt, rank: int, world: int, exc: BaseException) -> BaseException:
    """``exc``, the failure of this rank's commit of ``att``; when it is the refusal of a commit
    nothing was saved for, on rank 0 with a store (or alone), the attempt's place goes if it holds
    nothing but the attempt's records (``MARKER_DIR``), else this rank's marker: what this commit created;
    and the burst-buffer copies get their manifest back (``put_back``; without a store too)."""
    if not isinstance(exc, ConfigError) or att.handles or rank != 0:
        return exc
    put_back(att)
    if world > 1 and att.channel is None:
        return exc
    try:
        if all(f.startswith(f"{MARKER_DIR}/") for f in att.place.files()):
            att.place.target.delete_tree(att.place.key, last=(MARKER_DIR,))
        else:  # a directory holding files (not this commit's): only its marker goes
            drop_marker(att, rank)
    except OSError as why:  # the refusal is the error to raise: the leftover only warns
        log.warning("fastckpt: could not delete %s, which the refused commit left: %s", att.place.label, why)
    return exc


def set_aside(local: tuple[Place, ...], writes: bool) -> None:
    """An attempt at the group opens on this rank: its burst-buffer copies (``local``) are no
    longer complete. ``writes``: this rank saves into them, so their manifest and any ``KEPT`` one
    go; else the manifest moves to ``KEPT``, for ``put_back``."""
    for copy in local:
        if not os.path.isdir(copy.url()):  # no copy on this drive: nothing to take away
            continue
        with copy.exclusive():
            if writes:
                copy.delete(GROUP_MANIFEST)
                copy.delete(KEPT)
            elif copy.size(GROUP_MANIFEST) >= 0:
                with contextlib.suppress(FileNotFoundError):  # trimmed meanwhile (keep_local): nothing to keep
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(copy.url(MARKER_DIR))  # one level: a trimmed copy is not brought back
                    copy.target.ops.replace(copy.url(GROUP_MANIFEST), copy.url(KEPT))


def put_back(att: Attempt) -> None:
    """Rank 0 refused ``att`` (no rank saved into it), or this rank ends it as it begins it: each
    burst-buffer copy whose manifest was set aside, and is still the one published at the home, gets
    it back; a failure only warns."""
    for copy in att.local:
        try:
            if att.old is None or not os.path.isdir(copy.url()):
                continue
            with copy.exclusive():
                kept = copy.get(KEPT)
                mine = json.loads(kept) if kept is not None else None
                if isinstance(mine, dict) and mine.get("digest") == att.old.get("digest"):
                    copy.target.ops.replace(copy.url(KEPT), copy.url(GROUP_MANIFEST))
        except (OSError, ValueError) as why:  # the copy stays without it: loads judge it by the home's
            log.warning("fastckpt: could not give %s its manifest back after the refused commit: %s", copy.label, why)
