"""``load(..., into=state)``: a checkpoint read into tensors that already exist.

Why: a resumed job has built its model (and often its optimizer's state) before it loads. A
load into fresh memory pays a page fault per 4 KiB page (0.2-0.4 s per GiB on the VMs measured,
more than the copy), and ``load_state_dict`` then copies every byte again. With ``into``, each
tensor of ``into`` (nested dicts, lists and tuples, as ``state_dict()`` gives them) receives the
saved tensor at the same place (the same keys and positions) of the saved object:
  - read straight into its memory, when it is a contiguous CPU tensor of the saved dtype that
    fills its storage as the saved one fills its record (``plan``, from the file's pickle before
    any large record is read); its autograd version is bumped, as an in-place op's would be;
  - else copied into it once the checkpoint is verified (``place``: another dtype or device,
    or a file whose records are not laid out to read in place).
The loaded object holds the ``into`` tensors themselves at those places; what ``into`` does not
name loads as without it. Every place ``into`` names must be in the checkpoint with the same
shape (``check``), else nothing is read and the error lists each difference. A load that fails
after reading (every copy of the file corrupt) leaves those tensors' bytes unspecified, as
DCP's in-place load does.
"""

from __future__ import annotations

import types
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView

import torch

from ..errors import ConfigError, CorruptCheckpointError

Where = tuple[object, ...]
#: what ``into`` holds by mistake where tensors were meant (a method whose call was forgotten, a
#: ``dict.values()`` view, an iterator): every other value is passed over, as it was saved
_MISTAKES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType,
             types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
             KeysView, ValuesView, ItemsView, Iterator)


def in_place(map_location: object) -> bool:
    """Whether a load with ``map_location`` keeps the storages where it reads them (the CPU)."""
    return map_location is None or (isinstance(map_location, (str, torch.device)) and str(map_location) == "cpu")


