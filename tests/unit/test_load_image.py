"""load.image: a page-aligned checkpoint is read into heap pieces, each large record in memory of
its own (as torch.load allocates storages), the checksum still over every byte wherever it landed;
any other file is read into one buffer, as before."""

from __future__ import annotations

import importlib
import mmap
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import CorruptCheckpointError
from fastckpt.format import checksum
from fastckpt.io.engine import block_digests
from fastckpt.io.image import BlockFetch, BlockStream, Bounce, image_digests, needs_bounce
from fastckpt.load.deserialize import deserialize
from fastckpt.load.image import OWN_BYTES, HeapImage, heap_image
from fastckpt.storage.homes import open_target
from tests.helpers import flip_byte

loader = importlib.import_module("fastckpt.load.loader")  # fastckpt.load is the function
MiB = 1 << 20


def _state() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {"a": torch.randn(1 << 20, generator=gen),  # 4 MiB
            "b": torch.randn((3 << 18) + 5, generator=gen),  # 3 MiB + 20 B: its last page is shared
            "small": [torch.arange(5) + i for i in range(8)],  # between and after the large ones
            "c": torch.randn(300_000, generator=gen).to(torch.float64),
            "step": 3}


def _same(a: dict, b: dict) -> bool:
    return (all(torch.equal(a[k], b[k]) for k in "abc") and b["step"] == 3
            and all(torch.equal(x, y) for x, y in zip(a["small"], b["small"], strict=True)))


