"""A cached layout's metadata (``format.segments``): kept compressed when large, given back span
by span, and copied into a staging buffer only when the buffer does not hold it already; and the
heap given back after a save of many tensors (``save.heap``)."""

from __future__ import annotations

import gc
import random
import weakref
from array import array

import pytest
import torch

import fastckpt
from fastckpt.format import layout as F
from fastckpt.format import segments as S
from fastckpt.save import heap
from fastckpt.save.snapshot import snapshot
from fastckpt.save.staging import _new_buffer
from fastckpt.testing import FaultyOps


def _spans(rng: random.Random) -> tuple[bytes, array, array]:
    lens = [rng.choice([0, 1, 5, 100, 3000]) for _ in range(rng.randint(0, 60))]
    starts, offsets, pos = array("q"), array("q"), 0
    for i, n in enumerate(lens):
        starts.append(pos)
        offsets.append(i * 7)
        pos += n
    return rng.randbytes(pos), offsets, starts


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("inflate", [1, 7, 4096, 1 << 20])
def test_segments_give_back_every_span_packed_or_not(monkeypatch, packed, inflate) -> None:
    monkeypatch.setattr(S, "PACK_ABOVE", -1 if packed else 1 << 40)
    monkeypatch.setattr(S, "INFLATE_BYTES", inflate)  # spans cut across the inflated pieces
    rng = random.Random(inflate)
    for _ in range(40):
        blob, offsets, starts = _spans(rng)
        seg = S.Segments(blob, offsets, starts)
        want = [(offsets[i], blob[starts[i] : starts[i + 1] if i + 1 < len(starts) else len(blob)])
                for i in range(len(offsets))]
        assert [(off, bytes(data)) for off, data in seg] == want
        assert seg.blob == blob
        assert seg == S.Segments(blob, offsets, starts)


def test_large_metadata_is_kept_compressed() -> None:
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(4, generator=gen) for i in range(10_000)}
    seg = F.plan(state).segments
    assert seg.size > S.PACK_ABOVE
    assert seg.kept_bytes * 4 < seg.size  # zip headers and the pickle compress about 7 x
    small = F.plan({"w": torch.zeros(1 << 16)}).segments
    assert small.kept_bytes == small.size  # a few KiB: kept as they are


def _state(seed: int, n: int = 300) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"small": {f"t{i}": torch.randn(4, generator=gen) for i in range(n)}, "big": torch.randn(1 << 15),
            "step": seed}


def _image(layout: F.FileLayout) -> bytes:
    fresh = _new_buffer(layout.data_size + 4096, False)
    snapshot(layout, fresh)
    return bytes(fresh.view[: layout.covered_bytes])


def test_a_buffer_that_holds_the_metadata_is_not_given_it_again(monkeypatch) -> None:
    a, b = _state(0), _state(1, n=200)
    la, lb = F.plan(a), F.plan(b)
    buf = _new_buffer(max(la.data_size, lb.data_size) + 4096, False)
    copies: list[int] = []
    real_iter = S.Segments.__iter__
    monkeypatch.setattr(S.Segments, "__iter__", lambda self: (copies.append(self.serial), real_iter(self))[1])

    snapshot(la, buf)
    assert copies == [la.segments.serial] and buf.holds == la.segments.serial
    for t in a["small"].values():
        t.add_(1.0)  # in place: the same layout, new bytes
    a["big"].mul_(-1.0)
    snapshot(la, buf)
    assert copies == [la.segments.serial]  # the storages only
    monkeypatch.setattr(S.Segments, "__iter__", real_iter)
    assert bytes(buf.view[: la.covered_bytes]) == _image(la)

    monkeypatch.setattr(S.Segments, "__iter__", lambda self: (copies.append(self.serial), real_iter(self))[1])
    snapshot(lb, buf)  # another structure takes the buffer, then the first one comes back
    snapshot(la, buf)
    assert copies == [la.segments.serial, lb.segments.serial, la.segments.serial]
    monkeypatch.setattr(S.Segments, "__iter__", real_iter)
    assert bytes(buf.view[: la.covered_bytes]) == _image(la)


