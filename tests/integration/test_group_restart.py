"""A group commit after a torchrun restart, through the agent's store that outlived the first run.

``torchrun --nproc-per-node=2 --max-restarts=1`` (gloo over 127.0.0.1) runs
``_restart_worker.py``: in the first run rank 1 SIGKILLs itself before it makes its
Checkpointer while rank 0's commit is under way; the second run must commit a group on both
ranks well within ``commit_timeout_s``. Before sessions were agreed through rank 0, the
first run's rank 0 had counted itself into the store's session counter alone, so the ranks of
every later run computed different sessions and every group commit timed out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import fastckpt
from fastckpt.commit import protocol as P
from tests.helpers import place

from . import _restart_worker as W
from .test_groups import _communicate, _env, _free_port

WORKER = str(Path(W.__file__).resolve())
TIMEOUT_S = 10.0


def test_a_restarted_job_commits_groups_through_the_agents_store(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--monitor-interval=0.1", "--master-addr=127.0.0.1", f"--master-port={_free_port()}", WORKER,
           "--root", str(tmp_path), "--timeout", str(TIMEOUT_S)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=tmp_path)
    out = _communicate(proc, 3 * TIMEOUT_S + 60)
    wall = time.monotonic() - t0
    results = {r: json.loads(p.read_text()) for r in (0, 1) if (p := tmp_path / "results" / f"rank{r}.json").exists()}
    assert sorted(results) == [0, 1], out
    for r, res in results.items():
        assert res["run"] == 1, out  # the restarted run, after the first one lost rank 1
        assert res["committed"], f"rank {r}: {res.get('error')}\n{out}"
        assert res["commit_s"] < TIMEOUT_S / 2, (r, res)
    assert proc.returncode == 0, out
    group = tmp_path / "step1"
    assert P.read_group_manifest(place(str(group)))["ranks"] == [0, 1]
    assert fastckpt.latest(str(tmp_path)) == str(group)
    assert fastckpt.load(str(group / "rank1.pt"))["rank"] == 1
    assert wall < 3 * TIMEOUT_S, wall
