"""``Checkpointer.save`` in its five modes, and what follows a write.

Modes, chosen per save (all on the training thread, which is blocked only until the call
returns; docs/core.md):
  eager      plan -> acquire a staging buffer -> copy the state into it -> return
  lazy       plan -> acquire -> return; the copy runs on the snapshot thread and
             ``fence()`` (before the next optimizer step) waits for it
  overlapped CPU state with ``overlap_write``: the writer starts at once and follows the copy
  gds        CUDA state on the gds tier: GPU -> file through kvikio, then return
  skipped    every staging buffer busy and ``when_busy="skip"``: nothing is saved
After the snapshot the writer thread writes, fsyncs and renames the file (``FileWriter``). A file
written to its own path is durable then; one written to the burst buffer is handed to the
``Replicator``, which copies it to its path. A single file that the burst buffer has no room
for (``Stripes.choose``), or runs out of room for mid-write (``FileWriter.write``'s fallback),
is written straight to its path instead (with ``replicate_in_order``, renamed into place in
its turn: ``save.ordering``), and the stale burst-buffer copy of an earlier save of it goes once
it is durable. Either way retention runs before the
handle resolves, so ``wait()`` returning means retention has run.
"""

from __future__ import annotations

import functools
import logging
import posixpath
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import replace

from ..commit.coordinator import Coordinator
from ..commit.names import check_save_name
from ..commit.protocol import publish_file
from ..config import CheckpointerConfig
from ..errors import ConfigError, ReplicationError, refused_once_closed
from ..events import LAZY
from ..format import layout as F
from ..format.manifest import TAIL_ROOM
from ..inflight import InFlight, raise_as_write_error, set_surfaced, surfaced
from ..monitor import Monitor
from ..records import SaveHandle, SaveRecord, not_written
from ..storage.homes import Homes
from ..urls import is_within
from . import heap
from .lazy import LazyCopies
from .ordering import Turn
from .replicator import ReplicaJob, Replicator
from .retention import Retention
from .snapshot import LazySnapshot, Progress, Snapshot, Unfenced, cuda_marks, snapshot
from .staging import Lease, StagingBuffer, StagingPool
from .stripes import Reservation, Stripes
from .tiers import TierChoice, TierSelector
from .writer import FileWriter

log = logging.getLogger("fastckpt")


