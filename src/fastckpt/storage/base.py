"""The storage seam: every durable home of a checkpoint is a ``Target``.

A ``Target`` is rooted at a directory (``PosixTarget``: a Lustre/NFS/local mount, or a local
checkpoint's parent directory) or at a URL prefix (``FsspecTarget``: ``s3://bucket/prefix`` through
s3fs, or another fsspec filesystem); ``storage.homes`` maps a path or URL to its target and key.
Every method takes a *key*: a path relative to that root, ``/``-separated, with no leading
``/``, no ``.``/``..`` or empty component (``"run1/step_100/rank0.pt"``).

Order of calls when replicating one checkpoint (``save/replicator.py``):

1. (every rank, worker threads) ``put_file`` for each data file: any order, in parallel,
   with ``expect`` (the size and checksum recorded at save time);
2. (every rank) ``verify`` (a read-back) each one whose ``PutResult.verified`` is False, or
   every one when a read-back is asked for;
3. (coordinator) ``put_bytes`` of the manifest: published last, its presence means "complete";
4. (coordinator) ``put_bytes`` of the ``latest`` pointer; then local retention may delete.

Readers (``load/``, discovery, ``fastckpt ls``) use ``read_object``, ``exists``, ``get_bytes``,
``list``, ``download``; group commits (``commit/``) use ``put_bytes``/``get_bytes``/``list``
through a ``Place``; retention uses ``delete`` and ``delete_tree``; ``clean_incomplete`` removes
what a killed process left behind. Every method is thread-safe and blocking; ``close`` ends the
target's worker threads.

Failures: transient errors are retried per request until ``retry_deadline_s`` (``storage.retry``
says how); permanent ones (missing bucket or directory, refused credentials, EACCES, EROFS,
ENOSPC...) raise at once, naming the target and the fix.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

from ..config import DEFAULT_RETRY_DEADLINE_S
from ..errors import ConfigError, ReplicationError
from ..exits import stop_pools
from ..io.ops import FileOps
from ..units import MiB
from ..urls import check_key
from .reads import ReadSide
from .retry import retry_call
from .types import (
    Expected,
    Listing,
    Progress,
    ProgressCallback,
    PutResult,
    RetryCallback,
    TokenBucket,
    as_limiter,
    is_transient_oserror,
    source_changed,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_CHUNK_BYTES = 16 * MiB

class Target(ReadSide, abc.ABC):
    """A persistent place for checkpoints (see the module docstring for keys and call order).

    Guarantees every implementation keeps:
        ``put_file``: the object appears complete or not at all; a failed or interrupted
            upload leaves no temp file and no open multipart upload (best effort when the
            target is unreachable: ``clean_incomplete`` removes leftovers later).
        ``put_bytes``: the same, for a small object (manifest, pointer); it replaces an
            existing one atomically.
        ``verify``: reads the remote bytes back (ranged, chunked) and recomputes the
            ``fastckpt.format.checksum`` tree checksum; raises, never returns False.
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
        ops: the system-call seam for local files (uploads read through it, downloads write).
        executor: worker threads to share (e.g. the Checkpointer's I/O pool); None: the target
            starts its own ``parallelism`` threads on first use and ``close`` ends them.
    """

    def __init__(self, *, retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S, parallelism: int = 4,
                 on_retry: RetryCallback | None = None, ops: FileOps | None = None,
                 executor: Executor | None = None) -> None:
        if not retry_deadline_s >= 0:
            raise ConfigError(f"retry_deadline_s={retry_deadline_s!r} must be >= 0 seconds (0: no retries)")
        if not 1 <= parallelism <= 64:
            raise ConfigError(f"parallelism={parallelism!r} must be between 1 and 64 threads")
        self.retry_deadline_s = float(retry_deadline_s)
        self.parallelism = parallelism
        self.on_retry = on_retry
        self.ops = ops or FileOps()
        self._shared = executor
        self._pool_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._part_pools: set[ThreadPoolExecutor] = set()  # ``transient_pool``s in use

    #: True: a file system this node mounts. fastckpt writes there in place (no burst buffer
    #: needed), and a file visible at its key is complete and verified (copies are verified
    #: before their rename). False: an object store reached by requests; a single file there is
    #: published by its sidecar manifest (``commit.protocol.SIDECAR``) once verified, and saves
    #: to it go through a local burst buffer.
    mounted = False

    def is_link(self, key: str) -> bool:
        """Whether ``key`` is a symbolic link (readers never follow one out of a checkpoint root)."""
        return False

    def part_bytes(self, chunk_bytes: int) -> int:
        """The transfer size this target prefers for copies of ``chunk_bytes`` I/O chunks."""
        return chunk_bytes

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
        limiter = as_limiter(bandwidth_Bps, chunk_bytes)
        local_path = os.fspath(local_path)
        size = os.stat(local_path).st_size
        if expect is not None and size != expect.size:
            raise source_changed(local_path, f"is {size} bytes, its manifest says {expect.size}")
        t0 = time.monotonic()
        progress = Progress(on_progress, size)
        parts = self._put_file(local_path, key, size, limiter, chunk_bytes, progress, expect)
        verified = bool(expect is not None and progress.verified)
        return PutResult(key, self.url_of(key), size, time.monotonic() - t0, parts, progress.retries, verified,
                         verified and progress.read_back, progress.copies)

    @abc.abstractmethod
    def _put_file(self, local_path: str, key: str, size: int, limiter: TokenBucket | None, chunk_bytes: int,
                  progress: Progress, expect: Expected | None) -> int:
        """Upload and return the number of parts (see ``put_file``). An implementation that
        verified the upload against ``expect`` sets ``progress.verified``."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Publish a small object atomically (replacing any previous one)."""

    def put_new(self, key: str, data: bytes) -> bytes | None:
        """Publish a small object only if ``key`` has none: None when this call did, else the
        bytes there. A file system and S3 (``If-None-Match``) decide that atomically: one of
        several callers wins. This default checks first, then ``_create``s."""
        if self.exists(key) or not self._create(key, data):
            return self.get_bytes(key)
        return None

    def _create(self, key: str, data: bytes) -> bool:
        """``put_new``'s write after its check: False when ``key`` had an object by then. This
        default (a store without conditional writes) overwrites whatever came in between."""
        self.put_bytes(key, data)
        return True

    @abc.abstractmethod
    def get_bytes(self, key: str, *, deadline_s: float | None = None) -> bytes:
        """The whole object. ``deadline_s``: retry transient errors for at most that long
        instead of ``retry_deadline_s`` (a check that has a fallback should not wait minutes)."""

    @abc.abstractmethod
    def read_range(self, key: str, offset: int, length: int, *, version: str | None = None) -> bytes:
        """Exactly ``length`` bytes from ``offset``; with ``version`` (from ``version(key)``), of
        that version of the object only, else ``ObjectChangedError`` (a target without versions
        ignores it; one that cannot ask for a version in a request checks it only when what was
        read proves wrong: ``storage.reads``)."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes."""

    @abc.abstractmethod
    def modified(self, key: str) -> float:
        """When the object was last written (Unix seconds): how checkpoints written without
        fastckpt, which record no time of their own, are ordered."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a complete object is at ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str = "", *, max_depth: int | None = None) -> list[str]:
        """Keys starting with ``prefix`` (a plain string prefix, recursive), sorted; with
        ``max_depth``, only keys with at most that many '/' after the prefix's last '/'."""

    def listing(self, prefix: str = "", *, max_depth: int | None = None) -> Listing:
        """``list``, and the directories it passed over unlisted: none on an object store, whose
        listing is whole or raises (a file system passes over a folder it may not read)."""
        return Listing(self.list(prefix, max_depth=max_depth))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Key -> size of the objects directly in the directory ``prefix`` names (``"run/s9/"``), an
        object removed meanwhile left out; an object store's listing gives them in one request."""
        out: dict[str, int] = {}
        for key in self.list(prefix, max_depth=0):
            with contextlib.suppress(FileNotFoundError):
                out[key] = self.size(key)
        return out

    def dirs(self, prefix: str) -> list[str]:
        """Keys of the directories directly in the one ``prefix`` names (``"run/.step_9"``: in
        ``run``) whose keys start with ``prefix``, sorted. A file system lists every such
        directory, also one holding nothing or only temp files; this default (an object store)
        those that hold an object."""
        at = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
        return sorted({at + rest.split("/", 1)[0] for k in self.list(prefix) if "/" in (rest := k[len(at):])})

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing one is fine."""

    @abc.abstractmethod
    def clean_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        """Remove leftovers of interrupted uploads under ``prefix`` (temp files, open
        multipart uploads) started more than ``older_than_s`` ago; return how many.

        Call it from one process while no upload under ``prefix`` is younger than that.
        """

    def delete_tree(self, prefix: str, first: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> None:
        """Delete every object under ``prefix/``, the ``first`` ones (relative to ``prefix``,
        e.g. a group's manifest, whose absence makes the rest invisible) before the others, and
        those under the ``last`` folders (a group's commit markers, which tell a reader meanwhile
        that the group was committed) after them."""
        keys = self.list(check_key(prefix) + "/")
        head = [k for k in (f"{prefix}/{rel}" for rel in first) if k in keys]
        tail = [k for k in keys if any(k.startswith(f"{prefix}/{rel}/") for rel in last) and k not in head]
        for k in head + [k for k in keys if k not in head and k not in tail] + tail:
            self._delete_listed(k)

    def _delete_listed(self, key: str) -> None:
        """``delete`` of a key this target's own listing gave (``delete_tree``). An object store
        overrides it to delete the key as listed: one ``check_key`` refuses (a zero-byte folder
        marker ``run/s1/`` made by a console or rclone, a ``notes\\draft.txt``) is still in the tree."""
        self.delete(key)

    def exchange(self, key_a: str, key_b: str) -> None:
        """Swap two directories in one atomic step (a re-saved group's new attempt and the
        published one). Only a mounted file system can; this default raises.

        Raises:
            NotImplementedError: an object store has no atomic rename.
        """
        raise NotImplementedError(f"{self.url}: an object store cannot swap {key_a} and {key_b} atomically")

    def link(self, src: str, dst: str) -> None:
        """Give the file at ``src`` the second name ``dst`` (a hard link). Only a mounted file
        system can; this default raises ``NotImplementedError``."""
        raise NotImplementedError(f"{self.url}: an object store cannot link {src} to {dst}")

    def close(self, wait: bool = True) -> None:
        """End this target's worker threads (a later call starts new ones); without ``wait``,
        at once: queued work is cancelled and running work is not waited for."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            transient = [] if wait else list(self._part_pools)  # (with wait, each is shut by its transfer)
        stop_pools([p for p in (pool, *transient) if p is not None], wait)

    @contextlib.contextmanager
    def transient_pool(self, workers: int, name: str) -> Iterator[ThreadPoolExecutor]:
        """A pool for one transfer's parts, shut down (waited for) when it ends; ``close(wait=False)``
        cancels its queued parts and leaves its running ones to end with the process, as the
        target's own pool (``exits.stop_pools``)."""
        pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        with self._pool_lock:
            self._part_pools.add(pool)
        try:
            with pool:
                yield pool
        finally:
            with self._pool_lock:
                self._part_pools.discard(pool)

    # ------------------------------------------------------------------ helpers for implementations
    def _executor(self) -> Executor:
        if self._shared is not None:
            return self._shared
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallelism, thread_name_prefix="fastckpt-target")
            return self._pool

    def _is_transient(self, exc: BaseException) -> bool:
        return is_transient_oserror(exc)

    @abc.abstractmethod
    def _permanent(self, exc: BaseException, what: str) -> ReplicationError | None:
        """The ``ReplicationError`` to raise (chained) for permanent error ``exc``, its message
        naming ``what``, the cause and the fix; None re-raises ``exc`` unchanged (not a storage
        error, e.g. a bug)."""

    def _retry(self, what: str, fn: Callable[[], T], *, deadline_s: float | None = None,
               progress: Progress | None = None, cancel: threading.Event | None = None) -> T:
        """``fn`` under the target's retry policy (``storage.retry``)."""
        return retry_call(fn, what=what, url=self.url,
                          deadline_s=self.retry_deadline_s if deadline_s is None else deadline_s,
                          is_transient=self._is_transient, permanent=self._permanent, on_retry=self.on_retry,
                          progress=progress, cancel=cancel)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
