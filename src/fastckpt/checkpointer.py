"""The Checkpointer: the wiring of the layers, and the public methods that delegate to them.

Order of work for one ``save(state, path)`` (docs/architecture.md has the whole picture):
  training thread : plan the file (torch.save metadata, no data) -> acquire a staging buffer
                    -> snapshot into it -> return a SaveHandle            (save/saver.py)
  writer thread   : write the image to a temp file (parallel chunks, O_DIRECT), fsync,
                    rename into place, fsync the directory                 (save/writer.py)
  replicators     : with local_dir: copy to ``path``'s home, verify, publish (save/replicator.py)
  committer pool  : groups only: rank marker, then rank 0 publishes        (commit/coordinator.py)
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager

from .commit import discovery
from .commit.coordinator import Coordinator
from .commit.foreign import check_step, group_step
from .commit.removable import refuse_root
from .config import CheckpointerConfig, options_doc, options_signature
from .errors import ClosedError
from .events import Event, Fanout, JsonlSink, start_detail
from .exits import close_at_exit, flush_at_exit, forget_at_exit, inherited, ran_threads, stop_pools
from .format.manifest import TAIL_ROOM
from .inflight import InFlight
from .io.ops import FileOps
from .load.loader import Loader, LoadOptions
from .load.missing import nothing_to_load
from .monitor import Monitor, Stats
from .onesave import OneSave
from .records import SaveHandle, SaveRecord, stopped_note
from .save.replicator import Replicator
from .save.retention import Retention
from .save.saver import Saver
from .save.staging import StagingPool
from .save.stripes import Stripes
from .save.tiers import TierSelector
from .save.writer import FileWriter
from .storage.homes import Homes
from .storage.places import Place
from .storage.types import RetryNotice
from .urls import file_name, named, normalize

log = logging.getLogger("fastckpt")


class Checkpointer:
    """Saves that return after a snapshot and become durable in the background."""

    @options_signature(CheckpointerConfig)
    def __init__(self, *args: object, **options: object) -> None:
        self.config = cfg = CheckpointerConfig(*args, **options)  # type: ignore[arg-type]
        self._ops = cfg.ops or FileOps()
        self._staging = StagingPool(cfg.staging_buffers)
        self._monitor = Monitor(cfg.overhead_budget, cfg.overhead_window_s, cfg.on_overhead_exceeded,
                                lambda: self._staging.busy_waited_s)
        self._jsonl = JsonlSink(cfg.event_log, start_detail(cfg.overhead_budget, cfg.overhead_window_s,
                                                            self._monitor.started_at)) if cfg.event_log else None
        self._sinks = Fanout(tuple(cfg.sinks) + ((self._jsonl,) if self._jsonl else ()))
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="fastckpt-io")
        self._writers = tuple(ThreadPoolExecutor(1, thread_name_prefix="fastckpt-write")  # one per burst-buffer drive
                              for _ in range(max(1, len(cfg.local_dirs))))
        self._committer = ThreadPoolExecutor(4, thread_name_prefix="fastckpt-commit")
        self._snapper = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-snapshot")  # lazy saves
        self._inflight, self._group_saved_at = InFlight(), {}  # group -> {file: (wall, monotonic) of its last save}
        self._stop, self._closed, self._closed_by = threading.Event(), False, "by close()"
        self._last_restore: tuple[float | None, str | None] = (None, None)
        self._homes = Homes(cfg.storage_options, retry_deadline_s=cfg.retry_deadline_s, parallelism=cfg.io_threads,
                            on_retry=self._on_retry, ops=self._ops, odirect=cfg.odirect, executor=self._io)
        self._replicator = Replicator(cfg, self._homes, self._emit, self._monitor.record_durable)
        self._coordinator = Coordinator(self._committer, self._stop, cfg, lambda g: self._homes.resolve(g).place(),
                                        self._emit, local_for=self._local_places)
        self._stripes = Stripes(cfg.local_dirs, self.rank, self._homes.store_of)
        self._retention = Retention(cfg.keep_local, cfg.keep_persistent, self._homes, self._stripes.copies, self.rank,
                                    self._inflight.of_group, cfg.commit_timeout_s)
        self._saver = Saver(cfg, tiers=TierSelector(cfg.tier, cfg.local_dirs or None, cfg.odirect, self._ops),
                            staging=self._staging, monitor=self._monitor,
                            writer=FileWriter(self._ops, self._io, self._staging, cfg.chunk_bytes, self._emit,
                                              self._stripes.record, self._stripes.dirs,
                                              self._homes.reaper.unlink_later),
                            writer_threads=self._writers, snapshot_thread=self._snapper, inflight=self._inflight,
                            coordinator=self._coordinator, replicator=self._replicator, retention=self._retention,
                            homes=self._homes, stripes=self._stripes, emit=self._monitor.tagging(self._emit))
        self._loader = Loader(self._homes, self.local_path, cfg.chunk_bytes, self._inflight.wait_loadable, self._emit)
        self._metrics = None
        if cfg.metrics_port is not None:  # last: a scrape may call stats() as soon as it serves
            from .metrics import start_exporter  # lazy: prometheus-client is the optional extra [metrics]

            self._metrics = start_exporter(cfg.metrics_port, self.stats, lambda: self.rank, cfg.local_dirs)
            self._sinks.add(self._metrics)
        flush_at_exit(self)

    # ------------------------------------------------------------------ identity and events
    @property
    def rank(self) -> int:
        return self.config.ranks()[0]

    @property
    def world_size(self) -> int:
        return self.config.ranks()[1]

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus exporter's URL (``metrics_port``), or None without one."""
        return self._metrics.url if self._metrics is not None else None

    def local_path(self, path: str) -> str | None:
        """Where the burst-buffer copy of ``path`` lives: None without local_dir (see ``Stripes.local_path``)."""
        return self._stripes.local_path(normalize(path))

    def _local_places(self, group: str) -> tuple[Place, ...]:
        """The burst-buffer copies of ``group``: one per ``local_dir`` directory (its files may be in any)."""
        return tuple(self._homes.resolve(m).place() for m in self._stripes.mirrors(normalize(group)))

    def _emit(self, name: str, path: str, nbytes: int, start: float, tier: str, error: BaseException | None = None,
              detail: str | None = None, group: str | None = None, block: str | None = None) -> None:
        end, err = max(time.time(), start), error and repr(error)  # a clock stepped back: a zero span, not negative
        self._sinks.emit(Event(name, self.rank, path, nbytes, start, end, tier, err, detail, group=group, block=block))

    def _on_retry(self, notice: RetryNotice) -> None:
        """A transient storage error is being retried: an event, so outages are visible."""
        now = time.time()
        self._emit("retry", notice.what, 0, now - notice.elapsed_s, "replicate", notice.error,
                   detail=f"attempt={notice.attempt} next_in_s={notice.delay_s:.2f}")

    # ------------------------------------------------------------------ save and commit
    def reserve(self, nbytes: int, *, pinned: bool = False) -> Future:
        """Allocate the ``staging_buffers`` staging buffers for files of about ``nbytes`` now, on a background
        thread, so the first save does not (docs/core.md); a save arriving meanwhile waits for them, a larger one
        allocates its own. ``nbytes``: one file's expected size (the tensors' bytes, each rounded up to 4 KiB, plus a
        margin for the metadata); ``pinned``: True for states on CUDA devices (pinned host memory). Returns a
        Future of the number of buffers allocated, or holding the allocation's error (logged; the next save then
        allocates, and raises, itself)."""
        self._check_open()
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        return self._staging.reserve(int(nbytes) + TAIL_ROOM, pinned)

    def save(self, state_dict: object, path: str, group: str | None = None, *, lazy: bool = False,
             export: bool = False) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the file becomes durable at ``path`` later.

        Args:
            state_dict: tensors in (nested) dicts/lists and plain Python values.
            path: the checkpoint file's durable home: a path, or an fsspec URL with local_dir.
            group: a directory (or URL prefix) holding this file and others, from this and
                other ranks, that form one checkpoint; finish with ``commit(group)`` on every rank.
            lazy: return before the tensors' bytes are copied: the copy runs on a background thread while
                training goes on, and ``fence()`` must be called before anything mutates them (the next optimizer
                step; ``save.fencing.copy_unfenced`` clones the rest). ``blocked_s`` is the part spent here;
                ``fence()`` returns its wait, which ``stats()`` counts as blocked too. Ignored on the gds tier.
            export: a file beside the checkpoints (a model export), not one of them: neither keep_persistent nor
                coalescing counts it (keep_local may delete its burst-buffer copy once it is durable at its path).

        Raises:
            UnsupportedObjectError: an entry cannot be saved (the message names its key).
            ConfigError: a URL path without local_dir, or a path outside its group.
        """
        self._check_open()  # an earlier save's failure is raised by the Saver, once: see Saver.save
        name, g = file_name(path), normalize(group) if group is not None else None
        called = time.time(), time.monotonic()  # a group's RPO and durable_s count from its oldest file's save
        self._retention.exempt(name, export and g is None)
        handle = self._saver.save(state_dict, name, g, lazy, *self.config.ranks())
        if g is not None:  # a published group's RPO counts from its oldest file's (last) save
            self._group_saved_at.setdefault(g, {})[name] = called
        return handle

    def commit(self, group: str, *, move_latest: bool = True, **extra: object) -> SaveHandle:
        """This rank is done saving into ``group``; every rank must call it.

        Returns a handle that completes when the whole group is durable and published (rank 0: after it wrote the
        manifest; others: once they see it). ``extra`` (``step=100``) goes in the manifest. ``move_latest=False``
        (the same on every rank) does not move ``parent/latest``; retention and coalescing never drop it.

        Raises:
            CheckpointWriteError: a save of this rank into ``group`` raised or was skipped, and
                its path was not saved again since: the attempt ends on every rank (docs/groups.md).
        """
        self._check_open()
        extra = check_step(extra)  # ConfigError: a step that is no integer >= 0 (before anything is done)
        group = normalize(group)
        step = group_step(extra, group) if move_latest else None  # a series that moves latest: see Retention
        with self._retention.failing(group, step):  # a failure raised here ends the attempt: no rank waits for this one
            self._inflight.raise_unseen(before=lambda e: self._coordinator.abandon(group, *self.config.ranks(), e))
        rank, has_local, token = self.rank, bool(self.config.local_dirs), self._retention.committing(group)
        self._replicator.keep(group, not move_latest)  # beside the series: never coalesced away
        saved_at, first = min(self._group_saved_at.pop(group, {}).values(), default=(time.time(), None))  # durable_s
        def retain(rec: SaveRecord) -> SaveRecord:
            self._monitor.record_durable(None if has_local else rec.durable_s, None if rec.superseded else saved_at)
            self._retention.ended(group, rec.superseded, has_local and move_latest, rank == 0 and move_latest,
                                  token, step)
            return rec
        with self._retention.failing(group, step):  # refused: a file of this rank's attempt was never saved
            fut = self._coordinator.commit(group, rank, self.world_size, dict(extra), retain, move_latest, first)
        self._retention.watch_commit(fut, group, token, step)
        return self._inflight.track(fut, group, group)

    def one_save(self) -> AbstractContextManager[OneSave]:
        """``with ck.one_save():`` the saves this thread makes inside are one save for ``stats()``, the overhead alarm
        and the event log's readers: one checkpoint of several files (blocked time and bytes summed; counted when the
        block ends, a lazy file's copy that ends later adds to it). Nested, it joins the open one (docs/overhead.md)."""
        return self._monitor.one_save(self._emit)  # its files' snapshot events name it (Saver's emit: tagging)

    def unsaved(self, path: str, group: str, error: BaseException) -> None:
        """``path`` of ``group`` will not be saved: ``error`` was raised before ``save`` (a copy the caller
        made). ``commit(group)`` then raises and ends the attempt on every rank, as after a save that raised."""
        self._coordinator.failed(normalize(group), file_name(path), error)

    def fence(self) -> float:
        """Wait until every lazy save has copied its tensors; return the seconds waited. Call it before the saved
        tensors are mutated (the optimizer step). The wait counts as blocked time in ``stats()``; a failed copy
        surfaces through its save's handle."""
        return self._saver.fence()

    # ------------------------------------------------------------------ load, latest, remove
    def load(self, path: str, map_location: object = None, *, weights_only: bool = True,
             prefetch: bool = False, verify: bool = False, mmap: bool = False, into: object = None) -> object:
        """Read a checkpoint file in parallel, verify its checksum, return the saved object.

        Prefers a verified burst-buffer copy in ``local_dir``, then ``path`` (a URL: parallel ranged reads into
        memory; ``prefetch=True`` with local_dir downloads it into the burst buffer first). A file without a
        fastckpt manifest loads unverified, with a warning once per path; ``verify=True`` refuses it.
        ``mmap=True`` (as in ``torch.load``) maps a file copy-on-write: the tensors share the page cache (no
        copy, no new memory; verified all the same), so the file must not change in place while they live.
        ``into``: tensors that exist (``{"model": model.state_dict()}``), filled in place with the saved ones at
        their keys and returned in the object (``load.into``); if the load raises, their contents are unspecified.
        Each call logs a ``load`` event: with its time (``stats().last_restore_s``), or with the error it raises.

        Raises:
            CorruptCheckpointError: bytes not matching the recorded checksum; an empty, truncated or non-torch file.
            UnverifiableCheckpointError: ``verify=True`` and the file has no manifest.
            IncompleteCheckpointError: the file belongs to a group that was never committed.
            CheckpointWriteError: this Checkpointer's save of ``path`` it waited for failed (raised once).
            ConfigError: ``path`` is None (``latest`` found nothing complete), or ``into`` does not match.
        """
        self._check_open()
        if path is None:
            raise nothing_to_load()
        got = self._loader.load(file_name(path), LoadOptions(map_location, weights_only, prefetch, verify, mmap, into))
        self._last_restore = (got.rto_s, got.where)
        return got.obj

    def reading(self, group: str) -> AbstractContextManager[dict]:
        """``with ck.reading(group) as manifest:`` this thread's loads of its files read the save published when
        it began, else raise ``GroupChangedError`` (a re-save was swapped in since); IncompleteCheckpointError:
        ``group`` is not published."""
        return self._loader.reading(normalize(group))

    def latest(self, root: str) -> str | None:
        """The newest complete checkpoint under ``root`` (directory or URL), or None (see ``fastckpt.latest``)."""
        return discovery.latest(self._homes, root)

    def remove(self, path: str, *, whole: bool = False) -> None:
        """Delete a checkpoint file or group, after any save in flight to it has finished.

        A file whose replication has not started yet is not replicated (its handle resolves with ``cancelled=True``);
        an upload under way is waited for. A group's commit in flight is cancelled (on every rank, with a store) and
        fails at once with ``GroupRemovedError``, as does a later ``commit`` of what was saved into it before; a commit
        rank 0 is already publishing completes first, then the group is deleted. ConfigError, nothing deleted: ``path``
        is no checkpoint (a directory holding them, ``commit.removable``), unless ``whole``: a framework's own name for
        one checkpoint (Lightning's), deleted whatever it holds. ClosedError after ``close()``, as ``save``."""
        self._check_open()
        path = normalize(named(path, "remove()"))  # never the working directory for an empty one
        refuse_root(self._homes.resolve(path))  # '/' or a bucket: before anything is cancelled, listed or deleted
        self._coordinator.cancel(path, self.rank, self.world_size)
        with self._replicator.cancelling(path):
            self._inflight.wait_writing(path)
        self._retention.remove(path, check=not whole)

    # ------------------------------------------------------------------ lifecycle
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending save, replication and commit is done; raise a background
        error once. A wait longer than a few seconds shows progress (a bar on a terminal, a log
        line every few seconds otherwise: ``fastckpt.progress``), drawn off this thread.

        Raises:
            ReplicationError: ``timeout_s`` passed first (naming what is still pending; the
                local copies are kept).
        """
        self.fence()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._inflight.wait_shown(timeout_s, self._replicator.pending)  # ReplicationError past timeout_s
        self._homes.reaper.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))  # replaced files
        self._inflight.raise_unseen()

    def stats(self) -> Stats:
        r, (rto, where) = self._replicator, self._last_restore
        return self._monitor.stats(len(self._inflight), replication_lag_s=r.lag_s(), replication_failures=r.failures,
                                   replication_pending=len(r.pending()), last_restore_s=rto, last_restore_from=where,
                                   local_dirs=self._stripes.stats())

    def close(self) -> None:
        """Flush pending saves and replication (up to ``close_timeout_s``), stop the workers, and raise the oldest
        background error (the others are logged). Past ``close_timeout_s``, stops without them (burst-buffer.md)."""
        if self._closed:
            return
        raised: BaseException | None = None  # not sys.exc_info(): that is also a caller's (``__exit__``)
        try:
            self.wait(self.config.close_timeout_s)
        except BaseException as exc:
            raised = exc
            raise
        finally:
            self._closed = True
            self._coordinator.close(self.rank, self.world_size)  # groups never committed
            self._stop.set()
            wait = self.config.close_timeout_s is None or not len(self._inflight)  # False: it gave up on them
            if not wait:
                self._inflight.log_unseen("close() gave up waiting (close_timeout_s)")
                if raised is not None:
                    raised.add_note(stopped_note(self.config.local_dirs))
            # writes first (also after a Ctrl-C in wait()): one that ends now still hands its file to the replicator
            stop_pools((self._snapper, *self._writers) if wait else (), wait)
            self._replicator.close(wait)
            stop_pools((self._snapper, self._committer, *self._writers, self._io), wait)
            self._homes.close(wait)
            self._staging.close()
            if self._jsonl:
                self._jsonl.close()
            if self._metrics is not None:
                self._metrics.close()
            forget_at_exit(self)
            try:  # a failure that ended while the workers stopped, or one more than close() raises
                if raised is None:
                    self._inflight.raise_unseen()
            finally:
                self._inflight.log_unseen("close() raised another failure")

    def _atexit(self, forked: bool = False) -> bool:  # see exits.py
        ran = ran_threads(self._io, self._snapper, self._committer, *self._writers, self._replicator)
        if forked and ran:
            self._closed, self._closed_by = True, "for this process by fork(): its worker threads stayed in the parent"
        elif not forked and not self._closed and (ran or not inherited(self)):  # else: unused, and the parent's
            self._closed_by = "at interpreter exit (the main thread ended: join a thread that still saves first)"
            close_at_exit(self.close, lambda: len(self._inflight), self._replicator.pending)
        return not ran

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"this Checkpointer was closed {self._closed_by}; create a new one or use fastckpt.load")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Checkpointer.__doc__ = f"""Saves that return after a snapshot and become durable in the background.

Every option is defined once, in ``fastckpt.config.CheckpointerConfig``; the first four may be given by position.

{options_doc()}
"""
