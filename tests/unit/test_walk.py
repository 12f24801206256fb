"""format/walk.py: one memoised walk per state (issue #9, item 5): a cyclic container saves as
torch.save saves it, and deeply shared containers cost one visit each, not one per path."""

from __future__ import annotations

import threading

import pytest
import torch

import fastckpt
from fastckpt.errors import UnsupportedObjectError
from fastckpt.format import layout as F
from fastckpt.format import walk


def _within(fn, timeout_s: float = 120.0):  # noqa: ANN001, ANN202
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it never returns.

    The bound is generous: the fixed walk takes milliseconds, the old one never ended.
    """
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (re-raised on the test's thread)
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "save() did not return: the walk loops or grows exponentially"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _deep_shared(depth: int) -> list:
    x: list = [torch.arange(3)]
    for _ in range(depth):
        x = [x, x]  # 2**depth paths, depth + 1 distinct lists
    return x


def test_cyclic_list_saves_and_loads(tmp_path) -> None:
    c: list = [torch.ones(2)]
    c.append(c)
    path = str(tmp_path / "c.pt")
    with fastckpt.Checkpointer() as ck:
        _within(lambda: ck.save({"c": c}, path).wait())
        out = ck.load(path)
    assert out["c"][1] is out["c"] and torch.equal(out["c"][0], torch.ones(2))
    plain = torch.load(path, weights_only=True)  # as torch.save would have written it
    assert plain["c"][1] is plain["c"]


def test_cycle_through_a_tuple(tmp_path) -> None:
    holder: list = []
    holder.append((holder, torch.zeros(4)))
    path = str(tmp_path / "t.pt")
    with fastckpt.Checkpointer() as ck:
        _within(lambda: ck.save({"h": holder}, path).wait())
        out = ck.load(path)
    assert out["h"][0][0] is out["h"] and torch.equal(out["h"][0][1], torch.zeros(4))


def test_deeply_shared_list_is_walked_once(tmp_path) -> None:
    state = {"x": _deep_shared(40)}  # 2**40 paths: the old walk never returned
    scan = _within(lambda: walk.scan(state))
    assert scan is not None and len(scan.storages) == 1
    sig = scan.signature  # one flat sequence: each visit starts with its type, a memo reference with "@"
    assert (sig.count(list), sig.count(torch.Tensor), sig.count(dict), sig.count("@")) == (41, 1, 1, 40)
    path = str(tmp_path / "d.pt")
    with fastckpt.Checkpointer() as ck:
        _within(lambda: ck.save(state, path).wait())
        out = ck.load(path)
    x = out["x"]
    for _ in range(40):
        assert x[0] is x[1]
        x = x[0]
    assert torch.equal(x[0], torch.arange(3))


class Box(dict):
    """A dict subclass is not "plain": the general walk (check_tensors, key_path) runs."""


def test_general_path_is_memoised_too() -> None:
    state = Box(x=_deep_shared(40))
    assert walk.scan(state) is None
    _within(lambda: walk.check_tensors(state))
    assert _within(lambda: walk.key_path(state, lambda v: isinstance(v, torch.Tensor))) == \
        "state['x']" + "[0]" * 41
    layout = _within(lambda: F.plan(state))
    assert len(layout.storages) == 1


def test_meta_tensor_in_a_cycle_is_named() -> None:
    c: list = []
    c.append({"m": torch.empty(3, device="meta"), "c": c})
    with pytest.raises(UnsupportedObjectError, match=r"state\['c'\]\[0\]\['m'\] is a tensor on the meta device"):
        _within(lambda: F.plan({"c": c}))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_strided_nested_tensor_is_named_and_jagged_one_saves(tmp_path) -> None:
    """A strided nested tensor (torch.nested's default) cannot go through torch.save's skip_data
    pass and its .shape raises: refused naming its key and the fix, on the plain-state walk and on
    the general one (a tuple key), and no file is left. A jagged one saves and loads."""
    parts = [torch.ones(2), torch.full((3,), 2.0)]
    nt = torch.nested.nested_tensor(parts)
    with fastckpt.Checkpointer() as ck:
        for state, where in (({"v": nt}, r"state\['v'\]"), ({("k", 1): [nt]}, r"state\[\('k', 1\)\]\[0\]")):
            with pytest.raises(UnsupportedObjectError, match=where + r" is a nested tensor of layout torch.strided"
                                                              r".*to_padded_tensor.*layout=torch.jagged"):
                ck.save(state, str(tmp_path / "nested.pt"))
        assert not list(tmp_path.iterdir())
        jagged = torch.nested.nested_tensor(parts, layout=torch.jagged)
        ck.save({"v": jagged}, str(tmp_path / "jagged.pt")).wait()
    got = fastckpt.load(str(tmp_path / "jagged.pt"))["v"]
    assert got.is_nested and [t.tolist() for t in got.unbind()] == [t.tolist() for t in parts]
