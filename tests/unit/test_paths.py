"""Names that cannot be a checkpoint file fail clearly, and a burst buffer inside the
checkpoint directory never makes ``latest`` name its copies."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import ConfigError
from fastckpt.urls import normalize
from tests.helpers import scan


def _state(v: int) -> dict:
    return {"w": torch.full((16,), float(v)), "v": v}


@pytest.mark.parametrize("bad", ["", "  ", "ckpt/", "s3://bucket/run/"])
def test_a_name_that_is_no_file_fails_at_the_call(tmp_path: Path, bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        with pytest.raises(ConfigError, match="empty: name the file|ends with a separator, so it names a directory"):
            ck.save(_state(1), bad)
        with pytest.raises(ConfigError, match="empty: name the file|ends with a separator, so it names a directory"):
            ck.load(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["nvme"])



@pytest.mark.parametrize("name", ["a\\b.pt", "from windows\\run/a.pt"])
@pytest.mark.parametrize("local", [False, True])
def test_a_name_with_a_backslash_is_refused_at_the_call_before_anything_is_written(
        tmp_path: Path, name: str, local: bool) -> None:
    """save() took '/ckpt/a\\b.pt', wrote the whole file (and its burst-buffer copy), and only
    then wait() raised "key ... must be relative to the target root", naming no backslash and
    leaving the file at the path."""
    home = tmp_path / "home"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None) as ck:
        with pytest.raises(ConfigError, match=r"holds a backslash .*Choose another name, e.g. '.*a_b\.pt'|"
                                              r"holds a backslash .*e.g. '.*from windows_run/a\.pt'"):
            ck.save(_state(1), str(home / name))
        assert ck.save(_state(2), str(home / "ok.pt")).wait().durable_s is not None  # it keeps working
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert [w for w in written if "\\" in w] == [], written

def test_a_group_name_too_long_to_be_saved_again_is_refused_at_its_first_save(tmp_path: Path) -> None:
    """A group named with 228-255 bytes committed once, and every later save of it failed in the
    background (its re-save directory '.NAME.fastckpt-next-<12 hex>' is 28 bytes longer than
    the name: "File name too long"), so a resume loaded the first save. Now its first save is
    refused naming the limit; a name of 227 bytes is saved again and loads the newer save."""
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:
        group = tmp_path / ("g" * 228)
        with pytest.raises(ConfigError, match="name is 228 bytes long.*Use a group name of at most 227 bytes"):
            ck.save(_state(1), str(group / "rank0.pt"), group=str(group))
        group = tmp_path / ("é" * 113 + "g")  # bytes, not characters: 227
        for v in (1, 2):
            ck.save(_state(v), str(group / "rank0.pt"), group=str(group))
            ck.commit(str(group)).wait(60)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([group.name, "latest"])  # no 228-byte one
    assert fastckpt.load(str(group / "rank0.pt"))["v"] == 2
    import uuid  # at a URL a group is never saved again beside itself: a long name saves there (w4)

    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run/" + "g" * 240
    with fastckpt.Checkpointer(overhead_budget=0.99, local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(3), f"{url}/rank0.pt", group=url)
        ck.commit(url).wait(60)
    assert fastckpt.latest(url.rsplit("/", 1)[0]) == url


def test_a_name_with_a_part_longer_than_a_file_system_name_is_refused_at_save(tmp_path: Path) -> None:
    """A file name over 255 bytes (a group's file too), or such a folder in a URL's key (its
    burst-buffer copy keeps the key's parts), failed only after the snapshot, in the background
    ("File name too long"); such a folder in a local path failed at save as a CheckpointWriteError
    advising to check the file system. Each is refused at save now, before anything is written."""
    long = "p" * 256
    cases = [(tmp_path / "run" / f"{long[:253]}.pt", None), (tmp_path / "run" / long / "a.pt", None),
             (tmp_path / "run" / "step-1" / f"{long[:253]}.pt", tmp_path / "run" / "step-1"),
             (tmp_path / "run" / long / "step-1" / "a.pt", tmp_path / "run" / long / "step-1")]
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:
        for path, group in cases:
            with pytest.raises(ConfigError, match=r"its part 'p{40}'\.\.\. is 256 bytes long, over the 255 bytes a "
                                                  r"file system takes in one name, so the save would fail only after "
                                                  r"its snapshot\. Choose a shorter name for it, of at most 255 bytes"):
                ck.save(_state(1), str(path), group=None if group is None else str(group))
        assert not (tmp_path / "run").exists()
        fits = tmp_path / "run" / ("p" * 255) / "step-1"  # 255 bytes: a file system takes it
        ck.save(_state(2), str(fits / f"{'q' * 252}.pt"), group=str(fits))
        ck.commit(str(fits)).wait(60)
    assert fastckpt.load(str(fits / f"{'q' * 252}.pt"))["v"] == 2
    import uuid

    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run/{long}/a.pt"  # memory:// takes it; its burst buffer not
    with fastckpt.Checkpointer(overhead_budget=0.99, local_dir=str(tmp_path / "nvme")) as ck:
        with pytest.raises(ConfigError, match=r"is 256 bytes long.*\(the burst-buffer copy of a URL keeps its key's "
                                              r"parts; SeaweedFS and MinIO take no longer part either\)"):
            ck.save(_state(3), url)
    assert list((tmp_path / "nvme").rglob("p*")) == []


@pytest.mark.parametrize("bad", ["too long", "link loop"])
def test_a_name_that_cannot_be_opened_is_a_config_error_of_the_load_not_a_write_error(tmp_path: Path,
                                                                                     bad: str) -> None:
    """A name longer than NAME_MAX (ENAMETOOLONG) or a symbolic link loop (ELOOP) made load()
    raise a ReplicationError, a CheckpointWriteError, advising to "check the target file system":
    a resume script that catches the load's errors got a write failure for a read."""
    if bad == "too long":
        path = tmp_path / ("y" * 300 + ".pt")
        why = r"File name too long\): a name in it is longer than the file system allows .*shorten it"
    else:
        path = tmp_path / "loop.pt"
        os.symlink("loop.pt", path)
        why = r"Too many levels of symbolic links\): a symbolic link in it leads back to itself .*fix or remove"
    with pytest.raises(ConfigError, match=f"^read of {path}: the name cannot be opened \\({why}") as err:
        fastckpt.load(str(path))
    assert not isinstance(err.value, fastckpt.CheckpointWriteError)
    assert err.value.__cause__.errno == (errno.ENAMETOOLONG if bad == "too long" else errno.ELOOP)


@pytest.mark.parametrize("local", [False, True])
def test_a_name_with_a_nul_is_refused_at_the_call_before_anything_is_written(tmp_path: Path, local: bool) -> None:
    """save() took 'a\\x00b.pt', wrote the whole file to a hidden temp name, and wait() raised a
    bare ValueError "embedded null byte" from the commit, leaving the temp file behind."""
    home = tmp_path / "home"
    home.mkdir()
    path = str(home / "a\x00b.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None) as ck:
        with pytest.raises(ConfigError, match=r"holds a NUL character \('\\x00'\), which no file or object name may "
                                              r"hold: remove it \(e\.g\. '.*/home/ab\.pt'\)"):
            ck.save(_state(1), path)
        with pytest.raises(ConfigError, match="holds a NUL character"):
            ck.load(path)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_bytes_path_is_a_file_name_and_a_file_object_is_refused_naming_torch_save(tmp_path: Path) -> None:
    """torch.save and torch.load accept a bytes path and a file object; fastckpt failed on both with
    internal TypeErrors ("a bytes-like object is required, not 'str'" for a bytes path: the opposite
    of what was wrong). A bytes path is the file it names (decoded as ``open`` decodes it); a buffer
    is refused at the call, naming what fastckpt takes and what writes a buffer."""
    path = tmp_path / "a.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(1), os.fsencode(path)).wait()
        assert ck.load(os.fsencode(path))["v"] == 1
        assert fastckpt.load(str(path))["v"] == 1
        for buf in (io.BytesIO(path.read_bytes()), 7):
            with pytest.raises(ConfigError, match=f"the checkpoint path is a {type(buf).__name__}, not a file name or "
                               r"URL: fastckpt saves and loads named files or URLs .* torch.save\(state, buf\) and "
                               r"torch.load\(buf\)"):
                ck.load(buf)
            with pytest.raises(ConfigError, match="fastckpt saves and loads named files or URLs"):
                ck.save(_state(2), buf)
        with pytest.raises(ConfigError, match="the checkpoint path is a BytesIO"):
            fastckpt.load(io.BytesIO(path.read_bytes()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


def test_a_name_that_is_not_utf8_is_refused_at_the_call(tmp_path: Path) -> None:
    """A bytes path in Latin-1 (``caf\\xe9.pt``) was accepted, then the save failed in the background with a
    bare UnicodeEncodeError: names go into records as UTF-8. It is refused at the call, naming the byte."""
    with fastckpt.Checkpointer() as ck:
        with pytest.raises(ConfigError, match=r"is not UTF-8 \(byte b'\\xe9' at \d+\).*give a UTF-8 name"):
            ck.save({"a": 1}, os.fsencode(tmp_path) + b"/caf\xe9.pt")
    assert list(tmp_path.iterdir()) == []


def test_loading_a_directory_says_so(tmp_path: Path) -> None:
    (tmp_path / "step-1").mkdir()
    with pytest.raises(ConfigError, match=r"step-1 is a directory, not a checkpoint file: .*fastckpt\.latest\("):
        fastckpt.load(str(tmp_path / "step-1"))


@pytest.mark.parametrize("local", [False, True])
def test_saving_over_a_directory_names_it_and_keeps_it(tmp_path: Path, local: bool) -> None:
    home = tmp_path / "home"
    (home / "x.pt").mkdir(parents=True)
    (home / "x.pt" / "keep").write_bytes(b"k")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None) as ck:
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(1), str(home / "x.pt")).wait()
    assert ei.value.errno == errno.EISDIR
    said = "a directory stands where the file goes: name a file inside it" if local else \
        f"{home / 'x.pt'} is a directory, not a file (name a file inside it"
    assert said in str(ei.value)
    assert (home / "x.pt" / "keep").read_bytes() == b"k"
    assert sorted(p.name for p in home.iterdir()) == ["x.pt"]  # no temp file left


@pytest.fixture
def shallow() -> Iterator[Path]:
    """A directory two levels below the root, so the burst-buffer copies of what is saved in it
    (at local_dir + its absolute path) lie within ``latest``'s scan depth."""
    d = Path(tempfile.mkdtemp(prefix="fck-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.mark.parametrize("local", [".", "nvme"])
def test_burst_buffer_inside_the_checkpoint_directory_is_not_a_checkpoint(shallow: Path, local: str) -> None:
    with fastckpt.Checkpointer(local_dir=str(shallow / local), rank=0, world_size=1) as ck:
        ck.save(_state(1), str(shallow / "a.pt")).wait()
        mirror = Path(ck.local_path(str(shallow / "a.pt")))
        assert mirror.exists() and mirror.is_relative_to(shallow)  # the copy really is inside
        assert fastckpt.latest(str(shallow)) == str(shallow / "a.pt")
        group = shallow / "step-2"
        ck.save(_state(2), str(group / "m.pt"), group=str(group))
        ck.commit(str(group), step=2).wait()
    os.unlink(shallow / "latest")  # the pointer names the group: make latest() scan
    assert fastckpt.latest(str(shallow)) == str(group)
    found = [f.path for f in scan(shallow)]
    assert found == [str(shallow / "a.pt"), str(group)]  # one entry per save, each the copy at its home
    assert fastckpt.load(fastckpt.latest(str(shallow)) + "/m.pt")["v"] == 2


def test_a_name_fastckpt_refuses_under_a_directory_is_passed_over_by_latest(tmp_path: Path) -> None:
    """A folder with a backslash in its name (legal on Linux, common in copies from Windows)
    four levels under the run made ``fastckpt.latest(dir)`` (and ``ls``, ``verify``) raise
    ConfigError "key ... must be relative ...": no resume at all. It is none of fastckpt's."""
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.ones(4)}, str(tmp_path / "step-1.pt")).wait()
    odd = tmp_path / "from windows\\run"
    odd.mkdir()
    shutil.copy(tmp_path / "step-1.pt", odd / "step-2.pt")
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step-1.pt")
    assert fastckpt.load(fastckpt.latest(str(tmp_path)))["w"].sum() == 4



def test_a_name_fastckpt_refuses_is_passed_over_by_ls_verify_and_remove(tmp_path: Path) -> None:
    """One stray ``notes\\draft.txt`` beside a checkpoint (or inside a group) made ``ls DIR``,
    ``verify DIR`` and ``verify --latest DIR`` exit 1 with ConfigError "key ... must be relative",
    never checking the intact checkpoint beside it; ``remove(DIR)`` gave the same error instead
    of naming the checkpoints the directory holds."""
    from click.testing import CliRunner

    from fastckpt.cli import cli

    group = tmp_path / "step-2"
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(1), str(tmp_path / "step-1.pt")).wait()
        ck.save(_state(2), str(group / "m.pt"), group=str(group))
        ck.commit(str(group), step=2).wait(60)
        (tmp_path / "notes\\draft.txt").write_text("not a checkpoint")
        (group / "x\\y.txt").write_text("not a checkpoint")
        for args in (["ls", str(tmp_path)], ["verify", str(tmp_path)], ["verify", "--latest", str(tmp_path)],
                     ["ls", str(group)], ["verify", str(group)]):
            res = CliRunner().invoke(cli, args)
            assert res.exit_code == 0 and "ConfigError" not in res.output, (args, res.output)
        listed = CliRunner().invoke(cli, ["ls", "--json", str(tmp_path)])
        assert sorted(e["name"] for e in json.loads(listed.stdout)["checkpoints"]) == ["step-1.pt", "step-2"]
        with pytest.raises(ConfigError, match=r"holding 2 checkpoints"):
            ck.remove(str(tmp_path))
        (tmp_path / "odd").mkdir()
        (tmp_path / "odd" / "a\\b.pt").write_text("not a checkpoint")
        with pytest.raises(ConfigError, match="holding no checkpoint fastckpt recognises"):
            ck.remove(str(tmp_path / "odd"))
        ck.remove(str(group))  # the group goes, with what it holds
    assert not group.exists() and (tmp_path / "step-1.pt").exists()

def test_latest_of_a_checkpoint_file_is_that_file_and_of_another_file_refuses(tmp_path: Path) -> None:
    """``latest`` given the checkpoint file itself (the path the last run printed, Lightning's
    ``last.ckpt``) answered None, "nothing saved: start fresh", for a complete, loadable file."""
    from click.testing import CliRunner

    from fastckpt.cli import cli

    with fastckpt.Checkpointer() as ck:
        ck.save(_state(3), str(tmp_path / "run" / "last.pt")).wait()
    torch.save(_state(4), tmp_path / "run" / "plain.pt")
    (tmp_path / "run" / "notes.txt").write_text("not a checkpoint")
    for name in ("last.pt", "plain.pt"):
        assert fastckpt.latest(str(tmp_path / "run" / name)) == str(tmp_path / "run" / name)
    with pytest.raises(ConfigError, match=r"notes\.txt is a file, not a directory.*latest\(\) takes the directory"):
        fastckpt.latest(str(tmp_path / "run" / "notes.txt"))
    assert fastckpt.latest(str(tmp_path / "run" / "missing.pt")) is None  # nothing saved there yet
    out = CliRunner().invoke(cli, ["latest", str(tmp_path / "run" / "last.pt")])
    assert (out.exit_code, out.output.strip()) == (0, str(tmp_path / "run" / "last.pt"))


def test_latest_of_a_link_to_a_checkpoint_file_is_the_link(tmp_path: Path) -> None:
    """``best.pt`` -> ``step-5.pt``: ``load`` reads it verified, but ``latest`` judged it by the
    scan of its folder, which lists no link, and raised "is no complete checkpoint". A link to
    a group's file or to a file that is no checkpoint stays refused, as the file itself is."""
    run = tmp_path / "run"
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(5), str(run / "step-5.pt")).wait()
        ck.save(_state(6), str(run / "g" / "rank0.pt"), group=str(run / "g"))
        ck.commit(str(run / "g"), step=6).wait()
    torch.save(_state(7), run / "plain.pt")
    (run / "notes.txt").write_text("not a checkpoint")
    for link, target, v in (("best.pt", "step-5.pt", 5), ("plain-link.pt", "plain.pt", 7)):
        os.symlink(run / target, run / link)
        assert fastckpt.latest(str(run / link)) == str(run / link)
        assert fastckpt.load(fastckpt.latest(str(run / link)))["v"] == v
    os.symlink(run / "notes.txt", run / "notes-link.pt")
    os.symlink(run / "g" / "rank0.pt", run / "rank0-link.pt")
    for link in ("notes-link.pt", "rank0-link.pt"):
        with pytest.raises(ConfigError, match="is no complete checkpoint"):
            fastckpt.latest(str(run / link))
    (run / "step-5.pt").unlink()  # retention deleted what best.pt names: None would mean "start from scratch"
    with pytest.raises(ConfigError, match="is a symbolic link to a file or directory that does not exist"):
        fastckpt.latest(str(run / "best.pt"))
    (tmp_path / "scratch").mkdir()  # jobs/run1 -> /scratch/run1 before its first save: nothing there yet
    os.symlink(tmp_path / "scratch", tmp_path / "linked-run")
    assert fastckpt.latest(str(tmp_path / "linked-run")) is None


def test_latest_of_a_directory_at_a_url_with_no_checkpoint_yet_is_none() -> None:
    """fsspec's memory (and gs, az) filesystems say a prefix "exists" as a file would: a run
    directory holding only logs is still "nothing saved yet" (None), never "is a file"."""
    import uuid

    import fsspec

    run = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    fsspec.filesystem("memory").pipe(run.removeprefix("memory://") + "/logs/train.log", b"step 1")
    assert fastckpt.latest(run) is None


def test_latest_at_a_memory_url_names_it_as_it_was_given(tmp_path: Path) -> None:
    """fsspec's path of memory://b is /b: latest("memory://b/run") named memory:///b/run/..., and
    latest("memory:///b/run") memory:/b/run/..., which no later call accepted (a URL typo)."""
    import uuid

    bucket = f"fastckpt-{uuid.uuid4().hex[:8]}"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), f"memory://{bucket}/run/step-1.pt").wait()
        ck.save(_state(2), f"memory://{bucket}/run/step-2/a.pt", group=f"memory://{bucket}/run/step-2")
        ck.commit(f"memory://{bucket}/run/step-2", step=2).wait()
    for given in (f"memory://{bucket}/run", f"memory:///{bucket}/run"):
        assert fastckpt.latest(given) == f"{given}/step-2"
        assert fastckpt.latest(f"{given}/step-1.pt") == f"{given}/step-1.pt"
        assert fastckpt.load(f"{fastckpt.latest(given)}/a.pt")["v"] == 2


