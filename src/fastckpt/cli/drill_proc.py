"""The drill's child processes: each in its own process group, so a kill takes its children
too; its stdout JSON lines read by a thread into a queue, its stderr to a log file."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

from ..errors import FastCkptError

TAIL_BYTES = 4000


class DrillError(FastCkptError, RuntimeError):
    """The job or the probe did not behave as the drill needs (it exited, or went silent)."""


class Child:
    """A child (in its own process group, so a kill takes its children too) whose stdout
    JSON lines are read by a thread into a queue; stderr goes to a log file."""

    def __init__(self, argv: list[str], log_path: str, env: dict | None = None, json_lines: bool = True,
                 who: str = "the job") -> None:
        self.log_path, self.who = log_path, who  # who is named when it fails: the job, or the drill's own probe
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in kill() / close())
        self.t_spawn = time.time()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE if json_lines else self._log, stderr=self._log,
                                     env=env, start_new_session=True, text=json_lines)
        self.lines: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True) if json_lines else None
        if self._reader:
            self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:  # type: ignore[union-attr]
            try:
                self.lines.put(json.loads(raw))
            except ValueError:
                continue  # not a protocol line (a library printed something)
        self.lines.put(None)

    def tail(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - TAIL_BYTES))
            return f.read().decode(errors="replace")

    def next(self, timeout_s: float) -> dict:
        """The job's next line.

        Raises:
            TimeoutError: none within ``timeout_s``.
            DrillError: it exited (with its log's tail).
        """
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError from None
        if line is None:
            self.proc.wait()
            raise DrillError(f"{self.who} exited with {self.proc.returncode}; its log {self.log_path} ends:\n"
                             f"{self.tail()}")
        return line

    def kill(self) -> list[dict]:
        """SIGKILL the process group; return the lines it wrote that were not read yet. Once:
        a second call (the drill's cleanup) returns nothing and signals no one."""
        if self._log.closed:
            return []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        rest = []
        if self._reader:
            self._reader.join()  # it has queued everything, up to its end mark (perhaps taken already)
            while not self.lines.empty():
                line = self.lines.get_nowait()
                if line is not None:
                    rest.append(line)
        self._log.close()
        return rest
