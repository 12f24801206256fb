"""Bit-exact comparison of nested checkpoint structures, shared by the integration tests
(imports neither Lightning nor DeepSpeed, so worker processes can use it cheaply)."""

from __future__ import annotations

import enum

import torch

PLAIN = (int, float, str, bool, bytes, type(None), enum.Enum, torch.Size, torch.dtype, torch.device)


def tree_equal(a: object, b: object, where: str = "") -> None:
    """Assert bit-exact equality of nested checkpoint structures: tensors, containers, plain
    values, and other objects (a framework's loss scaler, say) by their attributes."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            tree_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            tree_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, PLAIN) or not hasattr(a, "__dict__"):
        assert a == b, f"{where}: {a!r} != {b!r}"
    else:
        assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
        tree_equal(vars(a), vars(b), where)
