"""Two real processes commit groups without a store, ``keep_persistent=1``, a per-step tag and a
rolling ``last`` tag both committed at each step (as Lightning's ``save_last`` makes them): rank 0
publishes ``step-1``, then ``last``, moves ``latest`` to ``last`` and trims ``step-1`` before rank
1's poll reads ``step-1``'s manifest. Rank 1 found its marker gone and, since ``latest`` named no
later step, raised ``GroupRemovedError`` naming ``Checkpointer.remove``, which nobody called: a
healthy job crashed on every launch. Rank 1 now finds retention's record of the trim and reports
the commit done, as rank 0 did.

Rank 1's first poll for ``step-1``'s manifest once its marker joined rank 0's attempt is held until
rank 0 has deleted ``step-1`` (a pipe between the processes, written by rank 0's ``rmdir`` of it):
rank 1 never reads that manifest, the order the race needs, every run.
"""

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
STEPS = 3

RANK = textwrap.dedent("""
    import json, os, select, sys, threading, torch, fastckpt
    from fastckpt.testing import FaultyOps

    root, r, steps, fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
    last_step = sys.argv[4] == "1"
    first = os.path.join(root, "step-1")
    held, saw, lock = [], [], threading.Lock()

    def joined():  # rank 1's marker names rank 0's attempt at step-1: rank 0 can publish it
        try:
            marks = [json.load(open(os.path.join(first, ".fastckpt", n))) for n in ("rank-00001.json", "attempt.json")]
        except (OSError, ValueError):
            return False
        return marks[0].get("attempt") is not None and marks[0].get("attempt") == marks[1].get("attempt")

    class Ops(FaultyOps):
        def rmdir(self, path):  # rank 0: step-1 is gone (retention trimmed it)
            super().rmdir(path)
            if r == 0 and os.path.normpath(path) == first:
                os.write(fd, b"x")

        def read_small(self, path):  # rank 1: its first poll for step-1's manifest, once joined, waits for that
            mine = r == 1 and path == os.path.join(first, "fastckpt-manifest.json")
            if mine and joined():
                with lock:
                    if not held:
                        held.append(bool(select.select([fd], [], [], 60)[0]))
            data = super().read_small(path)
            if mine and data is not None:
                saw.append(path)
            return data

    said = {}
    with fastckpt.Checkpointer(ops=Ops(), store=None, rank=r, world_size=2, keep_persistent=1, commit_timeout_s=30,
                               overhead_budget=0.99) as ck:
        for i in range(1, steps + 1):
            handles = []
            for g in (f"{root}/step-{i}", f"{root}/last"):
                ck.save({"w": torch.full((4096,), float(i)), "step": i}, f"{g}/r{r}.pt", group=g)
                step = {"step": i} if last_step or not g.endswith("last") else {}  # last: a tag without a number
                handles.append((os.path.basename(g) + f"@{i}", ck.commit(g, **step)))
            for name, h in handles:
                try:
                    rec = h.wait(120)
                    said[name] = ["ok", rec.bytes, rec.superseded]
                except Exception as exc:
                    said[name] = [f"{type(exc).__name__}: {exc}"[:400]]
    print(json.dumps({"said": said, "held": held, "saw": saw}), flush=True)
""")


def _run(root: Path, last_step: bool) -> dict[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    rd, wr = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(root), str(r), str(STEPS), "1" if last_step else "0",
                               str(fd)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              pass_fds=(fd,)) for r, fd in ((0, wr), (1, rd))]
    os.close(rd)
    os.close(wr)
    outs = [p.communicate(timeout=300) for p in procs]
    return {r: json.loads(out.splitlines()[-1]) if out.strip() else {"said": {"crash": [err[-3000:]]}}
            for r, (out, err) in enumerate(outs)}


@pytest.mark.parametrize("last_step", [True, False], ids=["last-with-step", "last-without-step"])
def test_a_group_trimmed_before_a_late_rank_read_its_manifest_is_committed_on_every_rank(
        tmp_path: Path, last_step: bool) -> None:
    said = _run(tmp_path, last_step)
    assert said[0]["said"].keys() == said[1]["said"].keys() and len(said[0]["said"]) == 2 * STEPS, said
    for name, ok in said[0]["said"].items():
        assert ok[0] == "ok" and not ok[2], (name, said)  # before: rank 1's step-1@1 was GroupRemovedError
        assert said[1]["said"][name] == ok, (name, said)  # the same bytes, committed (not superseded) on rank 1
    assert all(said[1]["held"]) and not said[1]["saw"], said  # rank 1 never read step-1's manifest: it was trimmed
    assert not (tmp_path / "step-1").exists()
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "last")
    assert fastckpt.load(str(tmp_path / "last" / "r1.pt"))["step"] == STEPS
