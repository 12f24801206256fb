"""Two real processes commit a group without a store (marker files): every rank reports what
rank 0 reports, where a step of rank 0's commit after the manifest failed or could not matter.

Faults are injected in rank 0's process only (``FaultyOps``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastckpt

REPO = Path(__file__).resolve().parents[2]
COMMIT_TIMEOUT_S = 20  # a rank that waited for a pointer never to come failed after about twice this

RANK = textwrap.dedent("""
    import errno, json, os, sys, time, torch, fastckpt
    from fastckpt.testing import FaultyOps

    root, r, name, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    g = root + "/" + name
    armed, hits = [], []

    def parent_fsync(op, path):  # the re-save's exchange landed, then the parent's fsync fails (EIO)
        if r == 0 and armed and not hits and op == "fsync_dir" and path.rstrip("/") == root:
            hits.append(path)
            raise OSError(errno.EIO, "Input/output error (injected)", path)

    ck = fastckpt.Checkpointer(ops=FaultyOps(on_call=parent_fsync), store=None, commit_timeout_s=float(sys.argv[5]),
                               rank=r, world_size=2)
    said = []
    for step in range(1, steps + 1):
        ck.save({"w": torch.arange(4096) + r, "step": step}, f"{g}/rank{r}.pt", group=g).wait()
        armed.extend([1] if step == steps > 1 else [])
        began = time.monotonic()
        try:
            ck.commit(g, step=step).wait()
            said.append("ok")
        except Exception as exc:
            said.append(f"{type(exc).__name__}: {exc}"[:400])
    print(json.dumps({"said": said, "took_s": time.monotonic() - began, "hit": bool(hits)}), flush=True)
    ck.close()
    os._exit(0)
""")


def _run(root: Path, name: str, steps: int) -> dict[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(root), str(r), name, str(steps), str(COMMIT_TIMEOUT_S)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    return {r: json.loads(out.splitlines()[-1]) if out.strip() else {"said": [err[-3000:]]}
            for r, (out, err) in enumerate(outs)}


@pytest.mark.parametrize("name", [".hidden_step1", "linked", "step1 "])
def test_a_group_no_pointer_can_name_commits_on_every_rank(tmp_path: Path, name: str) -> None:
    """A group whose name ``latest`` cannot lead to (a hidden name, a symlinked group directory, a
    name ending in a blank: the pointer is read stripped): rank 0 reported it committed, while
    rank 1 waited for ``latest`` to name it, twice its commit_timeout_s, then failed. Such a group
    is committed once it is published, on every rank, as before rank 1 waited for the pointer."""
    if name == "linked":
        (tmp_path / "real").mkdir()
        (tmp_path / "linked").symlink_to(tmp_path / "real")
    said = _run(tmp_path, name, 1)
    assert said[0]["said"] == said[1]["said"] == ["ok"], said
    assert said[1]["took_s"] < COMMIT_TIMEOUT_S, said[1]


def test_a_resave_whose_exchange_landed_before_the_fsync_failed_commits_on_every_rank(tmp_path: Path) -> None:
    """A re-save of ``last`` (which ``latest`` names): rank 0's exchange swapped it in, then the
    parent's fsync failed (EIO). Rank 0 reported it failed, rank 1 committed, and ``latest()``
    resumed it. Rank 0 reads the manifest again: it is this attempt's, so every rank reports it
    committed (rank 0 with a WARNING)."""
    said = _run(tmp_path, "last", 2)
    assert said[0]["hit"], said
    assert said[0]["said"] == said[1]["said"] == ["ok", "ok"], said
    assert fastckpt.latest(str(tmp_path)) == f"{tmp_path}/last"
    assert fastckpt.load(f"{tmp_path}/last/rank1.pt")["step"] == 2
