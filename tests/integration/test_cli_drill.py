"""fastckpt drill for real: SIGKILLed jobs, restarts, byte-exact restores, RTO and RPO.

The CI drill: 10 trials of the built-in job with a small state through a POSIX burst buffer.
Then the lost node (--lose-local) on POSIX and on S3 (SeaweedFS), a user's own job, and a
job whose checkpoint is damaged (the drill must count it as a corrupt load and fail).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from fastckpt.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
USER_JOB = os.path.join(HERE, "_drill_user_job.py")
IDLE = [sys.executable, "-c", "import signal; signal.pause()"]  # a job that never saves: waits for the drill's SIGKILL


def drill(*args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(cli, ["drill", "--json", *args])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def builtin(tmp_path, trials: int, *args: str, home: str = "home") -> tuple[int, dict]:
    return drill("--trials", str(trials), "--state-size", "8MiB", "--every", "3", "--step-time", "20ms",
                 "--seed", "7", "--dir", str(tmp_path / home), *args)


def test_ci_drill_ten_kills_through_a_burst_buffer(tmp_path) -> None:
    code, d = builtin(tmp_path, 10, "--local-dir", str(tmp_path / "bb"))
    assert code == 0, d
    assert (d["trials"], d["run"], d["restored"], d["corrupt_loads"]) == (10, 10, 10, 0)
    assert d["passed"] and d["error"] is None and d["logs"] is None
    for key in ("rto_seconds", "rpo_steps"):
        assert set(d[key]) == {"min", "median", "max"}
        assert 0 <= d[key]["min"] <= d[key]["median"] <= d[key]["max"]
    for row in d["rows"]:
        # never older than what was durable when the job died, never newer than where it was
        assert row["durable_step"] <= row["restored_step"] <= row["killed_at_step"]
        assert row["rpo_steps"] == row["killed_at_step"] - row["restored_step"]
        assert row["hit"] and row["aimed"] in ("snapshot", "write", "commit", "replicate", "idle")
    assert sum(d["phases_hit"].values()) >= 10


def test_lost_node_restores_from_the_durable_home(tmp_path) -> None:
    # a --dir with a step-N of its own: the phases are read from the checkpoints' step-N, not
    # from the first one in the path (before: "no durable checkpoint... is it saving?")
    code, d = builtin(tmp_path, 3, "--local-dir", str(tmp_path / "bb"), "--lose-local", home="step-7/home")
    assert code == 0, d
    assert d["restored"] == 3 and d["corrupt_loads"] == 0
    assert {row["source"] for row in d["rows"]} == {"path"}  # never the wiped burst buffer


def test_lost_node_restores_from_s3(tmp_path, s3_server, s3_bucket) -> None:
    opts = json.dumps(s3_server.storage_options())
    code, d = drill("--trials", "3", "--state-size", "8MiB", "--every", "3", "--step-time", "20ms",
                    "--dir", f"s3://{s3_bucket}/drill", "--local-dir", str(tmp_path / "bb"), "--lose-local",
                    "--storage-options", opts)
    assert code == 0, d
    assert d["restored"] == 3 and d["corrupt_loads"] == 0
    assert {row["source"] for row in d["rows"]} == {"remote"}


def test_a_users_job(tmp_path) -> None:
    code, d = drill("--trials", "2", "--dir", str(tmp_path / "home"), "--local-dir", str(tmp_path / "bb"),
                    "--min-run", "8s", "--max-run", "10s", "--seed", "3", "--", sys.executable, USER_JOB)
    assert code == 0, d
    assert d["restored"] == 2 and d["corrupt_loads"] == 0
    for row in d["rows"]:
        assert row["restored_step"] % 5 == 0 and 0 <= row["rpo_steps"]
        assert row["rto_s"] > 0


def test_a_launchers_variables_reach_a_users_job_but_not_the_built_in_one(tmp_path, monkeypatch) -> None:
    """Started where a launcher exported WORLD_SIZE (a Kubeflow PyTorchJob pod, an srun step), the
    built-in job, one process, took itself for rank 0 of 2: every commit waited for a rank 1 that
    never existed, and the drill blamed --trial-timeout."""
    launcher = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in launcher.items():
        monkeypatch.setenv(k, v)
    code, d = builtin(tmp_path, 1, "--trial-timeout", "20s")
    assert code == 0 and d["restored"] == 1, d
    seen = tmp_path / "env.json"
    job = f"import json, os, signal; json.dump(dict(os.environ), open({str(seen)!r}, 'w')); signal.pause()"
    code, d = drill("--trials", "1", "--dir", str(tmp_path / "user"), "--min-run", "5s", "--max-run", "5s",
                    "--", sys.executable, "-c", job)
    assert code == 1 and d["restored"] == 0  # it saves nothing; what it was given is the point
    assert launcher.items() <= json.loads(seen.read_text()).items()
    shutil.rmtree(d["logs"])


def test_a_damaged_checkpoint_counts_as_a_corrupt_load_and_fails(tmp_path) -> None:
    import fastckpt

    home = tmp_path / "home"
    path = str(home / "step-00000001.pt")
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.arange(1 << 16), "step": 1}, path).wait()
    with open(path, "r+b") as f:  # one flipped byte in the tensor's data
        f.seek(4096 + 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    code, d = drill("--trials", "1", "--dir", str(home), "--min-run", "0.5s", "--max-run", "1s", "--", *IDLE)
    assert code == 1
    assert d["corrupt_loads"] == 1 and d["restored"] == 0
    assert "CorruptCheckpointError" in d["rows"][0]["error"]
    assert d["logs"] and os.path.isdir(d["logs"])  # kept for the post-mortem
    shutil.rmtree(d["logs"])


def test_a_jobs_plain_torch_save_checkpoint_is_not_a_corrupt_load(tmp_path) -> None:
    """A job saving with plain torch.save (each file whole, renamed into place) was counted as a
    corrupt load: the probe named the file it could not verify "loaded", and the drill counted
    every loaded-but-unverified restore as corrupt."""
    home = tmp_path / "home"
    home.mkdir()
    torch.save({"w": torch.arange(1 << 10), "step": 5}, str(home / "step-00000005.pt"))
    code, d = drill("--trials", "1", "--dir", str(home), "--min-run", "0.5s", "--max-run", "1s", "--", *IDLE)
    assert code == 1 and d["corrupt_loads"] == 0 and d["restored"] == 0
    assert "not a complete fastckpt checkpoint" in d["rows"][0]["error"]
    assert "the drill restores and verifies checkpoints fastckpt wrote" in d["rows"][0]["error"]
    shutil.rmtree(d["logs"])


def test_a_committed_group_missing_a_file_is_a_corrupt_load(tmp_path) -> None:
    """Counted as corrupt before 419c300 and not after it (which also told the user to "save through
    fastckpt", though fastckpt wrote it): a file of a committed group gone is a partial checkpoint."""
    import fastckpt

    home = tmp_path / "home"
    group = str(home / "step-00000005")
    with fastckpt.Checkpointer() as ck:
        for name in ("model.pt", "optim.pt"):
            ck.save({"w": torch.ones(8), "step": 5}, os.path.join(group, name), group=group)
        ck.commit(group).wait()
    os.remove(os.path.join(group, "optim.pt"))
    code, d = drill("--trials", "1", "--dir", str(home), "--min-run", "0.5s", "--max-run", "1s", "--", *IDLE)
    assert code == 1 and d["corrupt_loads"] == 1 and d["restored"] == 0
    assert "CheckpointNotFoundError" in d["rows"][0]["error"] and "save through fastckpt" not in d["rows"][0]["error"]
    shutil.rmtree(d["logs"])


def test_a_job_killed_before_its_first_checkpoint_is_told_to_raise_min_run(tmp_path) -> None:
    code, d = drill("--trials", "1", "--dir", str(tmp_path / "home"), "--min-run", "0.5s", "--max-run", "1s",
                    "--", *IDLE)
    assert code == 1 and d["restored"] == 0
    assert re.fullmatch(r"no complete checkpoint was found after the job ran [\d.]+ s \(it reported no step\): if "
                        r"it needs longer to start and make its first checkpoint durable, raise --min-run",
                        d["rows"][0]["error"]), d["rows"][0]["error"]
    shutil.rmtree(d["logs"])


def test_a_job_that_keeps_stepping_but_never_saves_stops_at_the_trial_timeout(tmp_path) -> None:
    """The built-in job printing its steps held the drill past --trial-timeout (each wait for a
    line restarted it), and the error then said the job "said nothing for 0 s"."""
    # 10 s: the job must import torch and print its first steps before then, also on a busy machine
    code, d = drill("--trials", "1", "--state-size", "1MiB", "--every", "100000", "--step-time", "10ms",
                    "--trial-timeout", "10s", "--dir", str(tmp_path / "home"))
    assert code == 1 and d["error"].startswith(
        "the job did not make a checkpoint durable within --trial-timeout (10 s; it said "), d["error"]
    assert "other line(s) meanwhile): give a longer --trial-timeout" in d["error"]
    shutil.rmtree(d["logs"])


_REPORTS_ONCE = """
import os, signal, sys
if not os.path.exists(sys.argv[1]):  # the first incarnation only
    open(sys.argv[1], "w").close()
    with open(os.environ["FASTCKPT_DRILL_STEP_FILE"], "w") as f:
        f.write("9")
signal.pause()
"""


def test_a_step_reported_in_one_trial_is_not_read_in_the_next(tmp_path) -> None:
    """Before: the step file outlived its trial, so a job that had not reported a step yet was
    "killed at" the previous trial's step (a wrong RPO, or here a wrong hint)."""
    code, d = drill("--trials", "2", "--dir", str(tmp_path / "home"), "--min-run", "2s", "--max-run", "2.5s",
                    "--", sys.executable, "-c", _REPORTS_ONCE, str(tmp_path / "reported"))
    assert code == 1 and [r["killed_at_step"] for r in d["rows"]] == [9, None]
    assert "(its last step report was 9)" in d["rows"][0]["error"]
    assert "(it reported no step)" in d["rows"][1]["error"]
    shutil.rmtree(d["logs"])


@pytest.mark.parametrize("args, msg", [
    (["--dir", "{tmp}/h", "--lose-local"], "--local-dir"),
    (["--dir", "s3://bucket/x"], "URL"),
    (["--dir", "{tmp}/h", "--min-run", "9s", "--max-run", "1s"], "--min-run"),
])
def test_bad_usage_exits_2(tmp_path, args: list[str], msg: str) -> None:
    r = CliRunner().invoke(cli, ["drill", *[a.format(tmp=tmp_path) for a in args]])
    assert r.exit_code == 2 and msg in r.output


def test_a_dir_that_is_a_file_is_a_usage_error(tmp_path) -> None:
    """Before: the drill ran, every save failed, and it ended in a traceback."""
    (tmp_path / "f").write_text("not a directory")
    r = CliRunner().invoke(cli, ["drill", "--dir", str(tmp_path / "f")])
    assert r.exit_code == 2 and f"--dir {tmp_path / 'f'} is a file" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_device_cuda_without_cuda_is_a_usage_error(tmp_path) -> None:
    """Before: the built-in job failed at its first tensor and the drill ended in a traceback."""
    r = CliRunner().invoke(cli, ["drill", "--dir", str(tmp_path / "h"), "--device", "cuda"])
    assert r.exit_code == 2 and "no CUDA device" in r.output
    r = CliRunner().invoke(cli, ["drill", "--dir", str(tmp_path / "h"), "--device", "tpu"])
    assert r.exit_code == 2 and "'tpu' is not one of 'cpu', 'cuda'" in r.output


# A user's job that tells the test it runs (its pid, through a FIFO the test blocks on), then
# waits for its SIGKILL with a child of its own (in its process group).
_ANNOUNCED_JOB = """
import os, signal, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
with open(sys.argv[1], "w") as fifo:
    fifo.write(str(os.getpid()))
signal.pause()
"""

# The drill in a child, with Ctrl-C as in a terminal (a shell without job control starts
# background commands with SIGINT ignored, and children inherit that).
_DRILL = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from fastckpt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _running_in_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` not yet dead (zombies are: init reaps them later)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_drill_kills_the_job_and_removes_its_logs(tmp_path, sig: int) -> None:
    fifo, tmp = str(tmp_path / "started"), tmp_path / "tmp"
    os.mkfifo(fifo)
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(filter(None, [REPO, *sys.path])))
    p = subprocess.Popen([sys.executable, "-c", _DRILL, "drill", "--dir", str(tmp_path / "home"), "--min-run", "10m",
                          "--max-run", "10m", "--", sys.executable, "-c", _ANNOUNCED_JOB, fifo],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    with open(fifo) as f:  # blocks until the job runs
        job = int(f.read())
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    left = _running_in_group(job)
    if left:  # what a failure leaves, this test removes
        os.killpg(job, signal.SIGKILL)
    assert p.returncode == 1 and "Aborted" in err and "Traceback" not in err, err
    assert left == []  # neither the job nor its child is left
    assert os.listdir(tmp) == []  # no fastckpt-drill-* log folder


# A user's job that holds a FIFO open for writing, it and a child of its own (in its process group):
# the test reads its pid there, then EOF once both are dead, with no sleep and no polling.
_HOLDING_JOB = """
import os, signal, subprocess, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], pass_fds=(fd,))
os.write(fd, str(os.getpid()).encode())
signal.pause()
"""


# A job whose child starts a session of its own (as torchrun's workers do) and holds a FIFO open for
# writing: the test reads the job's pid there, then EOF once the child is dead.
_SESSION_JOB = """
import os, signal, subprocess, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], pass_fds=(fd,), start_new_session=True)
os.write(fd, str(os.getpid()).encode())
signal.pause()
"""


@pytest.mark.parametrize("job_code", [_HOLDING_JOB, _SESSION_JOB], ids=["child-in-its-group", "child-in-own-session"])
def test_a_drill_killed_with_sigkill_takes_its_job_and_the_jobs_children(tmp_path, job_code: str) -> None:
    """The job, in a session of its own, trained on for good after the drill was SIGKILLed (the OOM
    killer, ``timeout -s KILL``): nothing tied its life to the drill's. Now its leader dies with the
    drill and the drill's guard kills the rest of its process group, and the job's children in
    sessions of their own (torchrun's workers: orphans once the leader died) by the mark in their
    environment."""
    fifo, tmp = str(tmp_path / "held"), tmp_path / "tmp"
    os.mkfifo(fifo)
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(filter(None, [REPO, *sys.path])))
    p = subprocess.Popen([sys.executable, "-c", _DRILL, "drill", "--dir", str(tmp_path / "home"), "--min-run", "10m",
                          "--max-run", "10m", "--", sys.executable, "-c", job_code, fifo],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    fd = os.open(fifo, os.O_RDONLY)  # blocks until the job opens it
    try:
        job = int(os.read(fd, 32))  # its child holds the FIFO before the pid is written
        p.kill()
        p.wait()
        readable, _, _ = select.select([fd], [], [], 60)
        gone = bool(readable) and os.read(fd, 1) == b""  # EOF: every writer, the job and its child, is dead
    finally:
        os.close(fd)
    if not gone:  # what a failure leaves, this test removes
        os.killpg(job, signal.SIGKILL)
    assert gone, "the job or its child still runs 60 s after the drill was SIGKILLed"
    assert [n[:len("fastckpt-drill-")] for n in os.listdir(tmp)] == ["fastckpt-drill-"]  # its logs: all it leaves


def test_lose_local_never_wipes_what_the_drill_did_not_write(tmp_path) -> None:
    """--lose-local wipes --local-dir before each restart: it once deleted a user's unrelated
    files there, and a home inside it."""
    bb = tmp_path / "bb"
    bb.mkdir()
    (bb / "keep.txt").write_text("not the drill's")
    for cmd in ([], ["--", sys.executable, USER_JOB]):
        r = CliRunner().invoke(cli, ["drill", "--trials", "1", "--state-size", "1MiB", "--every", "1",
                                     "--min-run", "0.1s", "--max-run", "0.1s", "--dir", str(tmp_path / "home"),
                                     "--local-dir", str(bb), "--lose-local", *cmd])
        assert r.exit_code == 2, r.output
        assert f"--local-dir {bb} already holds keep.txt" in r.output and "Traceback" not in r.output
        assert (bb / "keep.txt").read_text() == "not the drill's"
    r = CliRunner().invoke(cli, ["drill", "--dir", str(tmp_path / "bb2" / "home"), "--local-dir",
                                 str(tmp_path / "bb2"), "--lose-local"])
    assert r.exit_code == 2 and "is inside --local-dir" in r.output


def test_the_built_in_job_needs_an_empty_home(tmp_path) -> None:
    import torch

    import fastckpt

    with fastckpt.Checkpointer() as ck:
        ck.save({"x": torch.zeros(4)}, str(tmp_path / "old.pt")).wait()
    r = CliRunner().invoke(cli, ["drill", "--dir", str(tmp_path)])
    assert r.exit_code == 2 and "already holds a checkpoint" in r.output


def test_a_job_that_dies_on_restart_ends_the_drill_with_its_log(tmp_path, monkeypatch) -> None:
    from fastckpt.cli import drill_run

    real, starts = drill_run.Drill._job_argv, []

    def argv(self, events_path: str, probe: bool = False) -> list[str]:
        starts.append(probe)
        if len(starts) == 1:
            return real(self, events_path, probe)
        return [sys.executable, "-c", "import sys; print('cannot start', file=sys.stderr); sys.exit(5)"]

    monkeypatch.setattr(drill_run.Drill, "_job_argv", argv)
    code, d = builtin(tmp_path, 2)
    assert code == 1 and d["restored"] == 0
    assert "the job exited with 5" in d["error"] and "cannot start" in d["error"]
    assert os.path.isdir(d["logs"])
    shutil.rmtree(d["logs"])


def test_the_probe_restores_a_checkpoint_holding_numpy_state(tmp_path) -> None:
    """The probe loaded with weights_only=True: an intact checkpoint holding numpy's RNG state (saved
    for an exact resume, which the job's own load with weights_only=False restores) made it die
    with an UnpicklingError, and the drill blamed the job ("the job exited with 1")."""
    import numpy as np

    import fastckpt

    home = tmp_path / "home"
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.arange(1 << 12), "step": 5, "np_rng": np.random.get_state()},
                str(home / "step-00000005.pt")).wait()
    code, d = drill("--trials", "1", "--dir", str(home), "--min-run", "0.5s", "--max-run", "1s", "--", *IDLE)
    assert code == 0, d
    assert d["restored"] == 1 and d["rows"][0]["restored_step"] == 5 and d["rows"][0]["rto_s"] > 0


_SAVES_ITS_OWN_CLASS = """
import sys, torch, fastckpt
class RunState:  # defined in the job's script: pickled as __main__.RunState
    step = 5
with fastckpt.Checkpointer() as ck:
    ck.save({"w": torch.ones(8), "step": 5, "run": RunState()}, sys.argv[1]).wait()
"""


def test_a_checkpoint_the_probe_cannot_unpickle_fails_naming_the_probe_not_as_corrupt(tmp_path) -> None:
    """A class of the job's own script cannot be rebuilt in the probe's process: the trial fails
    saying so and how to fix it, not a corrupt load and not "the job exited"."""
    home = tmp_path / "home"
    subprocess.run([sys.executable, "-c", _SAVES_ITS_OWN_CLASS, str(home / "step-00000005.pt")], check=True)
    code, d = drill("--trials", "1", "--dir", str(home), "--min-run", "0.5s", "--max-run", "1s", "--", *IDLE)
    assert code == 1 and d["restored"] == 0 and d["corrupt_loads"] == 0, d
    error = d["rows"][0]["error"]
    assert error.startswith(f"the drill's restore probe could not unpickle {home / 'step-00000005.pt'} "
                            "(AttributeError: "), error
    assert "define them in a module on PYTHONPATH, not in the job's script" in error
    shutil.rmtree(d["logs"])


def test_a_probe_that_dies_is_named_not_the_users_job(tmp_path, monkeypatch) -> None:
    """The probe is the drill's own process: when it dies, the error said "the job exited"."""
    from fastckpt.cli import drill_run

    real = drill_run.Drill._job_argv

    def argv(self, events_path: str, probe: bool = False) -> list[str]:
        if not probe:
            return real(self, events_path, probe)
        return [sys.executable, "-c", "import sys; print('probe broke', file=sys.stderr); sys.exit(5)"]

    monkeypatch.setattr(drill_run.Drill, "_job_argv", argv)
    code, d = drill("--trials", "1", "--dir", str(tmp_path / "home"), "--min-run", "0.5s", "--max-run", "1s",
                    "--", *IDLE)
    assert code == 1 and d["error"].startswith("the drill's restore probe (not your job) exited with 5"), d["error"]
    assert "probe broke" in d["error"]
    shutil.rmtree(d["logs"])


def test_a_trials_kill_takes_the_jobs_children_in_sessions_of_their_own(tmp_path) -> None:
    """The drill's kill of a trial (killpg of the job's group) missed torchrun's workers, which start
    sessions of their own: they trained on beside the next incarnation and the restore probe."""
    from fastckpt.cli.drill_proc import Child

    fifo = str(tmp_path / "held")
    os.mkfifo(fifo)
    child = Child([sys.executable, "-c", _SESSION_JOB, fifo], str(tmp_path / "job.log"), json_lines=False)
    fd = os.open(fifo, os.O_RDONLY)  # blocks until the job opens it
    try:
        assert int(os.read(fd, 32)) == child.proc.pid  # its child holds the FIFO before the pid is written
        child.kill()
        readable, _, _ = select.select([fd], [], [], 60)
        gone = bool(readable) and os.read(fd, 1) == b""  # EOF: the job's child is dead too
    finally:
        os.close(fd)
    assert gone, "the job's child, in a session of its own, still runs after the trial's kill"


# a launcher that crashes after it started its worker: the worker an orphan
_LAUNCHER_DIES = _SESSION_JOB.replace("signal.pause()\n", "sys.exit(3)\n")


def test_a_trials_kill_takes_the_workers_of_a_job_whose_first_process_died(tmp_path) -> None:
    """A launcher that dies on its own (torchrun's agent OOM-killed) leaves its workers orphans,
    with no parent link back to the job: the trial's kill found none of them and they trained on
    after the drill ended. The guard kills every process that carries the child's mark."""
    from fastckpt.cli.drill_proc import Child

    fifo = str(tmp_path / "held")
    os.mkfifo(fifo)
    child = Child([sys.executable, "-c", _LAUNCHER_DIES, fifo], str(tmp_path / "job.log"), json_lines=False)
    fd = os.open(fifo, os.O_RDONLY)  # blocks until the job opens it
    try:
        assert int(os.read(fd, 32)) == child.proc.pid
        assert child.proc.wait(timeout=60) == 3  # the launcher is gone; its worker holds the FIFO
        child.kill()
        readable, _, _ = select.select([fd], [], [], 60)
        gone = bool(readable) and os.read(fd, 1) == b""  # EOF: the orphaned worker is dead too
    finally:
        os.close(fd)
    assert gone, "the orphaned worker of a job whose first process died still runs after the trial's kill"
