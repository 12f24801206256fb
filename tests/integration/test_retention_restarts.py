"""keep_local bounds the burst buffer across restarts: a restarted job trims what earlier runs
left there, and never a copy that did not reach its durable home.

Each "run" is a Checkpointer that is closed (or a process that is SIGKILLed) before the next
one is made on the same local_dir and destination; the retention of the next run must count
what the earlier ones left.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.storage.s3_options import store_tag
from fastckpt.urls import mirror_path
from tests.integration._fork_server import ForkServer


def _state(step: int) -> dict:
    return {"w": torch.full((1024,), step, dtype=torch.int32), "step": step}


def _run(nvme: Path, dest: Path, steps: range, keep_local: int = 2, rank: int = 0, world: int = 1) -> None:
    with fastckpt.Checkpointer(local_dir=str(nvme), keep_local=keep_local, rank=rank, world_size=world,
                                 overhead_budget=0.99) as ck:
        for i in steps:
            ck.save(_state(i), str(dest / f"c{i}-r{rank}.pt")).wait()


def _local(nvme: Path, dest: Path) -> list[str]:
    mirror = mirror_path(str(nvme), str(dest))
    return sorted(n for n in os.listdir(mirror) if not n.startswith(".") and n != "latest")


def test_a_restarted_run_trims_what_earlier_runs_left(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    _run(nvme, dest, range(0, 3))
    with caplog.at_level("INFO", logger="fastckpt"):
        _run(nvme, dest, range(3, 5))  # each run alone keeps 2: together they left 4 before this change
    assert f"keep_local=2 also counts 2 burst-buffer copies that earlier runs left beside {dest}/c3-r0.pt" \
        in caplog.text
    _run(nvme, dest, range(5, 6))
    assert _local(nvme, dest) == ["c4-r0.pt", "c5-r0.pt"]
    assert sorted(os.listdir(dest)) == [f"c{i}-r0.pt" for i in range(6)]  # the durable home keeps every one


def test_a_copy_that_never_reached_its_home_is_kept(tmp_path: Path) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    _run(nvme, dest, range(0, 3))
    os.remove(dest / "c1-r0.pt")  # as if the job died before replicating it: the local copy is the only one
    (dest / "c2-r0.pt").write_bytes((dest / "c0-r0.pt").read_bytes())  # home holds another save of c2
    _run(nvme, dest, range(3, 5), keep_local=1)
    assert _local(nvme, dest) == ["c1-r0.pt", "c2-r0.pt", "c4-r0.pt"]


def test_another_ranks_files_are_its_own_to_trim(tmp_path: Path) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    _run(nvme, dest, range(0, 2), keep_local=1, rank=1, world=2)
    _run(nvme, dest, range(0, 3), keep_local=1, rank=0, world=2)
    assert _local(nvme, dest) == ["c1-r1.pt", "c2-r0.pt"]


def test_a_restarted_group_job_trims_the_groups_earlier_runs_published(tmp_path: Path) -> None:
    nvme, root = tmp_path / "nvme", tmp_path / "ckpt"

    def run(steps: range) -> None:
        cks = [fastckpt.Checkpointer(local_dir=str(nvme), rank=r, world_size=2, keep_local=1, commit_timeout_s=60,
                                     overhead_budget=0.99)
               for r in range(2)]
        try:
            for step in steps:
                group = str(root / f"global_step{step}")
                for r, ck in enumerate(cks):
                    ck.save(_state(step), f"{group}/rank{r}.pt", group=group)
                for h in [ck.commit(group, step=step) for ck in cks]:
                    h.wait()
        finally:
            for ck in cks:
                ck.close()

    run(range(0, 2))
    (root / "global_step9").mkdir()  # an attempt that never published: its local copy stays
    local9 = Path(mirror_path(str(nvme), str(root / "global_step9")))
    local9.mkdir(parents=True)
    (local9 / "rank0.pt").write_bytes(b"partial")
    run(range(2, 4))
    assert _local(nvme, root) == ["global_step3", "global_step9"]
    assert fastckpt.latest(str(root)) == str(root / "global_step3")
    run(range(2, 3))  # resumed from step 1: step 3 is a later tag this run may save again, so it stays
    assert _local(nvme, root) == ["global_step2", "global_step3", "global_step9"]


def test_a_restarted_group_job_removes_its_files_of_groups_earlier_runs_left_unpublished(tmp_path: Path) -> None:
    """An earlier run saved steps 2 and 5 on both ranks but never committed them (killed first).
    They can never load. The next run, resumed from step 1, saves steps 3 and 4: each rank
    removes its own files of step 2, below them, and the directory goes with the last one; step
    5, a tag this run may save again, stays."""
    nvme, root = tmp_path / "nvme", tmp_path / "ckpt"

    def run(steps: range, commit: bool = True, keep_local: int | None = 1) -> None:
        cks = [fastckpt.Checkpointer(local_dir=str(nvme), rank=r, world_size=2, keep_local=keep_local,
                                     commit_timeout_s=60, overhead_budget=0.99) for r in range(2)]
        try:
            for step in steps:
                group = str(root / f"global_step{step}")
                for r, ck in enumerate(cks):
                    ck.save(_state(step), f"{group}/rank{r}.pt", group=group).wait()
                for h in [ck.commit(group) for ck in cks] if commit else []:
                    h.wait()
        finally:
            for ck in cks:
                ck.close()

    run(range(0, 2), keep_local=None)
    run(range(2, 6, 3), commit=False, keep_local=None)
    assert _local(nvme, root) == ["global_step0", "global_step1", "global_step2", "global_step5"]
    run(range(3, 5))
    assert _local(nvme, root) == ["global_step4", "global_step5"]
    assert sorted(os.listdir(Path(mirror_path(str(nvme), str(root / "global_step5"))))) == ["rank0.pt", "rank1.pt"]
    assert fastckpt.latest(str(root)) == str(root / "global_step4")


def _group_run(nvme: Path, root: Path, steps: range, keep_local: int | None = 1, commit: bool = True,
               first: str | None = None) -> None:
    """One single-process run saving the groups ``root/global_step<N>`` (committed, or not), after
    the single file ``root/<first>`` when given."""
    with fastckpt.Checkpointer(local_dir=str(nvme), keep_local=keep_local, overhead_budget=0.99) as ck:
        if first is not None:
            ck.save({"cfg": 1}, str(root / first)).wait()
        for step in steps:
            group = str(root / f"global_step{step}")
            ck.save(_state(step), f"{group}/rank0.pt", group=group).wait()
            if commit:
                ck.commit(group, step=step).wait()


def test_a_single_file_in_a_numbered_directory_is_never_taken_for_an_unpublished_group(tmp_path: Path) -> None:
    """``ep3/model.pt`` is a single file in a numbered directory; its upload never ended (the job
    was killed), so its burst-buffer copy is the only copy of that save. The next run's first
    group removes this rank's files of the group left unpublished at step 2, never that file."""
    nvme, root = tmp_path / "nvme", tmp_path / "ckpt"
    single = root / "ep3" / "model.pt"
    with fastckpt.Checkpointer(local_dir=str(nvme), overhead_budget=0.99) as ck:
        ck.save(_state(3), str(single)).wait()
    _group_run(nvme, root, range(2, 3), keep_local=None, commit=False)
    os.remove(single)  # as if the job died while uploading it
    _group_run(nvme, root, range(5, 6), keep_local=2)
    assert _local(nvme, root) == ["ep3", "global_step5"]
    assert os.listdir(mirror_path(str(nvme), str(root / "ep3"))) == ["model.pt"]


