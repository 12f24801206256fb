"""Bad input to doctor, drill, latest, ls, verify and bench: exit 2 (1 for a path that does not
exist or holds no checkpoint) with a message that names the problem and the fix, never a
traceback. Real files and processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastckpt.cli", *args], capture_output=True, text=True, timeout=120)


def _refused(res: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert res.returncode == code, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


def test_doctor_storage_options_file_that_is_not_json(tmp_path: Path) -> None:
    for name, data in (("opts.txt", b"endpoint_url=http://x\n"), ("opts.bin", b"\xff\xfe\x00")):
        f = tmp_path / name
        f.write_bytes(data)
        _refused(_cli("doctor", "--storage-options", str(f), "--probe-size", "0"), 2,
                 f"{f} is not a JSON file", "endpoint_url")


def test_doctor_target_that_is_a_file(tmp_path: Path) -> None:
    """It said "cannot write in FILE: File exists" with the fix "create FILE", which exists."""
    (tmp_path / "file").write_text("x")
    _refused(_cli("doctor", "--target", str(tmp_path / "file"), "--probe-size", "0"), 2,
             "--target", f"{tmp_path / 'file'} is a file: give the directory checkpoints are saved in")
    _refused(_cli("doctor", "--local-dir", str(tmp_path / "file"), "--probe-size", "0"), 2,
             "--local-dir", f"{tmp_path / 'file'} is a file: give the burst buffer's directory")


def test_drill_local_dir_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _refused(_cli("drill", "--dir", str(tmp_path / "home"), "--local-dir", str(tmp_path / "file" / "x"),
                  "--trials", "1"), 2, "--local-dir", "Not a directory", "give a directory path")


def test_drill_command_that_does_not_exist(tmp_path: Path) -> None:
    for cmd in ("fastckpt-no-such-program", str(tmp_path / "missing.sh")):
        _refused(_cli("drill", "--dir", str(tmp_path / "home"), "--trials", "1", "--", cmd), 2,
                 f"not found or not executable: {cmd!r}")


def test_latest_of_a_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    _refused(_cli("latest", str(missing)), 1, f"{missing} does not exist")
    _refused(_cli("latest", str(tmp_path)), 1, "no complete checkpoint")


def test_bench_the_same_dir_twice(tmp_path: Path) -> None:
    _refused(_cli("bench", "--dir", str(tmp_path), "--dir", f"{tmp_path}/", "--size", "1MiB", "--block-size", "1MiB"),
             2, "given twice", "give each directory once")


def test_a_malformed_url_or_an_unknown_scheme_is_named(tmp_path: Path) -> None:
    for url, args in (("http://[::1", ["ls"]), ("http://[::1", ["verify"]), ("foo://bar/x", ["latest"]),
                      ("foo://bar/x", ["ls"]), ("http://[::1", ["drill", "--local-dir", str(tmp_path / "bb"), "--dir"]),
                      ("foo://bar", ["doctor", "--probe-size", "0", "--target"])):
        _refused(_cli(*args, url), 2, f"'{url}'", "s3://bucket/prefix")
    assert not (tmp_path / "bb").exists()
    from fastckpt.urls import check_url  # fsspec's chained URLs and upper-case schemes are no typos

    assert check_url("simplecache::s3://b/x") == "simplecache::s3://b/x" and check_url("S3://b/x") == "S3://b/x"


def test_ls_and_verify_of_a_path_that_does_not_exist_or_is_not_a_checkpoint(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    for cmd in ("ls", "verify"):
        _refused(_cli(cmd, str(missing)), 1, f"{missing} does not exist")
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    _refused(_cli("verify", str(notes)), 1, f"{notes} is not a complete fastckpt checkpoint")
    _refused(_cli("ls", str(notes)), 1, f"{notes} is a file", f"fastckpt verify {notes}")
