"""Lazy saves (``save(lazy=True)``): the call returns before the copy, ``fence()`` waits for it
(counted as blocked time), and what is written is what the tensors held at the call."""

from __future__ import annotations

import dataclasses
import threading
import types

import numpy as np
import torch

import fastckpt
from fastckpt.save import snapshot as snapshots
from tests.helpers import collect_only_new


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


def test_copy_unfenced_saves_what_torch_save_would(tmp_path) -> None:
    """The clones kept nothing of the structure torch.save writes: an unprotected parameter
    became a plain tensor, one tensor at two places two tensors, a view a storage of its own,
    and a cyclic state raised RecursionError."""
    from fastckpt.save.fencing import copy_unfenced, optimizer_tensors

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].requires_grad_(False)  # frozen: not the optimizer's, so cloned now
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    buf = torch.randn(5)
    ref = buf.clone()
    state = {"model": model.state_dict(keep_vars=True), "extra": {"a": buf, "b": buf, "view": buf[1:]},
             "grad": torch.ones(2, requires_grad=True)}
    state["self"] = state
    out = copy_unfenced(state, optimizer_tensors(opt))
    assert out["self"] is out and out["extra"]["a"] is out["extra"]["b"] is not buf
    buf.add_(1)  # changed after the call: the copy holds the values at the call
    with fastckpt.Checkpointer() as ck:
        ck.save(out, str(tmp_path / "l.pt"), lazy=True)
        ck.fence()
        ck.wait()
        got = ck.load(str(tmp_path / "l.pt"), weights_only=False)
    w = got["model"]["0.weight"]
    assert type(w) is torch.nn.Parameter and not w.requires_grad and torch.equal(w, model[0].weight)
    assert got["grad"].requires_grad
    assert got["extra"]["a"] is got["extra"]["b"] and torch.equal(got["extra"]["a"], ref)
    assert got["extra"]["view"].untyped_storage().data_ptr() == got["extra"]["a"].untyped_storage().data_ptr()
    assert got["self"] is got


class _Tagged(torch.Tensor):
    pass


def test_copy_unfenced_keeps_empty_tensors_dtypes_subclasses_and_attributes(tmp_path) -> None:
    """Every empty storage has data pointer 0: the one-clone-per-storage rule put every empty
    tensor on one clone, so they loaded with the first one's dtype."""
    from fastckpt.save.fencing import copy_unfenced

    noted = torch.ones(2)
    noted.note = "kept by torch.save"
    state = {"a": torch.empty(0), "b": torch.empty(0, dtype=torch.int64), "c": torch.empty(2, 0, dtype=torch.bfloat16),
             "tagged": torch.ones(3).as_subclass(_Tagged), "noted": noted}
    with fastckpt.Checkpointer() as ck:
        ck.save(copy_unfenced(state, []), str(tmp_path / "l.pt"), lazy=True)
        ck.fence()
        ck.wait()
        got = ck.load(str(tmp_path / "l.pt"), weights_only=False)
    assert [got[k].dtype for k in "abc"] == [torch.float32, torch.int64, torch.bfloat16]
    assert got["c"].shape == (2, 0) and type(got["tagged"]) is _Tagged and got["noted"].note == "kept by torch.save"


def test_lightning_row_counts_the_fence_of_a_group_commit(tmp_path, monkeypatch) -> None:
    """FastCkptIO under DeepSpeedStrategy: a lazily snapshotted group commit's ``ckpt/blocked_s``
    row is the commit's blocked time plus the optimizer step's wait for the copy."""
    from fastckpt.integrations._lightning.saves import SaveLedger

    release = threading.Event()
    real = snapshots.snapshot

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (no copy before the fence)
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr("fastckpt.save.saver.snapshot", held)
    group = str(tmp_path / "tag")
    with fastckpt.Checkpointer() as ck:
        real_fence, waits = ck.fence, []

        def fence() -> float:  # a spy on the real fence: it releases the held copy, then waits for it
            release.set()
            waits.append(real_fence())
            return waits[-1]

        ck.fence = fence  # type: ignore[method-assign]
        ck.save({"w": torch.ones(1 << 16)}, f"{group}/model.pt", group=group, lazy=True)
        ledger = SaveLedger()
        item = ledger.add(ck.commit(group), step=1, blocked_s=None, lazy=True)
        assert ledger.harvest(ck.stats, keep_rows=True) == [] and ledger.drain_rows() == []  # unfenced: no row
        ledger.fence(ck)
        ledger.wait(item)
        rec = item.handle.wait()
        assert ledger.harvest(ck.stats, keep_rows=True) == []
        (row,) = ledger.drain_rows()
    assert waits[0] > 0  # (closing the Checkpointer fences again: nothing is left to wait for)
    assert row["ckpt/blocked_s"] == rec.blocked_s + waits[0] and row["ckpt/step"] == 1.0


