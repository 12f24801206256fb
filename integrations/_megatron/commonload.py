"""megatron's common state (``common.pt``) read from the same save as the tensors.

megatron-core 0.16.1's ``dist_checkpointing.load`` reads ``common.pt`` through its
``("torch", 1)`` common strategy before it calls the sharded strategy, which pins the group. Every
checkpoint's metadata.json names that common backend (megatron's finalize rewrites the file with
the default), so our sharded strategy cannot choose the common loader. A save of the same iteration
swapped in between the two reads gave a load with the common state of one save and the tensors of
another, without an error.

``FastCkptCommonLoadStrategy`` is registered in megatron's place for ``("torch", 1)``. For a
fastckpt checkpoint (metadata.json names our sharded backend) it reads ``common.pt`` once, checks
its bytes against the published manifest and notes, for this thread, which save they are of; each
call of the sharded load in the same ``dist_checkpointing.load`` (one, or two under
``FullyParallelLoadStrategyWrapper``: objects, then tensors) refuses another save (``seen``). The
note lives for one load: megatron checks the sharded strategy's backend (``forget``) at the start
of every ``dist_checkpointing.load``, before it reads ``common.pt``. Its non-default ``strict``
modes check it again after ``common.pt`` was read, then read the sharded metadata
(``load_sharded_metadata``) within the same load: that read takes back the notes the second check
set aside (``resume``). Any other checkpoint (an
iteration re-saved with ``torch_dist`` keeps our old manifest beside it) is loaded exactly as
megatron loads it, but for a missing ``common.pt`` (``absent_error``).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import maybe_load_config
from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy

from fastckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, GroupChangedError

from .common import BACKEND
from .compat import checksum_bytes, framework_files, is_url, normalize, read_group_manifest
from .inplace import FIX, committed

log = logging.getLogger("fastckpt.megatron")

_seen = threading.local()  # group -> the identity of the save whose common.pt this thread loaded


def identity(manifest: dict | None) -> tuple | None:
    """What tells two saves of one group apart: the attempt and the commit time."""
    return None if manifest is None else (manifest.get("attempt"), manifest.get("committed_at"))


def seen(group: str) -> tuple | None:
    """The save whose ``common.pt`` this thread's current load read for ``group``; None when
    megatron's common state was not read through ``FastCkptCommonLoadStrategy`` in this load."""
    return getattr(_seen, "groups", {}).get(group)


def forget() -> None:
    """The sharded backend is checked on this thread: a new ``dist_checkpointing.load`` starts, and
    what an earlier one noted is not its. The notes are set aside rather than dropped, for ``resume``."""
    _seen.aside, _seen.groups = getattr(_seen, "groups", {}), {}


def resume() -> None:
    """The sharded metadata is read on this thread right after a backend check: megatron-core
    0.16.1's ``dist_checkpointing.load`` with any ``strict`` mode but the default does that after
    ``load_common`` (``load_sharded_metadata``), so the notes that check set aside are this load's.
    Dropping them made the sharded load check ``common.pt`` on disk instead: a save under way in
    another job was reported as damage, and a save swapped in after megatron read ``common.pt``
    loaded, mixed, without an error. A metadata read of its own (``load_sharded_metadata`` called
    alone) takes back notes that the next load's check sets aside again."""
    _seen.groups = {**getattr(_seen, "aside", {}), **getattr(_seen, "groups", {})}


def missing_error(path: str, cause: CorruptCheckpointError) -> CheckpointNotFoundError:
    """``common.pt`` was deleted and the index does not hold its committed bytes either
    (``cause`` says why): nothing can put it back, so the fix is another checkpoint."""
    return CheckpointNotFoundError(f"{path} is missing, and {cause}. {FIX} cannot put it back either (it reads "
                                   "the same index)")


def absent_error(group: str, path: str) -> CheckpointingException:
    """``common.pt`` of a checkpoint fastckpt did not write (or never committed) does not exist. megatron-core
    0.16.1's own loader would say so by calling ``checkpoint_dir.iterdir()`` on the str ``dist_checkpointing.load``
    passes it, raising ``AttributeError: 'str' object has no attribute 'iterdir'``, which names neither. Its own
    exception type, so what catches megatron's errors still does."""
    try:
        held = sorted(os.listdir(group))
    except OSError as exc:
        held = [f"cannot be listed: {exc}"]
    shown = ", ".join(held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "")
    return CheckpointingException(
        f"Common file {path} does not exist: the checkpoint directory {group} (holding {shown or 'nothing'}) has no "
        f"{COMMON_STATE_FNAME}, which megatron's dist_checkpointing.save writes on rank 0 with every checkpoint, so "
        "this checkpoint is incomplete or the file was deleted. Load another checkpoint (an earlier iteration), or "
        f"put back its {COMMON_STATE_FNAME} from a copy")


def changed_error(group: str) -> GroupChangedError:
    return GroupChangedError(f"{group} was saved again while this load read it: megatron read common.pt of one save, "
                             "and another is published now. Nothing was loaded: load it again.")


class FastCkptCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's ``("torch", 1)`` common loader, reading a fastckpt checkpoint's ``common.pt`` as
    committed and remembering which save it was of."""

    def load_common(self, checkpoint_dir: str | Path) -> dict:
        group = normalize(checkpoint_dir)
        config = None if is_url(group) else maybe_load_config(group)
        manifest = read_group_manifest(group) if config is not None and config.sharded_backend == BACKEND else None
        path = os.path.join(group, COMMON_STATE_FNAME)
        if COMMON_STATE_FNAME not in framework_files(manifest):
            if not is_url(group) and not os.path.exists(path):  # megatron's own error would be about iterdir
                raise absent_error(group, path)
            return super().load_common(checkpoint_dir)
        try:
            with open(path, "rb") as f:
                data: bytes | None = f.read()
        except FileNotFoundError:  # deleted: its committed bytes are in the index all the same
            data = None
        digest = framework_files(manifest)[COMMON_STATE_FNAME]
        missing = data is None
        if data is None or checksum_bytes(data) != digest:  # or rewritten in place: a save into it under way, or killed
            try:  # the committed bytes, kept in the index: a reader never needs the file put back first
                data = committed(group, {COMMON_STATE_FNAME: digest})[COMMON_STATE_FNAME]
            except CorruptCheckpointError as exc:
                if identity(read_group_manifest(group)) != identity(manifest):
                    raise changed_error(group) from None
                if missing:
                    raise missing_error(path, exc) from exc
                raise
            if missing:
                log.warning("fastckpt: %s is missing; loading the committed bytes kept in the checkpoint's index "
                            "(%s(%r) puts the file back)", path, FIX, group)
        if not hasattr(_seen, "groups"):
            _seen.groups = {}
        _seen.groups[group] = identity(manifest)
        return torch.load(io.BytesIO(data), map_location="cpu")
