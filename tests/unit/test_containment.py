"""Paths stay where they belong (issue #9 items 6 and 10): a parent that is a file is named as
such, discovery and group loads never follow a symlink or a manifest entry out of the checkpoint
root, remove() of a symlink removes the link, and temp files of killed copies are swept from the
durable destination too."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import CheckpointWriteError, CorruptCheckpointError
from fastckpt.cli import main as cli
from fastckpt.io.atomic import _HOST, TMP_TAG


def _state(v: int) -> dict:
    return {"w": torch.arange(1024) + v, "v": v}


def test_a_parent_that_is_a_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "notadir").write_text("x")
    with fastckpt.Checkpointer() as ck, pytest.raises(CheckpointWriteError) as ei:
        ck.save(_state(1), str(tmp_path / "notadir" / "sub" / "a.pt")).wait()
    assert f"{tmp_path / 'notadir'} is a file, not a directory" in str(ei.value)


@pytest.mark.parametrize("below", ["a.pt", "sub/a.pt"])
@pytest.mark.parametrize("local", [False, True], ids=["direct", "burst-buffer"])
def test_a_parent_that_is_a_file_is_named_the_same_through_the_burst_buffer(tmp_path: Path, below: str,
                                                                           local: bool) -> None:
    """The copy from the burst buffer said "(creating .../notadir): File exists ...; check the target
    file system" (a.pt) or a bare "Not a directory" (sub/a.pt), while a direct save named the file."""
    (tmp_path / "notadir").write_text("x")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None) as ck, \
            pytest.raises(CheckpointWriteError) as ei:
        ck.save(_state(1), str(tmp_path / "notadir" / below)).wait()
    assert f"{tmp_path / 'notadir'} is a file, not a directory (choose another path, or move that file away)" \
        in str(ei.value)
    assert ei.value.errno in (errno.EEXIST, errno.ENOTDIR)
    assert (tmp_path / "notadir").read_text() == "x"


def test_latest_never_follows_a_pointer_symlink_out_of_the_root(tmp_path: Path) -> None:
    outside, root = tmp_path / "outside", tmp_path / "run"
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        for g in (outside / "evil", root / "step-1"):
            ck.save(_state(1), str(g / "m.pt"), group=str(g))
            ck.commit(str(g)).wait()
    os.symlink(outside / "evil", root / "evil")
    (root / "latest").write_text("evil")
    assert fastckpt.latest(str(root)) == str(root / "step-1")


def test_a_manifest_entry_leading_out_of_the_group_is_refused(tmp_path: Path) -> None:
    g = tmp_path / "step-1"
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g / "m.pt"), group=str(g))
        ck.commit(str(g)).wait()
    (tmp_path / "secret.pt").write_bytes((g / "m.pt").read_bytes())
    m = json.loads((g / "fastckpt-manifest.json").read_text())
    m["files"]["../secret.pt"] = m["files"]["m.pt"]
    (g / "fastckpt-manifest.json").write_text(json.dumps(m))
    from fastckpt.commit.protocol import member_files

    with pytest.raises(CorruptCheckpointError, match=r"'\.\./secret\.pt'.*leads out"):
        member_files(m, str(g))
    assert cli(["verify", str(g)]) != 0  # the CLI refuses it rather than reading ../secret.pt


def test_remove_of_a_symlink_removes_the_link_not_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real"
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save(_state(1), str(real / "a.pt")).wait()
        ck.save(_state(2), str(real / "g" / "m.pt"), group=str(real / "g"))
        ck.commit(str(real / "g")).wait()
        os.symlink(real / "a.pt", tmp_path / "link.pt")
        os.symlink(real / "g", tmp_path / "glink")
        ck.remove(str(tmp_path / "link.pt"))
        ck.remove(str(tmp_path / "glink"))
    assert not os.path.lexists(tmp_path / "link.pt") and not os.path.lexists(tmp_path / "glink")
    assert fastckpt.load(str(real / "a.pt"))["v"] == 1 and fastckpt.load(str(real / "g" / "m.pt"))["v"] == 2


def test_temp_files_of_killed_copies_are_swept_from_the_destination(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    home = tmp_path / "home"
    home.mkdir()
    stale = home / f".a.pt{TMP_TAG}{_HOST}.{dead}.0123456789ab"
    live = home / f".b.pt{TMP_TAG}{_HOST}.{os.getppid()}.0123456789ab"
    probe = home / f".fastckpt-probe-{_HOST}.{dead}.0123456789ab"
    for p in (stale, live, probe):
        p.write_bytes(b"x" * 100)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), str(home / "a.pt")).wait()
    assert not stale.exists() and not probe.exists() and live.exists()
