"""``fastckpt rm``: deletes what ``fastckpt ls`` lists as one checkpoint (with its burst-buffer
copies under ``--local-dir``), refuses a directory of checkpoints or a file that is none before
anything goes, and says so for a path where nothing is: local files and SeaweedFS alike."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def _names(root: str, *extra: str) -> dict[str, str]:
    return {e["name"]: e["status"] for e in json.loads(run("ls", root, "--json", *extra).stdout)["checkpoints"]}


def _save(ck: fastckpt.Checkpointer, home: str) -> None:
    for step in (1, 2):
        ck.save({"w": torch.full((256,), float(step))}, f"{home}/step-{step}.pt")
        group = f"{home}/g-{step}"
        for name in ("a.pt", "b.pt"):
            ck.save({"w": torch.full((256,), float(step))}, f"{group}/{name}", group=group)
        ck.commit(group, step=step)
    ck.wait()


def test_rm_deletes_files_and_groups_with_their_burst_buffer_copies(tmp_path: Path) -> None:
    home, bb = str(tmp_path / "home"), str(tmp_path / "nvme")
    with fastckpt.Checkpointer(local_dir=bb, overhead_budget=0.99, replicate_policy="all") as ck:
        _save(ck, home)
    Path(home, "notes.txt").write_text("not a checkpoint")
    assert set(_names(home, "--local-dir", bb).values()) == {"replicated"}

    r = run("rm", f"{home}/step-1.pt", f"{home}/g-1", "--local-dir", bb)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [f"removed {home}/step-1.pt", f"removed {home}/g-1"]
    assert _names(home, "--local-dir", bb) == {"step-2.pt": "replicated", "g-2": "replicated"}
    assert not list(Path(bb).rglob("step-1.pt")) and not list(Path(bb).rglob("g-1"))  # the node's copies went too

    for refused, why in ((home, "a directory holding 2 checkpoints"), (f"{home}/notes.txt", "it is not a checkpoint")):
        r = run("rm", f"{home}/step-2.pt", refused)  # refused before anything goes, also the PATH before it
        assert r.exit_code == 1 and why in r.stderr and "Nothing was deleted" in r.stderr, r.output
    assert sorted(p.name for p in Path(home).iterdir()) == ["g-2", "latest", "notes.txt", "step-2.pt"]

    r = run("rm", f"{home}/step-2.pt", "/")  # a root: refused unlisted
    assert r.exit_code == 1 and "the root of the file system" in r.stderr and Path(home, "step-2.pt").exists()
    r = run("rm", f"{home}/step-2.pt", f"{home}/step-9.pt")  # a typo beside a good PATH: nothing goes
    assert r.exit_code == 1 and f"{home}/step-9.pt: nothing there" in r.stderr, r.output
    assert "Nothing was deleted" in r.stderr and Path(home, "step-2.pt").exists()
    r = run("rm", f"{home}/g-2/a.pt")  # one file of a group: the group would be left damaged
    assert r.exit_code == 1 and f"it is one file of the fastckpt group, {home}/g-2" in r.stderr, r.output
    assert Path(home, "g-2", "a.pt").exists()
    r = run("rm", f"{home}/step-2.pt", "--local-dir", str(tmp_path / "nvmee"))  # mistyped: not made
    assert r.exit_code == 2 and "does not exist" in r.output and not (tmp_path / "nvmee").exists(), r.output
    r = run("rm", f"{home}/step-2.pt", "--local-dir", bb, "--local-dir", f"{bb}/.")  # a striped drive typed twice
    assert r.exit_code == 2 and "name one directory twice" in r.output and Path(home, "step-2.pt").exists(), r.output
    assert fastckpt.latest(home) == f"{home}/g-2"


def test_rm_at_a_url(s3_server, s3_bucket, tmp_path: Path) -> None:
    opts = s3_server.storage_options()
    home = f"s3://{s3_bucket}/run"
    with fastckpt.Checkpointer(storage_options=opts, overhead_budget=0.99, local_dir=str(tmp_path / "nvme"),
                               replicate_policy="all") as ck:  # each one reaches the bucket, none coalesced away
        _save(ck, home)
    so = ("--storage-options", json.dumps(opts))
    r = run("rm", f"{home}/g-1", f"{home}/step-1.pt", *so)
    assert r.exit_code == 0, r.output
    assert _names(home, *so) == {"step-2.pt": "complete", "g-2": "complete"}
    r = run("rm", home, *so)
    assert r.exit_code == 1 and "a directory holding 2 checkpoints" in r.stderr, r.output
    r = run("rm", f"{home}/g-1", *so)
    assert r.exit_code == 1 and "nothing there" in r.stderr, r.output


def test_remove_and_rm_of_a_file_alone_in_its_folder_at_a_url_leave_nothing_there(s3_server, s3_bucket,
                                                                                  tmp_path: Path) -> None:
    """A file's publication at a URL moves its folder's ``latest`` to it: removed, the file left that
    pointer behind, naming nothing (``run/step-1/latest``, a folder ``fastckpt ls`` still listed)."""
    opts = s3_server.storage_options()
    home = f"s3://{s3_bucket}/run"
    with fastckpt.Checkpointer(storage_options=opts, local_dir=str(tmp_path / "nvme")) as ck:
        for step in (1, 2, 3):
            ck.save({"w": torch.full((256,), float(step))}, f"{home}/step-{step}/state.pt")
        ck.wait()
        ck.remove(f"{home}/step-1/state.pt")
    r = run("rm", f"{home}/step-2/state.pt", "--storage-options", json.dumps(opts))
    assert r.exit_code == 0, r.output
    keys = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="run/").get("Contents", [])
    names = ("latest", "state.pt", "state.pt.fastckpt.json")
    assert sorted(o["Key"] for o in keys) == [f"run/step-3/{n}" for n in names]
    assert fastckpt.latest(home, storage_options=opts) == f"{home}/step-3/state.pt"


def test_rm_at_a_url_deletes_the_sidecar_ls_lists_of_an_object_deleted_behind_its_back(
        s3_server, s3_bucket, tmp_path: Path) -> None:
    """The object was deleted without fastckpt (`aws s3 rm`), its sidecar left: ls lists the file
    (missing), and rm of that name said "nothing there" and kept the sidecar."""
    opts = s3_server.storage_options()
    home = f"s3://{s3_bucket}/run"
    with fastckpt.Checkpointer(storage_options=opts, overhead_budget=0.99, local_dir=str(tmp_path / "nvme")) as ck:
        for step in (1, 2):
            ck.save({"w": torch.full((256,), float(step))}, f"{home}/step-{step}.pt").wait()
    s3_server.client().delete_object(Bucket=s3_bucket, Key="run/step-2.pt")
    so = ("--storage-options", json.dumps(opts))
    assert "step-2.pt" in _names(home, *so)
    r = run("rm", f"{home}/step-2.pt", *so)
    assert r.exit_code == 0 and r.stdout.splitlines() == [f"removed {home}/step-2.pt"], r.output
    left = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="run/").get("Contents", [])
    assert not [o["Key"] for o in left if o["Key"].startswith("run/step-2.pt")], left
    assert _names(home, *so) == {"step-1.pt": "complete"}


def test_rm_through_a_linked_folder_deletes_the_burst_buffer_copy_saved_through_its_target(tmp_path: Path) -> None:
    """/ckpt links to the run's folder, saved through its own name: rm /ckpt/a.pt --local-dir (and
    remove()) deleted the home file but looked for the node's copy under /ckpt only, so it stayed,
    and a load of the deleted checkpoint read it."""
    run_dir, link, bb = tmp_path / "run", tmp_path / "ckpt", str(tmp_path / "nvme")
    with fastckpt.Checkpointer(local_dir=bb) as ck:
        for name in ("a.pt", "b.pt"):
            ck.save({"w": torch.ones(8)}, str(run_dir / name)).wait()
    link.symlink_to(run_dir)
    r = run("rm", str(link / "a.pt"), "--local-dir", bb)
    assert r.exit_code == 0 and not (run_dir / "a.pt").exists(), r.output
    with fastckpt.Checkpointer(local_dir=bb) as ck:
        ck.remove(str(link / "b.pt"))
        assert not list(Path(bb).rglob("*.pt")), list(Path(bb).rglob("*.pt"))  # the node's copies went too
        for name in ("a.pt", "b.pt"):
            with pytest.raises(fastckpt.CheckpointNotFoundError):
                ck.load(str(run_dir / name))


def test_remove_through_either_spelling_forgets_the_save_and_deletes_its_copy(tmp_path: Path) -> None:
    """remove() forgot only the spelling it was given: a save tracked as real/step-2.pt removed as
    link/step-2.pt stayed counted by keep_persistent, which then deleted step-1 as well (one
    checkpoint kept of two); and a save made through the link, removed through the real path, kept
    its burst-buffer copy, from which a load through the link read the removed checkpoint."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    real, link, bb = tmp_path / "real", tmp_path / "link", str(tmp_path / "nvme")
    with fastckpt.Checkpointer(keep_persistent=2, local_dir=bb, overhead_budget=0.99) as ck:
        for s in (1, 2):
            ck.save({"w": torch.ones(8)}, str(real / f"step-{s}.pt")).wait()
        ck.remove(str(link / "step-2.pt"))
        ck.save({"w": torch.ones(8)}, str(real / "step-3.pt")).wait()
        ck.wait()
        assert sorted(os.listdir(real)) == ["step-1.pt", "step-3.pt"]  # was: ["step-3.pt"]
        ck.save({"w": torch.ones(8)}, str(link / "b.pt")).wait()
        ck.remove(str(real / "b.pt"))
        assert not [p for p in Path(bb).rglob("b.pt")], list(Path(bb).rglob("b.pt"))  # its copy went too
        with pytest.raises(fastckpt.CheckpointNotFoundError):
            ck.load(str(link / "b.pt"))