def test_a_single_file_durable_first_in_a_directory_leaves_its_groups_counted(tmp_path: Path) -> None:
    """A run whose first durable checkpoint in the directory is a single file (no step to count
    groups below) still counts the groups earlier runs left, at its first durable group."""
    nvme, root = tmp_path / "nvme", tmp_path / "ckpt"
    for steps in (range(1, 3), range(3, 5), range(5, 7)):
        _group_run(nvme, root, steps, first="run_config.pt")
    assert [n for n in _local(nvme, root) if n.startswith("global_step")] == ["global_step6"]


_KILLED_RUN = """
import os, signal, sys, torch, fastckpt
nvme, dest = sys.argv[1], sys.argv[2]
ck = fastckpt.Checkpointer(local_dir=nvme, keep_local=2)
for i in range(3):
    ck.save({"w": torch.full((1024,), i, dtype=torch.int32), "step": i}, f"{dest}/c{i}-r0.pt").wait()
ck.save({"w": torch.zeros(1 << 20), "step": 3}, f"{dest}/c3-r0.pt")  # in flight when the kill comes
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_killed_with_sigkill_is_trimmed_by_the_next(torch_python: ForkServer, tmp_path: Path) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    proc = torch_python.run_code(_KILLED_RUN, [str(nvme), str(dest)], 120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    _run(nvme, dest, range(10, 12))
    left = _local(nvme, dest)
    assert left[-2:] == ["c10-r0.pt", "c11-r0.pt"]
    assert not {"c0-r0.pt", "c1-r0.pt", "c2-r0.pt"} & set(left)
    for name in left:  # whatever the killed save left locally is only kept if it is not safe at home
        assert name in ("c10-r0.pt", "c11-r0.pt", "c3-r0.pt")
    assert fastckpt.load(str(dest / "c11-r0.pt"))["step"] == 11


def test_a_restarted_run_trims_copies_replicated_to_s3(s3_server, s3_bucket, tmp_path: Path) -> None:
    opts, nvme, url = s3_server.storage_options(), tmp_path / "nvme", f"s3://{s3_bucket}/run8"
    for steps in (range(0, 3), range(3, 4)):
        with fastckpt.Checkpointer(local_dir=str(nvme), keep_local=1, storage_options=opts, overhead_budget=0.99) as ck:
            for i in steps:
                ck.save(_state(i), f"{url}/c{i}.pt").wait()
    mirror = mirror_path(str(nvme), url, store_tag(url, opts))
    assert sorted(n for n in os.listdir(mirror) if not n.startswith(".")) == ["c3.pt"]
    assert fastckpt.load(f"{url}/c0.pt", storage_options=opts)["step"] == 0  # the bucket keeps every one


_KILLED_STEP_RUN = """
import json, os, signal, sys, torch, fastckpt
cfg = json.loads(sys.argv[1])
ck = fastckpt.Checkpointer(local_dir=cfg["nvme"], storage_options=cfg["opts"], keep_local=1, overhead_budget=0.99)
for step in cfg["steps"]:
    ck.save({"w": torch.full((1024,), step, dtype=torch.int32), "step": step},
            f"{cfg['url']}/step-{step}/state.pt").wait()
