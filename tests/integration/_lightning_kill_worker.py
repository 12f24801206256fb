"""Run by test_lightning_kill.py: one generation of a Lightning run that is SIGKILLed and resumed.

Forked by ``_fork_launcher.py`` (``run_rank``), or run alone: ``_lightning_kill_worker.py ROOT
GEN KILLS``. A real Trainer with FastCkptIO (burst buffer
ROOT/nvme, home ROOT/ckpt) and ModelCheckpoint (every step, the 2 newest by step, and
last.ckpt). Generation GEN resumes from ``FastCkptIO.latest(ROOT/ckpt)`` and records in
ROOT/gen/gGEN.json what it loaded: the path, the step, and whether the weights after the
restore hash to what that checkpoint recorded when it was saved. Generations before KILLS then
SIGKILL themselves at a random moment of training; generation KILLS trains a few steps and
ends. Every generation logs fastckpt's events to ROOT/events/gGEN.jsonl: the test reads which
checkpoints were verified at their home before each kill from there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.integrations.lightning import FastCkptIO  # noqa: E402
from tests.integration.test_lightning import TinyModel, loader, make_trainer  # noqa: E402

KILL_WINDOW_S = (0.05, 1.5)  # after training starts, the generation dies within this many seconds
FINAL_STEPS = 4


def weights_hash(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Recorder(Callback):
    """Stamps each checkpoint with its weights' hash; after a resume, records what was loaded."""

    def __init__(self, out: str, ckpt_path: str | None, kill_after_s: float | None) -> None:
        self.out, self.ckpt_path, self.kill_after_s = out, ckpt_path, kill_after_s
        self.loaded: dict | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        checkpoint["wsum"] = weights_hash(pl_module)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        self.loaded = {"step": checkpoint["global_step"], "wsum": checkpoint.get("wsum")}

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        rec = {"path": self.ckpt_path, "step": trainer.global_step}
        if self.loaded is not None:
            rec.update(saved_step=self.loaded["step"], weights_match=weights_hash(pl_module) == self.loaded["wsum"])
        with open(self.out, "w") as f:
            json.dump(rec, f)
            f.flush()
            os.fsync(f.fileno())
        if self.kill_after_s is not None:
            threading.Timer(self.kill_after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()


def main(root: str, gen: int, kills: int) -> None:
    for d in ("gen", "events"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    home = os.path.join(root, "ckpt")
    io = FastCkptIO(local_dir=os.path.join(root, "nvme"), keep_local=2, overhead_budget=0.99,
                    event_log=os.path.join(root, "events", f"g{gen}.jsonl"))
    ckpt_path = io.latest(home)
    kill = random.Random(gen).uniform(*KILL_WINDOW_S) if gen < kills else None
    rec = Recorder(os.path.join(root, "gen", f"g{gen}.json"), ckpt_path, kill)
    max_steps = 100_000  # killed long before
    if gen == kills:  # the last generation: a few steps past where it resumes, then fit() returns
        start = int(fastckpt.load(ckpt_path, weights_only=False)["global_step"]) if ckpt_path else 0
        max_steps = start + FINAL_STEPS
    torch.manual_seed(gen)
    trainer = make_trainer(root, io, max_steps, callbacks=[rec], every_n_train_steps=1, save_top_k=2,
                           monitor="step", mode="max", save_last=True)
    trainer.fit(TinyModel(), loader(), ckpt_path=ckpt_path)


def prepare() -> None:
    """What ``_fork_launcher`` imports before forking: what each generation would otherwise
    import again (the optimizer's constructor imports torch._dynamo on its first call)."""
    import torch._dynamo  # noqa: F401


def run_rank(gen: int, root: str, kills: str) -> None:
    main(root, int(gen), int(kills))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
