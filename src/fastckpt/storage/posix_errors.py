"""What a ``PosixTarget`` raises for a system call that failed for good, and the fix it names.

A write's failure is the target's ``ReplicationError`` (a ``CheckpointWriteError``). A read's is
not: a load, ``latest`` or a prefetch that cannot read a file did not fail to write anything,
and code that resumes catches the load's errors. So a read raises the ``OSError`` itself (its
type and errno kept, a note naming the read and the fix), a name that can never be opened
(longer than the file system allows, or a symbolic link loop) a ``ConfigError`` naming it, and a
missing file ``TargetNotFoundError``, which the loader reports as ``CheckpointNotFoundError``.
"""

from __future__ import annotations

import errno

from ..errors import ConfigError, ReplicationError
from .types import TargetNotFoundError, TargetPermissionError, storage_error

FIXES = {
    errno.ENOSPC: "free space on the target (or prune old checkpoints there), or choose a larger target",
    errno.EDQUOT: "the disk quota is exhausted: free space or ask for a larger quota",
    errno.EROFS: "the file system is mounted read-only: remount it read-write or choose another target",
    errno.EACCES: "fix the directory's owner/mode, or run as a user who may write there",
    errno.EPERM: ("fix the directory's owner/mode, or run as a user who may write there; or the file is immutable or "
                  "append-only (lsattr shows 'i' or 'a': chattr -i / chattr -a clears it)"),
    errno.EISDIR: "a directory stands where the file goes: name a file inside it, or move the directory away",
    errno.EIO: "the storage reported an I/O error: check the mount (dmesg) and the storage system's health",
}
_READ_FIXES = {
    errno.EACCES: "fix the file's owner/mode, or run as a user who may read it",
    errno.EPERM: "fix the file's owner/mode, or run as a user who may read it",
    errno.EISDIR: "a directory stands where the file should be: name the file inside it",
    errno.EIO: FIXES[errno.EIO],
}
_BAD_NAMES = {
    errno.ENAMETOOLONG: "a name in it is longer than the file system allows (usually 255 bytes): shorten it",
    errno.ELOOP: "a symbolic link in it leads back to itself (a loop): fix or remove the link",
}


def permanent(exc: BaseException, what: str, root: str) -> ReplicationError | None:
    """The ``ReplicationError`` for a write's permanent error ``exc`` (None: not a storage error)."""
    if not isinstance(exc, OSError):
        return None
    code = exc.errno
    if code in (errno.ENOENT, errno.ENOTDIR):
        return storage_error(TargetNotFoundError, f"{what}: {exc}", exc)
    cls = TargetPermissionError if code in (errno.EACCES, errno.EPERM) else ReplicationError
    fix = FIXES.get(code, "check the target file system")  # type: ignore[arg-type]
    return storage_error(cls, f"{what}: {exc.strerror or exc} ({root}); {fix}", exc)


def permanent_read(exc: BaseException, what: str, root: str) -> ReplicationError | None:
    """``TargetNotFoundError`` for a missing file; None (``exc`` itself, with a note) for any
    other ``OSError`` of a read, whose ``ConfigError`` it raises for a name that cannot be opened.

    Raises:
        ConfigError: the name is too long, or leads through a symbolic link loop.
    """
    if not isinstance(exc, OSError):
        return None
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return storage_error(TargetNotFoundError, f"{what}: {exc}", exc)
    if exc.errno in _BAD_NAMES:
        raise ConfigError(f"{what}: the name cannot be opened ({exc.strerror or exc}): {_BAD_NAMES[exc.errno]}") \
            from exc
    exc.add_note(f"{what} ({root}): {_READ_FIXES.get(exc.errno, 'check the file system and the path')}")  # type: ignore[arg-type]
    return None
