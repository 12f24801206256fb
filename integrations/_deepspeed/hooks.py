"""The engine-level half of the DeepSpeed integration: thin wrappers around one engine's public
``save_checkpoint``, ``load_checkpoint`` and ``destroy`` (set on the instance; DeepSpeed's
classes are untouched), and the report of each checkpoint.

Who calls what (every rank, training thread, unless noted):
  save_checkpoint(save_dir, tag, ..., save_latest)
      report the checkpoints that finished since the last call (raises a failed one, once)
      -> rank 0: remove an incomplete earlier attempt at save_dir/tag (a crashed run's
         leftovers; DeepSpeed's barrier right after orders this before any rank's save)
      -> DeepSpeed's save_checkpoint(..., save_latest=False): snapshots, then
         FastCkptEngine.commit, which asks the group commit to move ``latest`` if the caller
         asked for save_latest. DeepSpeed's own plain write of ``latest`` is switched off: it
         would name the tag before its files are durable, and race the commit's atomic one.
  load_checkpoint(load_dir, tag=None, ...)
      wait for this engine's pending saves -> the ranks agree on what they were asked for
      (load_dir, tag, load options: one all-reduce) -> resolve the tag (``resolve_tag``) -> a URL's
      group is read through the burst buffer (downloaded first on a fresh node) -> DeepSpeed's
      load_checkpoint, every file from the one save of the tag published when it began
      (``Checkpointer.reading``; a tag saved again and swapped in meanwhile is loaded again)
  destroy() and interpreter exit: wait for pending saves, report them, close an owned
      Checkpointer.
  engine.optimizer.step()  (lazy snapshot only; ``StepFence``, set on the optimizer instance:
      every optimizer step DeepSpeed takes goes through it, ``engine.step()`` and the pipeline
      engine's ``train_batch`` alike)
      FastCkptEngine.fence: wait for the snapshots of the checkpoints saved since the last
      step -> the optimizer's own step
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import threading
import time
import types
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastckpt import Checkpointer, CheckpointNotFoundError, GroupChangedError, IncompleteCheckpointError
from fastckpt.errors import CheckpointWriteError, ConfigError, CorruptCheckpointError, ReplicationError
from fastckpt.save.fencing import optimizer_tensors

from . import fp32
from .agree import (
    COMMITTED,
    FAILED,
    agree_on_load,
    agree_on_save,
    asked_differently,
    different_loads_error,
    different_tags_error,
    error_on_any_rank,
)
from .compat import LATEST, Store, checked_tag, is_url, normalize, order, pointer_name, same_files
from .engine import OPT_OUT, SAFE_GLOBALS, FastCkptEngine
from .globs import literal_globs
from .preread import preread, reads_optimizer_files
from .rejoin import LoadRejoin
from .resaved import resaved_error, resaved_in_place
from .unsafe import refused_globals, warn_once

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

log = logging.getLogger("fastckpt.deepspeed")
LOAD_TRIES = 3  # loads of a tag that is saved again and swapped in meanwhile, before the error is raised


class OwnedCheckpointer:
    """The Checkpointer the integration made from the config section: created at attach (so the
    overhead clock starts with training), closed by ``destroy()``, made again if saves follow."""

    def __init__(self, options: Mapping[str, object]) -> None:
        self._options = dict(options)
        self._ck: Checkpointer | None = Checkpointer(**self._options)  # type: ignore[arg-type]

    def __call__(self) -> Checkpointer:
        if self._ck is None:
            self._ck = Checkpointer(**self._options)  # type: ignore[arg-type]
        return self._ck

    def close(self) -> None:
        ck, self._ck = self._ck, None
        if ck is not None:
            ck.close()

    @property
    def closed(self) -> bool:
        """Closed, and nothing saved since (which would have made it again)."""
        return self._ck is None


@dataclass(frozen=True)
class CheckpointReport:
    """One committed checkpoint, as rank 0 logs it and writes it to DeepSpeed's monitor."""

    tag: str
    group: str
    samples: int
    stall_s: float  # the training thread inside save_checkpoint (+ a lazy snapshot's fence)
    blocked_s: float  # of which snapshots (fastckpt's blocked time)
    durable_s: float | None  # save_checkpoint called -> every rank's files durable, published
    overhead: float  # fastckpt's blocked time / wall time, over the run

    def events(self) -> list[tuple[str, float, int]]:
        """DeepSpeed monitor events (name, value, step: global samples, as DeepSpeed's own)."""
        rows = [("Checkpoint/fastckpt_stall_s", self.stall_s), ("Checkpoint/fastckpt_blocked_s", self.blocked_s),
                ("Checkpoint/fastckpt_overhead", self.overhead)]
        if self.durable_s is not None:
            rows.append(("Checkpoint/fastckpt_durable_s", self.durable_s))
        return [(name, float(value), self.samples) for name, value in rows]