class Saver:
    """The save path of one Checkpointer (its collaborators are the Checkpointer's own)."""

    def __init__(self, cfg: CheckpointerConfig, *, tiers: TierSelector, staging: StagingPool, monitor: Monitor,
                 writer: FileWriter, writer_threads: Sequence[Executor], snapshot_thread: Executor, inflight: InFlight,
                 coordinator: Coordinator, replicator: Replicator, retention: Retention, homes: Homes,
                 stripes: Stripes, emit: Callable[..., None]) -> None:
        self._cfg, self._tiers, self._staging, self._monitor = cfg, tiers, staging, monitor
        self._writer, self._write_threads, self._snap_thread = writer, tuple(writer_threads), snapshot_thread
        self._inflight, self._coord, self._replicator, self._retention = inflight, coordinator, replicator, retention
        self._homes, self._stripes, self._emit = homes, stripes, emit
        self._queueing = threading.Lock()  # a write is queued and its turn taken at once
        self._planner = F.Planner()
        self._lazy = LazyCopies(monitor, emit)

    def save(self, state_dict: object, path: str, group: str | None, lazy: bool, rank: int, world: int) -> SaveHandle:
        """See ``Checkpointer.save``; ``path`` and ``group`` are normalised. An earlier save's
        failure nobody has seen is raised first (the sync point). A save into a group that
        raises, that one included, marks its file in the group's attempt: the group's commit
        then fails on every rank instead of publishing the group without it, unless the file is
        saved again first (``Coordinator.failed``); a path that is no file of the group does not."""
        check_save_name(path, group)
        if group is not None and not is_within(path, group):
            raise ConfigError(f"{path} is not inside its group directory {group}: save each file of a group "
                              f"under its directory, e.g. {group}/{posixpath.basename(path)}")
        called = time.time()
        try:
            self._inflight.raise_unseen()
            return self._save(state_dict, path, group, lazy, rank, world)
        except BaseException as exc:
            if group is not None:  # its group's commit fails, and counts it (``commit.tell``)
                self._coord.failed(group, path, exc)
            elif isinstance(exc, Exception) and not surfaced(exc):  # failed at the call: no phase of it emitted one
                self._emit("snapshot", path, 0, called, self._tier(), error=exc)
            raise

    def _tier(self) -> str:
        """The tier a save that failed before one was chosen is counted under: the one asked for, else
        the one its burst buffer (or none) gives."""
        return self._cfg.tier if self._cfg.tier != "auto" else "nvme" if self._cfg.local_dirs else "direct"

    def _save(self, state_dict: object, path: str, group: str | None, lazy: bool, rank: int,
              world: int) -> SaveHandle:
        t_call, w_call = time.monotonic(), time.time()
        mounted = self._homes.resolve(path).target.mounted
        if not self._cfg.local_dirs and not mounted:
            raise ConfigError(f"{path} is a URL: saving there needs local_dir=<node-local directory>, the "
                              "burst buffer the upload is made from")
        layout = self._planner.plan(state_dict)
        # A single file skips a burst buffer that has no room for it and goes straight to its
        # mounted home, unless an earlier save of it is still being written or replicated (that
        # copy could land after this one). A group's files always go through the burst buffer.
        # A path whose drive is full moves to one with room, unless such a save is in flight (its
        # copy there may be what an upload reads).
        idle = bool(self._cfg.local_dirs) and not self._inflight.writing(path)
        may_bypass = idle and group is None and mounted
        token = self._retention.replacing(group or path)
        spot = self._stripes.choose(path, layout.data_size, may_bypass, idle)  # the burst-buffer drive, if any
        self._stripes.note_bypass(path, layout.data_size, spot is not None and spot.local is None)
        # Such a file that finds the burst buffer full only mid-write (another writer filled it
        # since the check) is written to its path then (``FileWriter.write``'s fallback).
        fallback = functools.partial(self._tiers.choose_bypass, path, layout.cuda) \
            if may_bypass and spot and spot.local else None
        turn = self._replicator.turn(group is None and bool(self._cfg.local_dirs))  # its place (replicate_in_order)
        try:
            handle = self._save_planned(state_dict, layout, path, spot, group, lazy, rank, world, t_call, w_call,
                                        token, turn, fallback)
        except BaseException as exc:
            self._stripes.release(spot, exc)
            if turn is not None:
                turn.end()
            raise
        if handle.done():  # skipped: nothing will be written
            self._stripes.release(spot)
            if turn is not None:
                turn.end()
        return handle

    def _save_planned(self, state_dict: object, layout: F.FileLayout, path: str, spot: Reservation | None,
                      group: str | None, lazy: bool, rank: int, world: int, t_call: float, w_call: float,
                      token: int, turn: Turn | None, fallback: Callable[[], TierChoice] | None) -> SaveHandle:
        has_cuda, bb = layout.cuda, spot if spot is not None and spot.local is not None else None  # bb: its copy
        try:
            if spot is not None and bb is None:  # it skips the burst buffer
                choice = self._tiers.choose_bypass(path, has_cuda)
            else:
                choice = self._tiers.choose(path, has_cuda, bb.root if bb else None)
        except OSError as exc:  # the probe could not write there: unwritable, not a directory...
            raise_as_write_error(exc, path, where=bb.root if bb else None, local=bb is not None)
        if choice.tier == "gds" and layout.align != F.ALIGN:  # GDS writes each record: page-aligned
            layout = self._planner.plan(state_dict, page_aligned=True)
        home = path
        if group is not None:
            self._coord.begin(group, rank, world)
            home = self._coord.home_path(group, path)  # beside a published group when re-saving it
        dest = bb.local if bb and bb.local else home
        base = SaveRecord(path, choice.tier, layout.data_size, 0.0, 0.0, 0.0, None, rank=rank, group=group,
                          requested_at=w_call)
        if choice.tier == "gds":
            return self._save_gds(layout, base, dest, home, t_call, w_call, spot, token, turn)
        buf = self._staging.acquire(layout.data_size + TAIL_ROOM, owner=group or object(),
                                    pinned=has_cuda, wait=self._cfg.when_busy == "wait", holds=layout.segments.serial)
        if buf is None:
            return self._skipped(base, group, t_call)
        lease = buf.lease
        try:  # the buffer is this call's until its writer job is queued: on any exception (a Ctrl-C) it goes back
            if self._cfg.overlap_write and not lazy and not has_cuda:
                return self._save_overlapped(layout, buf, base, dest, home, t_call, w_call, choice, spot, token,
                                             turn, fallback)
            if lazy:  # CUDA: the copy follows the work queued so far and runs beside what comes next
                with refused_once_closed("this save"):
                    copy = self._snap_thread.submit(self._staging.lent, lease, functools.partial(
                        snapshot, layout, buf, after=cuda_marks(layout), hold_stream=False))
                counted: Future = Future()  # the copy's outcome, once it is counted: the writer waits for it
                snap: Snapshot | LazySnapshot = LazySnapshot(counted, layout, buf)
                # fence() waits for the copy and counts that wait as blocked time (or the copy ends first)
                blocked = time.monotonic() - t_call
                entry = Unfenced(copy, t_call, blocked, layout.payload_bytes, batch=self._monitor.current(),
                                 path=path, tier=choice.tier, w_call=w_call, group=group)
                self._lazy.add(entry)
            else:
                snap = snapshot(layout, buf)
            self._emit("snapshot", path, layout.payload_bytes, w_call, choice.tier, detail=LAZY if lazy else None,
                       group=group)
            if lazy:  # after its snapshot event: the fence event that counts it follows it
                self._lazy.watch(entry, counted)
            base = replace(base, blocked_s=blocked if lazy else time.monotonic() - t_call)  # eager: sinks count
            fut = self._submit(spot, token, turn, layout, self._writer.write, snap, base, dest, t_call,
                               choice, fallback, lease=lease)
        except BaseException:
            self._staging.give_back(lease)  # not once its writer job was queued; a lazy copy under way ends first
            raise
        handle = self._track(fut, base, dest, home, t_call, spot, token, turn)
        if not lazy:  # counted once the write is queued: an alarm's callback can neither delay nor drop it
            self._monitor.record_blocked(t_call, base.blocked_s, layout.payload_bytes)
        return handle

    def _save_gds(self, layout: F.FileLayout, base: SaveRecord, dest: str, home: str, t_call: float, w_call: float,
                  spot: Reservation | None, token: int, turn: Turn | None) -> SaveHandle:
        st = self._writer.gds_write(layout, dest)
        self._emit("snapshot", base.path, layout.payload_bytes, w_call, base.tier, detail="gds write", group=base.group)
        blocked = time.monotonic() - t_call  # the event's sinks included
        self._monitor.record_blocked(t_call, blocked, layout.payload_bytes)
        base = replace(base, blocked_s=blocked)
        fut = self._submit(spot, token, turn, layout, self._writer.gds_finish, st, layout, base, t_call)
        return self._track(fut, base, dest, home, t_call, spot, token, turn)

    def _skipped(self, base: SaveRecord, group: str | None, t_call: float) -> SaveHandle:
        self._monitor.record_skipped()
        warnings.warn(f"fastckpt: skipped save of {base.path}: the previous save still holds the staging "
                      "buffer (when_busy='skip')", stacklevel=4)
        if group is not None:
            self._coord.skipped(group, base.path)
        return SaveHandle.finished(replace(base, bytes=0, blocked_s=time.monotonic() - t_call, skipped=True))

    def _save_overlapped(self, layout: F.FileLayout, buf: StagingBuffer, base: SaveRecord, dest: str, home: str,
                         t_call: float, w_call: float, choice: TierChoice, spot: Reservation | None, token: int,
                         turn: Turn | None, fallback: Callable[[], TierChoice] | None) -> SaveHandle:
        """CPU state: the writer starts at once and follows the copy into the staging buffer,
        so the file is durable about one write time after the call, not copy + write."""
        progress = Progress()
        try:
            fut = self._submit(spot, token, turn, layout, self._writer.write, Snapshot(buf, layout, progress=progress),
                               base, dest, t_call, choice, fallback, lease=buf.lease)
        except BaseException as exc:  # a writer job that took the buffer as it was queued must not wait for the copy
            progress.finish(exc)
            raise
        try:
            snapshot(layout, buf, progress)
        except BaseException as exc:
            set_surfaced(exc)  # raised here, to the caller; the writer re-raises the same object
            progress.finish(exc)
            self._inflight.track(fut, base.path, base.group)
            raise
        blocked = time.monotonic() - t_call
        progress.finish(blocked_s=blocked)
        self._monitor.record_blocked(t_call, blocked, layout.payload_bytes)
        self._emit("snapshot", base.path, layout.payload_bytes, w_call, choice.tier, group=base.group)
        return self._track(fut, replace(base, blocked_s=blocked), dest, home, t_call, spot, token, turn)

    def _submit(self, spot: Reservation | None, token: int, turn: Turn | None, layout: F.FileLayout,
                write: Callable[..., SaveRecord], *args: object, lease: Lease | None = None) -> Future:
        """Run ``write`` on the writer thread of the save's burst-buffer directory (one per
        directory: the drives write at once; files of one directory, and so every save of one
        path, are written in order). A ``turn`` is taken as the write is queued, under one lock
        (so keys follow the writer queues: ``save.ordering``), and goes to ``write`` last. The
        staging buffer's ``lease`` is the writer's once the job is queued (``staging.Lease``)."""
        big = len(layout.storages) >= heap.TRIM_AFTER_RECORDS
        with self._queueing, refused_once_closed("this save"):
            if turn is not None:
                turn.take()
            fut = self._write_threads[spot.index if spot else 0].submit(
                self._written, token, big, lease, write, [*args, turn.wait if turn else None])
            if lease is not None:
                lease.taken = True  # no Ctrl-C lands between the return above and this store
            return fut

    def _written(self, token: int, big: bool, lease: Lease | None, write: Callable[..., SaveRecord],
                 args: list) -> SaveRecord:
        """The writer thread's job: write (unless its save gave the buffer back: ``Lease``); a file
        written to its own path is durable and published now (``commit.protocol.publish_file``), so
        retention runs before its handle resolves. After a save of many tensors, the heap's free
        pages go back (``save.heap``): ``args`` is emptied first, so the snapshot and its layout are freed."""
        try:
            if lease is not None and not self._staging.taken(lease):
                raise CancelledError("the save was interrupted before its write started")
            rec = write(*args)
            if rec.durable_s is None:
                return rec
            if rec.group is None:
                publish_file(self._homes.resolve(rec.path), {"written_at": time.time()})
                self._monitor.record_durable(rec.durable_s, rec.requested_at)  # at its path: no replica
                if self._cfg.local_dirs:  # it skipped the burst buffer: a copy there of an earlier save is stale
                    self._retention.bypassed(rec.path, token)
            return self._retain(rec, token, has_local=False)
        finally:
            args.clear()
            if big:
                heap.trim()

    def _track(self, fut: Future, base: SaveRecord, dest: str, home: str, t_call: float, spot: Reservation | None,
               token: int, turn: Turn | None) -> SaveHandle:
        """Replication (to ``home``) follows a write to the burst buffer; track the save; join
        its group. The save's reservation holds its path on its drive until the write ends."""
        def ended(f: Future) -> None:
            failure = None if f.cancelled() else f.exception()
            if not f.cancelled() and failure is None:
                self._stripes.written(spot)
            self._stripes.release(spot, failure)

        fut.add_done_callback(ended)
        if dest != home:
            fut = self._then_replicate(fut, dest, home, t_call, token, turn.key if turn else None)
        if turn is not None:
            turn.until(fut)  # its place ends with its handle
        handle = self._inflight.track(fut, base.path, base.group)
        if base.group is not None:
            self._coord.add(base.group, handle)
        return handle

    def _then_replicate(self, wrote: Future, local: str, home: str, t_call: float, token: int,
                        order: int | None) -> Future:
        """A future that resolves once the file written to ``local`` is replicated to ``home``
        (after the saves before ``order``, with replicate_in_order)."""
        final: Future = Future()
        export = self._retention.exporting(token)  # an export never coalesces with checkpoints
        block = batch.id if (batch := self._monitor.current()) is not None else ""  # nor a one_save()'s files

        def enqueue(f: Future) -> None:
            if f.cancelled():  # a close() that gave up waiting: its local copy was never written
                final.set_exception(not_written(home))
                return
            exc = f.exception()
            if exc is not None:
                final.set_exception(exc)
                return
            rec = f.result()
            if rec.durable_s is not None:  # the burst buffer filled up mid-write: written to its path instead
                final.set_result(rec)
                return
            try:
                self._replicator.submit(ReplicaJob(rec, local, t_call, time.time(), final,
                                                   finish=functools.partial(self._retain, token=token),
                                                   home=home if home != rec.path else "", order=order,
                                                   export=export, block=block))
            except RuntimeError as err:  # closed under us: nothing will replicate it
                final.set_exception(ReplicationError(f"{rec.path} was not replicated: {err}"))
            except BaseException as err:  # noqa: BLE001 (a done-callback's error is swallowed: the handle must resolve)
                final.set_exception(err)

        wrote.add_done_callback(enqueue)
        return final

    def _retain(self, rec: SaveRecord, token: int, has_local: bool = True) -> SaveRecord:
        """A single-file checkpoint (save ``token``) is verified at its home, or replication dropped
        it for a newer one: apply keep_local/keep_persistent. ``has_local``: it was written
        through the burst buffer (if there is one)."""
        if rec.group is None and not rec.skipped:
            self._retention.ended(rec.path, rec.superseded, has_local and bool(self._cfg.local_dirs),
                                  owns_persistent=True, token=token)
        return rec

    def fence(self) -> float:
        """See ``Checkpointer.fence`` (``save.lazy``)."""
        return self._lazy.fence()
