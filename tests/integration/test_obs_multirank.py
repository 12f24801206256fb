"""Observability with two real ranks on one node (torchrun, gloo over 127.0.0.1).

Each rank serves its metrics on ``metrics_port + LOCAL_RANK``; together the two endpoints show
no series twice (the node's storage health comes from local rank 0 only). The same run's
event logs feed ``fastckpt report``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import _obs_worker as W
from ._scrape import parse
from .test_groups import _communicate, _env, _free_port

pytest.importorskip("prometheus_client")
WORKER = str(Path(W.__file__).resolve())


@dataclass(frozen=True)
class Run:
    root: Path
    base_port: int
    ranks: dict[int, dict]


def _two_free_ports() -> int:
    for _ in range(50):
        base = _free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", base))
                b.bind(("", base + 1))
            return base
        except OSError:
            continue
    pytest.fail("no two consecutive free TCP ports")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("obs")
    base = _two_free_ports()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", WORKER, "--root", str(root),
           "--metrics-port", str(base)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=root)
    out = _communicate(proc, 180)
    assert proc.returncode == 0, out
    return Run(root, base, {r: json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)})


def test_per_rank_ports_and_no_duplicate_series(run: Run) -> None:
    for r in (0, 1):
        assert run.ranks[r]["url"] == f"http://127.0.0.1:{run.base_port + r}/metrics"
    scraped = {r: parse(run.ranks[r]["text"]) for r in (0, 1)}
    union: dict = {}
    for r, samples in scraped.items():
        for key, v in samples.items():
            assert key not in union, f"{key} is exported by both ranks"
            union[key] = v
            labels = dict(key[1])
            if "rank" in labels:
                assert labels["rank"] == str(r)
    node = {r: {n for n, _ in s if n.startswith(("fastckpt_node_", "fastckpt_filesystem_", "fastckpt_health_"))}
            for r, s in scraped.items()}
    assert node[0] and node[1] == set()  # the node's health: local rank 0 only


def test_each_rank_counts_its_own_saves(run: Run) -> None:
    from ._scrape import value

    for r in (0, 1):
        got, recs = parse(run.ranks[r]["text"]), run.ranks[r]["records"]
        lab = {"rank": str(r), "tier": "nvme"}
        assert value(got, "fastckpt_saves_total", **lab) == 3
        assert value(got, "fastckpt_saved_bytes_total", **lab) == sum(x["bytes"] for x in recs)
        assert value(got, "fastckpt_group_commit_seconds_count", **lab) == 3
        assert value(got, "fastckpt_save_blocked_seconds_sum", **lab) == pytest.approx(
            sum(x["blocked_s"] for x in recs), abs=0.03)
        assert os.path.exists(run.root / f"events-rank{r}.jsonl")


def test_report_of_both_ranks_logs(run: Run, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    logs = [str(run.root / f"events-rank{r}.jsonl") for r in (0, 1)]
    png = tmp_path / "r.png"
    res = subprocess.run([sys.executable, "-m", "fastckpt.cli", "report", *logs, "-o", str(png), "--json"],
                         capture_output=True, text=True)
    got = json.loads(res.stdout)
    assert res.returncode == (1 if got["alarms"] else 0), res.stderr
    assert [r["rank"] for r in got["ranks"]] == [0, 1]
    assert got["saves"] == 6 and got["durable"] == 6 and got["failed"] == 0
    assert got["bytes"] == sum(x["bytes"] for r in (0, 1) for x in run.ranks[r]["records"])
    assert got["group_commits"] == max(  # the groups published: each rank logs its commit of each
        sum(1 for line in Path(p).read_text().splitlines()
            if json.loads(line)["name"] == "commit" and json.loads(line)["detail"] == "group") for p in logs) == 3
    for r in (0, 1):
        stats = run.ranks[r]["stats"]
        assert got["ranks"][r]["saves"] == stats["saves"] == 3
        assert got["ranks"][r]["blocked_s"] == pytest.approx(stats["blocked_s"], abs=0.03)
    with Image.open(png) as im:
        assert im.format == "PNG"
