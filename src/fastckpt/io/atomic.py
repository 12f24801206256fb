"""The one recipe that publishes a file: temp name beside it -> write and fsync -> rename over
the final name -> fsync the directory. A reader sees the old file or the new one, never a part.

``Staged`` is the recipe in two steps (the save pipeline times the write and the rename as
separate phases); ``replacing`` is the same as a context manager; ``publish_bytes`` writes a
small file (manifest, marker, pointer) with it. Temp names carry this host, its PID namespace
and the process, so a process that starts later can tell a dead writer's leftovers from a live
one's
(``sweep_stale_tmp``). Every call goes through ``FileOps``.

Replacing a large file frees the old one's blocks, and the rename that drops its last name pays
for that: on ext4 mounted with ``discard`` (common on cloud VMs and NVMe) a 1 GiB file took
0.22 s to free, measured, a third of the time to write it. With ``unlink_later`` the old file
first gets a second, temp name (a hard link), so the rename only moves a name; the temp name is
handed to ``unlink_later`` once the new file is durable, and the freeing runs off the path to
durable. A process killed in between leaves that temp name, which ``sweep_stale_tmp`` removes.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager

from ..exits import abandon_at_exit
from .ops import FileOps
from .stamp import stamp

log = logging.getLogger(__name__)
TMP_TAG = ".fastckpt-tmp-"
PROBE_TAG = ".fastckpt-probe-"
DOCTOR_PROBE_TAG = ".fastckpt-doctor-bw-"  # doctor's bandwidth probe (doctor/local.py), up to --probe-size
_PROBE_TAGS = (PROBE_TAG, DOCTOR_PROBE_TAG)


def _pid_namespace() -> str:
    """This process's PID namespace (``@`` and its inode), or "" where there is none to read.
    Containers with the host's network share its host name but not its PIDs: without the
    namespace in a temp name, one container would take another's live writer for a dead one."""
    try:
        return "@" + os.readlink("/proc/self/ns/pid").split("[", 1)[1].rstrip("]")
    except (OSError, IndexError):
        return ""


_HOST = socket.gethostname().replace(os.sep, "_") + _pid_namespace()  # whose PIDs a temp name's PID is


NAME_MAX = 255  # bytes of one directory entry's name (Linux file systems)


def tmp_name(path: str) -> str:
    """A hidden temp name beside ``path``, unique per attempt, naming its host and process:
    ``.fastckpt-tmp-HOST@PIDNS.PID.XXXXXXXXXXXX~<path's name in hex>``.

    The name of the file it becomes is there only in hex (``final_path`` reads it back; it is
    left out where the whole would not fit in one name): frameworks find their checkpoints by
    listing the directory and matching parts of names (Lightning's SLURM resume takes the digits
    after ``hpc_ckpt_`` in every name that holds it), so a temp file a killed save left behind
    must never look like a checkpoint of some version."""
    d, base = os.path.split(path)
    name = f"{TMP_TAG}{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
    named = f"{name}~{base.encode().hex()}"
    return os.path.join(d, named if len(named.encode()) <= NAME_MAX else name)


def final_path(tmp: str) -> str | None:
    """The path a temp file made by ``tmp_name`` becomes once published; None when its name
    does not say (not a temp name, or too long to carry it)."""
    d, base = os.path.split(tmp)
    if TMP_TAG not in base or "~" not in base:
        return None
    try:
        return os.path.join(d, bytes.fromhex(base.rsplit("~", 1)[1]).decode())
    except (ValueError, UnicodeDecodeError):
        return None


def probe_name(directory: str, tag: str = PROBE_TAG) -> str:
    """A probe file's name in ``directory`` (``tag``: a tier probe's, or doctor's), naming its host
    and process as a temp name does, so ``sweep_stale_tmp`` removes it once its writer is dead."""
    return os.path.join(directory, f"{tag}{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}")


def is_tmp(name: str) -> bool:
    """Whether a file name is a temp or probe file (never a checkpoint)."""
    return TMP_TAG in name or name.startswith(_PROBE_TAGS)


