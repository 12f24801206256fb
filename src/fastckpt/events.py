"""Events: one per phase of every save; the monitor and the JSONL log consume them.

The JSONL log is written by the standard library's ``logging.FileHandler`` (its lock and a flush
per record); fastckpt adds the directory creation, the JSON line, and what a failed write does:
one WARNING naming the log, the errno and the fix, then the log's events are dropped (logging's
own ``handleError`` printed a traceback to stderr per event, for ever, on a full disk). It costs
about 25 us more per event than a bare locked ``write`` (measured: 68 vs 44 us, 20,000 events), a
few events per save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .errors import ConfigError

log = logging.getLogger("fastckpt")
#: The ``detail`` of a lazy save's ``snapshot`` event: its blocked time is final at its ``fence`` event (``save.lazy``).
LAZY = "lazy: counted at its fence event"


@dataclass(frozen=True)
class Event:
    """One phase of one save (or a load).

    Times are ``time.time()`` seconds; ``error`` is the exception's repr when the phase failed.
    ``session`` is set by ``JsonlSink``, one per Checkpointer: a job resumed with the same log
    appends events that must not be matched with the killed job's saves (None: not from a log,
    or from a log written before sessions). ``group``: on a ``snapshot``, the group the file was
    saved into (``save(group=...)``): it is durable once that group's ``commit`` succeeds, not at
    its own. ``block``: on a ``snapshot``, the ``Checkpointer.one_save()`` block the file was saved in,
    and on the ``one_save`` event that block logs when it ends (after its files): the log's readers
    count the block as one save, as the monitor does (``fastckpt.replay``).
    """

    name: str
    rank: int
    path: str
    bytes: int
    start: float
    end: float
    tier: str
    error: str | None = None
    detail: str | None = None
    session: str | None = None
    group: str | None = None
    block: str | None = None

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["duration_s"] = round(self.duration_s, 6)
        return json.dumps(d, sort_keys=True)


class EventSink(Protocol):
    """Receives every event. Called from the training thread and from worker threads; what it
    raises is logged, never raised to the save (``Fanout``)."""

    def emit(self, event: Event) -> None: ...


class Fanout:
    """Hands every event to each sink, in order (``Checkpointer`` emits through one).

    Observability never fails or hangs a save: a sink that raises (a user's ``sinks=``, a full disk
    under the event log; ``SystemExit`` on a worker thread: it failed the save) loses that
    event, the other sinks still get it, and the save that emitted it goes on as if nothing
    happened. The failure is logged at ERROR with its traceback, once per sink (a sink that raises
    on every event would flood the log otherwise).
    """

    def __init__(self, sinks: Iterable[EventSink]) -> None:
        self.sinks = tuple(sinks)
        self._lock = threading.Lock()
        self._failed: set[int] = set()  # id()s of the sinks that raised: each is logged once

    def add(self, sink: EventSink) -> None:
        self.sinks += (sink,)

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except BaseException as exc:  # noqa: BLE001 (logged once per sink below; the save goes on)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)) and threading.current_thread() is \
                        threading.main_thread():
                    raise  # a Ctrl-C, or a signal handler's sys.exit() (SIGTERM), that ran inside the sink
                with self._lock:
                    first = id(sink) not in self._failed
                    self._failed.add(id(sink))
                if first:
                    log.error("fastckpt: the event sink %r raised %r on the %s event of %s; the save goes on, and "
                              "this sink's failures are not logged again (fix or remove it: sinks=...)",
                              sink, exc, event.name, event.path, exc_info=exc)


class JsonlSink:
    """Appends one JSON line per event to ``path`` (flushed per line, safe across threads),
    creating its directory as saves create theirs. Events after ``close()`` are dropped. A log
    whose last line a killed job left torn gets a newline before the first event, so that line
    alone is lost. Each line carries this sink's ``session`` (random, one per sink, so one per
    Checkpointer): readers tell a resumed job's saves from those its killed predecessor left open.
    Given ``start``, the session's first line is a ``start`` event holding it (the Checkpointer's
    overhead options and construction time, ``start_detail``), so that a replay of the log uses the
    job's budget and starts the overhead's clock where its Monitor did.

    A write (or the last flush, at ``close()``) that fails with an OSError (a full disk: ENOSPC) is
    logged once, as a WARNING naming the log, the errno and the fix; the events after it are
    dropped, and neither ``emit`` nor ``close`` raises it: the saves go on, and so does ``close()``."""

    def __init__(self, path: str, start: str | None = None) -> None:
        """``start``: the ``detail`` of a ``start`` event written before the first event (``start_detail``)."""
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._handler = _LogFile(path, mode="a", encoding="utf-8")
        except OSError as exc:  # at start, not as a raw OSError from deep inside: name the option
            raise ConfigError(f"event_log={path!r} cannot be written ({exc}): point event_log at a file in a "
                              "writable directory (it is created if missing), or drop it") from exc
        self._path, self._start = path, start
        self._closed = False  # closed, or broken by a failed write: its events are dropped
        self._first = True
        self.session = os.urandom(6).hex()

    def emit(self, event: Event) -> None:
        events = [event]
        with self._handler.lock:  # an RLock: handle() takes it again
            if not self._closed:  # a closed FileHandler would open the file again
                if self._first:  # not at open: a job that emits nothing leaves the log as it found it
                    self._first = False
                    _end_torn_line(self._path)
                    if self._start is not None:  # a zero span at the first event's start: sorted before it
                        events.insert(0, Event("start", event.rank, self._path, 0, event.start, event.start,
                                               event.tier, detail=self._start))
                try:
                    for ev in events:
                        line = dataclasses.replace(ev, session=self.session).to_json()
                        self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))
                except OSError as exc:
                    self._broken(exc, event)

    def close(self) -> None:
        with self._handler.lock:
            broken, self._closed = self._closed, True
            try:
                self._handler.close()  # flushes: the last line may fail there too
            except OSError as exc:
                if not broken:
                    self._broken(exc, None)

    def _broken(self, exc: OSError, event: Event | None) -> None:
        """Under the lock: the log cannot be written; say so once, drop its events from now on."""
        self._closed = True
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        log.warning("fastckpt: the event log %s cannot be written (%s: %s) at %s; this and every later event of "
                    "this Checkpointer are dropped from it (the saves go on). Free space on its file system, or "
                    "point event_log at a file on another one", self._path, code, exc.strerror or exc,
                    f"the {event.name} event of {event.path}" if event is not None else "close()")
        with contextlib.suppress(OSError):  # the same failure again (the bytes it still holds): reported above
            self._handler.close()  # its file descriptor


class _LogFile(logging.FileHandler):
    """A FileHandler whose failed write raises to ``JsonlSink`` (logging's ``handleError`` prints a
    traceback per record to stderr)."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        raise  # noqa: PLE0704 (called in the except block of the failed write: its OSError)


def start_detail(overhead_budget: float, overhead_window_s: float, started_at: float) -> str:
    """The ``detail`` of the ``start`` event a Checkpointer's event log begins each session with:
    what its readers replay the overhead alarm with (``replay.parse_start``), as plain floats (a
    numpy scalar or a Fraction, which the options accept, would not read back): the options, and
    ``started_at``, the wall time the Checkpointer was built, where its Monitor's clock starts (the
    event itself is stamped at the session's first event, which may come long after)."""
    return (f"overhead_budget={float(overhead_budget)!r} overhead_window_s={float(overhead_window_s)!r} "
            f"started_at={float(started_at)!r}")


def _end_torn_line(path: str) -> None:
    """A job killed mid-line left its log's last line torn: end that line, so the resumed job's
    first event starts a line of its own (readers then skip only the torn line)."""
    try:
        if not stat.S_ISREG((st := os.stat(path)).st_mode) or st.st_size == 0:  # new, or a FIFO, a tty
            return
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if torn:
            with open(path, "ab") as f:
                f.write(b"\n")
    except OSError:  # not there yet, or not ours to read: the FileHandler opening it says what is wrong
        return
