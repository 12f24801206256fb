"""format.layout.Planner: a state whose structure and values were planned before reuses that
layout (the metadata pass leaves the save's hot path); any difference torch.save's metadata
would show plans afresh."""

from __future__ import annotations

import array
import collections
import dataclasses
from collections.abc import Callable

import pytest
import torch

import fastckpt
from fastckpt.format import layout as F


def _state(step: object = 7, lr: float = 0.1) -> dict:
    w = torch.randn(64, 32)
    return {"model": collections.OrderedDict(w=w, b=torch.zeros(32), view=w[1:]),
            "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(64, 32)}},
                      "param_groups": [{"lr": lr, "betas": (0.9, 0.999), "params": [0]}]},
            "step": step, "name": "run", "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "none": None}


def _same_layout(a: F.FileLayout, b: F.FileLayout) -> bool:
    return (a.segments, a.data_size, a.align, [(r.key, r.offset, r.nbytes) for r in a.storages]) == \
        (b.segments, b.data_size, b.align, [(r.key, r.offset, r.nbytes) for r in b.storages])


def test_same_structure_reuses_the_layout_bound_to_the_new_storages() -> None:
    planner = F.Planner()
    first = planner.plan(_state())
    again = _state()  # equal structure and values, new tensors
    reused = planner.plan(again)
    assert planner.hits == 1
    assert _same_layout(reused, F.plan(again))
    assert _same_layout(reused, first)
    assert [r.storage._cdata for r in reused.storages] == [r.storage._cdata for r in F.plan(again).storages]


@pytest.mark.parametrize("change", [
    lambda s: s.__setitem__("step", 8),  # a value
    lambda s: s.__setitem__("step", True),  # 1 == True, but they pickle differently
    lambda s: s.__setitem__("step", 7.0),  # 7 == 7.0 too
    lambda s: s["model"].__setitem__("b", torch.zeros(32).unsqueeze(1)),  # one more dimension, the same numbers
    lambda s: s["optim"]["param_groups"][0].__setitem__("lr", -0.0),
    lambda s: s["model"].__setitem__("b", torch.zeros(33)),  # a shape
    lambda s: s["model"].__setitem__("b", torch.zeros(32, dtype=torch.float64)),  # a dtype
    lambda s: s["model"].__setitem__("b", torch.zeros(64)[::2]),  # a stride and a storage size
    lambda s: s["model"].__setitem__("view", s["model"]["w"].clone()[1:]),  # storage sharing
    lambda s: s["model"].__setitem__("b", s["model"]["w"]),  # the same tensor twice (a memo reference)
    lambda s: s["model"].move_to_end("w"),  # key order
    lambda s: s["model"]["w"].requires_grad_(True),
    lambda s: setattr(s["model"], "_metadata", {"": {"version": 2}}),  # an OrderedDict's attribute
])
def test_any_difference_plans_afresh(change) -> None:  # noqa: ANN001
    planner = F.Planner()
    base = _state(lr=0.0)
    planner.plan(base)
    other = _state(lr=0.0)
    change(other)
    layout = planner.plan(other)
    assert planner.hits == 0
    assert _same_layout(layout, F.plan(other))


def test_a_nan_of_other_bits_plans_afresh(tmp_path) -> None:
    """Floats were keyed by float.hex(), which is 'nan' for every NaN: a NaN of another sign or
    payload reused the earlier pickle, and loaded with the earlier save's bits."""
    import struct

    def bits(f: float) -> int:
        return struct.unpack("<Q", struct.pack("<d", f))[0]

    other = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000001))[0]
    with fastckpt.Checkpointer() as ck:
        for i, x in enumerate((float("nan"), other)):
            ck.save({"t": torch.ones(3), "x": x}, str(tmp_path / f"{i}.pt")).wait()
        assert ck._saver._planner.hits == 0
    assert [bits(torch.load(tmp_path / f"{i}.pt")["x"]) for i in (0, 1)] == [bits(float("nan")), bits(other)]


def test_a_state_dicts_metadata_is_part_of_its_structure(tmp_path) -> None:
    """Module state_dicts are OrderedDicts with a ``_metadata`` attribute (load_state_dict reads
    its versions); pickle writes an OrderedDict's attributes after its items. A layout reused
    for equal keys and shapes once wrote the first save's ``_metadata`` into every later file."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    planner = F.Planner()
    planner.plan({"model": model.state_dict()})
    assert planner.plan({"model": model.state_dict()}) is not None and planner.hits == 1  # the fast path stays
    changed = model.state_dict()
    changed._metadata["1"]["version"] = 1
    changed.extra = torch.arange(3)  # an attribute holding a tensor: its storage comes after the items'
    layout = planner.plan({"model": changed})
    assert planner.hits == 1 and _same_layout(layout, F.plan({"model": changed}))
    with fastckpt.Checkpointer() as ck:
        for i, sd in enumerate((model.state_dict(), changed, model.state_dict(), changed)):
            ck.save({"model": sd}, str(tmp_path / f"{i}.pt")).wait()
        assert ck._saver._planner.hits == 2
        for i, want in enumerate((2, 1, 2, 1)):
            got = torch.load(tmp_path / f"{i}.pt", weights_only=False)["model"]
            assert got._metadata["1"]["version"] == want and hasattr(got, "extra") == (want == 1)
            assert not hasattr(got, "extra") or torch.equal(got.extra, torch.arange(3))


def test_templates_hold_no_storage_and_are_bounded() -> None:
    planner = F.Planner(cached=2)
    for step in range(5):
        planner.plan(_state(step=step))
    assert len(planner._layouts) == 2
    templates = [t for _, _, t in planner._layouts]
    assert all(type(t) is F.Template for t in templates)
    kept = [getattr(t, f.name) for t in templates for f in dataclasses.fields(t)]
    assert all(type(v) in (F.Segments, array.array, int) for v in kept), [type(v) for v in kept]
    planner.plan(_state(step=4))
    assert planner.hits == 1


def test_reused_layouts_write_correct_files(tmp_path) -> None:
    states = [_state(step=s % 2) for s in range(4)]  # two structures, alternating
    with fastckpt.Checkpointer() as ck:
        for i, st in enumerate(states):
            ck.save(st, str(tmp_path / f"{i}.pt")).wait()
        assert ck._saver._planner.hits == 2
        for i, st in enumerate(states):
            out = ck.load(str(tmp_path / f"{i}.pt"))
            assert out["step"] == st["step"] and torch.equal(out["model"]["w"], st["model"]["w"])
            assert out["model"]["view"].untyped_storage().data_ptr() == out["model"]["w"].untyped_storage().data_ptr()
            assert torch.load(tmp_path / f"{i}.pt", weights_only=True)["size"] == torch.Size([2, 3])


def test_the_collector_is_paused_for_the_walk_and_a_reuse_only(monkeypatch) -> None:
    import gc

    seen: list[tuple[str, bool]] = []

    def spy(name: str, fn: Callable) -> Callable:
        def wrapped(*args: object, **kwargs: object) -> object:
            seen.append((name, gc.isenabled()))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(F, "scan", spy("walk", F.scan))
    monkeypatch.setattr(F, "plan", spy("metadata pass", F.plan))  # a new structure: torch.save's pass
    monkeypatch.setattr(F.Template, "bind", spy("reuse", F.Template.bind))
    planner, state = F.Planner(), _state()
    planner.plan(state)
    planner.plan(state)
    assert planner.hits == 1 and gc.isenabled()
    assert seen == [("walk", False), ("metadata pass", True), ("walk", False), ("reuse", False)]
    gc.disable()
    try:
        planner.plan(state)
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()
