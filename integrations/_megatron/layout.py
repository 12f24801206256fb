"""What a fastckpt Megatron checkpoint holds and where: the index, and the resharding plan.

Each rank writes one tensor file with the main replicas of its ShardedTensors (a plain
``{name: tensor}`` dict, so every shard is written once, by the rank that owns its main
replica) and, if it has any, one file with its ShardedObjects. Rank 0 writes the index: one
``SavedTensor`` per shard (its key, dtype, global shape, the box it covers in the global
tensor, and where its bytes are in its file) and one ``SavedObject`` per object. A loader
intersects the boxes it needs with the saved ones (``plan_tensor``) and reads only those
byte ranges (``byte_range``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedObject, ShardedTensor

from fastckpt.errors import FastCkptError, UnsupportedObjectError

INDEX_FORMAT = 1


class ReshardingError(FastCkptError, CheckpointingException):
    """A saved tensor cannot be loaded with the requested layout; the message names the tensor
    and both layouts."""


@dataclass(frozen=True)
class Box:
    """A box of a global tensor: ``offset`` and ``shape`` per axis, in elements."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape,
                                                         strict=True))
        if any(h <= a for a, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - a for a, h in zip(lo, hi)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """This box as slices of the tensor that covers ``outer``."""
        return tuple(slice(a - o, a - o + n) for a, n, o in zip(self.offset, self.shape, outer.offset, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{a + n}" for a, n in zip(self.offset, self.shape)) + "]"


@dataclass(frozen=True)
class SavedTensor:
    """One saved shard: the ``box`` of global tensor ``key`` it covers, and where it lies in
    ``file``: storage number ``storage`` (zip record ``data/<storage>``, ``storage_nbytes``
    long), from element ``storage_offset`` with ``stride`` (one stride per global axis)."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    file: str
    storage: int
    storage_nbytes: int
    storage_offset: int
    stride: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def is_contiguous(self) -> bool:
        expect, step = [], 1
        for n in reversed(self.box.shape):
            expect.append(step)
            step *= n
        return all(n == 1 or s == e for n, s, e in zip(self.box.shape, self.stride, reversed(expect)))


@dataclass(frozen=True)
class SavedObject:
    """One saved ShardedObject: its ``unique_key`` (which encodes its place in the global
    object) and the ``file`` holding it."""

    key: str
    unique_key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    file: str


def tensor_box(sh: ShardedTensor) -> Box:
    """The box ``sh`` covers, in global axes (prepended axes have length 1)."""
    return Box(tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape))


def _plain(key: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, when it is a dense tensor with bytes of its own; else an error naming ``key``.

    Checked here, not left to ``Checkpointer.save``: the core names a tensor by its place in the
    ``{"t0": ...}`` dict this strategy saves (``state['t17']``), which names no parameter, and a
    tensor without a plain storage failed before it with torch's own error."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedObjectError(
            f"ShardedTensor {key!r} holds a {type(t).__name__}; fastckpt saves plain tensors. Convert it "
            "(e.g. dequantize FP8 weights) in the sharded state dict before saving.")
    if t.is_meta:
        raise UnsupportedObjectError(
            f"ShardedTensor {key!r} is a tensor on the meta device: it has no data to save. Materialise it "
            "(e.g. model.to_empty(device=...) and initialise) before saving.")
    if t.layout is not torch.strided or t.is_nested or t.is_quantized:
        what = "quantized tensor" if t.is_quantized else "nested tensor" if t.is_nested else \
            f"tensor of layout {t.layout}"
        raise UnsupportedObjectError(
            f"ShardedTensor {key!r} is a {what}; fastckpt's Megatron strategy saves dense strided "
            "tensors (it reads shards back as byte ranges). Convert it (t.to_dense(), t.dequantize()) in the "
            "sharded state dict before saving.")
    return t.detach()


def split_rank_state(items: list[object], tensor_file: str, object_file: str
                     ) -> tuple[dict[str, torch.Tensor], dict[str, object], list[SavedTensor], list[SavedObject]]:
    """This rank's main replicas as the two file states and their index entries.

    Storage numbers follow torch's rule for a plain dict of tensors: storages are numbered in
    the order their tensors first appear (views of one storage share its number); the loader
    checks each against the size of the record torch wrote.

    Raises:
        UnsupportedObjectError: a ShardedTensor this rank saves cannot be saved (the message
            names its key and the fix), or two view one storage with different dtypes (both keys).
    """
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, object] = {}
    saved_t: list[SavedTensor] = []
    saved_o: list[SavedObject] = []
    storages: dict[int, int] = {}
    viewed_as: dict[int, tuple[str, torch.dtype]] = {}  # storage -> the first key viewing it, and its dtype
    for sh in items:
        if isinstance(sh, ShardedTensor):
            if not _is_main(sh.replica_id):
                continue
            if sh.data is None:  # skipped, the checkpoint committed without it and its first load failed
                raise UnsupportedObjectError(
                    f"ShardedTensor {sh.key!r}: this rank holds its main replica but passes no data "
                    "(ShardedTensor.without_data()), so the checkpoint would lack it. Pass the tensor, or give "
                    "another rank the main replica (replica_id); megatron's torch_dist refuses it too.")
            t = _plain(sh.key, sh.data)
            st = t.untyped_storage()
            first, dtype = viewed_as.setdefault(st._cdata, (sh.key, t.dtype))
            if dtype != t.dtype:  # torch.save refuses it, naming neither ShardedTensor
                raise UnsupportedObjectError(
                    f"ShardedTensors {first!r} ({dtype}) and {sh.key!r} ({t.dtype}) view the same storage with "
                    "different dtypes, which torch.save (the format of fastckpt's files) cannot save. Give one of "
                    f"them a copy of its own in the sharded state dict (e.g. the data of {sh.key!r} cloned).")
            number = storages.setdefault(st._cdata, len(storages))
            tensors[f"t{len(tensors)}"] = t
            stride = (0,) * sh.prepend_axis_num + tuple(t.stride())
            saved_t.append(SavedTensor(sh.key, str(t.dtype).removeprefix("torch."), tuple(sh.global_shape),
                                       tensor_box(sh), tensor_file, number, st.nbytes(), t.storage_offset(),
                                       stride))
        elif isinstance(sh, ShardedObject):
            if not _is_main(sh.replica_id):
                continue
            objects[sh.unique_key] = sh.data
            saved_o.append(SavedObject(sh.key, sh.unique_key, tuple(sh.global_shape), tuple(sh.global_offset),
                                       object_file))
        else:
            raise UnsupportedObjectError(
                f"the sharded state dict holds a {type(sh).__name__}; fastckpt's Megatron strategy saves "
                "ShardedTensors and ShardedObjects (megatron-core applies factories before the strategy runs)")
    return tensors, objects, saved_t, saved_o


def _is_main(replica_id: object) -> bool:
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    return is_main_replica(replica_id)


# ---------------------------------------------------------------------------------- the index
def index_body(tensors: list[SavedTensor], objects: list[SavedObject], world_size: int) -> dict:
    """The index as plain values (loadable with ``weights_only=True``)."""
    def plain(entry: SavedTensor | SavedObject) -> dict:  # dataclasses.asdict deep-copies: 10x slower
        out = {f.name: getattr(entry, f.name) for f in fields(entry)}
        if isinstance(entry, SavedTensor):
            out["box"] = {"offset": entry.box.offset, "shape": entry.box.shape}
        return out

    return {"format": INDEX_FORMAT, "world_size": world_size,
            "tensors": [plain(t) for t in tensors], "objects": [plain(o) for o in objects]}


@dataclass(frozen=True)
class Index:
    tensors: dict[str, tuple[SavedTensor, ...]]  # key -> its shards
    objects: dict[str, SavedObject]  # unique key -> the object
    world_size: int

    @classmethod
    def parse(cls, body: dict, where: str) -> Index:
        if not isinstance(body, dict) or body.get("format") != INDEX_FORMAT:
            raise CheckpointingException(
                f"{where} is not a fastckpt Megatron index of format {INDEX_FORMAT} (got "
                f"{body.get('format') if isinstance(body, dict) else type(body).__name__}); upgrade fastckpt to "
                "read it")
        tensors: dict[str, list[SavedTensor]] = {}
        for t in body["tensors"]:
            box = Box(tuple(t["box"]["offset"]), tuple(t["box"]["shape"]))
            entry = SavedTensor(**{**t, "box": box, "global_shape": tuple(t["global_shape"]),
                                   "stride": tuple(t["stride"])})
            tensors.setdefault(entry.key, []).append(entry)
        objects = {o["unique_key"]: SavedObject(**{**o, "global_shape": tuple(o["global_shape"]),
                                                   "global_offset": tuple(o["global_offset"])})
                   for o in body["objects"]}
        return cls({k: tuple(v) for k, v in tensors.items()}, objects, int(body["world_size"]))


# ---------------------------------------------------------------------------------- resharding
def _layout(shards: tuple[SavedTensor, ...]) -> str:
    boxes = ", ".join(str(s.box) for s in shards[:8]) + (", ..." if len(shards) > 8 else "")
    return f"global shape {shards[0].global_shape} in {len(shards)} shard(s) {boxes}"


def plan_tensor(sh: ShardedTensor, index: Index) -> list[tuple[SavedTensor, Box]]:
    """The saved shards that overlap the box ``sh`` asks for, with each overlap.

    Raises:
        ReshardingError: the key is missing, the global shapes differ (without
            ``allow_shape_mismatch``) or the saved shards do not cover the box; the message
            names the tensor and both layouts.
    """
    want = tensor_box(sh)
    shards = index.tensors.get(sh.key)
    if not shards:
        raise ReshardingError(f"tensor {sh.key!r} is not in this checkpoint (requested {want} of global shape "
                              f"{tuple(sh.global_shape)})")
    saved_shape = shards[0].global_shape
    if tuple(sh.global_shape) != saved_shape and not sh.allow_shape_mismatch:
        raise ReshardingError(
            f"tensor {sh.key!r} cannot be resharded: saved as {_layout(shards)}, requested {want} of global shape "
            f"{tuple(sh.global_shape)}. Only the split may change between save and load, not the global shape "
            "(set allow_shape_mismatch=True on the ShardedTensor for a padded tensor)")
    parts = [(s, box) for s in shards if (box := s.box.intersect(want)) is not None]
    missing = uncovered(want, [box for _, box in parts])
    if missing and not sh.allow_shape_mismatch:
        raise ReshardingError(
            f"tensor {sh.key!r} cannot be loaded as {want}: the saved shards ({_layout(shards)}) leave {missing} "
            f"of its {want.numel} elements uncovered; the checkpoint is missing shards of it")
    return parts


def uncovered(want: Box, boxes: list[Box]) -> int:
    """How many elements of ``want`` none of ``boxes`` (each inside it) covers. Boxes may overlap
    (a shard saved twice): the count is over the grid their edges cut ``want`` into, not a sum."""
    edges = [sorted({o, o + n} | {b.offset[d] for b in boxes} | {b.offset[d] + b.shape[d] for b in boxes})
             for d, (o, n) in enumerate(zip(want.offset, want.shape))]
    if not edges:
        return 0 if boxes else 1  # a scalar: covered by any box
    at = [{v: i for i, v in enumerate(e)} for e in edges]
    hit = torch.zeros([len(e) - 1 for e in edges], dtype=torch.bool)
    for b in boxes:
        hit[tuple(slice(p[a], p[a + n]) for p, a, n in zip(at, b.offset, b.shape))] = True
    sizes = [torch.tensor([hi - lo for lo, hi in zip(e, e[1:])], dtype=torch.float64) for e in edges]
    volume = sizes[0] if len(sizes) == 1 else torch.cartesian_prod(*sizes).prod(dim=1).reshape(hit.shape)
    return int(volume[~hit].sum().item())


def byte_range(saved: SavedTensor, part: Box) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of ``saved``'s storage record that hold the elements of ``part``."""
    size = torch.empty((), dtype=saved.torch_dtype).element_size()
    first = saved.storage_offset + sum((a - o) * s for a, o, s in zip(part.offset, saved.box.offset, saved.stride))
    last = saved.storage_offset + sum((a - o + n - 1) * s for a, n, o, s in
                                      zip(part.offset, part.shape, saved.box.offset, saved.stride))
    return first * size, (last + 1) * size


def shard_view(saved: SavedTensor, record: torch.Tensor) -> torch.Tensor:
    """The saved shard as a tensor over its storage record's bytes (uint8)."""
    elems = record.view(saved.torch_dtype)
    return elems.as_strided(saved.box.shape, saved.stride, elems.storage_offset() + saved.storage_offset)
