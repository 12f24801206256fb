"""What a lazy save may leave for later: the tensors that only the fenced optimizer step changes.

``Checkpointer.save(lazy=True)`` copies the tensors' bytes after it returns, until ``fence()``.
An integration that fences before each optimizer step passes the state through
``copy_unfenced`` first: tensors of the ``protected`` storages (parameters and optimizer state,
which nothing but that step changes) stay as they are and are copied later; every other tensor
(BatchNorm statistics that the forward pass updates, a user's extras) is cloned now, on the
caller's thread, because nothing orders the copy before whatever changes it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Which storage ``t`` is a view of (views of one storage share it)."""
    return str(t.device), t.untyped_storage().data_ptr()


def map_tensors(obj: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """A copy of the containers of ``obj`` (types and attributes kept) with ``fn`` applied to tensors."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (dict, list)):
        new = copy.copy(obj)  # keeps the type and attributes, e.g. a state_dict's _metadata
        for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            new[k] = map_tensors(v, fn)
        return new
    if isinstance(obj, tuple):
        items = [map_tensors(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """The tensors an optimizer step changes: the parameters it updates and its state."""
    for group in optimizer.param_groups:
        yield from group["params"]
    for st in optimizer.state.values():
        yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def copy_unfenced(state: object, protected: Iterable[torch.Tensor]) -> object:
    """``state`` with every tensor that is not a view of a ``protected`` tensor's storage cloned."""
    keys = {storage_key(t) for t in protected}
    return map_tensors(state, lambda t: t if storage_key(t) in keys else t.detach().clone())
