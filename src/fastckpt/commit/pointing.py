"""Rank 0 moves the directory's ``latest`` to the group it has just published (``attempt.publish``),
so that the commit reports what ``latest()`` answers (docs/groups.md, "Finding the newest checkpoint").

A pointer write that fails (EIO, a full disk) leaves the group's manifest out. While the pointer
names an older complete checkpoint, ``latest()`` answers that one; but with none to name (a
directory's first group commit, a stale pointer) its scan found the group, whose commit every rank
reported failed. So the group is taken back before the commit fails. (Reporting such a commit
committed instead, with a WARNING, was undone in 84dde27: an older group's commit that ended later
moved the pointer to itself, behind a commit reported done.) The manifest's own publication
(``publish_manifest``) follows one rule with the pointer's: a failure after it landed (the
directory's fsync) leaves the commit standing, as the other ranks read it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpointError
from ..storage.places import Place
from . import protocol as P
from . import resave

if TYPE_CHECKING:
    from .attempt import Attempt

log = logging.getLogger("fastckpt")


def move_latest(att: Attempt, manifest: dict) -> None:
    """Move the parent's ``latest`` to the group ``att`` published with ``manifest``.

    When that fails, the pointer is read again: naming the group or a newer checkpoint (the write got
    through, or another group's commit moved it past), the commit stands, with a WARNING, as the other
    ranks conclude from it (``verdict.py``, ``fallback.wait_for_manifest``); so it does for a group no
    pointer can lead to (``protocol.pointable``: a hidden name, a link), which they take for committed
    once it is published. Else, and when the pointer cannot be read, the group is taken back
    (``take_back``) and the error raised.
    """
    try:
        P.move_pointer(att.home.parent(), manifest["tag"], P.group_order(manifest))
    except OSError as exc:
        if _reached(att, manifest) or not P.pointable(att.home.parent(), manifest["tag"]):
            log.warning("fastckpt: %s is committed: %s names it (or a newer checkpoint), though its write failed: "
                        "%s", att.home.label, att.home.parent().url(P.LATEST), exc)
            return
        take_back(att, exc)
        raise


def publish_manifest(att: Attempt, manifest: dict) -> None:
    """Publish ``manifest`` at the group's home: in place, or swapped in (``resave.swap_in``).

    A failure after its rename or exchange landed (the directory's fsync: EIO) leaves it visible, and
    the other ranks may have taken it for the outcome already: the manifest is read again strictly,
    and when it is this attempt's the commit goes on, with a WARNING (only its durability through a
    power loss is in doubt), as on every rank. Else, and when it cannot be read, the error is raised."""
    try:
        if att.staged:
            resave.swap_in(att.home, att.place, manifest, att.old)
        else:
            att.home.put(P.GROUP_MANIFEST, P.manifest_bytes(manifest))
    except OSError as exc:
        try:
            landed = (P.read_group_manifest(att.home) or {}).get("digest") == manifest["digest"]
        except (OSError, CorruptCheckpointError):
            landed = False
        if not landed:
            raise
        log.warning("fastckpt: %s is published: its manifest is in place, though the step after it failed (%s); "
                    "it may not survive a power loss", att.home.label, exc)


def moved(place: Place, manifest: dict) -> bool:
    """Another rank: whether rank 0 is done with the group it published at ``place`` (``manifest``):
    ``latest`` names it or a newer checkpoint (rank 0 committed a later group meanwhile: commits of
    different groups run at once), or its commit was not to move it (``moved_latest`` False). Not
    while no pointer names it (a job's first checkpoint) or one names an older checkpoint: rank 0
    may yet fail that move, and then takes the group back. A pointer that named the group before
    its commit (a re-save's, a fixed tag's) tells the same: rank 0 writes none then
    (``protocol.move_pointer``), so once the group is out nothing of its commit is left to fail. So
    does a name no pointer leads to (``protocol.pointable``): rank 0's commit of it stands anyway."""
    return (manifest.get("moved_latest", True) is False or not P.pointable(place.parent(), manifest["tag"])
            or P.latest_reached(place, manifest))


def _reached(att: Attempt, manifest: dict) -> bool:
    try:
        return P.latest_reached(att.home, manifest, strict=True)
    except OSError:  # no answer: once the storage answers, a scan may find the group
        return False


def take_back(att: Attempt, exc: BaseException) -> None:
    """Unpublish the group ``att`` just published, whose commit fails with ``exc``: in place its
    manifest goes (the group is incomplete, and its next save is written in place); a re-save is
    swapped back out, the group it replaced published again at its home, and the new attempt beside
    it loses its manifest. ``exc`` gets a note saying which happened."""
    try:
        if att.staged:
            att.home.swap(att.place)
            att.place.delete(P.GROUP_MANIFEST)
        else:
            att.home.delete(P.GROUP_MANIFEST)
    except OSError as why:
        exc.add_note(f"fastckpt could not take the group's manifest back ({why}): until it goes, latest() may find "
                     f"{att.home.label} although this commit failed. Delete {att.home.url(P.GROUP_MANIFEST)}, or "
                     "save the group again")
        return
    exc.add_note(f"{att.home.label} was taken back, so that latest() does not find it: "
                 + ("the save it replaced is published there again" if att.staged else "it is incomplete")
                 + "; its next save commits it")
