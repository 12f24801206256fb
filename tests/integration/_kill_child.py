"""Child process for test_sigkill.py: saves step-numbered states until it is SIGKILLed.

Usage: python _kill_child.py DIR FIRST_STEP [--local-dir DIR] [--lockstep]

Every step saves the state of that step to DIR/last.pt (always the same path) and to
DIR/step-NNNNNN.pt, keeping the newest three step files. Before the saves it prints
``saving N``, after they returned (snapshot taken, writes in flight) ``writing N``, and once
both are durable ``durable N``; each line is flushed before the child goes on.

``--lockstep`` routes every file operation through ``fastckpt.testing.FaultyOps`` whose hook
prints ``op <name> <file>`` and waits for a line on stdin before the call runs, so the parent
can kill the child exactly before any operation: mid-write, before an fsync, between rename
and directory fsync...
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import torch

import fastckpt
from fastckpt.testing import FaultyOps


def make_state(step: int) -> dict:
    """The state of one step: every value is a function of ``step`` (tests rebuild it)."""
    return {
        "model": {"w": torch.full((1024, 1024), step, dtype=torch.int64),  # 8 MiB
                  "b": torch.arange(4096, dtype=torch.int32) * step},
        "optim": [torch.full((3,), -step, dtype=torch.int16), {"lr_x1000": step % 7}],
        "step": step,
    }


def step_path(d: str, step: int) -> str:
    return os.path.join(d, f"step-{step:06d}.pt")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: lines from threads never interleave
    sys.stdout.flush()


def _lockstep_ops() -> FaultyOps:
    lock = threading.Lock()

    def hook(op: str, path: str) -> None:
        with lock:  # I/O workers take turns: one question to the parent at a time
            _say(f"op {op} {os.path.basename(path)}")
            if not sys.stdin.readline():
                raise SystemExit(0)  # the parent went away

    return FaultyOps(on_call=hook)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("first_step", type=int)
    ap.add_argument("--local-dir")
    ap.add_argument("--lockstep", action="store_true")
    args = ap.parse_args()
    d, step = args.dir, args.first_step
    ops = _lockstep_ops() if args.lockstep else None
    with fastckpt.Checkpointer(local_dir=args.local_dir, overhead_budget=0.99, ops=ops) as ck:
        while True:
            state = make_state(step)
            _say(f"saving {step}")
            h1 = ck.save(state, os.path.join(d, "last.pt"))
            h2 = ck.save(state, step_path(d, step))
            _say(f"writing {step}")
            h1.wait()
            h2.wait()
            _say(f"durable {step}")
            if os.path.exists(step_path(d, step - 3)):
                ck.remove(step_path(d, step - 3))
            step += 1


if __name__ == "__main__":
    main()
