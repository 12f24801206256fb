"""integrations/_lightning/lasts.py: which last file names a top-k file now or may yet, judged from
the records of the saves of the last file (landed, dropped for a newer one, skipped, pending)."""

from __future__ import annotations

from concurrent.futures import Future

from fastckpt.integrations._lightning.lasts import LastFiles
from fastckpt.records import SaveHandle, SaveRecord

LAST, BEST, OTHER = "/run/ckpt/last.ckpt", "/run/ckpt/epoch=0-step=1.ckpt", "/run/ckpt/epoch=0-step=2.ckpt"


def state(best: str) -> dict:
    """A Lightning checkpoint's ModelCheckpoint state naming ``best``."""
    return {"callbacks": {"ModelCheckpoint{'monitor': 'step'}": {"best_model_path": best, "best_k_models": {best: 1}}}}


def pending() -> tuple[SaveHandle, Future]:
    fut: Future = Future()
    return SaveHandle(fut, LAST, lambda exc: None), fut


def record(**kw: object) -> SaveRecord:
    return SaveRecord(LAST, "nvme", 1, 0.0, 0.0, 0.0, **{"durable_s": 1.0, **kw})


def landed() -> SaveHandle:
    return SaveHandle.finished(record())


class Reads:
    def __init__(self, names: frozenset[str] | None) -> None:
        self.names, self.calls = names, 0

    def __call__(self, path: str) -> frozenset[str] | None:
        self.calls += 1
        return self.names


def test_a_landed_namer_holds_until_a_newer_save_lands_and_a_skipped_one_does_not_count():
    lasts = LastFiles(Reads(frozenset()))
    lasts.saved(LAST, landed(), state(BEST))
    mark = {LAST: 1}
    assert lasts.named(BEST, mark) == LAST
    lasts.saved(LAST, SaveHandle.finished(record(durable_s=None, skipped=True)), state(OTHER))
    assert lasts.named(BEST, mark) == LAST  # the skipped save left the namer at the path
    newer, fut = pending()
    lasts.saved(LAST, newer, state(OTHER))
    assert lasts.named(BEST, mark) == LAST
    fut.set_result(record())
    assert lasts.named(BEST, mark) is None
    assert lasts.named(OTHER, mark) is None  # named only by saves after the request


def test_a_namer_dropped_for_a_newer_save_holds_nothing_but_a_pending_one_does():
    lasts = LastFiles(Reads(frozenset()))
    lasts.saved(LAST, SaveHandle.finished(record(durable_s=None, superseded=True)), state(BEST))
    assert lasts.named(BEST, {LAST: 1}) is None
    handle, fut = pending()
    lasts.saved(LAST, handle, state(BEST))
    assert lasts.named(BEST, {LAST: 2}) == LAST
    fut.set_exception(OSError("failed"))  # a failed save is never at its path
    assert lasts.named(BEST, {LAST: 2}) is None


def test_the_file_there_when_the_fit_began_is_read_once_and_holds_until_a_save_lands():
    reads = Reads(frozenset({BEST}))
    lasts = LastFiles(reads)
    assert lasts.named(BEST, {LAST: 0}) == LAST and lasts.named(OTHER, {LAST: 0}) is None
    handle, fut = pending()
    lasts.saved(LAST, handle, state(OTHER))
    assert lasts.named(BEST, {LAST: 0}) == LAST
    fut.set_result(record())
    assert lasts.named(BEST, {LAST: 0}) is None
    assert reads.calls == 1


def test_an_unreadable_last_file_holds_every_deletion_until_a_save_lands():
    lasts = LastFiles(Reads(None))
    assert lasts.named(OTHER, {LAST: 0}) == LAST
    lasts.saved(LAST, landed(), state(BEST))
    assert lasts.named(OTHER, {LAST: 0}) is None


def test_a_long_fit_forgets_the_saves_before_the_newest_landed_one_and_still_judges_old_marks():
    lasts = LastFiles(Reads(frozenset()))
    for _ in range(50):
        lasts.saved(LAST, landed(), state(OTHER))
    lasts.saved(LAST, landed(), state(BEST))
    mark = {LAST: 51}
    assert lasts.named(BEST, mark) == LAST
    assert len(lasts._saves[LAST]) == 2  # the newest landed save before it, and the namer
    handle, fut = pending()
    lasts.saved(LAST, handle, state(OTHER))
    assert lasts.named(BEST, mark) == LAST and lasts.named(OTHER, {LAST: 10}) is None
    fut.set_result(record())
    lasts.saved(LAST, landed(), state(OTHER))  # forgets the namer
    assert lasts.named(BEST, mark) is None
