"""What a save returns: a handle to wait on and the record of its phases."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass

from .errors import CheckpointWriteError


@dataclass(frozen=True)
class SaveRecord:
    """Timings of one save, each measured from the ``save`` call (seconds).

    ``blocked_s``: the training thread was blocked (snapshot, and any wait for a staging
    buffer). ``write_s``: bytes written and synced in the first location. ``commit_s``: the
    file renamed into place there. ``local_durable_s``: durable in ``local_dir`` (nvme tier,
    else None). ``durable_s``: durable and verified at the path given to ``save``; None when
    ``superseded`` (replication coalesced it away: only the local copy exists), ``skipped``, or
    ``cancelled`` (``remove()`` deleted it while its replication was still queued). A group
    commit's record also tells what the commit cost this rank: ``store_ops`` and
    ``store_bytes`` (torch.distributed store operations and the bytes of their keys and
    values; 0 without a store) and ``commit_cpu_s`` (CPU seconds of the committing thread).
    ``requested_at``: the wall-clock time (``time.time()``) of the ``save`` call; the file's
    manifest records it, and ``latest`` orders single files by it.
    """

    path: str
    tier: str
    bytes: int
    blocked_s: float
    write_s: float
    commit_s: float
    durable_s: float | None
    local_durable_s: float | None = None
    checksum: str = ""
    odirect: bool = False
    odirect_reason: str | None = None
    rank: int = 0
    group: str | None = None
    skipped: bool = False
    superseded: bool = False
    cancelled: bool = False
    store_ops: int = 0
    store_bytes: int = 0
    commit_cpu_s: float = 0.0
    requested_at: float = 0.0

    @property
    def write_GBps(self) -> float:
        """Bytes over the time from snapshot to first durable copy (the I/O part)."""
        t = (self.local_durable_s or self.durable_s or 0.0) - self.blocked_s
        return self.bytes / t / 1e9 if t > 0 else 0.0


class SaveHandle:
    """A save in flight. ``wait()`` returns its SaveRecord once it is durable at its path.

    A failure is raised by ``wait()`` with its original type and traceback; if nobody waits,
    the Checkpointer raises it once at its next sync point (``save``, ``commit``, ``wait``,
    ``close``).
    """

    def __init__(self, future: Future, path: str, on_seen) -> None:  # noqa: ANN001
        self._future = future
        self.path = path
        self._on_seen = on_seen

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(self)`` once the save has ended (durable, failed, skipped or never written),
        on the thread that ended it, or at once on this one if it has. ``fn`` must not raise."""
        self._future.add_done_callback(lambda _future: fn(self))

    def result(self, timeout: float | None = None) -> SaveRecord:
        """Like ``wait()``, for fastckpt's own background steps that wait on a save (a group
        commit waits for its files): a failure raised here still counts as unseen, so the
        Checkpointer's next sync point raises it to the user once."""
        return self._future.result(timeout)

    def wait(self, timeout: float | None = None) -> SaveRecord:
        try:
            return self._future.result(timeout)
        except CancelledError:
            raise not_written(self.path) from None
        except BaseException as exc:
            self._on_seen(exc)
            raise

    @classmethod
    def finished(cls, record: SaveRecord) -> SaveHandle:
        f: Future = Future()
        f.set_result(record)
        return cls(f, record.path, lambda exc: None)


def not_written(path: str) -> CheckpointWriteError:
    """A save's next step never ran: ``close()`` stopped its workers first (``close_timeout_s``
    passed, or it was interrupted)."""
    return CheckpointWriteError(f"{path} was not saved: close() stopped before this save's next step started "
                                "(close_timeout_s passed, or it was interrupted); it was not published, and the "
                                "checkpoint before it is untouched")


STOPPED = "close() stopped without them"  # how stopped_note begins


def stopped_note(local_dirs: tuple[str, ...]) -> str:
    """What ``close()`` adds to its timeout's error once it stops without the pending saves."""
    kept = f"; copies already in the burst buffer stay there ({', '.join(local_dirs)})" if local_dirs else ""
    return (f"{STOPPED}: a save whose write had not started is not written (its handle raises "
            f"CheckpointWriteError), and the checkpoint before each is untouched{kept}")
