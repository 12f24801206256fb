"""A tag DeepSpeed's own engine wrote, saved again with the same tag through fastckpt
(``_deepspeed_native_tag_worker.py``: real engines, one CPU process per phase, each forked from
one process that imported torch and DeepSpeed once, gloo, a real SIGKILL). The tag has no
fastckpt manifest, yet it is a complete checkpoint: the new attempt is staged beside it and
swapped in (``fastckpt.commit.resave``), so a kill during the save leaves DeepSpeed's checkpoint
whole, for fastckpt's loader and DeepSpeed's own. The other way round, a fastckpt tag that
DeepSpeed's own engine saved again in place is named as such when loaded, with the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import fastckpt  # noqa: E402
from tests.integration._fork_server import ForkServer  # noqa: E402

from .test_deepspeed import ds_env  # noqa: E402

WORKER = "tests.integration._deepspeed_native_tag_worker"
# what the first phase would otherwise import in every process: the optimizer's constructor
# imports torch._dynamo, DeepSpeed's optimizer check its Muon module (as _deepspeed_kill_worker's prepare())
PRELOAD = [WORKER, "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """Forks the five phases from one process that imported torch and DeepSpeed once
    (``_fork_server.py``): started fresh, each phase spent about 4 s of CPU on those imports."""
    fs = ForkServer(PRELOAD, ds_env(), str(tmp_path_factory.mktemp("ds-native-tag") / "server.err"), 300.0)
    try:
        yield fs
    finally:
        fs.close()


def _phase(server: ForkServer, phase: str, save_dir: Path) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    return server.run_module(WORKER, [phase, str(save_dir)], env, 300)


def _loads(server: ForkServer, save_dir: Path) -> dict:
    proc = _phase(server, "load", save_dir)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OUT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[0][4:])


@pytest.mark.timeout(900)  # five DeepSpeed starts, one process each
def test_a_save_over_deepspeeds_own_tag_killed_midway_leaves_that_tag_whole(server: ForkServer,
                                                                            tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    native = _phase(server, "native", save_dir)
    assert native.returncode == 0, native.stderr[-5000:]
    zero_files = sorted(os.listdir(save_dir / "last"))
    killed = _phase(server, "kill", save_dir)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-5000:]
    assert sorted(os.listdir(save_dir / "last")) == zero_files  # no file of the killed save among them
    assert _loads(server, save_dir) == {"fastckpt": {"version": "native", "whole": True},
                                "deepspeed": {"version": "native", "whole": True}}
    resaved = _phase(server, "resave", save_dir)
    assert resaved.returncode == 0, resaved.stderr[-5000:]
    assert _loads(server, save_dir) == {"fastckpt": {"version": "resave", "whole": True},
                                "deepspeed": {"version": "resave", "whole": True}}
    assert fastckpt.latest(str(save_dir)) == str(save_dir / "last")
    assert not [n for n in os.listdir(save_dir) if ".fastckpt-next" in n]  # the killed attempt's too


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.timeout(900)  # five DeepSpeed starts, one process each
def test_a_fastckpt_tag_deepspeeds_own_engine_saved_again_is_named_so(server: ForkServer, tmp_path: Path) -> None:
    """fastckpt commits ``last``; DeepSpeed's own engine ("enabled": false) saves it again in
    place, leaving fastckpt's manifest. The load raised CorruptCheckpointError advising to
    restore the file or load an earlier checkpoint (losing the newest training); now it names
    the re-save and the fix, which then loads DeepSpeed's save. A fastckpt tag with one damaged
    byte is not taken for a re-save."""
    save_dir = tmp_path / "run"
    assert _phase(server, "resave", save_dir).returncode == 0
    model_file = save_dir / "last" / "mp_rank_00_model_states.pt"
    _flip(model_file)
    damaged = _loads(server, save_dir)["fastckpt"]["error"]
    assert damaged.startswith("CorruptCheckpointError") and "DeepSpeed's own engine" not in damaged, damaged
    _flip(model_file)
    assert _phase(server, "native", save_dir).returncode == 0
    out = _loads(server, save_dir)
    named = out["fastckpt"]["error"]
    assert named.startswith(f"CorruptCheckpointError: checkpoint {save_dir / 'last'} was saved again in place by "
                            "DeepSpeed's own engine after fastckpt committed it"), named
    assert f"remove {save_dir / 'last' / 'fastckpt-manifest.json'} and {save_dir / 'last' / '.fastckpt'}" in named
    assert out["deepspeed"] == {"version": "native", "whole": True}
    (save_dir / "last" / "fastckpt-manifest.json").unlink()  # the fix the error names
    shutil.rmtree(save_dir / "last" / ".fastckpt")
    assert _loads(server, save_dir)["fastckpt"] == {"version": "native", "whole": True}