os.kill(os.getpid(), signal.SIGKILL)  # the job dies (preemption); the burst buffer stays
"""


@pytest.mark.parametrize("home", ["verified", "lost"])
def test_a_restarted_run_trims_single_files_earlier_runs_left_in_step_folders(torch_python: ForkServer, s3_server,
                                                                              s3_bucket, tmp_path: Path,
                                                                              home: str) -> None:
    """The README's layout, ``run7/step-N/state.pt``, one file per step folder, SIGKILLed runs:
    the restarted run's keep_local=1 counts the earlier run's copy in ``step-3`` (before, only
    copies in the saved file's own folder counted, so each restart left keep_local more), never
    one whose home does not hold its save."""
    opts, nvme, url = s3_server.storage_options(), tmp_path / "nvme", f"s3://{s3_bucket}/run7"
    for steps in ([1, 2, 3], [4, 5]):
        cfg = {"nvme": str(nvme), "opts": opts, "url": url, "steps": steps}
        proc = torch_python.run_code(_KILLED_STEP_RUN, [json.dumps(cfg)], 300)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        if home == "lost" and steps == [1, 2, 3]:  # as if the job died before step-3 reached its home
            s3_server.client().delete_object(Bucket=s3_bucket, Key="run7/step-3/state.pt")
    mirror = mirror_path(str(nvme), url, store_tag(url, opts))
    left = sorted(os.path.relpath(os.path.join(d, f), mirror) for d, _, fs in os.walk(mirror) for f in fs
                  if not f.startswith("."))
    assert left == (["step-5/state.pt"] if home == "verified" else ["step-3/state.pt", "step-5/state.pt"])
    assert fastckpt.load(f"{url}/step-5/state.pt", storage_options=opts)["step"] == 5


def test_earlier_step_folders_are_looked_at_once_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each save of run/step-N/state.pt goes to a new folder: the scan of the earlier step folders
    (and its read of each earlier file's home) ran at every save and was thrown away but once, a
    cost that grew with the square of the saves (a HEAD and a ranged GET each at an S3 home)."""
    import fastckpt.save.retention as retention

    scans: list[int] = []
    real = retention.earlier_steps
    monkeypatch.setattr(retention, "earlier_steps", lambda *a: scans.append(1) or real(*a))
    home = tmp_path / "home" / "run7"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), keep_local=20, overhead_budget=0.99) as ck:
        for step in range(1, 9):
            ck.save({"w": torch.full((64,), float(step))}, f"{home}/step-{step}/state.pt").wait()
    assert len(scans) == 1
