"""Without a store: who ends an attempt, decided once (the storage fallback's ``compare_set``).

Rank 0 claims its attempt right before the manifest goes. Another rank that waited for the
manifest in vain claims it first, if it can, before it reports the group not committed: a rank 0
that is only late then never publishes what that rank reported not committed (its next save of
the group, in place while the group is unpublished, would replace a file the late manifest names
with the old checksum). A rank that finds rank 0's claim waits once more for the manifest, or for
the failure rank 0 records when it cannot publish it.

The claim is the small file ``.fastckpt/claim-<attempt>.json``, created only if absent
(``Place.put_new``): on a file system a hard link of a complete temp file, on S3 a ``PutObject``
with ``If-None-Match: *``, so exactly one claimant wins and no reader sees it partial. Other
fsspec stores (and an S3-compatible store that ignores the header) check, then put: a rank
that gives up in the milliseconds between rank 0's check and its put fails although the group
is published. (With a store, ``store.Channel.claim`` decides the same in one ``compare_set``.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Container

from ..storage.places import Place
from . import protocol as P

RANK_0 = "rank 0"
REMOVED = "removed"  # the claim of a remover (``removal.py``): the group is deleted after it
log = logging.getLogger("fastckpt")


def claim_name(token: str | None) -> str:
    """The name of attempt ``token``'s claim in the marker directory."""
    return f"claim-{token}.json"


def claim_rel(token: str | None) -> str:
    return f"{P.MARKER_DIR}/{claim_name(token)}"


def claim(place: Place, token: str, who: str, why: str = "") -> dict:
    """Claim attempt ``token`` for ``who`` (``why``: how it ended, when not published); returns
    the claim that won: ``{"who": ..., "why": ...}``."""
    body = {"who": who, "why": why, "written_at": time.time()}
    found = place.put_new(claim_rel(token), json.dumps(body).encode())
    if found is None:
        return body
    try:
        return json.loads(found)
    except ValueError:  # put_new writes whole files: only a foreign one could be damaged
        return {"who": "?", "why": f"{place.url(claim_rel(token))} does not parse"}


def sweep(place: Place, token: str | None, listing: list[str]) -> None:
    """Rank 0, attempt ``token`` published in place: delete the claims of the attempts that ended
    unpublished before it (a group saved again after failed commits kept one claim per attempt;
    ``listing``: the marker directory's names, read after they ended). Best effort: a claim left
    behind is a few bytes that nothing reads again."""
    for name in listing:
        if name.startswith("claim-") and name.endswith(".json") and name != claim_name(token):
            try:
                place.delete(f"{P.MARKER_DIR}/{name}")
            except OSError as exc:
                log.warning("fastckpt: could not delete %s (%s); it is only a record of an attempt that "
                            "ended unpublished", place.url(f"{P.MARKER_DIR}/{name}"), exc)


def claimed(place: Place, token: str | None, listing: list[str]) -> dict | None:
    """The claim of attempt ``token`` other than rank 0's, if there is one (``listing``: the
    marker directory's names)."""
    if token is None or claim_name(token) not in listing:
        return None
    body = P.read_record(place, claim_rel(token))
    return body if body is not None and body.get("who") != RANK_0 else None


def note_held_up(exc: BaseException, seen: Container[int], world: int) -> None:
    """Rank 0, on an attempt a rank gave up on: note which ranks had not committed by then
    (``seen``: the ranks that had)."""
    if missing := [r for r in range(world) if r not in seen]:
        exc.add_note(f"ranks {missing} of {world} had not committed by then")


def gave_up_why(label: str, rank: int, waited_s: float) -> str:
    """Why an attempt ended when rank ``rank`` waited ``waited_s`` for rank 0's verdict in vain:
    what rank 0 and the other ranks raise (``CommitTimeoutError``)."""
    return (f"checkpoint group {label} not committed: rank {rank} gave up waiting {waited_s:.0f} s for rank 0 "
            "to publish it, and reported it not committed, so no rank publishes it. If rank 0 was only slow "
            "(see its log), raise commit_timeout_s; the previous checkpoint is intact.")


def claim_local(place: Place, rel: str, attempts: int = 5) -> bool:
    """Create the empty file ``rel`` (one directory deep) in the (local, POSIX) ``place``; False if
    it exists: one rank of a node wins (``attempt.publish_local``: it fetches the manifest).
    ``FileNotFoundError`` when the place itself is gone (it is never made again)."""
    path, ops = place.url(rel), place.target.ops
    for attempt in range(1, attempts + 1):
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(path))
            ops.close(ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:  # the place is gone, or a deletion pruned the emptied marker directory
            if attempt == attempts or not os.path.isdir(os.path.dirname(os.path.dirname(path))):
                raise
    return False
