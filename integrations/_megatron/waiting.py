"""Waiting for a group's commit from any process, and following it in the training process.

``await_commit`` is the ``async_fn`` of the AsyncRequest the save strategy returns: Megatron
runs it in the training process (``execute_sync``), in a forked child (its temporal async
caller) or in a spawned worker (the persistent one), and treats its return as "this rank's
part is done". In the training process it waits for the save's ``Watch``; elsewhere it polls
for the group manifest that carries the save's id. Failure notes (``Watch`` writes one when a
rank's commit fails) end every rank's wait at once instead of at the commit timeout.

Outside the training process a failure or the deadline ends the wait without an error: the
finalize step (``_finalize`` in ``megatron.py``, training thread) raises the save's real error,
as megatron's own ``torch_dist`` async function leaves its errors to finalize. megatron-core
0.16.1's persistent worker (``PersistentAsyncCaller.async_loop``) catches nothing: an error
raised there killed it, so no later save was ever finalized and the blocking finalize at exit
waited for ever.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass

from fastckpt.errors import CheckpointWriteError, CommitTimeoutError
from fastckpt.io.ops import FileOps
from fastckpt.records import SaveHandle, SaveRecord

from .compat import after_flush, publish_bytes, read_group_manifest
from .inplace import restore_after
from .tracker import TRACKER, advance_tracker, iteration_of

log = logging.getLogger("fastckpt.megatron")
EXIT_WAIT_S = 60.0  # at exit, for a watch whose commit ended: a few small writes (the tracker, a note) are left


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
    timeout_s: float | None  # None: no deadline of its own (a burst buffer's copy home has none either)


class Watch:
    """Follows one rank's commit in the training process (a daemon thread per save).

    On success rank 0 advances the tracker (when the group is a Megatron-LM iteration
    directory and ``tracker`` is set; a failure to write it is logged, not raised: the
    checkpoint is committed on every rank). On failure the rank puts back what megatron
    rewrote in the committed checkpoint, then leaves a note in the group, which ends every
    rank's ``await_commit``. ``error`` keeps the failure for the finalize step.
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
        except BaseException as exc:  # noqa: BLE001 (kept for finalize, which raises it)
            # every rank, before its error can reach a caller, and before its note ends the other
            # ranks' waits: the committed checkpoint is whole again (the same bytes, atomically)
            restore_after(job.group, self._ops, exc)
            self.error = exc
            self._leave("failed", repr(exc))
            self.done.set()
            return
        try:
            if self.record.superseded:
                self._leave("superseded", "replication coalesced this checkpoint away (replicate_policy='coalesce')")
            elif self._tracker and job.rank == 0:
                advance_tracker(os.path.dirname(job.group), iteration_of(job.group), ops=self._ops)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 (the checkpoint is committed, on every rank: no failure of the save)
            log.error("fastckpt: %s is committed, but %s could not be pointed at it (%r); the patched Megatron-LM's "
                      "sync_tracker moves it there before the next load", job.group,
                      os.path.join(os.path.dirname(job.group), TRACKER), exc)
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


def settle_at_exit() -> None:
    """Interpreter exit, after every Checkpointer's flush (``fastckpt.exits.after_flush``): let
    this process's watches of commits that ended finish what follows them (rank 0's tracker).

    A script that exits without megatron's finalize step left that to the watch's daemon
    thread, which the interpreter froze mid-write: the checkpoint was committed, but the
    tracker still named an older one (a resume from it silently took older state) and its temp
    file stayed. A watch that does not finish within ``EXIT_WAIT_S`` is logged as an ERROR.
    A commit the flush gave up on (``close_timeout_s``) has nothing to follow: the flush logged it.
    """
    for w in [w for w in list(_watches.values()) if w.pid == os.getpid() and w.handle.done()]:
        if not w.done.wait(EXIT_WAIT_S) and w._tracker and w.job.rank == 0 and _committed(w.handle):
            log.error("fastckpt: %s is committed, but %s could not be pointed at it before the process exited "
                      "(still being written after %.0f s); the patched Megatron-LM's sync_tracker moves it there "
                      "before the next load", w.job.group, os.path.join(os.path.dirname(w.job.group), TRACKER),
                      EXIT_WAIT_S)


