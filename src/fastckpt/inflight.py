"""Work in flight and the rule that each background failure is raised exactly once.

``track`` registers a future (training thread). A failure is raised by the handle's
``wait()`` if someone waits on it; otherwise by the next sync point (``save``, ``commit``,
``wait``, ``close``) through ``raise_unseen``, or by a load of what it wrote (``wait_loadable``:
the load has nothing new to read, and must not pass the copy before it off as new). Whether a
failure was raised is marked on the exception itself: a set of id()s could mistake a new error for
a freed one, and keeping raised errors alive would pin their tracebacks' frames (staging buffers,
the state's tensors).

A failed group is one failure: once its commit's failure was raised (by the commit handle's
``wait()``, or a sync point), the failures of the files that commit was waiting for count as
raised too. Else each file that failed (two ranks' copies to a full drive) was raised again, at
one more sync point each, and each of those refused a save: one failure cost several checkpoints.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

from .errors import WRITE_FIXES, CheckpointWriteError, FastCkptError, ReplicationError, file_in_the_way
from .progress import Progress
from .records import SaveHandle
from .urls import is_within, resolved

log = logging.getLogger("fastckpt")
_SURFACED = "_fastckpt_surfaced"
_WROTE = "_fastckpt_wrote"  # on a failure: the (key, group_key) of each save or commit that raised it
PROGRESS_EVERY_S = 10.0  # a log line this often while wait() or close() waits (off a terminal)
PROGRESS_DELAY_S = 3.0  # silent for waits shorter than this
_FIXED = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)  # a refusing home: WRITE_FIXES names the fix


def surfaced(exc: BaseException) -> bool:
    return getattr(exc, _SURFACED, False)


def set_surfaced(exc: BaseException) -> None:
    setattr(exc, _SURFACED, True)


def raise_as_write_error(exc: BaseException, path: str, renamed: bool = False, where: str | None = None,
                         local: bool = False) -> None:
    """Raise ``exc``; an OSError becomes a CheckpointWriteError that names the checkpoint.

    ``renamed``: the failure came after the new file was renamed into place (the directory
    fsync), so the message must not claim the previous file is still there. ``where``: the
    directory being written, when that is not ``path``'s; ``local``: it is the burst buffer
    (the file's copy in ``local_dir``), so a full or unwritable drive is named as that.
    """
    if isinstance(exc, FastCkptError) or not isinstance(exc, OSError) or surfaced(exc):
        raise exc
    state = ("the new file is in place but its directory entry may not be durable (directory fsync failed)"
             if renamed else "the previous checkpoint is untouched" if "://" in path or os.path.lexists(path)
             else "nothing was there before")
    why = exc.strerror or str(exc)
    blocker = file_in_the_way(os.path.dirname(path)) if exc.errno in (errno.EEXIST, errno.ENOTDIR) else None
    if blocker is not None:
        why = blocker
    elif exc.errno == errno.EISDIR and not local:
        why = f"{path} is a directory, not a file (name a file inside it, or move the directory away)"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = _full(why, where or os.path.dirname(path) or ".", local)
    elif local:
        why = f"{why} (writing its burst-buffer copy in {where})"
    elif exc.errno in _FIXED:
        why = f"{why} in {where or os.path.dirname(path) or '.'}: {WRITE_FIXES[exc.errno]}"  # type: ignore[index]
    notes = "".join(f". {n}" for n in getattr(exc, "__notes__", ()))  # e.g. pointing.take_back's: said, not lost
    err = CheckpointWriteError(exc.errno, f"saving {path} failed: {why}; {state}{notes}")
    err.filename = path
    raise err from exc


def _failed_at(exc: BaseException, key: str) -> bool:
    """Whether ``exc`` is the failure of a save of the file ``key``, or of a commit of (or a save
    into) the group ``key``, or of a commit of a group that holds ``key``."""
    return any(k == key or gk is not None and (gk == key or k == gk and is_within(key, gk))
               for k, gk in getattr(exc, _WROTE, ()))


def _not_loadable(exc: BaseException, path: str) -> CheckpointWriteError:
    """The error of a load that waited for a save of ``path`` by this Checkpointer that failed (``exc``)."""
    said = str(exc).rstrip(".")
    msg = (f"loading {path}: the save of it that this Checkpointer had in flight failed, so there is no new "
           f"checkpoint to load ({type(exc).__name__}: {said}). A second load reads the newest whole copy there is: "
           f"the previous checkpoint at {path}, which a failed save leaves intact unless its error says otherwise "
           "(a burst-buffer copy only if the home cannot be read). Handle this failure (it is raised here once, "
           "not again at the next save, commit or wait), then load it again.")
    code = getattr(exc, "errno", None)
    return CheckpointWriteError(code, msg) if code else CheckpointWriteError(msg)


def _full(why: str, where: str, local: bool) -> str:
    """A full drive: which one, and the fixes."""
    if local:
        return (f"{why} in the burst buffer {where} (the file's local copy is written there first): free space "
                "there, keep fewer local copies (keep_local=N), or point local_dir at a larger drive")
    return (f"{why} in {where}: free space there, keep fewer checkpoints (keep_persistent=N), or save to a "
            "larger file system")


class _Tracked(NamedTuple):
    """A future in flight: what it writes (``path``; a commit's is its ``group``), and both as
    ``urls.resolved`` keys, which match them however a later call spells them."""

    fut: Future
    path: str
    group: str | None
    key: str
    group_key: str | None


class InFlight:
    """Futures of saves, replications and commits, with the paths they write."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, _Tracked] = {}
        self._unseen: list[BaseException] = []
        self._files: dict[int, tuple[Future, list[Future]]] = {}  # a commit's future -> its group's saves
        self._excused: set[int] = set()  # saves in flight of a group whose failed commit was raised

    def track(self, fut: Future, path: str, group: str | None) -> SaveHandle:
        """Track a save, or a commit: tracked as ``(future, group, group)``, after the group's saves."""
        tracked = _Tracked(fut, path, group, resolved(path), None if group is None else resolved(group))
        with self._lock:
            if group is not None and path == group:  # a commit: it waits for the group's saves tracked so far
                files = [t.fut for t in self._pending.values() if t.group == group and t.path != group]
                self._files[id(fut)] = (fut, files)
            self._pending[id(fut)] = tracked
        fut.add_done_callback(self._on_done)
        return SaveHandle(fut, path, self._mark_seen)

    def _mark_seen(self, exc: BaseException) -> None:
        with self._lock:
            self._seen(exc)

    def _seen(self, exc: BaseException) -> None:
        """``exc`` was raised to the caller. If it is a commit's failure, or the failure of one of
        the saves a commit waits for (the first to fail in time need not be the one the commit
        raises), the group failed once: the commit's and its saves' failures are seen too (a
        commit still running: once it fails)."""
        set_surfaced(exc)
        self._unseen = [e for e in self._unseen if e is not exc]
        for key, (commit, files) in list(self._files.items()):
            ended = commit.done() and not commit.cancelled()
            if not (ended and commit.exception() is exc
                    or any(f.done() and not f.cancelled() and f.exception() is exc for f in files)):
                continue
            if not ended:  # its failure, when it comes, was raised already as this one
                self._excused.add(key)
                self._excuse(files)
            elif commit.exception() is not None:
                del self._files[key]
                self._excuse([commit, *files])
            else:  # it committed (that file was saved again): nothing else is excused
                del self._files[key]

    def _excuse(self, files: list[Future]) -> None:
        for f in files:
            if not f.done():
                self._excused.add(id(f))
            elif not f.cancelled() and (e := f.exception()) is not None:
                set_surfaced(e)
                self._unseen = [u for u in self._unseen if u is not e]

    def _remember(self, t: _Tracked) -> None:
        exc = None if t.fut.cancelled() else t.fut.exception()  # cancelled: by a close() that gave up waiting
        if exc is None:
            return
        if (t.key, t.group_key) not in getattr(exc, _WROTE, ()):  # a commit may raise one of its files' failures
            setattr(exc, _WROTE, (*getattr(exc, _WROTE, ()), (t.key, t.group_key)))
        if id(t.fut) in self._excused:  # its group's failed commit was raised already
            set_surfaced(exc)
        elif not surfaced(exc) and all(e is not exc for e in self._unseen):
            self._unseen.append(exc)

    def _on_done(self, fut: Future) -> None:
        with self._lock:
            tracked = self._pending.pop(id(fut), None)
            if tracked is not None:
                self._remember(tracked)
            self._excused.discard(id(fut))
            if id(fut) in self._files and (fut.cancelled() or (exc := fut.exception()) is None or surfaced(exc)):
                _, files = self._files.pop(id(fut))
                if not fut.cancelled() and exc is not None:  # its failure was raised already, as a save's
                    self._excuse(files)

    def raise_unseen(self, before: Callable[[BaseException], None] | None = None) -> None:
        """Raise the oldest failure nobody has seen yet (once), calling ``before(exc)`` first."""
        with self._lock:
            self._collect()
            if not self._unseen:
                return
            exc = self._unseen[0]
            self._seen(exc)
        if before is not None:
            before(exc)
        raise exc

    def _collect(self) -> None:
        """A future is done before its done-callbacks run (and result() returns then): collect
        failures of finished futures here too, so the sync point that follows sees them."""
        for t in self._pending.values():
            if t.fut.done():
                self._remember(t)

    def futures(self) -> list[Future]:
        with self._lock:
            return [t.fut for t in self._pending.values()]

    def wait_all(self, deadline: float | None) -> int:
        """Wait until nothing is pending (or the ``time.monotonic()`` ``deadline`` passed; None:
        no limit); return how many are still pending then. Failures are not raised here."""
        while futures := self.futures():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, not_done = cf.wait(futures, timeout=left)
            if not_done and deadline is not None and time.monotonic() >= deadline:
                return len(not_done)
        return 0

    def wait_shown(self, timeout_s: float | None, replicating: Callable[[], list[str]]) -> None:
        """``wait_all`` for ``Checkpointer.wait``: a wait longer than a few seconds shows progress (a bar
        on a terminal, a log line every few seconds otherwise: ``fastckpt.progress``), drawn off this thread.

        Raises:
            ReplicationError: ``timeout_s`` passed first, naming what is still pending (and the copies
                ``replicating()`` names).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first = len(self)
        if not first:
            return
        with Progress(f"fastckpt: waiting for {first} pending save(s)", total=first, unit="saves",
                      read=lambda: first - len(self), delay_s=PROGRESS_DELAY_S, every_s=PROGRESS_EVERY_S):
            if left := self.wait_all(deadline):
                raise ReplicationError(
                    f"{left} save(s) still pending after {timeout_s:g} s: {', '.join(self.paths())} "
                    f"(replicating: {', '.join(replicating()) or 'none'}). Wait longer (wait(timeout_s=...); for "
                    "close(), Checkpointer(close_timeout_s=...)), or check the storage target.")

    def log_unseen(self, why: str) -> None:
        """Log (ERROR, with its traceback) each failure nobody has seen yet, and mark it seen:
        for a sync point that raises something else (``why``) and cannot raise them too."""
        with self._lock:
            self._collect()
            unseen = []
            while self._unseen:
                unseen.append(self._unseen[0])
                self._seen(unseen[-1])
        for exc in unseen:
            log.error("fastckpt: a background failure not raised because %s: %r", why, exc, exc_info=exc)

    def wait_writing(self, path: str) -> None:
        """Wait for the saves that write ``path``, the group ``path`` or anything below it, however
        each was spelt (through a symbolic link to its folder or not: ``urls.resolved``).

        Their failures are not raised here: they stay unseen for the next sync point.
        """
        key = resolved(path)
        with self._lock:
            futures = [t.fut for t in self._pending.values() if t.group_key == key or is_within(t.key, key)]
        for f in futures:
            f.exception()

    def wait_loadable(self, path: str) -> None:
        """``wait_writing(path)``, and the commit in flight of a group that holds ``path`` (tracked
        as ``(future, group, group)``): a load of a file of a group committed here reads that commit's
        outcome, not the save before it (nor an incomplete group).

        Raises:
            CheckpointWriteError: such a save or commit failed (its copy home too: the loader reads the
                home, not a local copy newer than it), and nobody has seen that failure yet: the
                load has nothing new to read, and must not return the copy before it as if it were new.
                The failure counts as raised then (as at a sync point); a second load reads what is there.
        """
        self.wait_writing(path)
        key = resolved(path)
        with self._lock:
            commits = [t.fut for t in self._pending.values()
                       if t.path == t.group and t.group_key is not None and is_within(key, t.group_key)]
        for f in commits:
            f.exception()
        with self._lock:
            self._collect()
            failed = next((e for e in self._unseen if _failed_at(e, key)), None)
            if failed is None:
                return
            self._seen(failed)  # raised now, as a sync point would: the next one does not raise it again
        raise _not_loadable(failed, path)

    def of_group(self, group: str) -> list[Future]:
        """The futures of ``group``'s saves (each until its upload ended) and commits in flight."""
        with self._lock:
            return [t.fut for t in self._pending.values() if t.group == group]

    def writing(self, path: str) -> bool:
        """Whether a save of the file ``path`` (its write or its replication) has not ended."""
        with self._lock:
            return any(t.path == path and not t.fut.done() for t in self._pending.values())

    def paths(self) -> list[str]:
        """The paths (or groups) of the saves and commits in flight."""
        with self._lock:
            return sorted({t.group or t.path for t in self._pending.values()})

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
