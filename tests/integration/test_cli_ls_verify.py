"""fastckpt ls and verify on real checkpoints: files and groups, an incomplete group, burst
buffer copies (replicated, local only), damaged, truncated and missing files, and S3."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli
from fastckpt.errors import CommitTimeoutError
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import flip_byte


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def state(step: int) -> dict:
    return {"w": torch.full((1 << 16,), float(step)), "step": step}


def save_group(ck: fastckpt.Checkpointer, group: str, step: int) -> None:
    for name in ("a.pt", "b.pt"):
        ck.save(state(step), f"{group}/{name}", group=group)
    ck.commit(group, step=step).wait()


@pytest.fixture
def home(tmp_path) -> str:
    """Two single files, a committed group (step 5), and a group whose commit never finished."""
    h = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        ck.save(state(1), f"{h}/one.pt").wait()
        ck.save(state(2), f"{h}/two.pt").wait()
        save_group(ck, f"{h}/step-5", 5)
    # rank 0 of 2: its marker is written, rank 1 never commits, so no manifest is published
    with fastckpt.Checkpointer(rank=0, world_size=2, commit_timeout_s=0.2) as ck:
        ck.save(state(9), f"{h}/step-9/a.pt", group=f"{h}/step-9")
        with pytest.raises(CommitTimeoutError):
            ck.commit(f"{h}/step-9").wait()
    return h


def test_ls_lists_complete_and_incomplete_and_latest(home: str) -> None:
    r = run("ls", home, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    got = {e["name"]: (e["kind"], e["status"], e["step"], e["files"], e["latest"]) for e in d["checkpoints"]}
    # a single file's step is the one its state records at the top level (before: none shown)
    assert got == {"one.pt": ("file", "complete", 1, 1, False), "two.pt": ("file", "complete", 2, 1, False),
                   "step-5": ("group", "complete", 5, 2, True), "step-9": ("group", "incomplete", 9, 1, False)}
    # an incomplete group is listed where its attempt falls, with its tag's step, as a complete one: it
    # was listed first, with no step or age, as if it were the oldest checkpoint
    assert [e["name"] for e in d["checkpoints"]] == ["one.pt", "two.pt", "step-5", "step-9"]
    assert all(e["age_s"] is not None for e in d["checkpoints"]), d["checkpoints"]
    assert d["latest"] == f"{home}/step-5"
    sizes = {e["name"]: e["bytes"] for e in d["checkpoints"]}
    assert sizes["step-5"] == sum(os.path.getsize(f"{home}/step-5/{n}") for n in ("a.pt", "b.pt"))
    table = run("ls", home).stdout
    assert "incomplete" in table and "<- latest" in table and "step-5" in table


def test_ls_shows_a_committed_groups_step_from_its_tag_when_the_manifest_has_none(tmp_path) -> None:
    """fastckpt's DeepSpeed engine records the tag, not the step: ls showed "-" for its tags while
    DeepSpeed's own ones (and incomplete groups) showed the step their name ends with."""
    h = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        g = f"{h}/global_step12"
        ck.save(state(12), f"{g}/mp_rank_00_model_states.pt", group=g)
        ck.commit(g, tag="global_step12").wait()
    r = run("ls", h, "--json")
    assert r.exit_code == 0, r.output
    assert [(e["name"], e["step"]) for e in json.loads(r.stdout)["checkpoints"]] == [("global_step12", 12)]


def test_ls_marks_replicated_and_local_only(tmp_path) -> None:
    home, bb = str(tmp_path / "home"), str(tmp_path / "bb")
    with fastckpt.Checkpointer(local_dir=bb) as ck:
        ck.save(state(1), f"{home}/one.pt").wait()
        ck.save(state(2), f"{home}/two.pt").wait()
        save_group(ck, f"{home}/step-3", 3)
    os.unlink(f"{home}/two.pt")  # the durable copy is gone: only the burst buffer holds it
    d = json.loads(run("ls", home, "--local-dir", bb, "--json").stdout)
    got = {e["name"]: (e["status"], e["step"]) for e in d["checkpoints"]}
    # a local-only file's step is read as a complete one's (it was always None)
    assert got == {"one.pt": ("replicated", 1), "two.pt": ("local only", 2), "step-3": ("replicated", 3)}


def test_ls_lists_a_resaved_files_unreplicated_local_copy_as_local_only(tmp_path) -> None:
    """A re-save of a fixed name (last.pt) whose upload never landed: the burst buffer holds the
    only copy of the newer save. Before, ls marked the home's older save "replicated" because a local
    file of that name existed, and hid the newer one."""
    home, bb = str(tmp_path / "home"), str(tmp_path / "bb")
    ops = FaultyOps()
    with fastckpt.Checkpointer(local_dir=bb, ops=ops) as ck:
        ck.save(state(1), f"{home}/last.pt").wait()
        ck.save(state(1), f"{home}/one.pt").wait()
        ops.inject(Fault("replace", errno.EACCES, path_startswith=home))  # the home refuses step 2's copy
        with pytest.raises(OSError, match="Permission denied"):
            ck.save(state(2), f"{home}/last.pt").wait()
    assert torch.load(ck.local_path(f"{home}/last.pt"), weights_only=True)["step"] == 2
    d = json.loads(run("ls", home, "--local-dir", bb, "--json").stdout)
    got = sorted((e["name"], e["status"], e["step"]) for e in d["checkpoints"])
    assert got == [("last.pt", "complete", 1), ("last.pt", "local only", 2), ("one.pt", "replicated", 1)]
    table = run("ls", home, "--local-dir", bb).stdout
    assert "local only" in table and "replicated" in table


def test_ls_matches_a_group_whose_files_lie_in_subfolders_with_its_local_copy(tmp_path) -> None:
    """Megatron's layout (iter_N/mp_rank_00/model_optim_rng.pt): ls keyed a local copy by each file's
    folder, so the copy was a bogus local only row 'iter_0000100/mp_rank_00' and the home's group never
    replicated. Now a copy is its files' group, each file compared by its place in the group."""
    home, bb = str(tmp_path / "home"), str(tmp_path / "bb")
    with fastckpt.Checkpointer(local_dir=bb) as ck:
        for it in (100, 200):
            g = f"{home}/iter_{it:07d}"
            for tp in (0, 1):
                ck.save(state(it), f"{g}/mp_rank_{tp:02d}/model_optim_rng.pt", group=g).wait()
            ck.commit(g, step=it).result()
    shutil.rmtree(f"{home}/iter_0000200")  # its copy is the only one left
    d = json.loads(run("ls", home, "--local-dir", bb, "--json").stdout)
    got = sorted((e["name"], e["status"], e["files"]) for e in d["checkpoints"])
    assert got == [("iter_0000100", "replicated", 2), ("iter_0000200", "local only", 2)], got
    d = json.loads(run("ls", f"{home}/iter_0000100", "--local-dir", bb, "--json").stdout)  # the group itself
    got = sorted((e["name"], e["status"]) for e in d["checkpoints"])  # was: its copy an unnamed local only row too
    assert got == [("iter_0000100", "replicated")], got


def test_ls_with_a_misspelled_local_dir_says_it_does_not_exist(home: str, tmp_path) -> None:
    """Before: a --local-dir that does not exist listed everything as complete, nothing replicated
    or local only, with exit 0: as if the burst buffer held nothing. (A file there: click's exit 2.)"""
    bb = str(tmp_path / "bbb")
    r = run("ls", home, "--local-dir", bb)
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{bb} does not exist" in said and "leave --local-dir out" in said


_KILLED_RESAVE = """
import os, signal, sys, torch, fastckpt
from fastckpt.testing import FaultyOps

def on_call(op, path):
    if op == "exchange":  # the re-save's files and manifest are written: killed at its swap
        os.kill(os.getpid(), signal.SIGKILL)
ck = fastckpt.Checkpointer(ops=FaultyOps(on_call=on_call), overhead_budget=0.99)
ck.save({"w": torch.ones(4)}, sys.argv[1] + "/a.pt", group=sys.argv[1])
ck.commit(sys.argv[1], step=1).wait()
"""


