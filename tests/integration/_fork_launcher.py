"""Run generations of a multi-rank job whose ranks are forked from this one process.

Usage: _fork_launcher.py MODULE NPROC GENERATIONS [ARG...]

MODULE (a dotted name) is imported once here, with everything it imports (torch, DeepSpeed,
and what its ``prepare()`` imports besides: torch._dynamo, which an optimizer's constructor
imports on its first call). Then, for each generation ``g``, NPROC ranks are forked, each with
torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``: a fresh loopback port per generation; a single rank gets
none of it, as a plain ``python`` launch), and each calls
``MODULE.run_rank(g, *ARGS)`` and exits through the interpreter's normal exit (so exit hooks,
fastckpt's flush among them, run as in any process). When a rank exits non-zero or is killed,
the others get SIGTERM, then SIGKILL after ``GRACE_S``, as torchrun's agent stops a failed
group. After each generation one JSON line goes to stdout: ``{"gen": g, "exitcodes": [...],
"hung": bool}`` (negative exit codes: killed by that signal).

Why not torchrun: on a 2-core machine like CI's, a torchrun generation spent about 11 of its 14 s
importing torch (in torchrun and in every rank), DeepSpeed and torch._dynamo before the first
step. Forked ranks start with all of that imported, and everything after the fork is what
torchrun's ranks do: gloo over loopback, the real engine, real signals. torchrun itself is run
by the other multi-process tests.

No thread runs in this process when it forks (checked before each fork): the guards against a
hang are ``signal.alarm``, not timers.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

GRACE_S = 30  # torchrun's default wait between SIGTERM and SIGKILL
HANG_S = 120  # a generation longer than this is killed and reported hung


@dataclass(frozen=True)
class Launched:
    """What a test gets back: each generation's line, and everything the ranks printed."""

    generations: list[dict]
    output: str


def run_session(cmd: list[str], env: dict[str, str], timeout_s: float, cwd: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session, output captured; on a hang kill the whole session and
    raise (its ranks, and anything they started, go with it)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} hung for {timeout_s} s:\n{out[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def launch(module: str, nproc: int, generations: int, args: list[str], env: dict[str, str], cwd: str,
           timeout_s: float = 600) -> Launched:
    """Run this launcher (``run_session``); raise unless it ran every generation."""
    cmd = [sys.executable, os.path.abspath(__file__), module, str(nproc), str(generations), *args]
    proc = run_session(cmd, env, timeout_s, cwd)
    out = proc.stdout
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{out[-8000:]}")
    gens = [json.loads(line) for line in out.splitlines() if line.startswith('{"gen"')]
    if [g["gen"] for g in gens] != list(range(generations)):
        raise AssertionError(f"{cmd} reported generations {[g['gen'] for g in gens]}:\n{out[-8000:]}")
    return Launched(gens, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(module: object, rank: int, nproc: int, port: int, gen: int, args: list[str]) -> None:
    """The forked rank: never returns (``SystemExit`` unwinds to the interpreter's exit)."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    if nproc > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    module.run_rank(gen, *args)  # type: ignore[attr-defined]
    raise SystemExit(0)


def generation(module: object, nproc: int, gen: int, args: list[str]) -> dict:
    if threading.active_count() != 1:
        raise RuntimeError(f"a thread runs in the launcher before a fork: {threading.enumerate()}")
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            child(module, rank, nproc, port, gen, args)
        ranks[pid] = rank
    codes: dict[int, int] = {}
    state = {"stopping": False, "hung": False}

    def on_alarm(_sig: int, _frame: object) -> None:
        state["hung"] = not state["stopping"]
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):  # reaped, not yet popped
                os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_S)
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] != 0 and not state["stopping"]:
            state["stopping"] = True
            for other in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGTERM)
            signal.alarm(GRACE_S)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    return {"gen": gen, "exitcodes": [codes[r] for r in range(nproc)], "hung": state["hung"]}


def main(argv: list[str]) -> None:
    name, nproc, generations, args = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    module = importlib.import_module(name)
    module.prepare()  # type: ignore[attr-defined]
    for gen in range(generations):
        print(json.dumps(generation(module, nproc, gen, args)), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1:])
