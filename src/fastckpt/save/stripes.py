"""The burst buffer's directories: one, or several striped (``local_dir=[...]``, one per drive).

A new file goes to the directory with the fewest bytes queued (reserved by saves whose local
write has not finished), so the files of a group (per-rank shards, model and optimizer files)
spread across the drives by size, and a single large file goes to the least busy drive. Ties
go round-robin, starting at this process's rank, so that ranks sharing a node start on
different drives without talking to each other. A file saved again to the same path stays on
the drive of its save still queued or being written there (its reservation), else on the drive
that holds it: every save of one path is written by one writer thread, in the order of the
calls, so its replication never lands an older save over a newer one, and there is never a
stale copy elsewhere; reads find each file wherever it lives. Only when that drive has no room
for it, and no save of the path is in flight (its copy is no upload's source), does the path
move to a drive with room: the old copy is deleted once the new one is written (``written``),
as a drive that refused writes is left for another. A single file may skip the burst
buffer when the drive it would use has no room for it (free space, less the bytes already
queued there), unless a save of it is still queued: ``choose`` then returns a reservation
without a ``local`` place and the file is written straight to its path by that drive's writer
thread (``Saver``). Striped, a new file also passes over the drives without room for it. Each
directory has its own writer thread (``Saver``), so the drives write at once. Each directory's
written bytes and write time give its bandwidth (``Checkpointer.stats().local_dirs``).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..commit.names import BURST_BUFFER_MARK
from ..errors import ConfigError, file_in_the_way
from ..io.atomic import sweep_once, sweep_tree
from ..io.ops import FileOps
from ..units import fmt_bytes
from ..urls import mirror_path, spellings

log = logging.getLogger("fastckpt")
#: errors that say a drive takes no writes at all (not: this file did not fit)
_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)

ROOM_MARGIN = 1 << 20  # free bytes a drive must keep beyond a file for it to take the file


@dataclass(frozen=True)
class DirStats:
    """One burst-buffer directory, as ``stats()`` reports it.

    Attributes:
        path: the directory.
        files: files written there (local writes that completed; a failed one is not counted).
        bytes: bytes written there.
        write_s: seconds spent writing them (write, fsync; summed over files).
        queued_bytes: bytes of saves whose local write there is still in progress.
    """

    path: str
    files: int
    bytes: int
    write_s: float
    queued_bytes: int

    @property
    def bandwidth_Bps(self) -> float | None:
        """Mean write bandwidth of its files (None before the first)."""
        return self.bytes / self.write_s if self.write_s > 0 else None


@dataclass(frozen=True, eq=False)
class Reservation:
    """A save's place in the burst buffer: ``local`` under ``root`` (directory number
    ``index``, whose writer thread writes it), holding ``nbytes`` queued. ``local`` is None
    when the file skips the burst buffer: it goes straight to ``path``, on that writer thread.
    ``stale``: the copy of an earlier save on another drive, which had no room for this one;
    it is deleted once this one is written."""

    root: str
    local: str | None
    nbytes: int
    index: int
    path: str
    stale: str | None = None


class Stripes:
    """Chooses and finds burst-buffer copies (thread-safe).

    Order of calls for one save (``Saver``): ``choose`` on the training thread reserves the
    bytes; ``record`` (the writer thread, when the local write ends) counts the bandwidth;
    ``written`` (once the write succeeded) deletes the copy it moved away from; ``release``
    (once the local write is done, or the save failed before it) frees the queue.

    Args:
        dirs: the ``local_dir`` directories (empty: no burst buffer).
        rank: where round-robin starts (ranks on one node start on different drives).
        store: which store a name is at (``Homes.store_of``), part of its copy's place (``urls.mirror_path``).
    """

    def __init__(self, dirs: tuple[str, ...], rank: int = 0, store: Callable[[str], str] = lambda name: "") -> None:
        self.dirs = tuple(os.path.abspath(d) for d in dirs)
        self._store = store
        self._lock = threading.Lock()
        self._queued = [0] * len(self.dirs)
        self._files = [0] * len(self.dirs)
        self._bytes = [0] * len(self.dirs)
        self._write_s = [0.0] * len(self.dirs)
        self._live: set[int] = set()  # ids of reservations not released yet
        self._held: dict[str, tuple[int, int]] = {}  # path -> (directory, its live reservations)
        self._next = rank % len(self.dirs) if self.dirs else 0
        self._refused: set[int] = set()  # drives that refused a write (read-only, no permission): new paths avoid them
        self._bypassing = False  # the last save skipped a full burst buffer
        self._swept = False  # whether the first choose swept the drives (``_sweep``)
        self._sweep_lock = threading.Lock()
        self._check_usable()

    def _check_usable(self) -> None:
        """At start, make each directory: one that cannot be made (a typo under /proc, a path
        below a file, no permission) is left out, with a warning; none usable is a ConfigError
        now, not a failed first save hours into training."""
        failed: dict[int, OSError] = {}
        for i, d in enumerate(self.dirs):
            try:
                os.makedirs(d, exist_ok=True)
                if not os.access(d, os.W_OK | os.X_OK):  # access() says why only in errno, which Python drops
                    if os.statvfs(d).f_flag & os.ST_RDONLY:
                        raise OSError(errno.EROFS, os.strerror(errno.EROFS), d)
                    raise PermissionError(errno.EACCES, "no permission to write there", d)
            except OSError as exc:
                failed[i] = exc
        if failed and len(failed) == len(self.dirs):
            raise ConfigError(f"local_dir {self.dirs[0]} cannot hold checkpoints: {_why(failed[0], self.dirs[0])}. "
                              "Point local_dir at a writable directory on a node-local drive (it is created if "
                              "missing), or drop it")
        for i, exc in failed.items():
            self._refused.add(i)
            log.warning("fastckpt: burst-buffer directory %s cannot be used (%s): checkpoints go to the other "
                        "local_dir directories", self.dirs[i], _why(exc, self.dirs[i]))

    def existing(self) -> list[str]:
        """The directories a commit writes to: those there are, less those that refused writes
        (a stale manifest left on one names an older attempt; loads look at its copies last)."""
        return [d for i, d in enumerate(self.dirs) if i not in self._refused and os.path.isdir(d)]

    def copies(self, path: str, spelled: bool = False) -> list[str]:
        """The burst-buffer copies of ``path`` that exist (one, but look everywhere; a stale one
        left on a drive that refused writes, after the others). ``spelled`` (a removal): under each
        spelling of ``path`` (``urls.spellings``), for a copy saved through the folder a link names."""
        order = sorted(range(len(self.dirs)), key=lambda i: i in self._refused)
        names = spellings(path) if spelled else [path]
        return [p for n in names for p in (self.mirror(i, n) for i in order) if os.path.lexists(p)]

    def mirror(self, i: int, path: str) -> str:
        """The place of ``path``'s copy in directory number ``i``."""
        return mirror_path(self.dirs[i], path, self._store(path))

    def mirrors(self, path: str) -> list[str]:
        """The places of ``path``'s copy in the directories a commit writes to (``existing``)."""
        usable = self.existing()
        return [self.mirror(i, path) for i, d in enumerate(self.dirs) if d in usable]

    def local_path(self, path: str) -> str | None:
        """Where the copy of ``path`` lives: the existing one, else the first directory's place."""
        if not self.dirs:
            return None
        found = self.copies(path)
        return found[0] if found else self.mirror(0, path)

    def choose(self, path: str, nbytes: int, may_bypass: bool = False, may_move: bool = False) -> Reservation | None:
        """Where a new save of ``path`` (``nbytes``) writes: the drive of its live reservation if
        it has one (an earlier save of it queued or being written there), else a drive with room
        for it if there is one (the one holding its copy, if there is one and has room, or
        ``may_move`` allows none other: no save of ``path`` is in flight; else any). None
        without a burst buffer. With ``may_bypass`` and no live reservation of ``path``, when no
        drive it may use has room for it: a reservation with ``local=None`` (write it straight
        to its path)."""
        if not self.dirs:
            return None
        self._sweep()
        with self._lock:  # the check and the reservation are one step: saves of a path never part ways
            held = self._held.get(path)
            if held is not None:
                found, may_bypass, may_move = [held[0]], False, False
            else:  # a copy on a drive that refused writes stays (a load compares it with the home's)
                found = [i for i in range(len(self.dirs))
                         if i not in self._refused and os.path.lexists(self.mirror(i, path))]
            taking = [i for i in range(len(self.dirs)) if i not in self._refused]
            # its copy's drive first; the others only to move to when that one has no room
            allowed = found[:1] + [i for i in taking if may_move and i not in found[:1]] if found else \
                taking or list(range(len(self.dirs)))
            if may_bypass or len(allowed) > 1:
                for i in allowed:  # links a killed run's queued uploads left (save.versions) hold blocks: free them
                    sweep_once(FileOps(), os.path.dirname(self.mirror(i, path)))
                roomy = [i for i in allowed if _free_bytes(self.dirs[i]) - self._queued[i] >= nbytes + ROOM_MARGIN]
                if not roomy and may_bypass:  # written by the writer of the drive its old copy is on
                    return self._reserve(path, found[0] if found else 0, 0, direct=True)
                allowed = roomy or allowed  # none has room: the write names the full drive
            if found and allowed[0] == found[0]:
                return self._reserve(path, found[0], nbytes)
            ring = ((self._next + k) % len(self.dirs) for k in range(len(self.dirs)))
            order = [j for j in ring if j in allowed]
            i = min(order, key=lambda j: self._queued[j])
            self._next = (i + 1) % len(self.dirs)
            if found:
                log.info("fastckpt: burst-buffer directory %s is too full for %s (%s): it moves to %s, and its copy "
                         "there goes once it is written", self.dirs[found[0]], path, fmt_bytes(nbytes), self.dirs[i])
            return self._reserve(path, i, nbytes, stale=self.mirror(found[0], path) if found else None)

    def _sweep(self) -> None:
        """At the first ``choose``: remove what dead processes of this host left anywhere under each
        drive (``io.atomic.sweep_tree``), before the room check reads the drives' free space. A killed
        run's version links (``save.versions``) hold whole checkpoints, often in folders this run never
        writes into (Lightning's ``version_N``), where the per-folder sweeps never look. Each drive
        gets its mark (``_mark``) before the first copy is written there."""
        with self._sweep_lock:  # a second caller waits: its room check must see the blocks freed
            if self._swept:
                return
            self._swept = True
            for i, d in enumerate(self.dirs):
                if i not in self._refused:
                    _mark(d)
                    sweep_tree(FileOps(), d)

    def note_bypass(self, path: str, nbytes: int, bypass: bool) -> None:
        """(``Saver``, per save) Say when saves start skipping the full burst buffer, and when it takes them again."""
        if bypass and not self._bypassing:
            log.warning("fastckpt: the burst buffer (%s) has no room for %s (%s): saving it straight to its path, "
                        "and so every save until there is room again (the stall is the same; it is durable at the "
                        "path's write speed). Free space there, keep fewer local copies (keep_local=N), or point "
                        "local_dir at a larger drive", ", ".join(self.dirs), path, fmt_bytes(nbytes))
        elif self._bypassing and not bypass:
            log.info("fastckpt: the burst buffer has room again: %s is saved through it", path)
        self._bypassing = bypass

    def _reserve(self, path: str, i: int, nbytes: int, direct: bool = False, stale: str | None = None) -> Reservation:
        """A live reservation of ``nbytes`` on directory ``i`` for ``path`` (lock held)."""
        self._queued[i] += nbytes
        res = Reservation(self.dirs[i], None if direct else self.mirror(i, path), nbytes, i, path, stale)
        self._live.add(id(res))
        self._held[path] = (i, self._held.get(path, (i, 0))[1] + 1)
        return res

    def written(self, res: Reservation | None) -> None:
        """(The writer thread, before ``release``) ``res``'s save was written: the copy of an earlier
        save on the drive it moved away from (``Reservation.stale``) goes, before its hold on the path
        ends, so the next save of the path finds only the new copy. A failure is logged: the next
        save finds the old copy first, and a load judges it by its checksum."""
        if res is None or res.stale is None:
            return
        try:
            os.unlink(res.stale)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("fastckpt: could not delete %s, the burst-buffer copy of an earlier save of %s, now saved to "
                        "%s: %s. Delete it by hand (the next save of the path reads that drive first)",
                        res.stale, res.path, res.root, exc)

    def release(self, res: Reservation | None, failure: BaseException | None = None) -> None:
        """Free ``res``'s queued bytes, and its hold on its path's drive (again: nothing happens).
        A ``failure`` that says the drive takes no writes (read-only, permission) takes it out of
        the rotation for new paths, with a warning, when other drives are left."""
        if res is None:
            return
        refused = isinstance(failure, OSError) and failure.errno in _REFUSED and res.local is not None
        with self._lock:
            if refused and res.index not in self._refused and len(self._refused) + 1 < len(self.dirs):
                self._refused.add(res.index)
                log.warning("fastckpt: burst-buffer directory %s refused a write (%s): new checkpoints go to the "
                            "other local_dir directories from now on", self.dirs[res.index], failure)
            if id(res) in self._live:
                self._live.discard(id(res))
                self._queued[res.index] -= res.nbytes
                i, n = self._held.pop(res.path)
                if n > 1:
                    self._held[res.path] = (i, n - 1)

    def record(self, local: str, nbytes: int, seconds: float) -> None:
        """A local write to ``local`` ended: ``nbytes`` in ``seconds`` (for the bandwidth)."""
        for i, d in enumerate(self.dirs):
            if local.startswith(d.rstrip(os.sep) + os.sep):
                with self._lock:
                    self._files[i] += 1
                    self._bytes[i] += nbytes
                    self._write_s[i] += seconds
                return

    def stats(self) -> tuple[DirStats, ...]:
        with self._lock:
            return tuple(DirStats(d, self._files[i], self._bytes[i], self._write_s[i], self._queued[i])
                         for i, d in enumerate(self.dirs))


