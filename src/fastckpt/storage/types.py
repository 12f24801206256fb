"""The data that crosses the ``Target`` seam (``storage.base``): its errors, records, the shared
bandwidth cap and the key rules. Kept apart so the seam's module holds only the seam."""
from __future__ import annotations

import errno
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import CheckpointWriteError, ConfigError, ReplicationError

TRANSIENT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                              errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                              errno.EAGAIN, errno.EINTR})


class TargetUnavailableError(ReplicationError, TimeoutError):
    """The target kept failing with transient errors until the retry deadline passed."""


class TargetNotFoundError(ReplicationError, FileNotFoundError):
    """The bucket, the target directory or the object does not exist."""


class BucketNotFoundError(TargetNotFoundError):
    """The bucket itself does not exist: a wrong URL or a deleted bucket, never an empty run."""


class ObjectChangedError(ReplicationError):
    """The object was replaced while it was being read (its version, S3's ETag, changed between
    requests): the bytes read could mix two versions. Not damage: read it again, whole."""


class TargetPermissionError(ReplicationError, PermissionError):
    """The target refused the credentials or the operation (AccessDenied, EACCES, EPERM)."""


class TargetUnreachableError(ConfigError, TargetUnavailableError):
    """The very first request to a target's endpoint could not connect (no such host, connection
    refused): a wrong or missing endpoint, raised at once rather than retried as an outage."""


@dataclass(frozen=True)
class Listing:
    """``Target.listing``: the keys ``list`` gives, and the directories it passed over because
    they could not be listed (a file system's EACCES, EIO), each as (its key, the error)."""

    keys: list[str]
    unlisted: tuple[tuple[str, OSError], ...] = ()


@dataclass(frozen=True)
class Expected:
    """What an uploaded file must be: the local manifest's record of it.

    Attributes:
        size: bytes.
        xxh3: the ``fastckpt.format.checksum`` tree checksum of the first ``covered`` bytes.
        covered: how many bytes the checksum covers (a fastckpt file's checksum leaves out its
            own manifest at the end).
        publishing: called right before a verified copy is made visible at its key (a file
            system's rename, S3's PutObject or CompleteMultipartUpload; other fsspec targets do
            not call it); what it raises ends the upload with nothing published (the
            Replicator's: its Checkpointer was closed, or a newer save replaced the source).
    """

    size: int
    xxh3: str
    covered: int
    publishing: Callable[[], None] = field(default=lambda: None, compare=False)


@dataclass(frozen=True)
class PutResult:
    """What ``put_file`` did (for events and logs).

    Attributes:
        key: the key written.
        url: the full URL or path of the object.
        size_bytes: bytes uploaded.
        elapsed_s: wall time of the whole upload.
        parts: 1 for a single write, else the number of multipart parts.
        retries: how many failed attempts were retried along the way.
        verified: True when the upload itself proved the stored bytes equal ``expect``: the
            bytes sent hashed to ``expect.xxh3``, and the store checked a checksum of every
            part against the bytes it received and returned it (S3: CRC32, see
            ``targets_fsspec``). False: no ``expect`` was given or the store cannot do this;
            call ``verify`` (a read-back).
        read_back: the verification read the stored bytes back (a POSIX copy reads each chunk
            back with O_DIRECT), rather than trusting the store's checksums.
        copies: how many times the bytes were sent (> 1: a read-back found a copy wrong).
    """

    key: str
    url: str
    size_bytes: int
    elapsed_s: float
    parts: int
    retries: int
    verified: bool = False
    read_back: bool = False
    copies: int = 1


@dataclass(frozen=True)
class RetryNotice:
    """Passed to ``on_retry`` before each backoff sleep (on the thread that made the call).

    Attributes:
        what: the operation, e.g. ``"upload of part 2/4 of s3://b/run/step_1/rank0.pt"``.
        attempt: the attempt that just failed (1 = the first).
        error: the transient error it failed with.
        delay_s: how long the caller sleeps before the next attempt.
        elapsed_s: time since the first attempt of this request.
    """

    what: str
    attempt: int
    error: BaseException
    delay_s: float
    elapsed_s: float


