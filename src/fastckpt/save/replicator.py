"""Background replication of committed local checkpoints to their durable home.

Order of work for one file (worker threads of the Replicator, never the training thread), all through the home's
``Target`` (``storage.homes``):
  1. copy: ``put_file`` with the manifest's size and checksum (a file system: a parallel O_DIRECT copy to a temp
     name, each chunk read back as it is written; an object store: a multipart upload, retries, the bandwidth cap);
  2. verify against the checksum recorded at save time: the copy's own read-back, or in flight (the bytes sent
     hash to the checksum, the store confirms each part's CRC32, then the size), or a ranged read-back with
     ``replicate_verify="readback"`` or a store that confirms nothing (docs/burst-buffer.md, "What verified
     means"). A mismatch copies again (3 attempts), so only verified bytes are ever published;
  3. publish (``commit.protocol.publish_file``), unless ``close()`` gave up on it or another Checkpointer's newer
     save replaced its local copy (``localcopy.check_publishable``): on a file system the rename did it; on an
     object store the sidecar ``NAME.fastckpt.json`` goes last (a remote file without it is not a checkpoint
     yet). Group files get neither: the group manifest, written by rank 0 after every rank's marker, is theirs.
Backpressure: with ``replicate_policy="coalesce"`` a newly committed checkpoint drops the older ones still queued
(not started; ``_supersedes``): their handles resolve with ``superseded=True``, a ``superseded`` event each.
Older and newer go by the save calls (``t_call``), not by arrival (a later save's local write can end first).
Order: with ``replicate_in_order`` a single file starts only after every single file saved before it is final or
has failed (``save.ordering``); with "all", each upload of a single file reads a version link of its own save, so
a newer save of the same path replaces the local copy without dropping it: the oldest queued save of a path lands
in its turn, a save between it and the newest is dropped (``save.versions``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from ..commit.protocol import publish_file
from ..config import CheckpointerConfig
from ..errors import CheckpointWriteError, CorruptCheckpointError, ReplicationError
from ..records import SaveRecord
from ..storage.homes import Homes
from ..storage.types import Expected, as_limiter
from .behind import Behind
from .localcopy import check_publishable, local_manifest, replaced_by_newer
from .ordering import CallOrder, Turn
from .versions import link_version, unlink_version

log = logging.getLogger("fastckpt")
VERIFY_ATTEMPTS = 3  # uploads that do not verify before replication gives up


@dataclass(eq=False)
class ReplicaJob:
    rec: SaveRecord  # as committed locally
    local: str
    t_call: float
    committed_at: float
    future: Future = field(default_factory=Future)
    finish: Callable[[SaveRecord], SaveRecord] = lambda rec: rec  # runs before the future resolves
    home: str = ""  # where the copy goes when not rec.path (a re-saved group's new attempt, beside it)
    order: int | None = None  # its ``Turn``'s key with replicate_in_order: it starts after the earlier ones
    version: str = ""  # a second name of its own save's local copy, uploaded from (``save.versions``)
    export: bool = False  # save(export=True): a file beside the checkpoints, never coalesced with one
    block: str = ""  # the one_save() it was saved in: its files are one checkpoint, never coalesced together


class Replicator:
    """Copies committed local files to their destinations on ``replicate_workers`` threads."""

    def __init__(self, cfg: CheckpointerConfig, homes: Homes, emit: Callable[..., None],
                 on_durable: Callable[[float, float | None], None]) -> None:
        self._cfg, self._homes = cfg, homes
        self._emit, self._on_durable = emit, on_durable
        self._cv = threading.Condition()
        self._queue: deque[ReplicaJob] = deque()
        self._running: list[ReplicaJob] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._gave_up = False  # close(wait=False): running copies fail as their pools stop under them
        self._cancel: dict[str, int] = {}  # paths being removed -> how many remove() calls
        self._kept: set[str] = set()  # groups committed with move_latest=False: never coalesced
        self._started: deque[str] = deque(maxlen=256)  # one_save() blocks with a file started: never coalesced
        self._behind = Behind()
        self._order = CallOrder(self._cv)
        self.failures = 0
        self._bucket = as_limiter(cfg.replicate_bandwidth_Bps, cfg.chunk_bytes)  # shared by every copy and read-back

    # ------------------------------------------------------------------ queue
    def turn(self, single: bool) -> Turn | None:
        """With ``replicate_in_order``, a single-file save's ``Turn`` (``Saver``: any way it is written)."""
        return Turn(self._order) if single and self._cfg.replicate_in_order else None

    def submit(self, job: ReplicaJob) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError("replicator is closed")
            if self._cancelled(job):
                self._drop(job)
                return job.future
            coalesce = self._cfg.replicate_policy == "coalesce"
            # Saves reach the queue as their local writes end, which on several drives is not the
            # order of the calls: a single file called before a queued or running save is the
            # older one. (A group's file is not: its group may be kept, not known before its
            # commit, and another of its files may already have dropped that newer save.)
            newer = [j for j in (*self._running, *self._queue) if j.t_call > job.t_call
                     and self._supersedes(j, job, coalesce)]
            if newer and job.rec.group is None:
                self._drop_for(job, newer[-1], coalesce)
                return job.future
            olds = [j for j in self._queue if j.t_call < job.t_call and self._supersedes(job, j, coalesce)
                    and j.rec.group not in self._kept]
            waits = min((j for j in olds if j.version), key=lambda j: j.t_call, default=None)  # save.versions
            for old in [j for j in olds if j is not waits]:  # one version of a path waits, with its own bytes
                self._queue.remove(old)
                self._drop_for(old, job, coalesce)
            self._version(job)
            self._queue.append(job)
            try:
                self._emit("queued", job.rec.path, job.rec.bytes, job.committed_at, job.rec.tier,
                           detail=f"waiting={len(self._queue)} running={len(self._running)}"
                                  + ("" if self._order.ready(job.order) else " behind=earlier saves"))
                while len(self._threads) < self._cfg.replicate_workers:
                    t = threading.Thread(target=self._work, name=f"fastckpt-replicate-{len(self._threads)}",
                                         daemon=True)
                    t.start()
                    self._threads.append(t)
            except BaseException:  # the caller resolves the job's future with this: no worker may take it
                self._queue.remove(job)  # (none could yet: they need the lock held here)
                self._unversion(job)
                raise
            self._cv.notify()
        return job.future

    def _drop_for(self, old: ReplicaJob, by: ReplicaJob, coalesce: bool) -> None:
        why = "replicate_policy='coalesce'" if coalesce else "a newer save to the same path"
        log.info("fastckpt: replication of %s superseded by %s (%s); its local copy stays at %s",
                 old.rec.path, by.rec.path, why, old.local)
        self._logged_superseded(old.rec, "coalesce" if coalesce else "newer-save")
        self._unversion(old)
        old.future.set_result(old.finish(replace(old.rec, durable_s=None, superseded=True)))
        kept = any(j.version and j.rec.path == old.rec.path for j in (*self._running, *self._queue))
        if old.rec.group is None and old.rec.path == by.rec.path and not kept:  # kept: that one lands (save.behind)
            self._behind.dropped(old.rec.path)

    @contextmanager
    def cancelling(self, path: str) -> Iterator[None]:
        """While ``remove(path)`` runs: the single file ``path`` (or the files of the group
        ``path``) is not replicated.

        Its queued job is dropped now, and one submitted meanwhile (its local write was still
        finishing) is dropped on arrival; both resolve as ``cancelled``. An upload already
        running finishes (the caller waits for it, then deletes both copies).
        """
        with self._cv:
            self._cancel[path] = self._cancel.get(path, 0) + 1
            for job in [j for j in self._queue if self._cancelled(j)]:
                self._queue.remove(job)
                self._drop(job)
        try:
            yield
        finally:
            with self._cv:
                self._cancel[path] -= 1
                if not self._cancel[path]:
                    del self._cancel[path]

    def keep(self, group: str, kept: bool) -> None:
        """``group`` was committed with ``move_latest=False`` (``kept``) or not: coalescing skips it."""
        with self._cv:
            (self._kept.add if kept else self._kept.discard)(group)

    def _version(self, job: ReplicaJob) -> None:
        """With ``replicate_in_order`` and "all", a single file's upload reads a version link of its own
        save (``save.versions``): a newer save of its path may replace the local copy before it starts,
        or as it starts. Made as it is queued: the local copy is its own save's until the next save of
        that path, written after this by the same writer thread (``save.stripes``), renames over it."""
        if self._cfg.replicate_in_order and self._cfg.replicate_policy == "all" and job.rec.group is None:
            job.version = link_version(self._homes.resolve(job.local).target.ops, job.local) or ""

    def _unversion(self, job: ReplicaJob) -> None:
        """Its upload ended, however: its version link (if any) goes."""
        version, job.version = job.version, ""
        if version:
            unlink_version(self._homes.resolve(version).target.ops, version)

    def _supersedes(self, new: ReplicaJob, old: ReplicaJob, coalesce: bool) -> bool:
        """Whether queued ``old`` is dropped for ``new``: any other checkpoint when coalescing (an export is
        none: as with "all"; nor is a file of a ``one_save()`` block, one checkpoint, for another of it, nor
        once one of its files started: the home never gets part of it); with "all", an older save of the
        same single file (its bytes are replaced anyway)."""
        if coalesce and not (new.export or old.export):
            whole = old.block and (new.block == old.block or old.block in self._started)
            return (old.rec.group is None or old.rec.group != new.rec.group) and not whole
        return old.rec.group is None and new.rec.group is None and old.rec.path == new.rec.path

    def _next(self) -> ReplicaJob | None:
        """The oldest queued job whose destination no running job writes (lock held): two
        uploads of one path never overlap, so the newer save is always the one left there.
        With ``replicate_in_order`` also one no earlier save holds back (it waits in the queue)."""
        busy = {j.rec.path for j in self._running}
        for job in self._queue:
            if job.rec.path not in busy and self._order.ready(job.order):
                self._queue.remove(job)
                return job
        return None

    def _cancelled(self, job: ReplicaJob) -> bool:
        return (job.rec.group if job.rec.group is not None else job.rec.path) in self._cancel

    def _logged_superseded(self, rec: SaveRecord, by: str) -> None:
        """Its event ends the save in a replay of the log (fastckpt report, serve-metrics): events are logged as
        phases end, so nothing else tells a dropped replication from one still running. ``saved_at`` (its
        snapshot event's start) names the save among others to its path."""
        self._emit("superseded", rec.path, rec.bytes, time.time(), rec.tier, detail=f"saved_at={rec.requested_at!r} "
                   f"by={by}")

    def _drop(self, job: ReplicaJob) -> None:
        log.info("fastckpt: replication of %s cancelled: the checkpoint is being removed", job.rec.path)
        # its event ends the save in a replay of the log (fastckpt report, serve-metrics): no replicate follows
        self._emit("cancel", job.rec.path, job.rec.bytes, time.time(), job.rec.tier, detail="removed")
        self._unversion(job)
        job.future.set_result(replace(job.rec, durable_s=None, cancelled=True))

    def _work(self) -> None:
        while True:
            with self._cv:
                while (job := self._next()) is None and not (self._closed and not self._queue):
                    self._cv.wait()
                if job is None:
                    return
                self._running.append(job)
                if job.block and job.block not in self._started:  # the rest of its checkpoint follows it home
                    self._started.append(job.block)
            try:
                try:
                    rec = self._replicate(job)
                finally:
                    self._unversion(job)
                rec = job.finish(rec)
                if rec.durable_s is not None:
                    self._behind.landed(rec.path)
                job.future.set_result(rec)
            except BaseException as exc:  # noqa: BLE001 (delivered through the future, raised once)
                with self._cv:
                    self.failures += 1
                    gave_up = self._gave_up
                if gave_up:  # its pools were stopped under it: say why, not "cannot schedule new futures"
                    log.warning("fastckpt: replication of %s stopped: its Checkpointer was closed before the copy "
                                "ended (close_timeout_s); the local copy is kept at %s", job.rec.path, job.local)
                    err = ReplicationError(f"{job.rec.path} was not replicated: its Checkpointer was closed before the "
                                           f"copy ended (close() stopped waiting for it: close_timeout_s), so it was "
                                           f"not published; the local copy is kept at {job.local}")
                    err.__cause__ = exc
                    exc = err
                else:
                    log.error("fastckpt: replication of %s failed: %s; the local copy is kept at %s",
                              job.rec.path, exc, job.local)
                job.future.set_exception(exc)
            finally:
                with self._cv:
                    self._running.remove(job)
                    self._cv.notify_all()  # a job held back for this path may start now

    def lag_s(self) -> float:
        """Seconds since the oldest checkpoint still waiting for replication committed locally."""
        with self._cv:
            waiting = [j.committed_at for j in (*self._running, *self._queue)]
        return time.time() - min(waiting) if waiting else 0.0

    def pending(self) -> list[str]:
        with self._cv:
            return [j.rec.path for j in (*self._running, *self._queue)]

    def _own_newer(self, job: ReplicaJob) -> bool:  # a newer save of its path queued here: its upload follows
        with self._cv:
            return any(j.rec.path == job.rec.path and j.t_call > job.t_call for j in (*self._running, *self._queue))

    def close(self, wait: bool = True) -> None:
        """Stop taking jobs. With ``wait``, after the workers ran every queued job (joined);
        without, at once: the queued jobs resolve as not replicated (``ReplicationError``; their
        local copies stay), and the running ones fail on their (daemon) threads, unwaited for and
        never published (``Checkpointer.close`` past ``close_timeout_s``; ``localcopy.check_publishable``)."""
        with self._cv:
            self._closed = True
            self._gave_up = not wait
            dropped = [] if wait else list(self._queue)
            if not wait:
                self._queue.clear()
                self.failures += len(dropped)  # failed replications, as their events and handles say
            self._cv.notify_all()
        if dropped:
            log.warning("fastckpt: not replicating %s: close() stopped waiting (close_timeout_s); the local copies "
                        "stay at %s", ", ".join(j.rec.path for j in dropped), ", ".join(j.local for j in dropped))
        for job in dropped:  # logged as failed replications: a replay of the log never holds them pending
            self._unversion(job)
            err = ReplicationError(f"{job.rec.path} was not replicated: close() stopped waiting for it "
                                   f"(close_timeout_s); its local copy stays at {job.local}")
            self._emit("replicate", job.rec.path, job.rec.bytes, time.time(), job.rec.tier, err)
            job.future.set_exception(err)
        for t in self._threads if wait else ():
            t.join()

    # ------------------------------------------------------------------ one file
    def _replicate(self, job: ReplicaJob) -> SaveRecord:
        rec, r0 = job.rec, time.time()
        try:
            manifest = local_manifest(self._homes, job.version or job.local, job.local, rec)
        except BaseException as exc:  # logged, as a failed copy is: a replay of the log never holds it pending
            self._emit("replicate", rec.path, rec.bytes, r0, rec.tier, exc)
            raise
        if manifest is None:
            return self._superseded(rec)
        try:
            detail = self._copy(job, manifest)
        except CheckpointWriteError as exc:  # the copy read other bytes: a newer save replaced the file meanwhile?
            if not self._gave_up and replaced_by_newer(self._homes, job.version or job.local, rec):
                return self._superseded(rec)
            self._emit("replicate", rec.path, rec.bytes, r0, rec.tier, exc)
            raise
        except BaseException as exc:
            self._emit("replicate", rec.path, rec.bytes, r0, rec.tier, exc)
            raise
        durable = time.monotonic() - job.t_call
        self._emit("replicate", rec.path, rec.bytes, r0, rec.tier, detail=detail)
        # a group's file moves the RPO only once its group is published (Checkpointer.commit)
        self._on_durable(durable, None if rec.group is not None else rec.requested_at)
        return replace(rec, durable_s=durable)

    def _superseded(self, rec: SaveRecord) -> SaveRecord:
        log.info("fastckpt: replication of %s superseded: a newer save replaced its local copy", rec.path)
        self._logged_superseded(rec, "local-copy-replaced")
        return replace(rec, durable_s=None, superseded=True)

    def _copy(self, job: ReplicaJob, manifest: dict) -> str:
        """Copy, verify and publish one file at its home; returns the event's detail."""
        rec, cfg = job.rec, self._cfg
        home = self._homes.resolve(job.home or rec.path)
        target = home.target
        expect = Expected(rec.bytes, rec.checksum, manifest["covered"], lambda: check_publishable(  # before publishing
            self._homes, job.version or job.local, rec, self._gave_up, lambda: self._own_newer(job)))
        readback = cfg.replicate_verify == "readback"
        for attempt in range(1, VERIFY_ATTEMPTS + 1):
            t0 = time.monotonic()
            try:
                put = target.put_file(job.version or job.local, home.key, bandwidth_Bps=self._bucket, expect=expect,
                                      chunk_bytes=target.part_bytes(cfg.chunk_bytes))
                t1 = time.monotonic()
                how = "readback" if put.read_back else "checksum"
                if not put.verified or (readback and not put.read_back):  # checks the size and the checksum
                    how = "readback"
                    target.verify(home.key, rec.bytes, rec.checksum, expect.covered, bandwidth_Bps=self._bucket)
                else:  # the copy verified itself (read-back or the store's checksums); the size is left
                    target.check_size(home.key, rec.bytes)
                break
            except CorruptCheckpointError as exc:
                if attempt == VERIFY_ATTEMPTS:
                    raise
                log.warning("fastckpt: copy %d of %s did not verify (%s); copying again", attempt, rec.path, exc)
        if rec.group is None:  # published last: only now is the file at its home a checkpoint
            publish_file(home, manifest)
        return (f"copy_s={t1 - t0:.3f} verify_s={time.monotonic() - t1:.3f} parts={put.parts} "
                f"retries={put.retries} attempts={attempt - 1 + put.copies} verified={how}")
