"""Bad input to doctor, drill, latest and bench: exit 2 (1 for latest, as for no checkpoint)
with a message that names the problem and the fix, never a traceback. Real files and processes."""

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
