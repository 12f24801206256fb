"""Lazy saves (``save(lazy=True)``): the call returns before the copy, ``fence()`` waits for it
(counted as blocked time), and what is written is what the tensors held at the call."""

from __future__ import annotations

import threading

import torch

import fastckpt
from fastckpt.save import snapshot as snapshots


def test_lazy_copy_fence_then_mutate(tmp_path, monkeypatch) -> None:
    started, go = threading.Event(), threading.Event()
    real = snapshots.snapshot

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (the snapshot thread waits for the test)
        started.set()
        assert go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr("fastckpt.save.saver.snapshot", held)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 3}
    ref = state["w"].clone()
    with fastckpt.Checkpointer() as ck:
        h = ck.save(state, str(tmp_path / "l.pt"), lazy=True)
        assert started.wait(30) and not h.done()  # returned before the copy
        go.set()
        assert ck.fence() >= 0.0
        state["w"].add_(1)  # the optimizer step, after the fence
        h.wait()
        out = ck.load(str(tmp_path / "l.pt"))
        assert ck.stats().saves == 1
    assert torch.equal(out["w"], ref) and out["step"] == 3
