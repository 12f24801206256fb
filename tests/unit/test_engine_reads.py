"""io.engine.read_file: O_DIRECT reads that take what the page cache already holds from it, one
open file throughout (a rename over the path mid-read does not matter), partial caches mixed
with device reads at any offset, and the checksum unchanged by where the bytes came from."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastckpt.format import checksum
from fastckpt.io import engine
from fastckpt.io.ops import FileOps
from fastckpt.save.tiers import probe_odirect

MiB = 1 << 20


class CountingOps(FileOps):
    """Counts the bytes each kind of read returned."""

    def __init__(self) -> None:
        self.cached = self.device = 0

    def preadv(self, fd: int, buf: memoryview, offset: int) -> int:
        n = super().preadv(fd, buf, offset)
        self.device += n
        return n

    def preadv_cached(self, fd: int, buf: memoryview, offset: int) -> int:
        n = super().preadv_cached(fd, buf, offset)
        self.cached += n
        return n


@pytest.fixture
def direct_dir(tmp_path):  # noqa: ANN201
    ok, why = probe_odirect(str(tmp_path))
    if not ok:
        pytest.skip(f"needs O_DIRECT: {why}")
    return tmp_path


def _file(path, size: int) -> bytes:  # noqa: ANN001
    data = os.urandom(size)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def _evict(path) -> None:  # noqa: ANN001
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(ops: FileOps, path) -> engine.ReadResult:  # noqa: ANN001
    with ThreadPoolExecutor(3) as pool:
        return engine.read_file(ops, pool, str(path), chunk_bytes=16 * MiB, covered=os.path.getsize(path))


@pytest.mark.parametrize("size", [40 * MiB + 12345, 4096, 1])
def test_cached_file_comes_from_the_cache(direct_dir, size: int) -> None:
    path = direct_dir / "f.bin"
    data = _file(path, size)  # written through the cache, still in it
    ops = CountingOps()
    res = _read(ops, path)
    assert bytes(memoryview(res.buffer)[:size]) == data
    assert res.checksum == checksum.checksum_bytes(data)
    assert res.odirect
    assert ops.cached >= size - size % 4096  # only a partial last page may come from the device


def test_partly_cached_file_mixes_cache_and_device(direct_dir) -> None:
    size = 50 * MiB + 777
    path = direct_dir / "p.bin"
    data = _file(path, size)
    _evict(path)
    with open(path, "rb") as f:  # warm an unaligned stretch in the middle of the first chunk
        f.seek(3 * MiB + 100)
        f.read(5 * MiB)
    ops = CountingOps()
    res = _read(ops, path)
    assert bytes(memoryview(res.buffer)[:size]) == data
    assert res.checksum == checksum.checksum_bytes(data)
    assert ops.device > 0


def test_twin_reads_the_open_file_not_the_path(direct_dir) -> None:
    path = direct_dir / "r.bin"
    old = _file(path, 3 * 4096)
    ops = FileOps()
    fd = ops.open(str(path), os.O_RDONLY)
    try:
        _file(direct_dir / "new.bin", 3 * 4096)
        os.replace(direct_dir / "new.bin", path)  # a rename over the path after the open
        twin = ops.reopen(fd, os.O_RDONLY)
        try:
            buf = bytearray(len(old))
            assert os.preadv(twin, [buf], 0) == len(old)
            assert bytes(buf) == old
        finally:
            ops.close(twin)
    finally:
        ops.close(fd)

