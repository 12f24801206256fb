"""The read side every ``Target`` shares, built on its primitives (``size``, ``version``,
``read_range``, ``url_of``, ``ops`` and the worker threads of ``_executor``, which ``_map_ranges``
here spreads ranges over): size checks, verification by read-back, downloads, whole-object
reads with their manifest, and manifest reads. A backend overrides one where it can do better
(``PosixTarget`` reads a whole file through one open descriptor).

An object is read in several requests (its size, its tail, ranges in parallel), and another
writer may replace it meanwhile (Lightning's ``last.ckpt``, saved again and again). So a read
that takes more than one request asks for one version of the object: the one its first request
saw (``version``: S3's ETag, another fsspec store's ``info_version``), which every ranged read
then requires (``read_range(version=)``: If-Match). A store that cannot ask for a version in a
request (another fsspec store) is asked afterwards, and only when what was read proves wrong
(``_confirm_version``: a checksum that differs, a trailer that does not parse, a range cut short),
so a healthy read costs no request per range. A read that finds the object replaced
(``ObjectChangedError``) starts again, whole, on the new version, up to ``READ_ATTEMPTS`` times: a
replaced object is not a damaged one.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, TypeVar

from ..errors import CorruptCheckpointError
from ..format import checksum
from ..format.manifest import TAIL_BYTES, manifest_in
from ..io import atomic
from ..io.engine import ImageFactory, ReadResult, alloc_aligned, block_digests
from ..io.image import BlockFetch, FlatImage, image_digests
from ..io.ops import READ, FileOps, pread_exact, pwrite_all
from ..urls import check_key
from .types import ObjectChangedError, TokenBucket, as_limiter, storage_error

log = logging.getLogger(__name__)
T = TypeVar("T")
READ_CHUNK_BYTES = 4 * checksum.BLOCK_BYTES  # a multiple of the checksum block: see verify()
READ_ATTEMPTS = 3  # reads of an object replaced while it was read, each started again on the new version


class ReadSide:
    """Mixed into ``Target``; see the methods there for the primitives used here."""

    ops: FileOps

    if TYPE_CHECKING:  # the primitives, defined by Target and its backends
        url: str
        parallelism: int

        def url_of(self, key: str) -> str: ...
        def size(self, key: str) -> int: ...
        def read_range(self, key: str, offset: int, length: int, *, version: str | None = None) -> bytes: ...
        def _executor(self) -> Executor: ...

    def version(self, key: str) -> tuple[int, str | None]:
        """The object's size and its version, which ``read_range(version=)`` then requires; None
        where there is none to ask for (a file system; an fsspec store whose ``info`` gives no
        ``info_version`` token)."""
        return self.size(check_key(key)), None

    def _confirm_version(self, key: str, version: str | None) -> None:
        """Called when what was read of ``version`` of ``key`` proves wrong, before that is reported
        as damage: raises ``ObjectChangedError`` if the object was replaced meanwhile. Nothing to
        ask here: a file system has no versions, and S3 refuses a read of another version (If-Match);
        a store that can only check afterwards overrides it (``FsspecTarget``)."""

    def _map_ranges(self, size: int, chunk_bytes: int, fn: Callable[[int, int], T]) -> Iterator[T]:
        """``fn(offset, length)`` over ``[0, size)`` on ``parallelism`` threads; results in order,
        at most ``2 * parallelism`` ranges in flight (bounded memory)."""
        ranges = deque((o, min(chunk_bytes, size - o)) for o in range(0, size, chunk_bytes))
        if self.parallelism == 1 or len(ranges) <= 1:
            yield from (fn(o, n) for o, n in ranges)
            return
        pending: deque[Future[T]] = deque()
        pool = self._executor()
        try:
            while ranges or pending:
                while ranges and len(pending) < 2 * self.parallelism:
                    pending.append(pool.submit(fn, *ranges.popleft()))
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
            for f in pending:
                if not f.cancelled():
                    f.exception()  # wait: no worker may touch the caller's buffer after we return

    def _one_version(self, key: str, read: Callable[[], T]) -> T:
        """``read()`` (which reads one version of ``key``), again while the object is replaced
        under it, up to ``READ_ATTEMPTS`` times.

        Raises:
            ObjectChangedError: it was replaced during every attempt.
        """
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return read()
            except ObjectChangedError as exc:
                if attempt == READ_ATTEMPTS:
                    raise storage_error(ObjectChangedError, f"{self.url_of(key)} was replaced {READ_ATTEMPTS} times "
                                        "while it was read (another job is saving it again and again): load it "
                                        "once those saves stop, or load an earlier checkpoint", exc) from exc
                log.info("%s was replaced while it was read (%s): reading the new version", self.url_of(key), exc)
        raise AssertionError("unreachable: the last attempt returns or raises")

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
        """Read the object back (``READ_CHUNK_BYTES`` ranges on ``parallelism`` threads, each
        hashing its blocks) and check its size and ``fastckpt.format.checksum`` checksum.

        ``covered``: the checksum covers only the first ``covered`` bytes (a fastckpt file's
        leaves out its own manifest); default: the whole object. ``bandwidth_Bps``: a cap on
        the read-back (a ``TokenBucket`` shared with uploads, or bytes per second).

        Raises:
            TargetNotFoundError: the object is missing.
            CorruptCheckpointError: the size or checksum differs (the message says which).
        """
        actual = self.check_size(key, expected_size)
        got = self._read_back(key, actual if covered is None else covered, as_limiter(bandwidth_Bps, READ_CHUNK_BYTES))
        if got != expected_xxh3:
            raise CorruptCheckpointError(f"{self.url_of(key)}: checksum {got}, but {expected_xxh3} was recorded when "
                                         f"it was written ({checksum.ALGO}): its bytes were damaged in transit or at "
                                         "rest; copy it again from a good copy (the burst buffer's, or restore an "
                                         "earlier checkpoint)")

    def _read_back(self, key: str, covered: int, limiter: TokenBucket | None) -> str:
        """The checksum of the stored ``[0, covered)`` of ``key``, read back in parallel ranges."""
        def digests(offset: int, length: int) -> list[int]:
            if limiter is not None:
                limiter.consume(length)
            return block_digests(memoryview(self.read_range(key, offset, length)), offset, length, covered)

        return checksum.combine(d for ds in self._map_ranges(covered, READ_CHUNK_BYTES, digests) for d in ds)

    def download(self, key: str, local_path: str | os.PathLike, *, chunk_bytes: int = READ_CHUNK_BYTES) -> int:
        """Copy the object to ``local_path`` (temp, fsync, rename) with parallel ranged reads.

        Returns:
            The number of bytes written.
        """
        return self._one_version(key, lambda: self._download(key, os.fspath(local_path), chunk_bytes))

    def _download(self, key: str, local_path: str, chunk_bytes: int) -> int:
        size, version = self.version(check_key(key))
        with atomic.replacing(self.ops, local_path) as st:  # no checksum known here: one check at the end
            fd = self.ops.open(st.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                def fetch(offset: int, length: int) -> None:
                    data = self.read_range(key, offset, length, version=version)
                    pwrite_all(self.ops, fd, memoryview(data), offset, st.tmp)

                for _ in self._map_ranges(size, chunk_bytes, fetch):
                    pass
                self._confirm_version(key, version)
                self.ops.ftruncate(fd, size)
                self.ops.fsync(fd)
            finally:
                self.ops.close(fd)
        return size

    def read_object(self, key: str, *, chunk_bytes: int = READ_CHUNK_BYTES, mapped: bool = False,
                    into: ImageFactory | None = None) -> ReadResult:
        """The whole object in memory (the image ``into`` builds, ``io.engine.read_file``; else one
        page-aligned buffer), with its manifest and the checksum of the range the manifest covers
        (parallel ranged reads, hashed as they arrive). ``mapped`` is for files only: an object
        is always read into memory.

        Raises:
            TargetNotFoundError: the object is missing.
            CorruptCheckpointError: its trailer or manifest is damaged.
            ObjectChangedError: it was replaced during every one of ``READ_ATTEMPTS`` reads.
        """
        return self._one_version(key, lambda: self._read_object(key, chunk_bytes, into))

    def _read_object(self, key: str, chunk_bytes: int, into: ImageFactory | None) -> ReadResult:
        size, version, manifest, tail = self._size_and_manifest(key)
        covered = manifest["covered"] if manifest else None
        blocks = BlockFetch(lambda lo, n: bytes(self.read_range(key, lo, n, version=version)), size,
                            (size - len(tail), tail))
        try:
            image = into(blocks.fetch, size) if into else None  # the directory: mostly in the tail already read
        except CorruptCheckpointError:  # a directory that does not parse: damaged, or replaced under the read
            self._confirm_version(key, version)
            raise
        image = image or FlatImage(alloc_aligned(size), size)

        def fetch(offset: int, length: int) -> list[int]:
            data, at = memoryview(self.read_range(key, offset, length, version=version)), 0
            for _, count, view in image.pieces(offset, length):
                view[:count] = data[at : at + count]
                at += count
            return image_digests(image, offset, length, covered or 0)

        digests = [d for ds in self._map_ranges(size, chunk_bytes, fetch) for d in ds]
        image.release()
        got = checksum.combine(digests) if covered is not None else None
        if manifest is None or got != manifest["checksum"]["value"]:  # damaged, or replaced (nothing to tell by)
            self._confirm_version(key, version)
        return ReadResult(image.memory, size, manifest, got, False)

    def read_manifest(self, key: str) -> dict | None:
        """The fastckpt manifest in the zip comment of the file at ``key`` (its last bytes only);
        None for a file without one.

        Raises:
            CorruptCheckpointError: the trailer holding a manifest is damaged.
        """
        return self._one_version(key, lambda: self._size_and_manifest(key)[2])

    def _size_and_manifest(self, key: str) -> tuple[int, str | None, dict | None, bytes]:
        """The object's size, version, manifest and last ``TAIL_BYTES`` (where the manifest came from)."""
        size, version, tail = self._size_and_tail(key)
        try:
            manifest = manifest_in(tail, size, self.url_of(key), lambda: self.read_range(key, 0, 4, version=version))
        except CorruptCheckpointError:  # a torn trailer: damaged, or the size of one version, the tail of another
            self._confirm_version(key, version)
            raise
        if manifest is None:  # a plain file, or the tail of another version where no manifest is
            self._confirm_version(key, version)
        return size, version, manifest, tail

    def _size_and_tail(self, key: str) -> tuple[int, str | None, bytes]:
        """The object's size, version and last ``TAIL_BYTES``: two requests, the second asking
        for the version the first saw. A file system has no versions (``file_tail``)."""
        size, version = self.version(check_key(key))
        tail = b""
        if size:
            tail = bytes(self.read_range(key, max(0, size - TAIL_BYTES), min(size, TAIL_BYTES), version=version))
        return size, version, tail


