"""io.engine.read_file: O_DIRECT reads that take what the page cache already holds from it, one
open file throughout (a rename over the path mid-read does not matter), partial caches mixed
with device reads at any offset, and the checksum unchanged by where the bytes came from."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.format import checksum
from fastckpt.io import engine
from fastckpt.io import ops as ops_module
from fastckpt.io.ops import FileOps, Residency, resident_bytes
from fastckpt.load.deserialize import deserialize
from fastckpt.load.image import HeapImage, heap_image
from fastckpt.save.tiers import probe_odirect

MiB = 1 << 20


class CountingOps(FileOps):
    """Counts the bytes each kind of read returned."""

    def __init__(self) -> None:
        self.cached = self.device = self.device_calls = 0

    def preadv(self, fd: int, buf: memoryview | list[memoryview], offset: int) -> int:
        n = super().preadv(fd, buf, offset)
        self.device += n
        self.device_calls += 1
        return n

    def preadv_cached(self, fd: int, buf: memoryview, offset: int, residency: Residency | None = None) -> int:
        n = super().preadv_cached(fd, buf, offset, residency)
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


def _cached_pages(path) -> int:  # noqa: ANN001
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return sum(resident_bytes(fd, off, 4096) > 0 for off in range(0, size, 4096))
    finally:
        os.close(fd)


def test_a_cold_read_leaves_the_page_cache_alone(direct_dir) -> None:
    """Asking the cache for a page it lacks (RWF_NOWAIT) starts the kernel's readahead of it:
    the O_DIRECT load would read those bytes twice. The cache is asked only for resident pages."""
    size = 40 * MiB + 12345
    path = direct_dir / "c.bin"
    data = _file(path, size)
    _evict(path)
    with open(path, "rb") as f:  # one cached page, so the count below is not vacuous
        f.seek(20 * MiB)
        f.read(1)
    before = _cached_pages(path)
    assert 1 <= before <= 2048  # the page read, and whatever readahead the kernel chose for it
    ops = CountingOps()
    res = _read(ops, path)
    assert bytes(memoryview(res.buffer)[:size]) == data
    assert res.checksum == checksum.checksum_bytes(data)
    assert _cached_pages(path) == before
    assert ops.device >= size - before * 4096 - 4096


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "cached"])
def test_a_read_into_a_heap_image_finds_its_layout_as_the_chunks_read(direct_dir, warm: bool) -> None:
    """The zip directory that lays out a ``HeapImage`` is read as the chunks are: a cold read
    leaves the page cache alone and fetches each block once, a cached one takes it all from the
    cache."""
    path = str(direct_dir / "s.pt")
    state = {"a": torch.randn(3 << 20), "b": torch.randn((1 << 20) + 1), "step": 1}
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
    _evict(path)  # written with O_DIRECT, or through the cache: either way, a known start
    if warm:
        Path(path).read_bytes()
    before, size, ops = _cached_pages(path), os.path.getsize(path), CountingOps()
    with ThreadPoolExecutor(3) as pool:
        res = engine.read_file(ops, pool, path, chunk_bytes=16 * MiB, into=heap_image)
    assert isinstance(res.buffer, HeapImage) and res.checksum == res.manifest["checksum"]["value"]
    got = deserialize(res.buffer, res.size, None, True, path)
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
    assert _cached_pages(path) == before
    if warm:  # a partial last page may come from the device, as for any cached read
        assert ops.device <= 2 * 4096 and ops.cached >= size - 4096
    else:  # the whole file once, plus the directory's few 64 KiB blocks
        assert size <= ops.device <= size + 4 * 65536 + 4096


def test_a_cold_heap_image_read_asks_the_device_once_per_chunk(direct_dir) -> None:
    """A record's piece per read would be many small requests one after another (measured: a
    64 MiB file of 127 records read at two thirds of the speed of one request): a cold chunk goes
    to the device as one read into all its pieces."""
    path = str(direct_dir / "many.pt")
    state = {f"t{i}": torch.randn(100_000 + i) for i in range(30)}  # 30 records of about 400 KiB
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
    _evict(path)
    ops, size = CountingOps(), os.path.getsize(path)
    with ThreadPoolExecutor(3) as pool:
        res = engine.read_file(ops, pool, path, chunk_bytes=16 * MiB, into=heap_image)
    assert isinstance(res.buffer, HeapImage) and len(res.buffer.starts) > 30
    assert res.checksum == res.manifest["checksum"]["value"]
    got = deserialize(res.buffer, res.size, None, True, path)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    chunks, directory = -(-size // (16 * MiB)), 4  # the directory: a few 64 KiB blocks
    assert ops.device_calls <= chunks + directory and size <= ops.device <= size + directory * 65536 + 4096


class ShortOps(FileOps):
    """Returns at most ``most`` bytes per read, so every read stops inside a buffer."""

    def __init__(self, most: int) -> None:
        self.most = most

    def preadv(self, fd: int, buf: memoryview | list[memoryview], offset: int) -> int:
        room, out = self.most, []
        for view in buf if isinstance(buf, list) else [buf]:
            if room <= 0:
                break
            out.append(view[: min(room, len(view))])
            room -= len(out[-1])
        return super().preadv(fd, out, offset)


def test_pread_exact_fills_several_buffers_across_short_reads(tmp_path) -> None:
    path = tmp_path / "v.bin"
    data = _file(path, 10_000)
    bufs = [bytearray(n) for n in (4096, 1, 3000, 2903, 500)]  # one more byte than the file has
    fd = os.open(path, os.O_RDONLY)
    try:
        ops_module.pread_exact(ShortOps(1234), fd, [memoryview(b) for b in bufs], 0, 10_000, str(path))
        assert b"".join(bufs)[:10_000] == data
        with pytest.raises(OSError, match=r"ended at byte 10000"):
            ops_module.pread_exact(ShortOps(999), fd, [memoryview(b) for b in bufs], 0, 10_001, str(path))
    finally:
        os.close(fd)


def test_resident_bytes_counts_up_to_the_first_missing_page(direct_dir) -> None:
    path = direct_dir / "m.bin"
    _file(path, 8 * 4096)
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert resident_bytes(fd, 0, 8 * 4096) == 0
        os.pread(fd, 1, 2 * 4096)  # page 2 (and what readahead adds after it)
        assert resident_bytes(fd, 0, 8 * 4096) == 0
        assert resident_bytes(fd, 2 * 4096 + 100, 3996) == 3996  # the rest of page 2
        got = resident_bytes(fd, 2 * 4096 + 100, 6 * 4096 - 100)  # to the end of the file
        assert 3996 <= got and got % 4096 == 3996  # whole pages from there: as far as readahead went
        assert resident_bytes(fd, 0, 0) == 0
    finally:
        os.close(fd)


def test_one_residency_mapping_answers_every_chunk_of_a_read(direct_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapping made and removed per chunk stalls the page faults of the other workers: a read
    maps the file once and asks that mapping (the same answers as ``resident_bytes``)."""
    size = 40 * MiB + 12345
    path = direct_dir / "q.bin"
    data = _file(path, size)
    _evict(path)
    with open(path, "rb") as f:
        f.seek(17 * MiB + 5)
        f.read(3 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        with Residency(fd, 0, size) as res:
            for off, n in [(0, size), (17 * MiB, 4 * MiB), (17 * MiB + 4096 + 7, MiB), (size - 100, 100), (5, 0)]:
                assert res.resident(off, n) == resident_bytes(fd, off, n)
    finally:
        os.close(fd)
    asked = []
    monkeypatch.setattr(ops_module, "resident_bytes", lambda *a: asked.append(a) or 0)
    res = _read(CountingOps(), path)
    assert bytes(memoryview(res.buffer)[:size]) == data and asked == []


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



def test_a_file_system_that_refuses_o_direct_reads_is_read_buffered(direct_dir, caplog) -> None:
    """Some file systems accept O_DIRECT at open and refuse the reads (EINVAL), as writes there
    are refused (and fall back): a load reads the file again through the page cache."""
    import errno
    import logging

    from fastckpt.testing import Fault, FaultyOps

    path = direct_dir / "a.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.arange(1 << 20)}, str(path)).wait()
    ops = FaultyOps([Fault("preadv", errno.EINVAL)])
    with caplog.at_level(logging.INFO, logger="fastckpt"), fastckpt.Checkpointer(ops=ops) as ck:
        assert torch.equal(ck.load(str(path))["w"], torch.arange(1 << 20))
    ops.assert_all_reached()
    assert any("refused an O_DIRECT read" in r.getMessage() for r in caplog.records)
