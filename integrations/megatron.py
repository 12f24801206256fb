"""Megatron-core integration: ``dist_checkpointing`` save and load strategies backed by fastckpt.

Importing this module registers both strategies with megatron-core under the backend
``("fastckpt", 1)`` (megatron re-registers its own torch backends on every lookup, so ours has
its own name), and a common-state loader in the place of megatron's ``("torch", 1)`` one, which
reads a fastckpt checkpoint's common.pt from the save the tensors are read from
(``_megatron.commonload``)::

    import fastckpt.integrations.megatron  # registers ("fastckpt", 1)
    from megatron.core import dist_checkpointing

    request = dist_checkpointing.save(sharded_sd, ckpt_dir, ("fastckpt", 1), async_sharded_save=True)
    ...                                     # training goes on while the files are written
    request.execute_sync()                  # or schedule it on megatron's AsyncCallsQueue
    state = dist_checkpointing.load(sharded_sd, ckpt_dir)   # picks our loader from metadata.json

Order of calls for one save (every rank, training thread unless noted), docs/megatron.md:
  megatron: save_preprocess (validation) -> rank 0 writes common.pt -> ``async_save``:
    (rank 0: metadata.json on a side thread) -> snapshot this rank's main replicas into one
    file (``Checkpointer.save(..., group=)``) and its ShardedObjects into another ->
    all_gather the index -> rank 0: the index file (which keeps the bytes of common.pt and
    metadata.json, written in place by megatron: ``_megatron.inplace``), metadata.json
    joined -> request the group commit
    (``Checkpointer.commit``), which completes in the background: every rank's
    files durable -> manifest -> fastckpt's ``latest``; then rank 0 points Megatron-LM's
    tracker (``latest_checkpointed_iteration.txt``) at it. The returned AsyncRequest's
    ``async_fn`` waits for that commit (in whatever process megatron runs it); its finalize
    step raises any failure, then megatron rewrites metadata.json (same bytes) and
    Megatron-LM its tracker.
Loading reads the index, then from each rank's file only the checksum blocks holding the
shards this rank asks for (resharding), verified (``_megatron.read``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

from fastckpt import Checkpointer, SaveHandle
from fastckpt.errors import CheckpointWriteError, ConfigError
from fastckpt.io.ops import FileOps

from ._megatron import inplace
from ._megatron import waiting as W
from ._megatron.common import (
    BACKEND,
    INDEX_FILE,
    OBJECT_FILE,
    TENSOR_FILE,
    VERSION,
    CheckpointerSource,
    ThroughCheckpointer,
    checked,
    checkpoint_group,
    default_checkpointer,
    once,
    rank_world,
)
from ._megatron.commonload import FastCkptCommonLoadStrategy
from ._megatron.compat import publish_bytes
from ._megatron.layout import ReshardingError, index_body, split_rank_state
from ._megatron.load import FastCkptLoadStrategy, LoadReport
from ._megatron.tracker import (
    TRACKER,
    advance_tracker,
    iteration_of,
    newest_complete_iteration,
    read_tracker,
    repair,
    sync_tracker,
)

__all__ = [
    "BACKEND", "VERSION", "TRACKER", "FastCkptSaveStrategy", "FastCkptLoadStrategy", "MegatronSave", "LoadReport",
    "ReshardingError", "FastCkptCommonLoadStrategy", "register", "default_checkpointer", "advance_tracker",
    "sync_tracker", "read_tracker", "newest_complete_iteration", "repair_checkpoint",
]

log = logging.getLogger("fastckpt.megatron")
ASYNC_GRACE_S = 30.0  # the async part waits commit_timeout_s + this for the commit (without a burst buffer)


@dataclass(frozen=True)
class MegatronSave:
    """One save as this rank saw it: ``blocked_s`` is the time ``async_save`` held the training
    thread (snapshot, index exchange, rank 0's small files); ``handle.wait()`` returns the
    commit's SaveRecord (``durable_s``, from this rank's first file's save) once every rank's files
    are durable; ``lead_s``: ``async_save``'s time before that save."""

    group: str
    iteration: int | str | None
    blocked_s: float
    bytes: int
    handle: SaveHandle
    lead_s: float = 0.0

    def durable_s(self, timeout: float | None = None) -> float | None:
        """Seconds from ``async_save`` to the committed group (waits for it); None when the
        save was superseded before it reached its home."""
        rec = self.handle.wait(timeout)
        return None if rec.durable_s is None else self.lead_s + rec.durable_s


class FastCkptSaveStrategy(ThroughCheckpointer, AsyncSaveShardedStrategy):
    """Saves each rank's main replicas through a fastckpt Checkpointer, as one atomic group.

    Args:
        checkpointer: the Checkpointer to save through, a function returning it, or None for
            ``default_checkpointer()``.
        tracker: point Megatron-LM's ``latest_checkpointed_iteration.txt`` (in the parent of an
            ``iter_NNNNNNN`` checkpoint directory) at it right after each commit.
        ops: the FileOps for the files this strategy writes itself (metadata.json, the
            tracker, failure notes).
    """

    def __init__(self, checkpointer: CheckpointerSource = None, *, tracker: bool = True,
                 ops: FileOps | None = None, backend: str = BACKEND, version: int = VERSION) -> None:
        super().__init__(backend, version)
        if not isinstance(tracker, bool):
            raise ConfigError(f"tracker={tracker!r}: give True (point Megatron-LM's {TRACKER} at each committed "
                              "iteration) or False")
        (self._source, self._ops), self._tracker = checked(checkpointer, ops), tracker
        self.last_save: MegatronSave | None = None

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> AsyncRequest:
        """Snapshot this rank's shards and return; the files are written and committed in the
        background. Called on every rank (it exchanges the index with all_gather_object).

        When it fails, every rank first puts back what megatron rewrote in place (``common.pt``)
        in the checkpoint already committed at ``checkpoint_dir``, if any (``_megatron.inplace``;
        the same bytes, written atomically), so that no rank's caller sees it torn.

        Its files (tensors, objects, rank 0's index) are one save for the Checkpointer's overhead
        monitor (``Checkpointer.one_save``): counted once, their blocked time summed."""
        group = checkpoint_group(checkpoint_dir)
        try:
            with self.checkpointer.one_save():  # its 2-3 files are one save for the overhead alarm
                return self._save(sharded_state_dict, group)
        except BaseException as exc:
            inplace.restore_after(group, self._ops, exc)
            raise

    def _save(self, sharded_state_dict: ShardedStateDict, group: str) -> AsyncRequest:
        t0 = time.monotonic()
        ck = self.checkpointer
        rank, world = rank_world()
        config_bytes = json.dumps(asdict(CheckpointingConfig(self.backend, self.version))).encode()
        config = _in_thread(publish_bytes, self._ops, os.path.join(group, CONFIG_FNAME), config_bytes) \
            if rank == 0 else None  # metadata.json, durable before the commit; its fsync overlaps the snapshot
        tfile, ofile = TENSOR_FILE.format(rank), OBJECT_FILE.format(rank)
        tensors: dict = {}
        try:
            tensors, objects, saved_t, saved_o = split_rank_state(list(nested_values(sharded_state_dict)), tfile, ofile)
            lead_s = time.monotonic() - t0  # the commit's durable_s counts from the saves below
            for state, name in ((tensors, tfile), (objects, ofile)):
                if state:
                    ck.save(state, os.path.join(group, name), group=group)
            error = None
        except Exception as exc:  # every rank must reach the all_gather below, or the others hang in it
            saved_t, saved_o, error = [], [], exc
        gathered: list = [None] * world
        torch.distributed.all_gather_object(
            gathered, (saved_t, saved_o, uuid.uuid4().hex if rank == 0 else None,
                       None if error is None else repr(error)))
        if error is not None:
            raise error
        failed = [f"rank {r}: {g[3]}" for r, g in enumerate(gathered) if g[3] is not None]
        if failed:
            raise CheckpointWriteError(f"{group} was not saved (nothing is committed; the previous checkpoint is "
                                       f"intact): {'; '.join(failed)}")
        save_id = gathered[0][2]
        iteration = iteration_of(group)
        extra: dict = {"megatron_save": save_id, **({"step": iteration} if isinstance(iteration, int) else {})}
        if rank == 0:
            try:
                extra[inplace.MANIFEST_KEY] = self._save_index(ck, group, gathered, world, config_bytes)
                config.result()  # type: ignore[union-attr]  (metadata.json is durable before the commit)
            except Exception as exc:  # the others wait in their commit already: end it on every rank now
                ck.unsaved(os.path.join(group, INDEX_FILE), group, exc)
                with contextlib.suppress(CheckpointWriteError):
                    ck.commit(group)  # raises: this rank's index is missing
                raise
        handle = ck.commit(group, **extra)
        # with a burst buffer the commit waits for the copy home, which commit_timeout_s does not bound
        job = W.Job(group, save_id, rank, None if ck.config.local_dir else ck.config.commit_timeout_s + ASYNC_GRACE_S)
        watch = W.watch(handle, job, self._tracker and iteration is not None, self._ops)
        nbytes = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors.values()}.values())
        self.last_save = MegatronSave(group, iteration, time.monotonic() - t0, nbytes, handle, lead_s)
        return AsyncRequest(W.await_commit, (job,), [partial(_finalize, watch)])

    def _save_index(self, ck: Checkpointer, group: str, gathered: list, world: int, config: bytes) -> dict[str, str]:
        """Rank 0: the index, which also keeps the bytes of the files megatron writes in place
        (common.pt, metadata.json); returns their checksums, for the group manifest."""
        index = index_body([t for g in gathered for t in g[0]], [o for g in gathered for o in g[1]], world)
        index[inplace.KEY] = kept = inplace.record(group, config)
        ck.save(index, os.path.join(group, INDEX_FILE), group=group)
        return inplace.checksums(kept)


