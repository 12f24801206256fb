"""Group commits without a store: rank markers in the group's directory, polled with backoff.

The fallback for launches without torch.distributed (``protocol.py`` has the files). Attempts
are told apart by an id, not by age: rank 0 picks a random one when it starts an attempt and
writes it to ``.fastckpt/attempt.json``, with the id it replaced and its session (one random id
per Checkpointer); every other rank echoes the id in its marker. Rank 0 publishes only when
every rank's marker carries its id, so a dead rank's leftover marker never counts, and the
manifest names the files of this attempt only.

Which attempt a rank's files are for is fixed when it begins (its first save into the group,
``began``): the one running then, or, when none ran, the first that replaces the one recorded
then. While it waits it writes its marker again when that attempt appears (it may have read
the record of an earlier attempt before rank 0 started it), and for no other: a newer attempt
means that rank 0 gave up on this rank's (a timeout, a failed save) or was restarted, and the
rank's old files must not complete it, or the group would mix two saves. The rank fails instead
(``own_attempt``, ``left_behind``), and the newer attempt waits for its next save. Only an
attempt recorded before the rank's Checkpointer was made (by the record's wall-clock time) and
replaced by a rank 0 of another session was a dead job's leftover, not the rank's: the
replacing one is (a resumed job whose rank 1 begins before its rank 0). A rank whose commit
failed remembers that attempt (``Coordinator``), so its next save joins rank 0's retry rather
than the attempt it left.

An attempt that ends without a manifest (dropped by replication's coalescing, or failed) is
recorded in ``.fastckpt/outcome.json`` so the other ranks stop waiting. A rank whose own marker
vanished learns that rank 0 published the group and retention trimmed it (``trimmed.py``), or,
without retention's record of that, that it was removed. A rank whose save failed leaves a
failure record for rank 0's current attempt, or, before rank 0 started it, for the one that
replaces the attempt recorded then (``protocol.write_failure``): rank 0 ends the attempt on it
and records an "aborted" outcome. Such a record written before rank 0's Checkpointer was made
(by its time) is a dead job's, not a peer's, and ends nothing, though a restarted job's first
attempt replaces the same id as the dead job's would have (none, in a new group): ``_failed_in``.
Each poll of rank 0 lists the marker directory once and reads only markers it has not
accepted yet (and any failure records): O(W) reads per commit, plus one listing per poll.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CommitTimeoutError
from ..storage.places import Place
from . import claim as C
from . import protocol as P
from . import trimmed as T
from .failures import aborted_error, left_behind, not_committed, removed_error, vanished_error
from .pairing import REFUSED, refusal
from .pointing import moved

ABORTED = "aborted"  # the outcome of an attempt that a rank's failed save ended
POLL_FIRST_S, POLL_MAX_S = 0.005, 0.5


def poll(until: Callable[[], object], deadline: float, stop: threading.Event) -> object:
    """Call ``until`` with backoff until it returns something other than None; None on timeout."""
    delay = POLL_FIRST_S
    while True:
        got = until()
        if got is not None:
            return got
        if time.monotonic() >= deadline or stop.is_set():
            return None
        stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, POLL_MAX_S)


def record_aborted(place: Place, token: str | None, why: str, replaced: str | None = None) -> None:
    """Rank 0: attempt ``token`` (which replaced attempt ``replaced``) ended because a save
    failed (``why``: which rank, and its error); the ranks polling for the manifest raise
    ``aborted_error`` on it."""
    P.write_record(place, P.OUTCOME, attempt=token, outcome=ABORTED, why=why, replaced=replaced)


def wait_for_markers(place: Place, world_size: int, timeout_s: float, stop: threading.Event,
                     token: str | None = None, me: int | None = None,
                     cancel: threading.Event | None = None, replaced: str | None = None,
                     recorded: bool = False, since: float = 0.0, home: Place | None = None) -> dict[int, dict]:
    """Rank 0: every rank's marker of attempt ``token`` (or one that dropped it).

    Args:
        me: this rank, whose own marker vanishing means the group was removed.
        cancel: set by ``remove()`` on this rank.
        recorded: this attempt is in ``attempt.json``, which vanishing also means the group was
            removed (another rank's ``remove()`` may have run before this rank's marker was
            written, and the marker brought the directory back).
        replaced: the attempt id ``attempt.json`` held before ``token``'s: a failure record
            written before this attempt started, while that one was recorded, is this attempt's.
        since: when rank 0's Checkpointer was made: such a record written before it is a dead job's.
        home: the group, which errors name (``place`` is its re-save directory when it is staged).

    Raises:
        CommitTimeoutError: naming the ranks that never committed.
        CheckpointWriteError: a rank's save into this attempt failed (``protocol.write_failure``).
        GroupRemovedError: the group was removed meanwhile.
    """
    seen: dict[int, dict] = {}
    group = home or place

    def ready() -> dict[int, dict] | None:
        if cancel is not None and cancel.is_set():
            raise removed_error(group)
        listing = place.names(P.MARKER_DIR)
        names = P.marker_ranks(place, listing)
        if (me is not None and me not in names) or (recorded and P.ATTEMPT_NAME not in listing):
            raise removed_error(group)
        for rank, rel in names.items():
            if rank not in seen:
                m = P.read_marker(place, rel)
                if m is not None and m["world_size"] == world_size and m.get("attempt") == token:
                    seen[rank] = m
        check_failures(place, token, replaced, listing, since, group)  # after the markers: errors name who is missing
        done = all(r in seen for r in range(world_size)) or any(m.get("superseded") for m in seen.values())
        return dict(seen) if done else None

    try:
        got = poll(ready, time.monotonic() + timeout_s, stop)
    except CommitTimeoutError as exc:  # a rank gave up waiting (``check_failures``)
        C.note_held_up(exc, seen, world_size)
        raise
    if got is None:
        raise not_committed(group, [r for r in range(world_size) if r not in seen], world_size, timeout_s)
    return got  # type: ignore[return-value]


def check_failures(place: Place, token: str | None, replaced: str | None, listing: list[str], since: float = 0.0,
                   home: Place | None = None) -> None:
    """Rank 0: raise if a rank ended attempt ``token``: with a failure record, its save failed
    (``CheckpointWriteError``); with a claim (``claim.py``), it gave up waiting for the manifest
    (``CommitTimeoutError``), or it removed the group (``GroupRemovedError``). ``listing``: the
    marker directory's names; ``replaced``, ``since`` and ``home``: as for ``wait_for_markers``."""
    group = home or place
    for rank, rel in P.failure_ranks(listing).items():  # none, unless a save failed
        failed = P.read_record(place, rel)
        if failed is not None and _failed_in(failed, token, replaced, since):
            raise aborted_error(group.label, f"rank {rank}: {failed.get('why')}")
    if (won := C.claimed(place, token, listing)) is not None:
        if won.get("who") == C.REMOVED:  # another rank's remove() (``removal.py``)
            raise removed_error(group)
        raise CommitTimeoutError(str(won.get("why")))