def info_version(info: dict) -> str | None:
    """A token that changes when the object at an fsspec ``info`` is replaced: gcsfs's
    ``generation``, adlfs's ``etag`` (an ``ETag``), else its modification or creation time with its
    size (memory://: a re-save is a new object with its own ``created``); None when ``info`` gives
    none of these, and the read cannot tell a replaced object from the one it began on."""
    for k in ("generation", "etag", "ETag"):
        if info.get(k) not in (None, ""):
            return f"{k}:{info[k]}"
    for k in ("mtime", "LastModified", "last_modified", "created"):
        if info.get(k) not in (None, ""):
            return f"{k}:{info[k]}:{info.get('size')}"
    return None


def file_tail(ops: FileOps, path: str) -> tuple[int, None, bytes]:
    """The size and last ``TAIL_BYTES`` of the file at ``path``, through one descriptor (fstat,
    pread), as ``read_object`` reads it: a save renamed over the path meanwhile gives the old file
    or the new one, never the old one's size with the new one's tail (a false "damaged trailer")."""
    fd = ops.open(path, READ)
    try:
        size = os.fstat(fd).st_size
        tail = bytearray(min(size, TAIL_BYTES))
        pread_exact(ops, fd, memoryview(tail), size - len(tail), len(tail), path)
        return size, None, bytes(tail)
    finally:
        ops.close(fd)

