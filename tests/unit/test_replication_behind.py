"""Uploads running behind the saves: a file saved every step (Lightning's ``last.ckpt``) has each
queued upload dropped for the next save of it, so none reaches its path until the uploads catch
up, and a resume from that path by name goes back (or finds nothing). The run is told once per
streak, with what to resume from instead (``save.behind``)."""

from __future__ import annotations

import logging
import os
import threading

import torch

import fastckpt
from fastckpt.io.atomic import final_path
from fastckpt.save.behind import WARN_AT, Behind
from fastckpt.testing import FaultyOps
from tests.helpers import Queued

BEHIND = "uploads run behind the saves"


def _warnings(caplog) -> list[str]:  # noqa: ANN001
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and BEHIND in r.getMessage()]


def test_a_file_whose_saves_are_dropped_again_and_again_is_reported_once(tmp_path, caplog) -> None:  # noqa: ANN001
    home = tmp_path / "run"
    held, release = threading.Event(), threading.Event()

    def hold_first_upload(op: str, path: str) -> None:  # the upload of top.pt holds every later one (1 worker)
        if op == "replace" and os.path.dirname(path) == str(home) and (final_path(path) or path).endswith("top.pt"):
            held.set()
            assert release.wait(60)

    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=FaultyOps(on_call=hold_first_upload),
                               replicate_policy="all", replicate_workers=1, rank=0, world_size=1)
    try:
        ck.save({"w": torch.zeros(8)}, str(home / "top.pt"))
        assert held.wait(60)
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            handles = [ck.save({"w": torch.full((8,), step)}, str(home / "last.pt")) for step in range(WARN_AT + 2)]
            assert [h.result(60).superseded for h in handles[:-1]] == [True] * (WARN_AT + 1)
        said = _warnings(caplog)
        assert len(said) == 1 and str(home / "last.pt") in said[0] and "fastckpt.latest()" in said[0], said
        assert not os.path.exists(home / "last.pt")  # what a resume from it by name finds now
    finally:
        release.set()
    assert handles[-1].wait(60).durable_s is not None
    ck.close()
    assert torch.load(home / "last.pt", weights_only=True)["w"][0] == WARN_AT + 1


def test_saves_dropped_while_a_version_of_the_path_waits_are_not_reported(tmp_path, caplog) -> None:  # noqa: ANN001
    """With version links (FastCkptIO's settings, a burst buffer with hard links) the oldest queued
    save of a path keeps its bytes and lands in its turn; only those between it and the newest
    are dropped. The WARNING counted those and said the path stayed older or absent, each save
    dropped for the next: false, and seen on every Lightning backlog."""
    home = tmp_path / "run"
    held, release, queued = threading.Event(), threading.Event(), Queued()

    def hold_first_upload(op: str, path: str) -> None:  # the upload of top.pt holds every later one (in order)
        if op == "replace" and os.path.dirname(path) == str(home) and (final_path(path) or path).endswith("top.pt"):
            held.set()
            assert release.wait(60)

    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=FaultyOps(on_call=hold_first_upload),
                               replicate_policy="all", replicate_in_order=True, replicate_workers=1,
                               sinks=(queued,), rank=0, world_size=1)
    last, handles = str(home / "last.pt"), []
    try:
        ck.save({"w": torch.zeros(8)}, str(home / "top.pt"))
        assert held.wait(60)
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            for step in range(WARN_AT + 3):
                handles.append(ck.save({"w": torch.full((8,), step)}, last))
                assert queued.wait(last, step + 1)  # queued before the next save: each later one drops it
            release.set()
            recs = [h.wait(60) for h in handles]
        assert [r.superseded for r in recs] == [False] + [True] * (WARN_AT + 1) + [False]
        assert recs[0].durable_s is not None  # the oldest queued landed: the path was not left behind for good
        assert _warnings(caplog) == []
    finally:
        release.set()
        ck.close()
    assert torch.load(last, weights_only=True)["w"][0] == WARN_AT + 2


def test_an_upload_that_lands_ends_the_streak(caplog) -> None:  # noqa: ANN001
    behind = Behind()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        for _ in range(WARN_AT - 1):
            behind.dropped("last.ckpt")
        behind.landed("last.ckpt")
        for _ in range(WARN_AT - 1):
            behind.dropped("last.ckpt")
            behind.dropped("other.ckpt")
        assert not _warnings(caplog)
        behind.dropped("last.ckpt")
    assert len(_warnings(caplog)) == 1
