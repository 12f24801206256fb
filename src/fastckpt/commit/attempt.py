"""One attempt at a group, on one rank: what it is (``Attempt``), and the two ways its commit
runs once the rank's files are durable: through the store (``via_store``, ``store.py``) or
through marker files (``via_storage``, ``fallback.py``); rank 0 publishes (``publish``: in place,
or swapped in by ``resave.py``), and with ``local_dir`` every rank publishes the burst-buffer
copy's manifest (``publish_local``). ``coordinator.py`` runs these on the committer pool.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import CheckpointWriteError, CommitTimeoutError, GroupRemovedError
from ..io import atomic
from ..records import SaveHandle, SaveRecord
from ..storage.places import Place
from . import claim as C
from . import failures as E
from . import fallback as F
from . import pairing as G
from . import protocol as P
from . import resave
from . import store as S
from .pointing import move_latest, publish_manifest
from .verdict import manifest_of, verdict

log = logging.getLogger("fastckpt")
LOCAL_WAIT_S = 10.0  # how long a rank waits for its node's copy of a manifest before reading it itself


def grace(timeout_s: float) -> float:
    """How much longer than rank 0 the others wait: rank 0's verdict (naming who is missing) comes first."""
    return min(30.0, max(1.0, 0.1 * timeout_s))


@dataclass
class Attempt:
    """This rank's part of one attempt at a group.

    ``home`` is the group's place; ``place`` is where this attempt's files, markers and records
    go (``home``, or ``protocol.staged_place(home, old)`` for a re-save of a published group, then
    ``old`` is the manifest it replaces, ``resave.stand_in`` for a tag DeepSpeed saved).
    ``channel`` is the attempt's store keys (None: the
    storage fallback). ``token`` names the attempt (None on other ranks without a store until
    they join rank 0's: ``fallback.own_attempt`` says which, from ``began``, what such a rank saw
    of rank 0's attempts when it began); ``replaced``, on rank 0, the attempt id ``attempt.json``
    held before this attempt's. ``cancel`` is set by ``remove()``; ``move_latest=False``
    (``commit``'s) publishes the group without moving ``latest``.
    """

    group: str
    home: Place
    place: Place
    local: tuple[Place, ...]  # the burst-buffer copies (one per local_dir directory)
    channel: S.Channel | None
    token: str | None
    old: dict | None
    move_latest: bool = True
    cancel: threading.Event = field(default_factory=threading.Event)
    handles: list[SaveHandle] = field(default_factory=list)
    replaced: str | None = None
    began: F.Began | None = None  # other ranks without a store
    since: float = 0.0  # rank 0 without a store: when its Checkpointer was made (``fallback._failed_in``)
    steps: dict = field(default_factory=dict)  # this commit's step and this rank's previous one (``pairing.py``)

    @property
    def staged(self) -> bool:
        return self.place.key != self.home.key

    def home_path(self, path: str) -> str:
        """Where ``path`` (a file of the group) is written at its home in this attempt."""
        return self.place.url(path[len(self.group):].lstrip("/")) if self.staged else path


@dataclass(frozen=True)
class Ended:
    """How an attempt ended on this rank: the manifest (rank 0, or read by others), the group's
    total bytes, and whether replication's coalescing dropped it."""

    manifest: dict | None
    total: int
    superseded: bool = False


def records(handles: list[SaveHandle]) -> list[SaveRecord]:
    """The records of an attempt's saves, waited for in order; a failure is raised. A path saved
    more than once in the attempt counts its last save: an earlier one that failed is excused
    (its error is raised to the user once, by its handle or the next sync point), since the
    later save's file replaced it (one writer thread per drive writes a path's saves in order,
    and the replicator uploads them in order)."""
    last = {h.path: h for h in handles}
    recs = []
    for h in handles:
        if last[h.path] is h:
            recs.append(h.result())
            continue
        try:
            h.result()
        except Exception:  # noqa: BLE001 (saved again since: see above)
            log.debug("fastckpt: a failed save of %s was saved again in the same attempt", h.path)
    return recs


