"""How the multi-process worker scripts end (imports only torch, so any worker can use it)."""

from __future__ import annotations

import atexit
import os
import sys
import threading

import torch.distributed as dist


def leave(code: int = 0) -> None:
    """End a worker whose work is done: destroy the process group, do what the interpreter's
    exit does first (``threading._shutdown``: fastckpt's exit flush, then the join of the
    non-daemon threads; then the atexit handlers, logging's among them), flush, and exit
    without the interpreter's finalization. gloo's threads, torn down there while objects (a strategy, an
    engine) still hold the group, abort the process ("terminate called without an active
    exception") now and then even after ``destroy_process_group`` (pytorch/pytorch#190489):
    the suite saw it about once in six runs, and again after the destroy was added."""
    if dist.is_initialized():
        dist.destroy_process_group()
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
