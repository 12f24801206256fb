"""The callback that connects a FastCkptIO to its Trainer (see ``plugin.py``).

Lightning gives a CheckpointIO no way to reach its Trainer, so this callback does it: fastckpt's
``callbacks_factory`` entry point adds one to every Trainer built while a FastCkptIO exists.
Every hook runs on the training thread; a Trainer without a FastCkptIO is left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastckpt.errors import ConfigError

from .options import refuse_keep_persistent, refuse_url_without_local_dir
from .plugin import FastCkptIOMixin

log = logging.getLogger("fastckpt")


class FastCkptCallbackMixin:
    """Connects a ``FastCkptIO`` to its Trainer: metrics to the loggers, the lazy-snapshot
    fence, DeepSpeed's engine, reserving the staging buffer after the first optimizer step.
    Added by fastckpt's ``callbacks_factory`` entry point; add it yourself
    (``callbacks=[FastCkptCallback()]``) only where that entry point is not installed.
    A Trainer without a FastCkptIO is left alone. It adds nothing to checkpoints."""

    def _io(self, trainer: Any) -> FastCkptIOMixin | None:
        io = trainer.strategy.checkpoint_io
        inner = getattr(io, "checkpoint_io", None)
        if not isinstance(io, FastCkptIOMixin) and isinstance(inner, FastCkptIOMixin):
            raise ConfigError(
                f"{type(inner).__name__} is wrapped in {type(io).__name__}: pass it directly, "
                f"Trainer(plugins=[{type(inner).__name__}(...)]). It is already asynchronous; the wrapper "
                "would clone every tensor on the training thread and its teardown does not pass teardown on, "
                "so pending saves would not be flushed.")
        if isinstance(io, FastCkptIOMixin) and io._callback is self:
            return io
        return None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        self._io(trainer)  # raises for a wrapped FastCkptIO
        if isinstance(io, FastCkptIOMixin) and trainer.checkpoint_callbacks:
            config = io._given.config if io._given is not None else io.config
            refuse_keep_persistent(config)
            if stage == "fit":  # where ModelCheckpoint saves: refused now, not after steps at the first save
                dirs = [checkpoint_dir(cb, trainer) for cb in trainer.checkpoint_callbacks]
                refuse_url_without_local_dir(config, dirs)
        if isinstance(io, FastCkptIOMixin) and io._connect(trainer, self):
            self._run_first(trainer)
            self._count_saves_in_flight(trainer, io)

    def _run_first(self, trainer: Any) -> None:
        """Lightning calls each hook on the callbacks in ``trainer.callbacks`` order, then on the
        module. This callback goes first, so its lazy-snapshot fences run before any other
        callback's hook of a phase can change the weights in place (StochasticWeightAveraging and
        WeightAveraging copy the averaged weights in at ``on_train_end``, EMA callbacks swap them
        in for validation). Lightning is iterating that list to call ``setup`` right now: moving
        the callback being called to the front leaves every other callback's turn as it was."""
        callbacks = trainer.callbacks
        if callbacks and callbacks[0] is not self:
            callbacks.remove(self)
            callbacks.insert(0, self)

    def _count_saves_in_flight(self, trainer: Any, io: FastCkptIOMixin) -> None:
        """Each ModelCheckpoint asks its public ``file_exists`` before it picks a version suffix
        (``name-v1.ckpt``...), and links ``last.ckpt`` with ``_link_checkpoint``
        (``save_last="link"``). A save in flight has no file yet: its name would be reused (a
        checkpoint the user asked to keep replaced), and the link would name a file that is not
        there (a kill, or a failed or skipped save, then leaves ``last.ckpt`` dangling and
        ``ckpt_path="last"`` starts over). So ``file_exists`` also counts the plugin's saves in
        flight (decided on rank 0, which saves, and reduced across ranks like Lightning's own
        answer), and the link waits for its target's save (``TrainerLink._link_later``). A link
        whose file Lightning asked to delete is not there for ``file_exists``, as with
        TorchCheckpointIO (``TrainerLink._names_a_deleted_file``): it is linked anew. Both ask
        the Trainer's CheckpointIO when called, so a wrapper a crashed fit left behind serves the
        next Trainer's plugin; ``teardown`` and ``on_exception`` restore the methods."""
        self._wrapped = getattr(self, "_wrapped", [])
        for cb in trainer.checkpoint_callbacks:
            original, link = getattr(cb, "file_exists", None), getattr(cb, "_link_checkpoint", None)
            if original is None or getattr(original, "_fastckpt", False):
                continue

            def file_exists(filepath: Any, trainer: Any, _original: Any = original) -> bool:
                io = trainer.strategy.checkpoint_io
                exists = bool(_original(filepath, trainer))  # every rank's answer: rank 0's, reduced
                if isinstance(io, FastCkptIOMixin) and trainer.is_global_zero:
                    exists = io._in_flight(filepath) or (exists and not io._names_a_deleted_file(filepath))
                return bool(trainer.strategy.reduce_boolean_decision(trainer.is_global_zero and exists, all=False))

            def link_checkpoint(trainer: Any, filepath: str, linkpath: str, _original: Any = link) -> None:
                io = trainer.strategy.checkpoint_io
                if isinstance(io, FastCkptIOMixin) and io._link_later(trainer, filepath, linkpath):
                    trainer.strategy.barrier()  # as Lightning's own, on every rank
                else:
                    _original(trainer, filepath, linkpath)
                    if isinstance(io, FastCkptIOMixin) and io._in_fit and trainer.is_global_zero:
                        io._moved(linkpath)  # deletions that waited for the link to move off a file

            file_exists._fastckpt = True  # type: ignore[attr-defined]
            cb.file_exists = file_exists
            if link is not None:
                link_checkpoint._fastckpt = True  # type: ignore[attr-defined]
                cb._link_checkpoint = link_checkpoint
            self._wrapped.append(cb)

    def _unwrap(self) -> None:
        for cb in getattr(self, "_wrapped", []):
            for name in ("file_exists", "_link_checkpoint"):
                if getattr(cb.__dict__.get(name), "_fastckpt", False):
                    delattr(cb, name)  # the class's own method again
        self._wrapped = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        io = self._io(trainer)
        if io is not None and trainer.is_global_zero:
            io._lasts.start(trainer)  # the last files at their paths now: a resumed fit's callbacks are restored
        if io is not None and "DeepSpeedStrategy" in (c.__name__ for c in type(trainer.strategy).__mro__):
            io._install_deepspeed(trainer)

    def _fence(self, trainer: Any) -> None:
        io = self._io(trainer)
        if io is not None:
            io._fence()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._fence(trainer)  # the lazy copy overlaps the step's forward and backward, no more

    # Any other phase after a save may change the weights in place before the next optimizer step
    # (another callback's or the module's hooks): fence first, before them (``_run_first``).
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._fence(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._fence(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._fence(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        io = self._io(trainer)
        if io is not None:
            if trainer.global_step >= 1:  # the optimizer state exists now: its size is known
                io._reserve(trainer)
            io._log_metrics(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._fence(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        io = self._io(trainer)
        if io is not None:
            io._crashed = True
            # Flush now (failures are logged, not raised): not every strategy's teardown calls
            # CheckpointIO.teardown (Lightning 2.6's FSDPStrategy does not). A second teardown
            # by the strategy finds nothing left to do. Lightning calls no teardown hook after
            # an exception: the ModelCheckpoints get their own methods back here.
            io.teardown()
            self._unwrap()
            try:
                io._log_metrics(trainer)  # the rows of the saves that teardown just finished
            except Exception as exc:  # noqa: BLE001 (never hide the exception that stopped training)
                log.error("fastckpt: could not log the last checkpoints' metrics: %r", exc)
            try:  # another rank than 0: rank 0's saves in flight end before this rank's exit has it killed
                io._wait_for_rank0(trainer)
            except Exception as exc:  # noqa: BLE001 (never hide the exception that stopped training)
                log.error("fastckpt: could not wait for rank 0's checkpoint saves: %r", exc)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        io = self._io(trainer)
        if io is not None:
            if io._in_fit:  # the strategy's teardown did not reach CheckpointIO.teardown (FSDPStrategy)
                io.teardown()
            io._log_metrics(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._unwrap()
        io = self._io(trainer)
        if io is not None:
            if io._in_fit:  # a teardown that did not reach CheckpointIO.teardown (FSDPStrategy): flush now
                io.teardown()
            io._disconnect(self)


def checkpoint_dir(cb: Any, trainer: Any) -> str:
    """Where ``cb`` (a ModelCheckpoint) saves: its ``dirpath``, or, before its own setup has set
    that, where that setup puts it (below the first logger's ``save_dir``, else below
    ``default_root_dir``, which is all a URL check needs)."""
    dirpath = getattr(cb, "dirpath", None)
    if dirpath is None:
        save_dir = trainer.loggers[0].save_dir if trainer.loggers else None
        dirpath = save_dir if save_dir is not None else trainer.default_root_dir
    return os.fspath(dirpath)
