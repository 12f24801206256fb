"""Background replication of committed local checkpoints to their durable home.

Order of work for one file (worker threads of the Replicator, never the training thread):
  1. copy: POSIX destination -> parallel O_DIRECT copy to a temp name; URL -> multipart
     upload through the target (retries with backoff, the shared bandwidth cap);
  2. verify: read the destination back (O_DIRECT / ranged GETs) and compare with the checksum
     recorded at save time; a mismatch uploads again (3 attempts), so only verified bytes
     are ever published;
  3. publish: POSIX -> rename into place + directory fsync; URL -> the sidecar manifest
     ``NAME.fastckpt.json`` last (a remote file without it is not a checkpoint yet). Group
     files get no sidecar: the group manifest, written by rank 0 after every rank's marker,
     is their publication (commit.py).
Backpressure: with ``replicate_policy="coalesce"`` a newly committed checkpoint drops the
older ones still queued (not started); their handles resolve with ``superseded=True``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace

from . import commit as C
from .config import CheckpointerConfig
from .errors import CheckpointWriteError, CorruptCheckpointError
from .io.engine import checksum_file, copy_file
from .io.ops import FileOps
from .places import is_url, split_url
from .pipeline import reraise
from .records import SaveRecord

log = logging.getLogger("fastckpt")
SIDECAR = ".fastckpt.json"
VERIFY_ATTEMPTS = 3


@dataclass(eq=False)
class ReplicaJob:
    rec: SaveRecord  # as committed locally
    local: str
    t_call: float
    committed_at: float
    future: Future = field(default_factory=Future)
    finish: Callable[[SaveRecord], SaveRecord] = lambda rec: rec  # runs before the future resolves


class TargetCache:
    """One Target per root URL (a bucket), shared by replication, commits, loads and retention."""

    def __init__(self, storage_options: dict | None, retry_deadline_s: float, parallelism: int,
                 on_retry: Callable | None = None) -> None:
        self._opts, self._deadline, self._par = storage_options, retry_deadline_s, parallelism
        self._on_retry = on_retry
        self._lock = threading.Lock()
        self._targets: dict[str, object] = {}

    def get(self, url: str):  # noqa: ANN201 (a targets.Target)
        root, key = split_url(url)
        with self._lock:
            if root not in self._targets:
                from .targets import open_target

                self._targets[root] = open_target(root, self._opts, retry_deadline_s=self._deadline,
                                                  parallelism=self._par, on_retry=self._on_retry)
            return self._targets[root], key


class Replicator:
    """Copies committed local files to their destinations on ``replicate_workers`` threads."""

    def __init__(self, cfg: CheckpointerConfig, ops: FileOps, io_pool: Executor, targets: TargetCache,
                 emit: Callable[..., None], on_durable: Callable[[float], None]) -> None:
        self._cfg, self._ops, self._io, self.targets = cfg, ops, io_pool, targets
        self._emit, self._on_durable = emit, on_durable
        self._cv = threading.Condition()
        self._queue: deque[ReplicaJob] = deque()
        self._running: list[ReplicaJob] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.failures = 0
        self.newest_verified_call: float | None = None  # wall time of that checkpoint's save call
        self._bucket = None
        if cfg.replicate_bandwidth_Bps:
            from .targets import TokenBucket

            self._bucket = TokenBucket(cfg.replicate_bandwidth_Bps, burst_bytes=cfg.chunk_bytes)

    # ------------------------------------------------------------------ queue
    def submit(self, job: ReplicaJob) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError("replicator is closed")
            if self._cfg.replicate_policy == "coalesce":
                for old in [j for j in self._queue if j.rec.group is None or j.rec.group != job.rec.group]:
                    self._queue.remove(old)
                    log.info("fastckpt: replication of %s superseded by %s (replicate_policy='coalesce'); "
                             "its local copy stays at %s", old.rec.path, job.rec.path, old.local)
                    old.future.set_result(replace(old.rec, durable_s=None, superseded=True))
            self._queue.append(job)
            self._emit("queued", job.rec.path, job.rec.bytes, job.committed_at, job.rec.tier,
                       detail=f"waiting={len(self._queue)} running={len(self._running)}")
            while len(self._threads) < self._cfg.replicate_workers:
                t = threading.Thread(target=self._work, name=f"fastckpt-replicate-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()
        return job.future

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running.append(job)
            try:
                job.future.set_result(job.finish(self._replicate(job)))
            except BaseException as exc:  # noqa: BLE001 (delivered through the future, raised once)
                with self._cv:
                    self.failures += 1
                log.error("fastckpt: replication of %s failed: %s; the local copy is kept at %s",
                          job.rec.path, exc, job.local)
                job.future.set_exception(exc)
            finally:
                with self._cv:
                    self._running.remove(job)

    def lag_s(self) -> float:
        """Seconds since the oldest checkpoint still waiting for replication committed locally."""
        with self._cv:
            waiting = [j.committed_at for j in (*self._running, *self._queue)]
        return time.time() - min(waiting) if waiting else 0.0

    def rpo_s(self) -> float | None:
        """Seconds of training a node loss would cost now: since the newest verified replica's save."""
        return None if self.newest_verified_call is None else time.time() - self.newest_verified_call

    def pending(self) -> list[str]:
        with self._cv:
            return [j.rec.path for j in (*self._running, *self._queue)]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    # ------------------------------------------------------------------ one file
    def _replicate(self, job: ReplicaJob) -> SaveRecord:
        rec, r0 = job.rec, time.time()
        manifest = C.read_file_manifest(job.local)
        if manifest is None:
            raise CheckpointWriteError(f"local copy {job.local} of {rec.path} has no manifest: it was replaced "
                                       "or damaged after it was committed; not replicating it")
        covered = manifest["covered"]
        try:
            detail = (self._upload(job, covered, manifest) if is_url(rec.path)
                      else self._copy_posix(job, covered))
        except BaseException as exc:
            self._emit("replicate", rec.path, rec.bytes, r0, rec.tier, exc)
            raise
        durable = time.monotonic() - job.t_call
        self._emit("replicate", rec.path, rec.bytes, r0, rec.tier, detail=detail)
        self._on_durable(durable)
        call_wall = job.committed_at - (rec.local_durable_s or 0.0)
        with self._cv:
            self.newest_verified_call = max(self.newest_verified_call or 0.0, call_wall)
        return replace(rec, durable_s=durable)

    def _throttle(self, n: int) -> None:
        if self._bucket is not None:
            self._bucket.consume(n)

    def _copy_posix(self, job: ReplicaJob, covered: int) -> str:
        rec, cfg = job.rec, self._cfg
        tmp = C.tmp_name(rec.path)
        try:
            self._ops.makedirs(os.path.dirname(rec.path))
            for attempt in range(1, VERIFY_ATTEMPTS + 1):
                t0 = time.monotonic()
                res = copy_file(self._ops, self._io, job.local, tmp, rec.bytes, covered,
                                chunk_bytes=cfg.chunk_bytes, odirect=cfg.odirect, throttle=self._throttle)
                if res.checksum != rec.checksum:
                    raise CheckpointWriteError(
                        f"local copy {job.local} read back checksum {res.checksum}, expected {rec.checksum}: "
                        f"it changed after it was committed; not publishing {rec.path}")
                t1 = time.monotonic()
                _drop_cache(tmp)
                back = checksum_file(self._ops, self._io, tmp, rec.bytes, covered, chunk_bytes=cfg.chunk_bytes,
                                     odirect=cfg.odirect, throttle=self._throttle)
                if back == rec.checksum:
                    break
                log.warning("fastckpt: copy %d of %s read back as %s, expected %s; copying again",
                            attempt, rec.path, back, rec.checksum)
            else:
                raise CorruptCheckpointError(f"{rec.path}: {VERIFY_ATTEMPTS} copies all read back with the wrong "
                                             "checksum; the destination storage is corrupting data")
            self._ops.replace(tmp, rec.path)
            self._ops.fsync_dir(os.path.dirname(rec.path))
        except BaseException as exc:
            renamed = not os.path.lexists(tmp)
            C.discard(self._ops, tmp)
            reraise(exc, rec.path, renamed)
        return f"copy_s={t1 - t0:.3f} verify_s={time.monotonic() - t1:.3f} attempts={attempt}"

    def _upload(self, job: ReplicaJob, covered: int, manifest: dict) -> str:
        rec, cfg = job.rec, self._cfg
        target, key = self.targets.get(rec.path)
        for attempt in range(1, VERIFY_ATTEMPTS + 1):
            t0 = time.monotonic()
            put = target.put_file(job.local, key, bandwidth_Bps=self._bucket,
                                  chunk_bytes=max(cfg.chunk_bytes // 4, 8 << 20))
            t1 = time.monotonic()
            try:
                target.verify(key, rec.bytes, rec.checksum, covered)
                break
            except CorruptCheckpointError as exc:
                if attempt == VERIFY_ATTEMPTS:
                    raise
                log.warning("fastckpt: upload %d of %s did not verify (%s); uploading again", attempt, rec.path, exc)
        if rec.group is None:  # published last: only now is the remote file a checkpoint
            target.put_bytes(key + SIDECAR, json.dumps(manifest, sort_keys=True).encode())
        return (f"upload_s={t1 - t0:.3f} verify_s={time.monotonic() - t1:.3f} parts={put.parts} "
                f"retries={put.retries} attempts={attempt}")


def _drop_cache(path: str) -> None:
    """Evict a file's pages so a buffered read-back comes from storage, not memory."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
