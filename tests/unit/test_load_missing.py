"""A file of a committed group that is lost, cut short or damaged after its commit: the load
says so, with advice that leads away from that group (``load/missing.py``). Before, it said "it
was never saved there, or it was deleted since ... fastckpt.latest(<its directory>) names the
newest complete one now" or "Load an earlier checkpoint (fastckpt.latest(...))", while
``fastckpt.latest(dir)`` named that same group: a resume that followed the advice looped."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli
from fastckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tests.helpers import flip_byte

N = 16384  # 64 KiB of payload per file: a byte at 8 KiB + 100 is one of its data bytes


def _two_groups(root: Path) -> tuple[str, str]:
    groups = (str(root / "step-1"), str(root / "step-2"))
    with fastckpt.Checkpointer(rank=0, world_size=1, overhead_budget=0.99) as ck:
        for step, g in enumerate(groups, 1):
            for i, name in enumerate(("a.pt", "b.pt")):
                ck.save({"w": torch.full((N,), float(10 * step + i))}, f"{g}/{name}", group=g)
            ck.commit(g, step=step).wait()
    assert fastckpt.latest(str(root)) == groups[1]
    return groups


def _away_from_the_group(root: Path, g1: str, g2: str, cli_passes: bool) -> None:
    """The advice works: the command line names the group before it (when a file is missing or
    short), and moving the damaged group out of the directory makes ``latest()`` name it."""
    if cli_passes:
        res = CliRunner().invoke(cli, ["latest", str(root)])
        assert res.exit_code == 0 and res.stdout.strip() == g1
    shutil.move(g2, str(root.parent / "damaged-step-2"))
    assert fastckpt.latest(str(root)) == g1
    assert fastckpt.load(f"{g1}/b.pt")["w"][0] == 11


def test_a_group_file_lost_after_its_commit_is_named_so(tmp_path: Path) -> None:
    root = tmp_path / "run"
    g1, g2 = _two_groups(root)
    os.remove(f"{g2}/b.pt")
    with pytest.raises(CheckpointNotFoundError) as ei:
        fastckpt.load(f"{g2}/b.pt")
    said = str(ei.value)
    assert f"b.pt does not exist, though the committed group {g2} names it (" in said
    assert "lost after its commit" in said and f"`fastckpt latest {root}`" in said
    assert f"moving {g2} out of {root} makes latest('{root}') name it too" in said
    assert "never saved there" not in said and "fastckpt.latest(" not in said
    assert fastckpt.load(f"{g2}/a.pt")["w"][0] == 20  # the group's other file is whole
    _away_from_the_group(root, g1, g2, cli_passes=True)


def test_a_group_file_cut_short_after_its_commit_is_named_so(tmp_path: Path) -> None:
    root = tmp_path / "run"
    g1, g2 = _two_groups(root)
    size = os.path.getsize(f"{g2}/b.pt")
    os.truncate(f"{g2}/b.pt", size // 2)
    with pytest.raises(CorruptCheckpointError) as ei:
        fastckpt.load(f"{g2}/b.pt")
    said = str(ei.value)
    assert f"b.pt holds {size // 2} of the {size} bytes its committed group {g2} recorded" in said
    assert f"`fastckpt latest {root}`" in said and "fastckpt.latest(" not in said
    _away_from_the_group(root, g1, g2, cli_passes=True)


def test_a_group_file_damaged_in_place_after_its_commit_is_named_so(tmp_path: Path) -> None:
    """Same size, another byte: the command line does not pass over it (it checks sizes), so the
    advice does not name it."""
    root = tmp_path / "run"
    g1, g2 = _two_groups(root)
    flip_byte(f"{g2}/b.pt", 8192 + 100)
    with pytest.raises(CorruptCheckpointError) as ei:
        fastckpt.load(f"{g2}/b.pt")
    said = str(ei.value)
    assert "b.pt is damaged (the error it was raised from says how), though it is the " in said
    assert "changed after its commit" in said and "fastckpt latest" not in said and "fastckpt.latest(" not in said
    assert isinstance(ei.value.__cause__, CorruptCheckpointError)
    _away_from_the_group(root, g1, g2, cli_passes=False)


def test_a_file_no_group_names_keeps_the_plain_error(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _, g2 = _two_groups(root)
    with pytest.raises(CheckpointNotFoundError, match=r"c\.pt does not exist: it was never saved there"):
        fastckpt.load(f"{g2}/c.pt")
    shutil.copyfile(f"{g2}/a.pt", f"{g2}/b.pt")  # another file of the group copied over it: the load says which
    with pytest.raises(CorruptCheckpointError, match=r"b\.pt is not the file checkpoint group .* published at this"):
        fastckpt.load(f"{g2}/b.pt")


def test_a_group_file_lost_at_a_url_is_named_so(tmp_path: Path) -> None:
    """The same at a URL (an fsspec store, uploaded from a burst buffer): the object is gone."""
    import uuid

    import fsspec

    root = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    g = f"{root}/step-1"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), rank=0, world_size=1) as ck:
        for name in ("a.pt", "b.pt"):
            ck.save({"w": torch.full((N,), 1.0)}, f"{g}/{name}", group=g)
        ck.commit(g, step=1).wait()
    fsspec.filesystem("memory").rm(f"{g}/b.pt"[len("memory://"):])
    with pytest.raises(CheckpointNotFoundError, match=rf"b\.pt does not exist, though the committed group {g} "
                                                      r"names it .* moving .*step-1 out of .*/run makes latest\("):
        fastckpt.load(f"{g}/b.pt")
    assert fastckpt.latest(root) == g  # pointer and manifest only: the load says what to do
