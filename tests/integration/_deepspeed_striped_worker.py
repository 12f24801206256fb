"""The processes of ``test_deepspeed_striped.py``: a ZeRO-2 engine on one rank, ``save_dir`` an
``s3://`` URL, the burst buffer striped over two drives. ``save``: global_step1, whose model file
drive 0 writes slowly (held until the next save is taken), then global_step2, whose model file
goes to drive 1, the less busy one. ``load``: a restart on the same node resumes.

Forked by ``_fork_launcher.py`` (``run_rank``), one process per generation: 0 saves, 1 says
where global_step2's files lie on the drives and loads, 2 deletes drive 1's copy of
global_step2 and loads. Each prints one ``RESULT`` line. One import of torch and DeepSpeed for
the three processes, not three (about 4 s each on a 2-core machine)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading

TAG = "global_step2"


def main(phase: str, url: str, drives: list[str], opts: dict) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch

    import fastckpt
    from fastckpt.integrations.deepspeed import attach
    from fastckpt.testing import FaultyOps
    from tests.integration._ds_common import engine, train

    held, entered = threading.Event(), threading.Event()

    def on_call(op: str, path: str) -> None:  # drive 0's write of global_step1's model file is slow
        if op == "pwrite" and path.startswith(drives[0]) and "global_step1" in path and not held.is_set():
            entered.set()
            assert held.wait(60)

    eng = engine(2, None, use_fastckpt_initialize=False)
    ck = fastckpt.Checkpointer(local_dir=drives, storage_options=opts, staging_buffers=3,
                               ops=FaultyOps(on_call=on_call), overhead_budget=0.99)
    attach(eng, checkpointer=ck)
    written, release = threading.Event(), ck._stripes.release

    def released(res, failure=None):  # noqa: ANN001, ANN202 (global_step1's other file, on drive 1, is written)
        release(res, failure)
        if res is not None and res.index == 1 and "global_step1" in res.path:
            written.set()

    ck._stripes.release = released  # the Saver shares this Stripes
    result: dict = {}
    try:
        if phase == "save":
            train(eng, 1, 1)
            eng.save_checkpoint(url)
            assert entered.wait(60), "global_step1's model file was not written on drive 0"
            # drive 1 must be the less busy one when global_step2 is saved: its write of global_step1's other
            # file has ended (this raced: under load that write was still queued, and drive 0 was chosen)
            assert written.wait(60), "global_step1's other file was not written on drive 1"
            train(eng, 2, 2)
            eng.save_checkpoint(url)  # its model file goes to drive 1: drive 0 is busy
            held.set()
        else:
            held.set()
            path, _ = eng.load_checkpoint(url)
            result = {"path": path, "global_steps": eng.global_steps}
    finally:
        held.set()
        eng.destroy()
        ck.close()
        torch.distributed.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def files(drive: str, tag: str) -> list[str]:
    """The files (not links) of ``tag``'s directory on ``drive``."""
    return [f for top, _, fs in os.walk(drive) if os.path.basename(top) == tag for f in fs
            if not os.path.islink(os.path.join(top, f))]


def drop(drive: str, tag: str) -> None:
    """Delete ``drive``'s copy of ``tag`` (trimmed, a drive swapped)."""
    for top, _, _ in os.walk(drive):
        if os.path.basename(top) == tag:
            shutil.rmtree(top)
            return


def prepare() -> None:
    """What ``_fork_launcher`` imports before forking: what each process would import again."""
    import s3fs  # noqa: F401
    import torch._dynamo  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401

    import fastckpt.integrations.deepspeed  # noqa: F401
    import tests.integration._ds_common  # noqa: F401


def run_rank(gen: int, url: str, drives_json: str, opts_json: str) -> None:
    drives, opts = json.loads(drives_json), json.loads(opts_json)
    if gen == 0:
        main("save", url, drives, opts)
        return
    if gen == 1:  # before the load: where the save put the files
        print("WHERE " + json.dumps({d: files(d, TAG) for d in drives}), flush=True)
    else:
        drop(drives[1], TAG)  # the link on drive 0 dangles: the file is downloaded in its stead
    main("load", url, drives, opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])))
