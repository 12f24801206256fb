"""Parallel chunked file writes, reads and copies over a FileOps, O_DIRECT where the file
system allows it (else buffered, with the reason recorded), hashing checksum blocks in the same
worker threads that move the bytes (xxhash and the system calls release the GIL).

Work runs on the caller's executor (the Checkpointer's I/O pool), one chunk per task; memory is
the caller's buffer, or one reusable chunk buffer per worker thread for streaming copies.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from ..errors import CorruptCheckpointError
from ..format import checksum
from ..format.layout import ALIGN
from ..format.manifest import TAIL_BYTES, manifest_in
from .ops import FileOps, pread_exact, pwrite_all

_O_DIRECT = getattr(os, "O_DIRECT", 0)


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
        buffer: the bytes (``size`` of them; the mapping may be longer).
        manifest: the fastckpt manifest from the file's zip comment; None for a plain zip.
        checksum: the checksum of ``[0, covered)`` (``covered`` from the manifest, or the
            caller's); None for a file without a manifest when the caller gave no ``covered``.
        odirect: whether the reads bypassed the page cache.
    """

    buffer: mmap.mmap
    size: int
    manifest: dict | None
    checksum: str | None
    odirect: bool


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def open_for_write(ops: FileOps, path: str, want_direct: bool) -> tuple[int, bool, str | None]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if want_direct and _O_DIRECT:
        try:
            return ops.open(path, flags | _O_DIRECT), True, None
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            reason = f"filesystem refused O_DIRECT ({errno.errorcode.get(exc.errno, exc.errno)})"
    else:
        reason = "O_DIRECT disabled" if _O_DIRECT else "O_DIRECT not available on this OS"
    return ops.open(path, flags), False, reason


def open_for_read(ops: FileOps, path: str, want_direct: bool) -> tuple[int, bool]:
    if want_direct and _O_DIRECT:
        try:
            return ops.open(path, os.O_RDONLY | _O_DIRECT), True
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return ops.open(path, os.O_RDONLY), False


def block_digests(view: memoryview, off: int, n: int, covered: int) -> list[int]:
    """Block digests of ``view[:n]`` (file bytes from ``off``) that fall inside ``[0, covered)``."""
    lim = max(0, min(n, covered - off))
    return [checksum.block_digest(view[b : min(b + checksum.BLOCK_BYTES, lim)])
            for b in range(0, lim, checksum.BLOCK_BYTES)]


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
    ready: Callable[[int], None] | None = None,
) -> WriteResult:
    """Write ``image[:covered]`` plus a tail computed from its checksum, then fsync.

    ``image`` must be page aligned with room for the tail after ``covered``. Chunks run in
    ``pool``; each hashes its checksum blocks before writing them. ``tail(checksum, blocks)``
    (``blocks``: the block digests, in file order) returns the bytes that follow ``covered``
    (for fastckpt files: the comment-length field and the manifest); they are placed in
    ``image`` and written last, so the checksum is known.
    ``ready(end)``, if given, blocks until ``image[:end]`` is filled: writing overlaps the
    snapshot that is still copying into the image.
    """
    if chunk_bytes % checksum.BLOCK_BYTES:
        raise ValueError("chunk_bytes must be a multiple of the checksum block")
    fd, direct, reason = open_for_write(ops, path, odirect)
    try:
        head = covered // ALIGN * ALIGN  # written by the workers; the rest goes with the tail
        try:
            digests = run_chunks(pool, covered, chunk_bytes, lambda off, n: _write_chunk(
                ops, fd, image, off, n, head, covered, path, ready))
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            # Some filesystems accept O_DIRECT at open and refuse it on write: go buffered.
            ops.close(fd)
            fd = -1  # closed: if the re-open fails, the finally below must not close it again
            fd, direct = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), False
            reason = "filesystem refused O_DIRECT writes (EINVAL)"
            digests = run_chunks(pool, covered, chunk_bytes, lambda off, n: _write_chunk(
                ops, fd, image, off, n, head, covered, path, ready))
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


def _write_chunk(ops, fd, image, off, n, head, covered, path, ready=None) -> list[int]:  # noqa: ANN001
    if ready is not None:
        ready(off + n)
    view = image[off : off + n]
    digests = [checksum.block_digest(view[b : b + checksum.BLOCK_BYTES])
               for b in range(0, n, checksum.BLOCK_BYTES)]
    w_end = min(off + n, head)
    if w_end > off:
        pwrite_all(ops, fd, image[off:w_end], off, path)
    return digests


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


def alloc_aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (as O_DIRECT needs), at least one page."""
    return mmap.mmap(-1, max(ALIGN, round_up(nbytes)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def read_file(ops: FileOps, pool: Executor, path: str, *, chunk_bytes: int, odirect: bool = True,
              covered: int | None = None) -> ReadResult:
    """Read a whole file into page-aligned memory in parallel, through one open descriptor.

    The file is opened once, so a concurrent rename-replace of ``path`` gives this read the old
    file or the new one, never parts of both. The workers hash every checksum block that lies
    wholly before the last ``TAIL_BYTES`` (those are inside the checksummed range whatever the
    manifest says); the few blocks after that are hashed once the manifest is parsed.

    Args:
        covered: hash ``[0, covered)`` (a file being written has no manifest yet); None: the
            range the file's own manifest names.

    Raises:
        CorruptCheckpointError: the manifest names a range outside the file.
        OSError: the read failed (EIO when the file is shorter than its size said).
    """
    if chunk_bytes % checksum.BLOCK_BYTES:
        raise ValueError("chunk_bytes must be a multiple of the checksum block")
    fd, direct = open_for_read(ops, path, odirect)
    try:
        size = os.fstat(fd).st_size
        buf = alloc_aligned(size)
        view = memoryview(buf)
        early = covered if covered is not None else max(0, size - TAIL_BYTES)
        early -= early % checksum.BLOCK_BYTES if covered is None else 0

        def read_chunk(off: int, n: int) -> list[int]:
            want = min(round_up(n) if direct else n, len(view) - off)
            chunk = view[off : off + want]
            pread_exact(ops, fd, chunk, off, n, path)
            return block_digests(chunk, off, n, early)

        digests = run_chunks(pool, size, chunk_bytes, read_chunk)
    finally:
        ops.close(fd)
    manifest = manifest_in(bytes(view[max(0, size - TAIL_BYTES) : size]), size, path) if covered is None else None
    want = covered if covered is not None else (manifest or {}).get("covered")
    digest = None
    if want is not None:
        if want < early:
            raise CorruptCheckpointError(f"{path}: its manifest covers {want} bytes of a {size}-byte file")
        digests += block_digests(view[early:], early, want - early, want)
        digest = checksum.combine(digests)
    view.release()
    return ReadResult(buf, size, manifest, digest, direct)
