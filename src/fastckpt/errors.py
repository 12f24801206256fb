"""fastckpt's exceptions: one base, a few subclasses that also derive the natural builtin."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

# The fix a write's OSError names, wherever the write ran: a save straight to its home
# (``inflight.raise_as_write_error``), a copy to it (``storage.posix_errors``), a burst buffer.
WRITE_FIXES = {
    errno.ENOSPC: "free space on the target (or prune old checkpoints there), or choose a larger target",
    errno.EDQUOT: "the disk quota is exhausted: free space or ask for a larger quota",
    errno.EROFS: "the file system is mounted read-only: remount it read-write or choose another target",
    errno.EACCES: "fix the directory's owner/mode, or run as a user who may write there",
    errno.EPERM: ("fix the directory's owner/mode, or run as a user who may write there; or the file is immutable or "
                  "append-only (lsattr shows 'i' or 'a': chattr -i / chattr -a clears it)"),
    errno.EISDIR: "a directory stands where the file goes: name a file inside it, or move the directory away",
    errno.EIO: "the storage reported an I/O error: check the mount (dmesg) and the storage system's health",
}


class FastCkptError(Exception):
    """Base of every error fastckpt raises on purpose."""


class ConfigError(FastCkptError, ValueError):
    """An option or argument is invalid; the message names it and the fix."""


class UnsupportedObjectError(FastCkptError, TypeError):
    """The state to save holds something fastckpt cannot write; the message names the key."""


class CheckpointWriteError(FastCkptError, OSError):
    """Writing, syncing or publishing a checkpoint failed; the previous checkpoint is intact."""


class CorruptCheckpointError(FastCkptError, ValueError):
    """A file's bytes do not match the checksum recorded when it was written."""


class UnverifiableCheckpointError(CorruptCheckpointError):
    """``load(..., verify=True)`` of a file that carries no fastckpt manifest (a plain
    torch.save file): nothing records what its bytes should be."""


class CheckpointNotFoundError(FastCkptError, FileNotFoundError):
    """The checkpoint to load is not there: never saved at that path, or deleted since (retention,
    ``remove``); the message says which copies were looked at."""


class IncompleteCheckpointError(FastCkptError, FileNotFoundError):
    """A checkpoint was never committed: files or ranks are missing (named in the message)."""


class GroupRemovedError(IncompleteCheckpointError):
    """A group was removed (``Checkpointer.remove``) while it was being saved or committed; its
    commit fails at once and nothing of it is published."""


class GroupChangedError(FastCkptError, RuntimeError):
    """A group was re-saved (a new attempt swapped in) while ``Checkpointer.reading`` read it:
    the file just read is of the new save, the ones read before of the old one. Load again."""


class CommitTimeoutError(FastCkptError, TimeoutError):
    """Not every rank committed its part of a group within the timeout."""


class TierUnavailableError(FastCkptError, RuntimeError):
    """The requested storage tier cannot be used here; the message says why."""


class ReplicationError(CheckpointWriteError):
    """Copying a committed checkpoint to its durable home failed after all retries (a
    CheckpointWriteError: the previous checkpoint there is intact, except at an object store
    where the failure came after the object of the same key was replaced: docs/faults.md)."""


class ClosedError(FastCkptError, RuntimeError):
    """The Checkpointer was closed; create a new one."""


def blocking_file(directory: str) -> str | None:
    """The file (or link to none) standing where ``directory`` or one of its parents must be a
    directory, the one nearest the root; None if there is none."""
    parts = os.path.abspath(directory).split(os.sep)
    for i in range(2, len(parts) + 1):
        p = os.sep.join(parts[:i])
        if os.path.lexists(p) and not os.path.isdir(p):
            return p
    return None


def file_in_the_way(directory: str) -> str | None:
    """Why a write into ``directory`` failed with EEXIST or ENOTDIR, when a file stands where it or
    one of its parents must be a directory: that file named, and the fix; None if there is none."""
    p = blocking_file(directory)
    if p is None:
        return None
    if os.path.islink(p) and not os.path.exists(p):  # a link to nothing (a drive not mounted here): no file to move
        try:
            os.stat(p)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return (f"{p} is a symbolic link that leads back to itself (a loop): point it at a directory, "
                        "or remove it")
        return (f"{p} is a symbolic link to {os.path.realpath(p)}, which does not exist (create it or mount its "
                "drive, or choose another path)")
    return f"{p} is a file, not a directory (choose another path, or move that file away)"


@contextmanager
def refused_once_closed(what: str, lost: str = "nothing of it was written") -> Iterator[None]:
    """Hand work to a Checkpointer's worker pool: one that ``close()`` (or the exit flush, when the
    main thread ended) shut down while ``what`` was under way on another thread is ``ClosedError``,
    not concurrent.futures' bare ``RuntimeError``."""
    try:
        yield
    except RuntimeError as exc:
        if "after shutdown" not in str(exc) and "interpreter shutdown" not in str(exc):
            raise
        if "interpreter shutdown" in str(exc):  # the pools refuse work once the main thread ended: any Checkpointer
            raise ClosedError(f"{what} cannot run at interpreter exit: once the main thread has ended (an atexit "
                              f"handler runs after that), Python's thread pools refuse new work, a new Checkpointer's "
                              f"too: {lost}. Save before the main thread returns (in a finally block), and join a "
                              "thread that saves before it returns") from exc
        raise ClosedError(f"this Checkpointer was closed (by close(), or by the exit flush when the main thread ended) "
                          f"while {what} was under way: {lost}. Create a new Checkpointer, or "
                          "join the thread that saves before closing") from exc
