"""The Megatron load strategy: any sharding in, verified partial reads out.

Order of calls (every rank, training thread): megatron loads common.pt (through
``commonload``, which notes the save it was of) and validates the request -> ``load``: the group
manifest (a committed checkpoint, the same save as common.pt), the index, then for each
requested ShardedTensor the saved shards that overlap it (``plan_tensor``) -> every needed byte
range of every file, read as verified checksum blocks on a thread pool (``ensure_all``) ->
the tensors assembled from those bytes (a view when a saved shard is exactly the requested one)
-> the ShardedObjects, each from its rank's objects file.
"""

from __future__ import annotations

import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from fastckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, GroupChangedError
from fastckpt.io.ops import FileOps

from . import commonload
from .common import BACKEND, INDEX_FILE, VERSION, CheckpointerSource, ThroughCheckpointer, checked, checkpoint_group
from .compat import incomplete_group_error, read_group_manifest
from .inplace import check as check_inplace
from .layout import Index, ReshardingError, SavedTensor, byte_range, plan_tensor, shard_view, tensor_box
from .read import VerifiedFile, ensure_all


@dataclass(frozen=True)
class LoadReport:
    """One load on this rank: files opened, bytes read from them (verified), bytes the
    requested shards needed, and the time taken."""

    group: str
    files: int
    bytes_read: int
    bytes_needed: int
    seconds: float


