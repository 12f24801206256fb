"""The storage seam for replication: where committed checkpoints are copied to and read from.

A ``Target`` is rooted at a directory (``PosixTarget``: a Lustre/NFS/local mount) or at a URL
prefix (``FsspecTarget``: ``s3://bucket/prefix`` through s3fs, or another fsspec
filesystem). Every method takes a *key*: a path relative to that root, ``/``-separated, with
no leading ``/``, no ``.``/``..`` or empty component (``"run1/step_100/rank0.pt"``).

Order of calls when replicating one checkpoint (``replicate.py``):

1. (every rank, worker threads) ``put_file`` for each data file: any order, in parallel,
   with ``expect`` (the size and checksum recorded at save time);
2. (every rank) ``verify`` (a read-back) each one whose ``PutResult.verified`` is False, or
   every one when a read-back is asked for;
3. (coordinator) ``put_bytes`` of the manifest: published last, its presence means "complete";
4. (coordinator) ``put_bytes`` of the ``latest`` pointer; then local retention may delete.

Readers (restore, ``fastckpt ls``) use ``exists``, ``get_bytes``, ``list``, ``download``;
retention uses ``delete``; a coordinator at start-up calls ``clean_incomplete`` to remove what a
killed process left behind. Every method is thread-safe and blocking.

Failures. Transient errors (connection refused/reset, timeouts, HTTP 5xx/429, SlowDown) are
retried with exponential backoff and full jitter until ``retry_deadline_s`` has passed *for
that one request* (one part, one small object, one range), so a long upload that keeps
making progress is never cut off, while a target that stays down fails after the deadline
with ``TargetUnavailableError``. Permanent errors (missing bucket or directory, refused
credentials, EACCES, EROFS, ENOSPC...) raise at once, naming the target and the fix.
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from . import checksum
from .commit import discard, tmp_name
from .errors import (
    ConfigError,
    CorruptCheckpointError,
    ReplicationError,
)
from .io.ops import FileOps
from .target_types import (  # re-exported: the seam's public names live here too
    TRANSIENT_ERRNOS,
    Expected,
    ProgressCallback,
    PutResult,
    RetryCallback,
    RetryNotice,
    TargetNotFoundError,
    TargetPermissionError,
    TargetUnavailableError,
    TokenBucket,
    check_key,
    is_transient_oserror,
    source_changed,
    storage_error,
)

__all__ = ["TRANSIENT_ERRNOS", "Expected", "ProgressCallback", "PutResult", "RetryCallback", "RetryNotice", "Target",
           "TargetNotFoundError", "TargetPermissionError", "TargetUnavailableError", "TokenBucket", "check_key",
           "is_transient_oserror", "open_target", "source_changed", "storage_error"]

log = logging.getLogger(__name__)
T = TypeVar("T")
MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 16 * MiB
DEFAULT_RETRY_DEADLINE_S = 300.0
READ_CHUNK_BYTES = 4 * checksum.BLOCK_BYTES  # a multiple of the checksum block: see verify()
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0

class Target(abc.ABC):
    """A persistent place for checkpoints (see the module docstring for keys and call order).

    Guarantees every implementation keeps:
        ``put_file``: the object appears complete or not at all; a failed or interrupted
            upload leaves no temp file and no open multipart upload (best effort when the
            target is unreachable: ``clean_incomplete`` removes leftovers later).
        ``put_bytes``: the same, for a small object (manifest, pointer); it replaces an
            existing one atomically.
        ``verify``: reads the remote bytes back (ranged, chunked) and recomputes the
            ``fastckpt.checksum`` tree checksum; raises, never returns False.
        ``get_bytes``/``read_range``/``size``: raise ``TargetNotFoundError`` for a missing key;
            ``read_range`` returns exactly ``length`` bytes or raises.
        ``exists``: False for a missing key, raises on other errors.
        ``list``: every complete object whose key starts with ``prefix``, recursively, sorted;
            never in-flight temp files.
        ``delete``: idempotent (a missing key is not an error).
        ``download``: writes ``local_path`` atomically (temp, fsync, rename).

    Args:
        retry_deadline_s: how long one request keeps retrying transient errors.
        parallelism: threads for multipart uploads, ranged downloads and verification.
        on_retry: called with a ``RetryNotice`` before each backoff (for events and tests).
    """

    def __init__(self, *, retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S, parallelism: int = 4,
                 on_retry: RetryCallback | None = None) -> None:
        if not retry_deadline_s >= 0:
            raise ConfigError(f"retry_deadline_s={retry_deadline_s!r} must be >= 0 seconds (0: no retries)")
        if not 1 <= parallelism <= 64:
            raise ConfigError(f"parallelism={parallelism!r} must be between 1 and 64 threads")
        self.retry_deadline_s = float(retry_deadline_s)
        self.parallelism = parallelism
        self.on_retry = on_retry

    # ------------------------------------------------------------------ the interface
    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The root, as a path or URL (never with credentials)."""

    def url_of(self, key: str) -> str:
        """Where ``key`` lives, for messages and logs."""
        return f"{self.url.rstrip('/')}/{key}"

    def put_file(self, local_path: str | os.PathLike, key: str, *,
                 bandwidth_Bps: float | TokenBucket | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 on_progress: ProgressCallback | None = None, expect: Expected | None = None) -> PutResult:
        """Upload one local file so that it becomes visible complete or not at all.

        Args:
            local_path: the file to upload.
            key: where it goes (see the module docstring).
            bandwidth_Bps: a cap in bytes per second for this upload, or a ``TokenBucket``
                shared by several concurrent uploads; None: no cap.
            chunk_bytes: the write size (POSIX) or the multipart part size (S3: >= 5 MiB).
            on_progress: called as ``on_progress(done_bytes, total_bytes)`` after each chunk
                or part is accepted, one call at a time. An exception it raises aborts the
                upload (nothing left behind) and propagates unchanged.
            expect: what the file must be (size and checksum from its manifest). A target
                that can verify while uploading (S3) hashes the bytes it sends and refuses to
                complete an upload whose bytes differ; see ``PutResult.verified``.

        Returns:
            A ``PutResult``.

        Raises:
            TargetUnavailableError: transient errors outlasted ``retry_deadline_s``.
            ReplicationError: a permanent error (its subclass says which), naming the fix.
            CheckpointWriteError: with ``expect``: the local file is not what its manifest
                records (it changed after it was committed); nothing was published.
            CorruptCheckpointError: the store acknowledged a part with a checksum other than
                the one sent (a multipart upload is aborted; a single object may have landed,
                unverified): upload again.
        """
        check_key(key)
        if chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes={chunk_bytes!r} must be > 0")
        limiter = _limiter(bandwidth_Bps, chunk_bytes)
        local_path = os.fspath(local_path)
        size = os.stat(local_path).st_size
        if expect is not None and size != expect.size:
            raise source_changed(local_path, f"is {size} bytes, its manifest says {expect.size}")
        t0 = time.monotonic()
        progress = _Progress(on_progress, size)
        parts = self._put_file(local_path, key, size, limiter, chunk_bytes, progress, expect)
        verified = bool(expect is not None and progress.verified)
        return PutResult(key, self.url_of(key), size, time.monotonic() - t0, parts, progress.retries, verified)

    @abc.abstractmethod
    def _put_file(self, local_path: str, key: str, size: int, limiter: TokenBucket | None, chunk_bytes: int,
                  progress: _Progress, expect: Expected | None) -> int:
        """Upload and return the number of parts (see ``put_file``). An implementation that
        verified the upload against ``expect`` sets ``progress.verified``."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Publish a small object atomically (replacing any previous one)."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The whole object."""

    @abc.abstractmethod
    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a complete object is at ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` (a plain string prefix, recursive), sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing one is fine."""

    @abc.abstractmethod
    def clean_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        """Remove leftovers of interrupted uploads under ``prefix`` (temp files, open
        multipart uploads) started more than ``older_than_s`` ago; return how many.

        Call it from one process while no upload under ``prefix`` is younger than that.
        """

    # ------------------------------------------------------------------ shared implementations
    def check_size(self, key: str, expected_size: int) -> int:
        """The object's size, which must be ``expected_size``.

        Raises:
            TargetNotFoundError: the object is missing.
            CorruptCheckpointError: it has another size.
        """
        actual = self.size(check_key(key))
        if actual != expected_size:
            raise CorruptCheckpointError(f"replica {self.url_of(key)} is {actual} bytes, expected {expected_size}: "
                                         "the upload was truncated or replaced; upload it again from the local copy")
        return actual

    def verify(self, key: str, expected_size: int, expected_xxh3: str, covered: int | None = None, *,
               bandwidth_Bps: float | TokenBucket | None = None) -> None:
        """Read the object back and check its size and ``fastckpt.checksum`` tree checksum.

        ``covered``: the checksum covers only the first ``covered`` bytes (a fastckpt file's
        checksum leaves out its own manifest); default: the whole object.
        ``bandwidth_Bps``: a cap on the read-back (a ``TokenBucket`` shared with uploads, or
        bytes per second); None: no cap.

        Reads ``READ_CHUNK_BYTES`` ranges on ``parallelism`` threads; each thread hashes the
        16 MiB blocks of its range, and the block digests are combined in file order.

        Raises:
            TargetNotFoundError: the object is missing.
            CorruptCheckpointError: the size or checksum differs (the message says which).
        """
        actual = self.check_size(key, expected_size)
        limit = actual if covered is None else covered
        limiter = _limiter(bandwidth_Bps, READ_CHUNK_BYTES)

        def digests(offset: int, length: int) -> list[int]:
            if limiter is not None:
                limiter.consume(length)
            mv = memoryview(self.read_range(key, offset, length))[: max(0, limit - offset)]
            return [checksum.block_digest(mv[o:o + checksum.BLOCK_BYTES])
                    for o in range(0, len(mv), checksum.BLOCK_BYTES)]

        got = checksum.combine(d for ds in self._map_ranges(limit, READ_CHUNK_BYTES, digests) for d in ds)
        if got != expected_xxh3:
            raise CorruptCheckpointError(f"replica {self.url_of(key)} has checksum {got}, expected {expected_xxh3} "
                                         f"({checksum.ALGO}): its bytes were damaged in transit or at rest; "
                                         "delete it and upload it again from the local copy")

    def download(self, key: str, local_path: str | os.PathLike, *, chunk_bytes: int = READ_CHUNK_BYTES) -> int:
        """Copy the object to ``local_path`` (temp, fsync, rename) with parallel ranged reads.

        Returns:
            The number of bytes written.
        """
        size = self.size(check_key(key))
        local_path = os.fspath(local_path)
        tmp = tmp_name(local_path)
        ops = FileOps()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            def fetch(offset: int, length: int) -> None:
                view, pos = memoryview(self.read_range(key, offset, length)), 0
                while pos < len(view):
                    pos += os.pwrite(fd, view[pos:], offset + pos)

            for _ in self._map_ranges(size, chunk_bytes, fetch):
                pass
            os.ftruncate(fd, size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            discard(ops, tmp)
            raise
        os.close(fd)
        os.replace(tmp, local_path)
        ops.fsync_dir(os.path.dirname(local_path) or ".")
        return size

    # ------------------------------------------------------------------ helpers for implementations
    def _map_ranges(self, size: int, chunk_bytes: int, fn: Callable[[int, int], T]) -> Iterator[T]:
        """``fn(offset, length)`` over ``[0, size)`` on ``parallelism`` threads; results in order,
        at most ``2 * parallelism`` ranges in flight (bounded memory)."""
        ranges = deque((o, min(chunk_bytes, size - o)) for o in range(0, size, chunk_bytes))
        if self.parallelism == 1 or len(ranges) <= 1:
            yield from (fn(o, n) for o, n in ranges)
            return
        pending: deque[Future[T]] = deque()
        pool = ThreadPoolExecutor(self.parallelism, thread_name_prefix="fastckpt-target")
        try:
            while ranges or pending:
                while ranges and len(pending) < 2 * self.parallelism:
                    pending.append(pool.submit(fn, *ranges.popleft()))
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _is_transient(self, exc: BaseException) -> bool:
        return is_transient_oserror(exc)

    @abc.abstractmethod
    def _permanent(self, exc: BaseException, what: str) -> ReplicationError | None:
        """The ``ReplicationError`` to raise (chained) for permanent error ``exc``, its message
        naming ``what``, the cause and the fix; None re-raises ``exc`` unchanged (not a storage
        error, e.g. a bug)."""

    def _retry(self, what: str, fn: Callable[[], T], *, deadline_s: float | None = None,
               progress: _Progress | None = None, cancel: threading.Event | None = None) -> T:
        """Call ``fn`` until it succeeds, a permanent error, or the deadline (see module doc).
        Retries are counted on ``progress``; once ``cancel`` is set (a sibling part failed),
        the next transient error is raised instead of retried."""
        deadline_s = self.retry_deadline_s if deadline_s is None else deadline_s
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:
                if isinstance(exc, (ReplicationError, CorruptCheckpointError, ConfigError)):
                    raise
                if not self._is_transient(exc):
                    err = self._permanent(exc, what)
                    if err is None:
                        raise
                    raise err from exc
                if cancel is not None and cancel.is_set():
                    raise
                elapsed = time.monotonic() - t0
                delay = random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (attempt - 1)))
                if elapsed + delay > deadline_s:
                    raise storage_error(TargetUnavailableError, f"{what}: {self.url} kept failing for "
                                        f"{elapsed:.1f} s ({attempt} attempt(s), last error: {exc!r}); check that "
                                        "the target is up and reachable from this node, or raise retry_deadline_s "
                                        f"(now {deadline_s:g} s) to ride out longer outages",
                                        err_no=errno.ETIMEDOUT) from exc
                if progress is not None:
                    progress.retried()
                log.info("%s: transient error (%s), attempt %d, retrying in %.2f s", what, exc, attempt, delay)
                if self.on_retry is not None:
                    self.on_retry(RetryNotice(what, attempt, exc, delay, elapsed))
                if cancel is not None:
                    cancel.wait(delay)
                else:
                    time.sleep(delay)  # backoff between attempts (not a test-synchronisation sleep)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class _Progress:
    """One upload's byte and retry counts; serialises ``on_progress`` calls across threads.
    ``verified``: set by an implementation that verified the upload against ``expect``."""

    def __init__(self, callback: ProgressCallback | None, total: int) -> None:
        self._callback, self.total, self.done, self.retries = callback, total, 0, 0
        self.verified = False
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._callback is not None:
                self._callback(self.done, self.total)

    def retried(self) -> None:
        with self._lock:
            self.retries += 1


def _limiter(bandwidth_Bps: float | TokenBucket | None, burst_bytes: int) -> TokenBucket | None:
    if bandwidth_Bps is None or isinstance(bandwidth_Bps, TokenBucket):
        return bandwidth_Bps
    return TokenBucket(bandwidth_Bps, burst_bytes=burst_bytes)


def open_target(url_or_path: str | os.PathLike, storage_options: dict | None = None, *,
                retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S, parallelism: int = 4,
                on_retry: RetryCallback | None = None) -> Target:
    """The ``Target`` for a directory (``/mnt/lustre/ckpt``, ``file:///...``) or a URL
    (``s3://bucket/prefix``, any other fsspec protocol).

    Args:
        url_or_path: the target root.
        storage_options: fsspec options (URL targets only), e.g. ``{"endpoint_url": ...}``.
        retry_deadline_s, parallelism, on_retry: see ``Target``.

    Raises:
        ConfigError: ``storage_options`` given for a directory.
    """
    s = os.fspath(url_or_path)
    common = {"retry_deadline_s": retry_deadline_s, "parallelism": parallelism, "on_retry": on_retry}
    if "://" not in s or s.startswith("file://"):
        if storage_options:
            raise ConfigError(f"storage_options apply to URL targets only, not to the directory {s!r}: "
                              "drop them, or give an s3://... URL")
        from .targets_posix import PosixTarget

        return PosixTarget(s.removeprefix("file://"), **common)
    from .targets_fsspec import FsspecTarget

    return FsspecTarget(s, storage_options, **common)
