"""SIGTERM as Ctrl-C: the commands that start processes or write scratch files clean up alike."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

CLEANUP_S = 10.0  # how long clean-up after SIGTERM may take before the process ends regardless
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: the status a kill by SIGTERM reports to a shell


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a scheduler's cancel) raises KeyboardInterrupt, so the ``finally`` blocks that
    clean up after Ctrl-C run for it too. Clean-up can hang where the command did (a write stuck
    on a hung mount, a thread pool joining that write's worker): the handler therefore restores
    SIGTERM's default action, so a second SIGTERM kills at once, and arms a daemon watchdog that
    ends the process with exit 143 if it is still running ``CLEANUP_S`` seconds later. The
    watchdog stays armed after this block: the callers' own clean-up runs outside it."""
    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        watchdog = threading.Timer(CLEANUP_S, os._exit, (EXIT_SIGTERM,))
        watchdog.daemon = True  # never what keeps the process alive
        watchdog.start()
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