def test_a_url_name_whose_sidecar_key_is_over_1024_bytes_is_refused_at_save(tmp_path: Path) -> None:
    """S3 and GCS take keys of at most 1024 bytes: a name of 1011 bytes after the bucket was
    uploaded whole, then its sidecar (NAME.fastckpt.json, 1025 bytes) was refused. A store without
    those limits (memory://) takes such names: refusing them there was a regression (w3). A group's
    file has no sidecar: its own key is held to the 1024 bytes."""
    import uuid

    from fastckpt.commit.names import check_save_name

    long = "/".join(["d" * 200] * 5)  # 1004 bytes after the bucket
    for scheme in ("s3", "gs"):
        with pytest.raises(ConfigError, match=r"NAME\.fastckpt\.json, would have a key of 1025 bytes, over the 1024 "
                                              r"bytes S3 and Google Cloud Storage take.*Choose a shorter path after "
                                              r"the bucket, of at most 1010 bytes \(it has 1011\)"):
            check_save_name(f"{scheme}://b/{long}/xyz.pt", None)
        check_save_name(f"{scheme}://b/{long}/xy.pt", None)  # 1010 bytes: its sidecar's 1024 are taken
    group = f"s3://b/{long[:803]}/" + "s" * 99  # 903 bytes: its manifest and markers fit, a long file name not
    with pytest.raises(ConfigError, match=r"its key is 1107 bytes long, over the 1024 bytes S3 and Google Cloud "
                                          r"Storage take.*of at most 120 bytes \(it has 203\)"):
        check_save_name(f"{group}/{'x' * 200}.pt", group)
    check_save_name(f"{group}/{'x' * 117}.pt", group)  # 1024 bytes
    check_save_name("gs://b/" + "e" * 250 + ".pt", None)  # GCS has no 255-byte part limit; S3 stores do
    with pytest.raises(ConfigError, match="a last part of 267 bytes"):
        check_save_name("s3://b/" + "e" * 250 + ".pt", None)
    run = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/{long}"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), f"{run}/xyz.pt").wait()
        ck.save(_state(2), f"{run}/" + "e" * 250 + ".pt").wait()
    assert fastckpt.latest(run) == f"{run}/" + "e" * 250 + ".pt"


