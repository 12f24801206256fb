"""Run by test_lightning_last_names.py: ``python -m tests.integration._lightning_last_names_worker ROOT``.

Trains as that file's first test does (home ROOT/ckpt, burst buffer ROOT/nvme), prints "ready"
once the deletion of step=2 has run (or waits) while last.ckpt of step 3 is held, and then waits
on stdin for the SIGKILL that the test sends.
"""

from __future__ import annotations

import os
import sys

from tests.integration.test_lightning_last_names import held_fit


def ready(trainer: object) -> None:
    print("ready", flush=True)
    sys.stdin.readline()  # the test kills this process here
    raise SystemExit("the test was to kill this process")


def main(root: str) -> None:
    held_fit(root, os.path.join(root, "ckpt"), 5, hold_at=2, ready=ready)


if __name__ == "__main__":
    main(sys.argv[1])