class StepFence:
    """The optimizer's ``step``, preceded by the lazy snapshot's fence. It is set on the
    optimizer instance as a bound method, so that code wrapping ``step`` in turn (a torch LR
    scheduler built later wraps ``step.__func__``) keeps working."""

    def __init__(self, optimizer: object, fence: Callable[[], float]) -> None:
        self._optimizer, self._fence = optimizer, fence
        self._own = optimizer.__dict__.get("step")  # an instance attribute (an LR scheduler's wrapper), or None
        inner = optimizer.step  # type: ignore[attr-defined]

        def step(opt: object, *args: object, **kwargs: object) -> object:
            if self.active:
                self._fence()
            return inner(*args, **kwargs)

        self.method = types.MethodType(step, optimizer)
        self.active = True

    def install(self) -> None:
        self._optimizer.step = self.method  # type: ignore[attr-defined]

    def remove(self) -> None:
        """Put the optimizer's step back (a wrapper set on top of this one keeps it, inactive)."""
        self.active = False
        if self._optimizer.__dict__.get("step") is self.method:
            if self._own is None:
                del self._optimizer.step  # type: ignore[attr-defined]
            else:
                self._optimizer.step = self._own  # type: ignore[attr-defined]


def fenced_tensors(engine: DeepSpeedEngine) -> list[torch.Tensor]:
    """What only the optimizer step changes: the module's parameters (ZeRO copies its updated
    master weights into them within the step) and the underlying torch optimizer's parameters
    (ZeRO's fp32 partitions) and state."""
    out = list(engine.module.parameters())
    if isinstance(engine.basic_optimizer, torch.optim.Optimizer):
        out.extend(optimizer_tensors(engine.basic_optimizer))
    return out


def _join(root: str, name: str) -> str:
    return posixpath.join(root, name) if is_url(root) else os.path.join(root, name)


def _checksums(manifest: dict | None) -> list:
    """A group manifest's files and their checksums, sorted: the same on every rank for one save."""
    return sorted((k, v.get("checksum")) for k, v in ((manifest or {}).get("files") or {}).items())


def resolve_tag(store: Store, root: str, storage_options: dict | None) -> tuple[str | None, bool]:
    """The tag ``load_checkpoint(root)`` loads, and whether ``root/latest`` lags behind it.

    ``root/latest`` decides when it names a complete checkpoint (or a tag fastckpt never
    wrote: DeepSpeed's own engine's). It can name an incomplete one only after a re-save of
    that tag began; it lags, or is missing, when a crash fell between a group's publication and
    the pointer's move. Then the newest complete group under ``root`` that was saved with
    save_latest wins. Tags saved with ``save_latest=False`` never do: without a ``latest``
    file and any other tag, the answer is None, and DeepSpeed loads nothing, as its own engine.
    """
    return tag_named(store, root, store.pointer(root))


def tag_named(store: Store, root: str, named: str | None) -> tuple[str | None, bool]:
    """``resolve_tag`` when ``root/latest`` was read already and names ``named`` (None: none)."""
    newest = store.newest_group(root)
    cand, cand_m = (newest[0].rsplit("/", 1)[-1], newest[1]) if newest is not None else (None, None)
    if named is None:
        return cand, cand is not None
    named_m = store.manifest(_join(root, named))
    if named_m is None:  # not complete: a plain DeepSpeed tag, or a fastckpt attempt under way
        if store.attempted(_join(root, named)):
            return cand, cand is not None
        written = store.pointer_written(root)  # DeepSpeed's own tag: a group committed after the pointer was
        if cand_m is not None and written is not None and order(cand_m) > written:  # written lost its move
            return cand, True  # (a kill between its manifest and the pointer, the run's first fastckpt save)
        return named, False
    if cand_m is not None and cand != named and order(cand_m) > order(named_m):
        return cand, True
    return named, False


