"""Multi-rank groups with real processes: torchrun, 2 ranks, gloo over 127.0.0.1.

One torchrun launch runs scenarios a, c, r and b of ``_group_worker.py`` (see its docstring);
a second launch, without torchrun (whose agent would tear rank 0 down when a rank dies by
signal), SIGKILLs rank 1 before its commit. Every test here checks the files those runs left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit import protocol as C
from tests.helpers import place, read_file_manifest, scan, tmp_files

from . import _group_worker as W

WORKER = str(Path(W.__file__).resolve())
TIMEOUT_S = 5.0
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    root: Path
    results: dict[int, dict]
    wall_s: float
    output: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               MASTER_ADDR="127.0.0.1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


def _communicate(proc: subprocess.Popen, limit_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launcher and its workers
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} hung for {limit_s} s:\n{out}")
    return out


def _results(root: Path) -> dict[int, dict]:
    return {r: json.loads((root / "results" / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("groups")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", WORKER,
           "--root", str(root), "--scenario", "all", "--timeout", str(TIMEOUT_S)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=root)
    out = _communicate(proc, 120)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, out
    return Run(root, _results(root), wall, out)


@pytest.fixture(scope="module")
def sigkill_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("groups-kill")
    port = str(_free_port())
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, WORKER, "--root", str(root), "--scenario", "kill",
                               "--timeout", str(TIMEOUT_S)],
                              env=_env(MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, cwd=root)
             for r in (0, 1)]
    try:
        outs = [_communicate(p, 120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # the other rank, after a hang was reported
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    wall = time.monotonic() - t0
    output = "\n".join(f"--- rank {r} ---\n{o}" for r, o in enumerate(outs))
    assert procs[1].returncode == -signal.SIGKILL, output
    assert procs[0].returncode == 0, output
    return Run(root, _results(root), wall, output)


def _shard_files(group: Path, rank: int) -> list[Path]:
    return [group / name for name in W.shard_names(rank)]


def _assert_equal_state(got: object, want: object) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict)
        assert sorted(got, key=repr) == sorted(want, key=repr)
        for k in want:
            _assert_equal_state(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_equal_state(g, w)
    else:
        assert got == want


def _assert_loads(path: Path, want: dict) -> None:
    for got in (fastckpt.load(str(path)), torch.load(path, weights_only=True),
                torch.load(path, weights_only=True, mmap=True)):
        _assert_equal_state(got, want)


# --------------------------------------------------------------------------- (a)
def test_two_ranks_three_steps_commit_and_load(torchrun_run: Run) -> None:
    parent = torchrun_run.root / "a"
    last = parent / f"global_step{W.STEPS[-1]}"
    assert fastckpt.latest(str(parent)) == str(last)
    assert (parent / C.LATEST).read_text() == last.name
    assert [f.path for f in scan(str(parent))] == [str(parent / f"global_step{s}") for s in W.STEPS]
    for step in W.STEPS:
        group = parent / f"global_step{step}"
        manifest = json.loads((group / C.GROUP_MANIFEST).read_text())
        assert manifest["kind"] == "group"
        assert manifest["world_size"] == 2
        assert manifest["step"] == step
        want_files = {p.name: r for r in (0, 1) for p in _shard_files(group, r)}
        assert {name: info["rank"] for name, info in manifest["files"].items()} == want_files
        for name, info in manifest["files"].items():
            path = group / name
            assert info["size"] == path.stat().st_size
            inner = read_file_manifest(str(path))
            assert info["checksum"] == inner["checksum"]["value"]
            assert inner["group"] == group.name
            assert inner["rank"] == info["rank"]
        for r in (0, 1):
            model, optim = _shard_files(group, r)
            _assert_loads(model, W.expected_model(r, step))  # not the values mutated after save()
            _assert_loads(optim, W.expected_optim(r, step))
    for r in (0, 1):
        res = torchrun_run.results[r]
        assert (res["ck_rank"], res["ck_world_size"]) == (r, 2)  # taken from torch.distributed
        assert res["a"]["groups"] == [str(parent / f"global_step{s}") for s in W.STEPS]
    assert tmp_files(parent) == []


def test_torchrun_exits_cleanly(torchrun_run: Run) -> None:
    assert "Traceback" not in torchrun_run.output
    for r in (0, 1):
        with pytest.raises(ProcessLookupError):
            os.kill(torchrun_run.results[r]["pid"], 0)
    assert torchrun_run.results[0]["fastckpt_threads_after_close"] == []


def test_no_collectives_on_background_threads(torchrun_run: Run, sigkill_run: Run) -> None:
    for run in (torchrun_run, sigkill_run):
        for r in (0, 1):
            res = run.results[r]
            # the spy works: it saw the control collectives made from a helper thread ...
            assert ["spy-control", "distributed_c10d.all_reduce"] in res["spy_control"]
            assert ["spy-control", "ProcessGroup.barrier"] in res["spy_control"]
            # ... and fastckpt's threads made none, while the main thread ran all_reduce
            assert res["bg_collectives"] == []


# --------------------------------------------------------------------------- (c)
def test_rank_that_saved_nothing_still_completes_the_group(torchrun_run: Run) -> None:
    parent = torchrun_run.root / "c"
    assert fastckpt.latest(str(parent)) == str(parent / "global_step2")
    assert (parent / C.LATEST).read_text() == "global_step2"
    for step, saver in ((1, 0), (2, 1)):
        group = parent / f"global_step{step}"
        manifest = json.loads((group / C.GROUP_MANIFEST).read_text())
        assert manifest["world_size"] == 2
        ranks = {n: i["rank"] for n, i in manifest["files"].items()}
        assert ranks == {p.name: saver for p in _shard_files(group, saver)}
        assert manifest["ranks"] == [0, 1]  # both committed, the silent rank with no files
        model, optim = _shard_files(group, saver)
        _assert_loads(model, W.expected_model(saver, step))
        _assert_loads(optim, W.expected_optim(saver, step))
        for r in (0, 1):
            assert torchrun_run.results[r]["c"][str(step)]["saved_nothing"] == (r != saver)


# --------------------------------------------------------------------------- (r)
def test_a_commit_made_again_on_one_rank_never_publishes_a_mix(torchrun_run: Run) -> None:
    # Before: rank 1's second commit of step 1 joined rank 0's commit of step 2 (published without
    # r1.pt), and its commit of step 2 rank 0's of step 3 (r1.pt of step 2 published as step 3), and
    # so on: rank 1 stayed a commit ahead for the rest of the run.
    res = {r: torchrun_run.results[r]["r"] for r in (0, 1)}
    for r in (0, 1):
        for out in res[r]:
            if "error" not in out:  # every publication holds one save
                assert set(out["files"].values()) == {out["published"]} == {out["step"]}, res
    steps = "step=2 on ranks [0]; step=1 on ranks [1]"
    assert "ConfigError: checkpoint group" in res[0][1]["error"] and steps in res[0][1]["error"], res
    assert steps in res[1][1]["error"], res  # rank 1's second commit of step 1
    assert "with no attempt begun" in res[1][2]["error"], res  # its step 2, which rank 0's refused
    for r, first in ((0, 2), (1, 3)):  # steps 3-5 pair again; 6 and 7 with rank 1 saving nothing
        assert [(o["step"], o["files"]) for o in res[r][first:]] == \
            [(s, {"r0.pt": s, "r1.pt": s}) for s in (3, 4, 5)] + [(s, {"r0.pt": s}) for s in (6, 7)], res


# --------------------------------------------------------------------------- (b)
def _check_dead_rank(run: Run, how: str) -> None:
    parent = run.root / "b"
    g1, g2 = parent / "global_step1", parent / "global_step2"
    res = run.results[0]["b"]
    assert run.results[1]["b"] == {"died": how}
    assert res["error"] == "CommitTimeoutError"
    assert "ranks [1] of 2" in res["message"]
    assert TIMEOUT_S - 0.5 <= res["elapsed_s"] <= TIMEOUT_S + 5.0
    assert not (g2 / C.GROUP_MANIFEST).exists()
    assert sorted(C.read_markers(place(str(g2)))) == [0]
    assert [r for r in range(2) if r not in C.read_markers(place(str(g2)))] == [1]
    assert fastckpt.latest(str(parent)) == str(g1)
    assert (parent / C.LATEST).read_text() == g1.name
    for r in (0, 1):
        for path in _shard_files(g2, r):
            assert path.exists()  # durable, but the group never completed
            with pytest.raises(fastckpt.IncompleteCheckpointError, match=r"ranks \[1\] of 2"):
                fastckpt.load(str(path))
        model, optim = _shard_files(g1, r)
        _assert_loads(model, W.expected_model(r, 1))
        _assert_loads(optim, W.expected_optim(r, 1))
    assert tmp_files(parent) == []


def test_rank_exits_before_commit_times_out_rank0(torchrun_run: Run) -> None:
    _check_dead_rank(torchrun_run, "exit")


def test_sigkilled_rank_times_out_rank0(sigkill_run: Run) -> None:
    _check_dead_rank(sigkill_run, "kill")
