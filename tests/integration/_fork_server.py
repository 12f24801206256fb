"""Start processes of a worker script by forking them from one process that imported it once.

Usage: _fork_server.py MODULE [PRELOAD...]

MODULE (a dotted name, a script with a ``main()`` that reads ``sys.argv``) and every PRELOAD
module are imported once here. Then each line on stdin is a JSON request:

- ``{"argv": [...], "env": {...}, "stderr": PATH}``: fork a child that starts its own session
  (as ``Popen(start_new_session=True)``: ``os.killpg(pid, SIGKILL)`` takes it and anything it
  forks), adds ``env`` to its environment, writes its stderr to PATH, reads /dev/null, keeps
  this process's stdout, sets ``sys.argv = [MODULE's file, *argv]`` and calls ``MODULE.main()``,
  then exits through the interpreter's normal exit (exit hooks run as in a script). Answers
  ``FORKSERVER forked PID``.
- ``{"wait": PID}``: wait for that child; answers ``FORKSERVER exited PID CODE`` (a negative
  CODE: killed by that signal). Everything the child wrote to stdout comes before this line.

EOF on stdin ends the server (``os._exit``: see ``main``). The answers share stdout with the children's own lines;
``ForkServer`` (the test's side) tells them apart by the ``FORKSERVER`` prefix.

Why: importing torch and megatron-core takes about 4 s of CPU on a 2-core machine like CI's,
and tests that start a fresh rank for every kill paid it every time. A forked child starts with
all of that imported and runs the worker exactly as a script started for it would from there.
The children are forked before this process runs any worker code (no state of one child reaches
the next), and no thread runs here when it forks (checked).
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import subprocess
import sys
import threading

PREFIX = "FORKSERVER "


class ForkServer:
    """The test's side: runs this script, sends requests, hands the children's lines over.

    Args:
        module: the worker module (see the module docstring).
        preload: modules the workers import later, imported in the server before any fork.
        env: the server's environment, which every child inherits (a worker that reads the
            environment at import sees this one).
        log_path: the server's own stderr.
        timeout_s: how long an answer may take (the first waits for the imports).
    """

    def __init__(self, module: str, preload: list[str], env: dict[str, str], log_path: str,
                 timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.lines: queue.Queue[str] = queue.Queue()  # the children's stdout lines, stripped
        self._answers: queue.Queue[str] = queue.Queue()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), module, *preload], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            line = line.strip()
            if line.startswith(PREFIX):
                self._answers.put(line[len(PREFIX):])
            else:
                self.lines.put(line)

    def _ask(self, request: dict) -> list[str]:
        self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        try:
            return self._answers.get(timeout=self.timeout_s).split()
        except queue.Empty:
            raise AssertionError(f"the fork server did not answer {request} within {self.timeout_s} s "
                                 f"(exit code {self.proc.poll()})") from None

    def start(self, argv: list[str], env: dict[str, str], stderr_path: str) -> int:
        """Fork a child running the worker with ``argv``; its pid (and session id)."""
        return int(self._ask({"argv": argv, "env": env, "stderr": stderr_path})[1])

    def wait(self, pid: int) -> int:
        """Wait for the child ``pid`` to end; its exit code (negative: the signal that killed it)."""
        return int(self._ask({"wait": pid})[2])

    def drain(self) -> list[str]:
        """The children's lines not taken yet."""
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return out

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fork_child(module: object, request: dict) -> int:
    if threading.active_count() != 1:
        raise RuntimeError(f"a thread runs in the fork server before a fork: {threading.enumerate()}")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    os.setsid()
    os.environ.update(request.get("env", {}))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(devnull)
    os.close(err)
    sys.argv = [module.__file__, *request["argv"]]  # type: ignore[attr-defined]
    module.main()  # type: ignore[attr-defined]
    raise SystemExit(0)


def main(argv: list[str]) -> None:
    module = importlib.import_module(argv[0])
    for name in argv[1:]:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            _, status = os.waitpid(request["wait"], 0)
            print(f"{PREFIX}exited {request['wait']} {os.waitstatus_to_exitcode(status)}", flush=True)
        else:
            print(f"{PREFIX}forked {fork_child(module, request)}", flush=True)
    # The server ran no worker code: nothing of its own to flush or close. Skipping the
    # interpreter's teardown of torch and megatron-core saves about 4 s of every test's close.
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1:])
