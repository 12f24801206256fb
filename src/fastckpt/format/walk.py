"""Walking a state the way pickle does: once, with a memo.

A container or tensor reached a second time (shared, or a cycle such as ``c = []; c.append(c)``)
is not walked again, exactly as pickle's memo refers back to it, so a walk costs one visit per
object however deep the sharing goes (a depth-22 list of shared lists is 22 visits, not 2**22
paths) and never loops. Three walks live here:

- ``scan``: for plain states (dicts with str/int keys, lists, tuples, plain tensors and scalars),
  the storages in torch.save's key order and a *signature*: everything torch.save's metadata
  depends on (keys, values, types, tensor shapes, strides, dtypes, storage sharing). Two states
  with equal signatures get byte-identical metadata, so a layout can be reused
  (``format.layout.Planner``). Anything else returns None and is planned the general way.
- ``check_tensors`` and ``pickling_order``: the general way (any picklable object).
- ``key_path`` and ``dtype_aliases``: key paths for error messages only.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..errors import UnsupportedObjectError

_DOUBLE = struct.Struct("<d")
_SEQUENCES = (list, tuple)
_LEAVES = frozenset((int, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size))


@dataclass(frozen=True)
class Scan:
    """A plain state's storages (distinct, in torch.save's key order) and its signature."""

    storages: tuple[torch.UntypedStorage, ...]
    signature: tuple
    cuda: bool  # some storage is on a CUDA device


def scan(obj: object) -> Scan | None:
    """One memoised walk of a plain state; None when it holds anything else.

    Pickle visits dict items, list and tuple elements in order, and a plain tensor reduces to
    its storage first, so the walk meets storages in torch's key order without pickling.

    Raises:
        UnsupportedObjectError: a tensor on the meta device (it has no bytes to save), or a
            strided nested tensor (``_raise_nested``).
    """
    storages: list[torch.UntypedStorage] = []
    index: dict[int, int] = {}  # storage _cdata -> key
    memo: dict[int, int] = {}  # id of a container or tensor -> order of first visit
    # The signature is one flat sequence: with a tuple per object, 100,000 tiny tensors made
    # 39 MB of signature and a slow comparison. Each entry starts with a type (or "@"), which
    # fixes how many items follow, so two different states never flatten to the same sequence.
    sig: list[object] = []
    cuda = False
    stack = [obj]
    pop, extend, emit = stack.pop, stack.extend, sig.extend
    while stack:
        o = pop()
        t = type(o)
        if t in _LEAVES:
            emit((t, o))
        elif t is float:
            emit((t, _DOUBLE.pack(o)))  # its bits: 0.0 == -0.0, and every NaN's hex() is 'nan', but each pickles apart
        else:
            seen = memo.get(id(o))
            if seen is not None:
                emit(("@", seen))  # pickle writes a memo reference: nothing new to walk
                continue
            if t is dict or t is collections.OrderedDict:
                keys = tuple(o)
                for k in keys:
                    if type(k) is not str and type(k) is not int:
                        return None
                memo[id(o)] = len(memo)
                attrs = o.__dict__ if t is collections.OrderedDict else None  # type: ignore[union-attr]
                emit((t, keys, bool(attrs)))
                if attrs:  # a state_dict's _metadata: pickled after the items, so walked after them
                    stack.append(attrs)
                extend(reversed(o.values()))  # type: ignore[attr-defined]
            elif t is list or t is tuple:
                memo[id(o)] = len(memo)
                emit((t, len(o)))
                extend(reversed(o))  # type: ignore[call-overload]
            elif t is torch.Tensor or t is torch.nn.Parameter:
                if o.is_meta:  # type: ignore[union-attr]
                    _raise_meta(obj, o)
                if o.is_nested:  # type: ignore[union-attr]  (a strided nested tensor: its .shape raises)
                    _raise_nested(obj, o)
                if (o.layout is not torch.strided or o.is_quantized or o.__dict__  # type: ignore[union-attr]
                        or o.is_conj() or o.is_neg()):  # type: ignore[union-attr]
                    return None
                memo[id(o)] = len(memo)
                st = o.untyped_storage()  # type: ignore[union-attr]
                key = index.get(st._cdata)
                new = key is None
                if new:
                    key = index[st._cdata] = len(storages)
                    storages.append(st)
                    cuda = cuda or o.is_cuda  # type: ignore[union-attr]
                shape = o.shape  # type: ignore[union-attr]
                emit((t, o.dtype, len(shape), *shape, *o.stride(), o.storage_offset(),  # type: ignore[union-attr]
                      o.requires_grad, key, *((o.device, st.nbytes()) if new else (None,))))  # type: ignore[union-attr]
            else:
                return None
    return Scan(tuple(storages), tuple(sig), cuda)


def _children(o: object) -> Iterator[tuple[str, object]]:
    if isinstance(o, dict):
        return ((f"[{k!r}]", v) for k, v in o.items())
    if isinstance(o, _SEQUENCES):
        return ((f"[{i}]", v) for i, v in enumerate(o))
    return iter(())


def _walk(obj: object) -> Iterator[object]:
    """Every object once (containers are entered, including subclasses of dict, list, tuple)."""
    memo: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, (dict, *_SEQUENCES, torch.Tensor)):
            if id(o) in memo:
                continue
            memo.add(id(o))
        yield o
        if isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, _SEQUENCES):
            stack.extend(reversed(o))


def _paths(obj: object) -> Iterator[tuple[str, object]]:
    """Every object once, in walk order, with its key path (``state['a'][0]``)."""
    memo: set[int] = set()
    stack: list[tuple[str, object]] = [("state", obj)]
    while stack:
        path, o = stack.pop()
        if isinstance(o, (dict, *_SEQUENCES, torch.Tensor)):
            if id(o) in memo:
                continue
            memo.add(id(o))
        yield path, o
        stack.extend(reversed([(path + k, v) for k, v in _children(o)]))


def key_path(obj: object, match: Callable[[object], bool]) -> str | None:
    """The key path (``state['a'][0]``) of the first object, in walk order, that ``match``es."""
    return next((path for path, o in _paths(obj) if match(o)), None)


def dtype_aliases(obj: object) -> str | None:
    """Why torch.save refused ``obj`` when two of its tensors view one storage as two dtypes
    (its own error names neither): both key paths, and the fix; None if no two do."""
    seen: dict[int, tuple[str, torch.dtype]] = {}  # storage address -> the first key viewing it, and its dtype
    for path, o in _paths(obj):
        if not isinstance(o, torch.Tensor) or o.layout is not torch.strided or o.is_nested:
            continue
        try:
            ptr = o.untyped_storage().data_ptr()  # torch.save's own test: storages by address
        except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own to read: not this case
            continue
        first, dtype = seen.setdefault(ptr, (path, o.dtype)) if ptr else (path, o.dtype)
        if dtype != o.dtype:
            return (f"{first} ({dtype}) and {path} ({o.dtype}): they view one storage as two dtypes, which "
                    f"torch.save (the format of fastckpt's files) cannot write; give one of them a copy of its own "
                    f"(e.g. save {path}.clone() in its place)")
    return None


def _raise_meta(state: object, tensor: object) -> None:
    path = key_path(state, lambda v: v is tensor) or "a tensor"
    raise UnsupportedObjectError(
        f"{path} is a tensor on the meta device: it has no data to save. "
        "Materialise it (e.g. model.to_empty(device=...) and initialise) before saving."
    )


def _raise_nested(state: object, tensor: object) -> None:
    """torch.save writes a strided nested tensor, but not under ``skip_data`` (the metadata pass
    every fastckpt save makes), and its sizes are internal: say which entry, and what saves."""
    path = key_path(state, lambda v: v is tensor) or "a tensor"
    raise UnsupportedObjectError(
        f"{path} is a nested tensor of layout torch.strided, which fastckpt cannot save (torch cannot "
        "write its metadata without its data). Save its components (list(t.unbind())), a padded copy "
        "(t.to_padded_tensor(0.0)), or build it with layout=torch.jagged, which saves as it is."
    )


def check_tensors(obj: object) -> None:
    """Reject tensors whose bytes cannot be written (the general path; ``scan`` checks its own).

    Raises:
        UnsupportedObjectError: naming the key of the first such tensor (meta, strided nested, or
            without a plain storage).
    """
    for value in _walk(obj):
        if not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "meta":
            _raise_meta(obj, value)
        if value.is_nested and value.layout == torch.strided:  # a jagged one pickles through its components
            _raise_nested(obj, value)
        if value.is_sparse or value.layout != torch.strided:
            continue  # pickled through its strided components
        try:
            value.untyped_storage()
        except Exception as exc:  # noqa: BLE001 (any failure means the same: no plain storage)
            path = key_path(obj, lambda v, t=value: v is t)
            raise UnsupportedObjectError(
                f"{path} ({type(value).__name__}) has no plain storage fastckpt can copy; "
                "convert it to a regular tensor before saving."
            ) from exc


def _unpicklable(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_quantized  # torch.save's metadata pass (skip_data) refuses quantized tensors
    if isinstance(value, (dict, *_SEQUENCES)):
        return False
    try:
        pickle.dumps(value, protocol=2)
    except Exception:  # noqa: BLE001 (we only look for the culprit; the caller re-raises)
        return True
    return False


def find_unpicklable(obj: object) -> str:
    """The key path of the first value that cannot be pickled, or is a quantized tensor (for the
    error message)."""
    return key_path(obj, _unpicklable) or "state"


class _StorageOrder(pickle.Pickler):
    """Pickles to nowhere, recording storages in first-seen order: torch's key order."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=2)
        self.order: list[torch.UntypedStorage] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj):  # noqa: ANN001 (pickle protocol)
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            st = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
            if st._cdata not in self._seen:
                self._seen[st._cdata] = len(self.order)
                self.order.append(st)
            return ("s", self._seen[st._cdata])
        return None


def pickling_order(obj: object) -> list[torch.UntypedStorage]:
    """Storages in torch.save's key order, for any picklable object (pickles it once)."""
    pickler = _StorageOrder()
    pickler.dump(obj)
    return pickler.order
