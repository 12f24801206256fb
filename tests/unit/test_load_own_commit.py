"""``Checkpointer.load`` of a file of a group whose commit this Checkpointer has in flight loads
what that commit publishes: it waits for the commit, as it waits for a save of the path in
flight. It waited only for the file's write: a first save of the group raised
``IncompleteCheckpointError``, and a re-save silently loaded the save before it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.testing import FaultyOps


def _loaded_while_the_commit_is_held(tmp_path: Path, first: bool, read: Callable[[fastckpt.Checkpointer, str], object]
                                     ) -> object:
    """Save ``{"v": 2}`` into a group (after ``{"v": 1}`` was committed there, unless ``first``),
    commit it with its publication held, and ``read(ck, path)`` on another thread meanwhile: what
    it returned (or raised) once the publication went ahead."""
    g = str(tmp_path / "step-1")
    ops = FaultyOps()
    with fastckpt.Checkpointer(rank=0, world_size=1, ops=ops) as ck:
        if not first:
            ck.save({"v": torch.tensor(1)}, f"{g}/rank0.pt", group=g)
            ck.commit(g, step=1).wait()
        gate = ops.gate("write_small", path_contains="fastckpt-manifest")  # the group's publication, held
        ck.save({"v": torch.tensor(2)}, f"{g}/rank0.pt", group=g)
        ck.commit(g, step=1)
        got: list = []

        def run() -> None:
            try:
                got.append(read(ck, g))
            except Exception as exc:  # noqa: BLE001 (reported to the test)
                got.append(exc)

        reader = threading.Thread(target=run)
        reader.start()
        gate.wait_entered()
        reader.join(1)  # a bound, not a race: a load that waits is still waiting, one that did not has returned (ms)
        gate.open()
        reader.join(60)
    return got[0]


@pytest.mark.parametrize("first", [True, False], ids=["first-save", "re-save"])
def test_a_load_of_a_group_file_waits_for_this_checkpointers_commit_in_flight(tmp_path: Path, first: bool) -> None:
    got = _loaded_while_the_commit_is_held(tmp_path, first, lambda ck, g: ck.load(f"{g}/rank0.pt"))
    assert not isinstance(got, Exception), got
    assert int(got["v"]) == 2


def test_a_reading_begun_right_after_commit_pins_what_that_commit_publishes(tmp_path: Path) -> None:
    """It pinned the save published before, and its load, which waits for the commit, then always
    raised GroupChangedError (the DeepSpeed and Megatron load paths read through ``reading``)."""

    def read(ck: fastckpt.Checkpointer, g: str) -> object:
        with ck.reading(g):
            return ck.load(f"{g}/rank0.pt")

    got = _loaded_while_the_commit_is_held(tmp_path, False, read)
    assert not isinstance(got, Exception), got
    assert int(got["v"]) == 2


@pytest.mark.parametrize("saved, loaded", [("link", "real"), ("real", "link")])
def test_a_load_waits_for_a_save_of_the_same_file_spelt_through_a_symbolic_link(tmp_path: Path, saved: str,
                                                                                 loaded: str) -> None:
    """A job saves through ``ckpt`` -> ``real`` (``/ckpt`` -> ``/lustre/me/ckpt``) and loads by the
    other spelling: the wait for the save in flight matched names up to ``os.path.abspath``, so
    the load did not wait and returned the save before it."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    ops = FaultyOps()
    with fastckpt.Checkpointer(ops=ops, overhead_budget=0.99) as ck:
        ck.save({"v": torch.tensor(1)}, str(tmp_path / saved / "last.pt")).wait()
        gate = ops.gate("replace", path_contains="last.pt")  # the new file's rename into place, held
        ck.save({"v": torch.tensor(2)}, str(tmp_path / saved / "last.pt"))
        got: list = []
        reader = threading.Thread(target=lambda: got.append(ck.load(str(tmp_path / loaded / "last.pt"))))
        reader.start()
        gate.wait_entered()
        reader.join(1)  # a bound, not a race: a load that waits is still waiting, one that did not has returned (ms)
        gate.open()
        reader.join(60)
    assert int(got[0]["v"]) == 2
