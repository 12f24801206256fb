"""Reading parts of fastckpt files, each byte verified (the Megatron loader's resharding).

A fastckpt file's manifest lists the digest of each 16 MiB block its checksum is made of
(docs/format.md). ``VerifiedFile`` reads only the blocks that hold the byte ranges asked for,
in parallel, checks each against its listed digest, and serves reads from them; everything it
returns, the zip directory and headers included, comes from verified blocks. A file whose
manifest lists no block digests (larger than 46.9 GiB, or written by the GDS tier) is read
whole once and verified against its checksum, as ``Checkpointer.load`` does.

Order of calls (one loading thread; reads run on the given pool): ``VerifiedFile(path)`` reads
the tail and the manifest -> ``records()`` the zip directory -> ``ensure(ranges, pool)`` ->
``bytes()`` views of what was ensured.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import zipfile
from concurrent.futures import Executor

import torch

from fastckpt.errors import CorruptCheckpointError
from fastckpt.format.layout import ALIGN
from fastckpt.format.ranges import RangeReader
from fastckpt.io.engine import alloc_aligned
from fastckpt.io.ops import FileOps

from .compat import BLOCK_BYTES, block_digest, combine, parse_tail

TAIL_BYTES = 65536 + 22  # the zip comment (the manifest) and the end-of-directory record
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... name length, extra length
_O_DIRECT = getattr(os, "O_DIRECT", 0)


_FIX = ("the file is corrupt: restore it from another copy, or load an earlier checkpoint "
        "(fastckpt.latest(<save dir>))")


class VerifiedFile:
    """One fastckpt file, read by verified blocks.

    Args:
        ops: the FileOps every read goes through.
        path: the file.
        expect: the checksum its group's manifest recorded for it (None: do not compare).
        odirect: read blocks with O_DIRECT where the filesystem allows it.

    Raises:
        CorruptCheckpointError: no readable manifest, a checksum other than ``expect``, or a
            block list that does not combine to the checksum (each names the file).
    """

    def __init__(self, ops: FileOps, path: str, expect: str | None = None, *, odirect: bool = True) -> None:
        self.path, self._ops, self._odirect = path, ops, odirect
        self.size = os.path.getsize(path)
        self._buf = alloc_aligned(self.size)
        self._bytes = torch.frombuffer(self._buf, dtype=torch.uint8)
        start = max(0, self.size - TAIL_BYTES)
        self._read_into(start, self.size - start, direct=False)
        self.bytes_read = self.size - start
        try:
            manifest = parse_tail(bytes(memoryview(self._buf)[start : self.size]), self.size)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{path}: {exc}; " + _FIX) from exc
        if manifest is None:
            raise CorruptCheckpointError(f"{path} carries no fastckpt manifest, so nothing can verify it; {_FIX}")
        self.covered = int(manifest["covered"])
        self.checksum = manifest["checksum"]["value"]
        if expect is not None and self.checksum != expect:
            raise CorruptCheckpointError(
                f"{path} has checksum {self.checksum}, not the {expect} its checkpoint's manifest recorded: the file "
                f"was replaced after the commit. {_FIX}")
        listed = manifest["checksum"].get("blocks")
        self._digests = [int(listed[i : i + 16], 16) for i in range(0, len(listed), 16)] if listed else None
        if self._digests is not None and combine(self._digests) != self.checksum:
            raise CorruptCheckpointError(f"{path}: the block digests in its manifest do not make up its checksum; "
                                         + _FIX)
        self._nblocks = (self.covered + BLOCK_BYTES - 1) // BLOCK_BYTES
        self._loaded: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ blocks
    def ensure(self, ranges: list[tuple[int, int]], pool: Executor | None) -> None:
        """Read and verify every block that holds a byte of ``ranges`` (``[lo, hi)`` pairs).

        Raises:
            CorruptCheckpointError: a block's bytes do not match its digest (names the file
                and the bytes), or, for a file read whole, the checksum does not match.
        """
        ensure_all({self: ranges}, pool)

    def _missing(self, ranges: list[tuple[int, int]]) -> list[int]:
        if self._digests is None:
            wanted = set(range(self._nblocks))
        else:
            wanted = {k for lo, hi in ranges if lo < min(hi, self.covered)
                      for k in range(lo // BLOCK_BYTES, (min(hi, self.covered) - 1) // BLOCK_BYTES + 1)}
        with self._lock:
            return sorted(wanted - self._loaded)

    def _done(self, blocks: list[int], digests: list[int]) -> None:
        if self._digests is None and blocks and combine(digests) != self.checksum:
            raise CorruptCheckpointError(f"{self.path}: checksum {combine(digests)} != {self.checksum} recorded "
                                         f"when it was written; {_FIX}")
        with self._lock:
            self._loaded.update(blocks)

    def _load(self, k: int) -> int:
        lo, hi = k * BLOCK_BYTES, min((k + 1) * BLOCK_BYTES, self.covered)
        self._read_into(lo, hi - lo, direct=self._odirect)
        digest = block_digest(memoryview(self._buf)[lo:hi])
        with self._lock:
            self.bytes_read += hi - lo
        if self._digests is not None and digest != self._digests[k]:
            raise CorruptCheckpointError(
                f"{self.path}: bytes {lo}-{hi} (checksum block {k}) do not match the digest recorded when the file "
                f"was written; {_FIX}")
        return digest

    def _read_into(self, off: int, n: int, direct: bool) -> None:
        """Fill ``[off, off + n)`` of the buffer from the file (O_DIRECT reads whole pages)."""
        fd = -1
        if direct and _O_DIRECT and off % ALIGN == 0:
            try:
                fd = self._ops.open(self.path, os.O_RDONLY | _O_DIRECT)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        if fd < 0:
            fd, direct = self._ops.open(self.path, os.O_RDONLY), False
        try:
            end = min(len(self._buf), off + (n + ALIGN - 1) // ALIGN * ALIGN) if direct else off + n
            view, got = memoryview(self._buf)[off:end], 0
            while got < n:
                r = self._ops.preadv(fd, view[got:], off + got)
                if r <= 0:
                    raise CorruptCheckpointError(f"{self.path} ended at byte {off + got}; expected {self.size} bytes. "
                                                 + _FIX)
                got += r
        finally:
            self._ops.close(fd)

    # ------------------------------------------------------------------ zip records
    def records(self, pool: Executor | None) -> dict[str, tuple[int, int]]:
        """The zip records' names -> (offset of their data, size); all read from verified bytes."""
        with zipfile.ZipFile(RangeReader(self.size, self.read)) as zf:
            infos = zf.infolist()
        self.ensure([(i.header_offset, i.header_offset + _LOCAL_HEADER.size) for i in infos], pool)
        out = {}
        for info in infos:
            head = info.header_offset
            sig, n, m = _LOCAL_HEADER.unpack(self.read(head, head + _LOCAL_HEADER.size))
            if sig != b"PK\x03\x04":
                raise CorruptCheckpointError(f"{self.path}: zip record {info.filename} has no local header; "
                                             + _FIX)
            out[info.filename] = (head + _LOCAL_HEADER.size + n + m, info.file_size)
        return out

    def read(self, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)``, verified (read now if they were not ensured before)."""
        self.ensure([(lo, hi)], None)
        return bytes(memoryview(self._buf)[lo:hi])

    def bytes(self, lo: int, hi: int) -> torch.Tensor:
        """A uint8 view of ``[lo, hi)``; the caller has ensured it. Views keep the buffer alive."""
        return self._bytes[lo:hi]


def ensure_all(wants: dict[VerifiedFile, list[tuple[int, int]]], pool: Executor | None) -> None:
    """``VerifiedFile.ensure`` for several files at once: every missing block of every file is
    one task on ``pool`` (None: read here, one after the other)."""
    jobs = [(vf, k) for vf, ranges in wants.items() for k in vf._missing(ranges)]
    digests = list(pool.map(lambda j: j[0]._load(j[1]), jobs)) if pool is not None else [vf._load(k) for vf, k in jobs]
    for vf in wants:
        mine = [(k, d) for (f, k), d in zip(jobs, digests) if f is vf]
        vf._done([k for k, _ in mine], [d for _, d in mine])
