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
import enum
import io
import pickle
from collections.abc import Callable, Iterable

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Which storage ``t`` is a view of (views of one storage share it)."""
    return str(t.device), t.untyped_storage().data_ptr()


_IMMUTABLE = (int, float, complex, str, bytes, range, type, enum.Enum, torch.dtype, torch.device, torch.layout,
              torch.memory_format)


def map_tensors(obj: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """A copy of the containers of ``obj`` (types and attributes kept) with ``fn`` applied to
    tensors, a tensor's attributes included. Like pickle, it keeps identity: an object met twice
    (shared, or a cycle) maps to one copy, so a tensor at two places stays one tensor. Any other
    mutable object (a dataclass, a namespace, a set, a numpy array) is copied as pickle copies it,
    its tensors through ``fn``: a lazy save pickles it later, after the caller may have changed it."""
    memo: dict[int, object] = {}
    repickler: list[_Repickler] = []

    def walk(o: object) -> object:
        done = memo.get(id(o))
        if done is not None:
            return done
        if o is None or isinstance(o, _IMMUTABLE):
            return o
        if isinstance(o, torch.Tensor):
            new = memo[id(o)] = fn(o)
            if new is not o and o.__dict__:  # torch.save pickles a tensor's attributes
                new.__dict__.update({k: walk(v) for k, v in o.__dict__.items()})
            return new
        if isinstance(o, (dict, list)):
            new = memo[id(o)] = copy.copy(o)  # keeps the type and attributes, e.g. a state_dict's _metadata
            for k, v in (o.items() if isinstance(o, dict) else enumerate(o)):
                new[k] = walk(v)
            return new
        if isinstance(o, tuple):
            items = [walk(v) for v in o]
            new = memo[id(o)] = type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
            return new
        if not repickler:
            repickler.append(_Repickler(walk))
        new = memo[id(o)] = repickler[0].copy(o)
        return new

    return walk(obj)


class _Repickler:
    """Copies objects as pickle copies them, each tensor in them replaced by ``walk``'s (as
    ``torch.save`` stores tensors beside the pickle: by reference). One pickler and one unpickler
    serve every object of one ``map_tensors`` call, so their memos keep what the objects share
    (an array that twenty dataclasses hold stays one array, as ``torch.save`` writes it)."""

    def __init__(self, walk: Callable[[object], object]) -> None:
        self._walk, self._buf, self._at = walk, io.BytesIO(), 0
        self._tensors: list[object] = []
        self._pickler = pickle.Pickler(self._buf, protocol=pickle.HIGHEST_PROTOCOL)  # each one read once written
        self._busy = False
        self._pickler.persistent_id = self._persistent_id
        self._unpickler = pickle.Unpickler(self)
        self._unpickler.persistent_load = self._tensors.__getitem__

    def _persistent_id(self, x: object) -> int | None:
        if isinstance(x, torch.Tensor):
            self._tensors.append(self._walk(x))
            return len(self._tensors) - 1
        return None

    def read(self, n: int = -1) -> bytes:
        end = len(self._buf.getbuffer()) if n < 0 else self._at + n
        with self._buf.getbuffer() as view:
            data = bytes(view[self._at:end])
        self._at += len(data)
        return data

    def readline(self) -> bytes:
        end = self._buf.getvalue().find(b"\n", self._at)
        return self.read(-1 if end < 0 else end + 1 - self._at)

    def copy(self, o: object) -> object:
        if self._busy:  # met again from inside a dump (an object among a tensor's attributes): apart
            return _Repickler(self._walk).copy(o)
        self._busy = True
        try:
            self._pickler.dump(o)
            return self._unpickler.load()
        except Exception:  # noqa: BLE001 (the save pickles it again, and names what it cannot store)
            self.__init__(self._walk)  # its memo may name what the unpickler never read: start afresh
            return o
        finally:
            self._busy = False


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """The tensors an optimizer step changes: the parameters it updates and its state."""
    for group in optimizer.param_groups:
        yield from group["params"]
    for st in optimizer.state.values():
        yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def copy_unfenced(state: object, protected: Iterable[torch.Tensor]) -> object:
    """``state`` with every tensor that is not a view of a ``protected`` tensor's storage cloned,
    as ``torch.save`` would write it: each storage cloned once (views of it stay views of the
    clone), parameters stay parameters, ``requires_grad``, subclasses and attributes are kept."""
    keys = {storage_key(t) for t in protected}
    clones: dict[tuple[str, int], torch.UntypedStorage] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in keys:
            return t
        plain = type(t) in (torch.Tensor, torch.nn.Parameter)
        if (not plain or t.layout is not torch.strided or t.is_quantized or t.is_conj() or t.is_neg()
                or not t.untyped_storage().nbytes()):  # (every empty storage has data_ptr 0: no key)
            new = t.detach().clone()  # no storage to share a view of the plain way
        else:
            st = clones.get(key)
            if st is None:
                st = clones[key] = t.untyped_storage().clone()
            new = torch.empty(0, dtype=t.dtype, device=t.device).set_(st, t.storage_offset(), t.size(), t.stride())
        if plain and isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        elif t.requires_grad:
            new.requires_grad_(True)
        return new  # (its attributes: map_tensors)

    return map_tensors(state, clone)
