"""SIGKILL a 2-rank Megatron save loop at chosen moments of iteration 3, then check what a restart finds.

Each round starts both ranks (``_megatron_worker.py loop``, gloo; forked by ``_fork_server.py``
from one process that imported torch and megatron-core once), which save iterations 1, 2, 3
through the fastckpt strategy. A FileOps hook stops the run at one moment of iteration 3 and
says so; the test then SIGKILLs both ranks' process groups (their async children too):

- ``write``: rank 1 is writing its tensor file;
- ``manifest``: every rank's files are durable, rank 0 is about to publish the manifest;
- ``tracker``: the manifest is published, rank 0 is about to move Megatron-LM's tracker.

Afterwards the tracker never names an incomplete iteration, fastckpt's ``latest`` names the
newest complete one, and ``sync_tracker`` (what the patched Megatron-LM load path runs first)
makes them agree; that iteration loads with exactly its step's values. Only in ``tracker`` does
the raw tracker lag ``latest`` by one: the kill fell between the two renames.

Saving into an iteration that is already committed (``_megatron_worker.py resave``, 1 rank):
megatron-core rewrites its ``common.pt`` in place before our strategy runs. A save that fails
leaves the committed iteration loadable; one that is SIGKILLed leaves it for ``sync_tracker``
to put back (a load before that is refused, naming the fix).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.integration._fork_server import ForkServer  # noqa: E402
from tests.integration.test_megatron import RUN_TIMEOUT_S, free_port, reports  # noqa: E402

KILL_POINTS = ("write", "manifest", "tracker")
SMALL = {"MEGATRON_TEST_BIG": "1024,2048"}  # 8 MiB: still more than one checksum block
LINE_TIMEOUT_S = 120.0
WORKER_MODULE = "tests.integration._megatron_worker"
PRELOAD = ["megatron.core.dist_checkpointing", "fastckpt.integrations.megatron", "fastckpt.testing", "fastckpt.cli"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ForkServer]:
    """Forks every rank and one-rank run of this module's rounds from one process that imported
    torch, megatron-core and the worker once (``_fork_server.py``): started fresh, each took
    about 4 s of CPU to import them, nine times over."""
    log = str(tmp_path_factory.mktemp("megatron-forkserver") / "server.err")
    fs = ForkServer([WORKER_MODULE, *PRELOAD], dict(os.environ, **SMALL), log, LINE_TIMEOUT_S)
    try:
        yield fs
    finally:
        fs.close()


def _run_until_gate(server: ForkServer, d: str, kill_at: str, scenario: str = "loop", ranks: int = 2) -> list[str]:
    """Start the ranks, wait for the GATE line, SIGKILL everything; return the lines seen."""
    port, lines, pids = free_port(), queue.Queue(), []

    def forward(fifo: str) -> None:
        with open(fifo) as f:  # until the rank (and anything it forked) is gone
            for line in f:
                lines.put(line.strip())

    seen: list[str] = []
    try:
        for rank in range(ranks):
            env = {"RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "KILL_AT": kill_at}
            fifo = f"{d}.stdout{rank}"  # each rank's own pipe, as a Popen's stdout
            os.mkfifo(fifo)
            threading.Thread(target=forward, args=(fifo,), daemon=True).start()
            pids.append(server.start([scenario, d, d + ".out"], env, fifo, f"{d}.err{rank}", module=WORKER_MODULE))
        while not any(x.startswith("GATE") for x in seen):
            seen.append(lines.get(timeout=LINE_TIMEOUT_S))
    finally:
        for pid in pids:
            os.killpg(pid, signal.SIGKILL)  # the rank and any async child it forked
        for pid in pids:
            server.wait(pid)
    return seen


def _run_one_rank(server: ForkServer, scenario: str, d: str, out: str) -> dict:
    """``run_worker(scenario, d, out, 1)``, forked by the server."""
    pid = server.start([scenario, d, out], {"PORT": str(free_port())}, out + ".stdout", out + ".err",
                       module=WORKER_MODULE)
    code = server.wait(pid, RUN_TIMEOUT_S)
    return reports(out, 1, f"exit {code}): its stderr:\n{Path(out + '.err').read_text()[-4000:]}")[0]


@pytest.fixture(scope="module")
def killed(server, tmp_path_factory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("megatron-crash")
    dirs, seen = {}, {}
    for point in KILL_POINTS:
        dirs[point] = str(base / point)
        seen[point] = _run_until_gate(server, dirs[point], point)
    from fastckpt.integrations import megatron as fm

    raw = {point: fm.read_tracker(d) for point, d in dirs.items()}
    report = _run_one_rank(server, "verify", os.pathsep.join(dirs.values()), str(base / "verify"))
    return {point: {**report[d], "raw_before": raw[point], "seen": seen[point], "dir": d} for point, d in dirs.items()}


@pytest.mark.parametrize("point", KILL_POINTS)
def test_after_sigkill_tracker_and_latest_agree_on_the_newest_complete_iteration(killed, point) -> None:
    k = killed[point]
    assert "durable 2 rank=0" in k["seen"] and not any(x.startswith("durable 3") for x in k["seen"])
    newest = 3 if point == "tracker" else 2
    assert k["latest"] == os.path.join(k["dir"], f"iter_{newest:07d}")
    assert k["synced"] == newest
    assert k["equal"] is True
    assert k["raw_before"] == 2  # the tracker moved no further than the newest complete iteration
    if point != "tracker":
        assert k["iter3"] is not None  # the half-saved iteration is refused, never read


def test_only_a_kill_between_the_manifest_and_the_tracker_leaves_the_tracker_behind(killed) -> None:
    assert [killed[p]["raw_before"] for p in KILL_POINTS] == [2, 2, 2]
    assert [killed[p]["synced"] for p in KILL_POINTS] == [2, 2, 3]
    assert killed["manifest"]["iter3"]["type"] == "IncompleteCheckpointError"


def test_the_drills_restore_probe_restores_a_megatron_iteration(killed) -> None:
    """``fastckpt drill -- <megatron job>``'s probe loaded every file of the newest iteration with
    ``load``, megatron's metadata.json too (a framework's file: JSON), and called every intact
    iteration corrupt. It checks such a file whole against the group's checksum, as verify does."""
    d = killed["manifest"]["dir"]
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli.drill_job", "--probe", "--dir", d],
                       capture_output=True, text=True, timeout=LINE_TIMEOUT_S)
    restored = next(e for e in map(json.loads, filter(None, r.stdout.splitlines())) if e.get("ev") == "restored")
    assert r.returncode == 0 and restored["corrupt"] is False and restored["error"] is None, (restored, r.stderr)
    assert restored["path"] == os.path.join(d, "iter_0000002")