def test_both_spellings_of_a_memory_url_name_one_root(tmp_path: Path) -> None:
    """memory://b/run and memory:///b/run are one fsspec path, /b/run, but were two names: a group
    saved into as memory://b/... and committed as memory:///b/... had "no file saved into it"."""
    import uuid

    bucket = f"fastckpt-{uuid.uuid4().hex[:8]}"
    two, three = f"memory://{bucket}/run", f"memory:///{bucket}/run"
    assert normalize(f"{three}/step-1/") == normalize(f"{two}/step-1") == f"{two}/step-1"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), f"{two}/step-1/a.pt", group=f"{two}/step-1")
        ck.commit(f"{three}/step-1", step=1).wait()  # before: ConfigError, no rank saved into it
        ck.save(_state(2), f"{three}/step-2/a.pt", group=f"{three}/step-2")
        ck.commit(f"{two}/step-2", step=2).wait()
        assert (ck.latest(two), ck.latest(three)) == (f"{two}/step-2", f"{three}/step-2")
        assert ck.load(f"{three}/step-1/a.pt")["v"] == 1


@pytest.mark.parametrize(("typo", "meant"), [("s3:/bucket/run/x.pt", "s3://bucket/run/x.pt"),
                                             ("s3:bucket/run/x.pt", "s3://bucket/run/x.pt"),
                                             ("s3//bucket/run/x.pt", "s3://bucket/run/x.pt"),
                                             ("GS:/bucket/run/x.pt", "gs://bucket/run/x.pt"),
                                             (" s3://bucket/run/x.pt", "s3://bucket/run/x.pt")])
