"""The Megatron strategies on real megatron-core, real processes (gloo) and real files.

One 2-rank run (``_megatron_worker.py save``) saves synchronously, asynchronously through
megatron's AsyncCallsQueue and through ``execute_sync``, loads with the same and with another
layout, and fails a save on one rank; one 1-rank run loads the same checkpoints whole and
provokes the load errors. The tests below check what each run reported. The ranks are forked
by the session's ``megatron_python`` server (tests/integration/conftest.py), with torchrun's
environment: started by torchrun, the three runs spent about half of their 30 s importing torch
and megatron-core in the agent and each rank. torchrun runs megatron-core ranks in
test_megatron_example.py (and the GPU test, through ``run_worker``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import fastckpt  # noqa: E402
from fastckpt.integrations import megatron as fm  # noqa: E402
from tests.integration._fork_server import ForkServer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_megatron_worker.py")
_RUN_MAIN = "from tests.integration._megatron_worker import main; main()"  # as ``python WORKER ARGV...``
RUN_TIMEOUT_S = 240
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(scenario: str, d: str, out: str, nproc: int) -> list[dict]:
    """Run the worker on ``nproc`` ranks under torchrun and return each rank's report."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           WORKER, scenario, d, out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return reports(out, nproc, f"exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def fork_worker(server: ForkServer, scenario: str, d: str, out: str, nproc: int) -> list[dict]:
    """``run_worker``, each rank forked by ``server`` with the environment torchrun gives it."""
    port, pids = str(free_port()), []
    for rank in range(nproc):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}
        pids.append(server.start([scenario, d, out], env, f"{out}.stdout{rank}", f"{out}.stderr{rank}",
                                 code=_RUN_MAIN))
    codes = [server.wait(pid, RUN_TIMEOUT_S) for pid in pids]
    stderr = "\n".join(f"--- rank {r}:\n{Path(f'{out}.stderr{r}').read_text()[-4000:]}" for r in range(nproc))
    return reports(out, nproc, f"exit codes {codes}):\n{stderr}")


def reports(out: str, nproc: int, output: str) -> list[dict]:
    """Each rank's report ``OUT.<rank>``; ``output`` (how the run ended, what it said) goes in
    the error when one is missing."""
    got = []
    for r in range(nproc):
        path = f"{out}.{r}"
        if not os.path.exists(path):
            raise AssertionError(f"rank {r} wrote no report ({output}")
        with open(path) as f:
            rep = json.load(f)
        assert "crash" not in rep, rep["crash"]
        got.append(rep)
    return got


@pytest.fixture(scope="module")
def saved(tmp_path_factory, megatron_python) -> tuple[str, list[dict]]:
    base = tmp_path_factory.mktemp("megatron")
    d = str(base / "ckpt")
    return d, fork_worker(megatron_python, "save", d, str(base / "save"), 2)


@pytest.fixture(scope="module")
def loaded(saved, tmp_path_factory, megatron_python) -> dict:
    d, _ = saved
    return fork_worker(megatron_python, "load", d, str(tmp_path_factory.mktemp("megatron-load") / "load"), 1)[0]


def test_sync_save_moves_the_tracker_after_the_commit(saved) -> None:
    _, reps = saved
    assert [r["tracker_after_sync"] for r in reps] == [1, 1]


def test_async_save_through_megatrons_async_calls_queue(saved) -> None:
    # the queue's forked child waited for the commit; the tensors changed right after the call,
    # and the checkpoint still holds the values of the call (same layout, 2 ranks)
    _, reps = saved
    for r in reps:
        assert r["finalized"] == [0]
        assert r["tracker_after_queue"] == 2
        assert r["same_layout_equal"] is True
        assert r["blocked_s_2"] < 30


def test_a_shard_saved_as_a_transposed_view_loads_in_the_layout_asked_for(saved) -> None:
    """A saved non-contiguous view (a transposed weight) asked for as a contiguous tensor came back as
    a view with the saved strides; Megatron's fully parallel load broadcasts it, which needs the
    layout asked for (as torch_dist, which loads into the caller's tensor, gives)."""
    _, reps = saved
    assert [r["contiguous_request"] for r in reps] == [[True, True]] * 2


def test_each_shard_is_written_once(saved) -> None:
    # "ln" is replicated (main replica on rank 0); "grid" is 2x2 blocks, two per rank
    _, reps = saved
    assert reps[0]["index_counts"] == {"ln": 1, "grid": 4, "big": 2, "stack": 2}


