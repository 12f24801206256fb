"""An async Megatron save the script exits after, without megatron's finalize step.

fastckpt's exit flush completed the commit, but rank 0 moves Megatron-LM's tracker in the save's
watch, a daemon thread nobody waited for at exit: the interpreter froze it mid-write, so the
tracker still named an older iteration (a resume silently took older state), its temp file
stayed, and nothing was logged. Now the exit waits for the watches after the flush
(``fastckpt.exits.after_flush``), and logs an ERROR for one that does not end in time; the
tracker's first write in a directory removes the temp files dead processes of this host left there.

No timing: the tracker's rename is held until the exiting main thread waits for the watch (a
spy on the watch's ``done`` event), so without that wait it never happens. Real megatron-core,
gloo, one process (a child: it owns the process group and its exit is what is tested).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

CHILD = r"""
import os, sys, threading, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
import fastckpt
from fastckpt.integrations import megatron as fm
from fastckpt.integrations._megatron import waiting as W
from fastckpt.io.atomic import final_path
from fastckpt.testing import FaultyOps

root, exit_wait_s = sys.argv[1], float(sys.argv[2])
W.EXIT_WAIT_S = exit_wait_s
waited = threading.Event()  # the main thread waits for the watch (only the exit does: no finalize here)


class Spied(threading.Event):
    def wait(self, timeout=None):
        if threading.current_thread() is threading.main_thread() and timeout != 0:  # (0: a look, no wait)
            waited.set()
        return super().wait(timeout)


def hold_tracker(op, path):  # the tracker's rename, held until someone waits for it
    if op == "replace" and os.path.basename(final_path(path) or path) == fm.TRACKER:
        assert waited.wait(120)


dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, ".store"), 1), rank=0, world_size=1)
ck = fastckpt.Checkpointer()
fm.register(ck, ops=FaultyOps(on_call=hold_tracker))
ckpt = os.path.join(root, "save", "iter_0000001")
os.makedirs(ckpt)
dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.randn(16, 16)), "iteration": 1}, ckpt, ("fastckpt", 1),
        async_sharded_save=True)
(watch,) = W._watches.values()
watch.done = Spied()  # (not set yet: its thread waits in the commit, or in hold_tracker)
dist.destroy_process_group()
print("SCRIPT ENDS", flush=True)  # without finalize: fastckpt flushes the commit at interpreter exit
"""


def _run(root: Path, exit_wait_s: float) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", CHILD, str(root), str(exit_wait_s)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "SCRIPT ENDS" in res.stdout, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def test_the_tracker_names_an_iteration_committed_at_exit(tmp_path: Path) -> None:
    import fastckpt
    import fastckpt.integrations.megatron as fm
    from fastckpt.io.atomic import tmp_name

    save = tmp_path / "save"
    save.mkdir()
    dead = subprocess.Popen(["true"])  # what an earlier run, frozen mid-write, left: a temp of its tracker
    dead.wait()
    stale = Path(tmp_name(str(save / fm.TRACKER)).replace(f".{os.getpid()}.", f".{dead.pid}."))
    stale.write_text("0")
    res = _run(tmp_path, 60.0)
    assert fastckpt.latest(str(save)) == str(save / "iter_0000001")
    assert fm.read_tracker(str(save)) == 1, res.stderr[-3000:]  # was: None (no tracker written)
    assert [n for n in os.listdir(save) if ".fastckpt-tmp" in n] == []  # was: this run's temp and the stale one


def test_a_tracker_still_being_written_at_exit_is_an_error(tmp_path: Path) -> None:
    res = _run(tmp_path, 0.0)  # the exit does not wait for the watch at all
    tracker = tmp_path / "save" / "latest_checkpointed_iteration.txt"
    assert f"{tmp_path / 'save' / 'iter_0000001'} is committed, but {tracker} could not be pointed at it before the " \
           "process exited" in res.stderr, res.stderr[-3000:]  # was: nothing logged
    assert "sync_tracker" in res.stderr