def publish(att: Attempt, world: int, entries: dict[int, dict], extra: dict, requested_at: float,
            check_sizes: bool, last_check: Callable[[], None] = lambda: None) -> dict:
    """Rank 0: the manifest of this attempt, published (in place, or swapped in), then ``latest``
    moved to it (unless ``att.move_latest`` is False; ``pointing.py``). A re-save's replaced attempt
    is deleted after that, once the other ranks were told (``cleared``). ``last_check`` runs
    before the files are checked and the manifest goes (without a store it claims the attempt,
    ``removal.py``), and raises to keep the manifest from going."""
    recorded = extra if att.move_latest else {**extra, "moved_latest": False}  # see protocol.never_latest
    last_check()
    manifest = P.build_manifest(att.home, world, entries, recorded, requested_at, att.token, check_sizes,
                                files_at=att.place)
    publish_manifest(att, manifest)  # stands when only the step after its rename failed
    if att.move_latest:
        move_latest(att, manifest)  # taken back when it fails, unless latest names it anyway
    return manifest


def via_store(att: Attempt, ch: S.Channel, rank: int, world: int, files: dict, superseded: bool, extra: dict,
              requested_at: float, timeout_s: float, stop: threading.Event) -> Ended:
    """The commit through the store (``store.py``), on this rank: the session is agreed first
    (``session.py``; at once after the first commit), within the commit's own deadline."""
    waited_s = timeout_s if rank == 0 else timeout_s + grace(timeout_s)
    deadline = time.monotonic() + waited_s
    if not ch.join(deadline, stop):  # only another rank, stopped by close(): rank 0 always knows its own
        raise CommitTimeoutError(f"checkpoint group {att.home.label}: closed before rank 0 said which session "
                                 "of the store the group commits use; the group stays incomplete")
    att.token = ch.token
    ch.announce(rank, {"files": files, "superseded": superseded, "place": att.place.key, **att.steps})
    if rank != 0:
        said = verdict(att, ch, rank, files, deadline, stop, waited_s)
        kind, _, rest = said.partition(":")
        if kind == S.PUBLISHED:
            return Ended(None, int(rest or 0))
        if kind == S.SUPERSEDED:
            return Ended(None, 0, superseded=True)
        if kind == S.REMOVED:
            raise E.removed_error(att.home)
        if kind == S.ABORTED:
            raise E.aborted_error(att.home.label, rest)
        if kind == G.REFUSED:  # the ranks' steps differed
            raise G.heard(rest)
        raise CommitTimeoutError(rest)
    entries = ch.gather(deadline, stop)  # at once when some rank never joined the session by then
    if entries is None:
        present = ch.entries()
        err = E.not_committed(att.home, [r for r in range(world) if r not in present], world, timeout_s, ch.remade())
        ch.tell(f"{S.FAILED}:{err}")
        for r, e in present.items():  # the crash trail: who did commit (readers name the others)
            P.write_marker(att.place, r, world, e["files"], att.token, bool(e.get("superseded")))
        raise err
    if (apart := _elsewhere(att, entries)) and ch.abort(0, apart):  # nothing of it is published
        raise E.aborted_error(att.home.label, f"rank 0: {apart}")
    if err := G.refuse_via_store(ch, entries, att.home.label):  # its ranks' files are not of one save
        raise err
    won = ch.claim("rank 0")
    if won != "rank 0":
        ch.tell(None)
        if won.startswith(S.ABORTED + ":"):
            raise E.aborted_error(att.home.label, won.partition(":")[2])
        if won.startswith(S.FAILED + ":"):  # a rank gave up waiting (``verdict``)
            err = CommitTimeoutError(won.partition(":")[2])
            C.note_held_up(err, entries, world)
            raise err
        raise E.removed_error(att.home)
    if any(e.get("superseded") for e in entries.values()):
        ch.tell(S.SUPERSEDED)
        return Ended(None, 0, superseded=True)
    try:
        manifest = publish(att, world, entries, extra, requested_at, check_sizes=False)
    except BaseException as exc:
        ch.tell(f"{S.FAILED}:checkpoint group {att.home.label} not committed: rank 0 could not publish it: {exc}")
        raise
    total = sum(f["size"] for f in manifest["files"].values())
    try:
        ch.tell(f"{S.PUBLISHED}:{total}")
    except S.StoreError as exc:  # published (and latest moved): the others read it from the manifest (``verdict``)
        log.warning("fastckpt: checkpoint group %s is published, but the torch.distributed store stopped answering "
                    "(%s) before the other ranks were told; they learn the outcome from the group's manifest",
                    att.home.label, exc.__cause__ or exc)
    return cleared(att, Ended(manifest, total))


