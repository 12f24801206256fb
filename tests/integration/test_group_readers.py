"""Readers racing a writer: a job that reads ``latest`` while training commits groups, trims old
ones (``keep_persistent``) and re-saves a published one, never sees a partial or damaged
checkpoint, and a group that goes from under it fails with an error that says so.

Each reader loops until the writer is done: ``latest(root)``, then every file of that group,
each checked whole (verified by the load) and of that group's step. The only errors allowed are
``FileNotFoundError`` kinds (``CheckpointNotFoundError``, ``IncompleteCheckpointError``):
retention deleted the group between ``latest`` and the load (the last test makes that happen).
A ``CorruptCheckpointError`` would be a false corruption report, anything else a fault.

On a directory the writer also re-saves the group before the newest one every few steps (an
atomic exchange: a file read then is of the old attempt or the new, never a mix of the two);
on S3 (a real SeaweedFS server, through a burst buffer) an object store refuses that, and the
readers read the store directly, without a burst buffer of their own.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import CheckpointNotFoundError, CorruptCheckpointError

STEPS = 24  # on a directory; on S3, whose round trips take tens of ms, S3_STEPS
S3_STEPS = 10
FILES = ("model.pt", "optim.pt")
READERS = 2


def _state(step: int, name: str, attempt: int) -> dict:
    return {"w": torch.full((32 << 10,), step * 1000 + attempt, dtype=torch.int64), "step": step,
            "name": name, "attempt": attempt}


def _whole(got: dict, step: int, name: str) -> bool:
    return (got["step"] == step and got["name"] == name
            and torch.equal(got["w"], _state(step, name, got["attempt"])["w"]))


class _Reader(threading.Thread):
    def __init__(self, root: str, opts: dict | None, done: threading.Event) -> None:
        super().__init__(daemon=True)
        self.root, self.opts, self.done = root, opts, done
        self.loads, self.gone, self.steps = 0, 0, set()
        self.faults: list[str] = []

    def run(self) -> None:
        while not self.done.is_set():
            group = fastckpt.latest(self.root, storage_options=self.opts)
            if group is None:
                continue
            step = int(group.rsplit("/", 1)[1][4:])
            for name in FILES:
                try:
                    got = fastckpt.load(f"{group}/{name}", storage_options=self.opts)
                except CorruptCheckpointError as exc:
                    self.faults.append(f"false corruption report for {group}/{name}: {exc}")
                except FileNotFoundError:  # retention deleted the group after latest() named it
                    self.gone += 1
                except Exception as exc:  # noqa: BLE001 (every other error is a fault, reported below)
                    self.faults.append(f"{group}/{name}: {exc!r}")
                else:
                    self.loads += 1
                    self.steps.add(step)
                    if not _whole(got, step, name):
                        self.faults.append(f"{group}/{name} holds step {got['step']} {got['name']} "
                                           f"attempt {got['attempt']}")


def _race(root: str, opts: dict | None, resave: bool, steps: int, **options: object) -> list[_Reader]:
    done = threading.Event()
    readers = [_Reader(root, opts, done) for _ in range(READERS)]
    with fastckpt.Checkpointer(keep_persistent=3, overhead_budget=0.99, storage_options=opts, **options) as ck:
        ck.save(_state(0, "model.pt", 0), f"{root}/step0/model.pt", group=f"{root}/step0")
        ck.save(_state(0, "optim.pt", 0), f"{root}/step0/optim.pt", group=f"{root}/step0")
        ck.commit(f"{root}/step0", step=0).wait(60)
        for r in readers:
            r.start()
        try:
            for step in range(1, steps + 1):
                targets = [(step, 0)] + ([(step - 1, step)] if resave and step % 4 == 0 else [])
                for s, attempt in targets:  # the newest step, then (every 4th) the one before it again
                    group = f"{root}/step{s}"
                    for name in FILES:
                        ck.save(_state(s, name, attempt), f"{group}/{name}", group=group)
                    ck.commit(group, step=s, move_latest=attempt == 0).wait(60)
        finally:
            done.set()
            for r in readers:
                r.join(60)
    return readers


def _judge(readers: list[_Reader]) -> None:
    faults = [f for r in readers for f in r.faults]
    assert faults == [], faults[:5]
    assert all(r.loads > 0 for r in readers), [(r.loads, r.gone) for r in readers]
    assert len(set().union(*(r.steps for r in readers))) > 1  # the readers followed the writer
    print("reader loads, groups gone:", [(r.loads, r.gone) for r in readers])


def test_readers_of_latest_never_see_a_partial_or_damaged_group_on_a_directory(tmp_path: Path) -> None:
    _judge(_race(str(tmp_path / "ckpt"), None, resave=True, steps=STEPS))


@pytest.mark.slow
def test_readers_of_latest_never_see_a_partial_or_damaged_group_on_s3(s3_server, s3_bucket, tmp_path: Path) -> None:
    _judge(_race(f"s3://{s3_bucket}/run", s3_server.storage_options(), resave=False, steps=S3_STEPS,
                 local_dir=str(tmp_path / "nvme")))


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_a_group_retention_deletes_after_latest_named_it_fails_as_not_found(where: str, tmp_path: Path,
                                                                            request: pytest.FixtureRequest) -> None:
    """The path the racing readers allow, made to happen: ``latest`` names a group, three more
    commits make ``keep_persistent=3`` delete it, then the reader loads it."""
    root, opts, options = str(tmp_path / "ckpt"), None, {}
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        root, opts = f"s3://{request.getfixturevalue('s3_bucket')}/run", server.storage_options()
        options["local_dir"] = str(tmp_path / "nvme")
    with fastckpt.Checkpointer(keep_persistent=3, overhead_budget=0.99, storage_options=opts, **options) as ck:
        named = None
        for step in range(4):
            group = f"{root}/step{step}"
            for name in FILES:
                ck.save(_state(step, name, 0), f"{group}/{name}", group=group)
            ck.commit(group, step=step).wait(60)
            if step == 0:
                named = fastckpt.latest(root, storage_options=opts)
        assert named == f"{root}/step0"
        with pytest.raises(CheckpointNotFoundError, match=r"step0/model.pt does not exist: .* deleted since"):
            fastckpt.load(f"{named}/model.pt", storage_options=opts)
