"""Lazy snapshots of CUDA states (marked gpu; skipped without a CUDA device): the copy runs on a
side stream beside the kernels queued after the call, and ``fence()`` orders the next kernels
(the optimizer step) after it on the GPU, so what is written is what the tensors held at the
call. benchmarks/gpu_check.py measures the overlap with a real forward/backward."""

from __future__ import annotations

import pytest
import torch

import fastckpt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_lazy_cuda_snapshot_is_ordered_before_the_step(tmp_path) -> None:
    w = torch.randn(64 << 20, device="cuda")  # 256 MiB: the copy takes a while
    ref = w.cpu()
    x = torch.randn(4096, 4096, device="cuda")
    with fastckpt.Checkpointer(tier="direct") as ck:
        h = ck.save({"w": w}, str(tmp_path / "l.pt"), lazy=True)
        for _ in range(4):  # forward/backward-like work that does not touch w
            x = torch.tanh(x @ x)
        ck.fence()
        w.mul_(0).add_(7)  # the optimizer step, queued right after the fence: must not be saved
        h.wait()
        out = ck.load(str(tmp_path / "l.pt"))
    assert torch.equal(out["w"].cpu(), ref)
    assert torch.all(w == 7)
