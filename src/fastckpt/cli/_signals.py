"""SIGTERM as Ctrl-C: the commands that start processes or write scratch files clean up alike."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a scheduler's cancel) raises KeyboardInterrupt, so the ``finally`` blocks that
    clean up after Ctrl-C run for it too."""
    def handler(signum: int, frame: object) -> None:
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
