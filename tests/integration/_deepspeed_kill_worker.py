"""Run by test_deepspeed_kill.py: ZeRO-2, 2 CPU processes, once per generation: forked by
``_fork_launcher.py`` (``run_rank``), or under torchrun (``_deepspeed_kill_worker.py ROOT GEN
KILLS``). The checkpoints go to ROOT/ckpt, or, when
FASTCKPT_TEST_S3 names a SeaweedFS bucket (``{"bucket": ..., "storage_options": ...}``), to
``s3://BUCKET/run`` through the burst buffer ROOT/nvme. Generation GEN resumes with
``engine.load_checkpoint(save_dir)`` and records what it loaded; generations before KILLS then
train with a checkpoint every step until rank GEN % 2 SIGKILLs itself at a random moment
(in a lazy generation, counted from its first durable tag; the launcher then stops the other
rank); generation KILLS trains a few steps more, destroys the engine (flush) and exits 0. With
save_dir a directory, odd generations save with the lazy snapshot
(``"lazy_snapshot": true``: each save's copy runs beside the next step's forward and backward),
so resumes cross between checkpoints saved both ways.

Each rank writes ROOT/gen/g{g}-r{rank}.json: the loaded tag and the checks below (recorded,
not asserted, so a failed check does not cost a restart; a load that raises is recorded too):
  - the tag equals DeepSpeed's ``latest`` (at the URL: the pointer fastckpt published there)
    and ``fastckpt.latest(save_dir)``;
  - the weights after the load hash to what the tag's client_state recorded at save time
    (every rank's files of one attempt: mixed files would give other weights);
  - the tag is no older than any checkpoint rank 0 saw committed before the kill
    (ROOT/durable.log, appended and fsynced as commit handles complete).
Every rank also logs fastckpt's events (ROOT/events/g{g}-r{rank}.jsonl), so the test can say
which phase each kill interrupted.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import os
import random
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.integrations.deepspeed import attach  # noqa: E402
from tests.integration._ds_common import ds_config, full_weights, train  # noqa: E402

KILL_WINDOW_S = (0.05, 1.2)  # after the resume, the victim dies within this many seconds
FINAL_STEPS = 3


def weights_hash(eng) -> str:  # noqa: ANN001
    h = hashlib.sha256()
    for name, t in sorted(full_weights(eng).items()):
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def durable_steps(root: str) -> list[int]:
    try:
        with open(os.path.join(root, "durable.log")) as f:
            return [int(line) for line in f.read().split()]
    except FileNotFoundError:
        return []


def record_durable(root: str, step: int) -> None:
    fd = os.open(os.path.join(root, "durable.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{step}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def home(root: str) -> tuple[str, dict | None]:
    """The save_dir, and its storage_options when it is an S3 URL."""
    spec = os.environ.get("FASTCKPT_TEST_S3")
    if not spec:
        return os.path.join(root, "ckpt"), None
    s3 = json.loads(spec)
    return f"s3://{s3['bucket']}/run", s3["storage_options"]


def read_latest(save_dir: str, opts: dict | None) -> str:
    if opts is None:
        with open(os.path.join(save_dir, "latest")) as f:
            return f.read()
    import fsspec

    return fsspec.filesystem("s3", **opts).cat_file(f"{save_dir}/latest").decode()


def build(root: str, gen: int, rank: int, opts: dict | None, lazy: bool):  # noqa: ANN201
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 4))
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                                        config=ds_config(2))
    handles: list = []
    os.makedirs(os.path.join(root, "events"), exist_ok=True)
    attach(eng, {"local_dir": os.path.join(root, "nvme"), "commit_timeout_s": 60, "keep_local": 2,
                 "event_log": os.path.join(root, "events", f"g{gen}-r{rank}.jsonl"), "storage_options": opts,
                 "lazy_snapshot": lazy},
           on_commit=handles.append)
    return eng, handles


def resume(eng, save_dir: str, root: str, opts: dict | None) -> dict:  # noqa: ANN001
    floor = max(durable_steps(root), default=0)
    try:
        path, client = eng.load_checkpoint(save_dir)
    except BaseException as exc:  # recorded, then raised: the run fails
        return {"error": repr(exc)}
    if path is None:
        return {"tag": None, "floor": floor, "fresh": True}
    tag = os.path.basename(os.path.dirname(path))  # DeepSpeed's path: in the burst buffer for a URL
    torch.distributed.barrier()  # rank 0 may have moved a lagging latest forward while rank 1 loaded
    named = read_latest(save_dir, opts)
    newest = fastckpt.latest(save_dir, storage_options=opts)
    return {"tag": tag, "latest_file": named, "fastckpt_latest": (newest or "").rsplit("/", 1)[-1],
            "step": eng.global_steps, "client_step": client["step"], "floor": floor,
            "weights_match": weights_hash(eng) == client["wsum"]}


def save(eng, save_dir: str) -> None:  # noqa: ANN001
    eng.save_checkpoint(save_dir, client_state={"step": eng.global_steps, "wsum": weights_hash(eng)})


def report_durable(handles: list, root: str, rank: int) -> None:
    while handles and handles[0].done():
        rec = handles.pop(0).wait()
        if rank == 0 and not rec.superseded:
            record_durable(root, int(os.path.basename(rec.group).removeprefix("global_step")))


def main(root: str, gen: int, kills: int) -> None:
    faulthandler.dump_traceback_later(60, exit=True)
    logging.getLogger("fastckpt").setLevel(logging.ERROR)  # the overhead alarm fires in this tight loop
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    save_dir, opts = home(root)
    lazy = opts is None and gen % 2 == 1
    eng, handles = build(root, gen, rank, opts, lazy)
    rec = resume(eng, save_dir, root, opts)
    rec.update(gen=gen, rank=rank, final=gen == kills, lazy=lazy)
    os.makedirs(os.path.join(root, "gen"), exist_ok=True)
    with open(os.path.join(root, "gen", f"g{gen}-r{rank}.json"), "w") as f:
        json.dump(rec, f)
    if "error" in rec:
        raise SystemExit(f"resume failed: {rec['error']}")
    torch.distributed.barrier()  # both records are written before the victim's timer starts
    if gen < kills:
        victim = rank == gen % 2
        while True:  # until the victim's timer fires (and the launcher stops the other rank)
            train(eng, eng.global_steps + 1, eng.global_steps + 1)
            save(eng, save_dir)
            if victim and (not lazy or handles[0].wait(60)):  # a lazy generation leaves one durable tag first,
                victim = False  # so some generation resumes from a lazily saved tag (the test checks it)
                delay = random.Random(gen).uniform(*KILL_WINDOW_S)
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            report_durable(handles, root, rank)
    for _ in range(FINAL_STEPS):
        train(eng, eng.global_steps + 1, eng.global_steps + 1)
        save(eng, save_dir)
    final_hash = weights_hash(eng)
    eng.destroy()
    report_durable(handles, root, rank)
    with open(os.path.join(root, "gen", f"final-r{rank}.json"), "w") as f:
        json.dump({"step": eng.global_steps, "wsum": final_hash}, f)


def prepare() -> None:
    """What ``_fork_launcher`` imports before forking the ranks: what the first generation
    would otherwise import in every rank (the optimizer's constructor imports torch._dynamo;
    DeepSpeed's optimizer check imports its Muon module, which compiles at import)."""
    import torch._dynamo  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401

    if os.environ.get("FASTCKPT_TEST_S3"):
        import s3fs  # noqa: F401


def run_rank(gen: int, root: str, kills: str) -> None:
    """One rank of generation ``gen`` (``_fork_launcher`` calls it in each forked rank)."""
    main(root, int(gen), int(kills))
    # Destroy the process group before the interpreter's finalization: gloo's worker threads,
    # torn down there, abort the process ("terminate called without an active exception"), as
    # the suite saw about once in six runs (pytorch/pytorch#190489).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":  # under torchrun: _deepspeed_kill_worker.py ROOT GEN KILLS
    run_rank(int(sys.argv[2]), sys.argv[1], sys.argv[3])
