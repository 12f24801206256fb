"""FastCkptIO's books and its link to the Trainer: the saves in flight, queued removals, and
what the callback (``callback.py``) calls on the training thread (see ``plugin.py``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from typing import Any

from fastckpt.checkpointer import Checkpointer
from fastckpt.io.atomic import tmp_name
from fastckpt.records import SaveHandle
from fastckpt.urls import normalize

from .saves import SaveLedger, state_nbytes

log = logging.getLogger("fastckpt.lightning")

#: The key of a queued link (``_link_later``) among the queued removals.
LINK = "link:"
#: Strategies whose rank 0 does not hold the whole state in its own tensors.
SHARDED_STRATEGIES = {"FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"}
#: Added to the tensors' bytes when reserving: Lightning's metadata (loops, callbacks, hparams)
#: and the pickle around the tensors. The core adds its own headroom on top.
RESERVE_MARGIN = 1 << 20


class TrainerLink:
    """The part of ``FastCkptIO`` that keeps its books and talks to the Trainer."""

    _ck: Checkpointer | None
    _saves: SaveLedger
    _removals: dict[str, Future]
    _links: dict[str, tuple[list[SaveHandle], str]]  # linkpath -> (its target's saves, the target), queued
    _links_lock: threading.Lock
    _trainer_ref: Callable[[], Any] | None
    _callback: object
    _in_fit: bool
    _crashed: bool
    _reserved: bool
    _sharded: bool

    def _checkpointer(self) -> Checkpointer:
        raise NotImplementedError  # FastCkptIOMixin builds it

    def _trainer(self) -> Any:
        return self._trainer_ref() if self._trainer_ref is not None else None

    @contextmanager
    def _core(self) -> Iterator[Checkpointer]:
        """The Checkpointer for one CheckpointIO call. After fit no teardown follows to close one,
        so a Checkpointer made for a call there is closed when the call returns (such calls are
        synchronous: its work is done by then), and nothing of fastckpt outlives the call."""
        made = self._ck is None
        ck = self._checkpointer()
        try:
            yield ck
        finally:
            if made and not self._in_fit:
                self._ck = None
                ck.close()

    # ------------------------------------------------------------------ internals
    def _raise_first(self, errors: list[BaseException]) -> None:
        if not errors:
            return
        for e in errors[1:]:
            log.error("fastckpt: another checkpoint operation failed as well: %r", e)
        raise errors[0]

    def _harvest(self) -> list[BaseException]:
        ck = self._ck
        return self._saves.harvest(lambda: ck.stats() if ck is not None else None,
                                   keep_rows=self._callback is not None)

    def _fence(self) -> None:
        self._saves.fence(self._ck)

    def _in_flight(self, path: str | os.PathLike) -> bool:
        """Whether a save to ``path`` has not finished yet (its file may not exist)."""
        return any(not t.handle.done() for t in self._saves.to(normalize(os.fspath(path))))

    def _remove_after(self, ck: Checkpointer, path: str, saves: list[SaveHandle]) -> None:
        """The remover thread: delete ``path`` once ``saves`` (``SaveLedger.before_removal``) are all
        durable. If one failed or was skipped, Lightning counts a checkpoint that does not exist,
        and ``path`` may be the only good one left: keep it (a WARNING says so). Not an error:
        the failed save's own error is raised once, by the training thread."""
        for h in saves:
            why = not_durable(h)
            if why is not None:
                log.warning("fastckpt: kept %s although Lightning asked to delete it: the save of %s before it %s, "
                            "so deleting it could leave no checkpoint. Delete it yourself once a newer checkpoint "
                            "is durable.", path, h.path, why)
                return
        for linkpath in list(self._links):  # last.ckpt may name path: move it on first (it is queued after)
            self._relink(linkpath, False)
        ck.remove(path)

    def _link_later(self, trainer: Any, filepath: str, linkpath: str) -> bool:
        """ModelCheckpoint(save_last="link") links ``linkpath`` to ``filepath`` right after asking
        for its save. With that save in flight, queue the link behind it on the remover thread (in
        order with the removals) and return True; ``linkpath`` keeps its old target until then."""
        if not self._in_fit or not trainer.is_global_zero or not self._in_flight(filepath):
            return False
        saves = [t.handle for t in self._saves.to(normalize(os.fspath(filepath)))]
        with self._links_lock:
            self._links[linkpath] = (saves, filepath)
        self._removals[LINK + normalize(linkpath)] = self._queue(self._relink, linkpath, True)
        return True

    def _relink(self, linkpath: str, wait: bool) -> None:
        """The remover thread: make the newest link queued for ``linkpath``, once its target's
        saves are done (``wait``: waiting for them; else only if they are done already)."""
        with self._links_lock:
            entry = self._links.get(linkpath)
        if entry is None or (not wait and not all(h.done() for h in entry[0])):
            return
        _link_after(*entry, linkpath)
        with self._links_lock:
            if self._links.get(linkpath) is entry:
                del self._links[linkpath]

    def _queue(self, fn: Callable[..., None], *args: Any) -> Future:
        raise NotImplementedError  # FastCkptIOMixin runs it on its remover thread

    def _settle_removal(self, path: str) -> None:
        for key in (normalize(path), LINK + normalize(path)):  # its deletion, or its link, queued
            fut = self._removals.pop(key, None)
            if fut is not None:
                fut.result()

    def _raise_removal_errors(self) -> None:
        for p in [p for p, f in self._removals.items() if f.done()]:
            fut = self._removals.pop(p)
            if fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    def _track_commit(self, handle: SaveHandle, step: int | None) -> None:
        """DeepSpeed: one entry per group commit (the engine's ``on_commit``). With the lazy
        snapshot its row counts the fence wait too: the callback's fence, before DeepSpeed's
        step, is the one that waits (the engine's own finds the copies done)."""
        item = self._saves.add(handle, step, None, lazy=self.lazy_snapshot and self._in_fit)
        if not self._in_fit:
            self._saves.wait(item)

    # ------------------------------------------------------------------ called by the callback
    def _connect(self, trainer: Any, callback: object) -> bool:
        if self._callback is not None and self._callback is not callback and self._trainer() is trainer:
            return False  # another FastCkptCallback (explicit and from the entry point) got here first
        self._callback = callback
        self._trainer_ref = weakref.ref(trainer)
        # a save outside fit (validate, test, predict) is synchronous: no teardown hook flushes
        # there under every strategy (FSDPStrategy's never calls CheckpointIO.teardown)
        fitting = str(getattr(trainer.state.fn, "value", "fit")) == "fit"
        self._in_fit, self._crashed, self._reserved = fitting, False, False
        self._sharded = bool(SHARDED_STRATEGIES & {c.__name__ for c in type(trainer.strategy).__mro__})
        if trainer.is_global_zero and fitting:
            self._checkpointer()  # start the overhead clock with the run, not at the first save
        strategy = trainer.strategy
        if "FSDPStrategy" in (c.__name__ for c in type(strategy).__mro__) \
                and getattr(strategy, "_state_dict_type", "full") == "sharded":
            warnings.warn("fastckpt: FSDPStrategy(state_dict_type='sharded') writes its shards with "
                          "torch.distributed.checkpoint and never calls CheckpointIO, so FastCkptIO does not "
                          "see those saves. Use state_dict_type='full' to save through FastCkptIO.",
                          UserWarning, stacklevel=2)
        return True

    def _reserve(self, trainer: Any) -> None:
        """Once per fit, after the first optimizer step (when the optimizer state exists):
        have the core allocate the staging buffer in the background, so the first save does not
        allocate and prefault it on the training thread. Only where rank 0 holds whole tensors
        (single device, DDP); sharded strategies' local tensors do not tell the saved size."""
        if self._reserved or self._ck is None or not trainer.is_global_zero:
            return
        self._reserved = True
        if self._sharded:
            return
        nbytes, cuda = state_nbytes(trainer.lightning_module, trainer.optimizers)
        if nbytes:
            self._ck.reserve(nbytes + RESERVE_MARGIN, pinned=cuda)

    def _install_deepspeed(self, trainer: Any) -> None:
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if engine is None:
            return
        from ..deepspeed import install

        install(engine, self._checkpointer, on_commit=lambda handle: self._track_commit(handle, trainer.global_step),
                lazy_snapshot=self.lazy_snapshot)

    def _log_metrics(self, trainer: Any) -> None:
        self._raise_first(self._harvest())
        for row in self._saves.drain_rows():
            for lg in trainer.loggers:
                lg.log_metrics(row, step=trainer.global_step)

    def _disconnect(self, callback: object) -> None:
        if self._callback is callback:
            self._callback = None
            self._trainer_ref = None


