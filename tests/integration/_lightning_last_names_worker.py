"""Run by test_lightning_last_names.py: ``python -m tests.integration._lightning_last_names_worker MODE ROOT``.

``kill``: trains as that file's first test does (home ROOT/ckpt, burst buffer ROOT/nvme), prints
"ready" once the deletion of step=2 was judged while last.ckpt of step 3 is held, and then waits
on stdin for the SIGKILL that the test sends.

``fsdp``: a fit under FSDPStrategy(state_dict_type="sharded") (one CPU process, gloo; see
_lightning_fsdp_script.py for the CPU wrapping) with FastCkptIO on a burst buffer and
ModelCheckpoint(save_top_k=1, save_last=True) every step; writes ROOT/summary.json: the files
left, the top-k folders seen at each step, and the "kept" WARNINGs.

``model_parallel``: see ``model_parallel`` below.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings


def ready(trainer: object) -> None:
    print("ready", flush=True)
    sys.stdin.readline()  # the test kills this process here
    raise SystemExit("the test was to kill this process")


def kill(root: str) -> None:
    from tests.integration.test_lightning_last_names import held_fit

    held_fit(root, os.path.join(root, "ckpt"), 5, hold_at=2, ready=ready)


def fsdp(root: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fastckpt import FastCkptIO
    from tests.integration._lightning_fsdp_script import CountCheckpoints, CPUFSDPStrategy, Model
    from tests.integration.test_lightning import loader

    warnings.filterwarnings("ignore")
    kept: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("fastckpt: kept"):
                kept.append(record.getMessage())

    logging.getLogger("fastckpt.lightning").addHandler(Kept(logging.WARNING))
    directory = os.path.join(root, "ckpt")
    count = CountCheckpoints(directory)
    t = L.Trainer(max_steps=5, accelerator="cpu", devices=1, strategy=CPUFSDPStrategy(state_dict_type="sharded"),
                  plugins=[FastCkptIO(local_dir=os.path.join(root, "nvme"))], logger=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                  callbacks=[count, ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1,
                                                    monitor="step", mode="max", save_last=True)])
    t.fit(Model(), loader())
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump({"files": sorted(os.listdir(directory)), "counts": count.counts, "kept": kept}, f)


def model_parallel(root: str) -> None:
    """``model_parallel``: held_fit under ModelParallelStrategy(save_distributed_checkpoint=False);
    writes ROOT/summary.json: the files the durable last.ckpt named but were missing."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from tests.integration.test_lightning_last_names import ValModel, held_fit

    class Model(ValModel):
        def configure_model(self) -> None:  # ModelParallelStrategy requires one; nothing to parallelize here
            pass

    warnings.filterwarnings("ignore")
    missing, _ = held_fit(root, os.path.join(root, "ckpt"), 4, hold_at=2, model=Model,
                          strategy=ModelParallelStrategy(save_distributed_checkpoint=False))
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump({"missing": missing}, f)


if __name__ == "__main__":
    {"kill": kill, "fsdp": fsdp, "model_parallel": model_parallel}[sys.argv[1]](sys.argv[2])
    if sys.argv[1] in ("fsdp", "model_parallel"):
        from tests.integration._exit import leave

        leave()  # not through the interpreter's finalization: see _exit.leave
