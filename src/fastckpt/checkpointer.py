"""The Checkpointer: save, commit, load, remove, wait, close. The one orchestrator.

Order of work for one ``save(state, path)`` (docs/core.md):
  training thread : plan the file (torch.save metadata, no data) -> acquire a staging buffer
                    -> snapshot into it -> return a SaveHandle          (the blocked part)
  writer thread   : write the image to a temp file (parallel chunks, O_DIRECT), fsync,
                    rename into place, fsync the directory     (pipeline.py: write, commit)
  replicators     : nvme/gds with local_dir: copy or upload to ``path``, verify, publish
                    (replicate.py)
  committer pool  : groups only: rank marker, then rank 0 publishes (groups.py, commit.py)
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from . import commit as C
from . import format as F
from .background import InFlight, set_surfaced
from .config import CheckpointerConfig
from .errors import ConfigError, ReplicationError
from .events import Event, EventSink, JsonlSink
from .groups import Groups
from .io import FileOps
from .monitor import Monitor, Stats
from .pipeline import Pipeline, reraise
from .places import LocalPlace, Place, TargetPlace, is_url, mirror_path, normalize
from .records import SaveHandle, SaveRecord
from .replicate import ReplicaJob, Replicator, TargetCache
from .restore import load_any
from .retention import Retention
from .staging import LazySnapshot, Progress, Snapshot, StagingPool, snapshot
from .tiers import TierSelector

log = logging.getLogger("fastckpt")
TAIL_ROOM = F.MAX_COMMENT + 2
PROGRESS_EVERY_S = 10.0


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Checkpointer:
    """Saves that return after a snapshot and become durable in the background.

    Args:
        local_dir: node-local burst buffer (NVMe). Files land there first and are copied to
            the path given to ``save`` in the background (nvme tier). None writes straight to
            the path (direct tier). URL paths (``s3://...``) need it.
        tier: "auto", "gds", "nvme" or "direct" (docs/tiers.md).
        overhead_budget: fraction of wall time saves may block before the alarm (0.02 = 2 %).
        event_log: JSONL file that receives one event per phase of every save.
        ops: the FileOps seam (tests inject faults through it).
        sinks: extra EventSinks.
        **options: the other ``CheckpointerConfig`` fields: on_overhead_exceeded,
            overhead_window_s, when_busy, staging_buffers, io_threads, chunk_bytes, odirect,
            overlap_write, commit_timeout_s,
            rank, world_size, keep_local, keep_persistent, replicate_bandwidth_Bps,
            replicate_policy, replicate_verify, replicate_workers, storage_options, retry_deadline_s,
            close_timeout_s (docs/core.md and docs/burst-buffer.md).
    """

    def __init__(self, local_dir: str | None = None, tier: str = "auto", overhead_budget: float = 0.02,
                 event_log: str | None = None, *, ops: FileOps | None = None,
                 sinks: tuple[EventSink, ...] = (), **options: object) -> None:
        unknown = set(options) - set(CheckpointerConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown Checkpointer option(s) {sorted(unknown)}; see docs/core.md for the options")
        self.config = cfg = CheckpointerConfig(local_dir=local_dir, tier=tier, overhead_budget=overhead_budget,
                                               event_log=event_log, **options)  # type: ignore[arg-type]
        self._ops = ops or FileOps()
        self._tiers = TierSelector(cfg.tier, cfg.local_dir, cfg.odirect)
        self._monitor = Monitor(cfg.overhead_budget, cfg.overhead_window_s, cfg.on_overhead_exceeded)
        self._jsonl = JsonlSink(cfg.event_log) if cfg.event_log else None
        self._sinks: tuple[EventSink, ...] = tuple(sinks) + ((self._jsonl,) if self._jsonl else ())
        self._staging = StagingPool(cfg.staging_buffers)
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="fastckpt-io")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-write")
        self._committer = ThreadPoolExecutor(4, thread_name_prefix="fastckpt-commit")
        self._snapper = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-snapshot")  # lazy saves
        self._lazy: list[tuple[Future, float, float, int]] = []  # (copy, t_call, blocked, bytes)
        self._lock = threading.Lock()
        self._inflight = InFlight()
        self._stop = threading.Event()
        self._closed = False
        self._last_restore: tuple[float | None, str | None] = (None, None)
        self._targets = TargetCache(cfg.storage_options, cfg.retry_deadline_s, cfg.io_threads, self._on_retry)
        self._pipeline = Pipeline(cfg, self._ops, self._io, self._staging, self._monitor, self._emit)
        self._replicator = Replicator(cfg, self._ops, self._io, self._targets, self._emit,
                                      self._monitor.record_durable)
        self._groups = Groups(self._committer, self._stop, cfg.commit_timeout_s, self._place, self._emit)
        self._retention = Retention(cfg.keep_local, cfg.keep_persistent, self._delete_local, self._delete_persistent)
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ identity and places
    @property
    def rank(self) -> int:
        return self.config.rank if self.config.rank is not None else _dist_rank_world()[0]

    @property
    def world_size(self) -> int:
        return self.config.world_size if self.config.world_size is not None else _dist_rank_world()[1]

    def local_path(self, path: str) -> str | None:
        """Where the burst-buffer copy of ``path`` lives (None without local_dir)."""
        if self.config.local_dir is None:
            return None
        return mirror_path(self.config.local_dir, normalize(path))

    def _place(self, group: str) -> Place:
        if is_url(group):
            target, key = self._targets.get(group)
            return TargetPlace(target, key)
        return LocalPlace(group, self._ops)

    def _emit(self, name: str, path: str, nbytes: int, start: float, tier: str,
              error: BaseException | None = None, detail: str | None = None) -> None:
        ev = Event(name, self.rank, path, nbytes, start, time.time(), tier,
                   repr(error) if error else None, detail)
        for s in self._sinks:
            s.emit(ev)

    def _on_retry(self, notice) -> None:  # noqa: ANN001 (a targets.RetryNotice)
        """A transient storage error is being retried: an event, so outages are visible."""
        now = time.time()
        self._emit("retry", notice.what, 0, now - notice.elapsed_s, "replicate", notice.error,
                   detail=f"attempt={notice.attempt} next_in_s={notice.delay_s:.2f}")

    # ------------------------------------------------------------------ save
    def reserve(self, nbytes: int, *, pinned: bool = False) -> Future:
        """Allocate the ``staging_buffers`` staging buffers for files of about ``nbytes`` now, on
        a background thread, so the first save does not (docs/core.md). A save arriving meanwhile
        waits for them and never allocates a second copy; a larger one allocates its own.

        Args:
            nbytes: one checkpoint file's expected size: the tensors' bytes, each rounded up to
                4 KiB, plus a margin for the metadata.
            pinned: True for states on CUDA devices (pinned host memory).

        Returns:
            A Future resolving to the number of buffers allocated, or holding the allocation's
            error (logged; the next save then allocates, and raises, itself).
        """
        self._check_open()
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        return self._staging.reserve(int(nbytes) + TAIL_ROOM, pinned)

    def save(self, state_dict: object, path: str, group: str | None = None, *, lazy: bool = False) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the file becomes durable at ``path`` later.

        Args:
            state_dict: tensors in (nested) dicts/lists and plain Python values.
            path: the checkpoint file's durable home: a path, or an fsspec URL with local_dir.
            group: a directory (or URL prefix) holding this file and others, from this and
                other ranks, that form one checkpoint; finish with ``commit(group)`` on every rank.
            lazy: return before the tensors' bytes are copied: the copy runs on a background
                thread while training goes on, and ``fence()`` must be called before anything
                mutates them (the next optimizer step). The record's ``blocked_s`` is the part
                spent here; ``fence()`` returns its wait, which ``stats()`` counts as blocked
                time too. Ignored on the gds tier.

        Raises:
            UnsupportedObjectError: an entry cannot be saved (the message names its key).
            ConfigError: a URL path without local_dir, or a path outside its group.
        """
        self._check_open()
        self._inflight.raise_unseen()
        t_call, w_call = time.monotonic(), time.time()
        path = normalize(path)
        group = normalize(group) if group is not None else None
        if group is not None and not path.startswith(group.rstrip("/") + "/"):
            raise ConfigError(f"{path} is not inside its group directory {group}")
        if is_url(path) and self.config.local_dir is None:
            raise ConfigError(f"{path} is a URL: saving there needs local_dir=<node-local directory>, the "
                              "burst buffer the upload is made from")
        layout = F.plan(state_dict)
        has_cuda = any(r.storage.device.type == "cuda" for r in layout.storages)
        try:
            choice = self._tiers.choose(os.path.dirname(path) if not is_url(path) else path, has_cuda)
        except OSError as exc:  # the probe could not write there: unwritable, not a directory...
            reraise(exc, path)
        if group is not None:
            self._groups.begin(group, self.rank, self.world_size)
            self._unpublish_local(group)
        dest = self.local_path(path) or path
        base = SaveRecord(path, choice.tier, layout.data_size, 0.0, 0.0, 0.0, None, rank=self.rank, group=group)
        if choice.tier == "gds":
            tmp = self._pipeline.gds_write(layout, dest)
            blocked = time.monotonic() - t_call
            self._monitor.record_blocked(t_call, blocked, layout.payload_bytes)
            self._emit("snapshot", path, layout.payload_bytes, w_call, choice.tier, detail="gds write")
            base = replace(base, blocked_s=blocked)
            fut = self._writer.submit(self._then_retain, dest == path, self._pipeline.gds_finish,
                                      tmp, layout, base, dest, t_call)
            return self._after_write(fut, base, dest, t_call)
        buf = self._staging.acquire(layout.data_size + TAIL_ROOM, owner=group or object(),
                                    pinned=has_cuda, wait=self.config.when_busy == "wait")
        if buf is None:
            self._monitor.record_skipped()
            warnings.warn(f"fastckpt: skipped save of {path}: the previous save still holds the staging "
                          "buffer (when_busy='skip')", stacklevel=2)
            if group is not None:
                self._groups.skipped(group, path)
            return SaveHandle.finished(replace(base, bytes=0, blocked_s=time.monotonic() - t_call, skipped=True))
        if self.config.overlap_write and not lazy and not has_cuda:
            return self._save_overlapped(layout, buf, base, dest, t_call, w_call, choice)
        if lazy:
            snap = LazySnapshot(self._snapper.submit(snapshot, layout, buf), layout, buf)
        else:
            try:
                snap = snapshot(layout, buf)
            except BaseException:
                self._staging.release(buf)
                raise
        blocked = time.monotonic() - t_call
        if lazy:  # fence() waits for the copy and counts that wait as blocked time
            with self._lock:
                self._lazy.append((snap.future, t_call, blocked, layout.payload_bytes))
        else:
            self._monitor.record_blocked(t_call, blocked, layout.payload_bytes)
        self._emit("snapshot", path, layout.payload_bytes, w_call, choice.tier, detail="lazy" if lazy else None)
        base = replace(base, blocked_s=blocked)
        fut = self._writer.submit(self._then_retain, dest == path, self._pipeline.write,
                                  snap, base, dest, t_call, choice.odirect)
        return self._after_write(fut, base, dest, t_call)

    def _save_overlapped(self, layout: F.FileLayout, buf, base: SaveRecord, dest: str, t_call: float,  # noqa: ANN001
                         w_call: float, choice) -> SaveHandle:  # noqa: ANN001
        """CPU state: the writer starts at once and follows the copy into the staging buffer,
        so the file is durable about one write time after the call, not copy + write."""
        progress, base_f = Progress(), Future()
        fut = self._writer.submit(self._then_retain, dest == base.path, self._pipeline.write,
                                  Snapshot(buf, layout, None, progress), base_f, dest, t_call, choice.odirect)
        try:
            snapshot(layout, buf, progress)
        except BaseException as exc:
            set_surfaced(exc)  # raised here, to the caller; the writer re-raises the same object
            progress.finish(exc)
            base_f.set_result(base)
            self._inflight.track(fut, base.path, base.group)
            raise
        blocked = time.monotonic() - t_call
        self._monitor.record_blocked(t_call, blocked, layout.payload_bytes)
        self._emit("snapshot", base.path, layout.payload_bytes, w_call, choice.tier)
        base = replace(base, blocked_s=blocked)
        base_f.set_result(base)
        return self._after_write(fut, base, dest, t_call)

    def _then_retain(self, final: bool, stage, *args) -> SaveRecord:  # noqa: ANN001
        """Run a write stage; when it made the checkpoint durable at its home, apply retention
        before the handle resolves (so ``wait()`` returning means retention has run)."""
        rec = stage(*args)
        return self._retain(rec) if final else rec

    def _after_write(self, fut: Future, base: SaveRecord, dest: str, t_call: float) -> SaveHandle:
        """Chain replication when the file went to the burst buffer; track; apply retention."""
        if dest != base.path:
            final: Future = Future()

            def enqueue(f: Future) -> None:
                exc = f.exception()
                if exc is not None:
                    final.set_exception(exc)
                    return
                rec = f.result()
                job = ReplicaJob(rec, dest, t_call, time.time(), final, finish=self._retain)
                try:
                    self._replicator.submit(job)
                except RuntimeError as err:  # closed under us: nothing will replicate it
                    final.set_exception(ReplicationError(f"{rec.path} was not replicated: {err}"))

            fut.add_done_callback(enqueue)
            fut = final
        handle = self._inflight.track(fut, base.path, base.group)
        if base.group is not None:
            self._groups.add(base.group, handle)
        return handle

    def _retain(self, rec: SaveRecord) -> SaveRecord:
        """A single-file checkpoint is verified at its home: apply keep_local/keep_persistent."""
        if rec.group is None and not rec.superseded and not rec.skipped:
            self._retention.durable(rec.path, self.config.local_dir is not None, owns_persistent=True)
        return rec

    # ------------------------------------------------------------------ groups
    def commit(self, group: str, *, move_latest: bool = True, **extra: object) -> SaveHandle:
        """This rank is done saving into ``group``; every rank must call it.

        Returns a handle that completes when the whole group is durable and published (on
        rank 0 after it wrote the manifest, on other ranks once they see it). ``extra``
        (e.g. ``step=100``) is recorded in the group manifest. ``move_latest=False`` publishes
        the group without pointing ``parent/latest`` at it (give the same value on every rank).
        """
        self._check_open()
        self._inflight.raise_unseen()
        group = normalize(group)
        rank, has_local = self.rank, self.config.local_dir is not None

        def retain(rec: SaveRecord) -> SaveRecord:
            if not rec.superseded:
                if has_local:
                    self._publish_local(group)
                self._retention.durable(group, has_local, owns_persistent=rank == 0)
            return rec

        fut = self._groups.commit(group, rank, self.world_size, dict(extra), retain, move_latest)
        return self._inflight.track(fut, group, group)

    def _publish_local(self, group: str) -> None:
        """The group is durable at its home: give this node's burst-buffer copy the same manifest,
        so loads read the local files (each file still verifies its own checksum)."""
        local = self.local_path(group)
        data = self._place(group).get(C.GROUP_MANIFEST)
        if local is None or data is None or not os.path.isdir(local):
            return  # a newer attempt replaced it already, or this rank kept no local files
        LocalPlace(local, self._ops).put(C.GROUP_MANIFEST, data)

    def _unpublish_local(self, group: str) -> None:
        """A new attempt at ``group``: its local copy stops counting as complete until it commits."""
        local = self.local_path(group)
        if local is not None:
            LocalPlace(local, self._ops).delete(C.GROUP_MANIFEST)

    # ------------------------------------------------------------------ load / remove / latest
    def load(self, path: str, map_location: object = None, *, weights_only: bool = True,
             prefetch: bool = False) -> object:
        """Read a checkpoint file in parallel, verify its checksum, return the saved object.

        Prefers a verified burst-buffer copy in ``local_dir`` and falls back to ``path``
        (a URL is read with parallel ranged requests into memory; with ``prefetch=True`` and
        local_dir it is first downloaded into the burst buffer, so the next load is local).

        Raises:
            CorruptCheckpointError: the bytes do not match the recorded checksum.
            IncompleteCheckpointError: the file belongs to a group that was never committed.
        """
        path = normalize(path)
        t0, w0 = time.monotonic(), time.time()
        cfg = self.config
        obj, used, where = load_any(self._ops, self._io, self._targets, path, self.local_path(path),
                                    map_location, weights_only, prefetch, cfg.chunk_bytes, cfg.odirect)
        size = os.path.getsize(used) if os.path.exists(used) else 0
        rto = time.monotonic() - t0
        self._last_restore = (rto, where)
        self._emit("load", used, size, w0, where, detail=f"rto_s={rto:.6f}")
        return obj

    def latest(self, root: str) -> str | None:
        """The newest complete checkpoint under ``root`` (directory or URL), or None."""
        return latest(root, self.config.storage_options)

    def remove(self, path: str) -> None:
        """Delete a checkpoint file or group, after any save in flight to it has finished.

        A single file whose replication has not started yet is not replicated (its handle
        resolves with ``cancelled=True``); an upload or group commit under way is waited for.
        """
        path = normalize(path)
        with self._replicator.cancelling(path):
            for f in self._inflight.writing(path, "/" if is_url(path) else os.sep):
                try:
                    f.result()
                except BaseException:  # noqa: BLE001 (surfaced at the next sync point)
                    log.debug("save to %s failed before its removal", path)
        self._retention.forget(path)
        self._delete_local(path)
        self._delete_persistent(path)

    def _delete_local(self, path: str) -> None:
        local = self.local_path(path)
        if local and os.path.isdir(local):
            C.remove_group(self._ops, local)
        elif local and os.path.lexists(local):
            self._ops.unlink(local)

    def _delete_persistent(self, path: str) -> None:
        if is_url(path):
            from .remote import delete_remote

            delete_remote(self._targets, path)
        elif os.path.isdir(path):
            C.remove_group(self._ops, path)
        elif os.path.lexists(path):
            self._ops.unlink(path)

    # ------------------------------------------------------------------ lifecycle
    def fence(self) -> float:
        """Wait until every lazy save has copied its tensors; return the seconds waited.

        Call it before the saved tensors are mutated (the optimizer step). The wait counts as
        blocked time in ``stats()``; a failed copy surfaces through its save's handle.
        """
        with self._lock:
            lazy, self._lazy = self._lazy, []
        t0 = time.monotonic()
        for fut, _, _, _ in lazy:
            fut.exception()  # only waits: the write stage re-raises a failed copy
        waited = time.monotonic() - t0
        for i, (_, t_call, blocked, nbytes) in enumerate(lazy):
            self._monitor.record_blocked(t_call, blocked + (waited if i == 0 else 0.0), nbytes)
        return waited

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending save, replication and commit is done; raise a background
        error once. Logs progress every 10 s while it waits.

        Raises:
            ReplicationError: ``timeout_s`` passed first (naming what is still pending; the
                local copies are kept).
        """
        self.fence()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            futures = self._inflight.futures()
            if not futures:
                break
            step = PROGRESS_EVERY_S if deadline is None else min(PROGRESS_EVERY_S, max(0.0, deadline - time.monotonic()))
            _, not_done = cf.wait(futures, timeout=step)
            if not not_done:
                continue
            pending = self._replicator.pending()
            if deadline is not None and time.monotonic() >= deadline:
                raise ReplicationError(
                    f"{len(not_done)} save(s) still pending after {timeout_s:.0f} s (replicating: {pending}); "
                    f"their local copies are kept in {self.config.local_dir}. Raise close_timeout_s, or check "
                    "the storage target.")
            log.warning("fastckpt: waiting for %d pending save(s); replicating %s (lag %.0f s)",
                        len(not_done), pending, self._replicator.lag_s())
        self._inflight.raise_unseen()

    def stats(self) -> Stats:
        r = self._replicator
        rto, where = self._last_restore
        return self._monitor.stats(len(self._inflight), replication_lag_s=r.lag_s(), rpo_s=r.rpo_s(),
                                   replication_pending=len(r.pending()), replication_failures=r.failures,
                                   last_restore_s=rto, last_restore_from=where)

    def close(self) -> None:
        """Flush pending saves and replication (up to ``close_timeout_s``), stop the workers,
        and raise any background error once."""
        if self._closed:
            return
        try:
            self.wait(self.config.close_timeout_s)
        finally:
            self._closed = True
            self._stop.set()
            self._replicator.close()
            for ex in (self._snapper, self._committer, self._writer, self._io):
                ex.shutdown(wait=True)
            self._staging.close()
            if self._jsonl:
                self._jsonl.close()
            atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        if self._closed:
            return
        n = len(self._inflight)
        if n:
            log.warning("fastckpt: flushing %d pending save(s) at interpreter exit (replicating: %s); call "
                        "close() (or use the Checkpointer as a context manager) to do this explicitly",
                        n, self._replicator.pending())
        try:
            self.close()
        except BaseException as exc:  # noqa: BLE001 (at exit there is no caller left to raise to)
            log.error("fastckpt: a pending save failed at exit: %r", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed; create a new one")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def latest(root: str, storage_options: dict | None = None) -> str | None:
    """The newest complete checkpoint under ``root`` (a directory or a URL), or None.

    Single files and group directories count, in subfolders too; incomplete ones are skipped.
    """
    root = os.fspath(root)
    if is_url(root):
        from .remote import latest_remote

        return latest_remote(TargetCache(storage_options, 300.0, 4), normalize(root))
    return C.latest(root)


