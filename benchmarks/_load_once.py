"""Load one file that is in the page cache, in this fresh process, and print the seconds the
load took (``save_bench.py``'s "cached restore, new process": what a restarted job pays).

    python benchmarks/_load_once.py fastckpt|torch PATH

The file is read through the page cache first, so the timed load finds it there; imports and
the Checkpointer's construction are outside the clock.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from _save_variants import warm  # this script's folder is on sys.path


def main(kind: str, path: str) -> None:
    warm([path])
    if kind == "fastckpt":
        import fastckpt

        ck = fastckpt.Checkpointer()
        t0 = time.perf_counter()
        obj = ck.load(path)
    else:
        t0 = time.perf_counter()
        obj = torch.load(path, weights_only=True)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "tensors": sum(isinstance(v, torch.Tensor) for v in obj.values())}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