def check_into(dest: object) -> None:
    """Refuse an ``into`` that names no place to fill: ``_walk`` passes over what is neither a
    tensor nor a dict, list or tuple, so ``into=5`` or ``into=model`` loaded as without it, and a
    caller who skipped ``load_state_dict`` resumed from the freshly initialised weights. The same
    holds nested: ``{"model": model.state_dict}`` (a method, the parentheses forgotten), a
    ``dict.values()`` view or an iterator filled nothing. Every other value (numbers, None, an
    Enum member, a set, a numpy RNG state...) is allowed there, as the caller passes the structure
    they saved: an optimizer's ``param_groups`` hold such values. A tensor whose elements share
    memory (``expand``: a stride of 0; ``unfold``, ``as_strided``) cannot be filled: ``copy_``
    refuses the first and fills the others with later elements over earlier ones (a silently
    wrong resume); refused here, before anything is read.

    Raises:
        ConfigError: ``dest`` is of another type, or is or holds a module, an optimizer, a
            function or method, a dict view or an iterator, or a tensor whose elements share memory.
    """
    for where, v in ((), dest), *_containers(dest, ()):
        if isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
            kind = "a module" if isinstance(v, torch.nn.Module) else "an optimizer"
            raise ConfigError(f"load(into=...): {_name(where)} is {kind} ({type(v).__name__}), which into= does not "
                              "fill: pass its state_dict() (into={'model': model.state_dict()}), whose tensors are "
                              "filled in place")
        if isinstance(v, torch.Tensor):
            if v.layout == torch.strided and _overlaps(v):
                expanded = any(st == 0 and n > 1 for st, n in zip(v.stride(), v.shape))
                kind = "an expanded tensor" if expanded else "a tensor whose strides overlap"
                raise ConfigError(f"load(into=...): {_name(where)} is {kind} (shape {tuple(v.shape)}, "
                                  f"stride {v.stride()}): its elements share memory, so the saved values cannot be "
                                  "copied into it. Pass a tensor with memory of its own (.clone() or .contiguous()). "
                                  "Nothing was read into your tensors.")
        elif where and isinstance(v, _MISTAKES):
            called = " (a function or method: call it, model.state_dict())" if callable(v) else ""
            raise ConfigError(f"load(into=...): {_name(where)} is of type {type(v).__name__}{called}, which into= "
                              "does not fill: pass the tensors to fill nested in dicts, lists and tuples as the saved "
                              "object is (into={'model': model.state_dict()}). Nothing was read.")
    if not isinstance(dest, (torch.Tensor, Mapping, list, tuple)):
        raise ConfigError(f"load(into=...): into is of type {type(dest).__name__}, not the tensors to fill: pass them "
                          "nested in dicts, lists and tuples as the saved object is "
                          "(into={'model': model.state_dict()}), or None")


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of the strided ``t`` share memory. torch answers 2 ("cannot tell")
    for every view that is not dense (a slice of a larger buffer, which into= fills): then each
    stride, smallest first, must pass the span of the dimensions before it."""
    found = torch._debug_has_internal_overlap(t)
    if found != 2:
        return found == 1
    span = 0
    for st, n in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if st <= span:
            return True
        span += st * (n - 1)
    return False


def check_map_location(map_location: object) -> None:
    """Refuse ``map_location`` onto the meta device with ``into``: into= copies the loaded tensors
    into the given ones, and a meta tensor holds no data to copy (torch raised a bare
    NotImplementedError "Cannot copy out of meta tensor" after the whole read)."""
    targets = map_location.values() if isinstance(map_location, Mapping) else (map_location,)
    if any(isinstance(t, (str, torch.device)) and str(t).split(":")[0] == "meta" for t in targets):
        raise ConfigError(f"load(..., map_location={map_location!r}, into=...): the meta device holds no data to "
                          "copy into into='s tensors. Pass one of them: into= to fill your tensors, or "
                          "map_location='meta' alone for the structure without data.")


def _containers(dest: object, where: Where) -> Iterator[tuple[Where, object]]:
    items = dest.items() if isinstance(dest, Mapping) else enumerate(dest) if isinstance(dest, (list, tuple)) else ()
    for k, v in items:
        yield (*where, k), v
        yield from _containers(v, (*where, k))


def check(dest: object, saved: object) -> list[tuple[Where, torch.Tensor, torch.Tensor]]:
    """``(place, tensor of into, saved tensor)`` for every tensor of ``dest``.

    Raises:
        ConfigError: a place of ``dest`` is missing from ``saved``, or holds something else,
            or a tensor of another shape; the message lists the first few.
    """
    out: list[tuple[Where, torch.Tensor, torch.Tensor]] = []
    wrong: list[str] = []
    for where, d, s in _walk(dest, saved, ()):
        if s is _MISSING:
            wrong.append(f"{_name(where)}: not in the checkpoint")
        elif not isinstance(s, torch.Tensor):
            wrong.append(f"{_name(where)}: the checkpoint holds a {type(s).__name__} there, not a tensor")
        elif s.shape != d.shape:
            wrong.append(f"{_name(where)}: saved with shape {tuple(s.shape)}, into= has {tuple(d.shape)}")
        elif s.layout != d.layout:  # copy_ between dense and sparse fails, after the read
            wrong.append(f"{_name(where)}: saved as a {_layout(s)} tensor, into= has a {_layout(d)} one")
        elif d.is_meta:  # a copy into it is a no-op: the load would return no data there
            wrong.append(f"{_name(where)}: into= has a tensor on the meta device, which holds no memory to read "
                         "into (allocate the module first: module.to_empty(device='cpu'))")
        elif d.is_inference() and not torch.is_inference_mode_enabled():  # torch refuses the write, after it
            wrong.append(f"{_name(where)}: into= has an inference tensor (made under torch.inference_mode()), which "
                         "only code inside inference_mode may write: load inside `with torch.inference_mode():`, or "
                         "build the model outside it")
        else:
            out.append((where, d, s))
    if wrong:
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        raise ConfigError(f"load(into=...) does not match the checkpoint: {'; '.join(wrong[:5])}{more}. Nothing was "
                          "read into your tensors. Pass into= the part of the saved object it names, with the same "
                          "keys and shapes (a Lightning checkpoint keeps the model under 'state_dict'), or load "
                          "without into= and copy what you need.")
    return out


def plan(dest: object, meta: object, records: dict[int, int]) -> dict[int, torch.UntypedStorage]:
    """The records to read in place: record offset -> the storage of ``dest`` to read it into.

    ``meta`` is the saved object loaded onto the meta device (each storage carries its record's
    offset and its size, from the pickle); ``records``: offset -> size, from the zip's directory,
    of the records that have a piece of their own. A record is read in place when every tensor
    of ``dest`` on it is a contiguous CPU tensor of the saved dtype that fills its storage, as
    the saved tensor fills the record (so no byte outside the tensors ``dest`` names is
    written), and no other record goes into that storage. Neither may be a conjugate or negative
    view (``is_conj``, ``is_neg``): its values are not its bytes, so raw bytes read into it would
    read back as conj(saved) or -saved; ``copy_`` resolves those bits.

    Raises:
        ConfigError: ``dest`` does not match ``meta`` (``check``).
        CorruptCheckpointError: the directory and the pickle give a record different sizes:
            one of them is damaged (neither is verified yet), and a read sized by the directory
            would write past the tensor.
    """
    into: dict[int, torch.UntypedStorage] = {}
    refused: set[int] = set()
    for _, d, m in check(dest, meta):
        off = getattr(m.untyped_storage(), "_checkpoint_offset", None)
        if off is None or off not in records:
            continue
        if records[off] != m.untyped_storage().nbytes():
            raise CorruptCheckpointError(f"the zip directory gives the record at byte {off} {records[off]} bytes, "
                                         f"the pickle {m.untyped_storage().nbytes()}: the file is damaged")
        if d.layout != torch.strided or d.device.type != "cpu" or type(d) not in (torch.Tensor, torch.nn.Parameter):
            refused.add(off)
            continue
        s = d.untyped_storage()
        same = (d.dtype == m.dtype and d.is_contiguous() and m.is_contiguous() and d.storage_offset() == 0
                and m.storage_offset() == 0 and d.nbytes == s.nbytes() == m.nbytes == m.untyped_storage().nbytes()
                and not (d.is_conj() or d.is_neg() or m.is_conj() or m.is_neg()))
        if not same or (off in into and into[off].data_ptr() != s.data_ptr()):
            refused.add(off)
        into.setdefault(off, s)
    owners: dict[int, int] = {}
    for s in into.values():
        owners[s.data_ptr()] = owners.get(s.data_ptr(), 0) + 1
    return {off: s for off, s in into.items() if off not in refused and owners[s.data_ptr()] == 1}


def place(dest: object, saved: object) -> object:
    """``saved`` with ``dest``'s tensors at their places, each holding the saved values (copied
    in, unless it was read in place: it already shares the saved tensor's memory)."""
    for _, d, s in check(dest, saved):
        if not _shares(s, d):
            with torch.no_grad():
                d.copy_(s)
        else:  # its bytes changed under autograd's eyes: a graph that saved it must refuse to use it
            torch.autograd.graph.increment_version(d)
    return _put(dest, saved)


