"""Megatron-LM's tracker file, and waiting for a group's commit from any process.

Megatron-LM names the newest checkpoint in ``<save dir>/latest_checkpointed_iteration.txt``
(an iteration number, or ``release``); its checkpoints are ``<save dir>/iter_NNNNNNN``.
fastckpt's own truth is the group manifest: an iteration is complete once
``iter_NNNNNNN/fastckpt-manifest.json`` exists. The tracker is only ever moved forward, to a
complete iteration, atomically (temp, fsync, rename, directory fsync): ``advance_tracker``
right after the commit, ``sync_tracker`` at load time (a kill between the manifest and the
tracker's rename leaves the tracker one iteration behind; the loader moves it on).

``await_commit`` is the ``async_fn`` of the AsyncRequest the save strategy returns: Megatron
runs it in the training process (``execute_sync``), in a forked child (its temporal async
caller) or in a spawned worker (the persistent one), and treats its return as "this rank's
part is done". In the training process it waits for the save's ``Watch``; elsewhere it polls
for the group manifest that carries the save's id. Failure notes (``Watch`` writes one when a
rank's commit fails) end every rank's wait at once instead of at the commit timeout.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from fastckpt.errors import CheckpointWriteError, CommitTimeoutError
from fastckpt.io.ops import FileOps
from fastckpt.records import SaveHandle, SaveRecord

from .compat import publish_bytes, read_group_manifest
from .inplace import restore, restore_after

log = logging.getLogger("fastckpt.megatron")

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_(\d{7,})")
_lock = threading.Lock()  # the committer's watchers and Megatron-LM's finalize both advance it


def iteration_of(group: str) -> int | str | None:
    """The iteration a Megatron-LM checkpoint directory holds (``release`` for release)."""
    name = os.path.basename(os.path.normpath(group))
    if name == "release":
        return "release"
    m = _ITER_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def _group_of(save_dir: str, iteration: int | str) -> str:
    return os.path.join(save_dir, "release" if iteration == "release" else f"iter_{int(iteration):07d}")


def read_tracker(save_dir: str) -> int | str | None:
    """What the tracker names: an iteration, ``release``, or None (no or unreadable tracker)."""
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if text == "release":
        return text
    return int(text) if text.isdigit() else None


def is_complete(save_dir: str, iteration: int | str) -> bool:
    """True once the iteration's group manifest exists (every rank's files are durable)."""
    return read_group_manifest(_group_of(save_dir, iteration)) is not None


def advance_tracker(save_dir: str, iteration: int | str, *, ops: FileOps | None = None) -> bool:
    """Point Megatron-LM's tracker at ``iteration``, if that checkpoint is complete and newer.

    Args:
        save_dir: the directory holding ``iter_NNNNNNN`` checkpoints (Megatron-LM's ``--save``).
        iteration: the iteration saved, or ``"release"``.
        ops: the FileOps to write through.

    Returns:
        Whether the tracker moved (it never moves backward, nor to an incomplete checkpoint).
    """
    if not is_complete(save_dir, iteration):
        log.warning("fastckpt: not pointing %s at iteration %s: that checkpoint is not complete",
                    os.path.join(save_dir, TRACKER), iteration)
        return False
    with _lock:
        current = read_tracker(save_dir)
        if isinstance(current, int) and iteration != "release" and current >= int(iteration):
            return False
        publish_bytes(ops or FileOps(), os.path.join(save_dir, TRACKER), str(iteration).encode())
    return True


def newest_complete_iteration(save_dir: str) -> int | None:
    """The highest ``iter_NNNNNNN`` under ``save_dir`` whose group manifest exists."""
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return None
    found = sorted((int(m.group(1)) for n in names if (m := _ITER_DIR.fullmatch(n))), reverse=True)
    return next((it for it in found if is_complete(save_dir, it)), None)


def sync_tracker(save_dir: str, *, load_iteration: int | None = None, ops: FileOps | None = None
                 ) -> int | str | None:
    """Move the tracker forward to the newest complete iteration and return what it names.

    Call it before Megatron-LM reads the tracker (the patch in examples/megatron does, on
    every rank: each reaches the same answer from the same files). It also puts back the
    files megatron rewrites in place (``common.pt``, ``metadata.json``) of the iteration the
    tracker then names, and of ``load_iteration`` (Megatron-LM's ``--ckpt-step``), where a save
    into that committed iteration was killed (``_megatron.inplace``).
    """
    newest = newest_complete_iteration(save_dir)
    current = read_tracker(save_dir)
    if newest is not None and current != "release" and (current is None or newest > current):
        advance_tracker(save_dir, newest, ops=ops)
        current = newest
    for it in {current, load_iteration} - {None}:
        restore(_group_of(save_dir, it), ops or FileOps())  # type: ignore[arg-type]
    return current


# ---------------------------------------------------------------------------------- waiting
def _note(group: str, save_id: str, rank: int, kind: str) -> str:
    return os.path.join(group, f".fastckpt-megatron-{save_id}-rank{rank:05d}.{kind}")


def _notes(group: str, save_id: str) -> dict[str, str]:
    """This save's notes in ``group``: file name -> text."""
    prefix = f".fastckpt-megatron-{save_id}-"
    out = {}
    try:
        names = [n for n in os.listdir(group) if n.startswith(prefix)]
    except FileNotFoundError:
        return out
    for n in names:
        try:
            with open(os.path.join(group, n)) as f:
                out[n] = f.read()
        except FileNotFoundError:
            continue
    return out


@dataclass(frozen=True)
class Job:
    """What ``await_commit`` needs; plain values, so Megatron can pickle it to a spawned worker."""

    group: str
    save_id: str
    rank: int
    timeout_s: float


class Watch:
    """Follows one rank's commit in the training process (a daemon thread per save).

    On success rank 0 advances the tracker (when the group is a Megatron-LM iteration
    directory and ``tracker`` is set); on failure it leaves a note in the group, which ends
    every rank's ``await_commit``. ``error`` keeps the failure for the finalize step.
    """

    def __init__(self, handle: SaveHandle, job: Job, tracker: bool, ops: FileOps) -> None:
        self.handle, self.job, self.pid = handle, job, os.getpid()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.record: SaveRecord | None = None
        self._tracker, self._ops = tracker, ops
        threading.Thread(target=self._run, name="fastckpt-megatron-watch", daemon=True).start()

    def _run(self) -> None:
        job = self.job
        try:
            self.record = self.handle.wait()
            if self.record.superseded:
                self._leave("superseded", "replication coalesced this checkpoint away (replicate_policy='coalesce')")
            elif self._tracker and job.rank == 0:
                advance_tracker(os.path.dirname(job.group), iteration_of(job.group), ops=self._ops)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 (kept for finalize, which raises it)
            if job.rank == 0:  # before finalize can raise it: the committed checkpoint is whole again
                restore_after(job.group, self._ops, exc)
            self.error = exc
            self._leave("failed", repr(exc))
        finally:
            self.done.set()

    def _leave(self, kind: str, text: str) -> None:
        try:
            publish_bytes(self._ops, _note(self.job.group, self.job.save_id, self.job.rank, kind), text.encode())
        except OSError as exc:  # the other ranks then wait until the commit timeout instead
            log.warning("fastckpt: could not leave a %s note in %s: %s", kind, self.job.group, exc)


_watches: dict[str, Watch] = {}  # save id -> this process's watch of it


def watch(handle: SaveHandle, job: Job, tracker: bool, ops: FileOps) -> Watch:
    w = _watches[job.save_id] = Watch(handle, job, tracker, ops)
    return w


def forget(save_id: str) -> None:
    _watches.pop(save_id, None)


def failures(job: Job) -> list[str]:
    """The notes of ranks whose commit of this save failed (``failed`` notes), as messages."""
    return [f"{name}: {text}" for name, text in sorted(_notes(job.group, job.save_id).items())
            if name.endswith(".failed")]


def await_commit(job: Job) -> None:
    """Return once ``job``'s group is committed (or dropped by coalescing replication).

    Raises:
        CheckpointWriteError: some rank's commit failed (its note is in the message).
        CommitTimeoutError: nothing happened within ``job.timeout_s``.
    """
    w = _watches.get(job.save_id)
    local = w is not None and w.pid == os.getpid()  # a forked child sees the dict, not the thread
    deadline, delay = time.monotonic() + job.timeout_s, 0.005
    while True:
        if local and w.done.is_set():  # type: ignore[union-attr]
            if w.error is not None:  # type: ignore[union-attr]
                raise cause(job, w.error)  # type: ignore[union-attr]
            return
        if not local and committed(job):
            return
        failed = failures(job)
        if failed:
            raise failed_error(job, failed)
        if time.monotonic() >= deadline:
            raise CommitTimeoutError(f"{job.group} was not committed within {job.timeout_s:.0f} s (commit_timeout_s); "
                                     "some rank did not finish its part (see its log)")
        if local:
            w.done.wait(delay)  # type: ignore[union-attr]
        else:
            time.sleep(delay)  # another process: the files are the only signal
        delay = min(delay * 2, 0.2)


def failed_error(job: Job, failed: list[str]) -> CheckpointWriteError:
    return CheckpointWriteError(f"saving {job.group} failed on another rank: {'; '.join(failed)}. This "
                                "checkpoint is incomplete; the previous one is intact")


def cause(job: Job, error: BaseException) -> BaseException:
    """This rank's commit ``error``, or, when it only timed out and another rank left a failure
    note, that rank's failure (the cause; the timeout is its consequence)."""
    failed = failures(job) if isinstance(error, CommitTimeoutError) else []
    if not failed:
        return error
    return failed_error(job, failed)


def committed(job: Job) -> bool:
    """True once ``job``'s group manifest is published (or the save was dropped by coalescing
    replication, which a note says)."""
    manifest = _manifest(job.group)
    if manifest is not None and manifest.get("megatron_save") == job.save_id:
        return True
    return any(n.endswith(".superseded") for n in _notes(job.group, job.save_id))


def _manifest(group: str) -> dict | None:
    try:
        return read_group_manifest(group)
    except (OSError, ValueError):  # being replaced, or half-visible on a network filesystem
        return None