def test_ls_lists_the_directory_a_killed_re_save_left(torch_python, tmp_path) -> None:
    """A re-save of a published group killed before its swap leaves its hidden directory, a whole
    copy of the new attempt, until the next re-save of the tag: ``ls`` shows it and what it is."""
    home = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        save_group(ck, f"{home}/step-1", 1)
    proc = torch_python.run_code(_KILLED_RESAVE, [f"{home}/step-1"], 120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [left] = [n for n in os.listdir(home) if ".fastckpt-next" in n]
    d = json.loads(run("ls", home, "--json").stdout)
    assert {e["name"]: (e["status"], e["files"]) for e in d["checkpoints"]} == {
        "step-1": ("complete", 2), left: ("incomplete", 1)}
    assert "the next re-save of step-1 deletes it" in " ".join(run("ls", home).stdout.split())


def test_ls_of_an_empty_directory_exits_1(tmp_path) -> None:
    r = run("ls", str(tmp_path))  # before: an empty table and exit 1, not a word why
    assert r.exit_code == 1 and f"no complete checkpoint under {tmp_path}" in r.stderr


def test_verify_intact(home: str) -> None:
    r = run("verify", home, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["checkpoints"], d["checked"], d["bad"]) == (3, 4, [])
    assert d["incomplete"] == [f"{home}/step-9"]
    assert run("verify", f"{home}/one.pt").exit_code == 0  # a single file
    assert run("verify", f"{home}/step-5").exit_code == 0  # a group
    latest = json.loads(run("verify", home, "--latest", "--json").stdout)
    assert [f["checkpoint"] for f in latest["files"]] == [f"{home}/step-5"] * 2


def test_verify_names_each_bad_or_missing_file(home: str) -> None:
    flip_byte(f"{home}/step-5/a.pt", 4096 + 7)
    os.unlink(f"{home}/step-5/b.pt")
    flip_byte(f"{home}/two.pt", 4096 + 7)
    r = run("verify", home)
    assert r.exit_code == 1
    assert f"BAD {home}/step-5/a.pt: checksum" in r.stderr
    assert f"BAD {home}/step-5/b.pt: missing" in r.stderr
    assert f"BAD {home}/two.pt: checksum" in r.stderr
    assert f"{home}/one.pt" not in r.stderr
    assert "1 of 4 files intact" in r.stdout


@pytest.mark.parametrize("when", ["after the listing", "after its files were read"])
def test_verify_a_checkpoint_deleted_during_the_check_is_not_bad(home: str, monkeypatch, when: str) -> None:
    """A job's retention deletes old checkpoints while verify runs: deleted, not BAD (exit 0 for
    that), while a real corruption of another one is still BAD. The deletions happen at the
    moment named, through the functions verify calls."""
    import shutil

    import fastckpt.cli.verify as verify_mod

    victims = {f"{home}/step-5": lambda: shutil.rmtree(f"{home}/step-5"),
               f"{home}/one.pt": lambda: os.unlink(f"{home}/one.pt")}
    if when == "after the listing":
        listed = verify_mod.list_checkpoints

        def listing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = listed(*args, **kwargs)
            for delete in victims.values():
                delete()
            return out
        monkeypatch.setattr(verify_mod, "list_checkpoints", listing)
    else:
        files_of = verify_mod.checkpoint_files

        def files(h, path: str):  # noqa: ANN001, ANN202
            out = files_of(h, path)
            if path in victims:
                victims.pop(path)()
            return out
        monkeypatch.setattr(verify_mod, "checkpoint_files", files)
    r = run("verify", home, "--json")
    d = json.loads(r.stdout)
    assert r.exit_code == 0, r.output
    assert sorted(d["deleted"]) == [f"{home}/one.pt", f"{home}/step-5"]
    assert (d["bad"], d["checked"]) == ([], 1)  # two.pt


@pytest.mark.parametrize("how", ["between its manifest and its bytes", "each time it is read"])
def test_verify_and_latest_of_a_checkpoint_saved_again_during_the_check_never_say_bad(
        home: str, monkeypatch, how: str) -> None:
    """A job saves one.pt and group step-5 again (other sizes) while verify reads them: the old
    manifest against the new bytes is no corruption (helper review D5). Saved again once, both are
    checked again and pass; saved again at every read, they are reported replaced, not BAD.
    ``fastckpt latest`` does not pass over a group whose files changed size under it either."""
    from fastckpt.storage.posix import PosixTarget

    real, resaves = PosixTarget.verify, []

    def resave(step: int) -> None:
        with fastckpt.Checkpointer() as ck:
            ck.save({"w": torch.full((1 << 12,) if step % 2 else (1 << 13,), float(step))}, f"{home}/one.pt").wait()
            save_group(ck, f"{home}/step-5", step)

    def racing(self: PosixTarget, key: str, *args: object, **kw: object) -> None:
        again = how == "each time it is read" or len(resaves) < 2
        if os.path.join(self.root, key).endswith(("one.pt", "step-5/a.pt")) and again:
            resaves.append(key)
            resave(len(resaves))
        return real(self, key, *args, **kw)

    monkeypatch.setattr(PosixTarget, "verify", racing)
    r = run("verify", home, "--json", "--jobs", "1")  # one job saving: one re-save at a time
    d = json.loads(r.stdout)
    assert d["bad"] == [] and resaves, (d["bad"], d["replaced"], d["checked"])
    if how == "each time it is read":
        assert r.exit_code == 0 and sorted(d["replaced"]) == [f"{home}/one.pt", f"{home}/step-5"], d["replaced"]
        assert "saved again during each of 3 checks" in run("verify", f"{home}/one.pt").stdout
    else:
        assert r.exit_code == 0 and d["replaced"] == [] and d["checked"] == 4, r.output
    monkeypatch.undo()
    real_size, calls = PosixTarget.size, []

    def sizing(self: PosixTarget, key: str) -> int:
        # between the group's manifest and its files' sizes
        if os.path.join(self.root, key).endswith("step-5/a.pt") and not calls:
            calls.append(key)
            with fastckpt.Checkpointer() as ck:
                ck.save({"w": torch.zeros(1 << 14)}, f"{home}/step-5/a.pt", group=f"{home}/step-5")
                ck.save({"w": torch.zeros(1 << 14)}, f"{home}/step-5/b.pt", group=f"{home}/step-5")
                ck.commit(f"{home}/step-5", step=7).wait()
        return real_size(self, key)

    monkeypatch.setattr(PosixTarget, "size", sizing)
    r = run("latest", home)
    assert r.exit_code == 0 and calls and r.stdout.strip() == f"{home}/step-5", r.output


def test_verify_of_a_group_saved_again_without_one_of_its_files_never_says_missing(home: str, monkeypatch) -> None:
    """The re-save swapped in while verify reads step-5 has a.pt and c.pt: b.pt, listed before,
    is gone, and the group is reported saved again (not checked), not BAD: missing."""
    from fastckpt.storage.posix import PosixTarget

    real, resaved = PosixTarget.verify, threading.Event()

    def racing(self: PosixTarget, key: str, *args: object, **kw: object) -> None:
        if os.path.join(self.root, key).endswith("step-5/a.pt") and not resaved.is_set():
            resaved.set()
            with fastckpt.Checkpointer() as ck:
                for name in ("a.pt", "c.pt"):
                    ck.save(state(6), f"{home}/step-5/{name}", group=f"{home}/step-5")
                ck.commit(f"{home}/step-5", step=6).wait()
        return real(self, key, *args, **kw)

    monkeypatch.setattr(PosixTarget, "verify", racing)
    r = run("verify", home, "--json", "--jobs", "1")
    d = json.loads(r.stdout)
    assert resaved.is_set() and d["bad"] == [] and d["replaced"] == [f"{home}/step-5"], r.output
    assert r.exit_code == 0


def test_verify_still_names_a_damaged_checkpoint_beside_a_deleted_one(home: str, monkeypatch) -> None:
    import fastckpt.cli.verify as verify_mod

    flip_byte(f"{home}/two.pt", 4096 + 7)
    with open(f"{home}/step-5/a.pt", "r+b") as f:
        f.truncate(os.path.getsize(f"{home}/step-5/a.pt") - 100)
    files_of = verify_mod.checkpoint_files

    def files(h, path: str):  # noqa: ANN001, ANN202
        out = files_of(h, path)
        if path == f"{home}/one.pt":
            os.unlink(path)
        return out
    monkeypatch.setattr(verify_mod, "checkpoint_files", files)
    r = run("verify", home)
    assert r.exit_code == 1
    assert f"BAD {home}/two.pt: checksum" in r.stderr and f"BAD {home}/step-5/a.pt" in r.stderr
    assert f"{home}/one.pt" not in r.stderr
    assert f"- {home}/one.pt was deleted during the check" in r.stdout


def test_verify_never_counts_a_damaged_manifest_or_checksum_as_deleted(home: str, monkeypatch) -> None:
    """On S3 the deletion check of a damaged group (a prefix: no object) said "not found", and
    the damaged checkpoint was counted as deleted during the check: exit 0. Only a file found
    missing may be; here every deletion check says "gone"."""
    import fastckpt.cli.verify as verify_mod

    monkeypatch.setattr(verify_mod, "_gone", lambda *a: True)
    (Path(home) / "step-5" / "fastckpt-manifest.json").write_text("{ not json")
    flip_byte(f"{home}/two.pt", 4096 + 7)
    r = run("verify", home)
    assert r.exit_code == 1, r.output
    assert f"BAD {home}/step-5: damaged" in r.stderr and f"BAD {home}/two.pt: checksum" in r.stderr, r.stderr


@pytest.mark.parametrize("key", ["framework_files", "megatron_files"], ids=["now", "legacy"])
def test_verify_checks_a_groups_framework_files(tmp_path, key: str) -> None:
    """A framework writes files into a group in place (megatron's common.pt) and commits their
    checksums in the manifest; verify checks them, also under the name the Megatron strategy
    gave them before (verify said a damaged legacy common.pt was fine)."""
    from fastckpt.format.checksum import checksum_bytes

    g = str(tmp_path / "iter_5")
    data = b"megatron common state" * 100
    with fastckpt.Checkpointer() as ck:
        ck.save(state(5), f"{g}/a.pt", group=g)
        Path(g, "common.pt").write_bytes(data)
        ck.commit(g, step=5, **{key: {"common.pt": checksum_bytes(data)}}).wait()
    r = run("verify", g, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["checked"] == 2, r.output
    Path(g, "common.pt").write_bytes(data[:-1] + b"!")
    r = run("verify", g)
    assert r.exit_code == 1 and f"BAD {g}/common.pt" in r.stderr, r.output


def test_verify_catches_a_truncated_group_file(home: str) -> None:
    path = f"{home}/step-5/a.pt"
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    r = run("verify", f"{home}/step-5", "--json")
    assert r.exit_code == 1
    (bad,) = json.loads(r.stdout)["bad"]
    assert bad["path"] == path


def test_ls_and_verify_of_a_directory_report_damaged_manifests(home: str) -> None:
    """A damaged manifest makes a checkpoint no candidate for ``latest``; a directory's ``ls`` and
    ``verify`` must still show it (once, they left it out and verify passed)."""
    with fastckpt.Checkpointer() as ck:
        ck.save(state(3), f"{home}/three.pt").wait()  # intact: verify once passed on it alone
    manifest = f"{home}/step-5/fastckpt-manifest.json"
    os.truncate(manifest, os.path.getsize(manifest) // 2)  # a group's manifest cut in half
    os.truncate(f"{home}/one.pt", os.path.getsize(f"{home}/one.pt") - 1)  # a single file cut short
    flip_byte(f"{home}/two.pt", os.path.getsize(f"{home}/two.pt") - 30, 0x01)  # its trailing manifest damaged
    r = run("verify", home, "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert not d["passed"]
    assert sorted(b["path"] for b in d["bad"]) == [f"{home}/one.pt", f"{home}/step-5", f"{home}/two.pt"]
    assert all(b["problem"].startswith("damaged: ") for b in d["bad"])
    assert f"BAD {home}/step-5: damaged: " in run("verify", home).stderr
    ls = json.loads(run("ls", home, "--json").stdout)
    got = {e["name"]: (e["kind"], e["status"]) for e in ls["checkpoints"]}
    assert got == {"one.pt": ("file", "damaged"), "two.pt": ("file", "damaged"), "step-5": ("group", "damaged"),
                   "step-9": ("group", "incomplete"), "three.pt": ("file", "complete")}
    assert "does not parse" in next(e["problem"] for e in ls["checkpoints"] if e["name"] == "step-5")
    assert f"- {home}/step-5 is damaged" in run("ls", home).stdout
    assert fastckpt.latest(home) == f"{home}/three.pt"  # readers still skip them


def test_a_file_cut_short_beyond_its_manifest_is_listed_damaged(home: str) -> None:
    """Cut by 400 bytes, a file loses its manifest and its zip end record: it looked like no
    checkpoint at all, and ls and verify skipped it silently (helper review D7). A complete
    zip that is no checkpoint stays out of the listing."""
    import zipfile

    os.truncate(f"{home}/one.pt", os.path.getsize(f"{home}/one.pt") - 400)
    with zipfile.ZipFile(f"{home}/data.zip", "w") as z:
        z.writestr("x.txt", "not a checkpoint")
    r = run("verify", home, "--json")
    assert r.exit_code == 1, r.output
    (bad,) = json.loads(r.stdout)["bad"]
    assert bad["path"] == f"{home}/one.pt" and "truncated" in bad["problem"], bad
    got = {e["name"]: e["status"] for e in json.loads(run("ls", home, "--json").stdout)["checkpoints"]}
    assert got["one.pt"] == "damaged" and "data.zip" not in got
    assert fastckpt.latest(home) == f"{home}/step-5"


def test_a_directory_where_a_group_file_or_manifest_should_be_is_damage(home: str) -> None:
    """A directory standing where a group's file is (or its manifest) made verify abort with a
    storage error, and load report a ReplicationError (helper review D8): it is damage to that
    checkpoint, reported per file, and the other checkpoints are still checked."""
    os.unlink(f"{home}/step-5/a.pt")
    os.mkdir(f"{home}/step-5/a.pt")
    r = run("verify", home, "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert [(b["path"], b["problem"].split(":")[0]) for b in d["bad"]] == [
        (f"{home}/step-5/a.pt", "a directory stands where this file should be")]
    assert d["checked"] == 4  # step-5/b.pt, one.pt and two.pt checked too
    manifest = f"{home}/step-5/fastckpt-manifest.json"
    os.unlink(manifest)
    os.mkdir(manifest)
    with pytest.raises(fastckpt.CorruptCheckpointError, match="is a directory, not the group's manifest"):
        fastckpt.load(f"{home}/step-5/b.pt")
    r = run("verify", f"{home}/step-5")
    assert r.exit_code == 1 and "is a directory, not the group's manifest" in r.stderr, r.output
    got = {e["name"]: (e["status"], e["problem"]) for e in json.loads(run("ls", home, "--json").stdout)["checkpoints"]}
    assert got["step-5"][0] == "damaged" and "is a directory" in got["step-5"][1], got  # not "incomplete"
    r = run("verify", home, "--json")
    assert r.exit_code == 1 and f"{home}/step-5" in [b["path"] for b in json.loads(r.stdout)["bad"]], r.output


def test_a_file_cut_through_its_zip_end_record_is_listed_damaged(tmp_path) -> None:
    """A cut that leaves the end record's signature but not the whole record: no manifest, no
    complete zip, yet not "cut short" (the signature was there), so ls and verify of the
    directory skipped the file silently. Every cut through the tail is named now."""
    from fastckpt.cli._listing import list_checkpoints

    p = tmp_path / "one.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(state(1), str(p)).wait()
    data = p.read_bytes()
    tail = len(data) - data.rfind(b"PK\x05\x06")  # the end record (22 bytes) and the manifest after it
    for cut in (1, tail - 22, tail - 10, tail - 4, tail, tail + 50):
        p.write_bytes(data[:-cut])
        assert [e.status for e in list_checkpoints(str(tmp_path))] == ["damaged"], cut
    r = run("verify", str(tmp_path), "--json")
    assert r.exit_code == 1 and [b["path"] for b in json.loads(r.stdout)["bad"]] == [str(p)]


def test_a_checkpoint_file_emptied_is_listed_damaged(tmp_path) -> None:
    """The newest checkpoint file truncated to 0 bytes: load says "empty: truncated", but ls left it
    out, `verify --latest` passed (on the older one a resume then loads without a word) and `verify
    FILE` said it is no fastckpt checkpoint. Damaged, as one cut short; an empty file without a
    checkpoint's name (a log) stays out."""
    h = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        for s in (1, 2):
            ck.save(state(s), f"{h}/step-{s}.pt").wait()
    os.utime(f"{h}/step-1.pt", (1, 1))  # older, whatever the clock's resolution
    os.truncate(f"{h}/step-2.pt", 0)
    Path(h, "train.log").touch()
    empty = f"{h}/step-2.pt is empty (0 bytes): it was truncated or never written"
    with pytest.raises(fastckpt.CorruptCheckpointError, match="is empty"):
        fastckpt.load(f"{h}/step-2.pt")
    got = {e["name"]: (e["status"], e["latest"], e["problem"])
           for e in json.loads(run("ls", h, "--json").stdout)["checkpoints"]}
    assert got == {"step-1.pt": ("complete", True, None), "step-2.pt": ("damaged", False, empty)}
    r = run("verify", h, "--latest", "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["bad"] == [{"path": f"{h}/step-2.pt", "problem": f"damaged: {empty}"}]
    r = run("verify", f"{h}/step-2.pt")
    assert r.exit_code == 1 and f"BAD {h}/step-2.pt: damaged: {empty}" in r.stderr, r.output
    assert run("latest", h).stdout.strip() == f"{h}/step-1.pt"


def test_a_checkpoint_file_cut_inside_its_first_four_bytes_is_listed_damaged(tmp_path) -> None:
    """Cut to 1-3 bytes (inside the zip's first signature, ``PK\\x03\\x04``), a checkpoint file was
    left out of ``ls`` (neither empty nor long enough to look like a zip) though load refuses it:
    damaged, as one cut later; 1-3 bytes of anything else, or of a log, stay out."""
    h = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        ck.save(state(1), f"{h}/step-1.pt").wait()
    Path(h, "train.log").write_bytes(b"PK")
    Path(h, "other.pt").write_bytes(b"ab")
    for cut in (1, 2, 3):
        Path(h, "step-2.pt").write_bytes(b"PK\x03\x04"[:cut])
        got = {e["name"]: e["status"] for e in json.loads(run("ls", h, "--json").stdout)["checkpoints"]}
        assert got == {"step-1.pt": "complete", "step-2.pt": "damaged"}, (cut, got)
        r = run("verify", f"{h}/step-2.pt")
        assert r.exit_code == 1 and "is truncated" in r.stderr, r.output


def test_verify_of_one_group_file_says_what_load_says(home: str) -> None:
    """``verify step-5/a.pt`` said ok for a file that load refuses (b.pt copied over it: whole,
    but not the file its group published there). Named alone, a group's file is judged by its
    group as a load judges it; its intact sibling stays ok."""
    g = f"{home}/step-6"
    with fastckpt.Checkpointer() as ck:
        for i, name in enumerate(("a.pt", "b.pt")):
            ck.save(state(6 + i), f"{g}/{name}", group=g)
        ck.commit(g, step=6).wait()
    with open(f"{g}/b.pt", "rb") as src, open(f"{g}/a.pt", "wb") as dst:
        dst.write(src.read())
    r = run("verify", f"{g}/a.pt")
    assert r.exit_code == 1 and "moved or copied here, over the group's own file" in r.stderr, r.output
    with pytest.raises(fastckpt.CorruptCheckpointError, match="moved or copied here"):
        fastckpt.load(f"{g}/a.pt")
    assert run("verify", f"{g}/b.pt").exit_code == 0


@pytest.mark.timeout(120)
def test_a_named_pipe_in_a_checkpoint_directory_never_blocks_a_reader(home: str) -> None:
    """A named pipe beside checkpoints made latest, ls and verify DIR block for ever: the scan
    opened it to read a manifest (helper review H7). The walk lists regular files only, and a
    pipe standing where a file or a group's manifest should be reads as empty: damage."""
    os.mkfifo(f"{home}/pipe.pt")
    assert fastckpt.latest(home) == f"{home}/step-5"
    r = run("ls", home, "--json")
    assert r.exit_code == 0 and "pipe.pt" not in r.stdout, r.output
    r = run("verify", home, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["checked"] == 4, r.output
    for kw in ({}, {"mmap": True}):
        with pytest.raises(fastckpt.CorruptCheckpointError, match="is empty"):
            fastckpt.load(f"{home}/pipe.pt", **kw)
    assert run("verify", f"{home}/pipe.pt").exit_code == 1  # named alone: not a checkpoint, and no hang
    manifest = f"{home}/step-5/fastckpt-manifest.json"
    os.unlink(manifest)
    os.mkfifo(manifest)
    with pytest.raises(fastckpt.CorruptCheckpointError, match="does not parse"):
        fastckpt.load(f"{home}/step-5/b.pt")
    assert fastckpt.latest(home) != f"{home}/step-5"


def test_verify_latest_names_a_newer_damaged_checkpoint(tmp_path) -> None:
    """``verify --latest`` checks what a resume loads; a newer checkpoint that the resume passes
    over because its manifest is damaged is BAD too (once, --latest passed on the older one)."""
    h = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        ck.save(state(1), f"{h}/one.pt").wait()
        ck.save(state(2), f"{h}/two.pt").wait()
    os.utime(f"{h}/one.pt", (1, 1))  # older, whatever the clock's resolution
    flip_byte(f"{h}/two.pt", os.path.getsize(f"{h}/two.pt") - 30, 0x01)  # its trailing manifest damaged
    r = run("verify", h, "--latest", "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert [f["path"] for f in d["files"] if f["problem"] is None] == [f"{h}/one.pt"]
    assert [b["path"] for b in d["bad"]] == [f"{h}/two.pt"] and d["bad"][0]["problem"].startswith("damaged: ")
    os.utime(f"{h}/two.pt", (0, 0))  # now older than the one a resume loads: not --latest's business
    assert run("verify", h, "--latest").exit_code == 0


def test_verify_latest_checks_the_unverified_checkpoint_latest_names(tmp_path) -> None:
    """A newer torch.save file beside fastckpt's: `fastckpt latest` names it (the higher step), and
    `verify --latest` checked the older fastckpt file instead and passed. It reports the one latest
    names, unverified (no checksum to check), and exits 1 as for any file it cannot verify. In
    --json it is under "unverified", as without --latest, not "bad" (which is damage): a script
    reading either key got it wrong (``d3_verify_latest_json_unverified_empty``)."""
    h = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        ck.save(state(200), f"{h}/step-200.pt").wait()
    torch.save(state(300), f"{h}/step-300.pt")  # ordered by step: both record one
    assert run("latest", h).stdout.strip() == f"{h}/step-300.pt"
    r = run("verify", "--latest", "--json", h)
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and not d["passed"], r.output
    assert d["unverified"] == [f"{h}/step-300.pt"] and d["bad"] == [], d
    assert [f["path"] for f in d["files"]] == [f"{h}/step-300.pt"]
    r = run("verify", "--latest", h)
    assert r.exit_code == 1 and "written by torch.save" in r.stdout and "BAD" not in r.output, r.output
    assert f"UNVERIFIED {h}/step-300.pt: written by torch.save" in r.stderr
    assert f"the newest checkpoint under {h} was written without fastckpt" in " ".join(r.stdout.split())


def test_verify_of_a_directory_of_torch_save_files_names_them_unverified(tmp_path) -> None:
    """`verify DIR` of a folder holding only a plain torch.save file said "no complete checkpoint"
    and "0 of 0 files intact", not what the file is. Each file written without fastckpt is named
    unverified (no checksum to check); with nothing verified the exit is 1, as `--latest` and
    `verify FILE` give; beside a verified fastckpt checkpoint they are named, and it decides."""
    h = str(tmp_path / "home")
    os.makedirs(h)
    torch.save(state(300), f"{h}/model.pt")
    r = run("verify", h)
    assert r.exit_code == 1, r.output
    assert f"no fastckpt checkpoint under {h} to verify: 1 written without fastckpt" in " ".join(r.stderr.split())
    assert f"UNVERIFIED {h}/model.pt: written by torch.save, not fastckpt" in r.stderr and "BAD" not in r.output
    assert "0 of 0 files intact" not in r.stdout, r.stdout  # (printed after it, and said nothing)
    d = json.loads(run("verify", "--json", h).stdout)
    assert not d["passed"] and d["unverified"] == [f"{h}/model.pt"] and d["bad"] == []
    with fastckpt.Checkpointer() as ck:
        ck.save(state(200), f"{h}/ours.pt").wait()
    r = run("verify", h)
    assert r.exit_code == 0 and "1 of 1 files intact" in r.stdout, r.output
    assert f"UNVERIFIED {h}/model.pt" in r.stderr

def test_ls_and_verify_show_names_with_square_brackets_as_written(tmp_path, monkeypatch) -> None:
    """rich read names as markup: `model[best].pt` was listed as `model.pt`, and `x[/dim].pt` (or a
    ROOT such as `exp[/x]`) crashed ls and verify with a MarkupError traceback."""
    from fastckpt.cli._common import console, table

    monkeypatch.chdir(tmp_path)  # a short ROOT: the table's title wraps a long one
    h = "exp[/x]/lr=[1e-3]"
    with fastckpt.Checkpointer() as ck:
        ck.save(state(1), f"{h}/model[best].pt").wait()
        ck.save(state(2), f"{h}/x[/dim].pt").wait()
    full = os.path.abspath(h)
    for cmd, shown in (("ls", [f"under {h}", " model[best].pt ", " x[/dim].pt "]),
                       ("verify", [f"verify {full}", f"{full}/model[best].pt ", f"{full}/x[/dim].pt "])):
        r = run(cmd, h)
        assert r.exit_code == 0 and r.exception is None, (cmd, r.output)
        assert all(s in r.stdout for s in shown), (cmd, r.stdout)
    out = console()
    with out.capture() as got:
        out.print(table("[bold]t[/]", ["a[/]"], [["[red]c[/red]"], [None]]))
    assert "[bold]t[/]" in got.get() and "[red]c[/red]" in got.get()


def test_latest_passes_over_a_group_with_a_missing_file(home: str) -> None:
    """A resume script loads what ``fastckpt latest`` prints: once, a group one of whose files
    was deleted, which failed to load instead of falling back."""
    assert run("latest", home).stdout.strip() == f"{home}/step-5"
    os.unlink(f"{home}/step-5/b.pt")
    r = run("latest", home)
    assert r.exit_code == 0 and r.stdout.strip() == f"{home}/two.pt"
    assert f"passing over {home}/step-5: {home}/step-5/b.pt missing" in r.stderr
    fastckpt.load(r.stdout.strip())
    assert json.loads(run("ls", home, "--json").stdout)["latest"] == f"{home}/two.pt"  # as latest (was: step-5)
    os.unlink(f"{home}/one.pt"), os.unlink(f"{home}/two.pt")
    r = run("latest", home)
    assert r.exit_code == 1 and r.stdout == "" and "no complete checkpoint" in r.stderr


def test_ls_names_an_older_checkpoint_with_a_file_cut_short(home: str) -> None:
    """Only the checkpoints newer than the one `latest` answers were checked for files missing
    or cut short: an older group (a rollback target) with a truncated file was listed complete,
    with no problem, and a rollback to it failed to load."""
    with fastckpt.Checkpointer() as ck:
        save_group(ck, f"{home}/step-7", 7)
    os.truncate(f"{home}/step-5/b.pt", 100)
    listed = {e["name"]: e for e in json.loads(run("ls", home, "--json").stdout)["checkpoints"]}
    assert listed["step-7"]["latest"] and listed["step-7"]["problem"] is None
    assert listed["step-5"]["problem"] == f"{home}/step-5/b.pt missing or not the committed size"
    assert listed["one.pt"]["problem"] is None and listed["two.pt"]["problem"] is None
    assert "step-5/b.pt missing or not the committed size" in " ".join(run("ls", home).stdout.split())


def test_verify_of_a_file_cut_short_says_it_is_damaged(home: str) -> None:
    """A file cut short past its manifest (a single file, or one of a group) was "not a complete
    fastckpt checkpoint ... no published manifest", while verify DIR, ls and load call it damaged."""
    os.truncate(f"{home}/one.pt", 100)
    os.truncate(f"{home}/step-5/b.pt", 100)
    r = run("verify", f"{home}/one.pt")
    assert r.exit_code == 1 and f"BAD {home}/one.pt: damaged: {home}/one.pt is truncated" in r.stderr, r.output
    r = run("verify", f"{home}/step-5/b.pt")
    assert r.exit_code == 1 and f"BAD {home}/step-5/b.pt: 100 bytes, but " in r.stderr, r.output
    assert "not a complete fastckpt checkpoint" not in r.output
    (Path(home) / "notes.txt").write_text("x")
    r = run("verify", f"{home}/notes.txt")  # no checkpoint at all: said so, as before
    assert r.exit_code == 1 and "not a complete fastckpt checkpoint" in r.stderr


def test_verify_of_a_file_that_is_no_checkpoint_looks_at_that_file_only(tmp_path) -> None:
    """`verify DIR/notes.txt` listed all of DIR, recursively, and ran latest() over it, to learn
    whether that one file was listed damaged: a full scan of a big run directory, and a warning
    about another checkpoint in it (the newest under DIR, a torch.save file in a subfolder). Now
    the file is judged alone; a damaged one still is (test_verify_of_a_file_cut_short...)."""
    os.makedirs(tmp_path / "old")
    torch.save({"w": torch.zeros(3)}, tmp_path / "old" / "legacy.pt")  # someone else's plain checkpoint
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "verify", str(tmp_path / "notes.txt")],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "not a complete fastckpt checkpoint" in out, out
    assert "legacy.pt" not in out, out


def test_verify_latest_fails_on_a_newer_group_cut_short_after_its_commit(home: str) -> None:
    """``fastckpt.latest()`` (what a resume script calls) names the newest committed group even
    when a file of it was cut short since; ``fastckpt latest`` passes over it. ``verify --latest``
    checked only the older one and exited 0: it now checks the one passed over too."""
    path = f"{home}/step-5/b.pt"
    committed = os.path.getsize(path)
    os.truncate(path, committed - 4096)
    assert fastckpt.latest(home) == f"{home}/step-5"
    r = run("verify", home, "--latest", "--json")
    assert r.exit_code == 1, r.output  # before: 0, checking two.pt alone
    d = json.loads(r.stdout)
    assert [b["path"] for b in d["bad"]] == [path]
    assert d["bad"][0]["problem"] == f"{committed - 4096} bytes, but {committed} were committed"
    assert f"{home}/two.pt" in [f["path"] for f in d["files"] if f["problem"] is None]
    entry = next(e for e in json.loads(run("ls", home, "--json").stdout)["checkpoints"] if e["name"] == "step-5")
    assert entry["status"] == "complete" and entry["problem"] == f"{path} missing or not the committed size"
    assert f"- {home}/step-5: {path} missing or not the committed size" in " ".join(run("ls", home).stdout.split())


def test_verify_with_nothing_to_check_exits_1_saying_why_on_stderr(tmp_path) -> None:
    """``verify --json EMPTY_DIR`` exited 1 with an empty stderr: a launch script's log showed no
    reason. It says what was not found and what to do, as ``ls`` does; stdout stays JSON."""
    for flags in ([], ["--json"], ["--json", "--latest"]):
        r = run("verify", str(tmp_path), *flags)
        assert r.exit_code == 1, r.output
        assert f"no fastckpt checkpoint under {tmp_path} to verify: check the path" in r.stderr, r.stderr
        assert f"`fastckpt ls {tmp_path}` lists what is there" in r.stderr
        if "--json" in flags:
            assert json.loads(r.stdout)["checked"] == 0


def test_verify_of_a_url_with_nothing_there_says_it_does_not_exist(tmp_path) -> None:
    """As of a local path that does not exist. Before: "no complete checkpoint under" the URL of
    a file, as if it were a directory holding none."""
    run_url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb")) as ck:
        ck.save(state(1), f"{run_url}/one.pt").wait()
    for missing in (f"{run_url}/missing.pt", f"{run_url}-typo"):
        r = run("verify", missing)
        assert r.exit_code == 1, r.output
        assert f"{missing} does not exist: check the URL" in r.output and "no complete checkpoint" not in r.output
    assert run("verify", f"{run_url}/one.pt").exit_code == 0


def test_ls_of_a_url_that_is_a_file_or_holds_nothing_names_the_problem(tmp_path) -> None:
    """As of a local path. Before: an empty table and exit 1 without a word, for the checkpoint
    URL `fastckpt latest` prints and for a misspelt prefix."""
    run_url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb")) as ck:
        ck.save(state(1), f"{run_url}/one.pt").wait()
    r = run("ls", f"{run_url}/one.pt")
    assert r.exit_code == 1 and r.stdout == ""
    assert f"{run_url}/one.pt is a file: `fastckpt ls` lists the checkpoints under a directory; `fastckpt verify " \
        f"{run_url}/one.pt` checks one checkpoint file" in r.stderr
    for missing in (f"{run_url}/nope", f"{run_url}-typo"):
        r = run("ls", missing, "--json")
        assert r.exit_code == 1 and r.stdout == ""
        assert f"{missing} does not exist: check the URL (no checkpoint was saved there yet)" in r.stderr
    assert run("ls", run_url).exit_code == 0


def test_ls_and_verify_at_a_url(tmp_path, s3_server, s3_bucket) -> None:
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/ckpts"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb"), storage_options=opts) as ck:
        ck.save(state(1), f"{url}/one.pt").wait()
        save_group(ck, f"{url}/step-4", 4)
    o = json.dumps(opts)
    d = json.loads(run("ls", url, "--storage-options", o, "--json").stdout)
    got = {e["name"]: (e["kind"], e["status"], e["step"]) for e in d["checkpoints"]}
    assert got == {"one.pt": ("file", "complete", 1), "step-4": ("group", "complete", 4)}
    assert sum(e["latest"] for e in d["checkpoints"]) == 1
    d = json.loads(run("ls", url, "--storage-options", o, "--local-dir", str(tmp_path / "bb"), "--json").stdout)
    assert {e["name"]: e["status"] for e in d["checkpoints"]} == {"one.pt": "replicated", "step-4": "replicated"}
    r = run("verify", url, "--storage-options", o, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["checked"] == 3
    client = s3_server.client()
    key = "ckpts/step-4/b.pt"
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[4096 + 3] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    r = run("verify", url, "--storage-options", o)
    assert r.exit_code == 1
    assert f"BAD {url}/step-4/b.pt" in r.stderr and "checksum" in r.stderr
    # the object of a published file gone, its sidecar still there (deleted outside fastckpt, which
    # deletes the sidecar first): lost, not "deleted during the check" (before: exit 0, as ls said it fails)
    client.delete_object(Bucket=s3_bucket, Key="ckpts/one.pt")
    r = run("verify", url, "--storage-options", o, "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["deleted"] == [] and {"path": f"{url}/one.pt", "problem": "missing"} in d["bad"]
    client.delete_object(Bucket=s3_bucket, Key="ckpts/one.pt.fastckpt.json")  # now it is deleted for good
    d = json.loads(run("verify", url, "--storage-options", o, "--json").stdout)
    assert f"{url}/one.pt" not in {b["path"] for b in d["bad"]}


def test_ls_at_a_url_sizes_a_groups_files_with_one_listing(tmp_path, s3_server, s3_bucket, monkeypatch) -> None:
    """ls checks every complete checkpoint's files against their committed sizes: at a URL that was
    a HEAD request per file of every checkpoint (runs of 512 ranks x 200 checkpoints: 100k). Now
    one listing per directory; a file gone or cut short is still named."""
    from fastckpt.storage.fsspec import FsspecTarget

    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/many"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb"), storage_options=opts) as ck:
        for step in (1, 2, 3):
            for name in ("a.pt", "b.pt", "c.pt", "d.pt"):
                ck.save(state(step), f"{url}/step-{step}/{name}", group=f"{url}/step-{step}")
            ck.commit(f"{url}/step-{step}", step=step).wait()
    heads = []
    real_size = FsspecTarget.size
    monkeypatch.setattr(FsspecTarget, "size", lambda self, key: heads.append(key) or real_size(self, key))
    d = json.loads(run("ls", url, "--storage-options", json.dumps(opts), "--json").stdout)
    assert [(e["name"], e["status"], e["files"]) for e in d["checkpoints"]] == [
        ("step-1", "complete", 4), ("step-2", "complete", 4), ("step-3", "complete", 4)]
    assert [k for k in heads if k.endswith(".pt")] == []  # was a request each: 16 (the newest's twice)
    client = s3_server.client()
    client.delete_object(Bucket=s3_bucket, Key="many/step-1/b.pt")
    client.put_object(Bucket=s3_bucket, Key="many/step-2/c.pt", Body=b"cut")
    d = json.loads(run("ls", url, "--storage-options", json.dumps(opts), "--json").stdout)
    problems = {e["name"]: e["problem"] for e in d["checkpoints"]}
    assert problems["step-1"] == f"{url}/step-1/b.pt missing or not the committed size"
    assert problems["step-2"] == f"{url}/step-2/c.pt missing or not the committed size"
    assert problems["step-3"] is None


def test_a_single_file_cut_short_or_grown_at_a_url_is_passed_over_and_named(tmp_path, s3_server, s3_bucket) -> None:
    """At a URL a single file's sidecar publishes it, and nothing checked its object's size: one
    cut short (or grown) under its intact sidecar was listed complete and latest with no problem,
    printed by `fastckpt latest` (its load then failed), and verify said it "has no fastckpt
    manifest". A file written before manifests carried their sum is its committed size too."""
    opts = s3_server.storage_options()
    url, o = f"s3://{s3_bucket}/run", json.dumps(opts)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb"), storage_options=opts) as ck:
        for step in (1, 2, 3):
            ck.save(state(step), f"{url}/single-{step}.pt").wait()
    assert run("verify", url, "--storage-options", o).exit_code == 0
    assert run("latest", url, "--storage-options", o).stdout.strip() == f"{url}/single-3.pt"
    client = s3_server.client()
    body = {s: client.get_object(Bucket=s3_bucket, Key=f"run/single-{s}.pt")["Body"].read() for s in (1, 2, 3)}
    m = json.loads(client.get_object(Bucket=s3_bucket, Key="run/single-1.pt.fastckpt.json")["Body"].read())
    old = json.dumps({"fastckpt": m}, separators=(",", ":"), sort_keys=True).encode()  # the comment before its sum
    client.put_object(Bucket=s3_bucket, Key="run/single-1.pt",
                      Body=body[1][: m["covered"]] + len(old).to_bytes(2, "little") + old)
    client.put_object(Bucket=s3_bucket, Key="run/single-3.pt", Body=body[3][:100000])
    client.put_object(Bucket=s3_bucket, Key="run/single-2.pt", Body=body[2] + b"grown")
    r = run("latest", url, "--storage-options", o)
    assert r.exit_code == 0 and r.stdout.strip() == f"{url}/single-1.pt", r.output
    assert f"passing over {url}/single-3.pt: {url}/single-3.pt missing or not the committed size" in r.stderr
    listed = {e["name"]: e for e in json.loads(run("ls", url, "--storage-options", o, "--json").stdout)["checkpoints"]}
    assert listed["single-1.pt"]["latest"] and listed["single-1.pt"]["problem"] is None
    for s in (2, 3):
        assert listed[f"single-{s}.pt"]["problem"] == f"{url}/single-{s}.pt missing or not the committed size"
    d = json.loads(run("verify", url, "--storage-options", o, "--json").stdout)
    assert {b["path"]: b["problem"] for b in d["bad"]} == {
        f"{url}/single-2.pt": f"{len(body[2]) + 5} bytes, but {len(body[2])} were committed",
        f"{url}/single-3.pt": f"100000 bytes, but {len(body[3])} were committed"}
    r = run("verify", f"{url}/single-3.pt", "--storage-options", o)
    assert r.exit_code == 1 and f"100000 bytes, but {len(body[3])} were committed" in r.stderr, r.output
    assert fastckpt.load(f"{url}/single-1.pt", storage_options=opts)["step"] == 1  # the one a resume loads


def test_an_object_cut_short_or_emptied_without_its_sidecar_is_damaged_for_verify_and_remove(
        tmp_path, s3_server, s3_bucket) -> None:
    """An object cut short (or emptied) with its sidecar gone: `fastckpt ls` of its prefix lists it
    damaged, as it does a local file, but `verify URL` stopped with a ConfigError ("is a file, not
    a directory") and `remove(URL)` refused the emptied one as "not a checkpoint". Both now judge
    it as the listing does; an object that is no checkpoint is still said to be none, and kept."""
    opts = s3_server.storage_options()
    url, o = f"s3://{s3_bucket}/run", json.dumps(opts)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb"), storage_options=opts) as ck:
        for step in (1, 2, 3):
            ck.save(state(step), f"{url}/step-{step}.pt").wait()
    client = s3_server.client()
    body = client.get_object(Bucket=s3_bucket, Key="run/step-2.pt")["Body"].read()
    client.put_object(Bucket=s3_bucket, Key="run/step-2.pt", Body=body[: len(body) // 2])
    client.put_object(Bucket=s3_bucket, Key="run/step-3.pt", Body=b"")
    for s in (2, 3):
        client.delete_object(Bucket=s3_bucket, Key=f"run/step-{s}.pt.fastckpt.json")
    client.put_object(Bucket=s3_bucket, Key="run/notes.txt", Body=b"not a checkpoint")
    why = {2: f"{url}/step-2.pt is truncated: it is a zip", 3: f"{url}/step-3.pt is empty (0 bytes)"}
    listed = {e["name"]: e for e in json.loads(run("ls", url, "--storage-options", o, "--json").stdout)["checkpoints"]}
    assert {n: e["status"] for n, e in listed.items()} == {"step-1.pt": "complete", "step-2.pt": "damaged",
                                                         "step-3.pt": "damaged"}
    for s in (2, 3):
        assert listed[f"step-{s}.pt"]["problem"].startswith(why[s])
        r = run("verify", f"{url}/step-{s}.pt", "--storage-options", o, "--json")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception  # before: a ConfigError
        assert [b["problem"] for b in json.loads(r.stdout)["bad"]] == [f"damaged: {listed[f'step-{s}.pt']['problem']}"]
        assert f"BAD {url}/step-{s}.pt: damaged: {why[s]}" in r.stderr, r.output
    r = run("verify", f"{url}/notes.txt", "--storage-options", o)  # no checkpoint at all: said so, as of a local file
    assert r.exit_code == 1 and f"{url}/notes.txt is not a complete fastckpt checkpoint" in r.stderr, r.output
    assert run("verify", f"{url}/step-1.pt", "--storage-options", o).exit_code == 0
    with fastckpt.Checkpointer(storage_options=opts) as ck:
        with pytest.raises(fastckpt.ConfigError, match="it is not a checkpoint: a file with no fastckpt manifest"):
            ck.remove(f"{url}/notes.txt")
        ck.remove(f"{url}/step-3.pt")  # before: ConfigError, "it is not a checkpoint"
        ck.remove(f"{url}/step-2.pt")
    keys = sorted(x["Key"] for x in client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert [k for k in keys if k != "run/latest"] == ["run/notes.txt", "run/step-1.pt", "run/step-1.pt.fastckpt.json"]


_KILLED_BEFORE_SIDECAR = """
import json, os, signal, sys, torch, fastckpt
import fastckpt.save.replicator as R

cfg = json.loads(sys.argv[1])
publish, seen = R.publish_file, []

def before_sidecar(loc, manifest):  # the object of the save is complete and verified at the URL
    seen.append(loc.key)
    if len(seen) == 2:  # the re-save's sidecar comes next
        os.kill(os.getpid(), signal.SIGKILL)
    publish(loc, manifest)

R.publish_file = before_sidecar
ck = fastckpt.Checkpointer(local_dir=cfg["local"], storage_options=cfg["opts"], overhead_budget=0.99)
for step in (1, 2):  # the re-save is larger: its size does not match the sidecar either
    ck.save({"w": torch.full((step << 16,), float(step)), "step": step}, cfg["url"]).wait()
"""


def test_a_resave_killed_before_its_sidecar_is_judged_by_its_object_as_load_does(torch_python, tmp_path, s3_server,
                                                                                  s3_bucket) -> None:
    """``last.pt`` at a URL saved again, the process SIGKILLed after the new object completed and
    before its sidecar was written: ``fastckpt.latest()`` and ``load`` take the object (its own
    manifest verifies it, and it is a later save than the sidecar's), and so do the command line's
    ``latest`` and ``verify`` (they judged it by the stale sidecar: "no complete checkpoint", and
    BAD "N bytes, but M were committed")."""
    opts = s3_server.storage_options()
    url, o = f"s3://{s3_bucket}/run", json.dumps(opts)
    cfg = {"local": str(tmp_path / "nvme"), "opts": opts, "url": f"{url}/last.pt"}
    proc = torch_python.run_code(_KILLED_BEFORE_SIDECAR, [json.dumps(cfg)], 300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert fastckpt.latest(url, storage_options=opts) == f"{url}/last.pt"
    assert fastckpt.load(f"{url}/last.pt", storage_options=opts)["step"] == 2
    r = run("latest", url, "--storage-options", o)
    assert r.exit_code == 0 and r.stdout.strip() == f"{url}/last.pt", r.output
    for where in (url, f"{url}/last.pt"):
        r = run("verify", where, "--storage-options", o, "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["bad"] == [], r.output
    listed = json.loads(run("ls", url, "--storage-options", o, "--json").stdout)["checkpoints"]
    assert [(e["name"], e["problem"]) for e in listed] == [("last.pt", None)]


@pytest.mark.parametrize("sidecar", ["cut short", "another shape", "deleted"])
def test_a_whole_file_under_a_damaged_sidecar_is_judged_by_its_object_as_load_does(tmp_path, s3_server, s3_bucket,
                                                                                   sidecar: str) -> None:
    """A damaged sidecar says nothing (burst-buffer.md): load() verifies the object by its own
    manifest, as with the sidecar deleted. latest() skipped the file ("skipping a damaged
    checkpoint") and named the save before, so a resume went back a save; ls listed it damaged,
    verify failed on it, and `verify FILE` raised the JSON error (a sidecar of another shape: an
    AttributeError in latest(), ls and verify). Now all judge the object, as with no sidecar."""
    opts = s3_server.storage_options()
    url, o = f"s3://{s3_bucket}/run", json.dumps(opts)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb"), storage_options=opts) as ck:
        for step in (1, 2):
            ck.save(state(step), f"{url}/step-{step}.pt").wait()
    client, key = s3_server.client(), "run/step-2.pt.fastckpt.json"
    body = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    if sidecar == "deleted":
        client.delete_object(Bucket=s3_bucket, Key=key)
    else:
        client.put_object(Bucket=s3_bucket, Key=key, Body=body[:40] if sidecar == "cut short" else b"[]")
    newest = f"{url}/step-2.pt"
    assert fastckpt.load(newest, storage_options=opts, verify=True)["step"] == 2
    assert fastckpt.latest(url, storage_options=opts) == newest
    r = run("latest", url, "--storage-options", o)
    assert r.exit_code == 0 and r.stdout.strip() == newest, r.output
    listed = json.loads(run("ls", url, "--storage-options", o, "--json").stdout)["checkpoints"]
    assert [(e["name"], e["status"], e["step"], e["latest"], e["problem"]) for e in listed] == [
        ("step-1.pt", "complete", 1, False, None), ("step-2.pt", "complete", 2, True, None)]
    for where, checked in ((url, 2), (newest, 1)):
        r = run("verify", where, "--storage-options", o, "--json")
        assert r.exit_code == 0, r.output
        assert (json.loads(r.stdout)["checked"], json.loads(r.stdout)["bad"]) == (checked, []), r.output
    r = run("verify", url, "--latest", "--storage-options", o, "--json")
    assert r.exit_code == 0 and [f["path"] for f in json.loads(r.stdout)["files"]] == [newest], r.output


def test_readers_and_planners_start_without_torch(home, tmp_path) -> None:
    """The tools an operator runs by hand on a login node (ls, verify, latest, plan, report,
    serve-metrics) never import torch, which takes seconds to import: run each in a process
    where importing torch fails."""
    import subprocess
    import sys

    log = tmp_path / "events.jsonl"
    with fastckpt.Checkpointer(event_log=str(log)) as ck:
        ck.save(state(3), str(tmp_path / "logged.pt")).wait()
    commands = [["ls", home], ["verify", f"{home}/step-5"], ["latest", home],
                ["plan", "--params", "7e9", "--gpus", "16", "--bandwidth", "2GB/s"],
                ["report", str(log), "--json"], ["serve-metrics", "--event-log", str(log), "--once"]]
    blocked = "import sys; sys.modules['torch'] = None; from fastckpt.cli import main; sys.exit(main(sys.argv[1:]))"
    for args in commands:
        res = subprocess.run([sys.executable, "-c", blocked, *args], capture_output=True, text=True, timeout=60,
                             check=False)
        assert res.returncode in (0, 1) and "torch" not in res.stderr, (args, res.stdout, res.stderr)
        assert res.stdout.strip(), args


def test_ls_lists_a_group_saved_but_never_committed_as_incomplete(tmp_path) -> None:
    """Through a store a commit leaves no rank marker: a group whose files were saved and whose
    commit never ran (the job was killed) was not listed at all."""
    import datetime

    import torch.distributed as dist

    h = str(tmp_path / "home")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    with fastckpt.Checkpointer() as ck:
        ck.save(state(1), f"{h}/a.pt").wait()
    with fastckpt.Checkpointer(rank=0, world_size=2, store=store) as ck:
        for name in ("model.pt", "optim.pt"):
            ck.save(state(2), f"{h}/grp/step-1/{name}", group=f"{h}/grp/step-1").wait()
    listed = {c["name"]: c["status"] for c in json.loads(run("ls", h, "--json").stdout)["checkpoints"]}
    assert listed == {"a.pt": "complete", "grp/step-1": "incomplete"}, listed


def test_ls_of_a_group_lists_it_once(home: str) -> None:
    """``ls step-5`` listed the committed group and, before it, a nameless "incomplete" group:
    its own rank markers, read as those of a group at ``step-5/`` with no manifest. A group that
    never committed is listed by its name."""
    got = json.loads(run("ls", f"{home}/step-5", "--json").stdout)["checkpoints"]
    assert [(c["name"], c["status"]) for c in got] == [("step-5", "complete")], got
    got = json.loads(run("ls", f"{home}/step-9", "--json").stdout)["checkpoints"]
    assert [(c["name"], c["status"]) for c in got] == [("step-9", "incomplete")], got


def test_ls_and_verify_of_a_group_that_never_committed_and_has_no_markers_name_it(tmp_path) -> None:
    """A single process killed before its commit (or a job with a store) leaves a group's files
    and no rank markers. ``ls GROUP`` listed nothing and ``verify GROUP`` said only "no complete
    checkpoint"; the files name the group as theirs, so it is listed incomplete."""
    group = str(tmp_path / "run" / "step-7")
    code = ("import os, sys, torch, fastckpt\n"
            "fastckpt.Checkpointer().save({'w': torch.ones(8)}, sys.argv[1] + '/rank0.pt', group=sys.argv[1]).wait()\n"
            "os._exit(9)  # killed before its commit\n")
    assert subprocess.run([sys.executable, "-c", code, group], timeout=120).returncode == 9
    assert not os.path.exists(os.path.join(group, ".fastckpt"))  # no markers: judged by the files themselves
    got = json.loads(run("ls", group, "--json").stdout)["checkpoints"]
    assert [(c["name"], c["status"], c["files"]) for c in got] == [("step-7", "incomplete", 1)], got
    res = run("verify", group, "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["incomplete"] == [group], res.stdout
    assert f"no fastckpt checkpoint under {group} to verify: 1 incomplete (never committed" in res.stderr


def test_verify_of_a_directory_checks_every_copy_of_a_save(tmp_path) -> None:
    """``cp step-5.pt best.pt`` gives two files with one manifest. The scan kept one path per
    manifest (right for ``latest``), so ``verify DIR`` checked only step-5.pt and passed while
    best.pt was damaged (``verify best.pt`` failed)."""
    d = tmp_path / "run"
    with fastckpt.Checkpointer() as ck:
        ck.save(state(5), str(d / "step-5.pt")).wait()
    data = bytearray((d / "step-5.pt").read_bytes())
    data[1000] ^= 0x01  # a data byte; the manifest in the zip comment is untouched
    (d / "best.pt").write_bytes(bytes(data))
    res = run("verify", str(d), "--json")
    got = json.loads(res.stdout)
    assert res.exit_code == 1 and [b["path"] for b in got["bad"]] == [str(d / "best.pt")], res.stdout
    assert sorted(os.path.basename(f["path"]) for f in got["files"]) == ["best.pt", "step-5.pt"]
    names = [c["name"] for c in json.loads(run("ls", str(d), "--json").stdout)["checkpoints"]]
    assert sorted(names) == ["best.pt", "step-5.pt"], names
    assert fastckpt.latest(str(d)) in (str(d / "best.pt"), str(d / "step-5.pt"))  # one save: one of its copies


def _groups(tmp_path, committed: int, pending: int = 0, **opts: object) -> tuple[str, fastckpt.Checkpointer]:
    """``committed`` groups step-1... and ``pending`` more saved but not committed yet, by a job
    (the Checkpointer returned: the caller closes it) that may commit or remove while ls looks."""
    home, ck = str(tmp_path / "home"), fastckpt.Checkpointer(**opts)
    for s in range(1, committed + pending + 1):
        for name in ("a.pt", "b.pt"):
            ck.save(state(s), f"{home}/step-{s}/{name}", group=f"{home}/step-{s}")
        ck.wait()
        if s <= committed:
            ck.commit(f"{home}/step-{s}", step=s).wait()
    return home, ck


@pytest.mark.parametrize("latest", [False, True], ids=["all", "latest"])
def test_verify_checks_what_is_there_when_retention_deletes_what_it_picked(tmp_path, monkeypatch,
                                                                           latest: bool) -> None:
    """A job (keep_persistent=1) commits step-3 while verify reads step-2, and its retention deletes
    step-2: verify said "no fastckpt checkpoint under DIR to verify" and exited 1. It lists again
    and checks step-3; a job that deletes what verify picked each time ends it after 3 listings,
    saying so, never "no fastckpt checkpoint"."""
    import fastckpt.cli.verify as verify_mod

    home, ck = _groups(tmp_path, 2, keep_persistent=1)
    real, saved = verify_mod.check_file, []

    def check_file(h, spec, *args):  # noqa: ANN001, ANN002, ANN202
        if spec.path.endswith("/a.pt") and len(saved) < limit:  # the job commits while verify reads a.pt
            saved.append(3 + len(saved))
            save_group(ck, f"{home}/step-{saved[-1]}", saved[-1])
        return real(h, spec, *args)

    monkeypatch.setattr(verify_mod, "check_file", check_file)
    flag = ["--latest"] if latest else []
    try:
        limit = 1
        r = run("verify", home, "--json", "--jobs", "1", *flag)
        d = json.loads(r.stdout)
        assert r.exit_code == 0 and saved == [3] and not os.path.exists(f"{home}/step-2"), r.output
        assert d["deleted"] == [f"{home}/step-2"] and d["bad"] == [] and d["checked"] == 2, d
        assert {f["checkpoint"] for f in d["files"]} == {f"{home}/step-3"}
        limit = 1 + 3  # every listing's pick deleted: three listings, then it says so
        r = run("verify", home, *flag)
        assert saved == [3, 4, 5, 6] and r.exit_code == 1, r.output
        assert f"nothing left to verify under {home}: what was listed there was deleted or saved again" in r.stderr
        assert "no fastckpt checkpoint" not in r.output
    finally:
        ck.close()


@pytest.mark.parametrize("races", ["once", "at every look"])
def test_ls_never_marks_latest_a_group_it_lists_incomplete(tmp_path, monkeypatch, races: str) -> None:
    """A job commits a group between ls's looks (its scan, then ``fastckpt.latest``): the group
    was listed incomplete AND latest, and verify --latest then checked 0 files and exited 1. ls
    looks again; when a commit lands between its looks each time, no incomplete row is latest."""
    home, ck = _groups(tmp_path, 2, pending=4)
    real, committed, looks = fastckpt.latest, [], [1 if races == "once" else 3]

    def latest(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if len(committed) < looks[0]:
            committed.append(len(committed) + 3)
            ck.commit(f"{home}/step-{committed[-1]}", step=committed[-1]).wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(fastckpt, "latest", latest)
    try:
        d = json.loads(run("ls", home, "--json").stdout)
        rows = {e["name"]: (e["status"], e["latest"]) for e in d["checkpoints"]}
        assert len(rows) == len(d["checkpoints"]) == 6, d["checkpoints"]
        assert all(status == "complete" for status, latest in rows.values() if latest), rows
        if races == "once":
            assert rows["step-3"] == ("complete", True) and d["latest"] == f"{home}/step-3"
        looks[0] += 1  # a commit between verify --latest's looks: what it checks is a complete group
        r = run("verify", home, "--latest", "--json")
        d = json.loads(r.stdout)
        assert r.exit_code == 0 and d["checked"] == 2 and d["passed"], r.output
    finally:
        ck.close()


@pytest.mark.parametrize("races", ["once", "at every look"])
def test_ls_lists_a_group_being_removed_once(tmp_path, monkeypatch, races: str) -> None:
    """Retention's remove deletes a group's manifest first: between ls's scan and its look for
    incomplete groups, the group was listed twice (complete and incomplete). ls looks again; when
    a removal starts between its looks each time, the group stays listed once."""
    import fastckpt.cli._listing as listing

    home, ck = _groups(tmp_path, 3)
    ck.close()
    real, removed = listing.incomplete_groups, []

    def incomplete(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if len(removed) < (1 if races == "once" else 3):
            removed.append(len(removed) + 1)
            os.remove(f"{home}/step-{removed[-1]}/fastckpt-manifest.json")  # remove()'s first step
        return real(*args, **kwargs)

    monkeypatch.setattr(listing, "incomplete_groups", incomplete)
    d = json.loads(run("ls", home, "--json").stdout)
    names = [e["name"] for e in d["checkpoints"]]
    assert sorted(names) == ["step-1", "step-2", "step-3"], d["checkpoints"]
    if races == "once":
        assert {e["name"]: e["status"] for e in d["checkpoints"]}["step-1"] == "incomplete"


def test_ls_never_reports_a_checkpoint_retention_removes_as_damaged(tmp_path, monkeypatch) -> None:
    """ls checks each complete checkpoint's files after its looks; a job (keep_persistent=2)
    committing step-3 just as ls sized step-1's files removed step-1, and ls listed it complete
    with "a.pt, b.pt missing or not the committed size" (a false damage report). Gone, not damaged."""
    import fastckpt.cli._discovery as discovery

    home, ck = _groups(tmp_path, 2, keep_persistent=2)
    real, saved = discovery._sizes, []

    def sizes(h, paths):  # noqa: ANN001, ANN202
        if not saved and any("/step-1/" in p for p in paths):  # step-1's manifest read, its files not yet
            saved.append(3)
            save_group(ck, f"{home}/step-3", 3)
        return real(h, paths)

    monkeypatch.setattr(discovery, "_sizes", sizes)
    try:
        d = json.loads(run("ls", home, "--json").stdout)
    finally:
        ck.close()
    assert saved == [3] and not os.path.exists(f"{home}/step-1")
    assert [e["problem"] for e in d["checkpoints"]] == [None] * len(d["checkpoints"]), d["checkpoints"]


def test_ls_of_a_checkpoint_file_url_looks_once(tmp_path, monkeypatch) -> None:
    """Under a checkpoint object's own URL nothing is listed while ``latest`` names the file: the
    looks never agreed, and ls made every request three times before saying "is a file"."""
    import fastckpt.cli._listing as listing

    run_url, looks = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run", []
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb"), overhead_budget=0.99) as ck:
        for s in (1, 2):
            ck.save(state(s), f"{run_url}/step-{s}.pt")
    real = listing._looks
    monkeypatch.setattr(listing, "_looks", lambda *a: looks.append(1) or real(*a))
    r = run("ls", f"{run_url}/step-2.pt")
    assert r.exit_code == 1 and "is a file" in r.stderr and len(looks) == 1, (r.output, looks)


def test_latest_never_names_a_checkpoint_removed_while_its_files_are_sized(tmp_path, monkeypatch) -> None:
    """The newest group lost a file, so `fastckpt latest` checks the one before; retention removed
    that one while its files were sized, and (7512ff9 taking "removed" for "no file missing")
    `fastckpt latest` printed its path, which no longer existed."""
    import shutil

    import fastckpt.cli._discovery as discovery

    home, ck = _groups(tmp_path, 2)
    ck.close()
    os.remove(f"{home}/step-2/a.pt")
    real = discovery._sizes

    def sizes(h, paths):  # noqa: ANN001, ANN202
        if any("/step-1/" in p for p in paths) and os.path.isdir(f"{home}/step-1"):
            shutil.rmtree(f"{home}/step-1")  # the job's retention, at that moment
        return real(h, paths)

    monkeypatch.setattr(discovery, "_sizes", sizes)
    r = run("latest", home)
    assert r.exit_code == 1 and r.stdout == "", r.output
    assert f"passing over {home}/step-2" in r.stderr and "step-1" not in r.stderr, r.stderr


def test_latest_never_names_a_checkpoint_removed_right_after_the_listing(tmp_path, monkeypatch) -> None:
    """As above, one moment earlier: retention removed step-1 after the scan listed it, before
    its manifest was read; "not fastckpt's" (nothing to size) was taken for "whole"."""
    import shutil

    import fastckpt.cli._discovery as discovery

    home, ck = _groups(tmp_path, 2)
    ck.close()
    os.remove(f"{home}/step-2/a.pt")
    real = discovery.scan

    def scan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        found = real(*args, **kwargs)
        shutil.rmtree(f"{home}/step-1", ignore_errors=True)  # the job's retention, right after the listing
        return found

    monkeypatch.setattr(discovery, "scan", scan)
    r = run("latest", home)
    assert r.exit_code == 1 and r.stdout == "", r.output


def test_latest_asks_again_when_retention_removes_each_checkpoint_it_checks(tmp_path, monkeypatch) -> None:
    """A job keeping one checkpoint (keep_persistent=1) saves while `fastckpt latest` checks: the
    file latest() named is removed before its files are checked, and so is the one the scan found
    next. `fastckpt latest` then said "no complete checkpoint" (a resume script starts fresh)
    although fastckpt.latest() never answers None there: it asks latest() again."""
    import fastckpt.cli._discovery as discovery

    home = str(tmp_path / "home")
    ck = fastckpt.Checkpointer(keep_persistent=1, overhead_budget=0.99)
    ck.save(state(1), f"{home}/step-1.pt").wait()
    real, checked = discovery.checkpoint_files, []

    def checkpoint_files(h, path):  # noqa: ANN001, ANN202
        if path not in checked and len(checked) < 2:  # the job's next save lands, its retention removes path
            checked.append(path)
            ck.save(state(len(checked) + 1), f"{home}/step-{len(checked) + 1}.pt").wait()
            assert not os.path.exists(path)
        return real(h, path)

    monkeypatch.setattr(discovery, "checkpoint_files", checkpoint_files)
    try:
        r = run("latest", home)
    finally:
        ck.close()
    assert checked == [f"{home}/step-1.pt", f"{home}/step-2.pt"]
    assert r.exit_code == 0 and r.stdout.strip() == f"{home}/step-3.pt", r.output


def test_latest_never_names_a_removed_group_whose_name_begins_a_newer_ones(tmp_path, monkeypatch) -> None:
    """latest() answers step-100; the job then commits step-1000 and its retention removes
    step-100. Whether anything is left of step-100 was asked of the plain prefix "step-100", which
    step-1000's files match: the removed group counted as whole and `fastckpt latest` printed it."""
    home = str(tmp_path / "home")
    with fastckpt.Checkpointer() as ck:
        save_group(ck, f"{home}/step-100", 100)
    real = fastckpt.latest

    def latest(root, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        found = real(root, *args, **kwargs)
        if os.path.isdir(f"{home}/step-100"):  # the job's next commit and its retention, right after the answer
            with fastckpt.Checkpointer() as job:
                save_group(job, f"{home}/step-1000", 1000)
                job.remove(f"{home}/step-100")
        return found

    monkeypatch.setattr(fastckpt, "latest", latest)
    r = run("latest", home)
    assert r.exit_code == 0 and r.stdout.strip() == f"{home}/step-1000", r.output
