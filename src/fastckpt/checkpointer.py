"""The Checkpointer: save, commit, load, remove, wait, close. The one orchestrator.

Order of work for one ``save(state, path)`` (see docs/design.md):
  training thread : plan the file (torch.save metadata, no data) -> acquire a staging buffer
                    -> snapshot into it -> return a SaveHandle          (the blocked part)
  writer thread   : write the image to a temp file (parallel chunks, O_DIRECT), fsync,
                    rename into place, fsync the directory             (write, commit)
  replicator      : nvme tier only: copy the committed local file to ``path``, verified
  committer pool  : groups only: rank marker, then (rank 0) wait for every rank and publish
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from . import commit as C
from . import format as F
from .config import CheckpointerConfig
from .errors import CheckpointWriteError, FastCkptError
from .events import Event, EventSink, JsonlSink
from .io import FileOps
from .io.engine import copy_file, write_file
from .io.gds import finish_gds_file, gds_write
from .monitor import Monitor, Stats
from .records import SaveHandle, SaveRecord
from .restore import load_file
from .staging import LazySnapshot, StagingPool, snapshot
from .tiers import TierSelector

log = logging.getLogger("fastckpt")
TAIL_ROOM = F.MAX_COMMENT + 2


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Checkpointer:
    """Saves that return after a snapshot and become durable in the background.

    Args:
        local_dir: node-local burst buffer (NVMe). Files land there first and are copied to
            the path given to ``save`` in the background (nvme tier). None writes straight to
            the path (direct tier).
        tier: "auto", "gds", "nvme" or "direct" (docs/tiers.md).
        overhead_budget: fraction of wall time saves may block before the alarm (0.02 = 2 %).
        event_log: JSONL file that receives one event per phase of every save.
        on_overhead_exceeded: called with an ``OverheadReport`` when the budget is crossed.
        when_busy: "wait" (default) blocks a save until the previous one frees its staging
            buffer (counted as blocked time); "skip" drops the save with a warning.
        io_threads: parallel chunk writers/readers. chunk_bytes: bytes per I/O request.
        odirect: use O_DIRECT where the filesystem allows it.
        commit_timeout_s: how long rank 0 waits for the other ranks of a group.
        rank, world_size: default to torch.distributed's (or RANK/WORLD_SIZE, else 0/1).
        ops: the FileOps seam (tests inject faults through it).
        sinks: extra EventSinks.
    """

    def __init__(self, local_dir: str | None = None, tier: str = "auto", overhead_budget: float = 0.02,
                 event_log: str | None = None, *, ops: FileOps | None = None,
                 sinks: tuple[EventSink, ...] = (), **options) -> None:  # noqa: ANN003 (CheckpointerConfig fields)
        self.config = CheckpointerConfig(local_dir=local_dir, tier=tier, overhead_budget=overhead_budget,
                                         event_log=event_log, **options)
        cfg = self.config
        self._ops = ops or FileOps()
        self._tiers = TierSelector(cfg.tier, cfg.local_dir, cfg.odirect)
        self._monitor = Monitor(cfg.overhead_budget, cfg.overhead_window_s, cfg.on_overhead_exceeded)
        self._jsonl = JsonlSink(cfg.event_log) if cfg.event_log else None
        self._sinks: tuple[EventSink, ...] = tuple(sinks) + ((self._jsonl,) if self._jsonl else ())
        self._pool = StagingPool()
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="fastckpt-io")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-write")
        self._replicator = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-replicate")
        self._committer = ThreadPoolExecutor(4, thread_name_prefix="fastckpt-commit")
        self._snapper = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-snapshot")  # lazy saves
        self._lazy: list[tuple[Future, float, float, int]] = []  # (copy, t_call, blocked, bytes)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, str, str | None]] = {}
        self._unseen: list[BaseException] = []  # failures not yet raised to the caller
        self._groups: dict[str, _GroupAttempt] = {}
        self._stop = threading.Event()
        self._swept: set[str] = set()
        self._closed = False
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ identity
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
        return os.path.join(self.config.local_dir, os.path.abspath(path).lstrip(os.sep))

    # ------------------------------------------------------------------ errors
    def _mark_seen(self, exc: BaseException) -> None:
        with self._lock:
            _set_surfaced(exc)
            self._unseen = [e for e in self._unseen if e is not exc]

    def _on_done(self, fut: Future) -> None:
        exc = fut.exception()
        with self._lock:
            self._pending.pop(id(fut), None)
            if exc is not None and not _surfaced(exc) and all(e is not exc for e in self._unseen):
                self._unseen.append(exc)

    def _raise_background_error(self) -> None:
        with self._lock:
            # A future is done before its done-callbacks run (and result() returns then): collect
            # failures of finished futures here too, so the sync point that follows sees them.
            for fut, _, _ in self._pending.values():
                exc = fut.exception() if fut.done() and not fut.cancelled() else None
                if exc is not None and not _surfaced(exc) and all(e is not exc for e in self._unseen):
                    self._unseen.append(exc)
            if not self._unseen:
                return
            exc = self._unseen.pop(0)
            _set_surfaced(exc)
        raise exc

    def _emit(self, name: str, path: str, nbytes: int, start: float, tier: str,
              error: BaseException | None = None, detail: str | None = None) -> None:
        ev = Event(name, self.rank, path, nbytes, start, time.time(), tier,
                   repr(error) if error else None, detail)
        for s in self._sinks:
            s.emit(ev)

    def _track(self, fut: Future, path: str, group: str | None) -> SaveHandle:
        with self._lock:
            self._pending[id(fut)] = (fut, path, group)
        fut.add_done_callback(self._on_done)
        return SaveHandle(fut, path, self._mark_seen)

    # ------------------------------------------------------------------ save
    def save(self, state_dict: object, path: str, group: str | None = None, *, lazy: bool = False) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the file becomes durable at ``path`` later.

        Args:
            state_dict: tensors in (nested) dicts/lists and plain Python values.
            path: the checkpoint file's durable home.
            group: a directory that holds this file and others (from this and other ranks)
                forming one checkpoint; finish with ``commit(group)`` on every rank.
            lazy: return before the tensors' bytes are copied: the copy runs on a background
                thread while training goes on, and ``fence()`` must be called before anything
                mutates them (the next optimizer step). The Python structure is captured now.
                The record's ``blocked_s`` is then the part spent here; ``fence()`` returns its
                wait, which ``stats()`` counts as blocked time too. Ignored on the gds tier.

        Raises:
            UnsupportedObjectError: an entry cannot be saved (the message names its key).
        """
        self._check_open()
        self._raise_background_error()
        t_call, w_call = time.monotonic(), time.time()
        path = os.path.abspath(os.fspath(path))
        group = os.path.abspath(group) if group is not None else None
        if group is not None and not path.startswith(group + os.sep):
            raise ValueError(f"{path} is not inside its group directory {group}")
        layout = F.plan(state_dict)
        has_cuda = any(r.storage.device.type == "cuda" for r in layout.storages)
        try:
            choice = self._tiers.choose(os.path.dirname(path), has_cuda)
        except OSError as exc:  # the probe could not write there: unwritable, not a directory...
            _reraise(exc, path)
        if group is not None and group not in self._groups:
            self._begin_group(group)
        if choice.tier == "gds":
            return self._save_gds(layout, path, group, choice.tier, t_call, w_call)
        buf = self._pool.acquire(layout.data_size + TAIL_ROOM, owner=group or object(),
                                 pinned=has_cuda, wait=self.config.when_busy == "wait")
        if buf is None:
            self._monitor.record_skipped()
            warnings.warn(f"fastckpt: skipped save of {path}: the previous save still holds the staging "
                          "buffer (when_busy='skip')", stacklevel=2)
            if group is not None:
                self._groups[group].skipped.append(path)
            return SaveHandle.finished(SaveRecord(path, choice.tier, 0, time.monotonic() - t_call, 0, 0, 0,
                                                  skipped=True, rank=self.rank, group=group))
        if lazy:
            snap = LazySnapshot(self._snapper.submit(snapshot, layout, buf), layout, buf)
        else:
            try:
                snap = snapshot(layout, buf)
            except BaseException:
                self._pool.release(buf)
                raise
        blocked = time.monotonic() - t_call
        if lazy:  # fence() waits for the copy and counts that wait as blocked time
            with self._lock:
                self._lazy.append((snap.future, t_call, blocked, layout.payload_bytes))
        else:
            self._monitor.record_blocked(t_call, blocked, layout.payload_bytes)
        self._emit("snapshot", path, layout.payload_bytes, w_call, choice.tier, detail="lazy" if lazy else None)
        base = SaveRecord(path, choice.tier, layout.data_size, blocked, 0.0, 0.0, 0.0,
                          rank=self.rank, group=group)
        fut = self._writer.submit(self._write_stage, snap, base, t_call, choice.odirect)
        if choice.tier in ("nvme", "gds") and self.config.local_dir is not None:
            fut = self._chain(self._replicator, fut, self._replicate_stage, t_call)
        handle = self._track(fut, path, group)
        if group is not None:
            self._groups[group].handles.append(handle)
        return handle

    def _save_gds(self, layout: F.FileLayout, path: str, group: str | None, tier: str,
                  t_call: float, w_call: float) -> SaveHandle:
        """GPU -> file with kvikio while the caller waits; checksum and commit in the background."""
        dest = self.local_path(path) or path
        self._ops.makedirs(os.path.dirname(dest))
        tmp = C.tmp_name(dest)
        try:
            gds_write(tmp, layout)
        except BaseException:
            C.discard(self._ops, tmp)
            raise
        blocked = time.monotonic() - t_call
        self._monitor.record_blocked(t_call, blocked, layout.payload_bytes)
        self._emit("snapshot", path, layout.payload_bytes, w_call, tier, detail="gds write")
        base = SaveRecord(path, tier, layout.data_size, blocked, blocked, 0.0, 0.0, rank=self.rank, group=group)

        def finish() -> SaveRecord:
            try:
                res = finish_gds_file(self._ops, self._io, tmp, layout,
                                      lambda d: self._tail(base, layout, d), self.config.chunk_bytes)
                self._ops.replace(tmp, dest)
                self._ops.fsync_dir(os.path.dirname(dest))
            except BaseException as exc:
                C.discard(self._ops, tmp)
                _reraise(exc, path)
            done = time.monotonic() - t_call
            local = dest != path
            return replace(base, bytes=res.bytes, commit_s=done, checksum=res.checksum, odirect=True,
                           durable_s=0.0 if local else done, local_durable_s=done if local else None)

        fut = self._writer.submit(finish)
        if dest != path:
            fut = self._chain(self._replicator, fut, self._replicate_stage, t_call)
        handle = self._track(fut, path, group)
        if group is not None:
            self._groups[group].handles.append(handle)
        return handle

    def _tail(self, base: SaveRecord, layout: F.FileLayout, digest: str) -> bytes:
        body = F.comment_bytes(self._manifest(base, layout, digest))
        return F.comment_length_field(len(body)) + body

    def _sweep(self, directory: str) -> None:
        """Once per directory: remove temp files that killed processes left there."""
        if directory not in self._swept:
            self._swept.add(directory)
            n = C.sweep_stale_tmp(self._ops, directory)
            if n:
                log.info("fastckpt: removed %d temp file(s) of dead processes in %s", n, directory)

    def _begin_group(self, group: str) -> None:
        """First touch of a group by this rank in this attempt (training thread).

        An earlier attempt at the same tag (a resumed run re-saving ``global_step{N}``) is
        invalidated first: its manifest goes, so no reader mixes old and new files, and this
        rank's old marker goes. Markers and the manifest carry the attempt's token, agreed
        through the process group's key-value store (not a collective) when there is one.
        """
        self._groups[group] = _GroupAttempt(C.attempt_token(group, self.world_size), time.time())
        C.discard(self._ops, os.path.join(group, C.GROUP_MANIFEST))
        C.discard(self._ops, C.marker_path(group, self.rank))

    def _chain(self, executor: ThreadPoolExecutor, prev: Future, fn, *args) -> Future:  # noqa: ANN001
        return executor.submit(lambda: fn(prev.result(), *args))

    def _manifest(self, rec: SaveRecord, layout: F.FileLayout, digest: str) -> dict:
        return {"format": F.FORMAT_VERSION, "kind": "file", "covered": layout.covered_bytes,
                "checksum": {"algo": "xxh3_64-tree-16MiB", "value": digest}, "rank": rec.rank,
                "group": os.path.basename(rec.group) if rec.group else None, "tier": rec.tier,
                "group_rel": os.path.relpath(rec.path, rec.group) if rec.group else None,
                "payload_bytes": layout.payload_bytes, "written_at": time.time(),
                "blocked_s": round(rec.blocked_s, 6),
                "versions": {"fastckpt": _version(), "torch": F.torch_version()}}

    def _write_stage(self, snap, base: SaveRecord, t_call: float, odirect: bool) -> SaveRecord:  # noqa: ANN001
        dest = self.local_path(base.path) if base.tier in ("nvme", "gds") and self.config.local_dir else base.path
        w0 = time.time()
        tmp = C.tmp_name(dest)
        try:
            snap.wait_ready()
            layout = snap.layout
            self._ops.makedirs(os.path.dirname(dest))
            self._sweep(os.path.dirname(dest))
            res = write_file(self._ops, self._io, tmp, snap.buffer.view, layout.covered_bytes,
                             lambda digest: self._tail(base, layout, digest),
                             chunk_bytes=self.config.chunk_bytes, odirect=odirect)
        except BaseException as exc:
            C.discard(self._ops, tmp)
            self._emit("write", base.path, base.bytes, w0, base.tier, exc)
            _reraise(exc, base.path)
        finally:
            self._pool.release(snap.buffer)
        write_s = time.monotonic() - t_call
        self._emit("write", dest, res.bytes, w0, base.tier,
                   detail=None if res.odirect else f"buffered: {res.odirect_reason}")
        c0 = time.time()
        try:
            self._ops.replace(tmp, dest)
            self._ops.fsync_dir(os.path.dirname(dest))
        except BaseException as exc:
            renamed = not os.path.lexists(tmp)
            C.discard(self._ops, tmp)
            self._emit("commit", dest, res.bytes, c0, base.tier, exc)
            _reraise(exc, base.path, renamed)
        commit_s = time.monotonic() - t_call
        self._emit("commit", dest, res.bytes, c0, base.tier)
        local = dest != base.path
        rec = replace(base, bytes=res.bytes, write_s=write_s, commit_s=commit_s,
                      durable_s=0.0 if local else commit_s, local_durable_s=commit_s if local else None,
                      checksum=res.checksum, odirect=res.odirect, odirect_reason=res.odirect_reason)
        if not local:
            self._monitor.record_durable(commit_s)
        return rec

    def _replicate_stage(self, rec: SaveRecord, t_call: float) -> SaveRecord:
        src = self.local_path(rec.path)
        assert src is not None  # noqa: S101 (only chained for the local tiers)
        r0 = time.time()
        tmp = C.tmp_name(rec.path)
        try:
            self._ops.makedirs(os.path.dirname(rec.path))
            covered = C.read_file_manifest(src)["covered"]
            res = copy_file(self._ops, self._io, src, tmp, rec.bytes, covered,
                            chunk_bytes=self.config.chunk_bytes, odirect=self.config.odirect)
            if res.checksum != rec.checksum:
                raise CheckpointWriteError(
                    f"copy of {src} to {rec.path} read back checksum {res.checksum}, expected "
                    f"{rec.checksum}: the local copy changed or the read failed; not publishing it")
            self._ops.replace(tmp, rec.path)
            self._ops.fsync_dir(os.path.dirname(rec.path))
        except BaseException as exc:
            renamed = not os.path.lexists(tmp)
            C.discard(self._ops, tmp)
            self._emit("replicate", rec.path, rec.bytes, r0, rec.tier, exc)
            _reraise(exc, rec.path, renamed)
        durable = time.monotonic() - t_call
        self._emit("replicate", rec.path, rec.bytes, r0, rec.tier)
        self._monitor.record_durable(durable)
        return replace(rec, durable_s=durable)

    # ------------------------------------------------------------------ groups
    def commit(self, group: str, **extra: object) -> SaveHandle:
        """This rank is done saving into ``group``; every rank must call it.

        Returns a handle that completes when the whole group is durable and published (on
        rank 0 after it wrote the manifest, on other ranks once they see it). ``extra``
        (e.g. ``step=100``) is recorded in the group manifest.
        """
        self._check_open()
        self._raise_background_error()
        group = os.path.abspath(group)
        if group not in self._groups:
            self._begin_group(group)  # a rank that saved nothing into this group
        attempt = self._groups.pop(group)
        handles = attempt.handles
        rank, world, t_call = self.rank, self.world_size, time.monotonic()
        requested_at = time.time()  # orders overlapping commits (commit.group_order)
        timeout = self.config.commit_timeout_s

        def run() -> SaveRecord:
            try:
                return commit_group()
            except OSError as exc:
                _reraise(exc, group)

        def commit_group() -> SaveRecord:
            c0 = time.time()
            recs = [h._future.result() for h in handles]  # a failed save stops the commit here
            if attempt.skipped:
                raise FastCkptError(
                    f"checkpoint group {group} not committed: this rank skipped {attempt.skipped} "
                    "(when_busy='skip' found the staging buffer busy); the group stays incomplete")
            files = {os.path.relpath(r.path, group): {"size": r.bytes, "checksum": r.checksum}
                     for r in recs}
            C.write_marker(self._ops, group, rank, world, files, attempt.token, attempt.started_at)
            if rank == 0:
                markers = C.wait_for_markers(group, world, timeout, self._stop, attempt.token,
                                             attempt.started_at - C.STALE_MARKER_S)
                manifest = C.publish_group(self._ops, group, world, markers, dict(extra), requested_at,
                                           attempt.token)
            else:
                manifest = C.wait_for_manifest(group, timeout, self._stop, attempt.token, files)
            total = sum(f["size"] for f in manifest["files"].values())
            self._emit("commit", group, total, c0, recs[0].tier if recs else "direct", detail="group")
            return SaveRecord(group, recs[0].tier if recs else "direct", total,
                              sum(r.blocked_s for r in recs), 0.0, time.monotonic() - t_call,
                              time.monotonic() - t_call, rank=rank, group=group)

        return self._track(self._committer.submit(run), group, group)

    # ------------------------------------------------------------------ load / remove
    def load(self, path: str, map_location: object = None, *, weights_only: bool = True) -> object:
        """Read a checkpoint file in parallel, verify its checksum, return the saved object.

        Prefers a verified burst-buffer copy in ``local_dir`` and falls back to ``path``.

        Raises:
            CorruptCheckpointError: the bytes do not match the recorded checksum.
            IncompleteCheckpointError: the file belongs to a group that was never committed.
        """
        path = os.path.abspath(os.fspath(path))
        t0, w0 = time.monotonic(), time.time()
        local = self.local_path(path)
        candidates = [p for p in (local, path) if p and os.path.exists(p)]
        if len(candidates) == 2 and _other_save(local, path):  # type: ignore[arg-type]
            candidates = [path]  # the local copy is of a save that never reached path (it failed)
        obj, used = load_file(self._ops, self._io, candidates or [path], map_location, weights_only,
                              self.config.chunk_bytes, self.config.odirect)
        self._emit("load", used, os.path.getsize(used), w0, "local" if used == local else "path",
                   detail=f"rto_s={time.monotonic() - t0:.6f}")
        return obj

    def remove(self, path: str) -> None:
        """Delete a checkpoint file or group, after any save in flight to it has finished."""
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            inflight = [f for f, p, g in self._pending.values() if p == path or g == path
                        or p.startswith(path + os.sep)]
        for f in inflight:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 (surfaced at the next sync point)
                log.debug("save to %s failed before its removal", path)
        for p in (self.local_path(path), path):
            if p and os.path.isdir(p):
                C.remove_group(self._ops, p)
            elif p and os.path.lexists(p):
                self._ops.unlink(p)

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

    def wait(self) -> None:
        """Block until every pending save and commit is durable; raise a background error."""
        self.fence()
        with self._lock:
            futures = [f for f, _, _ in self._pending.values()]
        for f in futures:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 (raised once below)
                pass
        self._raise_background_error()

    def stats(self) -> Stats:
        with self._lock:
            pending = len(self._pending)
        return self._monitor.stats(pending)

    def close(self) -> None:
        """Flush pending saves, stop the workers, raise any background error once."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stop.set()
            for ex in (self._snapper, self._committer, self._replicator, self._writer, self._io):
                ex.shutdown(wait=True)
            self._pool.close()
            if self._jsonl:
                self._jsonl.close()
            atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        if self._closed:
            return
        with self._lock:
            n = len(self._pending)
        if n:
            log.warning("fastckpt: flushing %d pending save(s) at interpreter exit; call close() "
                        "(or use the Checkpointer as a context manager) to do this explicitly", n)
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


@dataclass
class _GroupAttempt:
    """This rank's part of one attempt at a group: its saves, skips, token and start time."""

    token: str | None
    started_at: float
    handles: list[SaveHandle] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _reraise(exc: BaseException, path: str, renamed: bool = False) -> None:
    """Raise ``exc``; an OSError becomes a CheckpointWriteError that names the checkpoint.

    ``renamed``: the failure came after the new file was renamed into place (the directory
    fsync), so the message must not claim the previous file is still there.
    """
    if isinstance(exc, FastCkptError) or not isinstance(exc, OSError):
        raise exc
    state = ("the new file is in place but its directory entry may not be durable (directory fsync failed)"
             if renamed else "the previous checkpoint is untouched")
    err = CheckpointWriteError(exc.errno, f"saving {path} failed: {exc.strerror or exc}; {state}")
    err.filename = path
    raise err from exc


# Whether a failure was raised to the caller is marked on the exception itself: a set of id()s
# could mistake a new error for a freed one, and keeping raised errors alive would pin their
# tracebacks' frames (staging buffers, the state's tensors).
_SURFACED = "_fastckpt_surfaced"


def _surfaced(exc: BaseException) -> bool:
    return getattr(exc, _SURFACED, False)


def _set_surfaced(exc: BaseException) -> None:
    setattr(exc, _SURFACED, True)


def _other_save(local: str, path: str) -> bool:
    """True when both copies carry readable manifests with different checksums."""
    try:
        a, b = C.read_file_manifest(local), C.read_file_manifest(path)
    except (OSError, ValueError):  # unreadable: let the verified load decide
        return False
    return bool(a and b) and a.get("checksum") != b.get("checksum")


def _version() -> str:
    from . import __version__

    return __version__
