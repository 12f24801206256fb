"""The Lightning plugin's logic, written once for both builds of Lightning.

Lightning ships the same classes twice (``lightning.pytorch`` and ``pytorch_lightning``) and a
Trainer of one rejects a plugin built on the other, so the plugin (here) and its callback
(``callback.py``) are mixins that import neither package; ``build`` (``__init__.py``) combines
them with a package's ``CheckpointIO`` and ``Callback`` for ``lightning.py`` and
``pytorch_lightning.py``. ``link.py`` keeps the books of the saves in flight and answers the
callback; ``options.py`` checks what the plugin is given.

Who calls what (everything runs on the training thread; only global rank 0 saves and removes):

  Trainer(plugins=[io])          the strategy holds ``io``. fastckpt's ``callbacks_factory``
                                 entry point adds one ``FastCkptCallback`` to every Trainer built
                                 while a FastCkptIO exists: the plugin's only way to the Trainer
  callback.setup                 connects ``io`` to the Trainer; rejects a wrapped FastCkptIO
  callback.on_fit_start          DeepSpeedStrategy: installs fastckpt's engine on deepspeed_engine
  io.save_checkpoint             Checkpointer.save, returns after the snapshot (lazy: earlier)
  callback.on_before_optimizer_step   lazy snapshot: Checkpointer.fence(); also in on_train_epoch_start
                                 and _end, on_validation_start, on_train_end, where the callback
                                 runs first (moved to the front of trainer.callbacks in setup)
  callback.on_train_batch_end    after the first optimizer step (rank 0): Checkpointer.reserve, so
                                 the staging buffer is allocated off the training thread; logs
                                 finished saves' ``ckpt/*`` metrics to trainer.loggers
  io.remove_checkpoint           queued; runs once every save to that path is durable (save_last=True
                                 on a burst buffer: and a last file naming it was replaced: lasts.py)
  io.teardown   (strategy)       waits for every save and removal, raises the first error once
                                 (the callback calls it in on_fit_end where the strategy did not:
                                 Lightning 2.6's FSDPStrategy.teardown skips CheckpointIO.teardown;
                                 and in on_exception, so a crash under any strategy flushes)
  callback.on_exception          (after that flush) a rank other than 0 waits until rank 0's saves
                                 have ended (told through the store: fastckpt.commit.reports), as
                                 its exit has the launcher kill rank 0
  callback.on_fit_end            logs the remaining saves' metrics (before loggers finalize)

Policy (tiers, budgets, retries, ordering of a save and a removal of the same path) belongs to
the core; this module translates Lightning's calls and reports what the core measured.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from fastckpt.checkpointer import Checkpointer
from fastckpt.errors import ConfigError
from fastckpt.exits import stop_pools
from fastckpt.monitor import OverheadReport, Stats
from fastckpt.urls import is_url, normalize

from .lasts import FLUSH, LastFiles
from .link import LINK, TrainerLink, filed_under
from .options import checkpointer_config, is_requeue_checkpoint, parse_storage_options
from .saves import SaveLedger, StepSave, copy_unfenced_tensors

log = logging.getLogger("fastckpt.lightning")


class FastCkptIOMixin(TrainerLink):
    """A Lightning ``CheckpointIO`` whose saves return after a snapshot (docs/lightning.md).

    ``Trainer(plugins=[FastCkptIO(local_dir="/local_nvme/ckpt")])``: keep ``ModelCheckpoint``;
    the path it passes (its dirpath) is where each checkpoint becomes durable, ``local_dir`` the
    optional burst buffer it lands in first. Files are plain ``torch.save`` zips.

    Args:
        local_dir: node-local burst buffer (see ``fastckpt.Checkpointer``); None writes straight
            to the checkpoint path.
        lazy_snapshot: copy parameters and optimizer state while the next step's forward and
            backward run, blocking in ``on_before_optimizer_step`` (or, first, when an epoch ends
            or starts, validation starts or training ends); other tensors, such as BatchNorm
            buffers that forward updates, are copied at once. Needs the callback (installed
            automatically) and a training step that does not modify parameters or optimizer
            state in place outside the optimizer step.
        staging_buffers: host copies of the checkpoint the saves may use at once (1 to 4; see
            ``fastckpt.Checkpointer``). None (default): 2 when a ``ModelCheckpoint`` has
            ``save_last=True`` (it saves the same state twice in one step, and the second save
            would otherwise wait for the first one's write), else 1.
        checkpointer: an existing ``fastckpt.Checkpointer`` to use instead; then no other option
            may be given. FastCkptIO waits for it but does not close it, and warns if it has a
            ``local_dir`` without ``replicate_policy="all"`` (below).
        **options: any other ``fastckpt.Checkpointer`` option (``tier``, ``overhead_budget``,
            ``event_log``, ``when_busy``, ``storage_options`` for a URL dirpath, ``keep_local``,
            ...): each is defined once, in ``fastckpt.config.CheckpointerConfig``.
            ``replicate_policy`` defaults to "all" here: Lightning expects every path it saved
            (top-k, last) to exist.
    """

    _PACKAGE = ""  # "lightning" or "pytorch_lightning": set by the concrete class
    _OTHER_BUILD = ""  # the import path of the build for the other package
    _live: weakref.WeakSet

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._live = weakref.WeakSet()

    def __init__(self, local_dir: str | None = None, *, lazy_snapshot: bool = False,
                 staging_buffers: int | None = None, checkpointer: Checkpointer | None = None,
                 **options: object) -> None:
        super().__init__()
        if checkpointer is not None:
            if not isinstance(checkpointer, Checkpointer):
                raise TypeError(f"checkpointer must be a fastckpt.Checkpointer, got {type(checkpointer).__name__}")
            given = [n for n, v in (("local_dir", local_dir), ("staging_buffers", staging_buffers)) if v is not None]
            if given or options:
                raise ConfigError(f"FastCkptIO(checkpointer=...) uses that Checkpointer's settings; do not also "
                                  f"pass {', '.join(given + sorted(options))} (set them on the Checkpointer)")
            if checkpointer.config.local_dirs and checkpointer.config.replicate_policy != "all":
                # a warning, not an error: FastCkptIO(replicate_policy="coalesce") is allowed too
                policy = checkpointer.config.replicate_policy
                warnings.warn(f"fastckpt: the Checkpointer given to FastCkptIO has a local_dir and replicate_policy="
                              f"{policy!r} (the core's default): when uploads fall behind it replicates only the "
                              "newest checkpoint, so files ModelCheckpoint saved (top-k, last.ckpt) may never reach "
                              "their path, and the older files they were to replace are kept instead. Build it with "
                              "Checkpointer(..., replicate_policy='all'), as FastCkptIO does when it builds its own.",
                              UserWarning, stacklevel=2)
            if checkpointer.config.local_dirs and not checkpointer.config.replicate_in_order:
                warnings.warn("fastckpt: the Checkpointer given to FastCkptIO has a local_dir and replicate_in_order="
                              "False (the core's default): a later file (last.ckpt) can reach its path before an "
                              "earlier one (the top-k file it names), and ckpt_path='last' picks by mtime. Build it "
                              "with Checkpointer(..., replicate_in_order=True), as FastCkptIO does when it builds "
                              "its own.", UserWarning, stacklevel=2)
        if not isinstance(lazy_snapshot, bool):  # "false" would turn it on
            raise ConfigError(f"lazy_snapshot={lazy_snapshot!r} must be True or False")
        options.setdefault("replicate_policy", "all")
        options.setdefault("replicate_in_order", True)  # saves final in call order, as TorchCheckpointIO's
        # validated now: a bad option should fail where the Trainer is built, not at the first save
        self.config = checkpointer_config(local_dir=local_dir,
                                          staging_buffers=1 if staging_buffers is None else staging_buffers,
                                          **options)
        self._options = options
        self.local_dir, self.lazy_snapshot, self.staging_buffers = local_dir, lazy_snapshot, staging_buffers
        self._given = checkpointer
        self._ck: Checkpointer | None = checkpointer
        self._reset_runtime()
        type(self)._live.add(self)

    def _reset_runtime(self) -> None:
        self._saves = SaveLedger()
        self._step_save = StepSave()
        self._removals, self._deferred = {}, {}
        self._links, self._links_lock = {}, threading.Lock()
        self._lasts = LastFiles(self._read_last, enabled=False)  # (``_connect`` makes each fit's)
        self._remover: ThreadPoolExecutor | None = None
        self._trainer_ref = None
        self._callback = None
        self._final_stats: Stats | None = None
        self._in_fit = False  # saves may stay in flight until teardown: only while connected (``_connect``)
        self._crashed = False
        self._warned_unconnected = False
        self._was_connected = False  # ever (``_connect``): after fit ``_disconnect`` drops the Trainer
        self._reports = None
        self._reserved = False
        self._sharded = False  # the Trainer's strategy is one of SHARDED_STRATEGIES

    # ------------------------------------------------------------------ plumbing
    def __getstate__(self) -> dict:
        # ddp_spawn pickles the Trainer: threads and Checkpointers are rebuilt in the child
        if self._given is not None:
            raise TypeError("FastCkptIO(checkpointer=...) cannot be pickled (ddp_spawn): pass the settings "
                            "(local_dir=..., tier=...) instead and each process builds its own Checkpointer")
        keep = ("config", "_options", "local_dir", "lazy_snapshot", "staging_buffers")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._given = self._ck = None
        self._reset_runtime()
        type(self)._live.add(self)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(local_dir={self.local_dir!r}, tier={self.config.tier!r}, "
                f"overhead_budget={self.config.overhead_budget!r}, lazy_snapshot={self.lazy_snapshot!r})")

    def __str__(self) -> str:
        # Lightning names the plugin with str() when it rejects one of the other package's types.
        return (f"{self!r} (built for the {self._PACKAGE!r} package; with the other one, use "
                f"`from {self._OTHER_BUILD} import FastCkptIO`)")

    def _checkpointer(self) -> Checkpointer:
        if self._ck is None:
            options = {"on_overhead_exceeded": self._on_overhead, **self._options}
            self._ck = Checkpointer(self.local_dir, staging_buffers=self._staging_buffers(), **options)
        return self._ck

    def _config(self) -> Any:
        return self._given.config if self._given is not None else self.config

    def _staging_buffers(self) -> int:
        if self.staging_buffers is not None:
            return self.staging_buffers
        trainer = self._trainer()
        if trainer is None or not any(getattr(cb, "save_last", None) is True for cb in trainer.checkpoint_callbacks):
            return 1
        # save_last=True saves the same state twice per step; with one buffer the second save
        # would wait for the first one's write on the training thread
        log.info("fastckpt: ModelCheckpoint(save_last=True) saves twice per step: using 2 staging buffers (two "
                 "host copies of the checkpoint) so last.ckpt does not wait for the other file's write; "
                 "FastCkptIO(staging_buffers=1) keeps one")
        return 2

    def latest(self, dirpath: str | os.PathLike) -> str | None:
        """The newest complete checkpoint under ``dirpath`` (a directory or URL, listed with
        this plugin's ``storage_options``), or None: ``trainer.fit(model, ckpt_path=io.latest(url))``
        where Lightning's ``ckpt_path="last"`` cannot find checkpoints (a URL dirpath in
        Lightning 2.6, docs/lightning.md)."""
        from fastckpt import latest

        return latest(os.fspath(dirpath), self.config.storage_options)

    def stats(self) -> Stats | None:
        """The Checkpointer's ``Stats`` (overhead, alarms, ...): live during fit, as of the end of
        the last fit after it, None before any save."""
        return self._ck.stats() if self._ck is not None else self._final_stats

    @property
    def metrics_url(self) -> str | None:
        """Where this process's Prometheus metrics are served during fit (the ``metrics_port``
        option), else None."""
        return self._ck.metrics_url if self._ck is not None else None

    def _on_overhead(self, report: OverheadReport) -> None:
        warnings.warn(f"fastckpt: {report.advice()}", UserWarning, stacklevel=2)

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: object = None) -> None:
        """Snapshot ``checkpoint`` and return; it becomes durable at ``path`` in the background.

        Synchronous (durable at ``path`` on return) outside fit, for ``storage_options={"wait":
        True}``, and for Lightning's SLURM requeue checkpoint (``hpc_ckpt_<N>.ckpt``), after
        which the job is killed.

        Raises:
            ConfigError: ``storage_options`` holds a key FastCkptIO does not understand.
            FastCkptError: a previous save failed in the background (raised once).
        """
        wait = parse_storage_options(storage_options)
        path = os.fspath(path)
        if not wait and is_requeue_checkpoint(path):
            log.info("fastckpt: %s is Lightning's SLURM requeue checkpoint (`scontrol requeue` follows and ends the "
                     "job): waiting until it is durable", path)
            wait = True
        self._settle_removal(path)
        self._deferred.pop(normalize(path), None)  # saved again: a deletion waiting for last.ckpt to move is off
        self._unpark(normalize(path))  # (or for a newer last file: ``lasts``)
        self._raise_removal_errors()
        with self._core() as ck:
            self._save(ck, checkpoint, path, wait)
        self._queue_flush()

    def _save(self, ck: Checkpointer, checkpoint: dict[str, Any], path: str, wait: bool) -> None:
        if not is_url(path):  # as TorchCheckpointIO does: ModelCheckpoint(save_last="link") links into it now
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        trainer = self._trainer()
        unconnected = trainer is None and not self._was_connected and not self._warned_unconnected
        # sharded strategies hand rank 0 a gathered copy: there is nothing to defer
        # and only while training: a save in validation (ModelCheckpoint's on_validation_end) is
        # followed by the module's own on_validation_end, which no callback hook can fence
        lazy = self.lazy_snapshot and trainer is not None and self._in_fit and not wait and not self._sharded \
            and trainer.state.stage == "train"
        t0 = time.monotonic()
        state = copy_unfenced_tensors(checkpoint, trainer.lightning_module.parameters(), trainer.optimizers) \
            if lazy else checkpoint
        mapping = isinstance(checkpoint, Mapping)
        step = checkpoint.get("global_step") if mapping else None
        if self._in_fit and trainer is not None and not wait and mapping:  # top-k and last.ckpt of a step: one save
            self._step_save.join(ck, (checkpoint.get("epoch"), step))
        try:
            handle = ck.save(state, path, lazy=lazy)
        except BaseException as exc:
            self._saves.forget(exc)  # the core raised an earlier save's failure: do not raise it again
            raise
        item = self._saves.add(handle, step if isinstance(step, int) else None, time.monotonic() - t0, lazy)
        if self._reports is not None and self._in_fit:  # told to the other ranks once it ends (``_wait_for_rank0``)
            self._reports.started(handle)
        if self._in_fit and trainer is not None:  # ModelCheckpoint(save_last=True)'s last file? (``lasts``)
            self._lasts.saved(trainer, normalize(path), handle, checkpoint)
        if wait or not self._in_fit:  # outside fit no teardown follows to flush: finish it now
            self._fence()
            self._saves.wait(item)
        self._raise_first(self._harvest())
        if unconnected:  # after the save: under -W error the warning must not cost the checkpoint
            self._warned_unconnected = True
            warnings.warn("fastckpt: FastCkptIO is not connected to a Trainer, so each save and removal finishes "
                          "before it returns, ckpt/* metrics are not logged and lazy_snapshot is off. In a Trainer, "
                          "fastckpt's `callbacks_factory` entry point connects it; without an installed fastckpt, "
                          "add `callbacks=[FastCkptCallback()]` to the Trainer.", UserWarning, stacklevel=2)

    def load_checkpoint(self, path: str | os.PathLike, map_location: object = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load through the core (verified, burst-buffer copy first); waits for a save in flight
        to the same path. ``weights_only=None`` means torch's default, True; ``map_location=None``
        loads to CPU as ``TorchCheckpointIO`` does.

        Returns a new dict and changes nothing else, as ``TorchCheckpointIO``: Lightning loads
        it into the module itself (``load_model_state_dict``), after the ``on_load_checkpoint``
        hooks, which may drop or change keys; and a ``strategy.load_checkpoint`` during fit (to
        inspect an older checkpoint) must not touch the weights being trained."""
        path = os.fspath(path)
        self._settle_removal(path)
        # save_last="link": last.ckpt is a symlink to a file whose save may be in flight
        paths = {normalize(path)} | (set() if is_url(path) else {normalize(os.path.realpath(path))})
        for t in [t for t in self._saves.tracked if t.handle.path in paths]:
            self._saves.wait(t)
        with self._core() as ck:
            return ck.load(path, "cpu" if map_location is None else map_location,
                           weights_only=True if weights_only is None else weights_only)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete ``path`` (and its burst-buffer copy) once any save to it is durable.

        It is kept (with a WARNING) if a save started before the removal, or the one just before
        it, failed or was skipped (``when_busy="skip"``): ModelCheckpoint removes a file after
        saving its replacement, so then ``path`` may be the only good checkpoint.

        During fit it returns at once: the deletion is queued, so removing a checkpoint whose
        save is still in flight neither blocks training nor races the write. A later save to the
        same path waits for the queued deletion first. After fit (no teardown follows) it deletes
        before it returns, as ``TorchCheckpointIO`` does. With ModelCheckpoint(save_last=True) on a
        burst buffer, a file the last file at its path names waits for a newer one to land (``lasts``).

        Lightning names one checkpoint here, whatever it holds (DeepSpeedStrategy's ``epoch=N.ckpt/``
        holds its tag and DeepSpeed's ``latest``): it goes whole (``Checkpointer.remove(whole=True)``),
        as with ``TorchCheckpointIO``, where a user's ``remove()`` of a directory of checkpoints is refused.
        """
        path = normalize(path)
        if not self._in_fit:
            with self._core() as ck:
                ck.remove(path, whole=True)
            return
        ck = self._checkpointer()
        self._note_links()  # the ModelCheckpoints' dirpaths, known by now, where their last.ckpt links are
        prev = self._removals.get(path)
        if prev is not None and not prev.done():
            return
        self._file(path, self._queue(self._remove_after, ck, path, self._saves.before_removal(path),
                                     self._lasts.mark(self._trainer())))

    def _queue(self, fn: Callable[..., None], *args: Any) -> Future:
        """Run ``fn(*args)`` on the remover thread, after what was queued before."""
        if self._remover is None:
            self._remover = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-lightning-remove")
        return self._remover.submit(fn, *args)

    def teardown(self) -> None:
        """Wait for every pending save and removal, each wait up to the Checkpointer's
        ``close_timeout_s`` (None: as long as the storage takes); raise the first failure once.

        With several ranks, every rank then meets at a barrier (the training thread, as in
        Lightning's own teardown), so no rank leaves fit() before rank 0's saves are durable.
        After a crash (Lightning's ``on_exception``) failures are logged instead, so they do not
        hide the exception that stopped training.
        """
        self._in_fit = False
        errors: list[BaseException] = []
        ck = self._ck
        # Every wait is bounded by close_timeout_s (None: as long as the storage takes): Lightning
        # ignores SIGINT while it tears down after a Ctrl-C, so a stalled store must not hold it.
        timeout_s = ck.config.close_timeout_s if ck is not None else None
        self._fence()
        if self._remover is not None:  # parked deletions (``lasts``): after those queued, once every save ended
            self._file(FLUSH, self._queue(self._flush, True))
        removals, self._removals = self._removals, {}
        _, stuck = wait_futures(removals.values(), timeout=timeout_s)
        for key, fut in removals.items():
            path = filed_under(key)
            if fut in stuck:
                log.warning("fastckpt: gave up waiting for the %s (close_timeout_s=%s): the save it waits for is "
                            "still pending", f"link {path[len(LINK):]}" if path.startswith(LINK) else
                            f"deletion of {path}, which may remain", timeout_s)
            elif fut.exception() is not None:
                errors.append(fut.exception())  # type: ignore[arg-type]
        if not stuck:  # a link moved by Lightning itself (a file this fit did not save): what it freed goes now
            try:
                self._remove_deferred()
            except BaseException as exc:  # noqa: BLE001 (collected, raised below)
                errors.append(exc)
            for path in self._deferred:
                log.info("fastckpt: kept %s although Lightning asked to delete it: a link still names it",
                         path)
        if ck is not None:
            try:
                if self._given is None:
                    self._ck = None
                    ck.close()  # waits up to close_timeout_s, stops the workers
                else:
                    ck.wait(timeout_s)
            except BaseException as exc:  # noqa: BLE001 (collected, raised below)
                errors.append(exc)
            errors.extend(self._saves.harvest(ck.stats, keep_rows=self._callback is not None))
            self._final_stats = ck.stats()
        if self._remover is not None:
            stop_pools((self._remover,), wait=not stuck)
            self._remover = None
        trainer = self._trainer()
        if trainer is not None and trainer.world_size > 1 and not self._crashed:
            # Only rank 0 saves, so Lightning's barrier after each save no longer means the file
            # exists: without this one, another rank could leave fit() and read (or resolve
            # ckpt_path="last" to) a checkpoint rank 0 is still writing.
            trainer.strategy.barrier("fastckpt.teardown")
        unique: list[BaseException] = []
        for e in errors:
            if all(e is not u for u in unique):
                unique.append(e)
        if self._crashed:
            for e in unique:
                log.error("fastckpt: a checkpoint operation failed while training was stopping: %r", e)
            return
        self._raise_first(unique)

