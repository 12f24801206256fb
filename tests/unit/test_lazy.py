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


def test_copy_unfenced_defers_only_the_protected_storages() -> None:
    """What an integration passes to a lazy save: tensors of the protected storages (views
    included) as they are, every other tensor cloned, the containers' types kept."""
    from collections import OrderedDict

    from fastckpt.save.fencing import copy_unfenced, optimizer_tensors

    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([w])
    w.grad = torch.ones(4)
    opt.step()
    running = torch.zeros(4)
    state = {"model": OrderedDict(w=w, half=w.detach()[:2], running=running), "opt": opt.state_dict(),
             "pair": (running, 3)}
    out = copy_unfenced(state, optimizer_tensors(opt))
    assert out["model"]["w"] is w and out["model"]["half"] is state["model"]["half"]
    assert type(out["model"]) is OrderedDict
    assert out["opt"]["state"][0]["exp_avg"] is opt.state[w]["exp_avg"]
    assert out["model"]["running"] is not running and torch.equal(out["model"]["running"], running)
    assert out["pair"][0] is not running and out["pair"][1] == 3
    running.add_(1)  # what forward does to a BatchNorm buffer after the save returned
    assert torch.equal(out["model"]["running"], torch.zeros(4))