@pytest.fixture
def images(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every image the loader's reads built (None: one buffer, or the factory raised)."""
    built: list = []

    def spy(fetch: Callable[[int, int], bytes], size: int, **kw: object) -> HeapImage | None:
        built.append(None)
        built[-1] = heap_image(fetch, size, **kw)
        return built[-1]

    monkeypatch.setattr(loader, "heap_image", spy)
    return built


def _record_offsets(path: str) -> dict[str, tuple[int, int]]:
    reader = torch._C.PyTorchFileReader(path)
    return {n: (reader.get_record_offset(n), reader.get_record_size(n))
            for n in reader.get_all_records() if n.startswith("data/")}


def test_large_records_get_heap_pieces_of_their_own(tmp_path: Path, images: list) -> None:
    path, state = str(tmp_path / "s.pt"), _state()
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
        out = ck.load(path)
    assert _same(state, out)
    (image,) = images
    assert isinstance(image, HeapImage)
    large = [(off, n) for off, n in _record_offsets(path).values() if n >= OWN_BYTES]
    assert len(large) == 3
    for off, n in large:  # a piece starts at the record, the next one only after it
        i = image.starts.index(off)
        assert image.starts[i + 1] >= off + n
    for key in "abc":  # each large tensor owns its storage: no other record's bytes in it
        st = out[key].untyped_storage()
        assert st.nbytes() == out[key].numel() * out[key].element_size() and st.data_ptr() % 4096 == 0
    del image, images[:]
    out["a"].add_(1)  # the storages are the loaded memory, writable, and outlive the image
    assert torch.equal(out["a"], state["a"] + 1)


@pytest.mark.parametrize("where", ["large record", "last page of a large record", "pickle", "small record",
                                   "central directory"])
def test_a_damaged_byte_in_any_piece_is_caught(tmp_path: Path, images: list, where: str) -> None:
    path, state = str(tmp_path / "s.pt"), _state()
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
        recs = sorted(_record_offsets(path).values(), key=lambda r: -r[1])
        if where == "large record":
            offset = recs[0][0] + 12345
        elif where == "last page of a large record":  # "b": the piece after it starts on the next page
            offset = sum(next(r for r in recs if r[1] % 4096)) - 1
        elif where == "pickle":
            offset = torch._C.PyTorchFileReader(path).get_record_offset("data.pkl") + 10
        elif where == "small record":
            offset = recs[-1][0] + 3
        else:  # an entry's sizes in the central directory, found from the end record
            tail = Path(path).read_bytes()[-70000:]
            at = tail.rfind(b"PK\x05\x06")
            offset = int.from_bytes(tail[at + 16 : at + 20], "little") + 20
        flip_byte(path, offset, 0x40)
        with pytest.raises(CorruptCheckpointError, match="corrupt|damaged|truncated"):
            ck.load(path)
    assert images  # the read went through the factory, whatever it decided


def test_small_records_are_read_into_one_buffer(tmp_path: Path, images: list) -> None:
    path = str(tmp_path / "s.pt")
    state = {f"t{i}": torch.arange(10) + i for i in range(200)}
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
        out = ck.load(path)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert images == [None]


def test_a_plain_torch_save_file_is_read_into_one_buffer(tmp_path: Path, images: list) -> None:
    path = str(tmp_path / "plain.pt")
    state = {"w": torch.randn(1 << 20)}
    torch.save(state, path)  # 64-byte alignment: no record starts on a page
    with fastckpt.Checkpointer() as ck:
        assert torch.equal(ck.load(path)["w"], state["w"])
    assert images == [None]


def _filled(size: int, spans: list[tuple[int, int]]) -> tuple[HeapImage, bytes]:
    data = os.urandom(size)
    image = HeapImage(size, spans)
    for off in range(0, size, 3 * MiB):  # pieces of ranges that start anywhere
        n = min(3 * MiB, size - off)
        at = off
        for start, count, view in image.pieces(off, n):
            assert start == at and len(view) >= count
            view[:count] = data[start : start + count]
            at += count
        assert at == off + n
    return image, data


def test_block_digests_over_pieces_equal_those_over_contiguous_bytes() -> None:
    size = 40 * MiB + 777
    image, data = _filled(size, [(4096, 20 * MiB + 3), (24 * MiB, 5 * MiB), (30 * MiB, 8 * MiB)])
    assert len(image.starts) == 7  # three records, and the bytes before, between and after them
    blocks = checksum.BLOCK_BYTES
    for off in range(0, size, blocks):
        n = min(blocks, size - off)
        assert image_digests(image, off, n, size) == block_digests(memoryview(data)[off:], off, n, size)
    assert image.fetch(24 * MiB - 10, 24 * MiB + 10) == data[24 * MiB - 10 : 24 * MiB + 10]


@pytest.mark.parametrize("limit", [40 * MiB + 777, 32 * MiB, 20 * MiB + 5, 16 * MiB])
def test_a_block_stream_fed_in_any_parts_gives_the_contiguous_digests(limit: int) -> None:
    """What a read hashes as it copies from the page cache, a few MiB at a time (io.image.BlockStream)."""
    data = memoryview(os.urandom(40 * MiB + 777))
    want = block_digests(data[16 * MiB :], 16 * MiB, len(data) - 16 * MiB, limit)
    for cuts in ([], [1, 4096, 2 << 20, 16 * MiB - 1, 16 * MiB, 16 * MiB + 3], list(range(0, 25 * MiB, 3 << 20))):
        stream, at = BlockStream(16 * MiB, limit), 16 * MiB
        for end in [16 * MiB + c for c in cuts] + [len(data)]:
            stream.feed(data[at:end])
            at = max(at, end)
        assert stream.digests() == want
    short = BlockStream(0, limit)
    short.feed(data[: limit - 1])
    with pytest.raises(AssertionError, match="fed up to"):
        short.digests()


def test_a_record_across_pieces_is_copied_not_misread() -> None:
    image, data = _filled(8 * MiB, [(MiB, 2 * MiB)])
    inside = image[MiB + 8 : MiB + 100]  # within a piece: a view of it
    across = image[MiB - 50 : MiB + 50]  # a damaged directory could name this
    assert bytes(inside.tolist()) == data[MiB + 8 : MiB + 100]
    assert bytes(across.tolist()) == data[MiB - 50 : MiB + 50]


def test_block_fetch_reads_each_block_once() -> None:
    data = os.urandom(300_000)
    reads: list[tuple[int, int]] = []

    def read(off: int, n: int) -> bytes:
        reads.append((off, n))
        return data[off : off + n]

    f = BlockFetch(read, len(data))
    assert f.fetch(65530, 65540) == data[65530:65540]  # across two blocks
    assert f.fetch(65536, 70000) == data[65536:70000]
    assert f.fetch(299_990, 400_000) == data[299_990:]  # past the end: what there is
    assert reads == [(0, 131072), (262144, 300_000 - 262144)]  # two blocks not read yet: one request
    reads.clear()
    tail = BlockFetch(read, len(data), (250_000, data[250_000:]))  # an object's tail, read already
    assert tail.fetch(260_000, 400_000) == data[260_000:] and reads == []
    assert tail.fetch(0, 4) == data[:4] and reads == [(0, 65536)]


def test_an_object_store_read_fills_a_heap_image(tmp_path: Path) -> None:
    path, state = str(tmp_path / "s.pt"), _state()
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
    t = open_target(f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run", parallelism=2)
    t.put_file(path, "s.pt", chunk_bytes=MiB)
    ranges: list[tuple[int, int]] = []
    read_range = t.read_range
    t.read_range = lambda key, lo, n, **kw: ranges.append((lo, n)) or read_range(key, lo, n, **kw)  # type: ignore[method-assign]
    res = t.read_object("s.pt", chunk_bytes=checksum.BLOCK_BYTES, into=heap_image)
    size = os.path.getsize(path)
    assert size < checksum.BLOCK_BYTES  # one chunk
    # the tail (for the manifest, and the zip directory in it), the first block, the chunk
    assert ranges == [(size - 65557, 65557), (0, 65536), (0, size)]
    flat = t.read_object("s.pt", chunk_bytes=checksum.BLOCK_BYTES)
    assert isinstance(res.buffer, HeapImage) and isinstance(flat.buffer, mmap.mmap)
    assert res.checksum == flat.checksum == res.manifest["checksum"]["value"]
    assert _same(state, deserialize(res.buffer, res.size, None, True, "s.pt"))


def test_needs_bounce_for_memory_or_offsets_off_a_page() -> None:
    buf = mmap.mmap(-1, 3 * 4096)
    view = memoryview(buf)
    try:
        assert not needs_bounce(4096, 8000, view[4096:])  # on pages, room for the last whole page
        assert needs_bounce(4096, 8000, view[64:])  # memory 64 bytes into a page
        assert needs_bounce(100, 8000, view)  # a file offset inside a page
        assert needs_bounce(0, 8000, view[: 8000])  # no room for the rest of the last page
    finally:
        view.release()
        buf.close()


def test_bounce_moves_a_piece_a_buffer_at_a_time_from_any_offset() -> None:
    data = os.urandom(50_000)
    calls: list[tuple[int, int]] = []

    def read(buf: memoryview, off: int, n: int) -> None:
        assert off % 4096 == 0 and len(buf) % 4096 == 0 and len(buf) >= n
        calls.append((off, n))
        buf[:n] = data[off : off + n]

    bounce, out, fed = Bounce(nbytes=8192), bytearray(30_000), bytearray()
    try:
        bounce.read_through(read, memoryview(out), 10_001, 30_000, fed.extend)
    finally:
        bounce.close()
    assert bytes(out) == data[10_001:40_001] == bytes(fed)
    assert calls == [(8192, 8192), (16384, 8192), (24576, 8192), (32768, 7233)]  # from the page of byte 10,001


def _pickle_at(path: str) -> int:
    """Where the bytes of ``path``'s ``data.pkl`` start."""
    return torch._C.PyTorchFileReader(path).get_record_offset("data.pkl")


#: One byte of the metadata, damaged so that parsing it (before the checksum is known) fails in
#: a different way each: (the bytes to find, where it starts in the pickle or the directory, the
#: byte to change in them, the mask, whether the load fills ``into``).
_METADATA = {
    "a record's name in the directory": (b"archive/data.pkl", "directory", 9, 0xFF, False),  # UnicodeDecodeError
    "the alignment record": (b"4096", "file", 1, 0x40, False),  # ValueError from int()
    "a key the tensors are under": (b"weight", "pickle", 0, 0x01, True),  # 'veight': into= does not match
    "a storage's key": (b"X\x01\x00\x00\x000", "pickle", 5, 0x01, True),  # AssertionError in torch's loader
    "a class name": (b"FloatStorage", "pickle", 11, 0x01, True),  # the safe unpickler refuses it
    "an opcode": (b"K\x07u", "pickle", 0, 0x01, True),  # struct.error
}


def _damage_metadata(path: str, case: str) -> None:
    find, region, at, mask, _ = _METADATA[case]
    data = Path(path).read_bytes()
    start = {"pickle": _pickle_at(path), "file": 0,
             "directory": int.from_bytes(data[data.rfind(b"PK\x05\x06") + 16:][:4], "little")}[region]
    flip_byte(path, data.index(find, start) + at, mask)


@pytest.mark.parametrize("case", list(_METADATA))
def test_damaged_metadata_is_corruption_and_falls_back(tmp_path: Path, case: str) -> None:
    """The zip's directory (and, for into=, the pickle) is parsed before the checksum is known:
    whatever that parse raises on a damaged byte, the load reports corruption naming the file,
    and a damaged burst-buffer copy falls back to the good one at the path."""
    state = {"model": {"weight": torch.randn(1_000_000), "bias": torch.randn(300_000)}, "step": 7}
    into = _METADATA[case][4]
    dest = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    path = str(tmp_path / "home" / "x.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(state, path).wait()
        _damage_metadata(ck.local_path(path), case)
        got = ck.load(path, into=dest) if into else ck.load(path)
        assert ck.stats().last_restore_from == "path"
        assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
        _damage_metadata(path, case)
        with pytest.raises(CorruptCheckpointError, match=f"{path} is corrupt"):
            ck.load(path, into=dest) if into else ck.load(path)
