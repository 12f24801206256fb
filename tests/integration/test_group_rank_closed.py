"""A rank whose process exits (an uncaught exception: the exit flush closes its Checkpointer) after
saving into a group it never committed ends that attempt on every rank: the other rank's commit
fails at once, naming it, and that rank's own exit is not held for ``commit_timeout_s``.

Two real processes (RANK/WORLD_SIZE in the environment), without a store (marker files) and with
a TCPStore the test hosts (as torchrun's agent would). They are kept in step through pipes: rank
1 raises only once rank 0 is in its commit of step2. In-process cases: tests/unit/test_commit_closed.py.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P

REPO = Path(__file__).resolve().parents[2]
COMMIT_TIMEOUT_S = 120  # what rank 0 would wait for rank 1 without the fix; the test allows it 60 s

RANK = textwrap.dedent("""
    import datetime, json, os, sys, time, torch, fastckpt

    root, port = sys.argv[1], sys.argv[2]
    r = int(os.environ["RANK"])
    store = None
    if port:
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", int(port), 2, False, timeout=datetime.timedelta(seconds=60))
    ck = fastckpt.Checkpointer(store=store, commit_timeout_s=float(sys.argv[3]), io_threads=1)
    for step in (1, 2):
        g = f"{root}/step{step}"
        ck.save({"w": torch.arange(1 << 12) + r, "step": step}, f"{g}/rank{r}.pt", group=g).wait()
        if step == 1:
            ck.commit(g, step=1).wait()
    if r == 1:
        print("saved step2", flush=True)
        sys.stdin.readline()  # the test says when: rank 0 is in its commit of step2
        raise RuntimeError("rank 1: a bug in the training loop, after its save into step2")
    h = ck.commit(g, step=2)
    print("committing", flush=True)
    try:
        h.wait()
        said = "ok"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"said": said}), flush=True)
    # returns from main with the Checkpointer open: its exit flush has nothing left to wait for
""")


def _start(rank: int, root: Path, port: int | None) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", RANK, str(root), str(port or ""), str(COMMIT_TIMEOUT_S)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("with_store", [True], ids=["tcpstore"])  # without a store close() tells no one
def test_a_rank_that_exits_without_committing_its_group_ends_the_others_commit(tmp_path: Path,
                                                                              with_store: bool) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) if with_store else None
    procs = [_start(r, tmp_path, store.port if store is not None else None) for r in (0, 1)]
    guard = threading.Timer(240, lambda: [p.kill() for p in procs])  # a hung rank must not hang the suite
    guard.start()
    try:
        assert procs[0].stdout.readline().strip() == "committing", procs[0].communicate()[1]
        assert procs[1].stdout.readline().strip() == "saved step2", procs[1].communicate()[1]
        procs[1].stdin.write("go\n")
        procs[1].stdin.flush()
        err1 = procs[1].communicate(timeout=60)[1]
        assert procs[1].returncode == 1 and "a bug in the training loop" in err1, err1
        try:
            out0, err0 = procs[0].communicate(timeout=60)  # without the fix: commit_timeout_s (120 s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still waits in its commit of step2 60 s after rank 1 exited "
                        f"(commit_timeout_s={COMMIT_TIMEOUT_S}); rank 1 said:\n{err1}")
    finally:
        guard.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode == 0, err0
    said = json.loads(out0.splitlines()[-1])["said"]
    assert said.startswith("CheckpointWriteError: "), said
    assert f"rank 1 closed its Checkpointer without committing group {tmp_path}/step2" in said, said
    assert fastckpt.latest(str(tmp_path)) == f"{tmp_path}/step1"
    assert not (tmp_path / "step2" / P.GROUP_MANIFEST).exists()
