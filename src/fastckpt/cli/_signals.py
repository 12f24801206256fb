"""SIGTERM as Ctrl-C: the commands that start processes or write scratch files clean up alike."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

CLEANUP_S = 10.0  # how long clean-up after SIGTERM may take before the process ends regardless
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: the status a kill by SIGTERM reports to a shell
EXIT_SIGINT = 128 + signal.SIGINT  # 130: Ctrl-C's


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
