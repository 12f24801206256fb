"""Small storages are packed (issue #9, item 9): a state of many tiny tensors (Adam's ``step``
per parameter, scalars) gives a file no larger than torch.save's, a staging buffer to match, and
a file that plain torch.load reads in every mode, ``calculate_storage_offsets`` included."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.serialization import config as ser_config

import fastckpt
from fastckpt.format import layout as F

N = 20_000  # the issue measured 100,000 (benchmarks/save_bench.py --small); the ratio is the same


@pytest.fixture(scope="module")
def tiny() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(4, generator=gen) for i in range(N)}


def test_file_and_staging_no_larger_than_torch_save(tmp_path, tiny) -> None:
    ref = tmp_path / "torch.pt"
    torch.save(tiny, ref)
    path = tmp_path / "fast.pt"
    with fastckpt.Checkpointer() as ck:
        rec = ck.save(tiny, str(path)).wait()
        staged = ck._staging.capacities()
    size, want = path.stat().st_size, ref.stat().st_size
    assert size <= 1.1 * want, f"{size} bytes against torch.save's {want}"
    assert rec.bytes == size
    assert staged and max(staged) <= 1.1 * want + (2 << 20)  # one buffer of the file's size + headroom


@pytest.mark.parametrize("mode", ["plain", "mmap", "calculate_storage_offsets", "debug_asserts"])
def test_packed_file_is_plain_torch_loadable(tmp_path, tiny, mode, monkeypatch) -> None:
    state = dict(list(tiny.items())[:500])
    state["big"] = torch.arange(1 << 16, dtype=torch.float64)  # one large record among small ones
    path = tmp_path / "p.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(state, str(path)).wait()
    assert torch._C.PyTorchFileReader(str(path)).get_record(".storage_alignment") == str(F.SMALL_ALIGN).encode()
    old = ser_config.load.calculate_storage_offsets
    if mode == "calculate_storage_offsets":  # torch computes each offset from the file's one alignment
        ser_config.load.calculate_storage_offsets = True
    if mode == "debug_asserts":  # torch checks its computed offsets against the zip directory
        monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    try:
        out = torch.load(path, weights_only=True, mmap=mode != "plain")
    finally:
        ser_config.load.calculate_storage_offsets = old
    assert out.keys() == state.keys()
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_large_records_stay_page_aligned(tmp_path) -> None:
    # an optimizer state: large moments plus one scalar step per parameter
    state = {f"p{i}": {"exp_avg": torch.zeros(1 << 18), "step": torch.tensor(float(i))} for i in range(40)}
    layout = F.plan(state)
    assert layout.align == F.ALIGN
    assert all(r.offset % F.ALIGN == 0 for r in layout.storages)
    path = tmp_path / "o.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(state, str(path)).wait()
        assert ck.load(str(path))["p3"]["step"].item() == 3.0
    assert torch._C.PyTorchFileReader(str(path)).get_record(".storage_alignment") == b"4096"
    assert os.path.getsize(path) < layout.payload_bytes * (1 + F.PAD_BUDGET) + (64 << 10)
