"""The burst-buffer copy as the fallback for a damaged home copy (``load.fallback``): only when
it is of the save the home holds. Another node's newer save, or another attempt of the group,
whose home file lost its trailer (the manifest) raises, as a flipped data byte does, instead of
resuming from this node's older state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import CorruptCheckpointError


def _state(step: int) -> dict:
    return {"step": step, "w": torch.full((1000,), float(step))}


@pytest.mark.parametrize("damage", ["last byte lost", "cut 5000 bytes short"])
def test_a_damaged_newer_save_at_home_never_falls_back_to_an_older_local_copy(tmp_path: Path, damage: str) -> None:
    path = str(tmp_path / "home" / "last.pt")
    bb_a = str(tmp_path / "bbA")
    with fastckpt.Checkpointer(local_dir=bb_a) as a:
        a.save(_state(1), path).wait()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbB")) as b:  # another node saves the path since
        b.save(_state(2), path).wait()
    os.truncate(path, os.path.getsize(path) - (1 if damage == "last byte lost" else 5000))
    with fastckpt.Checkpointer(local_dir=bb_a) as a, pytest.raises(CorruptCheckpointError) as err:
        a.load(path)
    assert f"{path} is damaged" in str(err.value) and a.local_path(path) in str(err.value)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbB")) as b:  # B's copy is of that save: it loads
        assert b.load(path)["step"] == 2 and b.stats().last_restore_from == "local"