def _elsewhere(att: Attempt, entries: dict[int, dict]) -> str | None:
    """Rank 0: why the attempt cannot be published, if a rank wrote it elsewhere than rank 0 (in
    place, or beside the published group): each rank decides at its first save (``coordinator.begin``)."""
    apart = sorted(r for r, e in entries.items() if e.get("place", att.place.key) != att.place.key)
    if not apart:
        return None
    return (f"ranks {apart} wrote this attempt to {att.home.target.url_of(entries[apart[0]]['place'])}, rank 0 to "
            f"{att.place.label}: the group was removed (retention: keep_persistent; or remove()) or published "
            "after some ranks had begun saving into it, so they disagree on where it lives, and nothing of it "
            "is published. Its next save on every rank starts from one state and commits")


def via_storage(att: Attempt, rank: int, world: int, files: dict, superseded: bool, extra: dict,
                requested_at: float, timeout_s: float, stop: threading.Event) -> Ended:
    """The commit through marker files (``fallback.py``), on this rank."""
    if rank != 0:
        began = att.began or F.Began()
        ended = P.read_record(att.place, P.OUTCOME) or {}
        if began.running is not None and ended.get("attempt") == began.running:  # ended while this rank wrote
            if ended.get("outcome") == F.ABORTED:
                raise E.aborted_error(att.home.label, str(ended.get("why")))
            if ended.get("outcome") == "superseded":
                return Ended(None, 0, superseded=True)  # another rank's file was dropped: so is this attempt
            F.own_attempt(att.place, rank, began, att.home)  # raises, naming the newer attempt if rank 0 began one
            raise E.left_behind(att.home, rank, None, str(ended.get("outcome")))
        att.token = F.own_attempt(att.place, rank, began, att.home)  # before the marker: a newer attempt never gets it

        def restamp(aid: str) -> None:
            att.token = aid
            P.write_marker(att.place, rank, world, files, aid, superseded, att.steps)

        P.write_marker(att.place, rank, world, files, att.token, superseded, att.steps)
        if _files_gone(att, files):  # another rank's remove() took the group before the marker, which
            raise E.removed_error(att.home)  # brought the directory back: the coordinator deletes it again
        m = F.wait_for_manifest(att.home, timeout_s + grace(timeout_s), stop, att.token, files, me=rank,
                                restamp=restamp, cancel=att.cancel, records=att.place, began=began)
        if m.get("superseded"):
            return Ended(None, 0, superseded=True)
        if m.get("trimmed"):  # published, then trimmed by rank 0's keep_persistent before this rank read it
            return Ended(None, m["total"])
        return Ended(m, sum(f["size"] for f in m["files"].values()))
    P.write_marker(att.place, rank, world, files, att.token, superseded, att.steps)
    # recorded: another rank's remove() deletes attempt.json with the group, even before this marker
    with _recorded(att):
        markers = F.wait_for_markers(att.place, world, timeout_s, stop, att.token, me=rank, cancel=att.cancel,
                                     replaced=att.replaced, recorded=world > 1 and att.token is not None,
                                     since=att.since, home=att.home)
    if err := G.refused_record(att.place, att.token, markers, att.home.label, att.replaced):  # not of one save
        raise err
    if any(m.get("superseded") for m in markers.values()):
        P.write_record(att.place, P.OUTCOME, attempt=att.token, outcome="superseded", replaced=att.replaced)
        return Ended(None, 0, superseded=True)

    listing: list[str] = []  # the marker directory's names, read by last_check
    claimed: list[bool] = []  # rank 0 won the attempt's claim: its failure is the attempt's outcome

    def last_check() -> None:  # a rank that gave up (or failed) since its marker came: not published
        if world > 1 and att.token is not None:
            with _recorded(att):
                listing[:] = att.place.names(P.MARKER_DIR)
                F.check_failures(att.place, att.token, att.replaced, listing, att.since, att.home)
                won = C.claim(att.place, att.token, C.RANK_0)
                if won["who"] == C.REMOVED:  # another rank's remove() came first: it deletes the group
                    raise E.removed_error(att.home)
                if won["who"] != C.RANK_0:
                    raise CommitTimeoutError(str(won.get("why")))
                claimed.append(True)

    try:
        manifest = publish(att, world, markers, extra, requested_at, check_sizes=True, last_check=last_check)
    except Exception as exc:  # claimed, then a file did not match or the storage failed: the others stop waiting
        if claimed and not isinstance(exc, GroupRemovedError):
            try:  # (else they wait for the manifest the claim promised, a second commit_timeout_s)
                P.write_record(att.place, P.OUTCOME, attempt=att.token, outcome=str(exc), replaced=att.replaced)
            except OSError as why:
                exc.add_note(f"the other ranks were not told, and wait commit_timeout_s for it: {why}")
        raise
    if listing and not att.staged:  # a re-save's swap keeps only its own claim
        C.sweep(att.place, att.token, listing)  # claims of earlier attempts were all there by then
    return cleared(att, Ended(manifest, sum(f["size"] for f in manifest["files"].values())))


