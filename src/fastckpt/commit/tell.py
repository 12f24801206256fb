"""Telling the other ranks that this rank's attempt at a group ended, at once rather than after
``commit_timeout_s``: a failed save or commit (``Coordinator.abandon``, ``refuse``, ``Coordinator._run``), a
``remove()`` (``Coordinator.cancel``), and a Checkpointer closed with attempts it never committed
(``Coordinator.close``). With a store, through the attempt's keys; without one, through records
in the group's directory (rank 0: the outcome; another rank: a failure record, ``fallback.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import NoReturn

from ..errors import CommitTimeoutError
from . import attempt as A
from . import failures as E
from . import fallback as F
from . import protocol as P
from . import store as S

log = logging.getLogger("fastckpt")


class Teller:
    """Ends this rank's attempts on every rank.

    Args:
        pool: the committer threads (a session still to agree is agreed there, polling).
        stop: set by ``Checkpointer.close``: a polling wait ends at once.
        timeout_s: ``commit_timeout_s``: how long agreeing on the session may take.
    """

    def __init__(self, pool: Executor, stop: threading.Event, timeout_s: float) -> None:
        self._pool, self._stop, self._timeout = pool, stop, timeout_s

    def abort(self, att: A.Attempt, rank: int, exc: BaseException, background: bool = False,
              why: str | None = None) -> None:
        """End the attempt on every rank at once, not after ``commit_timeout_s``. With a store through it
        (``background``: on the training thread, so a session still to agree is agreed on the pool); else
        rank 0 records the outcome, another rank a failure record for rank 0's current attempt or, before
        it started, for the one after the attempt recorded now. ``why``: what the others are told."""
        why = (why or f"{type(exc).__name__}: {exc}")[:500]
        if att.channel is not None:
            self.through_store(att.channel, att.group, rank, lambda ch: ch.abort(rank, why), "the failure of",
                               background)
            return
        try:
            if rank == 0:
                F.record_aborted(att.place, att.token, f"rank 0: {why}", att.replaced)
            else:
                seen, current = F.attempt_ids(att.place)  # one read: both of the same attempt.json
                P.write_failure(att.place, rank, current, why, seen=seen)
        except OSError as tell_exc:  # the others then time out, naming this rank
            log.warning("fastckpt: could not tell the other ranks that the save into %s failed: %s",
                        att.group, tell_exc)

    def refuse(self, group: str, att: A.Attempt | None, rank: int, missing: dict[str, str],
               begun: Callable[[], A.Attempt], emit: Callable[..., None]) -> NoReturn:
        """``commit``: files of this rank's attempt at ``group`` were never saved (``missing``: path ->
        why): end the attempt on every rank at once, and raise, naming them. A rank whose save failed
        before its attempt began (``att`` None) begins it now (``begun``), to know which attempt to end."""
        files = "; ".join(f"{os.path.relpath(path, group)} ({why})" for path, why in missing.items())
        err = E.unsaved_error(group, files)
        emit("commit", group, 0, time.time(), "direct", err, detail="group")  # those saves emitted none
        try:
            if att is None:
                att = begun()
        except BaseException as exc:  # the others then time out, naming this rank
            err.add_note(f"the other ranks were not told, and wait commit_timeout_s: {type(exc).__name__}: {exc}")
            raise err from exc
        self.abort(att, rank, err, background=True, why=f"the save of {files} did not happen")
        raise err

    def through_store(self, ch: S.Channel, group: str, rank: int, act: Callable[[S.Channel], object], what: str,
                      background: bool = True) -> None:
        """``act`` on the attempt's keys, once the session is agreed. From the training thread
        (``background``), a session still to agree is agreed on the committer pool, polling, so
        that close() ends it at once: the commit's own join, if any, is what close() waits for."""
        timeout_s = self._timeout + (0 if rank == 0 else A.grace(self._timeout))

        def run(poll: bool) -> None:
            try:
                if ch.join(time.monotonic() + timeout_s, self._stop, poll=poll):
                    act(ch)
            except (S.StoreError, CommitTimeoutError) as exc:  # the others then time out, naming this rank
                log.warning("fastckpt: could not tell the other ranks of %s %s: %s", what, group, exc)

        if background and not ch.agreed:
            self._pool.submit(run, True)
        else:
            run(False)
