"""``fastckpt report`` on the event log of a real run: the PNG opens, the HTML page is
self-contained, and the summary's numbers are the log's (and the SaveRecords')."""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import json
import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from fastckpt import Checkpointer, CheckpointWriteError
from fastckpt.testing import Fault, FaultyOps
from tests.cli_child import CliChild
from tests.helpers import tmpfs

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402 (matplotlib brings pillow)

SAVES = 5


Report = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def report(cli_child: CliChild) -> Report:
    """``fastckpt report ARGS``, run in the child this module's reports share: a child each spent
    most of this file's time starting Python and importing torch, the CLI and matplotlib."""
    return functools.partial(cli_child.run, "report")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """Five saves through a burst buffer, a sixth whose write fails (EIO), and a load."""
    root = tmp_path_factory.mktemp("report")
    log = root / "events.jsonl"
    ops = FaultyOps()
    recs = []
    with Checkpointer(local_dir=str(root / "bb"), event_log=str(log), ops=ops) as ck:
        for i in range(SAVES):
            recs.append(ck.save({"w": torch.randn(256 * 1024), "i": i}, str(root / "home" / f"s{i}.pt")).wait())
        ops.inject(Fault("pwrite", errno.EIO))
        with pytest.raises(CheckpointWriteError):
            ck.save({"w": torch.randn(1024)}, str(root / "home" / "bad.pt")).wait()
        ck.load(str(root / "home" / "s1.pt"))
    ops.assert_all_reached()
    return log, recs


def _log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_summary_numbers_match_the_log_and_the_records(report: Report, run: tuple[Path, list]) -> None:
    log, recs = run
    res = report(str(log), "--json")
    assert res.returncode == 1, res.stderr  # a save failed: the check fails
    got = json.loads(res.stdout)
    events = _log(log)
    snaps = [e for e in events if e["name"] == "snapshot"]
    assert got["events"] == len(events)
    assert got["saves"] == len(snaps) == SAVES + 1
    assert got["failed"] == 1 and got["failures"] == {"write: CheckpointWriteError": 1}
    assert got["durable"] == SAVES and got["pending"] == 0 and got["tiers"] == {"nvme": SAVES + 1}
    assert got["bytes"] == sum(r.bytes for r in recs)
    blocked = [e["end"] - e["start"] for e in snaps]
    for q in ("p50", "p90", "p99"):
        assert got["blocked_s"][q] == pytest.approx(np.percentile(blocked, int(q[1:])))
    assert got["blocked_s"]["max"] == pytest.approx(max(r.blocked_s for r in recs), abs=0.02)
    assert got["durable_s"]["max"] == pytest.approx(max(r.durable_s for r in recs), abs=0.05)
    assert got["durable_s"]["count"] == SAVES
    assert got["replication_lag_s"]["count"] == SAVES
    assert got["loads"]["count"] == 1
    (rank,) = got["ranks"]
    assert rank["saves"] == SAVES + 1 and rank["blocked_s"] == pytest.approx(sum(blocked))
    assert got["alarms"] == rank["alarms"] >= 0


def test_png_and_self_contained_html(report: Report, run: tuple[Path, list], tmp_path: Path) -> None:
    log, _ = run
    png, page = tmp_path / "report.png", tmp_path / "report.html"
    res = report(str(log), "-o", str(png), "--html", str(page), "--overhead-budget", "0.5")
    assert res.returncode == 1, res.stderr
    assert "6 saves (nvme 6) by 1 rank(s)" in res.stdout and "failures: write: CheckpointWriteError x1" in res.stdout
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] >= 800 and im.size[1] >= 600
    html = page.read_text()
    (b64,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert base64.b64decode(b64) == png.read_bytes()
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing fetched from elsewhere
    assert "<script" not in html


def test_html_alone_and_bad_input(report: Report, run: tuple[Path, list], tmp_path: Path) -> None:
    log, _ = run
    page = tmp_path / "only.html"
    assert report(str(log), "--html", str(page)).returncode == 1
    assert "data:image/png;base64," in page.read_text()
    assert list(tmp_path.iterdir()) == [page]  # the PNG it embedded was not left behind
    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    res = report(str(bad))
    assert res.returncode == 2 and "not JSON" in res.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert report(str(empty)).returncode == 2
    assert report(str(tmp_path / "missing.jsonl")).returncode == 2


def test_a_clean_run_passes(report: Report, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log)) as ck:
        ck.save({"w": torch.randn(1024)}, str(tmp_path / "a.pt")).wait()
    res = report(str(log))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "overhead n/a (fewer than 2 saves)" in res.stdout