def _committed(handle: SaveHandle) -> bool:
    """Whether the ended commit ``handle`` follows reached its home (a failure is not seen here:
    whoever waits for it raises it)."""
    try:
        return not handle.result(0).superseded
    except Exception:  # noqa: BLE001 (failed: the flush or finalize reports it)
        return False


after_flush(settle_at_exit)


def failures(job: Job) -> dict[int, str]:
    """The notes of ranks whose commit of this save failed (``failed`` notes): rank -> message."""
    out = {}
    for name, text in sorted(_notes(job.group, job.save_id).items()):
        if name.endswith(".failed"):
            out[int(name.removesuffix(".failed").rsplit("-rank", 1)[1])] = f"{name}: {text}"
    return out


def await_commit(job: Job) -> None:
    """Return once ``job``'s group is committed (or dropped by coalescing replication); outside
    the training process also once some rank's commit failed or ``job.timeout_s`` passed, logged
    at WARNING: the finalize step raises the save's error on the training thread (an error
    raised in megatron's persistent worker kills it).

    Raises:
        CheckpointWriteError: in the training process, some rank's commit failed (its error on
            this rank, the failed rank's note on the others).
    """
    w = _watches.get(job.save_id)
    local = w is not None and w.pid == os.getpid()  # a forked child sees the dict, not the thread
    # In this process the commit's own end is waited for: it is bounded (after this rank's write,
    # which no timeout bounds, by commit_timeout_s). A deadline from the request would also bound
    # the write, and give up on a slow write whose save then commits. Another process has only the
    # files to go by, and keeps the deadline (a killed rank leaves no note).
    timeout_s = None if local else job.timeout_s
    deadline, delay = time.monotonic() + (timeout_s if timeout_s is not None else math.inf), 0.005
    while True:
        if local and w.done.is_set():  # type: ignore[union-attr]
            if w.error is not None:  # type: ignore[union-attr]
                raise cause(job, w.error)  # type: ignore[union-attr]
            return
        if not local and committed(job):
            return
        failed = failures(job)
        if failed and not (local and set(failed) == {job.rank}):  # this rank's own: its watch ends next
            if local:
                raise failed_error(job, failed)
            log.warning("fastckpt: %s (seen by megatron's async worker; megatron's finalize step raises it on the "
                        "training thread)", failed_error(job, failed))
            return
        if time.monotonic() >= deadline:
            log.warning("fastckpt: %s was not committed within %.0f s, as seen by megatron's async worker (which has "
                        "only the files to go by); megatron's finalize step waits for the commit on the training "
                        "thread and raises its failure, if any", job.group, timeout_s)
            return
        if local:
            w.done.wait(delay)  # type: ignore[union-attr]
        else:
            time.sleep(delay)  # another process: the files are the only signal
        delay = min(delay * 2, 0.2)


def failed_error(job: Job, failed: dict[int, str]) -> CheckpointWriteError:
    """The error for ``failed`` (``failures``), naming the ranks as this rank sees them."""
    others = sorted(r for r in failed if r != job.rank)
    who = ([f"this rank ({job.rank})"] if job.rank in failed else []) + \
        ([f"another rank ({', '.join(map(str, others))})"] if others else [])
    return CheckpointWriteError(f"saving {job.group} failed on {' and '.join(who)}: "
                                f"{'; '.join(failed[r] for r in sorted(failed))}. This checkpoint is incomplete; "
                                "the previous one is intact")


def cause(job: Job, error: BaseException) -> BaseException:
    """This rank's commit ``error``, or, when it only timed out and another rank left a failure
    note, that rank's failure (the cause; the timeout is its consequence)."""
    failed = {r: n for r, n in failures(job).items() if r != job.rank} if isinstance(error, CommitTimeoutError) \
        else {}
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
