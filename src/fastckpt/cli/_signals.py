"""SIGTERM as Ctrl-C: the commands that start processes or write scratch files clean up alike.
SIGKILL runs no clean-up at all: the processes they start die with them (``die_with_parent``)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

CLEANUP_S = 10.0  # how long clean-up after SIGTERM may take before the process ends regardless
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: the status a kill by SIGTERM reports to a shell
EXIT_SIGINT = 128 + signal.SIGINT  # 130: Ctrl-C's
_PR_SET_PDEATHSIG = 1  # prctl(2)
# resolved here, not in the child: ``die_with_parent`` may run between fork and exec
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """Have Linux SIGKILL this process when its parent ``parent`` ends (``prctl(PR_SET_PDEATHSIG)``;
    strictly, when the parent's thread that started it ends: start children from a thread that
    lives as long as they should). A parent killed with SIGKILL (the OOM killer, ``timeout -s
    KILL``) cleans nothing up; without this its children run on. A no-op off Linux."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a scheduler's cancel) raises KeyboardInterrupt, so the ``finally`` blocks that
    clean up after Ctrl-C run for it too. Clean-up can hang where the command did (a write stuck
    on a hung mount, a thread pool joining that write's worker): the handler therefore restores
    SIGTERM's default action, so a second SIGTERM kills at once, and arms a daemon watchdog that
    ends the process with exit 143 if it is still running ``CLEANUP_S`` seconds later (Ctrl-C
    arms it too, with exit 130, as the KeyboardInterrupt leaves this block). The
    watchdog stays armed after this block: the callers' own clean-up runs outside it."""
    armed: list[threading.Timer] = []

    def arm(status: int) -> None:
        if not armed:
            armed.append(threading.Timer(CLEANUP_S, os._exit, (status,)))
            armed[0].daemon = True  # never what keeps the process alive
            armed[0].start()

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        arm(EXIT_SIGTERM)
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    except KeyboardInterrupt:  # Ctrl-C too: a worker stuck on a hung mount would hold the exit for good
        arm(EXIT_SIGINT)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, by the parent links in /proc ([] where there is none): a
    job's children that started sessions of their own (torchrun's workers do) are out of its
    process group, so a ``killpg`` of the job misses them."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
        except (OSError, ValueError):  # exited meanwhile
            continue
        if state != b"Z":
            children.setdefault(int(ppid), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out
