"""Parallel chunked file writes, reads and copies over a FileOps, O_DIRECT where the file
system allows it (else buffered, with the reason recorded), hashing checksum blocks in the same
worker threads that move the bytes (xxhash and the system calls release the GIL).

Work runs on the caller's executor (the Checkpointer's I/O pool), one chunk per task; memory is
the caller's buffer, or one reusable chunk buffer per worker thread for streaming copies.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from ..errors import CorruptCheckpointError
from ..format import checksum
from ..format.align import ALIGN, round_up
from ..format.manifest import TAIL_BYTES, manifest_in
from .image import BlockFetch, BlockStream, FlatImage, Image, block_digests, image_digests
from .ops import READ, FileOps, Residency, pwrite_all
from .parts import PartReader, alloc_aligned

log = logging.getLogger("fastckpt")

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: ``into(fetch, size)``: the image a read fills (``io.image``), or None for one flat buffer.
ImageFactory = Callable[[Callable[[int, int], bytes], int], "Image | None"]


@dataclass(frozen=True)
class WriteResult:
    path: str
    bytes: int
    checksum: str
    odirect: bool
    odirect_reason: str | None


@dataclass(frozen=True)
class ReadResult:
    """A whole file in page-aligned memory.

    Attributes:
        buffer: the bytes (``size`` of them; the mapping may be longer): an mmap, or the
            ``memory`` of the image ``read_file(into=...)`` built.
        manifest: the fastckpt manifest from the file's zip comment; None for a plain zip.
        checksum: the checksum of ``[0, covered)`` (``covered`` from the manifest, or the
            caller's); None for a file without a manifest when the caller gave no ``covered``.
        odirect: whether the reads bypassed the page cache.
    """

    buffer: mmap.mmap | object
    size: int
    manifest: dict | None
    checksum: str | None
    odirect: bool


def open_for_write(ops: FileOps, path: str, want_direct: bool, why_not: str | None = None
                   ) -> tuple[int, bool, str | None]:
    """Open ``path`` to be written; (fd, O_DIRECT or not, why not). ``why_not``: why the caller
    does not want O_DIRECT (a tier probe's refusal, ``odirect=False``), recorded as the reason."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if want_direct and _O_DIRECT:
        try:
            return ops.open(path, flags | _O_DIRECT), True, None
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            reason = f"filesystem refused O_DIRECT ({errno.errorcode.get(exc.errno, exc.errno)})"
    else:
        reason = why_not or ("O_DIRECT disabled" if _O_DIRECT else "O_DIRECT not available on this OS")
    return ops.open(path, flags), False, reason


def open_for_read(ops: FileOps, path: str, want_direct: bool) -> tuple[int, bool]:
    if want_direct and _O_DIRECT:
        try:
            return ops.open(path, READ | _O_DIRECT), True
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return ops.open(path, READ), False


def write_file(
    ops: FileOps,
    pool: Executor,
    path: str,
    image: memoryview,
    covered: int,
    tail: Callable[[str, list[int]], bytes],
    *,
    chunk_bytes: int,
    odirect: bool = True,
    odirect_reason: str | None = None,
    ready: Callable[[int], None] | None = None,
    copying: Callable[[], bool] | None = None,
) -> WriteResult:
    """Write ``image[:covered]`` plus a tail computed from its checksum, then fsync.

    ``image`` must be page aligned with room for the tail after ``covered``. Chunks run in
    ``pool``; each hashes its checksum blocks once written (``_Hashes``). ``tail(checksum,
    blocks)`` (``blocks``: the block digests, in file order) returns the bytes that follow
    ``covered`` (for fastckpt files: the comment-length field and the manifest); they are placed
    in ``image`` and written last, so the checksum is known.
    ``ready(end)``, if given, blocks until ``image[:end]`` is filled: writing overlaps the
    snapshot that is still copying into the image. ``copying()``, if given, is True until that
    copy is done: hashing waits for it, so that it does not take cores from the copy.
    ``odirect_reason``: why ``odirect`` is False (the tier probe's answer), the result's reason.
    """
    if chunk_bytes % checksum.BLOCK_BYTES:
        raise ValueError("chunk_bytes must be a multiple of the checksum block")
    fd, direct, reason = open_for_write(ops, path, odirect, odirect_reason)
    try:
        head = covered // ALIGN * ALIGN  # written by the workers; the rest goes with the tail

        def write_all(fd: int) -> list[int]:
            hashes = _Hashes(image, covered, copying)

            def one(off: int, n: int) -> list[int]:
                if ready is not None:
                    ready(off + n)
                if min(off + n, head) > off:
                    pwrite_all(ops, fd, image[off : min(off + n, head)], off, path)
                hashes.add(off, n)
                return []

            run_chunks(pool, covered, chunk_bytes, one)
            return hashes.digests()

        try:
            digests = write_all(fd)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            # Some filesystems accept O_DIRECT at open and refuse it on write: go buffered.
            ops.close(fd)
            fd = -1  # closed: if the re-open fails, the finally below must not close it again
            fd, direct = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), False
            reason = "filesystem refused O_DIRECT writes (EINVAL)"
            digests = write_all(fd)
        digest = checksum.combine(digests)
        extra = tail(digest, digests)
        total = covered + len(extra)
        if total > len(image):
            raise ValueError("staging image has no room for the manifest")
        image[covered:total] = extra
        end = round_up(total) if direct else total
        pwrite_all(ops, fd, image[head:end], head, path)
        if end != total:
            ops.ftruncate(fd, total)
        ops.fsync(fd)
    finally:
        if fd >= 0:
            ops.close(fd)
    return WriteResult(path, total, digest, direct, reason)


class _Hashes:
    """The block digests of an image's chunks, each hashed once its chunk is written: at once,
    or, while a snapshot is still copying into the image (``copying()``), later, so that the
    hashing does not compete with the copy for cores and memory bandwidth. Deferred chunks are
    hashed by whichever worker finishes a write after the copy ended, and the rest at the end
    by ``digests``."""

    def __init__(self, image: memoryview, covered: int, copying: Callable[[], bool] | None) -> None:
        self._image, self._covered, self._copying = image, covered, copying
        self._lock = threading.Lock()
        self._pending: list[tuple[int, int]] = []
        self._done: dict[int, list[int]] = {}

    def add(self, off: int, n: int) -> None:
        if self._copying is not None and self._copying():
            with self._lock:
                self._pending.append((off, n))
            return
        self._hash(off, n)
        self._drain()

    def _hash(self, off: int, n: int) -> None:
        digests = block_digests(self._image[off : off + n], off, n, self._covered)
        with self._lock:
            self._done[off] = digests

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                off, n = self._pending.pop()
            self._hash(off, n)

    def digests(self) -> list[int]:
        """Every block digest, in file order (hashes what is still pending on this thread)."""
        self._drain()
        return [d for off in sorted(self._done) for d in self._done[off]]


def run_chunks(pool: Executor, size: int, chunk: int, fn) -> list[int]:  # noqa: ANN001
    futures = [pool.submit(fn, off, min(chunk, size - off)) for off in range(0, size, chunk)]
    digests: list[int] = []
    first_error: BaseException | None = None
    for fut in futures:  # wait for all, so no worker touches the fd after we close it
        try:
            digests.extend(fut.result())
        except BaseException as exc:  # noqa: BLE001 (re-raised below, first one wins)
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return digests


def _buffered_twin(ops: FileOps, fd: int) -> int:
    """The O_DIRECT file ``fd`` opened again through the page cache, or -1 where it cannot be."""
    try:
        return ops.reopen(fd, os.O_RDONLY)
    except OSError:
        return -1


def read_file(ops: FileOps, pool: Executor, path: str, *, chunk_bytes: int, odirect: bool = True,
              covered: int | None = None, into: ImageFactory | None = None) -> ReadResult:
    """``read_one`` (its docstring says what it does); again through the page cache if the file
    system accepted O_DIRECT at open but refuses its reads (EINVAL), as writes fall back."""
    try:
        return read_one(ops, pool, path, chunk_bytes=chunk_bytes, odirect=odirect, covered=covered, into=into)
    except OSError as exc:
        if not odirect or exc.errno != errno.EINVAL:
            raise
        log.info("fastckpt: the file system refused an O_DIRECT read of %s (EINVAL): reading it buffered", path)
        return read_one(ops, pool, path, chunk_bytes=chunk_bytes, odirect=False, covered=covered, into=into)


def read_one(ops: FileOps, pool: Executor, path: str, *, chunk_bytes: int, odirect: bool = True,
             covered: int | None = None, into: ImageFactory | None = None) -> ReadResult:
    """Read a whole file into page-aligned memory in parallel, through one open file.

    The file is opened once, so a concurrent rename-replace of ``path`` gives this read the old
    file or the new one, never parts of both. What the page cache holds is copied from it
    (``io.parts``), the rest read with O_DIRECT. The workers hash each checksum block wholly
    before the last ``TAIL_BYTES`` as it arrives; the few after that once the manifest is parsed.

    Args:
        covered: hash ``[0, covered)`` (a file being written has no manifest yet); None: the
            range the file's own manifest names.
        into: ``into(fetch, size)`` builds the image to read into (``io.image``; ``fetch(lo, hi)``
            reads bytes of this open file first), or returns None for one flat buffer.

    Raises:
        CorruptCheckpointError: the manifest names a range outside the file.
        OSError: the read failed (EIO when the file is shorter than its size said).
    """
    if chunk_bytes % checksum.BLOCK_BYTES:
        raise ValueError("chunk_bytes must be a multiple of the checksum block")
    fd, direct = open_for_read(ops, path, odirect)
    cached, res, reader = -1, None, None
    try:
        size = os.fstat(fd).st_size
        if direct and (cached := _buffered_twin(ops, fd)) >= 0:
            res = Residency(cached, 0, size)  # one mapping asked by every chunk (see Residency)
        reader = PartReader(ops, fd, cached, path, direct, res)
        image = into(BlockFetch(reader.block, size).fetch, size) if into else None
        image = image or FlatImage(alloc_aligned(size), size)
        early = covered if covered is not None else max(0, size - TAIL_BYTES)
        early -= early % checksum.BLOCK_BYTES if covered is None else 0

        def read_chunk(off: int, n: int) -> list[int]:
            stream = BlockStream(off, min(off + n, early))
            reader.fill(image.pieces(off, n), stream.feed)
            return stream.digests()

        digests = run_chunks(pool, size, chunk_bytes, read_chunk)
    finally:
        if reader is not None:
            reader.close()
        if res is not None:
            res.close()
        if cached >= 0:
            ops.close(cached)
        ops.close(fd)
    return _verified(image, early, covered, digests, path, direct)


def map_file(ops: FileOps, pool: Executor, path: str, *, chunk_bytes: int, odirect: bool = True) -> ReadResult:
    """Map a whole file copy-on-write instead of reading it (``load(..., mmap=True)``), hashing
    its blocks in parallel: no copy and no fresh memory, so a file in the page cache "loads" at
    hashing speed. The buffer shares the file's cached pages until written to, so the file must
    not be changed in place while the mapping is in use (fastckpt never does: it replaces files
    by rename); truncating it would make access to the lost pages raise SIGBUS. A file system
    that cannot map files (``ENODEV``) is read as ``read_file`` reads it.
    """
    fd = ops.open(path, READ)
    try:
        size = os.fstat(fd).st_size
        if size == 0:  # nothing to map: an empty buffer, judged like any empty file
            return ReadResult(alloc_aligned(0), 0, None, None, False)
        buf = ops.map_private(fd, size)
    except OSError as exc:
        if exc.errno not in (errno.ENODEV, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return read_file(ops, pool, path, chunk_bytes=chunk_bytes, odirect=odirect)
    finally:
        ops.close(fd)
    if hasattr(buf, "madvise"):
        buf.madvise(mmap.MADV_WILLNEED)  # start reading what is not cached yet
    image = FlatImage(buf, size)
    early = max(0, size - TAIL_BYTES)
    early -= early % checksum.BLOCK_BYTES
    digests = run_chunks(pool, size, chunk_bytes, lambda off, n: image_digests(image, off, n, early))
    return _verified(image, early, None, digests, path, False)


def _verified(image: Image, early: int, covered: int | None, digests: list[int], path: str,
              direct: bool) -> ReadResult:
    """The read's result: the manifest parsed from the tail (unless ``covered`` was given) and the
    checksum of the covered range, from the workers' digests of ``[0, early)`` and the rest."""
    size = image.size
    manifest = None
    if covered is None:
        manifest = manifest_in(image.fetch(max(0, size - TAIL_BYTES), size), size, path, lambda: image.fetch(0, 4))
    want = covered if covered is not None else (manifest or {}).get("covered")
    digest = None
    if want is not None:
        if want < early:
            raise CorruptCheckpointError(f"{path}: its manifest covers {want} bytes of a {size}-byte file")
        digests += image_digests(image, early, want - early, want)
        digest = checksum.combine(digests)
    image.release()
    return ReadResult(image.memory, size, manifest, digest, direct)
