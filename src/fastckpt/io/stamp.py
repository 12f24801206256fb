"""Dating a file as it becomes final (``Staged.stamp``), and telling once what a file system
cannot do of it.

Every file fastckpt makes final on a file system is dated ``final_mtime_ns`` just before its
rename, so that files made final one after another are ordered by mtime. A home that refuses to
set times (a FUSE, NFS or SMB mount that lets the writer write but not date) refuses it for
every file: told at WARNING each time, a sharded job logged one per file of every save. It is
told at WARNING once per Checkpointer (its ``FileOps``) and file system, at DEBUG after.

A file system whose timestamps are coarse (seconds: ext4 with 128-byte inodes, FAT's 2 s, NFS
servers and FUSE mounts that keep seconds) truncates the time set: files made final back to
back tie, and a reader that takes the newest by mtime takes either. The time kept is read back
and compared; one coarser than ``FINAL_MTIME_STEP_NS`` (which the order needs) is told the same
way. Microseconds are fine: the step is 2 µs.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

from .ops import FINAL_MTIME_STEP_NS, FileOps, final_mtime_ns

log = logging.getLogger(__name__)

#: per FileOps (one per Checkpointer), what it was told of which file systems: (what, st_dev)
_told: weakref.WeakKeyDictionary[FileOps, set[tuple[str, int | str]]] = weakref.WeakKeyDictionary()
_told_lock = threading.Lock()


def stamp(ops: FileOps, tmp: str, dest: str) -> None:
    """Date ``tmp`` (about to be renamed to ``dest``) as final now. A failure costs only the order
    by mtime: it is told (``_tell``) and the file is published all the same."""
    ns = final_mtime_ns()
    try:
        ops.utime(tmp, ns)
    except FileNotFoundError:  # gone (its folder removed meanwhile): its publish fails and says so; no file to date
        return
    except OSError as exc:
        _tell(ops, "utime", tmp, "fastckpt: could not set the modification time of %s (%s): a reader that takes the "
              "newest file by mtime may pick a file made final before it", dest, exc)
        return
    try:
        kept = os.stat(tmp).st_mtime_ns
    except OSError:  # gone meanwhile: its publish fails and says so
        return
    if abs(kept - ns) >= FINAL_MTIME_STEP_NS:  # kept coarser than the step: files made final back to back tie
        _tell(ops, "coarse", tmp, "fastckpt: the file system of %s keeps coarse modification times (set %d ns, it kept "
              "%d): it cannot order files by mtime, and files made final within one of its ticks tie, so a reader "
              "that takes the newest file by mtime (Lightning's ckpt_path=\"last\") may pick an older one: resume "
              "from fastckpt.latest(<the run's directory>) or the newest step instead", dest, ns, kept)


def _tell(ops: FileOps, what: str, path: str, msg: str, *args: object) -> None:
    """Log ``msg`` at WARNING the first time ``ops`` meets ``what`` on ``path``'s file system, then at DEBUG."""
    try:
        fs: int | str = os.stat(path).st_dev
    except OSError:  # gone meanwhile: its directory stands for its file system
        fs = os.path.dirname(path)
    with _told_lock:
        told = _told.setdefault(ops, set())
        first = (what, fs) not in told
        told.add((what, fs))
    if first:
        log.warning(msg + " (said once per file system; the next ones at DEBUG)", *args)
    else:
        log.debug(msg, *args)
