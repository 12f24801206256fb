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
    assert out["w"].is_cuda  # as torch.load: back on the device it was saved from
    assert torch.equal(out["w"].cpu(), ref)


def test_load_to_cuda(tmp_path) -> None:
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.ones(10)}, str(tmp_path / "x.pt")).wait()
        out = ck.load(str(tmp_path / "x.pt"), map_location="cuda")
    assert out["w"].is_cuda


_GPU_SECOND = int(2e9)  # clock cycles of torch.cuda._sleep: about a second of queued GPU work


@pytest.mark.parametrize("tier", ["direct", "gds"])
def test_a_save_waits_for_the_kernels_that_produce_the_state(tmp_path, tier) -> None:
    from fastckpt.save.tiers import gds_unavailable_reason

    if tier == "gds" and (why := gds_unavailable_reason(True)):
        pytest.skip(why)
    w = torch.zeros(16 << 20, device="cuda")
    torch.cuda._sleep(_GPU_SECOND)  # the optimizer step still running when save() is called
    w.fill_(7.0)
    with fastckpt.Checkpointer(tier=tier) as ck:
        ck.save({"w": w}, str(tmp_path / "w.pt")).wait()
    assert torch.all(fastckpt.load(str(tmp_path / "w.pt"))["w"] == 7.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("lazy", [False, True])
def test_a_state_on_two_gpus_is_saved_as_it_was_at_the_call(tmp_path, lazy) -> None:
    a = torch.zeros(16 << 20, device="cuda:0")
    b = torch.zeros(16 << 20, device="cuda:1")
    with torch.cuda.device(1):  # device 1 is still producing b, the current device is 0
        torch.cuda._sleep(_GPU_SECOND)
        b.fill_(5.0)
    a.fill_(3.0)
    with fastckpt.Checkpointer(tier="direct") as ck:
        h = ck.save({"a": a, "b": b}, str(tmp_path / "ab.pt"), lazy=lazy)
        if lazy:
            ck.fence()
        with torch.cuda.device(1):
            b.fill_(9.0)  # the next step on device 1: ordered after its copy, never saved
        h.wait()
    out = fastckpt.load(str(tmp_path / "ab.pt"))
    assert torch.all(out["a"] == 3.0) and torch.all(out["b"] == 5.0)
    assert torch.all(b == 9.0)
