"""FastCkptIO's bookkeeping of the saves it started: lazy fences, metric rows, errors once.

Everything here runs on the training thread. A save is tracked from ``save_checkpoint`` until
its handle is done; then it becomes one row of ``ckpt/*`` metrics (or, if it failed, an error
handed back to be raised once).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from fastckpt.checkpointer import Checkpointer
from fastckpt.monitor import Stats
from fastckpt.records import SaveHandle, SaveRecord
from fastckpt.save.fencing import copy_unfenced, optimizer_tensors, storage_key


class StepSave:
    """The files Lightning saves for one training step are one save for the overhead monitor and the
    event log (``Checkpointer.one_save``): ``ModelCheckpoint(save_last=True)`` saves one state twice
    (its top-k file, then ``last.ckpt``), as do several ModelCheckpoints at one step. Counted as two
    saves, the first checkpoint raised the overhead alarm with the milliseconds between its two files
    as the interval, and the alarm's advice was sized from one file's blocked time. The block opens
    on the training thread (the one the plugin was connected on, ``owner``) at the step's first save
    and closes at the next fence (every phase after the saves passes one first: ``FastCkptCallback``)
    or at a save of another step. A save from another thread (a user's ``trainer.save_checkpoint``
    in a worker) is a save of its own: a block is the thread's, and one shared across threads was
    closed on the wrong one, leaving the training thread's later saves in a closed block."""

    def __init__(self, owner: int | None = None) -> None:
        self.owner = threading.get_ident() if owner is None else owner
        self._open: tuple[object, contextlib.AbstractContextManager] | None = None

    def join(self, ck: Checkpointer, key: object) -> None:
        """Make the calling thread's next save part of the block of ``key`` (epoch, step), on the
        training thread; on another, nothing."""
        if threading.get_ident() != self.owner or (self._open is not None and self._open[0] == key):
            return
        self.close()
        block = ck.one_save()
        block.__enter__()
        self._open = (key, block)

    def close(self) -> None:
        """End the open block (counted now), on the training thread (its block is that thread's)."""
        if self._open is None or threading.get_ident() != self.owner:
            return
        block, self._open = self._open[1], None
        block.__exit__(None, None, None)


@dataclass(eq=False)
class Tracked:
    """A save (or a DeepSpeed group commit) whose numbers the loggers have not seen yet."""

    handle: SaveHandle
    step: int | None
    blocked_s: float | None  # training-thread time in save_checkpoint; None: the record's (a group commit)
    fence_s: float = 0.0  # lazy snapshot: the optimizer step's wait for the copy (on the first save fenced)


