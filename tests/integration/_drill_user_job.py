"""A user's training job for the drill tests: resumes from the newest checkpoint under
$FASTCKPT_DRILL_DIR, then steps forever, saving a single file every 5 steps and writing its
current step to $FASTCKPT_DRILL_STEP_FILE (how the drill counts RPO in steps)."""

from __future__ import annotations

import os
import time

import torch

import fastckpt


def main() -> None:
    home = os.environ["FASTCKPT_DRILL_DIR"]
    step_file = os.environ["FASTCKPT_DRILL_STEP_FILE"]
    with fastckpt.Checkpointer(local_dir=os.environ.get("FASTCKPT_DRILL_LOCAL_DIR") or None, keep_persistent=3) as ck:
        found = ck.latest(home)
        state = ck.load(found) if found else {"w": torch.zeros(1 << 18), "step": 0}
        step = state["step"]
        while True:
            step += 1
            state["w"] += 1
            with open(step_file + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(step_file + ".tmp", step_file)
            time.sleep(0.02)
            if step % 5 == 0:
                ck.save({"w": state["w"], "step": step}, os.path.join(home, f"step-{step:08d}.pt"))


if __name__ == "__main__":
    main()
