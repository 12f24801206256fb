"""Writing a file a user named on the command line (``report -o``/``--html``).

A regular file (or a name not yet taken) is replaced as a manifest is: a temp file beside it,
fsync, rename, so a write that fails or is killed midway leaves the previous file whole. The
temp file takes the old file's mode (and owner, where this user may give it), so a private
report stays private. What is no regular file (``/dev/stdout``, a named pipe, ``>(gzip > f)``,
a device) is written in place as a stream, as ``open`` would: renaming over it would replace the
pipe its reader waits on, or as root the device node. A file in a folder this user may not write
is refused (the caller names the fix), never rewritten in place, where a failed write would leave
a part of the new report. The target is reached through a user's symlink.
"""

from __future__ import annotations

import contextlib
import os
import stat

from ..io.atomic import Staged
from ..io.ops import FileOps


def write_output(path: str, data: bytes) -> None:
    """Put ``data`` at ``path`` (see the module's docstring).

    Raises:
        OSError: it cannot be written; the previous file, if any, is left whole.
    """
    try:  # through the name as given: /dev/stdout's realpath (/proc/PID/fd/pipe:[N]) names nothing
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, "wb") as f:  # a stream: the name stands for what it opens
            f.write(data)
        return
    # io.atomic's recipe (temp beside it, fsync, rename, folder fsync) at the file a symlink names
    staged = Staged(FileOps(), os.path.realpath(path))
    try:
        # 0o666 less the umask, as open() makes a new file; a folder this user may not write: refused
        with os.fdopen(os.open(staged.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
            f.flush()
            if st is not None:
                with contextlib.suppress(OSError):  # another user's file: it becomes this user's
                    os.fchown(f.fileno(), st.st_uid, st.st_gid)
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))  # after chown, which clears set-id bits
            os.fsync(f.fileno())
        staged.commit()
    except BaseException as exc:
        staged.discard()  # (nothing once renamed)
        if not (staged.renamed and isinstance(exc, OSError)):
            raise
        # it is in place; a folder that cannot be synced (write-only, some FUSE) only risks a power loss
