"""A process of another PID namespace on the same host (a container with the host's network,
hence its host name) writing into the same directory must not take this process's live temp
file for a dead writer's leftover: once, it swept it away mid-save and the save failed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt.testing import FaultyOps

OTHER = """
import sys, torch, fastckpt
with fastckpt.Checkpointer() as ck:
    ck.save({"w": torch.ones(8)}, sys.argv[1]).wait()
"""


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root, util-linux)")
def test_a_save_in_another_pid_namespace_leaves_a_live_temp_file_alone(tmp_path) -> None:
    ops = FaultyOps()
    gate = ops.gate("fsync", path_contains="a.pt")  # A's write is held with its temp file on disk
    with fastckpt.Checkpointer(ops=ops) as ck:
        h = ck.save({"w": torch.arange(10.0)}, str(tmp_path / "a.pt"))
        gate.wait_entered()
        assert any(".fastckpt-tmp-" in n for n in os.listdir(tmp_path))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        other = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", OTHER,
                                str(tmp_path / "b.pt")], capture_output=True, text=True, env=env, timeout=120)
        assert other.returncode == 0, other.stderr[-2000:]
        gate.open()
        rec = h.wait()  # its temp file was still there to fsync and rename
    assert torch.equal(fastckpt.load(rec.path)["w"], torch.arange(10.0))
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]
