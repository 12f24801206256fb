"""``load(..., prefetch=True)``: download a remote file into the burst buffer, verify it, and put
it at its local path only in place of the copy the load judged replaceable.

Another Checkpointer on the node (a training process beside an eval one, same ``local_dir``) may
save the same path while the download runs: that save's copy waits in the burst buffer for its
upload, and is its only copy. So the download is read and verified under a temp name beside the
local path, and then put there only if the path still holds what the load judged (``Loader.
_candidates``): nothing (a hard link, which fails when a file appeared meanwhile), or the older
copy it compared (its identity compared again, and the download renamed over it, under the
directory's lock, ``storage.places.dir_lock``, which a save's rename into the burst buffer holds
too). Otherwise the download is dropped and the load returns what it read, the home's copy, as a
load without ``prefetch`` does. A download that does not verify is dropped the same way: only
the load's own temp file is ever removed.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

from ..io.ops import FileOps
from ..storage.places import dir_lock

log = logging.getLogger("fastckpt")
#: The identity of no file: the download may only be linked in, never replace anything
NOTHING: tuple[int, ...] = ()
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK)  # a file system without hard links


def identity(path: str) -> tuple[int, ...]:
    """Which file ``path`` names now (``NOTHING`` when none): a save, or another download, renames
    a new file there, so another identity means another copy than the one judged."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return NOTHING
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_warned: set[str] = set()
_warned_lock = threading.Lock()


def local_identity(local: str, home: str) -> tuple[int, ...] | None:
    """``identity`` of the burst-buffer copy ``local`` of ``home``; None when it cannot be looked
    at: a folder of its path that cannot be searched (another user's mode-700 folder in a shared
    ``local_dir``: EACCES) or is a file (ENOTDIR). That copy is unusable, not the checkpoint: the
    load reads ``home``'s copy (no prefetch over it), and says so once per path."""
    try:
        return identity(local)
    except OSError as exc:
        with _warned_lock:
            first = local not in _warned
            _warned.add(local)
        if first:
            log.warning("fastckpt: the burst-buffer copy %s cannot be looked at (%s): loading %s instead. Make "
                        "its folder readable by this user, or move what blocks its path away", local, exc, home)
        return None


def put(ops: FileOps, tmp: str, local: str, judged: tuple[int, ...]) -> bool:
    """Put the verified download ``tmp`` at ``local`` if that still holds ``judged`` (its
    ``identity`` when the load judged it); whether it did. The caller removes ``tmp``."""
    where = os.path.dirname(local)
    if judged == NOTHING:
        try:
            ops.link(tmp, local)  # fails if a save (or another download) put a file there since
        except FileExistsError:
            return _kept(local)
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
        else:
            ops.fsync_dir(where)
            return True
    with dir_lock(where):
        if identity(local) != judged:
            return _kept(local)
        ops.replace(tmp, local)
        ops.fsync_dir(where)
    return True


def _kept(local: str) -> bool:
    log.info("fastckpt: %s was saved (or prefetched) again while the prefetch downloaded it: it stays, and the "
             "download is dropped", local)
    return False