class FastCkptLoadStrategy(ThroughCheckpointer, LoadShardedStrategy):
    """Loads a fastckpt Megatron checkpoint with any sharding: each rank reads, from every
    rank's file, only the verified checksum blocks that hold the shards it asks for.

    Args:
        checkpointer: the Checkpointer to read the index and objects through (or a function
            returning it, or None for ``default_checkpointer()``).
        ops: the FileOps the tensor reads go through.
        weights_only: load ShardedObjects with torch's safe unpickler (as megatron does;
            register extra types with ``torch.serialization.add_safe_globals``).
    """

    def __init__(self, checkpointer: CheckpointerSource = None, *, ops: FileOps | None = None,
                 weights_only: bool = True) -> None:
        super().__init__()
        (self._source, self._ops), self._weights_only = checked(checkpointer, ops), weights_only
        self.last_load: LoadReport | None = None

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        commonload.forget()  # megatron asks this first in every load, before it reads common.pt (strict: again after)
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"this checkpoint was saved with backend {loaded_backend!r}; "
                                         f"FastCkptLoadStrategy reads {BACKEND!r} checkpoints")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version > VERSION:
            raise CheckpointingException(f"this checkpoint has fastckpt format version {loaded_version}; this "
                                         f"fastckpt reads up to {VERSION}: upgrade fastckpt")

    def _index(self, group: str, manifest: dict | None = None) -> tuple[dict, Index]:
        manifest = manifest or read_group_manifest(group)
        if manifest is None:
            raise incomplete_group_error(group, None)
        path = os.path.join(group, INDEX_FILE)
        return manifest, Index.parse(self.checkpointer.load(path), path)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """Load every ShardedTensor and ShardedObject of ``sharded_state_dict``.

        Raises:
            IncompleteCheckpointError: the checkpoint was never committed.
            CorruptCheckpointError: bytes that do not match their recorded digests (names the file).
            ReshardingError: a tensor or object cannot be loaded with the requested layout.
            GroupChangedError: the iteration was saved again (and swapped in) during the load.
        """
        t0, group = time.monotonic(), checkpoint_group(checkpoint_dir)
        with self.checkpointer.reading(group) as manifest:  # every file of the one save published now
            try:
                return self._load(sharded_state_dict, group, manifest, t0)
            except (CorruptCheckpointError, FileNotFoundError) as exc:
                if _changed(group, manifest):  # saved again and swapped in under the reads: not damage
                    raise GroupChangedError(
                        f"{group} was saved again while this load read it (its manifest changed): what was read "
                        f"so far is of the earlier save ({exc}). Nothing was loaded: load it again.") from exc
                raise

    def _load(self, sharded_state_dict: ShardedStateDict, group: str, manifest: dict, t0: float) -> StateDict:
        manifest, index = self._index(group, manifest)
        leaves = list(nested_values(sharded_state_dict))
        plans = {id(sh): plan_tensor(sh, index) for sh in leaves if isinstance(sh, ShardedTensor)}
        tensor_files = sorted({saved.file for parts in plans.values() for saved, _ in parts})
        if commonload.seen(group) not in (None, commonload.identity(manifest)):
            raise commonload.changed_error(group)  # megatron's common.pt was of another save
        if commonload.seen(group) is None:  # megatron read common.pt itself (else ours gave it the committed bytes)
            check_inplace(group, manifest)  # common.pt, which megatron has read: the committed bytes?
        whole = [COMMON_STATE_FNAME] if COMMON_STATE_FNAME in manifest["files"] else []  # (older saves: in the group)
        with ThreadPoolExecutor(self.checkpointer.config.io_threads, thread_name_prefix="fastckpt-mload") as pool:
            opened = {rel: self._open(group, manifest, rel) for rel in tensor_files + whole}
            records = {rel: _by_storage(opened[rel].records(pool)) for rel in tensor_files}
            ranges: dict[str, list[tuple[int, int]]] = {rel: [(0, opened[rel].covered)] for rel in whole}
            for parts in plans.values():
                for saved, part in parts:
                    off = _record(records[saved.file], saved, group)
                    lo, hi = byte_range(saved, part)
                    ranges.setdefault(saved.file, []).append((off + lo, off + hi))
            ensure_all({opened[rel]: r for rel, r in ranges.items()}, pool)
            objects = self._objects(group, index, leaves)

            def fill(sh: object) -> object:
                if isinstance(sh, ShardedObject):
                    return objects[sh.unique_key]
                if not isinstance(sh, ShardedTensor):
                    return sh
                return _assemble(sh, plans[id(sh)], opened, records, group)

            dict_list_map_inplace(fill, sharded_state_dict)
        needed = sum(hi - lo for rel in tensor_files for lo, hi in ranges[rel])
        self.last_load = LoadReport(group, len(opened), sum(vf.bytes_read for vf in opened.values()), needed,
                                    time.monotonic() - t0)
        return sharded_state_dict

    def _open(self, group: str, manifest: dict, rel: str) -> VerifiedFile:
        info = manifest["files"].get(rel)
        if info is None:
            raise CorruptCheckpointError(f"{os.path.join(group, rel)} is named by the index but not by the "
                                         "checkpoint's manifest; the checkpoint is damaged: load an earlier one")
        try:
            return VerifiedFile(self._ops, os.path.join(group, rel), info["checksum"],
                                odirect=self.checkpointer.config.odirect)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{os.path.join(group, rel)} is named by the checkpoint's manifest but does not exist (deleted since "
                "the commit): the checkpoint is damaged; load an earlier one (fastckpt.latest(<save dir>))") from exc

    def _objects(self, group: str, index: Index, leaves: list) -> dict[str, object]:
        wanted = [sh for sh in leaves if isinstance(sh, ShardedObject)]
        loaded: dict[str, dict] = {}
        out = {}
        for sh in wanted:
            saved = index.objects.get(sh.unique_key)
            if saved is None:
                same = sorted(u for u, o in index.objects.items() if o.key == sh.key)
                raise ReshardingError(
                    f"ShardedObject {sh.key!r} cannot be loaded as {sh.unique_key}: saved as {same or 'nothing'}. "
                    "Objects are not resharded; load with the layout they were saved with")
            if saved.file not in loaded:
                loaded[saved.file] = self._load_objects(group, saved.file, sorted(
                    {o.key for o in wanted if (where := index.objects.get(o.unique_key)) is not None
                     and where.file == saved.file}))  # (one missing is named when the loop reaches it)
            out[sh.unique_key] = loaded[saved.file][sh.unique_key]
        return out

    def _load_objects(self, group: str, file: str, keys: list[str]) -> dict:
        """The objects file ``file``, holding the ShardedObjects ``keys``; one that weights_only
        refuses names them and the fix as a dist_checkpointing.load caller makes it (torch's
        message, and the core's note, speak of a torch.load call the caller never made)."""
        path = os.path.join(group, file)
        try:
            return self.checkpointer.load(path, weights_only=self._weights_only)
        except pickle.UnpicklingError as exc:
            if not self._weights_only:
                raise
            raise pickle.UnpicklingError(
                f"ShardedObject {', '.join(map(repr, keys))} cannot be loaded from {path}: it holds an object that "
                f"weights_only=True refuses ({exc}). If you trust this checkpoint, load it with dist_checkpointing"
                ".load(..., sharded_strategy=FastCkptLoadStrategy(checkpointer, weights_only=False)), or allow the "
                "type first with torch.serialization.add_safe_globals([...])") from exc

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every saved tensor as a data-less ShardedTensor of its global shape and dtype."""
        _, index = self._index(checkpoint_group(checkpoint_dir))
        return {key: ShardedTensor.from_rank_offsets(
                    key, torch.empty(shards[0].global_shape, dtype=shards[0].torch_dtype, device="meta")).without_data()
                for key, shards in index.tensors.items()}

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Tensors as in ``load_tensors_metadata``, plus every saved ShardedObject."""
        commonload.resume()  # megatron's strict modes: part of the load whose common.pt was just read
        _, index = self._index(checkpoint_group(checkpoint_dir))
        out = self.load_tensors_metadata(checkpoint_dir)
        out.update({u: ShardedObject.empty_from_unique_key(u) for u in index.objects})
        return out


