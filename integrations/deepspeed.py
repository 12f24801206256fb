"""DeepSpeed integration: a DeepSpeed ``CheckpointEngine`` backed by fastckpt.

DeepSpeed picks its checkpoint engine from its own config only, so fastckpt's is installed in
code, after ``deepspeed.initialize``::

    from fastckpt.integrations.deepspeed import install
    install(model_engine, fastckpt.Checkpointer(local_dir="/local_nvme/ckpt"))
    model_engine.save_checkpoint(save_dir, tag)   # returns after the snapshot

(Lightning's ``DeepSpeedStrategy`` never calls CheckpointIO; ``FastCkptIO`` installs this engine
on ``trainer.strategy.deepspeed_engine`` itself.)

Order of calls, from ``DeepSpeedEngine.save_checkpoint``, on every rank, training thread:
  makedirs(save_dir)  (rank 0)  -> create(info) -> makedirs(save_dir/tag)
  -> save(state_dict=..., path=...) for each file this rank writes
  -> commit(info) -> rank 0 writes save_dir/latest -> barrier
Each file is saved into the group ``save_dir/tag`` (``Checkpointer.save(..., group=)``), and
``commit`` calls ``Checkpointer.commit(group)`` and returns at once: rank 0 publishes the group
manifest, and fastckpt's own ``latest`` pointer (in DeepSpeed's format: the tag), once every
rank's files are durable. Loading an uncommitted tag through this engine raises
``IncompleteCheckpointError``.

``is_decoupled()`` is False on purpose. True would make DeepSpeed call ``commit`` at the next
``engine.step()`` boundary and then write ``latest`` and run a barrier: to keep ``latest``
truthful ``commit`` would have to block there until the group is durable, every rank would have
to decide at the same step, and the last checkpoint before the process ends would never be
committed. With False, DeepSpeed's plain ``latest`` write may name a tag that is still being
written; fastckpt's reader refuses it until it is complete, and ``fastckpt.latest(save_dir)``
names the newest complete one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from fastckpt.checkpointer import Checkpointer
from fastckpt.records import SaveHandle
from fastckpt.urls import normalize

__all__ = ["FastCkptEngine", "install"]


class FastCkptEngine(CheckpointEngine):
    """DeepSpeed checkpoint engine whose saves return after the snapshot.

    Args:
        checkpointer: the Checkpointer to save through, or a function returning the one to use
            now (FastCkptIO passes its own, which it replaces after each fit).
        on_commit: called with each group commit's SaveHandle (FastCkptIO logs its numbers).
    """

    def __init__(self, checkpointer: Checkpointer | Callable[[], Checkpointer],
                 on_commit: Callable[[SaveHandle], None] | None = None) -> None:
        super().__init__(None)
        self.name = "FastCkptEngine"
        self._source = checkpointer
        self._on_commit = on_commit
        self._group: str | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        return self._source if isinstance(self._source, Checkpointer) else self._source()

    def create(self, info: CheckpointCommitInfo) -> None:
        self._group = normalize(os.path.join(info.save_dir, str(info.tag)))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: object, path: str) -> None:
        """DeepSpeed calls this with the keyword ``state_dict``; returns after the snapshot."""
        path = normalize(path)
        group = self._group if self._group is not None and path.startswith(self._group + os.sep) else None
        self.checkpointer.save(state_dict, path, group=group)

    def load(self, path: str, map_location: object = None) -> object:
        """Verified load. DeepSpeed's files hold its config objects, which its own engine also
        loads with ``weights_only=False``: load only checkpoints you trust."""
        return self.checkpointer.load(path, map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """This rank is done with ``info.tag``; the group is published in the background."""
        group = normalize(os.path.join(info.save_dir, str(info.tag)))
        handle = self.checkpointer.commit(group, tag=str(info.tag))
        self._group = None
        if self._on_commit is not None:
            self._on_commit(handle)
        return True

    def is_decoupled(self) -> bool:
        return False  # see the module docstring

    def wait(self) -> None:
        """Block until every save and commit so far is durable (raises a failure once)."""
        self.checkpointer.wait()


def install(engine: object, checkpointer: Checkpointer | Callable[[], Checkpointer] | None = None,
            on_commit: Callable[[SaveHandle], None] | None = None) -> FastCkptEngine:
    """Make ``engine`` (a ``DeepSpeedEngine``) save and load through fastckpt.

    Without ``checkpointer`` a default ``Checkpointer()`` is created; call ``.wait()`` on the
    returned engine (or close your own Checkpointer) before the process ends.
    """
    if not hasattr(engine, "save_checkpoint") or not hasattr(engine, "checkpoint_engine"):
        raise TypeError(f"install() needs a deepspeed.DeepSpeedEngine (from deepspeed.initialize), "
                        f"got {type(engine).__name__}")
    fe = FastCkptEngine(checkpointer if checkpointer is not None else Checkpointer(), on_commit)
    engine.checkpoint_engine = fe  # type: ignore[attr-defined]
    return fe