def test_remove_of_a_save_tracked_as_given_leaves_a_save_made_through_a_link_moved_since(tmp_path: Path) -> None:
    """cur -> real2 when cur/a.pt was saved, then cur -> real1 and real1/a.pt saved: a removal of
    real1/a.pt took cur/a.pt for another spelling of it (links resolved as they point now) and
    deleted real2's save's burst-buffer copy."""
    for d in ("real1", "real2"):
        (tmp_path / d).mkdir()
    cur, bb = tmp_path / "cur", str(tmp_path / "nvme")
    cur.symlink_to(tmp_path / "real2")
    with fastckpt.Checkpointer(keep_persistent=10, keep_local=10, local_dir=bb, overhead_budget=0.99) as ck:
        ck.save({"w": torch.full((8,), 2.0)}, str(cur / "a.pt")).wait()
        copies = sorted(Path(bb).rglob("a.pt"))
        cur.unlink()
        cur.symlink_to(tmp_path / "real1")  # the "current" link moves on
        ck.save({"w": torch.full((8,), 1.0)}, str(tmp_path / "real1" / "a.pt")).wait()
        ck.remove(str(tmp_path / "real1" / "a.pt"))
        assert [p for p in copies if p.exists()] == copies  # real2's save keeps its copy
    assert (tmp_path / "real2" / "a.pt").exists() and not (tmp_path / "real1" / "a.pt").exists()