def _failed_in(failed: dict, token: str | None, replaced: str | None, since: float = 0.0) -> bool:
    """Whether a failure record belongs to attempt ``token``: it names it, or it was written
    before rank 0 started it (no running attempt) while ``attempt.json`` still held ``replaced``,
    and not before rank 0's Checkpointer was made (``since``; the writer's clock against rank 0's,
    as for ``Began.stale``): that one is a dead job's. A record naming an earlier attempt, running
    then, is that attempt's."""
    return failed.get("attempt") == token or (
        failed.get("attempt") is None and "seen" in failed and failed["seen"] == replaced
        and float(failed.get("written_at", since)) >= since)


def current_attempt(place: Place) -> str | None:
    """The attempt rank 0 is running at ``place``, as far as this rank can tell: the id in ``attempt.json``,
    unless ``outcome.json`` says that attempt already ended (then None: rank 0 will start the next one)."""
    return attempt_ids(place)[1]


def attempt_ids(place: Place) -> tuple[str | None, str | None]:
    """(the id in ``attempt.json``, ended or not; ``current_attempt``), from one read of each."""
    current = P.read_record(place, P.ATTEMPT)
    if current is None:
        return None, None
    ended = P.read_record(place, P.OUTCOME)
    aid = current.get("attempt")
    return aid, None if ended is not None and ended.get("attempt") == aid else aid


