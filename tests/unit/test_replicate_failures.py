"""A replication that fails before its copy starts (reading the burst-buffer copy: EIO,
EACCES, a damaged manifest) is in the event log as a failed ``replicate``, as a failed copy is.

It raised from ``wait()`` but logged nothing: ``fastckpt report`` said "0 failed, 1 pending"
and exited 0, ``serve-metrics`` held the save pending for ever with no failure. The failure is
injected on the replicator's first read of the copy by a FaultyOps hook: no timing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli
from fastckpt.storage.types import TargetNotFoundError
from fastckpt.testing import FaultyOps


def _fail_first_read(local: str, how: str):  # noqa: ANN202
    """FaultyOps ``on_call``: the replicator's first open of ``local`` fails (or finds it damaged)."""
    fired: list[str] = []

    def hook(op: str, path: str) -> None:
        if op != "open" or path != local or fired or not threading.current_thread().name.startswith("fastckpt-rep"):
            return
        fired.append(path)
        if how == "damaged":  # a byte inside the manifest in the zip comment
            data = bytearray(Path(path).read_bytes())
            data[-30] ^= 0x01
            Path(path).write_bytes(bytes(data))
            return
        code = errno.EIO if how == "eio" else errno.EACCES
        raise OSError(code, os.strerror(code), path)

    return hook, fired


@pytest.mark.parametrize("how", ["eio", "eacces", "damaged"])
@pytest.mark.parametrize("grouped", [False, True])
def test_a_replication_failing_before_its_copy_is_logged_failed(tmp_path: Path, how: str, grouped: bool) -> None:
    log, nvme, home = str(tmp_path / "events.jsonl"), str(tmp_path / "bb"), str(tmp_path / "home")
    path = f"{home}/step-1/model.pt" if grouped else f"{home}/a.pt"
    hook, fired = _fail_first_read(nvme + path, how)
    with fastckpt.Checkpointer(local_dir=nvme, event_log=log, ops=FaultyOps(on_call=hook),
                               overhead_budget=0.99) as ck:
        with pytest.raises(fastckpt.errors.FastCkptError):
            if grouped:
                ck.save({"w": torch.randn(1000)}, path, group=f"{home}/step-1")
                ck.commit(f"{home}/step-1").wait(60)
            else:
                ck.save({"w": torch.randn(1000)}, path).wait(60)
    assert fired, "the injected failure never happened"
    events = [json.loads(line) for line in open(log)]
    assert [e["path"] for e in events if e["name"] == "replicate" and e.get("error")] == [path]

    res = CliRunner().invoke(cli, ["report", log, "--json", "--overhead-budget", "0.99"])
    rep = json.loads(res.stdout)
    assert (res.exit_code, rep["failed"], rep["pending"]) == (1, 1, 0), res.output
    metrics = CliRunner().invoke(cli, ["serve-metrics", "--event-log", log, "--once"]).stdout
    assert re.search(r'^fastckpt_failures_total\{error="\w+",phase="replicate",rank="0",tier="nvme"\} 1\.0$', metrics,
                     re.M), metrics
    assert 'fastckpt_pending_saves{rank="0"} 0.0' in metrics, metrics


def test_replications_close_gives_up_on_are_counted_as_failures(tmp_path: Path) -> None:
    """close() past close_timeout_s resolves a replication still queued as failed (its handle raises
    ReplicationError, its event is a failed ``replicate``), but stats().replication_failures stayed 0:
    stats and the event log disagreed on whether anything failed. The first upload is held (a
    FaultyOps hook) so that the second stays queued: no timing."""
    log, nvme, home = str(tmp_path / "events.jsonl"), str(tmp_path / "bb"), str(tmp_path / "home")
    entered, release = threading.Event(), threading.Event()

    def hold(op: str, path: str) -> None:
        if op == "open" and path == nvme + f"{home}/a.pt" and threading.current_thread().name.startswith(
                "fastckpt-rep") and not entered.is_set():
            entered.set()
            assert release.wait(60)

    b_queued = threading.Event()

    class Queued:  # b.pt's local write is done and its replication queued (close() waits for that part)
        def emit(self, e) -> None:  # noqa: ANN001
            if e.name == "queued" and e.path == f"{home}/b.pt":
                b_queued.set()

    ck = fastckpt.Checkpointer(local_dir=nvme, event_log=log, ops=FaultyOps(on_call=hold), replicate_workers=1,
                               close_timeout_s=0.5, overhead_budget=0.99, sinks=(Queued(),))
    try:
        ck.save({"w": torch.randn(1000)}, f"{home}/a.pt")
        queued = ck.save({"w": torch.randn(1000)}, f"{home}/b.pt")
        assert entered.wait(60) and b_queued.wait(60)
        with pytest.raises(fastckpt.errors.ReplicationError, match="still pending after 0.5 s"):
            ck.close()
        with pytest.raises(fastckpt.errors.ReplicationError, match="close\\(\\) stopped waiting"):
            queued.wait()
        failed = [e["path"] for e in map(json.loads, open(log)) if e["name"] == "replicate" and e.get("error")]
        assert failed == [f"{home}/b.pt"] and ck.stats().replication_failures == 1
    finally:
        release.set()


def test_a_home_folder_removed_during_the_copy_says_so_and_names_the_kept_copy(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """The home's folder removed while a copy into it runs (a cleanup job, another run's rm -rf, an automounter
    dropping the path): the copy fails saying the folder disappeared, which local copy is kept and what to do,
    not with a bare ENOENT of its temp name; and the once-per-file-system "could not set the modification time"
    warning is not spent on a file that is gone. The folder is removed by a FaultyOps hook as the copy dates its
    temp file, just before the rename: no timing."""
    nvme, home = str(tmp_path / "bb"), str(tmp_path / "home")
    path = f"{home}/run/s1.pt"
    removed: list[str] = []

    def rm_home(op: str, p: str) -> None:
        if op == "utime" and p.startswith(f"{home}/run/.fastckpt-tmp") and not removed:
            removed.append(p)
            shutil.rmtree(home)

    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=rm_home)) as ck:
            h = ck.save({"w": torch.arange(1000)}, path)
            with pytest.raises(TargetNotFoundError) as err:
                h.wait(60)
            kept = ck.local_path(path)
    assert removed, "the folder was never removed during the copy"
    msg = str(err.value)
    assert f"the destination folder {home}/run disappeared during the copy" in msg
    assert f"local copy is kept at {kept}: recreate the folder and save again, or copy {kept} there" in msg
    assert os.path.isfile(kept)
    assert not [r for r in caplog.records if "could not set the modification time" in r.getMessage()]