# ------------------------------------------------------------------------ saving into a committed iteration
@pytest.fixture(scope="module")
def resaved(server, tmp_path_factory) -> tuple[str, dict]:
    d = str(tmp_path_factory.mktemp("megatron-resave") / "ckpt")
    seen = _run_until_gate(server, d, "resave", "resave", ranks=1)
    return d, json.loads(next(x for x in seen if x.startswith("REPORT "))[len("REPORT "):])


def test_a_failed_save_into_a_committed_iteration_leaves_it_loadable(resaved) -> None:
    _, report = resaved
    assert report["first"] == [1.0, "first"]
    assert report["refused"]["type"] == "UnsupportedObjectError"  # in the strategy, on the training thread
    assert report["after_refused"] == [1.0, "first"]
    assert report["second"] == [3.0, "second"]  # a save that succeeds replaces it, common.pt included
    assert report["failed"]["type"] == "CheckpointWriteError" and "No space left" in report["failed"]["message"]
    assert report["after_failed"] == [3.0, "second"]
    assert report["tracker"] == 100


def test_a_killed_save_into_a_committed_iteration_is_put_back_by_sync_tracker(server, resaved) -> None:
    d, _ = resaved
    check = _run_one_rank(server, "resave_check", d, d + ".check")
    # the loader reads the committed common.pt kept in the index (it raised CorruptCheckpointError
    # naming repair_checkpoint); the file on disk is still the killed save's, which verify names
    assert check["as_left"] == [3.0, "second"]
    iteration = os.path.join(d, "iter_0000100")
    assert check["verify_as_left"] == [f"BAD {iteration}/common.pt", 1]
    assert check["verify_after_sync"] == [0]
    assert check["torn_metadata"]["type"] == "JSONDecodeError"  # megatron cannot even pick a loader
    assert check["synced"] == 100
    assert check["after_sync"] == [3.0, "second"]  # the committed save, not the killed one
    assert check["repair_again"] == []
