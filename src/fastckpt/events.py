"""Events: one per phase of every save; the monitor and the JSONL log consume them."""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from typing import IO, Protocol


@dataclass(frozen=True)
class Event:
    """One phase of one save (or a load).

    Times are ``time.time()`` seconds; ``error`` is the exception's repr when the phase failed.
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

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["duration_s"] = round(self.duration_s, 6)
        return json.dumps(d, sort_keys=True)


class EventSink(Protocol):
    """Receives every event. Called from the training thread and from worker threads."""

    def emit(self, event: Event) -> None: ...


class JsonlSink:
    """Appends one JSON line per event to a file (flushed per line, safe across threads)."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._f: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def emit(self, event: Event) -> None:
        line = event.to_json()
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()
