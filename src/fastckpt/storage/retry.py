"""Retrying one storage request, with tenacity: transient errors (connection refused or reset,
timeouts, HTTP 5xx/429, SlowDown) are retried with exponential backoff and full jitter until
``deadline_s`` has passed (the last backoff is cut short so that one attempt starts at the
deadline, not up to a backoff before it); anything else becomes the target's permanent
``ReplicationError`` at once. The deadline applies to one request (one part, one small object,
one range), so a long upload that keeps making progress is never cut off, while a target that
stays down fails after the deadline with ``TargetUnavailableError``.

Retries are logged at INFO while they cost little, and at WARNING from the first one that has
delayed the request by more than ``WARN_AFTER_S`` (an outage the user should hear about).

``capped(s)``: the requests made inside it on this thread retry for ``s`` at most, whatever the
target's deadline (a check that has a cheaper answer when the store does not answer soon).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import tenacity

from ..errors import ConfigError, CorruptCheckpointError, ReplicationError
from .types import RetryCallback, RetryNotice, TargetUnavailableError, storage_error

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
WARN_AFTER_S = 5.0
_FINAL = (ReplicationError, CorruptCheckpointError, ConfigError)  # already ours: never retried or wrapped


_CAP: contextvars.ContextVar[float | None] = contextvars.ContextVar("fastckpt_retry_cap", default=None)


@contextlib.contextmanager
def capped(deadline_s: float) -> Iterator[None]:
    """Inside it (this thread), ``retry_call``'s deadline is at most ``deadline_s``."""
    token = _CAP.set(deadline_s)
    try:
        yield
    finally:
        _CAP.reset(token)


class RetryCounter(Protocol):
    def retried(self) -> None: ...


def retry_call(fn: Callable[[], T], *, what: str, url: str, deadline_s: float,
               is_transient: Callable[[BaseException], bool],
               permanent: Callable[[BaseException, str], ReplicationError | None],
               on_retry: RetryCallback | None = None, progress: RetryCounter | None = None,
               cancel: threading.Event | None = None) -> T:
    """Call ``fn`` until it succeeds, fails permanently, or the deadline passes.

    Args:
        what: the request, for messages (``"upload of part 2/4 of s3://b/k"``).
        url: the target's root, for messages.
        deadline_s: the last attempt starts this long after the first one (0: no retries).
        is_transient: whether an error is worth retrying.
        permanent: the ``ReplicationError`` for a permanent error (None: re-raise it as is).
        on_retry: called with a ``RetryNotice`` before each backoff.
        progress: counts the retries.
        cancel: once set (a sibling part failed), the next transient error is raised instead
            of retried, and a backoff in progress ends early.

    Raises:
        TargetUnavailableError: transient errors outlasted ``deadline_s``.
        ReplicationError: a permanent error, named by ``permanent``.
    """
    t0 = time.monotonic()
    cap = _CAP.get()
    capped_here = cap is not None and cap < deadline_s
    if capped_here:
        deadline_s = cap  # type: ignore[assignment]

    def retryable(exc: BaseException) -> bool:
        return not isinstance(exc, _FINAL) and is_transient(exc) and not (cancel is not None and cancel.is_set())

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc, delay = state.outcome.exception(), state.upcoming_sleep  # type: ignore[union-attr]
        elapsed = time.monotonic() - t0
        if progress is not None:
            progress.retried()
        level = logging.WARNING if elapsed + delay > WARN_AFTER_S else logging.INFO
        log.log(level, "%s: transient error (%s), attempt %d, retrying in %.2f s", what, exc, state.attempt_number,
                delay)
        if on_retry is not None:
            on_retry(RetryNotice(what, state.attempt_number, exc, delay, elapsed))  # type: ignore[arg-type]

    def give_up(state: tenacity.RetryCallState) -> T:
        exc = state.outcome.exception()  # type: ignore[union-attr]
        elapsed = time.monotonic() - t0
        longer = (f"this check waits {deadline_s:g} s at most, whatever retry_deadline_s says" if capped_here else
                  f"or raise retry_deadline_s (now {deadline_s:g} s) to ride out longer outages")
        raise storage_error(TargetUnavailableError, f"{what}: {url} kept failing for {elapsed:.1f} s "
                            f"({state.attempt_number} attempt(s), last error: {exc!r}); check that the target is "
                            f"up and reachable from this node; {longer}", err_no=errno.ETIMEDOUT) from exc

    backoff = tenacity.wait_random_exponential(multiplier=BACKOFF_FIRST_S, max=BACKOFF_MAX_S)

    def wait(state: tenacity.RetryCallState) -> float:  # the last backoff ends at the deadline, not before
        return min(backoff(state), max(0.0, deadline_s - (time.monotonic() - t0)))

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(deadline_s),
        wait=wait,
        retry=tenacity.retry_if_exception(retryable), before_sleep=before_sleep, retry_error_callback=give_up,
        sleep=cancel.wait if cancel is not None else time.sleep)
    try:
        return retrying(fn)
    except _FINAL:
        raise
    except Exception as exc:
        if is_transient(exc):  # cancelled: the sibling's error is the one that matters
            raise
        err = permanent(exc, what)
        if err is None:
            raise
        raise err from exc