def _shares(s: torch.Tensor, d: torch.Tensor) -> bool:
    """Whether ``s`` is ``d``'s memory, seen the same way (it was read in place): the same bytes
    under another conjugate or negative bit are other values, which only ``copy_`` gives ``d``."""
    if s.layout != torch.strided or d.layout != torch.strided or s.device != d.device:
        return False
    return (s.untyped_storage().data_ptr() == d.untyped_storage().data_ptr() and s.dtype == d.dtype
            and s.storage_offset() == d.storage_offset() and s.stride() == d.stride()
            and s.is_conj() == d.is_conj() and s.is_neg() == d.is_neg())


_MISSING = object()


def _walk(dest: object, saved: object, where: Where) -> Iterator[tuple[Where, torch.Tensor, object]]:
    if isinstance(dest, torch.Tensor):
        yield where, dest, saved
    elif isinstance(dest, Mapping):
        for k, v in dest.items():
            got = saved.get(k, _MISSING) if isinstance(saved, Mapping) else _MISSING
            yield from _walk(v, got, (*where, k)) if got is not _MISSING else _absent(v, (*where, k))
    elif isinstance(dest, (list, tuple)):
        for i, v in enumerate(dest):
            ok = isinstance(saved, (list, tuple)) and i < len(saved)
            yield from _walk(v, saved[i], (*where, i)) if ok else _absent(v, (*where, i))


def _absent(dest: object, where: Where) -> Iterator[tuple[Where, torch.Tensor, object]]:
    for w, d, _ in _walk(dest, None, where):
        yield w, d, _MISSING


def _put(dest: object, saved: object) -> object:
    """The loaded object with ``dest``'s tensors (filled) in place of the saved ones. A place of
    ``dest`` the checkpoint lacks holds no tensor (``_walk`` refused those before the read): it is
    passed over, as a plain value of a type the saved object does not share is."""
    if isinstance(dest, torch.Tensor):
        return dest
    if isinstance(dest, Mapping) and isinstance(saved, Mapping):
        for k, v in dest.items():
            if k in saved:
                saved[k] = _put(v, saved[k])  # type: ignore[index]
        return saved
    if isinstance(dest, (list, tuple)) and isinstance(saved, (list, tuple)):
        items = [_put(dest[i], s) if i < len(dest) else s for i, s in enumerate(saved)]  # type: ignore[arg-type]
        if isinstance(saved, list):
            saved[:] = items
            return saved
        return type(saved)(*items) if hasattr(saved, "_fields") else type(saved)(items)  # type: ignore[call-arg]
    return saved


def _layout(t: torch.Tensor) -> str:
    return "dense" if t.layout is torch.strided else str(t.layout).removeprefix("torch.")


def _name(where: Where) -> str:
    return "into" + "".join(f"[{k!r}]" for k in where)