ProgressCallback = Callable[[int, int], None]
RetryCallback = Callable[[RetryNotice], None]


class TokenBucket:
    """A bandwidth cap shared by any number of threads: ``consume(n)`` blocks until ``n``
    bytes fit under ``rate_Bps`` (with bursts of up to ``burst_bytes``).

    Args:
        rate_Bps: sustained bytes per second (> 0).
        burst_bytes: bytes that may pass at once after an idle spell (default: one second).
        clock, sleep: injectable for tests.
    """

    def __init__(self, rate_Bps: float, burst_bytes: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate_Bps > 0:
            raise ConfigError(f"bandwidth_Bps={rate_Bps!r} must be > 0 bytes per second, or None for no cap")
        self.rate_Bps = float(rate_Bps)
        self.burst_bytes = int(rate_Bps if burst_bytes is None else burst_bytes)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tat = clock()  # "theoretical arrival time" (GCRA): when every byte so far is paid for

    def consume(self, n: int) -> float:
        """Take ``n`` bytes' worth of tokens, sleeping as needed; return the seconds slept."""
        with self._lock:
            now = self._clock()
            self._tat = max(self._tat, now) + n / self.rate_Bps
            wait = self._tat - now - self.burst_bytes / self.rate_Bps
        if wait > 0:
            self._sleep(wait)
            return wait
        return 0.0


def _errno_of(exc: BaseException) -> int | None:
    return exc.errno if isinstance(exc, OSError) else None


def is_transient_oserror(exc: BaseException) -> bool:
    """Connection failures and timeouts: worth retrying. Anything else is permanent."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return _errno_of(exc) in TRANSIENT_ERRNOS


def source_changed(local_path: str, how: str) -> CheckpointWriteError:
    """The error for a local file that no longer matches its manifest (nothing is published)."""
    err = CheckpointWriteError(f"local copy {local_path} {how}: it changed after it was committed; "
                               "not publishing it (save the checkpoint again)")
    err.errno = errno.EIO
    return err


def storage_error(cls: type[ReplicationError], message: str, cause: BaseException | None = None,
                  err_no: int | None = None) -> ReplicationError:
    """``cls(message)`` carrying the errno of ``cause`` (or ``err_no``) for callers that test it."""
    err = cls(message)
    err.errno = err_no if err_no is not None else (_errno_of(cause) if cause is not None else None)
    return err


class Progress:
    """One upload's byte and retry counts; serialises ``on_progress`` calls across threads.
    ``verified``: set by an implementation that verified the upload against ``expect``;
    ``read_back``: it did so by reading the stored bytes back."""

    def __init__(self, callback: ProgressCallback | None, total: int) -> None:
        self._callback, self.total, self.done, self.retries = callback, total, 0, 0
        self.verified = False
        self.read_back = False
        self.copies = 1
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._callback is not None:
                self._callback(self.done, self.total)

    def retried(self) -> None:
        with self._lock:
            self.retries += 1


def as_limiter(bandwidth_Bps: float | TokenBucket | None, chunk_bytes: int) -> TokenBucket | None:
    """A cap of ``bandwidth_Bps`` bytes/s on transfers of ``chunk_bytes`` at a time (a bucket: as
    it is). Its burst, what may pass at once after an idle spell, is one second's worth, at most
    one chunk: a burst of a whole chunk let a checkpoint up to a chunk (64 MiB) through at full
    speed whatever the cap. A request larger than the burst waits its excess out (``consume``).
    An infinite cap is none (None), as it was before the burst was bounded.

    Raises:
        ConfigError: ``bandwidth_Bps`` is not > 0 (NaN included), naming it.
    """
    if bandwidth_Bps is None or isinstance(bandwidth_Bps, TokenBucket):
        return bandwidth_Bps
    if bandwidth_Bps == math.inf:
        return None
    bucket = TokenBucket(bandwidth_Bps)  # validates the rate before any int() of it; its burst: one second's worth
    bucket.burst_bytes = max(1, min(chunk_bytes, bucket.burst_bytes))
    return bucket
