"""Reading event logs: a whole JSONL file (``fastckpt report``) or one being written (``fastckpt
serve-metrics`` follows a running job's log).

A log holds one JSON object per line, as ``JsonlSink`` writes them (``fastckpt.events``). A line
is read only once its newline is there, so a follower never sees half a line; the last line
of a log whose writer was killed mid-line is skipped with a warning, and so is a line that is
not an event with events after it (that writer resumed, appending to the same log).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
from collections.abc import Iterable
from typing import BinaryIO

from .events import Event

log = logging.getLogger("fastckpt")
_FIELDS = ("name", "rank", "path", "bytes", "start", "end", "tier")
_MAX_BYTES = 2**63 - 1  # the largest file size (off_t) and object size any store allows
_ERROR_TYPE = re.compile(r"[A-Za-z_][\w.]*")


def error_type(error: str) -> str:
    """An event's ``error`` (``"OSError(28, 'No space left')"``) -> its type, ``"OSError"``."""
    m = _ERROR_TYPE.match(error)
    return m.group(0) if m else "unknown"


def parse_event(line: str, where: str = "event log") -> Event:
    """One log line -> Event.

    Raises:
        ValueError: the line is not a fastckpt event (the message names ``where`` and the field).
    """
    try:
        d = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg}); is this a fastckpt event log (event_log=...)?") from exc
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a JSON {type(d).__name__}, not an event object")
    missing = [f for f in _FIELDS if f not in d]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; is this a fastckpt event log (event_log=...)?")
    try:
        ev = Event(str(d["name"]), int(d["rank"]), str(d["path"]), int(d["bytes"]), float(d["start"]),
                   float(d["end"]), str(d["tier"]), d.get("error"), d.get("detail"),
                   None if d.get("session") is None else str(d["session"]),
                   None if d.get("group") is None else str(d["group"]),
                   None if d.get("block") is None else str(d["block"]))
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(Infinity)
        raise ValueError(f"{where}: a field has the wrong type ({exc}); is this a fastckpt event log?") from exc
    for field, value in (("error", ev.error), ("detail", ev.detail)):  # readers match them as text
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}: {field} is a {type(value).__name__}, not a message; is this a fastckpt "
                             "event log?")
    # the span's length too: -1e308 .. 1e308 are two finite times whose duration is not
    if not (math.isfinite(ev.start) and math.isfinite(ev.end) and ev.end >= ev.start
            and math.isfinite(ev.end - ev.start)):
        raise ValueError(f"{where}: start and end are not a time span (two finite times, the end not before the "
                         "start); the line is damaged")
    if ev.rank < 0 or ev.bytes < 0:
        raise ValueError(f"{where}: rank {ev.rank} or bytes {ev.bytes} is negative; the line is damaged")
    if ev.bytes > _MAX_BYTES:  # readers sum bytes as floats: a 400-digit count was an OverflowError traceback
        raise ValueError(f"{where}: bytes is a {len(str(ev.bytes))}-digit number, more than any file holds (2^63 - 1); "
                         "the line is damaged")
    return ev