def test_saves_into_a_buffer_that_holds_the_metadata_load_back(tmp_path) -> None:
    state = _state(0)
    with fastckpt.Checkpointer() as ck:
        for i in range(3):
            ck.save(state, str(tmp_path / f"{i}.pt")).wait()
            for t in state["small"].values():
                t.add_(1.0)
        assert ck._saver._planner.hits == 2
    for i in range(3):
        out = torch.load(tmp_path / f"{i}.pt", weights_only=True)
        assert torch.equal(out["small"]["t7"], _state(0)["small"]["t7"] + i)
        assert fastckpt.load(str(tmp_path / f"{i}.pt"))["step"] == 0


@pytest.mark.parametrize("records", [3, 10**9])
def test_a_save_of_many_tensors_gives_the_heap_back_once_its_objects_are_gone(tmp_path, monkeypatch,
                                                                               records) -> None:
    monkeypatch.setattr(heap, "TRIM_AFTER_RECORDS", records)
    layouts: list[weakref.ref] = []
    real_plan = F.Planner.plan

    def plan(self: F.Planner, *args: object, **kwargs: object) -> F.FileLayout:
        layout = real_plan(self, *args, **kwargs)
        layouts.append(weakref.ref(layout))
        return layout

    monkeypatch.setattr(F.Planner, "plan", plan)
    alive_at_trim: list[bool] = []
    monkeypatch.setattr(heap, "trim", lambda: alive_at_trim.append(gc.collect() >= 0 and layouts[-1]() is not None))
    ops = FaultyOps()
    gate = ops.gate("fsync", "state.pt")  # the write ends after save() has returned
    with fastckpt.Checkpointer(ops=ops) as ck:
        handle = ck.save({f"t{i}": torch.ones(4) * i for i in range(3)}, str(tmp_path / "state.pt"))
        assert gate.wait_entered()
        gate.open()
        handle.wait()
    assert alive_at_trim == ([False] if records == 3 else [])
    assert fastckpt.load(str(tmp_path / "state.pt"))["t2"].tolist() == [2.0] * 4


def test_trim_runs_where_the_c_library_has_it() -> None:
    import ctypes

    assert heap.trim() == hasattr(ctypes.CDLL(None), "malloc_trim")


def test_the_trailer_is_found_without_inflating_the_metadata() -> None:
    sink = F._SeekOnlySink()
    sink.write(b"head")
    sink.seek(100)
    sink.write(b"trailer")  # ends the file
    assert sink.tail() == (100, b"trailer")
    sink.seek(0)
    sink.write(b"HEAD")  # a header rewritten after the trailer: the trailer still ends last
    assert sink.tail() == (100, b"trailer")
    assert [(off, bytes(b)) for off, b in sink.segments()] == [(0, b"head"), (100, b"trailer"), (0, b"HEAD")]


def test_files_of_equal_size_keep_to_the_buffers_that_hold_their_metadata(tmp_path, monkeypatch) -> None:
    x = _state(0)
    y = {"small": {f"u{i}": t.clone() for i, t in enumerate(x["small"].values())}, "big": x["big"].clone(),
         "step": 1}  # another structure, of the same size: the pool's two buffers fit either
    copies: list[int] = []
    real_iter = S.Segments.__iter__
    monkeypatch.setattr(S.Segments, "__iter__", lambda self: (copies.append(self.serial), real_iter(self))[1])
    ops = FaultyOps()
    with fastckpt.Checkpointer(ops=ops, staging_buffers=2) as ck:
        for rnd in range(4):  # the first file of each round holds its buffer while the second is saved
            first, second = (("x", x), ("y", y)) if rnd % 2 == 0 else (("y", y), ("x", x))
            gate = ops.gate("fsync", f"{first[0]}{rnd}.pt")
            h1 = ck.save(first[1], str(tmp_path / f"{first[0]}{rnd}.pt"))
            assert gate.wait_entered()
            h2 = ck.save(second[1], str(tmp_path / f"{second[0]}{rnd}.pt"))
            gate.open()
            h1.wait()
            h2.wait()
        assert ck._saver._planner.hits == 6 and len(ck._saver._staging.capacities()) == 2
    assert len(copies) == 2  # each structure's metadata copied once, by its first save
    for rnd in range(4):
        assert list(fastckpt.load(str(tmp_path / f"y{rnd}.pt"))["small"])[:2] == ["u0", "u1"]
        assert torch.equal(fastckpt.load(str(tmp_path / f"x{rnd}.pt"))["big"], x["big"])