class SaveLedger:
    def __init__(self) -> None:
        self.tracked: list[Tracked] = []
        self._unfenced: list[Tracked] = []
        self._rows: list[dict[str, float]] = []
        self._last: SaveHandle | None = None
        #: Each path's newest save this fit, done or not, kept after ``harvest``: a skipped or
        #: failed save is done (and harvested) before ModelCheckpoint links last.ckpt to it.
        self.newest: dict[str, SaveHandle] = {}
        #: Each save's successor, the next save to its path this fit (``after``). Weak keys: an
        #: entry lasts while a queued removal or link may still judge that save.
        self._next: weakref.WeakKeyDictionary[SaveHandle, SaveHandle] = weakref.WeakKeyDictionary()

    def add(self, handle: SaveHandle, step: int | None, blocked_s: float | None, lazy: bool = False) -> Tracked:
        item = Tracked(handle, step, blocked_s)
        self.tracked.append(item)
        prev = self.newest.get(handle.path)
        if prev is not None:
            self._next[prev] = handle
        self._last = self.newest[handle.path] = handle
        if lazy:
            self._unfenced.append(item)
        return item

    def after(self, handle: SaveHandle) -> SaveHandle | None:
        """The save to ``handle``'s path called right after it this fit, if any (any thread)."""
        return self._next.get(handle)

    def fence(self, ck: Checkpointer | None) -> None:
        """Lazy saves: wait for their copies; the wait is blocked time of the first of them."""
        if not self._unfenced or ck is None:
            return
        self._unfenced[0].fence_s += ck.fence()
        self._unfenced = []

    def wait(self, item: Tracked) -> None:
        """Wait for one save; a failure is raised here and not again by ``harvest``."""
        try:
            item.handle.wait()
        except BaseException:
            self.tracked = [t for t in self.tracked if t is not item]
            raise

    def before_removal(self, path: str) -> list[SaveHandle]:
        """The saves a removal of ``path`` must see durable first: every save still in flight, and
        the newest save even if done (a skipped one is done at once). ModelCheckpoint removes a file
        right after saving the one that replaces it; if that one never lands, the old file is all
        there is. Saves to ``path`` itself are the core's to order."""
        saves = [t.handle for t in self.tracked if not t.handle.done()]
        if self._last is not None and all(h is not self._last for h in saves):
            saves.append(self._last)
        return [h for h in saves if h.path != path]

    def to(self, path: str) -> list[Tracked]:
        return [t for t in self.tracked if t.handle.path == path]

    def forget(self, exc: BaseException) -> None:
        """Drop the save whose failure ``exc`` is (the core has just raised it)."""
        keep = []
        for t in self.tracked:
            if t.handle.done() and t not in self._unfenced:
                try:
                    t.handle.wait()
                except BaseException as e:  # noqa: BLE001 (compared, not swallowed: kept unless it is exc)
                    if e is exc:
                        continue
            keep.append(t)
        self.tracked = keep

    def harvest(self, stats: Callable[[], Stats | None], keep_rows: bool) -> list[BaseException]:
        """Turn finished saves into metric rows; return the failures (each raised once by wait).
        ``stats`` is called only when a save has finished (this runs after every batch)."""
        done = [t for t in self.tracked if t.handle.done() and t not in self._unfenced]
        if not done:
            return []
        now = stats() if keep_rows else None
        self.tracked = [t for t in self.tracked if t not in done]
        errors: list[BaseException] = []
        for t in done:
            try:
                rec = t.handle.wait()
            except BaseException as exc:  # noqa: BLE001 (returned to the caller to raise)
                errors.append(exc)
                continue
            if keep_rows:
                self._rows.append(row(t, rec, now))
        return errors

    def drain_rows(self) -> list[dict[str, float]]:
        rows, self._rows = self._rows, []
        return rows


def row(t: Tracked, rec: SaveRecord, stats: Stats | None) -> dict[str, float]:
    """The ``ckpt/*`` metrics of one save (docs/lightning.md says what each one means)."""
    out = {"ckpt/blocked_s": (rec.blocked_s if t.blocked_s is None else t.blocked_s) + t.fence_s,
           "ckpt/write_GBps": rec.write_GBps, "ckpt/GB": rec.bytes / 1e9}
    if rec.durable_s is not None:
        out["ckpt/durable_s"] = rec.durable_s
        if rec.local_durable_s is not None:
            out["ckpt/replication_lag_s"] = rec.durable_s - rec.local_durable_s
    if stats is not None:
        out["ckpt/overhead_pct"] = 100.0 * stats.overhead
        out["ckpt/over_budget"] = float(stats.over_budget)
    if t.step is not None:
        out["ckpt/step"] = float(t.step)
    if rec.skipped:
        out["ckpt/skipped"] = 1.0
    if rec.superseded:  # a newer save to the same path was replicated instead of this one
        out["ckpt/superseded"] = 1.0
    return out


def copy_unfenced_tensors(checkpoint: object, params: Iterable[torch.Tensor],
                          optimizers: Iterable[torch.optim.Optimizer]) -> object:
    """Lazy mode defers only what the fence protects: parameters and optimizer state (changed
    only by the optimizer step). Everything else, such as BatchNorm buffers that forward
    updates or a user's extras, is copied now (``fastckpt.save.fencing``)."""
    protected = list(params)
    for opt in optimizers:
        protected.extend(optimizer_tensors(opt))
    return copy_unfenced(checkpoint, protected)


def state_nbytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> tuple[int, bool]:
    """The bytes a checkpoint of ``module`` and ``optimizers`` will hold in tensors, each storage
    padded to the file's alignment as the core lays it out, and whether any is on a CUDA device."""
    from fastckpt.format.layout import ALIGN

    seen: dict[tuple[str, int], int] = {}
    tensors = list(module.state_dict(keep_vars=True).values())
    for opt in optimizers:
        for st in opt.state.values():
            tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[storage_key(t)] = t.untyped_storage().nbytes()
    total = sum((n + ALIGN - 1) // ALIGN * ALIGN for n in seen.values())
    return total, any(dev.startswith("cuda") for dev, _ in seen)