def _link_after(saves: list[SaveHandle], filepath: str, linkpath: str) -> None:
    """The remover thread: point ``linkpath`` at ``filepath`` once its ``saves`` are durable,
    atomically (a symlink made beside it and renamed over it: ``linkpath`` never goes missing).
    If one failed or was skipped, ``linkpath`` keeps naming the checkpoint before."""
    for h in saves:
        why = not_durable(h)
        if why is not None:
            log.warning("fastckpt: %s still names the checkpoint before: the save of %s it was to name %s",
                        linkpath, filepath, why)
            return
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        shutil.rmtree(linkpath)
    tmp = tmp_name(linkpath)
    try:
        os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
    except OSError:  # no symlinks here (Windows without the privilege): a copy, as Lightning's fallback
        shutil.copy(filepath, tmp)
    try:
        os.replace(tmp, linkpath)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def not_durable(handle: SaveHandle) -> str | None:
    """Why ``handle``'s save did not leave a file at its path (waiting for it), or None if it did."""
    try:
        rec = handle.result()  # not wait(): its failure stays the training thread's to raise once
    except CancelledError:
        return "was never written (the Checkpointer stopped first)"
    except BaseException as exc:  # noqa: BLE001 (reported as the reason; raised once elsewhere)
        return f"failed ({type(exc).__name__}, raised on the training thread)"
    if rec.skipped:
        return "was skipped (when_busy='skip')"
    if rec.cancelled:
        return "was deleted before it was replicated"
    return None
