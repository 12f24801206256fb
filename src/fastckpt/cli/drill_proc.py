"""The drill's child processes: each in its own process group, so a kill takes its children
too; its stdout JSON lines read by a thread into a queue, its stderr to a log file.

A drill killed with SIGKILL runs no clean-up, and its jobs, in sessions of their own, would train
on for good. So each group's leader dies with the drill (``die_with_parent``), and a guard, a
tiny process in a session of its own, holds the read end of a pipe only the drill writes to:
when that end reads EOF without a word first (every descriptor of the drill closed: it is gone),
the guard SIGKILLs the whole group, the leader's own children too. ``Child.kill`` says a word
and closes the pipe: the guard then leaves the group, by then gone and its number free, alone.
Either way the guard then kills every process that carries the child's mark in its environment
(torchrun's workers, in sessions of their own: orphans once the job's first process died, with
the drill, or on its own as a crashed launcher), and ``Child.kill`` waits for it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

from ..errors import FastCkptError
from ._signals import descendants, die_with_parent

TAIL_BYTES = 4000
MARK = "FASTCKPT_DRILL_CHILD"  # in each child's environment, which everything it starts inherits
# The guard, on EOF without a word (the drill is gone): SIGKILL the job's process group; then, word
# or not, every process whose environment carries the job's mark. torchrun's workers start sessions
# of their own, out of the group, and once the job's first process dies they are orphans with no
# parent link back to it; the mark, inherited through fork and exec, still names them.
_GUARD = """
import os, signal, sys
job, mark = int(sys.argv[1]), sys.argv[2].encode()
if not os.read(0, 1):
    try:
        os.killpg(job, signal.SIGKILL)
    except ProcessLookupError:
        pass
for name in os.listdir("/proc"):  # also after the word: a job whose first process died left orphans
    try:
        with open(f"/proc/{name}/environ", "rb") as f:
            marked = mark in f.read().split(b"\\0")
        if name.isdigit() and marked:
            os.kill(int(name), signal.SIGKILL)
    except (OSError, ValueError):
        pass
"""


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
        mark = f"{MARK}={uuid.uuid4().hex}"
        env = dict(os.environ if env is None else env, **dict([mark.split("=")]))
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE if json_lines else self._log, stderr=self._log,
                                     env=env, start_new_session=True, text=json_lines,
                                     preexec_fn=functools.partial(die_with_parent, os.getpid()))
        watched, self._alive = os.pipe()  # not inherited (PEP 446): only the drill holds the write end
        try:
            self._guard = subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD, str(self.proc.pid), mark],
                                           stdin=watched, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(watched)
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
        """SIGKILL the process group and every process below the job (also in sessions of their
        own); return the lines it wrote that were not read yet. Once:
        a second call (the drill's cleanup) returns nothing and signals no one."""
        if self._log.closed:
            return []
        below = descendants(self.proc.pid)  # before the kill: orphans have no link back to the job
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in below:  # torchrun's workers, in sessions of their own: a crash takes them too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        with contextlib.suppress(BrokenPipeError):  # the guard was killed (it has nothing left to do)
            os.write(self._alive, b"k")  # the word: the group is gone, the guard need not kill it
        os.close(self._alive)
        self._guard.wait()
        rest = []
        if self._reader:
            self._reader.join()  # it has queued everything, up to its end mark (perhaps taken already)
            while not self.lines.empty():
                line = self.lines.get_nowait()
                if line is not None:
                    rest.append(line)
        self._log.close()
        return rest