def test_a_url_typo_is_refused_not_saved_to_a_local_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          typo: str, meant: str) -> None:
    """A URL that lost a slash or its colon was the relative local path ./s3:/bucket/...: saved
    there, reported durable, and found by latest, so a fresh node started from scratch. A
    leading space made fsspec's raw "Protocol not known"."""
    monkeypatch.chdir(tmp_path)
    root = typo.rsplit("/", 1)[0]
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        with pytest.raises(ConfigError, match=f"did you mean '{meant}'"):
            ck.save(_state(1), typo)
        for call in (lambda: ck.load(typo), lambda: fastckpt.latest(root)):
            with pytest.raises(ConfigError, match=f"{typo!r}|{root!r}"):
                call()
    assert sorted(os.listdir(tmp_path)) == ["nvme"] and not os.listdir(tmp_path / "nvme")


def test_a_space_before_file_scheme_is_named_and_file_localhost_is_refused(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A leading space was "spaces around its scheme" (which? where?). ``file://localhost/x`` was
    the folder ./localhost/x: a save landed there, where RFC 8089 reads /x. fastckpt reads what
    follows ``file://`` as a path, so the host is refused, naming both meanings."""
    monkeypatch.chdir(tmp_path)
    run = f"{tmp_path}/run"
    cases = [(f" file://{run}/x.pt", "starts with ' ' before its scheme", f"did you mean 'file://{run}"),
             (f"\tfile://{run}/x.pt", "starts with '\\t' before its scheme", "did you mean"),
             (f"file ://{run}/x.pt", "has ' ' between its scheme and '://'", "did you mean"),
             (f"file://localhost{run}/x.pt", "names the host 'localhost'", f"Write 'file://{run}"),
             (f"FILE://LocalHost{run}/x.pt", "names the host 'LocalHost'", f"or './LocalHost{run}")]
    with fastckpt.Checkpointer() as ck:
        for bad, what, fix in cases:
            for call in (lambda b=bad: ck.save(_state(1), b), lambda b=bad: ck.load(b),
                         lambda b=bad: fastckpt.latest(b.rsplit("/", 1)[0]), lambda b=bad: ck.remove(b)):
                with pytest.raises(ConfigError) as err:
                    call()
                assert what in str(err.value) and fix in str(err.value), str(err.value)
    assert os.listdir(tmp_path) == []  # no ./localhost folder, nothing saved

def test_a_colon_in_a_local_name_is_no_url_typo_and_a_scheme_is_case_insensitive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a first component that starts with a known scheme is refused: Lightning's names, a
    folder ``run:1``, a folder named like a scheme further down or spelt ``./s3:`` are local
    paths. An upper-case scheme is the same URL (RFC 3986): its checkpoint is named in lower case."""
    import uuid

    from fastckpt.urls import check_url

    monkeypatch.chdir(tmp_path)
    local = ["run:1/epoch=1-step=2.ckpt", "foo:bar/x.pt", "./s3:/bucket/x.pt", str(tmp_path / "s3:" / "x.pt"),
             "s3/x.pt", "data//x.pt"]  # "data" is an fsspec protocol; an empty part is no lost colon
    bucket = f"fastckpt-{uuid.uuid4().hex[:8]}"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        for i, name in enumerate(local):
            ck.save(_state(i), name).wait()
            assert fastckpt.load(os.path.abspath(name))["v"] == i
        rec = ck.save(_state(7), f"MEMORY://{bucket}/run/x.pt").wait()
    assert rec.path == f"memory://{bucket}/run/x.pt"
    found = fastckpt.latest(f"Memory://{bucket}/run")
    assert found is not None and found == fastckpt.latest(f"memory://{bucket}/run")
    assert fastckpt.load(f"MEMORY://{bucket}/run/x.pt")["v"] == 7
    assert check_url("S3://b/x") == "s3://b/x" and check_url("run:1/x") == "run:1/x"


def test_a_relative_name_that_starts_like_a_protocol_fsspec_knows_is_local(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec knows about 55 protocols (data, local, root, dir, tar...): only a storage scheme's
    look-alike is a typo; ``data:v2/model.pt`` is a folder ``data:v2`` here, as it always was."""
    monkeypatch.chdir(tmp_path)
    for name in ("data:v2/model.pt", "local:run1/model.pt", "root:exp/x.pt", "dir:a/x.pt", "tar:1/x.pt"):
        assert normalize(name) == str(tmp_path / name)
    for typo in ("s3:/b/x.pt", "hdfs:/x", "gs//b/x"):
        with pytest.raises(ConfigError, match="looks like a URL"):
            normalize(typo)


def test_a_group_named_latest_is_refused_at_save_before_anything_is_written(tmp_path: Path) -> None:
    """A group ``ckpt/latest`` (a "rolling latest folder") stood where every group commit in
    ``ckpt`` writes the pointer: its commit published the manifest, so ``latest()`` named it,
    and then raised ``ReplicationError`` ("... Is a directory ...") on every commit."""
    group = str(tmp_path / "ckpt" / "latest")
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        with pytest.raises(ConfigError, match=r"group as .*ckpt/latest: 'latest' is the name of .*ckpt's pointer.*"
                                              r"Choose another name, e.g. '.*ckpt/last'"):
            ck.save(_state(1), group + "/model.pt", group=group)
        ck.save(_state(1), str(tmp_path / "latest" / "model.pt")).wait()  # a single file's folder: no group
    assert not (tmp_path / "ckpt").exists()
    assert fastckpt.load(str(tmp_path / "latest" / "model.pt"))["v"] == 1


def test_burst_buffer_places_tell_stores_and_a_path_like_a_url_apart(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One local_dir shared by jobs: ``s3://b/k`` at two endpoints, and the directory ``/s3/b/k``,
    are three homes; their copies once all lay at ``local_dir/s3/b/k``, each replacing the others'."""
    for v in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(v, raising=False)
    nv, url = str(tmp_path / "nvme"), "s3://b/run/last.pt"
    opts = [None, {"endpoint_url": "http://127.0.0.1:8333"}, {"client_kwargs": {"endpoint_url": "http://10.0.0.1"}}]
    places = []
    for o in opts:
        with fastckpt.Checkpointer(local_dir=nv, storage_options=o) as ck:
            places.append(ck.local_path(url))
            path = ck.local_path("/s3/b/run/last.pt")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")  # the same store as opts[1]
    with fastckpt.Checkpointer(local_dir=nv) as ck:
        assert ck.local_path(url) == places[1]
    assert places[0] == os.path.join(nv, "s3", "b", "run", "last.pt")  # the default endpoint's, as before
    assert len({*places, path}) == 4 and all(p.startswith(nv + os.sep) for p in (*places, path))


def test_a_copys_path_is_read_back_with_its_store_tag_dropped_and_an_old_one_as_it_is() -> None:
    """Event-log readers match a copy's path with its home's ``scheme/rest`` (``urls.untagged``): a
    copy placed by its store (``s3@<10 hex>``) and one from a log before stores were told apart."""
    from fastckpt.urls import mirror_path, untagged

    home = "s3://b/run/last.pt"
    assert untagged(mirror_path("/nv", home, "@0123456789")).endswith("s3/b/run/last.pt")
    for old in ("/nv/s3/b/run/last.pt", "/nv/me@0123456789a/x.pt", "/nv/s3@0123/b/k.pt",
                "/runs/run@1765000000/step-1/r0.pt"):  # a run folder named for a Unix time: no store's tag
        assert untagged(old) == old


def test_one_endpoint_spelt_two_ways_is_one_burst_buffer_place(tmp_path: Path) -> None:
    """A restarted run that writes its store's endpoint another way (``:80`` spelt out, ``HTTP://``,
    a trailing '/') got another place: it missed the copies the first run left (never trimmed by
    ``keep_local``, never loaded from). A host name and its IP address are still two places."""
    nv, url = str(tmp_path / "nvme"), "s3://b/run/last.pt"

    def place(endpoint: str) -> str:
        with fastckpt.Checkpointer(local_dir=nv, storage_options={"endpoint_url": endpoint}) as ck:
            return ck.local_path(url)

    for a, b in [("http://127.0.0.1:80", "http://127.0.0.1"), ("https://store:443", "https://store/"),
                 ("HTTP://Store:8333", "http://store:8333/"), ("http://[::1]:80", "http://[::1]")]:
        assert place(a) == place(b), (a, b)
    for a, b in [("http://store", "http://127.0.0.1"), ("http://store:443", "https://store"),
                 ("http://store:8333", "http://store:8334")]:
        assert place(a) != place(b), (a, b)


def test_latest_of_a_file_tells_of_its_own_damaged_sidecar_not_of_its_neighbours(tmp_path: Path, caplog) -> None:
    """latest() of one file scans its folder but judges that file alone: a damaged neighbour is not
    told of (10726ce); the file's own damaged sidecar is (that commit silenced it too, v14)."""
    import uuid

    import fsspec

    bucket = f"fastckpt-{uuid.uuid4().hex[:8]}"
    root, fs = f"memory://{bucket}/run", fsspec.filesystem("memory")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        for name in ("a", "b", "c"):
            ck.save(_state(1), f"{root}/{name}.pt").wait()
    for name in ("b", "c"):
        fs.pipe_file(f"/{bucket}/run/{name}.pt.fastckpt.json", b'{"written_at": 1')  # partial copies
    with caplog.at_level("WARNING", logger="fastckpt"):
        assert fastckpt.latest(f"{root}/b.pt") == f"{root}/b.pt"
    told = [r.getMessage() for r in caplog.records]
    assert any("b.pt.fastckpt.json is damaged" in m for m in told), told
    assert not any("c.pt" in m for m in told), told
