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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from typing import Any

from fastckpt.checkpointer import Checkpointer
from fastckpt.commit.reports import SaveReports
from fastckpt.commit.store import default_store
from fastckpt.io.atomic import tmp_name
from fastckpt.records import SaveHandle
from fastckpt.urls import is_url, normalize

from .lasts import FLUSH, LastFiles, named_files
from .saves import SaveLedger, StepSave, state_nbytes

log = logging.getLogger("fastckpt.lightning")

#: The key of a queued link (``_link_later``) among the queued removals.
LINK = "link:"
#: Strategies whose rank 0 does not hold the whole state in its own tensors.
SHARDED_STRATEGIES = {"FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"}
#: Added to the tensors' bytes when reserving: Lightning's metadata (loops, callbacks, hparams)
#: and the pickle around the tensors. The core adds its own headroom on top.
RESERVE_MARGIN = 1 << 20


def filed_under(key: str) -> str:
    """The key ``TrainerLink._file`` was given, from the one it tracks a future under."""
    head, _, n = key.rpartition(" #")
    return head if head and n.isdigit() else key


class TrainerLink:
    """The part of ``FastCkptIO`` that keeps its books and talks to the Trainer."""

    _ck: Checkpointer | None
    _saves: SaveLedger
    _removals: dict[str, Future]
    _deferred: dict[str, Checkpointer]  # path -> its Checkpointer: deletions waiting for a link to move off them
    _links: dict[str, list[tuple[SaveHandle, str]]]  # linkpath -> queued links (target's save, target), oldest first
    _links_lock: threading.Lock
    _lasts: LastFiles  # ModelCheckpoint(save_last=True)'s last saves and the deletions they hold (``lasts``)
    _link_dirs: tuple[str, ...] = ()  # folders a link may sit in, away from the file it names (``_note_links``)
    _trainer_ref: Callable[[], Any] | None
    _callback: object
    _in_fit: bool
    _was_connected: bool
    _reports: SaveReports | None  # this fit's, with several ranks: rank 0's saves told to the others
    _crashed: bool
    _reserved: bool
    _sharded: bool

    def _checkpointer(self) -> Checkpointer:
        raise NotImplementedError  # FastCkptIOMixin builds it

    def _config(self) -> Any:
        raise NotImplementedError  # FastCkptIOMixin: the given Checkpointer's, else its own

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
        self._step_save.close()  # after the fence: a lazy copy's wait is blocked time of its step's save

    def _in_flight(self, path: str | os.PathLike) -> bool:
        """Whether a save to ``path`` has not finished yet (its file may not exist)."""
        return any(not t.handle.done() for t in self._saves.to(normalize(os.fspath(path))))

    def _names_a_deleted_file(self, path: str | os.PathLike) -> bool:
        """The training thread: whether ``path`` is a link (``last.ckpt`` of ModelCheckpoint(save_last="link"))
        to a file whose deletion Lightning asked for and that is still there: queued, or waiting for
        the link to move off it (``_delete``). With TorchCheckpointIO that file is gone and the link
        dangles, so ModelCheckpoint finds no file at ``path`` and links ``path`` itself anew, which
        moves the link off the file and lets its deletion run. Seen as a file, it would make
        ModelCheckpoint link ``last-v1.ckpt`` instead (a resumed fit's first link): ``path`` would
        never move again and the file it names would be kept for good."""
        p = os.fspath(path)
        if is_url(p) or not os.path.islink(p):
            return False
        # the queued deletions first: one that ends meanwhile is in ``_deferred`` before its future is done
        queued = [filed_under(k) for k, f in list(self._removals.items()) if not f.done()]
        pending = [q for q in (*queued, *list(self._deferred)) if q != FLUSH and not q.startswith(LINK)]
        target = os.path.realpath(p)
        return any(os.path.realpath(q) == target for q in pending)

    def _remove_after(self, ck: Checkpointer, path: str, saves: list[SaveHandle],
                      mark: dict[str, int] | None = None) -> None:
        """The remover thread: delete ``path`` once ``saves`` (``SaveLedger.before_removal``) are all
        durable. If one failed, was skipped or never reached its path (``not_durable``), Lightning
        counts a checkpoint that does not exist, and ``path`` may be the only good one left: keep
        it (a WARNING says so). Not an error: the failed save's own error is raised once, by the
        training thread. One whose upload was dropped for a newer save (last.ckpt's, while uploads
        run behind on a burst buffer without hard links: ``save.versions``) is older than those
        after it here: they stand for it. With ModelCheckpoint(save_last=True) on a burst buffer, a
        file the last file at its path names (``lasts``; ``mark``: as the deletion was asked for)
        is parked until a newer last file lands (``_flush``)."""
        for i, h in enumerate(saves):
            if i + 1 < len(saves) and dropped_for_newer(h):
                continue
            why = not_durable(h, self._saves.after)
            if why is not None:
                log.warning("fastckpt: kept %s although Lightning asked to delete it: the save of %s before it %s, "
                            "so deleting it could leave no checkpoint. Delete it yourself once a newer checkpoint "
                            "is durable.", path, h.path, why)
                return
        held = self._lasts.holders(path, mark) if mark else {}
        if held:  # ModelCheckpoint(save_last=True): the last file at its path names it (``lasts``)
            self._lasts.park(ck, path, {key: mark[key] for key in held})  # (the deletions queued after go on)
            return
        self._delete(ck, path)

    def _flush(self, final: bool = False) -> None:
        """The remover thread: the parked deletions (``lasts``) that a newer last file let go run;
        ``final`` (teardown): once every save has ended, each one, or it is kept with a WARNING
        while the newest last file at its path still names it."""
        if final:
            for h in self._lasts.handles():
                with contextlib.suppress(BaseException):  # (failures are the training thread's to raise)
                    h.result()
        for ck, path, mark in self._lasts.take(final):
            try:
                held = self._lasts.holders(path, mark) if mark else {}
                if held:
                    log.warning("fastckpt: kept %s although Lightning asked to delete it: %s, the last file at its "
                                "path, names it (no newer one landed). Delete it yourself once a newer checkpoint "
                                "is durable.", path, ", ".join(sorted(held.values())))
                    continue
                self._delete(ck, path)
            finally:
                self._lasts.done(path)

    def _queue_flush(self) -> None:
        """The training thread: a run of the parked deletions a newer last file let go, unless one is queued."""
        prev = self._removals.get(FLUSH)
        if self._in_fit and self._lasts.ready() and (prev is None or prev.done()):
            self._file(FLUSH, self._queue(self._flush))

    def _unpark(self, path: str) -> None:
        """The training thread, before a save to ``path``: its parked deletion is off; one a run is
        doing now ends first (the remover runs in turn: the newest run queued)."""
        fut = self._removals.get(FLUSH) if self._lasts.unpark(path) else None
        if fut is not None:
            wait_futures([fut])

    def _read_last(self, path: str, key: str) -> frozenset[str]:
        """The remover thread: what the state ``key`` in the last file at ``path`` itself names (not its
        burst-buffer copy), from its pickle only (``commit.foreign.pickle_plain``: a few ranged reads,
        no tensor data). Nothing for a file that is not there or cannot be read: it holds nothing back."""
        from fastckpt.commit.foreign import pickle_plain
        from fastckpt.storage.homes import Homes

        homes = Homes(self._config().storage_options)
        try:
            loc = homes.resolve(path)
            plain, why = pickle_plain(loc.target, loc.key), "not a whole torch.save file"
        except FileNotFoundError:
            return frozenset()
        except Exception as exc:  # noqa: BLE001 (not raised: it only holds nothing back)
            plain, why = None, repr(exc)
        finally:
            homes.close()
        if plain is None:
            log.info("fastckpt: could not read %s, the last file there when the fit began (%s): it holds no top-k "
                     "file back", path, why)
            return frozenset()
        return named_files(plain, key)

    def _delete(self, ck: Checkpointer, path: str) -> None:
        """The remover thread: delete ``path`` now, unless a ``save_last="link"`` link names it."""
        for linkpath in list(self._links):  # last.ckpt may name path: move it on first (it is queued after)
            self._relink(linkpath, None)
        if named_by_link(path, self._link_dirs):  # ModelCheckpoint asks to delete before it links anew: a kill
            self._deferred[path] = ck  # in between left last.ckpt dangling, so the deletion waits for the link to move
            return
        link = not is_url(path) and os.path.islink(path)  # a templated last name's previous link
        ck.remove(path, whole=True)  # Lightning's own name for one checkpoint (see FastCkptIO.remove_checkpoint)
        if link:  # the file it named may have waited for it
            self._remove_deferred()

    def _moved(self, linkpath: str) -> None:
        """Lightning moved ``linkpath`` itself (to a file this fit did not save, e.g. FSDP's sharded
        directories): the deletions that waited for it run on the remover thread, after any queued."""
        self._note_links(linkpath)
        if self._deferred or self._removals:
            self._file(LINK + normalize(linkpath) + " (moved)", self._queue(self._remove_deferred))

    def _remove_deferred(self) -> None:
        """Delete the files whose deletion waited for a link to move off them, where none names them now."""
        for path in [p for p in list(self._deferred) if not named_by_link(p, self._link_dirs)]:
            ck = self._deferred.pop(path, None)  # (None: a new save to path took it back meanwhile)
            if ck is not None:
                ck.remove(path, whole=True)

    def _link_later(self, trainer: Any, filepath: str, linkpath: str) -> bool:
        """ModelCheckpoint(save_last="link") links ``linkpath`` to ``filepath`` right after asking
        for its save. If this fit saved ``filepath`` (in flight, or done: durable, skipped or
        failed), queue the link on the remover thread (in order with the removals) and return True:
        ``linkpath`` keeps its old target until that save is durable, and for good if it is not.
        Lightning's own link (False) is only for a file this fit did not save, which exists."""
        self._note_links(linkpath)
        if not self._in_fit or not trainer.is_global_zero or os.path.abspath(filepath) == os.path.abspath(linkpath):
            return False  # the same file (last.ckpt saved whole, then "linked" to itself): Lightning skips it
        save = self._saves.newest.get(normalize(os.fspath(filepath)))
        if save is None:
            return False
        entry = (save, os.fspath(filepath))
        with self._links_lock:
            self._links.setdefault(linkpath, []).append(entry)
        self._file(LINK + normalize(linkpath), self._queue(self._relink, linkpath, entry))
        return True

    def _relink(self, linkpath: str, upto: tuple[SaveHandle, str] | None) -> None:
        """The remover thread: make the links queued for ``linkpath``, oldest first, so it ends
        at the newest durable target: up to ``upto`` (waiting for each save), or (None) those
        whose saves are done already. One whose save is not durable is passed over (a WARNING)."""
        while True:
            with self._links_lock:
                queued = self._links.get(linkpath, [])
                if not queued or (upto is not None and all(e is not upto for e in queued)):
                    return  # made already (by a removal, which moves links first)
                entry = queued[0]
            if upto is None and not entry[0].done():
                return
            _link_after(entry[0], entry[1], linkpath, self._saves.after)
            self._remove_deferred()
            with self._links_lock:
                queued.pop(0)
                if not queued:
                    del self._links[linkpath]
            if entry is upto:
                return

    def _note_links(self, *linkpaths: str) -> None:
        """The training thread: add the folders of ``linkpaths`` and each ModelCheckpoint's dirpath
        (where its ``last.ckpt`` is) to those ``named_by_link`` scans besides a file's own: a
        filename with a "/" ("{epoch}/{step}") puts the top-k files in a subfolder, below the link
        that names them. The dirpaths cover a resumed fit's first deletion, asked for before any
        link. A new tuple each time: the remover thread reads it without a lock."""
        trainer = self._trainer()
        dirs = [os.path.dirname(os.path.abspath(p)) for p in map(os.fspath, linkpaths) if not is_url(p)]
        for cb in getattr(trainer, "checkpoint_callbacks", None) or ():
            d = getattr(cb, "dirpath", None)
            if isinstance(d, (str, os.PathLike)) and not is_url(os.fspath(d)):
                dirs.append(os.path.abspath(d))
        new = [d for d in dict.fromkeys(dirs) if d not in self._link_dirs]
        if new:
            self._link_dirs = (*self._link_dirs, *new)

    def _queue(self, fn: Callable[..., None], *args: Any) -> Future:
        raise NotImplementedError  # FastCkptIOMixin runs it on its remover thread

    def _file(self, key: str, fut: Future) -> None:
        """Track ``fut`` under ``key``. One queued earlier under that key and not yet harvested stays
        tracked (under ``key #n``, which ``filed_under`` reads back): its failure is still raised, at
        the next save or at teardown."""
        old = self._removals.get(key)
        if old is not None:
            self._removals[f"{key} #{id(old)}"] = old
        self._removals[key] = fut

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
        self._was_connected = True  # a save after fit (``_disconnect``) is no unconnected plugin's
        # a save outside fit (validate, test, predict) is synchronous: no teardown hook flushes
        # there under every strategy (FSDPStrategy's never calls CheckpointIO.teardown)
        fitting = str(getattr(trainer.state.fn, "value", "fit")) == "fit"
        self._in_fit, self._crashed, self._reserved = fitting, False, False
        # a collective, as every rank sets up: the others learn rank 0's number for this fit
        self._reports = SaveReports.agree(default_store(), trainer.is_global_zero,
                                          lambda n: trainer.strategy.broadcast(n, src=0)) \
            if fitting and trainer.world_size > 1 else None
        self._link_dirs = ()  # this fit's ModelCheckpoints and links (``_note_links``)
        self._saves.newest.clear()  # the saves of this fit only
        self._step_save.close()
        self._step_save = StepSave()  # this thread runs the fit: its saves of one step are one save
        self._lasts = LastFiles(self._read_last, bool(self._config().local_dirs))  # this fit's (``lasts``)
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
        self._queue_flush()  # parked deletions a last file that landed since let go (``lasts``)
        for row in self._saves.drain_rows():
            for lg in trainer.loggers:
                lg.log_metrics(row, step=trainer.global_step)

    def _wait_for_rank0(self, trainer: Any) -> None:
        """After an exception, on a rank that does not save: rank 0's saves that returned are
        still being written (its training thread is stuck in a collective this rank left), and
        once this rank exits the launcher kills rank 0 within seconds. Stay until they have ended,
        up to close_timeout_s (``commit.reports``, docs/lightning.md)."""
        if self._reports is not None and not trainer.is_global_zero:
            self._reports.wait(self._config().close_timeout_s)

    def _disconnect(self, callback: object) -> None:
        if self._callback is callback:
            self._callback = None
            self._trainer_ref = None


