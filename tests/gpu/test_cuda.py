"""CUDA paths (marked gpu; skipped without a CUDA device). benchmarks/gpu_check.py runs the
longer checks, GDS included, on a GPU machine."""

from __future__ import annotations

import pytest
import torch

import fastckpt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_state_round_trip_and_mutation_after_save(tmp_path) -> None:
    state = {"w": torch.arange(1 << 20, device="cuda", dtype=torch.int32)}
    ref = state["w"].cpu().clone()
    with fastckpt.Checkpointer() as ck:
        h = ck.save(state, str(tmp_path / "c.pt"))
        state["w"].add_(1)  # queued after the side-stream copy by the event wait
        h.wait()
        out = ck.load(str(tmp_path / "c.pt"))
    assert torch.equal(out["w"], ref)


def test_load_to_cuda(tmp_path) -> None:
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.ones(10)}, str(tmp_path / "x.pt")).wait()
        out = ck.load(str(tmp_path / "x.pt"), map_location="cuda")
    assert out["w"].is_cuda