class EngineHooks:
    """The wrappers of one DeepSpeedEngine (see the module docstring)."""

    _stores: tuple[Checkpointer, Store] | None = None  # the current Checkpointer and its Store (see _store)

    def __init__(self, engine: DeepSpeedEngine, fe: FastCkptEngine, owned: OwnedCheckpointer | None,
                 flush_at_exit: bool) -> None:
        self.engine, self.fe, self.owned = engine, fe, owned
        self._save = engine.save_checkpoint  # DeepSpeed's, bound
        self._load = engine.load_checkpoint
        self._destroy = engine.destroy
        self._fence: StepFence | None = None
        self._unglob: Callable[[], None] = lambda: None  # undoes literal_globs (set by install)
        if fe.lazy and engine.optimizer is not None:  # no optimizer: nothing ever changes the weights
            self._fence = StepFence(engine.optimizer, fe.fence)
        self.closed = False
        if flush_at_exit:
            threading._register_atexit(_flush_at_exit, weakref.ref(self))  # noqa: SLF001 (see _flush_at_exit)

    def install(self) -> None:
        self.engine.checkpoint_engine = self.fe
        self.engine.save_checkpoint = self.save_checkpoint
        self.engine.load_checkpoint = self.load_checkpoint
        self.engine.destroy = self.destroy
        self._unglob = literal_globs(self.engine)  # a tag or save_dir holding * ? [ loads its own files
        if self._fence is not None:
            self._fence.install()

    def uninstall(self) -> None:
        """Undo ``install`` (before another attach replaces these hooks)."""
        for name in ("save_checkpoint", "load_checkpoint", "destroy"):
            self.engine.__dict__.pop(name, None)
        self._unglob()
        if self._fence is not None:
            self._fence.remove()
        if self._stores is not None:
            self._stores[1].close()
            self._stores = None

    @property
    def _rank0(self) -> bool:
        return self.engine.global_rank == 0

    def _store(self) -> Store:
        """The Store of the current Checkpointer, with its settings, made once: a Store made for
        each call took an S3 outage at a save's first request (rank 0's listing of the tag) for a
        wrong endpoint and raised at once, and retried for the default deadline, not the
        configured ``retry_deadline_s``."""
        ck = self.fe.checkpointer
        if self._stores is None or self._stores[0] is not ck:  # an owned Checkpointer made again after destroy()
            if self._stores is not None:
                self._stores[1].close()
            self._stores = (ck, Store(ck.config.storage_options, retry_deadline_s=ck.config.retry_deadline_s))
        return self._stores[1]

    def _where(self, home: str) -> tuple[str, tuple[str, str] | None]:
        """The directory DeepSpeed is given for ``home``: itself, or for a URL its burst-buffer
        mirror (DeepSpeed globs, opens and copies scripts into real directories)."""
        if not is_url(home):
            return home, None
        local = self.fe.checkpointer.local_path(home)
        if local is None:
            raise ConfigError(f"{home} is a URL: saving or loading DeepSpeed checkpoints there needs a burst "
                              'buffer: set "local_dir" in the "fastckpt" section of the DeepSpeed config')
        return local, (local, home)

    # ------------------------------------------------------------------ wrappers
    def save_checkpoint(self, save_dir: str, tag: object = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_checkpoint``; returns once every rank's snapshot is taken."""
        self.closed = False
        tag = checked_tag(save_dir, str(tag) if tag is not None else f"global_step{self.engine.global_steps}")
        home = normalize(save_dir)
        where, alias = self._where(home)
        self._report_on_every_rank(home, tag, where)
        if client_state and self.fe.weights_only:  # known now, not at the resume
            warn_once(refused_globals(client_state, SAFE_GLOBALS), log, OPT_OUT)
        self.fe.begin(alias, bool(save_latest), int(self.engine.global_samples))
        try:
            return self._save(where, tag=tag, client_state={} if client_state is None else client_state,
                              save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
        except Exception as exc:  # raised before the commit agreed: the other ranks wait there (abandon)
            self.fe.abandon(exc, self._rejoin)
            raise
        finally:
            self.fe.end()

    def load_checkpoint(self, load_dir: str, tag: object = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable | None = None) -> tuple:
        """DeepSpeed's ``load_checkpoint``, after this engine's pending saves are durable; with no
        tag, the newest complete checkpoint (``resolve_tag``). Every rank loads one and the same
        save: each pins the tag's published save for its loads (``Checkpointer.reading``), and the
        ranks then agree (``agree_on_load``). A tag saved again and swapped in during the load, or
        ranks that resolved different tags (the newest moved between them), load again, whole, on
        every rank (up to ``LOAD_TRIES`` times); a load that raised on one rank raises on all.

        Raises:
            ConfigError: on every rank, before anything is read, when the ranks were given
                different load_dirs, tags (one given and one not, too), or load options.
        """
        self.flush()
        home = normalize(load_dir)
        same = {"load_dir": home, "tag": None if tag is None else str(tag),
                "load_optimizer_states": bool(load_optimizer_states), "load_module_only": bool(load_module_only),
                "load_lr_scheduler_states": bool(load_lr_scheduler_states)}
        if asked_differently(same):  # each rank would load another checkpoint, or run other collectives in its load
            raise different_loads_error(same)
        where, alias = self._where(home)
        resolve = tag is None and not self.engine.load_universal_checkpoint()
        asked = {"load_module_strict": load_module_strict, "load_optimizer_states": load_optimizer_states,
                 "load_lr_scheduler_states": load_lr_scheduler_states, "load_module_only": load_module_only,
                 "custom_load_fn": custom_load_fn}
        kwargs = fp32.as_given(self.engine, asked)  # ZeRO-3's load_module_only: through the consolidation
        for attempt in range(1, LOAD_TRIES + 1):
            loaded, save, error, changed = None, "", None, None
            with contextlib.ExitStack() as held:  # the tag's pinned save and this rank's files read ahead
                try:
                    if resolve:
                        tag = self._resolve(home)
                    save = self._prepare(home, where, alias, tag, kwargs, held, named_by_latest=resolve)
                except GroupChangedError as exc:
                    changed = exc
                except Exception as exc:  # noqa: BLE001 (raised below, on every rank)
                    error = self._explained(exc, home, where, tag)
                outcome = agree_on_load(error, changed is not None, save)  # before DeepSpeed's collectives
                if not (outcome.failed or outcome.changed or outcome.mixed):
                    try:
                        loaded = self._load_once(home, where, tag, kwargs, named_by_latest=resolve)
                    except GroupChangedError as exc:
                        changed = exc
                    except Exception as exc:  # noqa: BLE001 (raised below, on every rank)
                        error = self._explained(exc, home, where, tag)
                    outcome = agree_on_load(error, changed is not None, save)
            if outcome.failed:
                raise error_on_any_rank(error)
            if not (outcome.changed or outcome.mixed):
                if kwargs is not asked and loaded[1] is not None:  # what load_optimizer_states=True leaves out
                    loaded[1].pop("optimizer", None)
                return loaded
            what = (f"checkpoint {_join(home, str(tag))} was saved again during its load ({changed})"
                    if changed is not None else "the ranks loaded different saves (a tag was saved again, or the "
                    "newest checkpoint moved, between their loads)" if outcome.mixed else
                    "another rank's tag was saved again during its load")
            if attempt == LOAD_TRIES:
                raise changed or GroupChangedError(
                    f"{what}, {LOAD_TRIES} times: no save of {home} stayed in place for a whole load. Load again "
                    "once the saves of that tag, or of the newest, stop")
            log.warning("fastckpt: %s; loading again on every rank", what)
        raise AssertionError("unreachable: the last try returns or raises")

    def _explained(self, exc: Exception, home: str, where: str, tag: object) -> Exception:
        """``exc``, or when it refused a file of a tag that DeepSpeed's own engine saved again in
        place after fastckpt's commit, the error naming that and the fix (``resaved.py``)."""
        if not isinstance(exc, CorruptCheckpointError) or tag is None or is_url(home) \
                or not resaved_in_place(os.path.join(where, str(tag))):
            return exc
        named = resaved_error(home, _join(home, str(tag)))
        named.__cause__ = exc
        return named

    @staticmethod
    def _refuse_empty_latest(home: str, data: bytes | None) -> None:
        """No complete fastckpt tag under ``home``, and ``home/latest`` (its bytes ``data``, as ``_resolve``
        read them) empty (a crash while DeepSpeed wrote it, non-atomically): DeepSpeed would load tag ""
        and stop at a bare ``AssertionError``."""
        if data is not None and not data.strip():
            raise CheckpointNotFoundError(
                f"{_join(home, LATEST)} is empty (cut short while it was written?) and no complete fastckpt tag "
                f"is saved under {home}: there is no tag to resume from. Write the tag to load into that file (the "
                f"tag alone), or pass it: load_checkpoint({home!r}, tag=...); delete the file to start fresh. List "
                f"the tags with: fastckpt ls {home}")

    def _prepare(self, home: str, where: str, alias: tuple[str, str] | None, tag: object, kwargs: dict,
                 held: contextlib.ExitStack, named_by_latest: bool = False) -> str:
        """Everything of a load of ``tag`` that can fail on one rank only, done before DeepSpeed's
        load begins (``preread.py``: why): a URL's tag fetched into the burst buffer, the tag's
        published save pinned (held until ``held`` closes), a missing tag or file named, and the
        files this rank's DeepSpeed load will ask for read and verified. Returns what is loaded:
        the tag and the pinned save's checksums."""
        if tag is not None and alias is not None:
            self._store().check_exists(home, os.path.join(where, str(tag)), str(tag))
            self._fetch(home, where, str(tag))
        self.fe.begin(alias, None, int(self.engine.global_samples))
        held.callback(self.fe.end)
        held.callback(self.fe.forget_prereads)
        manifest = self._pin(held, _join(home, str(tag))) if tag is not None else None  # the home's save
        if tag is not None:
            if (gone := self._not_loadable(home, where, tag, kwargs, named_by_latest)) is not None:
                raise gone
            # (paths map back to home); the consolidation's files on the CPU, as DeepSpeed maps them
            preread(self.engine, where, str(tag), kwargs, self.fe.preread, lambda p: self.fe.load(p, "cpu"))
        return json.dumps([str(tag), *_checksums(manifest)])

    def _load_once(self, home: str, where: str, tag: object, kwargs: dict, named_by_latest: bool = False) -> tuple:
        """DeepSpeed's load of ``tag`` (None: DeepSpeed's own choice; ``named_by_latest``: the tag
        ``load_checkpoint(home)`` resolved), once ``_prepare`` has pinned and read its files."""
        consolidates = tag is not None and fp32.applies(self.engine, kwargs)
        joins, self.fe.last_read = LoadRejoin(self.engine, consolidates), None
        try:
            try:
                with joins.watch(), fp32.weights_only_load(where, str(tag), self._consolidation_read) if consolidates \
                        else contextlib.nullcontext():  # ZeRO-3's weights-only load reads this tag, verified
                    return self._load(where, tag=tag, **kwargs)
            except Exception as exc:  # on this rank only, maybe: the others go on into DeepSpeed's collectives
                self._rejoin_load(exc, joins, _join(home, str(tag)))
                raise
        except AssertionError as exc:  # DeepSpeed's bare assert on a file it did not find: name it
            if (gone := self._not_loadable(home, where, tag, kwargs, named_by_latest)) is None:
                raise
            raise gone from exc

    def _consolidation_read(self, path: str, map_location: object) -> object:
        """A file DeepSpeed's weights-only consolidation reads (every rank's, through the verified load):
        not one this rank's load asked for, so a later error's note still names its own last file (an
        error in this read names its file itself)."""
        own = self.fe.last_read
        try:
            return self.fe.load(path, map_location)
        finally:
            self.fe.last_read = own

    def _rejoin_load(self, exc: Exception, joins: LoadRejoin, group: str) -> None:
        """DeepSpeed's load of ``group`` raised ``exc`` on this rank: run the collectives the other
        ranks still run in theirs (``rejoin.py``), so that the agreement after the load pairs with
        theirs and every rank raises; ``exc`` gets a note naming this rank and the file."""
        rank = self.engine.global_rank
        read = self.fe.last_read
        exc.add_note(f"fastckpt: [rank={rank}] DeepSpeed's load_checkpoint of {group} raised this on rank {rank}, "
                     + (f"after it read {read}" if read is not None else "before it read a file of it")
                     + "; every rank raises (the model and optimizer may be partly loaded: load a checkpoint "
                     "again before training on)")
        try:
            joins.rejoin()
        except Exception as rejoin_exc:  # noqa: BLE001 (the load's own error is the one raised)
            exc.add_note(f"fastckpt: [rank={rank}] running the collectives the other ranks run in their load "
                         f"failed too: {rejoin_exc!r}")

    def _not_loadable(self, home: str, where: str, tag: object, kwargs: dict,
                      named_by_latest: bool) -> BaseException | None:
        """The error naming what of ``tag`` a load with ``kwargs`` needs and is missing (its
        directory, a file of its manifest that load reads) or that it holds no complete save;
        None when nothing is missing."""
        if (missing := self._missing(where, tag, kwargs)) is None:
            if self._uncommitted(where, tag):
                return IncompleteCheckpointError(
                    f"checkpoint {_join(home, str(tag))} cannot be loaded: it holds no complete save (no fastckpt "
                    "manifest: its save never committed, killed while its files were written, or it is still "
                    f"being written; nor DeepSpeed's own files). Load the newest complete tag with "
                    f"load_checkpoint({home!r}) and no tag; list them with: fastckpt ls {home}")
            return None
        why = f"no tag {str(tag)!r} is saved under {home}: never saved, or deleted since" \
            if missing == os.path.join(where, str(tag)) else "deleted since it was saved"
        fix = f"Load another tag, or the newest complete one with load_checkpoint({home!r}) and no tag"
        if named_by_latest and missing == os.path.join(where, str(tag)):
            fix = (f"{_join(home, LATEST)} names it (removing a tag does not rewrite latest): write the newest "
                   "remaining tag into that file (the tag alone; an older one does not roll back: remove the tags "
                   f"newer than it first), or load a tag with load_checkpoint({home!r}, tag=...)")
        elif named_by_latest:  # damaged, not removed: its manifest keeps it the newest, whatever latest says
            fix = (f"it stays the newest complete tag whatever {_join(home, LATEST)} names: remove it "
                   f"(engine.checkpoint_engine.checkpointer.remove({_join(home, str(tag))!r})), then write the tag "
                   f"to resume from into latest, or load another with load_checkpoint({home!r}, tag=...)")
        if missing != os.path.join(where, str(tag)) and _optimizer_file(missing) \
                and not self.engine.zero_optimization_partition_weights():  # (under ZeRO-3 the weights are there)
            fix = (f"Its weights load without it: load_checkpoint({home!r}, tag={str(tag)!r}, load_module_only=True) "
                   f"(load them before removing the tag: it may be their only copy). Or: {fix[0].lower()}{fix[1:]}")
        return CheckpointNotFoundError(
            f"checkpoint {_join(home, str(tag))} cannot be loaded: {missing} does not exist ({why}). {fix}; "
            f"list them with: fastckpt ls {home}")

    def _uncommitted(self, where: str, tag: object) -> bool:
        """The tag directory holds no manifest and no checkpoint file of anyone's (only what a
        killed or unfinished fastckpt save leaves: temp files, markers); DeepSpeed's own tags,
        whose files are there, keep DeepSpeed's own error."""
        group = os.path.join(where, str(tag))
        if tag is None or is_url(where) or not os.path.isdir(group) or self._store().manifest(group) is not None:
            return False
        return not [n for n in os.listdir(group) if not n.startswith(".")]

    def _missing(self, where: str, tag: object, kwargs: dict) -> str | None:
        """The tag directory, or the first file its manifest names that a load with ``kwargs``
        reads, that is not there; None when nothing is missing, or there is no fastckpt manifest
        to say what should be. A load of the weights only reads no optimizer file: a tag whose
        ``*optim_states.pt`` were deleted (kept for evaluation or fine-tuning) loads that way."""
        if tag is None or is_url(where):
            return None
        group = os.path.join(where, str(tag))
        if not os.path.isdir(group):
            return group
        manifest = self._store().manifest(group)
        optimizer = reads_optimizer_files(self.engine, kwargs)
        needed = [r for r in sorted((manifest or {}).get("files", ())) if optimizer or not _optimizer_file(r)]
        gone = [r for r in needed if not os.path.exists(os.path.join(group, r))]
        return os.path.join(group, gone[0]) if gone else None

    def _pin(self, stack: contextlib.ExitStack, group: str) -> dict | None:
        """Pin the published save of the tag ``group`` for this thread's loads and return its
        manifest; a tag that is no fastckpt group (DeepSpeed's own checkpoint) loads as DeepSpeed
        loads it (None)."""
        try:
            return stack.enter_context(self.fe.checkpointer.reading(group))
        except IncompleteCheckpointError:  # no manifest: its files' own loads say what is wrong, if anything
            return None

    def destroy(self) -> None:
        """Flush pending saves (and close an owned Checkpointer), then DeepSpeed's ``destroy``."""
        try:
            self.close()
        finally:
            self._destroy()

    # ------------------------------------------------------------------ flushing and reporting
    def flush(self) -> None:
        """Wait until every save so far is durable (at most ``close_timeout_s`` when set);
        report them; raise a failure once."""
        if self.owned is not None and self.owned.closed:
            return  # nothing to wait for; making a Checkpointer to close it (DeepSpeed's __del__ calls
            # destroy() again at exit) started its metrics server there, which never returned
        timeout = self.fe.checkpointer.config.close_timeout_s
        self.report(wait=True, timeout_s=timeout)
        self.fe.checkpointer.wait(timeout)

    def close(self) -> None:
        """Flush, then close an owned Checkpointer: also when the flush raised a pending save's
        failure, which is then raised (once: not again at exit), with the close's own if any."""
        try:
            self.flush()
        except BaseException as exc:
            self.closed = True
            if self.owned is not None:
                try:
                    self.owned.close()
                except Exception as close_exc:  # noqa: BLE001 (the flush's failure is the one raised)
                    exc.add_note(f"closing fastckpt's Checkpointer failed too: {close_exc!r}")
            raise
        self.closed = True
        if self.owned is not None:
            self.owned.close()

    def _rejoin(self) -> None:
        """ZeRO-3 gathers its persistent parameters on every rank after the last file work of a
        save (``checkpoint_event_epilogue``: rank 0's copy of zero_to_fp32.py comes before it) and
        before the commit: a rank that raised before it runs it now (``FastCkptEngine.abandon``),
        so that its agreement pairs with the others' commit, not with that gather."""
        if self.engine.optimizer is not None and hasattr(self.engine.optimizer, "checkpoint_event_epilogue"):
            self.engine.optimizer.checkpoint_event_epilogue()

    def _report_on_every_rank(self, home: str, tag: str, where: str) -> None:
        """``report`` the checkpoints that finished, and on rank 0 make ``where`` (the directory
        DeepSpeed writes ``home`` into: its own makedirs runs on rank 0 only, the others waiting in
        its barrier, so a failure there hung the job) and clear a leftover attempt at ``home/tag``
        (which waits for this run's own attempt at it); a failure is raised on every rank or on
        none (a commit ends on every rank, but not at the same moment: raised where it ended first
        only, it would leave the other ranks inside DeepSpeed's save for ever). The same all-reduce
        finds ranks asked for different save_dirs or tags (a per-rank timestamp in the tag): each
        rank's group commit would pair with another rank's commit of another group, and every later
        checkpoint's with the wrong one, so every rank raises ``ConfigError`` before DeepSpeed's
        save (and its ``tag_validation``, which only warns by default) begins."""
        error: BaseException | None = None
        clear = _join(home, tag)
        try:
            self.report(wait=False)
            if self._rank0:
                _make_save_dir(where, home)
                self._clear_leftover(clear)
        except Exception as exc:  # noqa: BLE001 (raised below, on every rank)
            error = exc
        worst, different = agree_on_save(FAILED if error is not None else COMMITTED, home, tag)
        if different:  # before DeepSpeed's save: each rank's commit would pair with another rank's other tag
            refused = different_tags_error(home, tag)
            if error is not None:
                refused.add_note(f"fastckpt: this rank failed too, before it began: {error!r}")
            raise refused from error
        if worst == COMMITTED:
            return
        if error is None:  # it ended on another rank first: here it ends the same way (bounded)
            try:
                self.report(wait=True, timeout_s=self.fe.checkpointer.config.commit_timeout_s)
            except Exception as exc:  # noqa: BLE001
                error = exc
        raise error or CheckpointWriteError(f"checkpoint {clear} was not saved: another rank raised before it "
                                            "began (an earlier checkpoint failed there, which is not committed and "
                                            "latest names the one before it; or rank 0 could not create save_dir); "
                                            "that rank raised the error")

    def report(self, wait: bool, timeout_s: float | None = None) -> None:
        """Report finished checkpoints (with ``wait``, all of them, within ``timeout_s``), oldest
        first; a failed one is raised here (its handle marks it seen, so the Checkpointer does
        not raise it again).

        Raises:
            ReplicationError: ``timeout_s`` passed with checkpoints still pending.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.fe.pending and (wait or self.fe.pending[0].handle.done()):
            p = self.fe.pending.pop(0)
            try:
                rec = p.handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if p.handle.done():  # the commit's own failure (CommitTimeoutError), not our wait
                    raise
                self.fe.pending.insert(0, p)
                raise ReplicationError(f"checkpoint {p.group} is still not committed after close_timeout_s="
                                       f"{timeout_s} s; its files stay where they are (an incomplete tag is "
                                       "never loaded)") from None
            if not self._rank0:
                continue
            stall = (p.stall_s if p.stall_s is not None else p.committed - p.started) + (p.fence_s or 0.0)
            durable = None if rec.durable_s is None else p.saving - p.started + rec.durable_s  # from its first save
            self._publish(CheckpointReport(p.tag, p.group, p.samples, stall, rec.blocked_s, durable,
                                           self.fe.checkpointer.stats().overhead))

    def _publish(self, r: CheckpointReport) -> None:
        from deepspeed.utils import logger as ds_logger

        if r.durable_s is None:
            ds_logger.info("fastckpt: checkpoint %s: training blocked %.3f s; superseded by a newer one before "
                           "it was replicated", r.group, r.stall_s)
        else:
            ds_logger.info("fastckpt: checkpoint %s: training blocked %.3f s (snapshot %.3f s), durable after "
                           "%.3f s; checkpoint overhead %.2f %% of wall time", r.group, r.stall_s, r.blocked_s,
                           r.durable_s, 100 * r.overhead)
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and monitor.enabled:
            monitor.write_events(r.events())

    # ------------------------------------------------------------------ internals
    def _clear_leftover(self, group: str) -> None:
        """Rank 0, before a save into ``group``: an attempt that never completed (a crashed
        run's) is removed, so its rank markers cannot be mistaken for the new attempt's."""
        if any(p.group == group for p in self.fe.pending):
            self.flush()  # this run's own attempt at the same tag: let it finish first
        store = self._store()
        if store.attempted(group) and store.manifest(group) is None:
            log.info("fastckpt: removing %s, an incomplete earlier attempt at this checkpoint", group)
            self.fe.checkpointer.remove(group)

    def _resolve(self, root: str) -> str | None:
        """``resolve_tag`` for ``load_checkpoint(root)``; ``root/latest`` is read once, for both."""
        store = self._store()
        data = store.latest_file(root)
        tag, lagging = tag_named(store, root, pointer_name(data))
        if tag is None:
            self._refuse_empty_latest(root, data)
        if lagging and self._rank0 and tag is not None and (m := store.manifest(_join(root, tag))) is not None:
            try:  # forward only: a writer may have moved it to a newer commit since
                if store.set_pointer(root, tag, order(m)):
                    log.info("fastckpt: %s/latest moves to %s, the newest complete checkpoint", root, tag)
            except OSError as exc:  # a reader that may not write there (an evaluation job): it loads all the same
                log.warning("fastckpt: could not move %s/latest to %s, the newest complete checkpoint (%s); "
                            "loading %s", root, tag, exc, tag)
        return tag

    def _fetch(self, url: str, local_root: str, tag: str) -> None:
        """Make the burst-buffer copy of ``url/tag`` complete and of the save published at
        ``url`` (a fresh node has none; a node whose copy another node's save of the tag
        replaced at ``url`` has an older one, which is replaced)."""
        store = self._store()
        local = os.path.join(local_root, tag)
        ours, manifest = store.manifest(local), store.manifest(_join(url, tag))
        if ours is not None and (manifest is None or same_files(ours, manifest)):
            if not self._gather(url, local, tag, ours) or manifest is None:
                return  # the published save, or the only copy left (removed at url): loads verify it
            ours = None  # a file of it is on no drive here: fetch what is missing
        if manifest is None:
            raise IncompleteCheckpointError(
                f"checkpoint {url}/{tag} is incomplete (it has no manifest); load the newest complete one with "
                f"load_checkpoint({url!r}) and no tag, or fastckpt.latest({url!r}, storage_options=...)")
        started = time.monotonic()
        store.download_group(_join(url, tag), local, sorted(manifest["files"]), replace=ours is not None)
        self._gather(url, local, tag, manifest)
        log.info("fastckpt: downloaded %s into the burst buffer in %.2f s", _join(url, tag), time.monotonic() - started)

    def _gather(self, url: str, local: str, tag: str, manifest: dict) -> list[str]:
        """With several ``local_dir`` drives a tag's files lie on any of them, but DeepSpeed globs
        and opens one directory, the first drive's mirror: a file of the tag that lies on another
        drive gets a link there (its reads still go through the home's path, ``fe.home``, to the
        copy wherever it is). Returns the files that are on no drive here."""
        absent = []
        for rel in sorted(manifest.get("files", ())):
            here = os.path.join(local, *rel.split("/"))
            if os.path.islink(here) and not os.path.exists(here):  # its copy was trimmed since: link it again
                os.unlink(here)
            if os.path.lexists(here):
                continue
            there = self.fe.checkpointer.local_path(_join(_join(url, tag), rel))
            if there is None or there == here or not os.path.exists(there):
                absent.append(rel)
                continue
            os.makedirs(os.path.dirname(here), exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another rank of this node linked it first
                os.symlink(there, here)
        return absent


def _optimizer_file(rel: str) -> bool:
    """``rel`` (a file a manifest names) holds optimizer states (DeepSpeed's ``*optim_states.pt``,
    ZeRO's partitions and the non-ZeRO MoE experts' alike)."""
    return posixpath.basename(rel).endswith("optim_states.pt")


def _make_save_dir(where: str, save_dir: str) -> None:
    """Rank 0 makes ``where``, the directory DeepSpeed writes ``save_dir`` into (itself, or its
    burst-buffer mirror), before DeepSpeed's own makedirs, which then finds it."""
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as exc:
        exc.add_note(f"fastckpt: the burst-buffer copy of save_dir {save_dir} could not be created on rank 0 ({where}, "
                     "under local_dir), so no rank saved; free up or fix local_dir (a writable directory with free "
                     "space)" if is_url(save_dir) else
                     f"fastckpt: save_dir {save_dir} could not be created on rank 0 ({where}), so no rank saved; pass "
                     "a save_dir that is a directory, or can be made one, on a writable filesystem with free space")
        raise


def _flush_at_exit(ref: weakref.ref) -> None:
    """Runs before the interpreter stops its thread pools (``threading._register_atexit``: a
    plain ``atexit`` hook runs after them, when no write could be scheduled any more)."""
    hooks = ref()
    if hooks is None or hooks.closed:
        return
    try:
        hooks.close()
    except BaseException as exc:  # noqa: BLE001 (at exit there is no caller left to raise to)
        log.error("fastckpt: a pending DeepSpeed checkpoint failed at exit: %r", exc)
