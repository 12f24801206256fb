"""Run by test_deepspeed_crashed_tag.py through ``_fork_launcher.py``: ZeRO-2 on CPU processes
(gloo; fastckpt's ranks agree through torch.distributed's store, so they write no rank markers).

``crash`` (2 ranks): save and commit ``global_step1``, then save ``global_step2`` and SIGKILL
every rank once both ranks' files of it are written and durable, right before the group
commit: what a job killed mid-checkpoint leaves (its files in the tag, no manifest).
``resume`` (1 rank, as a restart on fewer nodes): load the newest complete tag's weights, train, save
``global_step2`` again and flush; writes ROOT/resume.json (the tag it loaded).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

from tests.integration._ds_common import engine, train  # noqa: E402

from ._fork_launcher import free_port  # noqa: E402


def prepare() -> None:
    """What ``_fork_launcher`` imports before forking (see ``_deepspeed_kill_worker.prepare``)."""
    import torch._dynamo  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401


def _killed_before_commit(checkpointer) -> None:  # noqa: ANN001
    """Make this rank's next group commit SIGKILL the process instead, once every rank's files
    are written (their writes waited for, then a barrier: no rank dies while another writes)."""
    def commit(*_args: object, **_kwargs: object) -> None:
        checkpointer.wait()
        torch.distributed.barrier()
        os.kill(os.getpid(), signal.SIGKILL)

    checkpointer.commit = commit


def run_rank(_gen: int, root: str, phase: str) -> None:
    faulthandler.dump_traceback_later(120, exit=True)
    logging.getLogger("fastckpt").setLevel(logging.ERROR)  # the overhead alarm fires in this tight loop
    if "WORLD_SIZE" not in os.environ:  # one rank: the launcher sets no torchrun environment
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    save_dir = os.path.join(root, "ckpt")
    eng = engine(2, {})
    if phase == "crash":
        train(eng, 1, 1)
        eng.save_checkpoint(save_dir, "global_step1")
        train(eng, 2, 2)
        _killed_before_commit(eng.checkpoint_engine.checkpointer)
        eng.save_checkpoint(save_dir, "global_step2")
        raise SystemExit("the save of global_step2 returned: the kill before its commit never came")
    path, _ = eng.load_checkpoint(save_dir, load_module_only=True)  # ZeRO-2 cannot repartition its optimizer
    train(eng, 2, 2)
    eng.save_checkpoint(save_dir, "global_step2")
    eng.destroy()
    with open(os.path.join(root, "resume.json"), "w") as f:
        json.dump({"loaded": path}, f)
    torch.distributed.destroy_process_group()  # before finalization (see _deepspeed_kill_worker.run_rank)