def test_async_save_finished_by_execute_sync(saved) -> None:
    _, reps = saved
    for r in reps:
        assert r["tracker_after_execute_sync"] == 3
        assert r["durable_s_3"] is not None


def test_reshard_two_ranks_along_other_axes_reads_only_what_each_needs(saved) -> None:
    # saved with "big" split by columns, loaded split by rows: each rank needs half of each
    # rank's file and reads that half plus the checksum blocks at its edges, not whole files
    _, reps = saved
    files = reps[0]["file_sizes"]
    tensor_files = files["fastckpt-rank00000.pt"] + files["fastckpt-rank00001.pt"]
    for r in reps:
        rep = r["reshard_report"]
        assert r["reshard_equal"] is True
        assert rep["files"] == 2  # the two tensor files (common.pt is checked against its recorded checksum)
        assert rep["bytes_needed"] < 0.55 * tensor_files
        assert rep["bytes_needed"] <= rep["bytes_read"] <= rep["bytes_needed"] + 4 * 16 * MiB + 2 * MiB
        assert rep["bytes_read"] < 0.9 * tensor_files


def test_a_failed_save_raises_on_every_rank_and_moves_nothing(saved) -> None:
    d, reps = saved
    rank0, rank1 = (r["failed_save"] for r in reps)
    assert rank1["type"] == "CheckpointWriteError" and "No space left on device" in rank1["message"]
    assert rank0["type"] == "CheckpointWriteError" and "failed on another rank" in rank0["message"]
    assert "iter_0000004" in rank0["message"] and "rank00001" in rank0["message"]
    assert [r["tracker_after_failure"] for r in reps] == [3, 3]
    assert fastckpt.latest(d) == os.path.join(d, "iter_0000003")
    assert fm.read_tracker(d) == 3 == fm.sync_tracker(d)


def test_a_state_one_rank_cannot_save_is_refused_on_every_rank(saved) -> None:
    # rank 1 fails before the index exchange; rank 0 must not hang in it, and nothing commits
    d, reps = saved
    rank0, rank1 = (r["refused_save"] for r in reps)
    assert rank1["type"] == "UnsupportedObjectError" and "'w'" in rank1["message"]
    assert rank0["type"] == "CheckpointWriteError" and "rank 1: UnsupportedObjectError" in rank0["message"]
    assert fastckpt.latest(d) == os.path.join(d, "iter_0000003")


@pytest.fixture(scope="module")
def failures(tmp_path_factory, megatron_python) -> tuple[str, list[dict]]:
    base = tmp_path_factory.mktemp("megatron-failures")
    d = str(base / "ckpt")
    return d, fork_worker(megatron_python, "failures", d, str(base / "failures"), 2)


def test_a_save_into_a_committed_iteration_failing_on_rank_1_leaves_it_loadable_on_every_rank(failures) -> None:
    """Only rank 0 put back the common.pt megatron had rewritten, and rank 1's own error reached
    its caller first: its load of the "intact" checkpoint failed on the torn common.pt."""
    _, reps = failures
    assert [r["resave"]["type"] for r in reps] == ["CheckpointWriteError"] * 2, reps
    assert "Input/output error" in reps[1]["resave"]["message"] and "rank 1" in reps[0]["resave"]["message"]
    assert [r["after_resave"] for r in reps] == [[1.0, "first"], [1.0, "first"]]  # before: rank 1 corrupt


def test_rank_0s_failure_after_the_index_exchange_ends_every_ranks_save_at_once(failures) -> None:
    """Rank 0 raised, and rank 1 waited commit_timeout_s (120 s here) in its commit."""
    _, reps = failures
    rank0, rank1 = (r["200"] for r in reps)
    assert rank0["type"] == "OSError" and "metadata.json" in rank0["message"]
    assert rank1["type"] == "CheckpointWriteError" and "rank 0" in rank1["message"], rank1
    assert "metadata.json" in rank1["message"] and rank1["seconds"] < 60


def test_a_tracker_that_cannot_be_written_fails_no_rank(failures) -> None:
    """The checkpoint is committed on every rank: rank 0 raised while rank 1 returned (and, in
    megatron's async queue, waited in its finalize barrier for rank 0)."""
    d, reps = failures
    assert [r["300"]["type"] for r in reps] == [None, None], reps
    assert [r["tracker"] for r in reps] == [100, 100]  # left behind, as after a kill before its write
    assert reps[0]["latest"] == os.path.join(d, "iter_0000300")
    assert [r["synced"] for r in reps] == [300, 300] and [r["after_sync"] for r in reps] == [[300.0, "new"]] * 2
    assert [r["close"] for r in reps] == [None, None]