def test_a_group_removed_before_its_commit_is_no_failure(report: Report, tmp_path: Path) -> None:
    """docs/report.md: exit 1 when a group commit failed, not one ended by ``remove()``. The file
    saved into the removed group is abandoned (not pending, not failed). Before: the group's
    GroupRemovedError failed its file too, and the report exited 1."""
    from fastckpt.errors import GroupRemovedError

    log = tmp_path / "events.jsonl"
    g = tmp_path / "run" / "step-1"
    with Checkpointer(event_log=str(log)) as ck:
        ck.save({"w": torch.randn(1024)}, str(g / "r0.pt"), group=str(g)).wait()
        ck.remove(str(g))
        with pytest.raises(GroupRemovedError):
            ck.commit(str(g)).wait()
    assert [(e["name"], (e.get("error") or "")[:17]) for e in _log(log) if e.get("detail") == "group"] == \
        [("committing", ""), ("commit", "GroupRemovedError")]
    res = report(str(log), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert (out["durable"], out["pending"], out["abandoned"], out["failed"]) == (0, 0, 1, 0)
    assert out["failures"] == {"commit: GroupRemovedError": 1}


@pytest.mark.parametrize("flag", ["-o", "--html"])
def test_a_figure_without_matplotlib_is_a_usage_error(run: tuple[Path, list], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    """Before: the log was read, then drawing raised ModuleNotFoundError with a traceback and no
    summary. Now: exit 2 at once, naming the extra to install."""
    from click.testing import CliRunner

    from fastckpt.cli import cli

    log, _ = run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra has
    out = tmp_path / ("out.png" if flag == "-o" else "out.html")
    res = CliRunner().invoke(cli, ["report", str(log), flag, str(out)])
    assert res.exit_code == 2, res.output
    assert f"{flag}: fastckpt report draws with matplotlib: pip install 'fastckpt[report]'" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert not out.exists()


def test_an_output_in_a_missing_directory_is_named_without_a_traceback(report: Report, run: tuple[Path, list],
                                                                        tmp_path: Path) -> None:
    log, _ = run
    for flag, name in (("-o", "x.png"), ("--html", "x.html")):
        target = tmp_path / "missing" / name
        res = report(str(log), flag, str(target))
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"{target}: the directory {target.parent} does not exist" in res.stderr
        assert ".html.png" not in res.stderr


@pytest.mark.parametrize("flag, name, options, fix", [
    ("--html", "r.html", "size=1m,ro", "its filesystem is read-only: give a path on a writable one"),
    ("-o", "r.png", "size=1m,ro", "its filesystem is read-only: give a path on a writable one"),
    ("--html", "r.html", "size=4k", "free space there, or give a path elsewhere"),
])
def test_an_output_that_cannot_be_written_is_bad_usage_not_a_failed_run(report: Report, tmp_path: Path, flag: str,
                                                                          name: str, options: str, fix: str) -> None:
    """docs/report.md keeps exit 1 for a failed save or group commit or a fired alarm: a clean
    run whose page could not be written (a read-only filesystem, a full one) exited 1."""
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log)) as ck:
        ck.save({"w": torch.randn(1024)}, str(tmp_path / "a.pt")).wait()
    assert report(str(log)).returncode == 0
    with tmpfs(tmp_path / "out", options) as out:
        if "ro" not in options.split(","):
            with contextlib.suppress(OSError), open(out / "fill", "wb") as f:
                f.write(b"\0" * (1 << 20))  # fill what the tmpfs holds
        res = report(str(log), flag, str(out / name))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"Invalid value for {flag}: cannot write {out / name} (" in res.stderr and fix in res.stderr, res.stderr


