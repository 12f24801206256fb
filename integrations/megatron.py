"""Megatron-core integration: ``dist_checkpointing`` save and load strategies backed by fastckpt.

Importing this module registers both strategies with megatron-core under the backend
``("fastckpt", 1)`` (megatron re-registers its own torch backends on every lookup, so ours has
its own name)::

    import fastckpt.integrations.megatron  # registers ("fastckpt", 1)
    from megatron.core import dist_checkpointing

    request = dist_checkpointing.save(sharded_sd, ckpt_dir, ("fastckpt", 1), async_sharded_save=True)
    ...                                     # training goes on while the files are written
    request.execute_sync()                  # or schedule it on megatron's AsyncCallsQueue
    state = dist_checkpointing.load(sharded_sd, ckpt_dir)   # picks our loader from metadata.json

Order of calls for one save (every rank, training thread unless noted), docs/megatron.md:
  megatron: save_preprocess (validation) -> rank 0 writes common.pt -> ``async_save``:
    snapshot this rank's main replicas into one file (``Checkpointer.save(..., group=)``) and
    its ShardedObjects into another -> all_gather the index -> rank 0: the index file,
    common.pt again through fastckpt (so the commit covers it), metadata.json -> request the
    group commit (``Checkpointer.commit``), which completes in the background: every rank's
    files durable -> manifest -> fastckpt's ``latest``; then rank 0 moves Megatron-LM's
    tracker (``latest_checkpointed_iteration.txt``) forward. The returned AsyncRequest's
    ``async_fn`` waits for that commit (in whatever process megatron runs it); its finalize
    step raises any failure, then megatron rewrites metadata.json (same bytes) and
    Megatron-LM its tracker.
Loading reads the index, then from each rank's file only the checksum blocks holding the
shards this rank asks for (resharding), verified (``_megatron_read``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from fastckpt import Checkpointer, SaveHandle
from fastckpt.errors import CheckpointWriteError, ConfigError, CorruptCheckpointError
from fastckpt.io.ops import FileOps

from . import _megatron_tracker as T
from ._megatron_compat import is_url, normalize, publish_bytes, read_group_manifest, incomplete_group_error
from ._megatron_layout import Index, ReshardingError, SavedTensor, byte_range, index_body, plan_tensor, shard_view
from ._megatron_layout import split_rank_state, tensor_box
from ._megatron_read import VerifiedFile, ensure_all
from ._megatron_tracker import TRACKER, advance_tracker, newest_complete_iteration, read_tracker, sync_tracker

__all__ = [
    "BACKEND", "VERSION", "TRACKER", "FastCkptSaveStrategy", "FastCkptLoadStrategy", "MegatronSave", "LoadReport",
    "ReshardingError", "register", "advance_tracker", "sync_tracker", "read_tracker", "newest_complete_iteration",
]

log = logging.getLogger("fastckpt.megatron")

BACKEND, VERSION = "fastckpt", 1
INDEX_FILE = "fastckpt-index.pt"
TENSOR_FILE = "fastckpt-rank{:05d}.pt"
OBJECT_FILE = "fastckpt-objects-rank{:05d}.pt"

CheckpointerSource = Checkpointer | Callable[[], Checkpointer] | None
_default: Checkpointer | None = None


def default_checkpointer() -> Checkpointer:
    """The Checkpointer the registered strategies use unless given one (created on first use,
    so that torch.distributed is initialised by then; closed at exit)."""
    global _default
    if _default is None:
        _default = Checkpointer()
    return _default


def _resolve(source: CheckpointerSource) -> Checkpointer:
    if source is None:
        return default_checkpointer()
    return source if isinstance(source, Checkpointer) else source()


def _group(checkpoint_dir: str | Path) -> str:
    group = normalize(checkpoint_dir)
    if is_url(group):
        raise ConfigError(f"{group}: megatron writes common.pt and metadata.json with POSIX calls, so the checkpoint "
                          "directory must be a path (a mount); for a burst buffer give the Checkpointer local_dir")
    return group


def _rank_world() -> tuple[int, int]:
    if not torch.distributed.is_initialized():
        raise ConfigError("megatron's dist_checkpointing needs torch.distributed: call "
                          "torch.distributed.init_process_group first (gloo works on CPU)")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


@dataclass(frozen=True)
class MegatronSave:
    """One save as this rank saw it: ``blocked_s`` is the time ``async_save`` held the training
    thread (snapshot, index exchange, rank 0's small files); ``handle.wait()`` returns the
    commit's SaveRecord (``durable_s``) once every rank's files are durable."""

    group: str
    iteration: int | str | None
    blocked_s: float
    bytes: int
    handle: SaveHandle

    def durable_s(self, timeout: float | None = None) -> float | None:
        """Seconds from ``async_save`` to the committed group (waits for it); None when the
        save was superseded before it reached its home."""
        rec = self.handle.wait(timeout)
        return None if rec.durable_s is None else self.blocked_s + rec.durable_s


@dataclass(frozen=True)
class LoadReport:
    """One load on this rank: files opened, bytes read from them (verified), bytes the
    requested shards needed, and the time taken."""

    group: str
    files: int
    bytes_read: int
    bytes_needed: int
    seconds: float


class FastCkptSaveStrategy(AsyncSaveShardedStrategy):
    """Saves each rank's main replicas through a fastckpt Checkpointer, as one atomic group.

    Args:
        checkpointer: the Checkpointer to save through, a function returning it, or None for
            ``default_checkpointer()``.
        tracker: move Megatron-LM's ``latest_checkpointed_iteration.txt`` (in the parent of an
            ``iter_NNNNNNN`` checkpoint directory) forward right after each commit.
        ops: the FileOps for the files this strategy writes itself (metadata.json, the
            tracker, failure notes).
    """

    def __init__(self, checkpointer: CheckpointerSource = None, *, tracker: bool = True,
                 ops: FileOps | None = None, backend: str = BACKEND, version: int = VERSION) -> None:
        super().__init__(backend, version)
        self._source, self._tracker, self._ops = checkpointer, tracker, ops or FileOps()
        self.last_save: MegatronSave | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        return _resolve(self._source)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> AsyncRequest:
        """Snapshot this rank's shards and return; the files are written and committed in the
        background. Called on every rank (it exchanges the index with all_gather_object)."""
        t0 = time.monotonic()
        ck, group = self.checkpointer, _group(checkpoint_dir)
        rank, world = _rank_world()
        tfile, ofile = TENSOR_FILE.format(rank), OBJECT_FILE.format(rank)
        tensors, objects, saved_t, saved_o = split_rank_state(list(nested_values(sharded_state_dict)), tfile, ofile)
        for state, name in ((tensors, tfile), (objects, ofile)):
            if state:
                ck.save(state, os.path.join(group, name), group=group)
        gathered: list = [None] * world
        torch.distributed.all_gather_object(gathered, (saved_t, saved_o, uuid.uuid4().hex if rank == 0 else None))
        save_id = gathered[0][2]
        if rank == 0:
            self._save_rank0_files(ck, group, gathered, world)
        iteration = T.iteration_of(group)
        extra = {"megatron_save": save_id, **({"step": iteration} if isinstance(iteration, int) else {})}
        handle = ck.commit(group, **extra)
        job = T.Job(group, save_id, rank, ck.config.commit_timeout_s + 30.0)
        watch = T.watch(handle, job, self._tracker and iteration is not None, self._ops)
        nbytes = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors.values()}.values())
        self.last_save = MegatronSave(group, iteration, time.monotonic() - t0, nbytes, handle)
        return AsyncRequest(T.await_commit, (job,), [partial(_finalize, watch)])

    def _save_rank0_files(self, ck: Checkpointer, group: str, gathered: list, world: int) -> None:
        """The index; common.pt through fastckpt, so the group's commit covers it; metadata.json,
        so that a committed group is a complete megatron checkpoint."""
        index = index_body([t for g in gathered for t in g[0]], [o for g in gathered for o in g[1]], world)
        ck.save(index, os.path.join(group, INDEX_FILE), group=group)
        common = os.path.join(group, COMMON_STATE_FNAME)
        if os.path.exists(common):  # written by megatron's common strategy just before us
            ck.save(torch.load(common, map_location="cpu", weights_only=False), common, group=group)
        config = CheckpointingConfig(self.backend, self.version)
        publish_bytes(self._ops, os.path.join(group, CONFIG_FNAME), json.dumps(asdict(config)).encode())


def _finalize(watch: T.Watch) -> None:
    """Megatron's finalize step (every rank, training thread, after every rank's async part):
    raise this save's failure, if any, before megatron writes metadata.json and the tracker.

    It does not wait for this rank's commit handle once the group is committed: on ranks other
    than 0 the handle resolves when its poll sees the manifest, which may be a moment later.
    """
    try:
        failed = T.failures(watch.job)
        if watch.error is not None:
            raise watch.error
        if failed:
            raise CheckpointWriteError(
                f"saving {watch.job.group} failed on another rank: {'; '.join(failed)}; the checkpoint is "
                "incomplete and the previous one is intact")
        if not watch.done.is_set() and not T.committed(watch.job):
            watch.handle.wait(watch.job.timeout_s)  # its async part was never run: wait here
        if watch.record is not None and watch.record.superseded:
            log.warning("fastckpt: %s was superseded before it reached its home (replicate_policy='coalesce')",
                        watch.job.group)
    finally:
        T.forget(watch.job.save_id)


class FastCkptLoadStrategy(LoadShardedStrategy):
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
        self._source, self._ops, self._weights_only = checkpointer, ops or FileOps(), weights_only
        self.last_load: LoadReport | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        return _resolve(self._source)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"this checkpoint was saved with backend {loaded_backend!r}; "
                                         f"FastCkptLoadStrategy reads {BACKEND!r} checkpoints")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version > VERSION:
            raise CheckpointingException(f"this checkpoint has fastckpt format version {loaded_version}; this "
                                         f"fastckpt reads up to {VERSION}: upgrade fastckpt")

    def _index(self, group: str) -> tuple[dict, Index]:
        manifest = read_group_manifest(group)
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
        """
        t0, group = time.monotonic(), _group(checkpoint_dir)
        manifest, index = self._index(group)
        leaves = list(nested_values(sharded_state_dict))
        plans = {id(sh): plan_tensor(sh, index) for sh in leaves if isinstance(sh, ShardedTensor)}
        by_file: dict[str, list[SavedTensor]] = {}
        for parts in plans.values():
            for saved, _ in parts:
                by_file.setdefault(saved.file, []).append(saved)
        files = sorted(by_file) + ([COMMON_STATE_FNAME] if COMMON_STATE_FNAME in manifest["files"] else [])
        with ThreadPoolExecutor(self.checkpointer.config.io_threads, thread_name_prefix="fastckpt-mload") as pool:
            opened = {rel: self._open(group, manifest, rel) for rel in files}
            records = {rel: vf.records(pool) for rel, vf in opened.items() if rel in by_file}
            ranges = {rel: [(0, opened[rel].covered)] for rel in files if rel not in by_file}
            for sh_id, parts in plans.items():
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
        needed = sum(hi - lo for rel in by_file for lo, hi in ranges[rel])
        self.last_load = LoadReport(group, len(opened), sum(vf.bytes_read for vf in opened.values()), needed,
                                    time.monotonic() - t0)
        return sharded_state_dict

    def _open(self, group: str, manifest: dict, rel: str) -> VerifiedFile:
        info = manifest["files"].get(rel)
        if info is None:
            raise CorruptCheckpointError(f"{os.path.join(group, rel)} is named by the index but not by the checkpoint's "
                                         "manifest; the checkpoint is damaged: load an earlier one")
        return VerifiedFile(self._ops, os.path.join(group, rel), info["checksum"],
                            odirect=self.checkpointer.config.odirect)

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
                loaded[saved.file] = self.checkpointer.load(os.path.join(group, saved.file),
                                                           weights_only=self._weights_only)
            out[sh.unique_key] = loaded[saved.file][sh.unique_key]
        return out

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every saved tensor as a data-less ShardedTensor of its global shape and dtype."""
        _, index = self._index(_group(checkpoint_dir))
        return {key: ShardedTensor.from_rank_offsets(
                    key, torch.empty(shards[0].global_shape, dtype=shards[0].torch_dtype, device="meta")).without_data()
                for key, shards in index.tensors.items()}

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Tensors as in ``load_tensors_metadata``, plus every saved ShardedObject."""
        _, index = self._index(_group(checkpoint_dir))
        out = self.load_tensors_metadata(checkpoint_dir)
        out.update({u: ShardedObject.empty_from_unique_key(u) for u in index.objects})
        return out


