"""Group commits: several files from one or many ranks become one checkpoint.

Calls, all on the training thread: ``begin`` (first save into a group by this rank in this
attempt), ``add``/``skipped``/``failed`` (each save), ``commit`` (every rank, once per attempt),
``cancel`` (``Checkpointer.remove`` of the group), ``close`` (``Checkpointer.close``: the attempts
this rank began and never committed end on every rank; ``tell.py`` tells the others). The work of
a commit runs on the committer pool:

  every rank   wait for its saves (and their replication)
  with a store (``store.py``): announce its files there; rank 0 waits for all W, publishes the
               manifest and moves ``latest``, then announces the outcome the others wait for
               (rank 0 writes the markers of the ranks that committed only if it fails)
  without one (``fallback.py``): each rank writes its marker; rank 0 polls the markers of its
               attempt and publishes; the other ranks poll for the manifest
  every rank   with ``local_dir``: publish the burst-buffer copy's manifest too, so that loads
               of the group's files read the local copy
``attempt.py`` holds the work of one attempt on one rank.

``begin`` decides where the attempt writes: in place, or, when the group is already published,
beside it (``resave.py``), so that a new attempt never unpublishes the old one.

A file of the attempt whose save did not happen (it raised on the training thread, or
``when_busy='skip'`` skipped it) is marked: ``commit`` then ends the attempt on every rank and
raises, naming it, instead of publishing the group without it. A later save of the same path
that succeeds in the same attempt clears the mark (and one whose write failed in the background
no longer counts once the same path is saved again): the group commits with the good file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, Future

from ..config import CheckpointerConfig
from ..errors import refused_once_closed
from ..records import SaveHandle, SaveRecord
from ..storage.places import Place
from . import attempt as A
from . import failures as E
from . import fallback as F
from . import leftovers as L
from . import owners as O
from . import pairing as G
from . import protocol as P
from . import removal as R
from . import resave
from . import store as S
from . import tell as T

log = logging.getLogger("fastckpt")

class Coordinator:
    """This rank's attempts at groups, and their commits on the committer pool.

    Args:
        pool: the committer threads.
        stop: set by ``Checkpointer.close``: waits end early.
        cfg: ``commit_timeout_s`` (how long a commit waits for the other ranks), ``store`` (the
            store to coordinate through; None: the default process group's, if any) and
            ``close_timeout_s`` (None: close() waits for every commit to end before it sets
            ``stop``, so a store wait is one c10d ``wait`` to its deadline, not slices re-armed
            to notice ``stop``, each of which logs two c10d warnings when it times out).
        place_for: the ``Place`` of a group name.
        local_for: the ``Place`` of each burst-buffer copy of a group (one per ``local_dir``).
        emit: the Checkpointer's event emitter.
    """

    def __init__(self, pool: Executor, stop: threading.Event, cfg: CheckpointerConfig,
                 place_for: Callable[[str], Place], emit: Callable[..., None],
                 local_for: Callable[[str], tuple[Place, ...]] = lambda g: ()) -> None:
        self._pool, self._stop, self._timeout = pool, stop, cfg.commit_timeout_s
        self._place_for, self._local_for, self._emit = place_for, local_for, emit
        self._links = S.Links(cfg.store, None if cfg.close_timeout_s is None else S.WAIT_SLICE_S)
        self._lock = threading.Lock()
        self._open: dict[str, A.Attempt] = {}
        self._running: dict[str, tuple[A.Attempt, Future]] = {}
        self._pending = O.Pending(self._lock)  # held, in neither of those (``owners.Pending``)
        self._missing = E.Unsaved()
        self._steps: dict[str, int | None] = {}  # group -> the step of this rank's last commit of it
        self._behind: set[str] = set()  # groups whose next commit on this rank fails at once (``pairing.py``)
        # without a store: this rank-0 session's id in attempt.json, when this rank was born (for
        # ``fallback.began`` and, on rank 0, ``fallback._failed_in``), and the attempt each group's
        # last failed commit of another rank was in
        self._session, self._born = uuid.uuid4().hex[:16], time.time()
        self._given_up: dict[str, str] = {}
        self._tell = T.Teller(pool, stop, self._timeout)
        self.label = O.label()  # how its claims on groups name it (``owners.py``)

    def begin(self, group: str, rank: int, world: int, writes: bool = True) -> None:
        """First touch of ``group`` by this rank in this attempt: decide where it writes.

        This rank's previous commit of the same group is waited for first, so that every rank
        sees the same published state. A published group (also a tag DeepSpeed's own engine
        saved) is re-saved beside itself (``resave.place_of``; refused on an
        object store); an unpublished one in place, its stale
        files never named by the new manifest. The burst-buffer copy's manifest goes now (``writes``
        False: this rank saves nothing into it, ``_begun``: it is set aside, ``leftovers.set_aside``).

        Raises:
            ConfigError: re-saving a published group on an object store (``resave.place_of``).
        """
        with self._lock:
            att = self._open.get(group)
            prev = self._running.get(group)
        if att is not None and not att.cancel.is_set():
            return
        with self._pending.marked(group):  # held from its claim on (the manifest's read may be a GET)
            self._open_attempt(group, rank, world, writes, prev)

    def _open_attempt(self, group: str, rank: int, world: int, writes: bool, prev: tuple | None) -> None:
        home = self._place_for(group)
        O.claim(home.url(), rank, group, self)  # ConfigError: another Checkpointer of this process holds it
        if prev is not None:
            prev[1].exception()  # waits; its failure is the previous commit's handle's to report
        place, old = resave.place_of(home)
        local = self._local_for(group)
        L.set_aside(local, writes)  # the local copy is rewritten in place: not complete until committed
        with self._lock:  # a rank behind: its next commit fails at once, it takes no attempt (``pairing.py``)
            alone = group in self._behind or world < 2
        channel = None if alone else self._links.channel(group, rank, world)
        token = None if channel is not None else (uuid.uuid4().hex[:16] if rank == 0 else None)
        replaced, began = None, None
        if channel is None and rank == 0 and not alone:
            replaced = P.attempt_id(place)
            P.write_record(place, P.ATTEMPT, attempt=token, world_size=world, replaced=replaced, session=self._session)
        if channel is None and not alone and rank != 0:
            with self._lock:
                given_up = self._given_up.pop(group, None)
            began = F.began(place, self._born, given_up)
            if began.running is not None:  # this rank's marker of it is an earlier process's: never published
                place.delete(P.marker_rel(rank))  # (it restarted and re-saves its files in place)
        with self._lock:
            self._open[group] = A.Attempt(group, home, place, local, channel, token, old, replaced=replaced,
                                          began=began, since=self._born)

    def holds(self, group: str) -> bool:
        """``owners.Holder``: an attempt at ``group`` is open on this rank, or its commit in flight, or
        either on its way (``owners.Pending``)."""
        with self._lock:
            att = self._open.get(group)
            return not self._stop.is_set() and (att is not None and not att.cancel.is_set() or group in self._running
                                                 or group in self._pending)

    def home_path(self, group: str, path: str) -> str:
        """Where ``path`` (a file of ``group``) is written at its home in this attempt."""
        return self._open[group].home_path(path)

    def add(self, group: str, handle: SaveHandle) -> None:
        """A save of ``handle.path`` into ``group`` is under way: it clears the path's mark."""
        self._missing.clear(group, handle.path)
        self._open[group].handles.append(handle)

    def skipped(self, group: str, path: str) -> None:
        self._missing.mark(group, path, "skipped: when_busy='skip' found the staging buffer busy")

    def failed(self, group: str, path: str, exc: BaseException) -> None:
        """The save of ``path`` into ``group`` raised ``exc`` on the training thread, perhaps
        before this rank's attempt began: the attempt cannot commit without the file. (Only its
        text is kept: the exception's traceback would pin the state's tensors until then.)"""
        self._missing.mark(group, path, f"{type(exc).__name__}: {exc}")

    def cancel(self, group: str, rank: int, world: int = 1) -> None:
        """``remove(group)`` on this rank: its attempt at the group ends, on every rank (unless
        rank 0 is already publishing it: then it completes, waited for, and is removed after;
        ``removal.py``). A later ``commit`` of the cancelled attempt fails at once."""
        with self._lock:
            running = self._running.get(group, (None,))[0]
            atts = [a for a in (self._open.get(group), running) if a is not None]
            self._missing.pop(group)  # the attempt ends as removed
        for att in atts:
            att.cancel.set()
            if att.channel is not None:
                why = f"rank {rank} removed the group"
                self._tell.through_store(att.channel, group, rank, lambda ch, why=why: ch.cancel(why),
                                         "the removal of")
        if running is not None and running.channel is None and world > 1:  # its marker may be in rank 0's hands
            R.claim(running, rank, self._timeout, self._stop)

    def abandon(self, group: str, rank: int, world: int, exc: BaseException) -> None:
        """This rank will not commit its attempt at ``group`` (its ``commit`` raised ``exc``, an
        earlier save's failure; or it closed: ``close``): end the attempt, on every rank at once.
        A rank that saved nothing into it begins it now (as ``_refuse``): else rank 0 waits for it,
        and with a store its attempt count at the group falls one behind the others' for good."""
        with self._lock:
            att = self._open.pop(group, None)
            self._missing.pop(group)
            if group in self._behind:  # its attempt is this rank's alone: nobody waits for it
                self._behind.discard(group)
                return
        if att is None and world > 1:
            try:
                att = self._begun(group, rank, world, ended=True)
            except BaseException as begin_exc:  # the others then time out, naming this rank
                exc.add_note(f"the other ranks were not told, and wait commit_timeout_s: "
                             f"{type(begin_exc).__name__}: {begin_exc}")
                return
        if att is not None:
            self._give_up(att)
            self._tell.abort(att, rank, exc, background=True)

    def close(self, rank: int, world: int) -> None:
        """``Checkpointer.close`` (or the exit flush), before ``stop`` is set: this rank commits none of
        the attempts it began and did not commit (a rank that leaves after its saves into a group,
        without ``commit``). Where the store session is agreed (this job committed a group through
        the store), each ends on every rank as a failed commit's does (``abandon``: one store write,
        here), so that the other ranks' commits fail now, naming this rank, not after
        ``commit_timeout_s``. Not before the session is agreed: that waits for rank 0, which may be
        dead too, and close() must not wait for it. Without a store not either: a failure record
        written now outlives this job, and only its time keeps the next job's first attempt at the
        group from taking it as its own (``fallback._failed_in``). There the others wait
        ``commit_timeout_s``, as before. A commit in flight (``_running``) is not touched: close()
        waited for it. One rank: nothing. Its claims on groups (``owners.py``) end with ``stop``, set next.
        A group whose every save on this rank raised at the call (a signal's ``SystemExit`` inside
        ``save``) began no attempt: with the session agreed it is begun and ended the same way."""
        unsaved = self._missing.groups() if world > 1 and self._links.agreed(rank, world) else {}
        with self._lock:  # removed: told already
            groups = {g: None for g, att in self._open.items()
                      if not att.cancel.is_set() and att.channel is not None and att.channel.agreed}
            groups.update({g: "; ".join(f"{os.path.relpath(p, g)} ({why})" for p, why in files.items())
                           for g, files in unsaved.items()
                           if g not in self._open and g not in self._running and g not in self._behind})
        for g, files in groups.items() if world > 1 else ():
            try:
                self.abandon(g, rank, world, E.closed_error(g, rank, files))
            except Exception as exc:  # noqa: BLE001 (close() goes on: the others then time out, naming this rank)
                log.warning("fastckpt: could not tell the other ranks that rank %d closed without committing %s: %r",
                            rank, g, exc)

    def _give_up(self, att: A.Attempt) -> None:
        """This rank's commit of ``att`` failed: without a store, on a rank other than 0, rank 0
        may still run the attempt its files were for, but its next save into the group is for
        the next attempt (``fallback.began``)."""
        mine = att.token or (att.began.running if att.began is not None else None)
        if att.channel is None and att.began is not None and mine is not None:
            with self._lock:
                self._given_up[att.group] = mine

    def commit(self, group: str, rank: int, world: int, extra: dict,
               finish: Callable[[SaveRecord], SaveRecord] = lambda r: r, move_latest: bool = True,
               first: float | None = None) -> Future:
        """``first``: the monotonic time of this rank's oldest save call of the group's files, which the record's
        ``durable_s`` counts from, as every ``SaveRecord`` timing does (None: this ``commit`` call)."""
        with self._pending.marked(group):  # held from leaving ``_open`` until it is ``_running``
            return self._commit(group, rank, world, extra, finish, move_latest, first)

    def _commit(self, group: str, rank: int, world: int, extra: dict, finish: Callable[[SaveRecord], SaveRecord],
                move_latest: bool, first: float | None) -> Future:
        with self._lock:
            att = self._open.pop(group, None)
            prev = self._running.get(group) if att is None else None
        if prev is not None:  # saved nothing since: its previous commit (``begin`` waits for it anyway) says
            prev[1].exception()  # whether this rank is behind (a saving rank's first save waited for it)
        with self._lock:
            missing = self._missing.pop(group)
            behind = group in self._behind
            self._behind.discard(group)
        if behind:  # of the save the others committed in the attempt refused before: it pairs with none
            self._emit("commit", group, 0, time.time(), "direct", err := G.skipped(group), detail="group")
            return G.failed(err)
        if missing:
            self._tell.refuse(group, att, rank, missing, lambda: self._begun(group, rank, world, ended=True),
                              self._emit)
        if att is None:  # a rank that saved nothing into this group
            att = self._begun(group, rank, world)
        with self._lock:  # announced with its files (``pairing.py``)
            att.steps = {"step": extra.get("step"), "prev": self._steps.get(group)}
            self._steps[group] = extra.get("step")
        att.move_latest = move_latest
        requested_at = time.time()
        t_call = min(time.monotonic(), first if first is not None else float("inf"))  # the records' durable_s

        def run() -> SaveRecord:
            try:
                rec = self._run(att, rank, world, extra, t_call, requested_at)  # raises the handle's error, emitted
            except BaseException as exc:
                self._give_up(att)
                if rank in getattr(exc, "behind", ()):  # refused: this rank committed a save twice (``pairing.py``)
                    with self._lock:
                        self._behind.add(group)
                raise
            try:
                return finish(rec)
            except BaseException as exc:
                raise R.failure(att, rank, exc)  # noqa: B904 (``failure`` chains it when it replaces it)

        # logged now, not as it ends: a replay of the log counts it as running, as stats().pending does (its end:
        # the group ``commit`` event, or ``uncommitted`` where it logs none: ``removal.failed``)
        try:
            self._emit("committing", group, 0, requested_at, "direct", detail="group")
        except BaseException:  # a sink's SystemExit (a signal handler's, on the main thread): still open, for close()
            with self._lock:
                self._open.setdefault(group, att)
            raise
        try:
            with refused_once_closed("this commit", "the group was not published"):
                fut = self._pool.submit(run)
        except BaseException:
            self._emit("uncommitted", group, 0, requested_at, "direct", detail="group: refused")
            raise
        with self._lock:
            self._running[group] = (att, fut)
        fut.add_done_callback(lambda f: self._forget(group, f))
        return fut

    def _begun(self, group: str, rank: int, world: int, ended: bool = False) -> A.Attempt:
        """This rank's attempt at ``group``, begun now: it saved nothing into it. ``ended``: to be ended at
        once (``abandon``, ``refuse``): its burst-buffer copies get back the manifest it set aside."""
        self.begin(group, rank, world, writes=False)
        with self._lock:
            att = self._open.pop(group)
        return L.put_back(att) or att if ended else att

    def _forget(self, group: str, fut: Future) -> None:
        with self._lock:
            if self._running.get(group, (None, None))[1] is fut:
                del self._running[group]

    def _run(self, att: A.Attempt, rank: int, world: int, extra: dict, t_call: float,
             requested_at: float) -> SaveRecord:
        c0, cpu0 = time.time(), time.thread_time()
        try:
            recs = A.records(att.handles)  # a failed save stops the commit here
        except BaseException as exc:
            self._tell.abort(att, rank, exc)
            raise R.failed(att, rank, exc, c0, "direct", self._emit, saved=True)  # noqa: B904 (as ``run``)
        tier = recs[0].tier if recs else "direct"
        blocked = sum(r.blocked_s for r in recs)
        superseded = any(r.superseded for r in recs)  # replication coalesced this attempt away
        files = {} if superseded else {r.path[len(att.group):].lstrip("/"): {"size": r.bytes, "checksum": r.checksum}
                                      for r in recs}
        try:
            if att.cancel.is_set():
                raise E.removed_error(att.home)
            ended = (A.via_store(att, att.channel, rank, world, files, superseded, extra, requested_at, self._timeout,
                                 self._stop) if att.channel is not None else
                     A.via_storage(att, rank, world, files, superseded, extra, requested_at, self._timeout, self._stop))
            done = time.monotonic() - t_call
            ops, nbytes = (att.channel.ops, att.channel.nbytes) if att.channel is not None else (0, 0)
            cost = {"store_ops": ops, "store_bytes": nbytes, "commit_cpu_s": time.thread_time() - cpu0}
            if ended.superseded:
                L.dropped(att, recs, rank, world, self._lock, (self._open, self._running))  # its files, records go
                self._emit("uncommitted", att.group, 0, c0, tier, detail="group: superseded")
                return SaveRecord(att.group, tier, 0, blocked, 0.0, done, None, rank=rank, group=att.group,
                                  superseded=True, **cost)
            for local in [p for p in att.local if os.path.isdir(p.url())]:  # striped: each drive holding files
                try:
                    A.publish_local(att, local, ended.manifest, self._stop)
                except OSError as exc:  # published at its home: a copy without its manifest is judged by the home's
                    (log.debug if isinstance(exc, FileNotFoundError) else log.warning)(  # (gone: trimmed by a rank)
                        "fastckpt: %s is published; its burst-buffer copy %s has no manifest (%r): loads judge it "
                        "by the home's", att.group, local.label, exc)
        except BaseException as exc:  # (a refused commit's directory goes: leftovers.refused)
            raise R.failed(att, rank, L.refused(att, rank, world, exc), c0, tier, self._emit)  # noqa: B904
        self._emit("commit", att.group, ended.total, c0, tier, detail="group")
        return SaveRecord(att.group, tier, ended.total, blocked, 0.0, done, done, rank=rank, group=att.group, **cost)