@contextlib.contextmanager
def _recorded(att: Attempt) -> Iterator[None]:
    """Rank 0 without a store: an attempt that ends here unpublished is recorded in its outcome
    (``fallback.py``), so that the other ranks stop waiting for it."""
    try:
        yield
    except CommitTimeoutError as exc:
        P.write_record(att.place, P.OUTCOME, attempt=att.token, outcome=str(exc), replaced=att.replaced)
        raise
    except CheckpointWriteError as exc:  # a rank's save failed: the others stop waiting too
        F.record_aborted(att.place, att.token, getattr(exc, "why", str(exc)), att.replaced)
        raise


def cleared(att: Attempt, ended: Ended) -> Ended:
    """Rank 0, a re-save published (the other ranks know, ``latest`` moved): delete the attempt
    it replaced (``resave.clear``; a failure only warns)."""
    if att.staged and ended.manifest is not None:
        resave.clear(att.home, att.place, ended.manifest)
    return ended


def _files_gone(att: Attempt, files: dict) -> bool:
    """Whether a file this rank committed is no longer in the group: only ``remove()`` deletes
    them. (A rank's own marker vanishing says the same, but a marker written after the group
    went brings the directory back instead.)"""
    return any(att.place.size(rel) < 0 for rel in files)


def publish_local(att: Attempt, local: Place, manifest: dict | None, stop: threading.Event) -> None:
    """The burst-buffer copy of this rank's files is complete: give it the group's manifest.

    Ranks on one node share the burst buffer. Of the ranks that do not hold the manifest (all
    but rank 0 with a store), the first to create ``.fastckpt/fetch-<attempt>`` there reads it
    from the home and puts it in the burst buffer; the others wait for it (up to
    ``LOCAL_WAIT_S``, then read it themselves): one read per node, not per rank.

    Nothing here creates the copy's directory: another rank of this node may have trimmed it
    (``keep_local``, once a later group was durable) while this one waited. Then this raises
    ``FileNotFoundError``, and the group stays what it is, published at its home.
    """
    if manifest is None:
        if not C.claim_local(local, f"{P.MARKER_DIR}/fetch-{att.token}"):  # another rank of this node fetches it
            F.poll(lambda: True if local.size(P.GROUP_MANIFEST) >= 0 else None, time.monotonic() + LOCAL_WAIT_S,
                   stop)  # a stat per poll: the manifest is parsed once, when it is there
            if manifest_of(local, att.token) is not None:
                return
        manifest = P.read_group_manifest(att.home)
        if manifest is None or manifest.get("attempt") != att.token:
            return  # a newer attempt already replaced it (or it was removed): nothing to vouch for
    # the claim stays (deleting it races the others); no makedirs: a trimmed copy is not brought back
    atomic.publish_bytes(local.target.ops, local.url(P.GROUP_MANIFEST), P.manifest_bytes(manifest))
