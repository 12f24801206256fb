"""One long-lived child process that runs ``fastckpt`` command lines through the CLI's ``main``.

A child per command line spends most of a CLI test's time starting Python and importing the CLI,
torch and the subcommand's own imports (matplotlib for ``report``, s3fs for a URL) again and
again. ``CliChild`` starts one child per test module (a module-scoped fixture) and runs each
command line there, in order, with its own stdout, stderr, environment and working directory,
as the ``fastckpt`` script would: an exception that escapes ``main`` is printed as its traceback
and exits 1. A test that needs a fresh process (a signal, a limit on the process, an injected
fault) starts its own.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
from pathlib import Path

# Requests come on stdin and replies go out on a copy of stdout, one JSON line each; the command's
# own stdin is /dev/null and its stdout/stderr are captured, so nothing it prints reaches the pipe.
_SERVE = """
import contextlib, io, json, os, sys, traceback
requests, replies = os.fdopen(os.dup(0)), os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
from fastckpt.cli import main
for line in requests:
    argv, env, cwd = json.loads(line)
    saved, here = dict(os.environ), os.getcwd()
    os.environ.update(env)
    os.chdir(cwd or here)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException:  # what the script would print: a test's "no traceback" check sees it
            traceback.print_exc()
            code = 1
    os.chdir(here)
    os.environ.clear()
    os.environ.update(saved)
    replies.write(json.dumps([code, out.getvalue(), err.getvalue()]) + "\\n")
    replies.flush()
"""


class CliChild:
    """``run(argv)`` is ``subprocess.run(["fastckpt", *argv], capture_output=True, text=True)``
    in one child process shared by every call; ``close()`` ends it. A command that gives no
    answer within ``timeout_s`` fails its test and the child is killed: the next call starts a
    fresh one, so one hung command does not take the module's later tests with it."""

    def __init__(self, timeout_s: float = 300) -> None:
        self._timeout_s = timeout_s
        self._log = tempfile.TemporaryFile("w+")  # the child's own stderr (what escapes a capture)
        self._proc: subprocess.Popen | None = None

    def run(self, *argv: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run ``fastckpt ARGV`` with ``env`` added to the environment, in ``cwd``."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-u", "-c", _SERVE], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._proc.stdin.write(json.dumps([list(argv), env or {}, str(cwd) if cwd else None]) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], self._timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self._end(kill=True)
            self._log.seek(0)
            raise AssertionError(f"the CLI child gave no answer to {argv} in {self._timeout_s} s (exit "
                                 f"{self._proc.returncode}): {self._log.read()[-4000:]}")
        code, out, err = json.loads(line)
        return subprocess.CompletedProcess(["fastckpt", *argv], code, out, err)

    def close(self) -> None:
        try:
            self._end(kill=False)
        finally:
            self._log.close()

    def _end(self, kill: bool) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        if kill:
            self._proc.kill()
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