def test_load_on_one_rank_reads_whole_tensors(loaded) -> None:
    assert loaded["full_equal_2"] is True and loaded["full_equal_3"] is True
    rep = loaded["report_3"]
    assert rep["bytes_read"] - rep["bytes_needed"] < 1 * MiB  # every byte of the files is needed


def test_a_layout_that_cannot_be_resharded_names_the_tensor_and_both_layouts(loaded) -> None:
    err = loaded["shape_error"]
    assert err["type"] == "ReshardingError" and "CheckpointingException" in err["mro"]
    assert "'w'" in err["message"] and "(64, 96)" in err["message"] and "(64, 100)" in err["message"]
    assert "[0:64, 0:48], [0:64, 48:96]" in err["message"]
    obj = loaded["object_error"]
    assert obj["type"] == "ReshardingError" and "rank_obj/shard_0_3" in obj["message"]
    assert "rank_obj/shard_0_2" in obj["message"]


def test_a_flipped_byte_raises_corrupt_checkpoint_error_naming_the_file(loaded) -> None:
    err = loaded["corrupt_error"]
    assert err["type"] == "CorruptCheckpointError"
    assert loaded["corrupt_file"] in err["message"] and "checksum block" in err["message"]


def test_a_resave_swapped_in_during_a_load_is_no_corruption_report(loaded) -> None:
    err = loaded["swapped_error"]  # without the pin: CorruptCheckpointError naming a checksum block
    assert err is not None and err["type"] == "GroupChangedError", err
    assert "saved again while this load read it" in err["message"] and "load it again" in err["message"]


def test_a_resave_swapped_in_after_megatron_read_common_pt_is_refused(loaded) -> None:
    """megatron reads common.pt before our strategy pins the group: without the common loader the
    load returned iteration 3's common state with iteration 2's tensors, and no error."""
    got = loaded["common_swapped"]
    assert got["error"] is not None and got["error"]["type"] == "GroupChangedError", got
    assert "megatron read common.pt of one save" in got["error"]["message"]
    assert "load it again" in got["error"]["message"]


def test_the_common_loader_leaves_a_torch_dist_save_over_a_fastckpt_one_to_megatron(loaded) -> None:
    """The loader took any directory with our manifest for ours: an iteration saved again with
    torch_dist (megatron saves in place; our manifest stays) failed as a rewritten common.pt."""
    got = loaded["common_cases"]
    assert got["torch_dist_error"] is None and got["torch_dist"] == [3, 3.0], got
    # sync_tracker (the patched load path) and repair_checkpoint wrote the old fastckpt save's
    # common.pt and metadata.json back over it, so iteration 3 silently loaded as step 2
    assert got["put_back"] == [], got
    # `fastckpt verify` judged it by the stale manifest: "BAD common.pt ... a killed save?"
    assert got["verify_td"]["type"] == "NotFastckpt" and "FastCkptError" in got["verify_td"]["mro"], got
    assert "was saved again by megatron's 'torch_dist' backend" in got["verify_td"]["message"], got


def test_the_common_loaders_note_lives_for_one_load(loaded) -> None:
    """load_common_state_dict's note lingered: a later load with another common loader, after a
    re-save, raised a false GroupChangedError. Under FullyParallelLoadStrategyWrapper's two calls
    (objects, then tensors) the first call used the note up and the second checked nothing."""
    got = loaded["common_cases"]
    assert got["stale_error"] is None, got
    assert got["two_calls_error"] is not None and got["two_calls_error"]["type"] == "GroupChangedError", got


def test_a_tensor_file_deleted_after_the_commit_is_named(loaded) -> None:
    err = loaded["lost_error"]  # was: a bare FileNotFoundError from os.path.getsize
    assert err["type"] == "CheckpointNotFoundError", err
    assert "fastckpt-rank00001.pt is named by the checkpoint's manifest but does not exist" in err["message"]


def test_an_uncommitted_checkpoint_is_refused(loaded) -> None:
    assert loaded["incomplete_error"]["type"] == "IncompleteCheckpointError"
