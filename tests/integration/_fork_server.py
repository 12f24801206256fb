"""Start Python processes by forking them from one process that imported the heavy modules once.

Usage: _fork_server.py PRELOAD...

Every PRELOAD module is imported once here. Then each line on stdin is a JSON request:

- ``{"module": NAME, "argv": [...], "env": {...}, "stdout": PATH, "stderr": PATH}``: fork a child that runs
  the script NAME (a dotted name, a module with a ``main()`` that reads ``sys.argv``) as
  ``python NAME's-file ARGV...`` would: ``sys.argv = [its file, *argv]``, then ``main()``.
- ``{"code": TEXT, "argv": [...], ...}``: fork a child that runs TEXT as ``python -c TEXT
  ARGV...`` would: in a fresh ``__main__`` module, ``sys.argv = ["-c", *argv]``.
- ``{"script": PATH, "argv": [...], ...}``: fork a child that runs the file PATH as ``python PATH
  ARGV...`` would (``runpy.run_path``: its own ``__main__``, its folder first on ``sys.path``).

Any request may add ``"cwd": DIR`` (the child's working directory) and ``"env_exact": true``
(``env`` is the child's whole environment, not an addition to the server's).

Either way the child starts its own session (as ``Popen(start_new_session=True)``:
``os.killpg(pid, SIGKILL)`` takes it and anything it forks), adds ``env`` to its environment,
reads /dev/null, writes its stdout and stderr to those paths (a FIFO too: a test can read a
child's lines as they come; each child has its own, as two processes' prints on one pipe can
interleave within a line), and ends through the interpreter's normal exit
(exit hooks run as in a script). Answers ``FORKSERVER forked PID``.
- ``{"wait": PID, "timeout_s": T}``: wait for that child; answers ``FORKSERVER exited PID CODE``
  (a negative CODE: killed by that signal), with `` hung`` after it when the child was still
  running after T s and this process SIGKILLed its process group (it reaps the child: no other
  process may signal that pid, which another process may get once it is reaped).

The answers are this process's stdout lines that start with ``FORKSERVER``. EOF on stdin ends
the server (``os._exit``: see ``main``).

Why: importing torch and megatron-core takes about 4 s of CPU on a 2-core machine like CI's,
and tests that started a fresh process for every rank, kill or check paid it every time. A
forked child starts with all of that imported and runs as the script started for it would from
there. The children are forked before this process runs any test code (no state of one child
reaches the next), and no thread runs here when it forks (checked).
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
import types
import uuid
from pathlib import Path

PREFIX = "FORKSERVER "


class ForkServer:
    """The test's side: runs this script, sends it requests and reads its answers.

    Args:
        preload: modules imported in the server before any fork.
        env: the server's environment, which every child inherits (a module that reads the
            environment at import sees this one).
        log_path: the server's own stderr; ``run_code`` keeps its children's output beside it.
        timeout_s: how long an answer may take (the first waits for the imports).
    """

    def __init__(self, preload: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.out_dir = Path(log_path).parent
        self._answers: queue.Queue[str] = queue.Queue()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *preload], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(PREFIX):
                self._answers.put(line[len(PREFIX):].strip())

    def _ask(self, request: dict, timeout_s: float | None = None) -> list[str]:
        self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        try:
            return self._answers.get(timeout=timeout_s or self.timeout_s).split()
        except queue.Empty:
            raise AssertionError(f"the fork server did not answer {request} within {timeout_s or self.timeout_s} s "
                                 f"(exit code {self.proc.poll()})") from None

    def start(self, argv: list[str], env: dict[str, str], stdout_path: str, stderr_path: str, **what: object) -> int:
        """Fork a child (``what``: ``module=``, ``code=`` or ``script=``, and the module docstring's
        options); its
        pid (and session id)."""
        return int(self._ask({"argv": argv, "env": env, "stdout": stdout_path, "stderr": stderr_path, **what})[1])

    def wait(self, pid: int, timeout_s: float | None = None) -> int:
        """Wait for the child ``pid`` to end; its exit code (negative: the signal that killed it).
        A child still running after ``timeout_s`` (default: the server's) is SIGKILLed, with
        anything it forked, and the test fails."""
        limit = timeout_s or self.timeout_s
        # the server, which reaps the child, kills it at the limit: only it may signal that pid
        # (once reaped, the pid may be another process's), and every request gets its one answer
        answer = self._ask({"wait": pid, "timeout_s": limit}, limit + self.timeout_s)
        if answer[3:] == ["hung"]:
            raise AssertionError(f"the forked child {pid} was still running after {limit} s: SIGKILLed")
        return int(answer[2])

    def run_code(self, code: str, argv: list[str], timeout_s: float,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
        timeout=timeout_s)``, forked (its stdout and stderr pass through files beside the log),
        with ``env`` added to its environment. A child still running after ``timeout_s`` is
        SIGKILLed and the test fails with its output."""
        return self._run(["-c", *argv], argv, env or {}, timeout_s, code=code)

    def run_module(self, module: str, argv: list[str], env: dict[str, str],
                   timeout_s: float) -> subprocess.CompletedProcess:
        """``run_code``'s counterpart for a preloaded script ``module`` (``python its-file ARGV...``),
        with ``env`` added to the child's environment."""
        return self._run([module, *argv], argv, env, timeout_s, module=module)

    def run_script(self, script: str, cwd: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, script], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=timeout_s)``, forked: ``env`` is the child's whole environment."""
        return self._run([script], [], env, timeout_s, script=script, cwd=cwd, env_exact=True)

    def _run(self, args: list[str], argv: list[str], env: dict[str, str], timeout_s: float,
             **what: object) -> subprocess.CompletedProcess:
        stem = self.out_dir / f"forked-{uuid.uuid4().hex[:12]}"
        out, err = Path(f"{stem}.out"), Path(f"{stem}.err")
        pid = self.start(argv, env, str(out), str(err), **what)
        try:
            exit_code = self.wait(pid, timeout_s)
        except AssertionError:
            raise AssertionError(f"the forked child hung for {timeout_s} s:\n{out.read_text()[-3000:]}\n"
                                 f"{err.read_text()[-3000:]}") from None
        return subprocess.CompletedProcess(args, exit_code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fork_child(request: dict) -> int:
    if threading.active_count() != 1:
        raise RuntimeError(f"a thread runs in the fork server before a fork: {threading.enumerate()}")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    os.setsid()
    if request.get("env_exact"):  # the child's whole environment, not an addition to the server's
        os.environ.clear()
    os.environ.update(request.get("env", {}))
    if "cwd" in request:
        os.chdir(request["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    if "module" in request:
        module = sys.modules[request["module"]]
        sys.argv = [module.__file__, *request["argv"]]
        module.main()
    elif "script" in request:  # as ``python SCRIPT ARGV...``: its folder first on sys.path, its own __main__
        sys.argv = [request["script"], *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
        runpy.run_path(request["script"], run_name="__main__")
    else:
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module  # classes the code defines pickle as a -c script's do
        sys.argv = ["-c", *request["argv"]]
        exec(compile(request["code"], "<string>", "exec"), main_module.__dict__)  # noqa: S102
    raise SystemExit(0)


def main(argv: list[str]) -> None:
    for name in argv:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            pid = request["wait"]
            with os.fdopen(os.pidfd_open(pid), "rb", buffering=0) as ended:  # readable once the child ends
                hung = not select.select([ended], [], [], request["timeout_s"])[0]
                if hung:
                    os.killpg(pid, signal.SIGKILL)  # not reaped yet: the pid (its group's id) is still its
            _, status = os.waitpid(pid, 0)
            print(f"{PREFIX}exited {pid} {os.waitstatus_to_exitcode(status)}{' hung' if hung else ''}", flush=True)
        else:
            print(f"{PREFIX}forked {fork_child(request)}", flush=True)
    # The server ran no worker code: nothing of its own to flush or close. Skipping the
    # interpreter's teardown of torch and megatron-core saves about 4 s of every test's close.
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1:])