def _in_thread(fn: Callable[..., None], *args: object) -> Future:
    """Run ``fn(*args)`` on a new thread; the Future holds its result or its error."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 (handed to whoever waits on the Future)
            fut.set_exception(exc)

    threading.Thread(target=run, name="fastckpt-megatron-config", daemon=True).start()
    return fut


def _finalize(watch: W.Watch) -> None:
    """Megatron's finalize step (every rank, training thread, after every rank's async part):
    raise this save's failure, if any, before megatron writes metadata.json and the tracker.

    Rank 0 waits for its watch, which moves the tracker right after the commit: when finalize
    returns there, the tracker names this iteration. Other ranks do not wait for their commit
    handle once the group is committed: theirs resolves when its poll sees the manifest, which
    may be a moment later. A commit still running (megatron's async worker gave up at its
    deadline, or never ran) is waited for without a deadline of finalize's own, as
    ``await_commit`` waits in this process: its waits for the other ranks end at
    ``commit_timeout_s``, but this rank's own write has no bound, so a save that is slow but
    moving finalizes, and a write that hangs (a hung mount) holds finalize as it would hold a
    synchronous save.
    """
    try:
        failed = W.failures(watch.job)
        if watch.error is not None:
            raise W.cause(watch.job, watch.error)
        if failed:
            raise W.failed_error(watch.job, failed)
        if not watch.done.is_set() and (watch.job.rank == 0 or not W.committed(watch.job)):
            try:
                watch.handle.wait()
            finally:  # rank 0: the tracker, moved just after; or, on failure, common.pt put back
                watch.done.wait(watch.job.timeout_s)
            if watch.error is not None:
                raise W.cause(watch.job, watch.error)
        if watch.record is not None and watch.record.superseded:
            log.warning("fastckpt: %s was superseded before it reached its home (replicate_policy='coalesce')",
                        watch.job.group)
    finally:
        W.forget(watch.job.save_id)


def repair_checkpoint(checkpoint_dir: str | Path, *, ops: FileOps | None = None) -> list[str]:
    """Put back the files megatron-core writes in place (``common.pt``, ``metadata.json``) of
    the committed checkpoint at ``checkpoint_dir``, where a save into it was killed while
    rewriting them; the patched Megatron-LM does it in ``sync_tracker`` before it loads.

    Returns:
        The names of the files put back (none when they are as committed, or when another
        backend, such as megatron's ``torch_dist``, saved the iteration last).

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` does not exist (a misspelled path), or is a file.
        IncompleteCheckpointError: it holds no committed fastckpt checkpoint (a save directory
            instead of one of its iterations, or a save that never committed).
        CorruptCheckpointError: the checkpoint's index does not hold their committed bytes.
    """
    return repair(checkpoint_group(checkpoint_dir), ops or FileOps())


def register(checkpointer: CheckpointerSource = None, *, tracker: bool = True, ops: FileOps | None = None
             ) -> tuple[FastCkptSaveStrategy, FastCkptLoadStrategy]:
    """(Re-)register the ``("fastckpt", 1)`` strategies, saving and loading through ``checkpointer``,
    and ``FastCkptCommonLoadStrategy`` for megatron's ``("torch", 1)`` common loads.

    Importing this module registers them with ``default_checkpointer()``; call this to use a
    Checkpointer of your own (a burst buffer, event log, overhead budget...). ``tracker`` and
    ``ops`` are passed to the strategies (see ``FastCkptSaveStrategy``).

    Returns:
        The registered save and load strategies (``last_save``/``last_load`` report on them).

    Raises:
        ConfigError: ``checkpointer``, ``tracker`` or ``ops`` is not of a kind it accepts (the
            strategies registered before stay registered).
    """
    checkpointer = once(checkpointer)  # a function is called once, for both strategies
    save = FastCkptSaveStrategy(checkpointer, tracker=tracker, ops=ops)
    load = FastCkptLoadStrategy(checkpointer, ops=ops)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, save)
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, load)
    # megatron's common loader, in its place (it delegates for checkpoints fastckpt did not save)
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, FastCkptCommonLoadStrategy())
    return save, load


register()