@dataclass(frozen=True)
class Began:
    """What a rank other than 0 saw of rank 0's attempts at its first save into a group (no
    store): ``own_attempt`` tells from it which attempt its files are for.

    ``seen`` is the id ``attempt.json`` held (None: there was none). ``running`` is that attempt,
    if it ran then (no outcome names it) and was not one this rank had given up (its commit of
    it failed): this rank's files are for it. ``stale`` is that attempt's rank-0 session ("" in a
    record without one), if its record is older than this rank's Checkpointer: then it may be
    what a job that died left behind, which a restarted rank 0 (another session) replaces.
    """

    seen: str | None = None
    running: str | None = None
    stale: str | None = None


def began(place: Place, born: float, given_up: str | None = None) -> Began:
    """A rank other than 0 begins an attempt at ``place``: what it sees (``Began``). ``born``:
    when its Checkpointer was made; ``given_up``: the attempt its last commit here failed in."""
    rec = P.read_record(place, P.ATTEMPT)
    if rec is None:
        return Began()
    aid = rec.get("attempt")
    ended = P.read_record(place, P.OUTCOME)
    if aid == given_up or (ended is not None and ended.get("attempt") == aid):
        return Began(aid)
    stale = str(rec.get("session", "")) if float(rec.get("written_at", 0.0)) < born else None
    return Began(aid, aid, stale)


def own_attempt(place: Place, me: int | None, began: Began, home: Place | None = None) -> str | None:
    """Other ranks: the attempt rank 0 runs now at ``place`` (the records of the group ``home``,
    default ``place``), if this rank's files are for it; None while there is none (not started
    yet, or ended: its outcome says how).

    The files are for the attempt that ran when this rank began (``began.running``), or, when
    none ran, for the first one rank 0 starts after the one recorded then (each ``attempt.json``
    names the id it replaced). A rank 0 that started another attempt instead gave up on this
    rank's or restarted: this rank was left behind, and joining the newer attempt would publish
    its old files with rank 0's new ones. The one exception is an attempt recorded before this
    rank's Checkpointer was made (``began.stale``) that a rank 0 of another session replaced:
    it was a dead job's leftover, and the new rank 0's attempt is this rank's.

    Raises:
        CommitTimeoutError: this rank was left behind (``left_behind``).
    """
    rec = P.read_record(place, P.ATTEMPT)
    if rec is None:
        return None
    aid = rec.get("attempt")
    ended = P.read_record(place, P.OUTCOME)
    now = None if ended is not None and ended.get("attempt") == aid else aid
    if aid == began.running:
        return now
    if aid == began.seen:  # ended, or given up by this rank: the next one is this rank's
        return None
    if "replaced" not in rec:  # written by a fastckpt that did not record it: joined, as before
        return now
    if began.running is None and rec["replaced"] == began.seen:
        return now
    if began.stale is not None and rec["replaced"] == began.running and rec.get("session") != began.stale:
        return now
    raise left_behind(home or place, me, aid)


def _outcome_of(ended: dict, token: str | None, began: Began | None) -> bool:
    """Whether an outcome record is of this rank's attempt: it names ``token``, or, while this
    rank has joined none, the attempt that ran when it began, or the one that replaced the
    attempt recorded then (it began before rank 0 started one)."""
    if ended.get("attempt") == token:
        return True
    if token is not None or began is None:
        return False
    return ended.get("attempt") == began.running or ("replaced" in ended and ended["replaced"] == began.seen)


