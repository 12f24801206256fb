"""Reading event logs: a whole JSONL file (``fastckpt report``) or one being written (``fastckpt
serve-metrics`` follows a running job's log).

A log holds one JSON object per line, as ``JsonlSink`` writes them (``fastckpt.events``). A line
is read only once its newline is there, so a follower never sees half a line; the last line
of a log whose writer was killed mid-line is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable

from .events import Event

log = logging.getLogger("fastckpt")
_FIELDS = ("name", "rank", "path", "bytes", "start", "end", "tier")
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
    return Event(str(d["name"]), int(d["rank"]), str(d["path"]), int(d["bytes"]), float(d["start"]),
                 float(d["end"]), str(d["tier"]), d.get("error"), d.get("detail"))


def _parse_lines(lines: Iterable[tuple[int, str]], path: str) -> list[Event]:
    return [parse_event(text, f"{path}:{no}") for no, text in lines if text.strip()]


def read_events(paths: str | Iterable[str]) -> list[Event]:
    """Every event of one or more logs (one per rank, say), sorted by start time.

    Raises:
        FileNotFoundError: a log does not exist.
        ValueError: a complete line is not an event (named by file and line number).
    """
    events: list[Event] = []
    for path in [paths] if isinstance(paths, str) else list(paths):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.split("\n")
        if lines[-1].strip():
            log.warning("fastckpt: %s ends in an incomplete line (its writer stopped mid-line); skipped", path)
        events += _parse_lines(enumerate(lines[:-1], 1), path)
    events.sort(key=lambda e: (e.start, e.end))
    return events


class LogFollower:
    """Reads the events appended to a log since the previous ``poll()``.

    The log may not exist yet (the job has not started): ``poll()`` then returns nothing. When
    the file shrinks or is replaced (a new job writing the same path), it starts over from
    the beginning of the new file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._line = 0
        self._inode: int | None = None
        self._partial = b""

    def poll(self) -> list[Event]:
        """The complete events written since the last call (possibly none)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            if self._inode is not None:
                log.warning("fastckpt: %s was replaced or truncated; reading it from the start", self.path)
            self._inode, self._offset, self._line, self._partial = st.st_ino, 0, 0, b""
        if st.st_size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        self._offset += len(data)
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()  # after the last newline: not complete yet
        first = self._line + 1
        self._line += len(chunks)
        return _parse_lines(((first + i, c.decode("utf-8")) for i, c in enumerate(chunks)), self.path)