@pytest.mark.parametrize("flag, name", [("-o", "r.png"), ("--html", "r.html")])
def test_a_write_that_fails_midway_leaves_the_previous_output_whole(report: Report, run: tuple[Path, list],
                                                                    tmp_path: Path, flag: str, name: str) -> None:
    """The output was opened in place (truncated) and written: a write that failed or was killed
    midway (here: the filesystem filled) left a part of the new file where the previous report
    was. Now a temp beside it is written, fsynced and renamed over it, or removed."""
    log, _ = run
    with tmpfs(tmp_path / "out", "size=2m") as out:
        (out / name).write_bytes(b"the previous report")
        with contextlib.suppress(OSError), open(out / "fill", "wb") as f:
            f.write(b"\0" * (4 << 20))  # fill what the tmpfs holds
        res = report(str(log), flag, str(out / name))
        assert res.returncode == 2 and "free space there" in res.stderr, res.stderr
        assert (out / name).read_bytes() == b"the previous report"
        assert sorted(p.name for p in out.iterdir()) == ["fill", name]  # no temp left behind
        (out / "fill").unlink()
        assert report(str(log), flag, str(out / name)).returncode == 1  # room again: replaced whole
        assert (out / name).read_bytes().startswith(b"\x89PNG" if flag == "-o" else b"<!DOCTYPE html>")
        assert sorted(p.name for p in out.iterdir()) == [name]


def test_a_page_into_a_pipe_whose_reader_left_is_a_closed_stdout_not_bad_usage(tmp_path: Path) -> None:
    """``report LOG --html /dev/stdout | head -c 100``: the reader gone, the write fails with EPIPE. It
    exited 2 with "make its directory writable by this user": neither bad usage nor a permission
    problem. Now it ends as the report's text into a closed stdout does: quiet, click's exit 1."""
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log), overhead_budget=0.99) as ck:
        ck.save({"w": torch.randn(1024)}, str(tmp_path / "a.pt")).wait()
    ended = []
    for args in (["--html", "/dev/stdout"], []):
        r, w = os.pipe()
        os.close(r)  # the reader has exited
        try:
            res = subprocess.run([sys.executable, "-m", "fastckpt", "report", str(log), *args], stdout=w,
                                 stderr=subprocess.PIPE, text=True, timeout=300)
        finally:
            os.close(w)
        ended.append((res.returncode, res.stderr))
    assert ended == [(1, ""), (1, "")]


def test_html_leaves_a_users_file_beside_it_alone(report: Report, run: tuple[Path, list], tmp_path: Path) -> None:
    log, _ = run
    mine = tmp_path / "page.html.png"
    mine.write_bytes(b"the user's own file")
    assert report(str(log), "--html", str(tmp_path / "page.html")).returncode == 1
    assert mine.read_bytes() == b"the user's own file"


def test_a_binary_log_is_named(report: Report, tmp_path: Path) -> None:
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b'\x89PNG\r\n\x1a\n\x00\xff\n')
    res = report(str(bad))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{bad}:" in res.stderr and "not UTF-8" in res.stderr


def test_a_long_runs_log_is_drawn(report: Report, tmp_path: Path) -> None:
    """20,000 saves (100,000 events) of four ranks: one artist per phase never finished."""
    from fastckpt.events import Event

    log = tmp_path / "long.jsonl"
    t = 1.7e9
    with open(log, "w") as f:
        for i in range(20_000):
            p = f"/h/s{i}.pt"
            for name, a, b, path in (("snapshot", 0, 0.01, p), ("write", 0.01, 0.2, "/bb" + p),
                                     ("commit", 0.2, 0.21, "/bb" + p), ("queued", 0.21, 0.21, p),
                                     ("replicate", 0.22, 0.5, p)):
                f.write(Event(name, i % 4, path, 1000, t + a, t + b, "nvme").to_json() + "\n")
            t += 1.0
    png = tmp_path / "long.png"
    res = report(str(log), "-o", str(png))
    assert res.returncode == 0, res.stderr
    assert "20000 saves (nvme 20000) by 4 rank(s)" in res.stdout
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] >= 800