def wait_for_manifest(place: Place, timeout_s: float, stop: threading.Event, token: str | None = None,
                      mine: dict | None = None, me: int | None = None,
                      restamp: Callable[[str], None] | None = None, cancel: threading.Event | None = None,
                      records: Place | None = None, began: Began | None = None) -> dict:
    """Other ranks: the manifest at ``place`` of this rank's attempt, listing its files with the
    checksums just written, or the attempt's recorded outcome (``{"superseded": True}``), or
    retention's record that rank 0 trimmed it once published (``overtaken``).

    Args:
        token: the attempt id this rank's marker carries.
        me, cancel: as for ``wait_for_markers``.
        restamp: called with rank 0's current attempt id when it differs from ``token`` and
            is this rank's (``own_attempt``, given ``began``; else ``current_attempt``): this
            rank writes its marker again with it.
        records: where this attempt's markers and records are, when not at ``place`` (a
            re-saved group's new attempt is written beside it until rank 0 swaps it in).
        began: what this rank saw when it began (``Began``).

    Raises:
        CommitTimeoutError: no manifest or outcome within ``timeout_s``, the outcome records a
            failure, or rank 0 moved on to a newer attempt without this rank (``left_behind``).
        GroupRemovedError: the group was removed meanwhile (``vanished_error``: not by retention).
    """
    state = {"token": token}
    rec = records or place

    def out() -> dict | None:
        m = P.read_group_manifest(place)
        if m is not None and m.get("attempt") == state["token"] and all(
                m["files"].get(rel, {}).get("checksum") == info["checksum"] for rel, info in (mine or {}).items()):
            return m
        return None

    def published(m: dict | None) -> dict | None:  # and ``latest`` moved (rank 0 takes it back if that fails)
        return m if m is not None and moved(place, m) else None

    def ended() -> dict | None:
        """The attempt's recorded outcome (raised when it failed)."""
        got = P.read_record(rec, P.OUTCOME)
        if got is not None and _outcome_of(got, state["token"], began):
            if got.get("outcome") == "superseded":
                return {"superseded": True, "files": {}}
            if got.get("outcome") == ABORTED:
                raise aborted_error(place.label, str(got.get("why")))
            if got.get("outcome") == REFUSED:  # the ranks' steps differed (``pairing.py``)
                raise refusal(str(got.get("why")), got.get("behind", []))
            raise CommitTimeoutError(str(got.get("outcome")))
        return None

    def settled() -> dict | None:
        """The attempt's manifest with ``latest`` moved to it, or its recorded outcome."""
        return published(out()) or ended()

    def ready() -> dict | None:
        if cancel is not None and cancel.is_set():
            raise removed_error(place)
        if (m := out()) is not None:  # published: rank 0 moves ``latest`` next, unless it ended
            return published(m) or ended()
        if (m := ended()) is not None:
            return m
        if restamp is not None:
            try:
                current = own_attempt(rec, me, began, place) if began is not None else current_attempt(rec)
            except CommitTimeoutError:
                if (m := out()) is not None:  # swapped in meanwhile: ``rec`` holds the old group
                    return published(m)
                raise
            own = rec.get(P.marker_rel(me)) if me is not None else b""
            if (m := out()) is not None:  # swapped in since the first read: ``rec`` now holds the old group
                return published(m)
            if own is None:
                return overtaken(place, state["token"])
            if current is not None and current != state["token"]:
                state["token"] = current
                restamp(current)
        return None

    got = poll(ready, time.monotonic() + timeout_s, stop)
    if got is None and T.find(place, state["token"]) is not None:  # trimmed since the last poll: no claim
        got = overtaken(place, state["token"])  # (it would bring the directory back)
    if got is None:
        err = CommitTimeoutError(
            f"checkpoint group {place.label}: rank 0 did not publish {P.GROUP_MANIFEST} and move latest to it "
            f"within {timeout_s:.0f} s; some rank did not commit, or rank 0 died (see rank 0's error).")
        if me is not None and state["token"] is not None:  # a late rank 0 must not publish it (``claim.py``)
            try:
                won = C.claim(rec, state["token"], f"rank {me}", C.gave_up_why(place.label, me, timeout_s))
            except OSError as exc:
                err.add_note(f"rank 0 was not told, and may still publish it: {exc}")
                raise err from exc
            if won["who"] == C.REMOVED:
                raise removed_error(place)
            if won["who"] == C.RANK_0:  # rank 0 is publishing it: the manifest follows, or its failure
                if (m := poll(settled, time.monotonic() + timeout_s, stop)) is not None:
                    return m  # type: ignore[return-value]
                err.add_note("rank 0 claimed the attempt to publish it, but its manifest did not follow")
        raise err
    return got  # type: ignore[return-value]


def overtaken(place: Place, token: str | None) -> dict:
    """Other ranks: the group ``place`` vanished while this rank waited for the manifest of its
    attempt ``token``. When retention recorded that rank 0 trimmed it after publishing that attempt
    (``trimmed.py``: keep_persistent, once a later group was committed, of any step or none, before
    this rank's poll read the manifest), the commit is done, as on rank 0: ``{"trimmed": True,
    "total": bytes}``. Else it was removed: GroupRemovedError (``vanished_error``)."""
    if (done := T.find(place, token)) is None:
        raise vanished_error(place)
    return {"trimmed": True, "total": int(done["total"]), "files": {}}