def test_lazy_saves_never_fenced_hold_no_state_and_are_counted(tmp_path) -> None:
    """A loop that waits on each lazy save's handle and never fences (nothing mutates what it
    saved): once a copy ends its state is let go, and stats() counts the save."""
    import gc
    import weakref

    import numpy as np

    with fastckpt.Checkpointer() as ck, collect_only_new():
        for i in range(3):
            arr = np.full(1 << 16, float(i), dtype=np.float32)  # the tensor's memory: alive while it is
            alive = weakref.ref(arr)
            rec = ck.save({"w": torch.from_numpy(arr)}, str(tmp_path / f"s{i}.pt"), lazy=True).wait()
            del arr
            gc.collect()
            assert alive() is None  # nothing of fastckpt holds the saved state any more
            assert ck.stats().saves == i + 1 and ck.stats().blocked_s >= rec.blocked_s
        assert ck.fence() >= 0.0 and ck.stats().saves == 3  # a late fence counts nothing twice
        assert ck.load(str(tmp_path / "s2.pt"))["w"][0] == 2.0


def test_copy_unfenced_clones_tensors_held_by_other_objects(tmp_path, monkeypatch) -> None:
    """``copy_unfenced`` walked dicts, lists and tuples only: a tensor in a namespace, a dataclass
    or a tensor's attribute reached the lazy copy as the live tensor, so a change made after the
    call (the forward pass) was saved. Protected tensors in such objects stay shared."""
    from fastckpt.save.fencing import copy_unfenced

    started, go = threading.Event(), threading.Event()
    real = snapshots.snapshot

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (the copy starts after the change)
        started.set()
        assert go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr("fastckpt.save.saver.snapshot", held)
    param = torch.zeros(4)
    stats, noted = torch.zeros(4), torch.zeros(2)
    noted.extra = torch.zeros(3)
    state = {"tracker": types.SimpleNamespace(stats=stats, param=param, seen={1, 2}), "noted": noted}
    copied = copy_unfenced(state, [param])
    assert copied["tracker"].param is param and copied["tracker"].stats is not stats
    with fastckpt.Checkpointer() as ck:
        h = ck.save(copied, str(tmp_path / "l.pt"), lazy=True)
        assert started.wait(30)
        for t in (stats, noted.extra):
            t.add_(5)  # the forward pass, before the fence
        go.set()
        ck.fence()
        h.wait()
        got = ck.load(str(tmp_path / "l.pt"), weights_only=False)
    assert torch.equal(got["tracker"].stats, torch.zeros(4)) and torch.equal(got["noted"].extra, torch.zeros(3))
    assert got["tracker"].seen == {1, 2}


@dataclasses.dataclass
class _Holder:  # at module level: pickle finds its class by name
    table: np.ndarray
    t: torch.Tensor


def test_copy_unfenced_keeps_what_copied_objects_share() -> None:
    """Each object was re-pickled on its own: an array that twenty dataclasses hold became twenty
    arrays (a checkpoint twenty times the size ``torch.save`` writes). One pickle memo serves
    them all now; a tensor's attribute that is such an object is copied too."""
    from fastckpt.save.fencing import copy_unfenced

    table, shared, meta = np.zeros(1000), torch.zeros(2), types.SimpleNamespace(w=torch.ones(1))
    shared.meta = meta
    got = copy_unfenced({"holders": [_Holder(table, shared) for _ in range(20)]}, [])["holders"]
    assert len({id(h.table) for h in got}) == 1 and got[0].table is not table
    assert len({id(h.t) for h in got}) == 1 and got[0].t is not shared
    assert got[0].t.meta is not meta and torch.equal(got[0].t.meta.w, torch.ones(1))
