"""Progress of long operations: a rich bar on a terminal, a log line every few seconds otherwise.

Rendering runs on its own thread, never on the caller's: the caller's only work is ``update()``
or ``advance()`` (one locked assignment), or nothing at all when it passes ``read=`` and the
progress thread polls the amount done. Nothing is shown for operations that finish within
``delay_s``, so a ``wait()`` that returns at once stays silent::

    with Progress("replicating 3 checkpoints", total=nbytes, read=lambda: copied_bytes()):
        wait_for_everything()

    with Progress("writing probe", total=size) as p:
        for chunk in chunks:
            write(chunk)
            p.advance(len(chunk))
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from .units import fmt_bytes

log = logging.getLogger("fastckpt")
MODES = ("auto", "bar", "log", "off")


def human(n: float, unit: str = "B") -> str:
    """1536 -> '1.54 kB' for bytes (``units.fmt_bytes``, as the CLI prints them); other units
    print plainly ('3 files')."""
    return fmt_bytes(n) if unit == "B" else f"{n:,.0f} {unit}"


class Progress:
    """Progress of one operation, shown off the caller's thread.

    Args:
        description: what is progressing ("replicating 3 checkpoints").
        total: the amount when done; None when unknown (no percentage, no ETA).
        unit: "B" for bytes (shown as KiB, MiB...), or a count's unit ("files").
        read: a function returning the amount done so far, polled by the progress thread
            (then ``update``/``advance`` are not needed); it must be thread-safe and cheap.
        mode: "auto" (a bar when ``stream`` is a terminal, else log lines), "bar", "log", "off".
        every_s: seconds between log lines.
        delay_s: show nothing unless the operation is still running after this long.
        stream: where the bar is drawn (default: stderr).
        logger: where log lines go (default: the "fastckpt" logger, INFO).
    """

    def __init__(self, description: str, total: float | None = None, *, unit: str = "B",
                 read: Callable[[], float] | None = None, mode: str = "auto", every_s: float = 5.0,
                 delay_s: float = 0.0, stream: TextIO | None = None, logger: logging.Logger | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {', '.join(MODES)}")
        if every_s <= 0 or delay_s < 0:
            raise ValueError("every_s must be > 0 and delay_s >= 0 seconds")
        self.description, self.total, self.unit = description, total, unit
        self._read, self._every_s, self._delay_s = read, every_s, delay_s
        self._stream = stream if stream is not None else sys.stderr
        self._log = logger or log
        isatty = getattr(self._stream, "isatty", lambda: False)()
        self.mode = ("bar" if isatty else "log") if mode == "auto" else mode
        self._lock = threading.Lock()
        self._done = 0.0
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None
        self.lines = 0  # log lines written (tests and callers may want to know it spoke)

    # ------------------------------------------------------------------ the caller's side
    def update(self, done: float) -> None:
        """Set the amount done (thread-safe, O(1))."""
        with self._lock:
            self._done = done

    def advance(self, n: float) -> None:
        """Add ``n`` to the amount done (thread-safe, O(1))."""
        with self._lock:
            self._done += n

    @property
    def done(self) -> float:
        if self._read is not None:
            return float(self._read())
        with self._lock:
            return self._done

    def start(self) -> Progress:
        if self.mode != "off" and self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="fastckpt-progress", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop; a bar or log that was shown gets its final state."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the progress thread
    def line(self) -> str:
        """The progress as one line of text."""
        done, elapsed = self.done, time.monotonic() - self._t0
        text = f"{self.description}: {human(done, self.unit)}"
        if self.total:
            text += f" of {human(self.total, self.unit)} ({min(done / self.total, 1.0):.0%})"
        if elapsed > 0 and done > 0:
            rate = done / elapsed
            text += f", {human(rate, self.unit)}/s"
            if self.total and done < self.total:
                text += f", ~{(self.total - done) / rate:.0f} s left"
        return text + f" after {elapsed:.0f} s"

    def _run(self) -> None:
        if self._stop.wait(self._delay_s):
            return  # finished quickly: say nothing
        if self.mode == "bar":
            self._run_bar()
        else:
            while not self._stop.wait(self._every_s if self.lines else 0.0):
                self._emit()
            self._emit()

    def _emit(self) -> None:
        self._log.info("fastckpt: %s", self.line())
        self.lines += 1

    def _run_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as Bar

        cols = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()]
        if self.unit == "B":
            cols += [DownloadColumn(binary_units=True), TransferSpeedColumn()]
        cols.append(TimeRemainingColumn())
        with Bar(*cols, console=Console(file=self._stream), auto_refresh=False, transient=False) as bar:
            task = bar.add_task(self.description, total=self.total)
            while not self._stop.wait(0.1):
                bar.update(task, completed=self.done)
                bar.refresh()
            bar.update(task, completed=self.done)
            bar.refresh()
