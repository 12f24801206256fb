"""A tag DeepSpeed's own engine wrote, saved again with the same tag through fastckpt
(``_deepspeed_native_tag_worker.py``: real engines, one CPU process per phase, gloo, a real
SIGKILL). The tag has no fastckpt manifest, yet it is a complete checkpoint: the new attempt is
staged beside it and swapped in (``fastckpt.commit.resave``), so a kill during the save leaves
DeepSpeed's checkpoint whole, for fastckpt's loader and DeepSpeed's own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import fastckpt  # noqa: E402

from .test_deepspeed import REPO, ds_env  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_deepspeed_native_tag_worker.py")


def _phase(phase: str, save_dir: Path) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = ds_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    return subprocess.run([sys.executable, WORKER, phase, str(save_dir)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _loads(save_dir: Path) -> dict:
    proc = _phase("load", save_dir)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OUT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[0][4:])


@pytest.mark.timeout(900)  # five DeepSpeed starts, one process each
def test_a_save_over_deepspeeds_own_tag_killed_midway_leaves_that_tag_whole(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    native = _phase("native", save_dir)
    assert native.returncode == 0, native.stderr[-5000:]
    zero_files = sorted(os.listdir(save_dir / "last"))
    killed = _phase("kill", save_dir)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-5000:]
    assert sorted(os.listdir(save_dir / "last")) == zero_files  # no file of the killed save among them
    assert _loads(save_dir) == {"fastckpt": {"version": "native", "whole": True},
                                "deepspeed": {"version": "native", "whole": True}}
    resaved = _phase("resave", save_dir)
    assert resaved.returncode == 0, resaved.stderr[-5000:]
    assert _loads(save_dir) == {"fastckpt": {"version": "resave", "whole": True},
                                "deepspeed": {"version": "resave", "whole": True}}
    assert fastckpt.latest(str(save_dir)) == str(save_dir / "last")
    assert not [n for n in os.listdir(save_dir) if ".fastckpt-next" in n]  # the killed attempt's too
