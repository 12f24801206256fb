"""fastckpt's DeepSpeed ``CheckpointEngine``: the per-file half of the integration.

Order of calls, from ``DeepSpeedEngine.save_checkpoint``, on every rank, training thread:
  makedirs(save_dir)  (rank 0)  -> create(info) -> makedirs(save_dir/tag)
  -> save(state_dict=..., path=...) for each file this rank writes
  -> commit(info)  [-> DeepSpeed's own plain write of save_dir/latest: switched off, see
     ``deepspeed.py``]  -> barrier
Each file is saved into the group ``save_dir/tag`` (``Checkpointer.save(..., group=)``; the
snapshots are taken in ``commit``, see there), then ``Checkpointer.commit(group)`` returns at once:
rank 0 publishes the group manifest, then ``save_dir/latest`` (the tag: DeepSpeed's format), once
every rank's files are durable. Loading a tag that never committed raises
``IncompleteCheckpointError``.

``is_decoupled()`` is False on purpose. True would make DeepSpeed call ``commit`` at the next
``engine.step()`` boundary and then write ``latest`` itself and run a barrier: to keep
``latest`` truthful ``commit`` would have to block there until the group is durable, and the
last checkpoint before the process ends would never be committed.

With ``"lazy_snapshot": true`` the snapshots taken in ``commit`` copy parameters and optimizer
state on the Checkpointer's snapshot thread while training goes on (everything else is cloned
there and then), and ``fence`` (called before every optimizer step: ``hooks.StepFence``) waits
for the copies.

Loads unpickle with ``weights_only=True`` and DeepSpeed's own classes allow-listed
(``SAFE_GLOBALS``), unless the user opted out in the config.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from fastckpt import Checkpointer, SaveHandle
from fastckpt.errors import CheckpointWriteError
from fastckpt.save.fencing import copy_unfenced

from .agree import COMMITTED, FAILED, SKIPPED, worst_on_any_rank
from .compat import is_url, normalize


def _safe_globals() -> list:
    """The classes DeepSpeed's own checkpoints pickle besides tensors and plain types
    (found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO 0-3 files)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


SAFE_GLOBALS = _safe_globals()
log = logging.getLogger("fastckpt.deepspeed")
OPT_OUT = ('"fastckpt": {"weights_only": false} in the DeepSpeed config (under Lightning: the config given to '
           "DeepSpeedStrategy(config=...))")


@dataclass(frozen=True)
class PendingCommit:
    """One ``save_checkpoint`` whose group commit is in flight on this rank."""

    tag: str
    group: str
    handle: SaveHandle
    started: float  # time.monotonic() when save_checkpoint was called
    committed: float  # time.monotonic() when commit() was called
    stall_s: float | None  # time inside save_checkpoint (set once it returned)
    samples: int  # engine.global_samples at the save (the step DeepSpeed's monitor uses)
    fence_s: float | None = None  # lazy snapshot: the optimizer step's wait for its copy (None: not yet)
    saving: float = 0.0  # time.monotonic() as its files' saves began (the commit's durable_s counts from there)