def test_over_the_log_spans_the_group_commit(report: Report, tmp_path: Path) -> None:
    """docs/report.md: over the log = blocked / (the last event's end - the first save's start), in one session."""
    from fastckpt.events import Event

    log = tmp_path / "events.jsonl"
    evs = []
    for t in (0.0, 10.0):
        p = f"/h/g{t}/a.pt"
        evs += [Event("snapshot", 0, p, 10, 100 + t, 101 + t, "direct"),
                Event("commit", 0, p, 10, 101 + t, 102 + t, "direct")]
    evs.append(Event("commit", 0, "/h/g10.0", 20, 112, 140, "direct", detail="group"))
    log.write_text("".join(e.to_json() + "\n" for e in evs))
    res = report(str(log), "--json")
    (rank,) = json.loads(res.stdout)["ranks"]
    assert rank["log_overhead"] == pytest.approx(2.0 / 40.0)


def test_over_the_log_leaves_out_the_gap_between_a_killed_job_and_its_resume(report: Report, tmp_path: Path) -> None:
    """A resumed job appends to the killed one's log: each session counts from its first save to
    its last event; the hour in between was no run time (before: 4 s blocked over 3,620 s)."""
    from fastckpt.events import Event

    log = tmp_path / "events.jsonl"
    evs = []
    for session, t0 in (("a" * 12, 100.0), ("b" * 12, 3700.0)):
        for t in (0.0, 10.0):
            p = f"/h/s{t0 + t}.pt"
            evs += [Event("snapshot", 0, p, 10, t0 + t, t0 + t + 1, "direct", session=session),
                    Event("commit", 0, p, 10, t0 + t + 1, t0 + t + 2, "direct", session=session)]
    log.write_text("".join(e.to_json() + "\n" for e in evs))
    res = report(str(log), "--json")
    (rank,) = json.loads(res.stdout)["ranks"]
    assert rank["log_overhead"] == pytest.approx(4.0 / (12.0 + 12.0))


def test_an_output_that_is_no_regular_file_is_streamed_and_a_replaced_one_keeps_its_mode(
        report: Report, run: tuple[Path, list], tmp_path: Path) -> None:
    """bb275c0 published every output by temp and rename through its realpath: a named pipe (or
    ``>(gzip > f)``, ``/dev/stdout``) was replaced by a regular file while its reader waited for
    ever (as root, a device node too), a private 0600 report became 0644, and ``--html reports/``
    wrote a file named ``reports``."""
    log, _ = run
    pipe = tmp_path / "pipe.html"
    os.mkfifo(pipe)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
    reader.start()
    try:
        assert report(str(log), "--html", str(pipe)).returncode == 1
    finally:
        reader.join(timeout=60)
    assert got and got[0].startswith(b"<!DOCTYPE html>") and stat.S_ISFIFO(os.stat(pipe).st_mode)
    res = subprocess.run([sys.executable, "-m", "fastckpt", "report", str(log), "--html", "/dev/stdout"],
                         capture_output=True, timeout=300)  # its realpath, /proc/PID/fd/pipe:[N], names nothing
    assert res.returncode == 1 and b"<!DOCTYPE html>" in res.stdout, res.stderr[-2000:]
    private = tmp_path / "private.html"
    private.write_bytes(b"the previous report")
    private.chmod(0o600)
    assert report(str(log), "--html", str(private)).returncode == 1
    assert private.read_bytes().startswith(b"<!DOCTYPE html>") and stat.S_IMODE(private.stat().st_mode) == 0o600
    res = report(str(log), "--html", f"{tmp_path / 'reports'}/")
    assert res.returncode == 2 and "names a folder: give a file in it" in res.stderr, res.stderr
    assert not (tmp_path / "reports").exists()