def _writer_of(name: str) -> tuple[str, int] | None:
    """(host, pid) of the process that made a temp or probe file, from its name (also the
    ``.NAME.fastckpt-tmp-HOST.PID.X`` names of earlier versions)."""
    tail = name.split(TMP_TAG, 1)[1] if TMP_TAG in name else \
        name[len(next(t for t in _PROBE_TAGS if name.startswith(t))):]
    try:
        host, pid, _ = tail.split("~", 1)[0].rsplit(".", 2)
        return host, int(pid)
    except ValueError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _stale(name: str) -> bool:
    """Whether ``name`` is a temp or probe file a dead process of this host and PID namespace left."""
    if not is_tmp(name):
        return False
    writer = _writer_of(name)
    return writer is not None and writer[0] == _HOST and writer[1] != os.getpid() and not _alive(writer[1])


def sweep_stale_tmp(ops: FileOps, directory: str) -> int:
    """Remove temp and probe files in ``directory`` left by dead processes of this host.

    A killed save leaves its temp file behind (never a visible checkpoint). Files of live
    processes, of other hosts, and of other PID namespaces of this host (other containers) are
    left alone: only the same host and namespace can tell a process is gone.

    Returns:
        How many files were removed.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if _stale(name):
            discard(ops, os.path.join(directory, name))
            removed += 1
    return removed


_swept: set[str] = set()
_swept_lock = threading.Lock()


def sweep_once(ops: FileOps, directory: str) -> None:
    """``sweep_stale_tmp`` the first time this process writes into ``directory`` (a burst buffer,
    a checkpoint's directory, a replication destination); logs what it removed."""
    with _swept_lock:
        if directory in _swept:
            return
        _swept.add(directory)
    n = sweep_stale_tmp(ops, directory)
    if n:
        log.info("fastckpt: removed %d temp file(s) of dead processes in %s", n, directory)


#: names a sweep of a whole burst buffer (``sweep_tree``) reads at most: about 20 ms from the page
#: cache; a burst buffer holds far fewer (the copies ``keep_local`` keeps, and their folders)
TREE_SWEEP_NAMES = 20_000


def sweep_tree(ops: FileOps, root: str, max_names: int = TREE_SWEEP_NAMES) -> int:
    """``sweep_stale_tmp`` in ``root`` and every folder below it (symlinks not followed), reading
    at most ``max_names`` names; logs what it removed, and when it stopped short.

    Why: a run writes only into its own folders, and a killed run's leftovers (the version links of
    its queued uploads, ``save.versions``: whole checkpoints whose blocks nothing else frees) often
    sit in folders the next run never writes into (Lightning saves each run under a new
    ``version_N``). The burst buffer is swept when a ``Checkpointer`` first picks a drive there
    (``save.stripes``); the cap bounds that first save's delay on a huge tree, whose remaining
    folders are still swept when written into (``sweep_once``).

    Returns:
        How many files were removed.
    """
    removed, seen, todo = 0, 0, [root]
    while todo:
        d = todo.pop()
        try:
            with os.scandir(d) as it:  # no more than the cap is left to read: a huge folder is not listed whole
                entries = list(itertools.islice(it, max_names - seen + 1))
        except OSError:  # gone meanwhile, or unreadable: nothing of ours to sweep there
            continue
        for e in entries:
            seen += 1
            if seen > max_names:
                log.info("fastckpt: stopped sweeping %s for dead processes' temp files after %d names (removed "
                         "%d): the folders not reached are swept when a save writes into them", root, max_names,
                         removed)
                return removed
            if e.is_dir(follow_symlinks=False):
                todo.append(e.path)
            elif _stale(e.name):
                discard(ops, e.path)
                removed += 1
    if removed:
        log.info("fastckpt: removed %d temp file(s) of dead processes under %s", removed, root)
    return removed


def discard(ops: FileOps, path: str) -> None:
    """Remove a temp file after a failure; a missing file is fine, other errors are logged."""
    try:
        ops.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the original failure matters more; leave a trace of this one
        if exc.errno == errno.EROFS and not os.path.lexists(path):  # a read-only mount's answer for any name:
            return  # this one was never made (its open was refused), so nothing is left behind
        log.warning("could not remove temp file %s: %s", path, exc)


class Staged:
    """A file being published: write ``tmp`` (and fsync it), then ``commit()``, or ``discard()``.

    ``renamed`` tells, after a failed ``commit``, whether the new file already replaced the old
    one (the directory fsync failed), so an error message never claims the previous file is
    still there when it is not. ``unlink_later`` (see the module's docstring) takes the temp
    name of the file replaced, to remove it off the caller's thread; without it the rename frees
    the old file.
    """

    def __init__(self, ops: FileOps, dest: str, unlink_later: Callable[[str], None] | None = None) -> None:
        self.ops, self.dest, self.tmp = ops, dest, tmp_name(dest)
        self.renamed = False
        self._unlink_later = unlink_later

    def stamp(self) -> None:
        """Date ``tmp`` as final now (``ops.final_mtime_ns``), just before ``commit``: the rename
        keeps it, so files made final one after another are ordered by mtime (``stamp.py``)."""
        stamp(self.ops, self.tmp, self.dest)

    def commit(self) -> None:
        old = None
        try:  # _keep_old inside: whatever it raises (a ValueError for a NUL in the name) removes the temp too
            old = self._keep_old() if self._unlink_later is not None else None
            self.ops.replace(self.tmp, self.dest)
            self.renamed = True
            self.ops.fsync_dir(os.path.dirname(self.dest) or ".")
        except BaseException:
            self.discard()
            if old is not None:
                discard(self.ops, old)
            raise
        if old is not None:
            self._unlink_later(old)  # type: ignore[misc]

    def _keep_old(self) -> str | None:
        """A second name for the file about to be replaced, so the rename does not free it; None
        when there is none (nothing to replace) or the file system has no hard links."""
        old = tmp_name(self.dest)
        try:
            self.ops.link(self.dest, old)
        except OSError:  # ENOENT: a first save; EPERM/ENOTSUP/EMLINK: the rename frees it, as without
            return None
        return old

    def discard(self) -> None:
        if not self.renamed:
            discard(self.ops, self.tmp)


@contextmanager
def replacing(ops: FileOps, dest: str, unlink_later: Callable[[str], None] | None = None) -> Iterator[Staged]:
    """``with replacing(ops, dest) as st:`` write and fsync ``st.tmp``; it replaces ``dest`` when
    the block ends, or is removed if the block raises (``unlink_later``: see ``Staged``)."""
    st = Staged(ops, dest, unlink_later)
    try:
        yield st
    except BaseException:
        st.discard()
        raise
    st.commit()


class Reaper:
    """Removes the files ``Staged`` replaced (``unlink_later``) on one background thread.

    ``drain`` (any thread) waits for every removal handed over so far (at most ``timeout_s``;
    the rest go on); ``close`` waits for them (unless ``wait=False``: they go on) and ends the
    thread (a later removal starts another).
    """

    def __init__(self, ops: FileOps) -> None:
        self._ops = ops
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="fastckpt-reap")  # started at first use
        self._pending: set[futures.Future] = set()
        self._lock = threading.Lock()

    def unlink_later(self, path: str) -> None:
        try:
            fut = self._pool.submit(discard, self._ops, path)
        except RuntimeError:  # the pool closed between our look and the submit: remove it here
            discard(self._ops, path)
            return
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: futures.Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def drain(self, timeout_s: float | None = None) -> None:
        with self._lock:
            pending = list(self._pending)
        futures.wait(pending, timeout=timeout_s)

    def close(self, wait: bool = True) -> None:
        with self._lock:
            pool, self._pool = self._pool, futures.ThreadPoolExecutor(1, thread_name_prefix="fastckpt-reap")
        pool.shutdown(wait=wait)  # without wait the queued removals still run, unless the process ends first
        if not wait:
            abandon_at_exit((pool,), "close() gave up waiting (close_timeout_s)")


def publish_bytes(ops: FileOps, path: str, data: bytes) -> None:
    """Write a small file atomically: temp, fsync, rename, directory fsync."""
    with replacing(ops, path) as st:
        ops.write_small(st.tmp, data)


def create_bytes(ops: FileOps, path: str, data: bytes) -> bytes | None:
    """Write a small file only if ``path`` does not exist, atomically: temp, fsync, hard link to
    ``path`` (which fails if it exists: exactly one of several creators wins, and no reader sees
    it partial), directory fsync. Returns None when this call created it, else the bytes found
    there (a temp left by a retry of this call is not this call's win: compare the bytes)."""
    tmp = tmp_name(path)
    try:
        ops.write_small(tmp, data)
        try:
            ops.link(tmp, path)
        except FileExistsError:
            return ops.read_small(path) or b""
        ops.fsync_dir(os.path.dirname(path) or ".")
        return None
    finally:
        discard(ops, tmp)