def _record(records: dict[str, tuple[int, int]], saved: SavedTensor, group: str) -> int:
    """Where ``saved``'s storage record starts in its file; its size is checked against the index."""
    hits = [v for name, v in records.items() if name.endswith(f"/data/{saved.storage}")]
    if len(hits) != 1 or hits[0][1] != saved.storage_nbytes:
        raise CorruptCheckpointError(
            f"{os.path.join(group, saved.file)}: storage {saved.storage} of tensor {saved.key!r} is not the "
            f"{saved.storage_nbytes}-byte record the index describes; the checkpoint is damaged: load an earlier one")
    return hits[0][0]


def _assemble(sh: ShardedTensor, parts: list, opened: dict[str, VerifiedFile],
              records: dict[str, dict[str, tuple[int, int]]], group: str) -> torch.Tensor:
    """The tensor ``sh`` asks for, from the verified bytes of the saved shards that overlap it.

    When one saved shard is exactly the requested one, the result is a view of the bytes read
    (no copy); otherwise the overlaps are copied into a new tensor.
    """
    want = tensor_box(sh)
    device = sh.data.device if sh.data is not None else torch.device("cpu")

    def source(saved: SavedTensor) -> torch.Tensor:
        off = _record(records[saved.file], saved, group)
        return shard_view(saved, opened[saved.file].bytes(off, off + saved.storage_nbytes))

    if len(parts) == 1 and parts[0][1] == want == parts[0][0].box and parts[0][0].torch_dtype == sh.dtype:
        out = source(parts[0][0]).reshape(sh.local_shape)
    else:
        full = sum(box.numel for _, box in parts) == want.numel
        out = torch.empty(sh.local_shape, dtype=sh.dtype) if full else torch.zeros(sh.local_shape, dtype=sh.dtype)
        view = out.view(want.shape)
        for saved, part in parts:
            view[part.within(want)].copy_(source(saved)[part.within(saved.box)])
    return out.to(device) if device.type != "cpu" else out


def register(checkpointer: CheckpointerSource = None, *, tracker: bool = True, ops: FileOps | None = None
             ) -> tuple[FastCkptSaveStrategy, FastCkptLoadStrategy]:
    """(Re-)register the ``("fastckpt", 1)`` strategies, saving and loading through ``checkpointer``.

    Importing this module registers them with ``default_checkpointer()``; call this to use a
    Checkpointer of your own (a burst buffer, event log, overhead budget...). ``tracker`` and
    ``ops`` are passed to the strategies (see ``FastCkptSaveStrategy``).

    Returns:
        The registered save and load strategies (``last_save``/``last_load`` report on them).
    """
    save = FastCkptSaveStrategy(checkpointer, tracker=tracker, ops=ops)
    load = FastCkptLoadStrategy(checkpointer, ops=ops)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, save)
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, load)
    return save, load


register()