def named_by_link(path: str, folders: Iterable[str] = ()) -> bool:
    """Whether a symlink beside ``path``, or in one of ``folders``, names it (``last.ckpt`` of
    ModelCheckpoint(save_last="link"), in its dirpath: above ``path`` if the filename has a "/").
    Never a link itself (a templated last name's previous link): deleting it deletes only the link."""
    if is_url(path) or os.path.islink(path):
        return False
    target = os.path.realpath(path)
    for folder in dict.fromkeys((os.path.dirname(os.path.abspath(path)), *folders)):
        try:
            with os.scandir(folder) as entries:
                if any(e.is_symlink() and os.path.realpath(e.path) == target for e in entries):
                    return True
        except OSError:  # the folder is gone (or was never made): no link there
            continue
    return False


def _link_after(save: SaveHandle, filepath: str, linkpath: str,
                after: Callable[[SaveHandle], SaveHandle | None]) -> None:
    """The remover thread: point ``linkpath`` at ``filepath`` once its ``save`` is durable,
    atomically (a symlink made beside it and renamed over it: ``linkpath`` never goes missing).
    If it failed or was skipped, ``linkpath`` keeps naming the checkpoint before."""
    why = not_durable(save, after)
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


def dropped_for_newer(handle: SaveHandle) -> bool:
    """Whether the replicator dropped ``handle``'s upload for a newer save (waiting for it)."""
    try:
        return handle.result().superseded
    except BaseException:  # noqa: BLE001 (not dropped: ``not_durable`` reports it)
        return False


def not_durable(handle: SaveHandle, after: Callable[[SaveHandle], SaveHandle | None]) -> str | None:
    """Why ``handle``'s save did not leave a file at its path (waiting for it), or None if it did.
    One the replicator dropped for a newer save to the same path (it does under any
    replicate_policy) is as durable as the next save there (``after``), and so on. Not the newest
    save there: with uploads behind, that one is always last in their queue."""
    start = handle
    while True:
        try:
            rec = handle.result()  # not wait(): its failure stays the training thread's to raise once
        except CancelledError:
            return "was never written (the Checkpointer stopped first)"
        except BaseException as exc:  # noqa: BLE001 (reported as the reason; raised once elsewhere)
            return f"failed ({type(exc).__name__}, raised on the training thread)"
        if rec.skipped and handle is start:  # (a later one, skipped, dropped nothing: the one after it did)
            return "was skipped (when_busy='skip')"
        if rec.cancelled:
            return "was deleted before it was replicated"
        if not rec.superseded and rec.durable_s is not None:
            return None
        newer = after(handle)
        if newer is None:
            return ("was dropped from the replication queue for a newer checkpoint (the Checkpointer's "
                    "replicate_policy='coalesce'): only its burst-buffer copy exists")
        handle = newer