def decode_line(raw: bytes, where: str) -> str:
    """One raw log line -> text.

    Raises:
        ValueError: not UTF-8 (binary junk, not an event log); the message names ``where``.
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); is this a fastckpt "
                         "event log (event_log=...)?") from exc


def may_start_event(raw: bytes) -> bool:
    """Whether ``raw``, a log's last bytes with no newline after them, can be an event's line cut
    short (its writer killed mid-line): the start of a JSON object, in ASCII as ``Event.to_json``
    writes it (any character escaped, a key first: ``{"``), cut anywhere. A whole JSON value that
    is no event is another file (``json.dump`` writes no newline), and so is a Python dict's repr
    (``{'loss': 2.3}``, a trainer's stdout)."""
    if not (raw == b"{" or raw.startswith(b'{"')) or not raw.isascii():
        return False
    try:
        json.loads(raw)
    except ValueError:
        return True  # cut short
    try:
        parse_event(raw.decode())
    except ValueError:
        return False
    return True  # a whole event, its newline not written yet


def open_log(path: str, stream: bool = False) -> BinaryIO:
    """``path`` opened to read. The open never blocks: a named pipe nothing writes would block
    it for ever. ``stream``: a pipe is read too (``report <(zcat events.jsonl.gz)``), to its
    end: its writer's data, or nothing when there is no writer.

    Raises:
        FileNotFoundError: it does not exist.
        ValueError: it is no regular file (nor, with ``stream``, a pipe): named, with the fix.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # io.ops.READ (a layer above this one)
    try:
        mode = os.fstat(fd).st_mode
        if stream and stat.S_ISFIFO(mode):
            os.set_blocking(fd, True)  # reads wait for the writer's data; with no writer they end at once
        elif not stat.S_ISREG(mode):
            raise ValueError(f"{path} is not a regular file (a directory, a device, or a pipe, which cannot be "
                             "followed): give the event log file the Checkpointer's event_log wrote")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _parse_lines(lines: Iterable[tuple[int, bytes]], path: str, skipped: list[str], warn: bool) -> list[Event]:
    """The events of one log's complete lines. A line that is not an event with an event after
    it (a torn write a resumed job appended after, junk) is skipped, its message added to
    ``skipped`` and logged; one after the last event (or in a log with no event) raises."""
    events: list[Event] = []
    bad: list[str] = []
    for no, raw in lines:
        where = f"{path}:{no}"
        try:
            text = decode_line(raw, where)
            if not text.strip():
                continue
            events.append(parse_event(text, where))
        except ValueError as exc:
            bad.append(str(exc))
            continue
        for msg in bad if warn else ():  # an event follows them: they were in the middle
            log.warning("fastckpt: skipped a line that is not an event: %s", msg)
        skipped += bad
        bad = []
    if bad:
        raise ValueError(bad[0])
    return events


def unique_paths(paths: Iterable[str]) -> list[str]:
    """``paths`` in order, each file once: the same log given twice, through a symlink, a hard
    link or a bind mount would count its events twice. Compared by device and inode where the
    file exists (two names of one file), else by real path, so a log that does not exist yet is kept."""
    seen: dict[object, str] = {}
    out: list[str] = []
    for p in paths:
        try:
            st = os.stat(p)
            key: object = (st.st_dev, st.st_ino)
        except OSError:  # not there (yet), or not ours to stat: its name is all there is
            key = os.path.realpath(p)
        if key in seen:
            log.warning("fastckpt: %s is a log already given (%s); read once", p, seen[key])
            continue
        seen[key] = p
        out.append(p)
    return out


def read_events(paths: str | Iterable[str], skipped: list[str] | None = None, *, warn: bool = True) -> list[Event]:
    """Every event of one or more logs (one per rank, say), sorted by start time.

    A line that is not an event between two events (a job killed mid-line, then resumed with
    the same log) is skipped with a warning, as ``LogFollower`` does; its message is appended
    to ``skipped`` when given. An incomplete last line (no newline: the writer was killed) is
    skipped too. ``warn=False``: no warnings (a reader of a log its job is still writing).

    Raises:
        FileNotFoundError: a log does not exist.
        ValueError: a complete line after a log's last event is not an event, or not text, or
            the log has no event but such lines: not an event log (named by file and line number).
    """
    events: list[Event] = []
    skipped = [] if skipped is None else skipped
    for path in unique_paths([paths] if isinstance(paths, str) else paths):
        with open_log(path, stream=True) as f:
            lines = f.read().split(b"\n")
        if lines[-1].strip() and warn:
            log.warning("fastckpt: %s ends in an incomplete line (its writer stopped mid-line); skipped", path)
        events += _parse_lines(enumerate(lines[:-1], 1), path, skipped, warn)
    events.sort(key=lambda e: (e.start, e.end))
    return events


class LogFollower:
    """Reads the events appended to a log since the previous ``poll()``.

    The log may not exist yet (the job has not started): ``poll()`` then returns nothing. When
    the file shrinks or is replaced (a new job writing the same path), it starts over from
    the beginning of the new file; what tells is the bytes just before the offset (the end of the
    last line read, with its session and times), not the inode: a file deleted and created again
    with the same inode number, or rewritten in place, and grown past the old offset before the
    next poll, no longer holds them there, while a log shipped as an updated copy (rsync without
    ``--inplace``, a copy renamed over it: a new inode) does, and is read on from the offset, so
    its events are not counted twice. A complete line that is not an event (a torn write followed by appends,
    binary junk) is skipped with a warning naming the file and line, and counted in
    ``bad_lines``: the events after it are still read, and a live exporter keeps serving.
    """

    TAIL = 256  # bytes before the offset kept to recognise the file (a line's session and times)

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._line = 0
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino)
        self._tail = b""  # the last bytes read, up to the offset
        self._partial = b""
        self.bad_lines = 0
        self._first_bad: str | None = None  # why the first line skipped could not even start an event
        self._events = 0  # read from the file now at the path
        self._not_a_file = False

    def poll(self) -> list[Event]:
        """The complete events written since the last call (possibly none)."""
        try:
            with open_log(self.path) as f:
                st = os.fstat(f.fileno())
                if st.st_size < self._offset or not self._same(f):
                    if self._file is not None:
                        log.warning("fastckpt: %s was replaced or truncated; reading it from the start", self.path)
                    self._offset, self._line, self._tail, self._partial = 0, 0, b"", b""
                    self._first_bad, self._events = None, 0
                elif (st.st_dev, st.st_ino) != self._file and self._file is not None:
                    log.info("fastckpt: %s was replaced by a copy of what was read and more (rsync, a copy renamed "
                             "over it); reading on from byte %d", self.path, self._offset)
                self._file = (st.st_dev, st.st_ino)
                f.seek(self._offset)
                data = f.read(st.st_size - self._offset) if st.st_size > self._offset else b""
        except FileNotFoundError:
            return []
        except ValueError as exc:  # not a regular file: nothing to follow there (warned once)
            if not self._not_a_file:
                log.warning("fastckpt: %s", exc)
            self._not_a_file = True
            return []
        self._not_a_file = False
        if not data:
            return []
        self._offset += len(data)
        self._tail = (self._tail + data)[-self.TAIL:]
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()  # after the last newline: not complete yet
        first = self._line + 1
        self._line += len(chunks)
        events = []
        for no, chunk in enumerate(chunks, first):
            try:  # one bad line costs that line, not the events after it nor the exporter
                if chunk.strip():
                    events.append(parse_event(decode_line(chunk, f"{self.path}:{no}"), f"{self.path}:{no}"))
            except ValueError as exc:
                self.bad_lines += 1
                if not may_start_event(chunk):  # a torn event line, ended by a restarted job, is no proof
                    self._first_bad = self._first_bad or str(exc)
                log.warning("fastckpt: skipped a line that is not an event: %s", exc)
        self._events += len(events)
        return events

    def not_an_event_log(self) -> str | None:
        """Why the file read so far is no event log (a text, JSON or binary file given by
        mistake), or None: it held no event, and a line, or bytes after its last line, that
        cannot start one. An empty log is one; so is a log whose lines a crash cut short
        (``may_start_event``): a job crash-looping at its first save leaves torn lines, each
        ended with a newline by the next launch's sink."""
        if self._events:
            return None
        if self._first_bad is not None:
            why = self._first_bad.partition("; is this a fastckpt event")[0]
        elif self._partial and not may_start_event(self._partial):
            why = f"{self.path}:{self._line + 1}: neither an event nor the start of one, cut short by a crash"
        else:
            return None
        return f"{self.path} is not a fastckpt event log: it holds no event ({why})"

    def _same(self, f: BinaryIO) -> bool:
        """The file still holds, just before the offset, the bytes read there last."""
        f.seek(self._offset - len(self._tail))
        return f.read(len(self._tail)) == self._tail
