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
import os

from ..errors import WRITE_FIXES, ConfigError, ReplicationError, file_in_the_way
from ..io.atomic import final_path
from .types import TargetNotFoundError, TargetPermissionError, storage_error

_READ_FIXES = {
    errno.EACCES: "fix the file's owner/mode, or run as a user who may read it",
    errno.EPERM: "fix the file's owner/mode, or run as a user who may read it",
    errno.EISDIR: "a directory stands where the file should be: name the file inside it",
    errno.EIO: WRITE_FIXES[errno.EIO],
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
    blocker = _blocker(exc) if code in (errno.EEXIST, errno.ENOTDIR) else None
    if code in (errno.ENOENT, errno.ENOTDIR):  # a key below a file is not there: a delete of it is done
        return storage_error(TargetNotFoundError, f"{what}: {blocker or exc}", exc)
    if blocker is not None:
        return storage_error(ReplicationError, f"{what}: {blocker}", exc)
    cls = TargetPermissionError if code in (errno.EACCES, errno.EPERM) else ReplicationError
    fix = WRITE_FIXES.get(code, "check the target file system")  # type: ignore[arg-type]
    return storage_error(cls, f"{what}: {exc.strerror or exc} ({root}); {fix}", exc)


def folder_gone(exc: FileNotFoundError, what: str, dest: str, local_path: str) -> OSError:
    """What a copy to ``dest`` raises for ``exc``: when the folder disappeared while it ran (removed by a
    cleanup job or another run, or an automounter dropped the path), an error that says so, chained to
    ``exc``, naming the local copy kept and the fix; else (another ``ENOENT``) ``exc`` itself."""
    folder, kept = os.path.dirname(dest), final_path(local_path) or local_path  # a version link's copy: save.versions
    if os.path.isdir(folder):
        return exc
    err = storage_error(TargetNotFoundError, f"{what}: the destination folder {folder} disappeared during the "
                        f"copy (removed, or its mount dropped); nothing was published there, and the checkpoint's "
                        f"local copy is kept at {kept}: recreate the folder and save again, or copy {kept} "
                        "there", exc)
    err.__cause__ = exc
    return err


def _blocker(exc: OSError) -> str | None:
    """A file where a directory must be: the directory a mkdir found taken (EEXIST), or one above
    the name a call could not reach (ENOTDIR); said as a save straight to its home says it."""
    if not exc.filename:
        return None
    name = os.fsdecode(exc.filename)
    return file_in_the_way(name if exc.errno == errno.EEXIST else os.path.dirname(name))


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