class FastCkptEngine(CheckpointEngine):
    """DeepSpeed checkpoint engine whose saves return after the snapshot.

    Args:
        checkpointer: the Checkpointer to save through, or a function returning the one to use
            now (FastCkptIO passes its own, which it replaces after each fit).
        on_commit: called with each group commit's SaveHandle (FastCkptIO logs its numbers).
        weights_only: load with ``weights_only=True`` and DeepSpeed's classes allow-listed;
            False unpickles anything (only for checkpoints you trust).
        fenced: with a lazy snapshot, a function returning the tensors that only the optimizer
            step changes (``fence`` runs before it): their copy is left for later, every other
            tensor is cloned in ``commit`` (``fastckpt.save.fencing``). None: eager snapshots.
    """

    def __init__(self, checkpointer: Checkpointer | Callable[[], Checkpointer],
                 on_commit: Callable[[SaveHandle], None] | None = None, *, weights_only: bool = True,
                 fenced: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        super().__init__(None)
        self.name = "FastCkptEngine"
        self._fenced = fenced
        self._unfenced = False  # lazy snapshots were started since the last fence
        self._source = checkpointer
        self._on_commit = on_commit
        self.weights_only = weights_only
        self._group: str | None = None  # the tag being saved, from create until commit (see abandon)
        self._tag = ""
        self._deferred: list[tuple[object, str]] = []  # (state_dict, path) saved into the tag so far
        self._alias: tuple[str, str] | None = None  # (burst-buffer dir, URL) of a URL save_dir
        self._move_latest: bool | None = None  # the caller's save_latest while save_checkpoint runs
        self._started = time.monotonic()
        self._samples = 0
        self.pending: list[PendingCommit] = []
        self.skipped: list[str] = []  # tags "when_busy": "skip" dropped (never committed), oldest first
        self._preread: dict[str, object] = {}  # path (as DeepSpeed names it) -> its object, read before the load
        self.last_read: str | None = None  # the file DeepSpeed's load asked for last (named when the load raises)

    @property
    def lazy(self) -> bool:
        """Snapshots are lazy (``"lazy_snapshot": true``)."""
        return self._fenced is not None

    @property
    def checkpointer(self) -> Checkpointer:
        return self._source if isinstance(self._source, Checkpointer) else self._source()

    # ------------------------------------------------------------------ set by the engine wrapper
    def begin(self, alias: tuple[str, str] | None, move_latest: bool | None, samples: int) -> None:
        """``save_checkpoint`` or ``load_checkpoint`` starts: DeepSpeed sees ``alias[0]``, a
        directory in the burst buffer, for the URL ``alias[1]``."""
        self._alias, self._move_latest, self._samples = alias, move_latest, samples
        self._started = time.monotonic()

    def end(self) -> None:
        """Record how long the training thread spent in ``save_checkpoint``. A tag whose
        ``commit`` never came (DeepSpeed raised between its saves and the commit: a full disk
        copying zero_to_fp32.py, a Ctrl-C) is forgotten: nothing of it was saved (its snapshots
        wait for the commit), and the next ``save_checkpoint`` starts clean."""
        self._group, self._deferred = None, []
        now = time.monotonic()
        self.pending = [p if p.stall_s is not None else PendingCommit(p.tag, p.group, p.handle, p.started,
                                                                      p.committed, now - p.started, p.samples,
                                                                      saving=p.saving)
                        for p in self.pending]
        self._alias, self._move_latest = None, None

    def home(self, path: str) -> str:
        """Where ``path`` (as DeepSpeed named it) lives: the URL for a burst-buffer alias."""
        if self._alias is not None:
            local, url = self._alias
            if path == local or path.startswith(local + os.sep):
                return url + path[len(local):].replace(os.sep, "/")
        return normalize(path)

    # ------------------------------------------------------------------ CheckpointEngine
    def create(self, info: CheckpointCommitInfo) -> None:
        """A tag's saves begin. Only ``save_checkpoint`` makes a tag a group: DeepSpeed also calls
        create/commit around other saves (``save_16bit_model``: one file beside the tags), which
        stay single-file checkpoints, written before ``save`` returns."""
        saving = self._move_latest is not None
        self._group = self.home(os.path.join(info.save_dir, str(info.tag))) if saving else None
        self._tag = str(info.tag)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if not is_url(path):
            os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: object, path: str) -> None:
        """DeepSpeed calls this with the keyword ``state_dict``. Inside ``save_checkpoint`` the
        snapshot waits for ``commit`` (see there). Elsewhere (``save_16bit_model``) the file is
        durable at ``path`` when this returns, as DeepSpeed's own engine writes it: callers
        export, then load or evaluate the file at once.

        Raises:
            CheckpointWriteError: the file was not written (``"when_busy": "skip"`` dropped it, or
                the write failed).
        """
        path = self.home(path)
        inside = self._group is not None and path.startswith(self._group + ("/" if is_url(path) else os.sep))
        if inside:
            self._deferred.append((state_dict, path))
            return
        rec = self.checkpointer.save(state_dict, path, export=True).wait()  # never one of keep_persistent's tags
        if rec.durable_s is None:
            why = "the staging buffers were busy and when_busy is \"skip\"" if rec.skipped else "it was dropped"
            raise CheckpointWriteError(f"{path} was not written: {why}. DeepSpeed's saves outside save_checkpoint "
                                       "(save_16bit_model) need the file: set \"when_busy\": \"wait\" (the default) "
                                       "in the \"fastckpt\" section, or save when no checkpoint is being copied")

    def preread(self, path: str) -> object:
        """Load ``path`` now (on the CPU, as DeepSpeed maps its checkpoints), for DeepSpeed's
        ``load`` of it to return (once) within the next load (``preread.py``: why)."""
        obj = self._preread[path] = self.load(path, "cpu")
        return obj

    def forget_prereads(self) -> None:
        """Drop what DeepSpeed's load did not ask for (its load raised, or it took another way)."""
        self._preread.clear()

    def load(self, path: str, map_location: object = None) -> object:
        """Verified load; unpickling as ``weights_only`` says (see the module docstring)."""
        self.last_read = self.home(path)
        if path in self._preread:
            return self._preread.pop(path)
        path = self.home(path)
        if not self.weights_only:
            return self.checkpointer.load(path, map_location, weights_only=False)
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return self.checkpointer.load(path, map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            exc.add_note(f"fastckpt loads DeepSpeed checkpoints with weights_only=True (tensors, plain types "
                         f"and DeepSpeed's own classes). If you trust {path}, allow its other classes with "
                         f"torch.serialization.add_safe_globals([...]), or set {OPT_OUT}.")
            raise

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """This rank is done with ``info.tag``: snapshot its files, then commit the group in the
        background.

        The snapshots are taken here rather than in each ``save``: DeepSpeed does file work of
        its own between the saves and the commit (rank 0 copies zero_to_fp32.py into save_dir
        every time), and once a background write is syncing, each of those metadata operations
        queues behind the filesystem's journal (measured on ext4: 9 ms per file opened for
        writing, 0.4 ms otherwise). Nothing mutates the state between the two calls: DeepSpeed
        does not train inside ``save_checkpoint``. The tag's files are one save for the
        Checkpointer's overhead monitor (``Checkpointer.one_save``).
        """
        if self._group is None:
            return True  # not a save_checkpoint (see create)
        deferred, self._deferred = self._deferred, []
        lazy = self.lazy
        group = self.home(os.path.join(info.save_dir, str(info.tag)))
        move, tag = bool(self._move_latest), str(info.tag)
        self._group = None
        handles: list[SaveHandle] = []
        handle, error, committed = None, None, False
        current = deferred[0][1] if deferred else None  # the file whose save is next
        saving = time.monotonic()
        try:
            protected = list(self._fenced()) if self._fenced is not None and deferred else []
            with self.checkpointer.one_save():  # its model and optimizer files: one save for the overhead alarm
                for state_dict, path in deferred:
                    current = path
                    state = copy_unfenced(state_dict, protected) if lazy else state_dict
                    handles.append(self.checkpointer.save(state, path, group=group, lazy=lazy))
                    self._unfenced = self._unfenced or lazy
            current = None
            if not any(_skipped(h) for h in handles):
                committed = True
                handle = self.checkpointer.commit(group, move_latest=move, tag=tag, save_latest=move)
        except Exception as exc:  # noqa: BLE001 (raised below, on every rank: see _failed)
            error = exc
            if current is not None:  # its save was never called: the commit must not publish the group without it
                self.checkpointer.unsaved(current, group, exc)
        outcome = worst_on_any_rank(FAILED if error is not None else SKIPPED if handle is None else COMMITTED)
        if outcome == FAILED:
            self._failed(group, tag, move, handle, error, committed)
        if outcome == SKIPPED:
            self._drop(group, tag, move, handle)
            return True
        if self._on_commit is not None:  # the caller reports it (FastCkptIO)
            self._on_commit(handle)
        else:  # the engine wrapper reports it (deepspeed.py)
            self.pending.append(PendingCommit(tag, group, handle, self._started, time.monotonic(),
                                              None, self._samples, None if lazy else 0.0, saving))
        return True

    def _drop(self, group: str, tag: str, move: bool, handle: SaveHandle | None) -> None:
        """``"when_busy": "skip"`` dropped a file of this tag on some rank: every rank ends the
        attempt here, the same way, so that ``save_checkpoint`` returns on all of them (an error
        on one rank only would leave the others in DeepSpeed's barrier). The rank that skipped
        has its commit raise (and end the attempt on every rank); the others wait for that end."""
        try:
            (handle or self.checkpointer.commit(group, move_latest=move, tag=tag, save_latest=move)).wait()
        except CheckpointWriteError as exc:
            log.warning("fastckpt: [rank=%d] checkpoint %s skipped (\"when_busy\": \"skip\": the previous "
                        "checkpoint still held the staging buffer on a rank); the tag is not committed and "
                        "latest still names the previous one: %s", self.checkpointer.rank, group, exc)
        self.skipped.append(tag)

    def _failed(self, group: str, tag: str, move: bool, handle: SaveHandle | None, error: BaseException | None,
                committed: bool) -> None:
        """A save or the commit of this tag raised on some rank: every rank ends the attempt and
        raises here, so that ``save_checkpoint`` raises on all of them, before DeepSpeed's
        barrier (raised on one rank only, it would leave the others waiting there for ever). A
        rank that failed or skipped before its commit commits now, which raises and ends the
        attempt on every rank; the others wait until their commit ends that way (its error seen).

        Raises:
            this rank's error, else CheckpointWriteError naming the tag.
        """
        if not committed:  # (a commit that raised has ended the attempt already)
            with contextlib.suppress(Exception):
                handle = self.checkpointer.commit(group, move_latest=move, tag=tag, save_latest=move)
        if handle is not None:
            with contextlib.suppress(Exception):  # its failure is the attempt's end; raised below as this tag's
                handle.wait(self.checkpointer.config.commit_timeout_s)
        if error is not None:
            raise error
        raise CheckpointWriteError(f"checkpoint {group} was not saved: a save or commit of it failed on another "
                                   "rank (that rank raised its error); the tag is not committed and latest still "
                                   "names the previous checkpoint")

    def abandon(self, error: Exception, rejoin: Callable[[], None]) -> None:
        """DeepSpeed's ``save_checkpoint`` raised ``error`` on this rank between ``create`` and
        ``commit`` (rank 0's copy of zero_to_fp32.py into a full save_dir): the other ranks went
        on into ``commit``'s all-reduce, which this rank joins now with FAILED, so that they end
        the attempt and raise too (training on, this rank's next collective would pair with theirs
        and hang both). None of this rank's files was saved: the commit raises, naming them, and
        ends the attempt on every rank. Nothing to do once ``commit`` was reached (it agreed), or
        before ``create`` (no tag began). ``rejoin`` first runs the collectives DeepSpeed runs
        between its last file work and the commit (``hooks.EngineHooks._rejoin``). The group is
        the same on every rank: ``save_checkpoint`` refuses, on every rank, save_dirs or tags
        that differ between the ranks before DeepSpeed's save begins (``hooks``:
        ``_report_on_every_rank``), so this commit never pairs with another group's.

        Raises:
            ``error``, once the ranks agreed.
        """
        group, self._group = self._group, None
        if group is None:
            return
        deferred, self._deferred = self._deferred, []
        sep = "/" if is_url(group) else os.sep
        for path in [p for _, p in deferred] or [group + sep + "(this rank's part of save_checkpoint)"]:
            self.checkpointer.unsaved(path, group, error)
        rejoin()
        worst_on_any_rank(FAILED)
        self._failed(group, self._tag, bool(self._move_latest), None, error, committed=False)

    def fence(self) -> float:
        """Called before every optimizer step (``hooks.StepFence``): wait until the lazy
        snapshots started since the last step are copied, and count the wait as the stall of
        the checkpoints that took them. Returns the seconds waited."""
        if not self._unfenced:
            return 0.0
        self._unfenced = False
        waited = share = self.checkpointer.fence()
        for i, p in enumerate(self.pending):
            if p.fence_s is None:  # one wait covers them all: the first carries it
                self.pending[i], share = replace(p, fence_s=share), 0.0
        return waited

    def is_decoupled(self) -> bool:
        return False  # see the module docstring

    def wait(self) -> None:
        """Block until every save and commit so far is durable (raises a failure once)."""
        self.checkpointer.wait()


def _skipped(handle: SaveHandle) -> bool:
    """The save was dropped by ``"when_busy": "skip"`` (such a handle is finished at once)."""
    if not handle.done():
        return False
    try:
        return handle.result().skipped
    except Exception:  # noqa: BLE001 (a failed save, not a skip: the commit raises it, as before)
        return False
