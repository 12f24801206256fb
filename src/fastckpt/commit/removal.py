"""A group removed (``Checkpointer.remove``) while an attempt at it is being committed.

The remover ends the attempt before it deletes anything, unless rank 0 already claimed it to
publish it: then rank 0's manifest is waited for (up to ``commit_timeout_s``) and the group is
deleted after it. With a store that is ``store.Channel.cancel``. Without one it is the attempt's
claim file (``claim.py``), created for "removed" the same way: if the remover's claim wins, rank
0's loses and its commit fails with ``GroupRemovedError``; a claim rank 0 makes once the remover
deleted the group (its claim with it) finds the group's files gone, since rank 0 checks them
after it claimed (``attempt.via_storage``), and a deletion takes the files before the markers.
Before, rank 0 checked the files, another rank's ``remove()`` deleted them, and rank 0's claim and
manifest brought the directory back (on S3 nothing even noticed): a published group without
files, which ``latest`` named.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

from ..errors import CorruptCheckpointError, GroupRemovedError
from ..inflight import raise_as_write_error
from ..records import SaveRecord
from ..storage.types import BucketNotFoundError
from . import claim as C
from . import failures as E
from . import fallback as F
from . import protocol as P
from . import store as S
from .attempt import Attempt

log = logging.getLogger("fastckpt")


def drop_copies(att: Attempt, recs: list[SaveRecord]) -> None:
    """Replication dropped attempt ``att`` (coalescing: another rank's file, or one of this
    rank's, was superseded by a newer checkpoint), so it is never published: this rank's files
    of it already copied to their home (``recs``: this rank's saves into it) are deleted there,
    else they stayed for good beside the checkpoints retention counts. A file there that holds
    another save (a newer attempt's, at the same name) stays."""
    for r in recs:
        if r.durable_s is None:  # not copied: only its burst-buffer copy exists (keep_local counts it)
            continue
        rel = r.path[len(att.group):].lstrip("/")
        try:
            if (att.place.manifest(rel) or {}).get("checksum", {}).get("value") == r.checksum:
                att.place.delete(rel)
        except (OSError, ValueError, CorruptCheckpointError) as exc:
            if getattr(exc, "errno", None) != errno.ENOENT:  # gone: trimmed with its group (``F.overtaken``)
                log.warning("fastckpt: could not delete %s of the dropped group %s: %s", rel, att.group, exc)


def claim(att: Attempt, rank: int, timeout_s: float, stop: threading.Event) -> None:
    """Without a store: ``remove()`` on this rank ends ``att`` (running: this rank's marker names
    its attempt) before the group is deleted, or, if rank 0 claimed it first, waits until rank 0
    published it (or recorded its failure), at most ``timeout_s``."""
    token = att.token
    if token is None:  # this rank joined no attempt yet: rank 0 cannot publish one with its files
        return
    try:
        won = C.claim(att.place, token, C.REMOVED, f"rank {rank} removed the group")
    except OSError as exc:
        log.warning("fastckpt: could not end the commit of %s before removing it (%s); rank 0 may still "
                    "publish it", att.home.label, exc)
        return
    if won["who"] != C.RANK_0:
        return

    def ended() -> bool | None:
        try:
            m = P.read_group_manifest(att.home)
        except CorruptCheckpointError:
            m = None
        if m is not None and m.get("attempt") == token:
            return True
        outcome = P.read_record(att.place, P.OUTCOME)
        return True if outcome is not None and outcome.get("attempt") == token else None

    if F.poll(ended, time.monotonic() + timeout_s, stop) is None:
        log.warning("fastckpt: rank 0 claimed the commit of %s to publish it, but published nothing within %.0f s; "
                    "removing the group all the same", att.home.label, timeout_s)


def failure(att: Attempt, rank: int, exc: BaseException) -> BaseException:
    """What the handle of this rank's failed commit of ``att`` raises: ``exc``, or a
    GroupRemovedError when the group was removed meanwhile (its directory went while this
    rank wrote its marker, which is dropped), or an OSError as a CheckpointWriteError."""
    if isinstance(exc, GroupRemovedError) or (isinstance(exc, OSError) and removed(att, exc)):
        drop_marker(att, rank)
        if not isinstance(exc, GroupRemovedError):
            err = E.removed_error(att.home)
            err.__cause__ = exc
            return err
    elif isinstance(exc, OSError):
        try:
            raise_as_write_error(exc, att.group, where=att.group)
        except BaseException as err:  # noqa: BLE001 (it always raises: ``exc``, or the error naming the group)
            return err
    return exc


def failed(att: Attempt, rank: int, exc: BaseException, start: float, tier: str, emit: Callable[..., None],
           saved: bool = False) -> BaseException:
    """``failure``, emitted as the group ``commit`` event (one per rank, as a success is) for metrics and
    reports; not a save's error (``saved``: its own event counted it), unless it was the group's removal:
    that commit's end is an ``uncommitted`` event (its ``committing`` one counts it as running until then)."""
    err = failure(att, rank, exc)
    if not saved or isinstance(err, GroupRemovedError):
        emit("commit", att.group, 0, start, tier, err, detail="group")
    else:
        emit("uncommitted", att.group, 0, start, tier, detail="group: a save of it failed")
    return err


def removed(att: Attempt, exc: OSError) -> bool:
    """Whether ``exc`` (this rank's commit failed on storage) is the group being removed:
    the store says so, or, without one, the group's own directory (or a file of it) vanished
    (nothing else deletes them). A missing bucket carries ENOENT too, but it is a wrong URL (or a
    deleted bucket), never the group's removal: its own error names the fix."""
    if att.cancel.is_set():
        return True
    if att.channel is None:
        return exc.errno == errno.ENOENT and not isinstance(exc, BucketNotFoundError)
    try:
        return att.channel.removed()
    except S.StoreError:
        return False


def drop_marker(att: Attempt, rank: int) -> None:
    """A cancelled attempt leaves nothing behind: a marker written after the group was
    deleted would bring its directory back, and so does rank 0's claim (without a store)."""
    rels = [P.marker_rel(rank)]
    if rank == 0 and att.channel is None and att.token is not None:
        rels.append(C.claim_rel(att.token))
    for rel in rels:
        try:
            att.place.delete(rel)
        except OSError as exc:
            log.warning("fastckpt: could not remove %s of removed group %s: %s", rel, att.home.label, exc)