def _by_storage(records: dict[str, tuple[int, int]]) -> dict[str, list[tuple[int, int]]]:
    """A file's zip records by the storage number their name ends in (``<archive>/data/<n>``), every
    match kept so that ``_record`` still sees a doubled record. Built once per file: looking each of
    a file's thousands of shards up by scanning all its records made a load quadratic in tensors."""
    out: dict[str, list[tuple[int, int]]] = {}
    for name, v in records.items():
        _, sep, number = name.rpartition("/data/")  # the same names as name.endswith(f"/data/{n}")
        if sep:
            out.setdefault(number, []).append(v)
    return out


def _record(records: dict[str, list[tuple[int, int]]], saved: SavedTensor, group: str) -> int:
    """Where ``saved``'s storage record starts in its file; its size is checked against the index."""
    hits = records.get(str(saved.storage), [])
    if len(hits) != 1 or hits[0][1] != saved.storage_nbytes:
        raise CorruptCheckpointError(
            f"{os.path.join(group, saved.file)}: storage {saved.storage} of tensor {saved.key!r} is not the "
            f"{saved.storage_nbytes}-byte record the index describes; the checkpoint is damaged: load an earlier one")
    return hits[0][0]


def _assemble(sh: ShardedTensor, parts: list, opened: dict[str, VerifiedFile],
              records: dict[str, dict[str, list[tuple[int, int]]]], group: str) -> torch.Tensor:
    """The tensor ``sh`` asks for, from the verified bytes of the saved shards that overlap it.

    When one saved shard is exactly the requested one, the result is a view of the bytes read
    (no copy) unless the saved shard's strides differ from the request's (a transposed view saved,
    a contiguous tensor asked for: copied into the requested layout); otherwise the overlaps are
    copied into a new tensor.
    """
    want = tensor_box(sh)
    device = sh.data.device if sh.data is not None else torch.device("cpu")

    def source(saved: SavedTensor) -> torch.Tensor:
        off = _record(records[saved.file], saved, group)
        return shard_view(saved, opened[saved.file].bytes(off, off + saved.storage_nbytes))

    if len(parts) == 1 and parts[0][1] == want == parts[0][0].box and parts[0][0].torch_dtype == sh.dtype:
        out = source(parts[0][0]).reshape(sh.local_shape)
        # the layout asked for, not a saved view's strides: Megatron's exchange broadcasts it, which needs that
        if sh.data is None:
            out = out.contiguous()  # one copy, only of a non-contiguous view
        elif out.stride() != sh.data.stride():
            out = torch.empty_like(sh.data, device="cpu").copy_(out)
    else:
        full = not sh.allow_shape_mismatch  # plan_tensor proved every element covered (else: padding)
        out = torch.empty(sh.local_shape, dtype=sh.dtype) if full else torch.zeros(sh.local_shape, dtype=sh.dtype)
        view = out.view(want.shape)
        for saved, part in parts:
            view[part.within(want)].copy_(source(saved)[part.within(saved.box)])
    return out.to(device) if device.type != "cpu" else out


def _changed(group: str, pinned: dict) -> bool:
    """Whether ``group``'s published manifest is no longer ``pinned`` (another save was swapped in)."""
    try:
        now = read_group_manifest(group)
    except (OSError, ValueError):  # unreadable now: nothing says it changed
        return False
    return now is not None and commonload.identity(now) != commonload.identity(pinned)