def _mark(directory: str) -> None:
    """Put the burst buffer's mark (``commit.names.BURST_BUFFER_MARK``) at the root of ``directory``,
    durably, if it is not there: a scan of a folder holding the directory (``local_dir`` inside the
    checkpoint folder: ``/ckpt/bb`` for saves to ``/ckpt``), in any process, passes over the copies
    below it, which are no checkpoints of that folder (one may never reach its home)."""
    path = os.path.join(directory, BURST_BUFFER_MARK)
    if os.path.exists(path):
        return
    ops = FileOps()
    try:
        ops.makedirs(directory)
        ops.write_small(path, b"A fastckpt burst buffer (local_dir): node-local copies of checkpoints saved "
                              b"elsewhere. fastckpt's scans (latest(), ls) of a folder holding it pass over them.\n")
        ops.fsync_dir(directory)
    except OSError as exc:  # the save's own write there fails with its error, or a scan may take a copy
        log.warning("fastckpt: could not mark the burst buffer %s (%s): a scan of a folder holding it (latest(), "
                    "ls) may take its copies for checkpoints; keep local_dir outside the checkpoint folders",
                    directory, exc)


def _free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still use on the drive of ``directory`` (or of its
    nearest existing parent: the burst buffer's folders are made by the first save). A file
    system that reports no size (``f_blocks == 0``: ramfs, some FUSE mounts; ``df`` shows 0/0)
    has no limit it can tell: room, as when ``statvfs`` fails."""
    d = directory
    while True:
        try:
            st = os.statvfs(d)
            return st.f_bavail * st.f_frsize if st.f_blocks else sys.maxsize
        except FileNotFoundError:
            parent = os.path.dirname(d)
            if parent == d:
                return sys.maxsize
            d = parent
        except OSError:  # cannot tell (permissions, a stale mount): let the write find out
            return sys.maxsize


def _why(exc: OSError, directory: str) -> str:
    """Why ``directory`` cannot be made or written, and the fix: the file standing where it or a
    parent must be a directory (not a bare "Not a directory"), or the drive mounted read-only
    (after errors, often: the drive, not the path)."""
    blocker = file_in_the_way(directory) if exc.errno in (errno.EEXIST, errno.ENOTDIR) else None
    if blocker is not None:
        return blocker
    if exc.errno == errno.EROFS:
        return f"{exc} (its drive is mounted read-only: remount it read-write, mount -o remount,rw)"
    return str(exc)
