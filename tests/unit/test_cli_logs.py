"""The commands that read event logs (report, plan --from-run, serve-metrics) against paths that
are no log: a named pipe never blocks them, and report never writes its output over a log it
reads. The exporter's URL is one a scraper can parse, for an IPv6 address too."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import urllib.parse
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli
from fastckpt.eventlog import LogFollower


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "events.jsonl"
    with fastckpt.Checkpointer(event_log=str(path)) as ck:
        ck.save({"w": torch.zeros(1024)}, str(tmp_path / "a.pt")).wait()
    return path


@pytest.mark.timeout(60)
def test_a_named_pipe_nothing_writes_never_blocks_a_reader(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """open() of a pipe nothing writes blocks for ever: each command hung with no message. Read
    whole, it is empty (report and plan say there are no events); followed, it is refused."""
    pipe = str(tmp_path / "events.jsonl")
    os.mkfifo(pipe)
    for args, said in ((["report", pipe], "no events"),
                       (["plan", "--from-run", pipe, "--bandwidth", "1GB/s"], "is empty (no event)"),
                       (["serve-metrics", "--event-log", pipe, "--once"], "not a regular file")):
        res = _run(*args)
        assert res.exit_code == 2 and said in res.output, (args, res.output)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        follower = LogFollower(pipe)
        assert follower.poll() == [] and follower.poll() == []
    assert caplog.text.count("not a regular file") == 1  # said once, not at every poll


@pytest.mark.timeout(60)
def test_report_reads_a_pipe_its_writer_fills(tmp_path: Path, log: Path) -> None:
    """report <(zcat events.jsonl.gz): the pipe's writer is there, and its events are read."""
    pipe = str(tmp_path / "piped.jsonl")
    os.mkfifo(pipe)
    data = log.read_bytes()

    def write() -> None:
        with open(pipe, "wb") as f:  # blocks until the reader opens its end
            f.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    fd = os.open(pipe, os.O_RDONLY)  # the reader's end, opened first as a shell's <(...) has it: no race
    try:
        res = _run("report", f"/dev/fd/{fd}", "--json")
    finally:
        writer.join(30)
        os.close(fd)
    assert res.exit_code == 0 and json.loads(res.stdout)["saves"] == 1, res.output


@pytest.mark.parametrize("flag", ["-o", "--html"])
def test_report_never_writes_over_a_log_it_reads(tmp_path: Path, log: Path, flag: str) -> None:
    before = log.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(log)
    hard = tmp_path / "results" / "run.html"  # a job script's hard link of the log: realpath cannot see it
    hard.parent.mkdir()
    os.link(log, hard)
    for out in (str(log), str(link), str(hard)):
        res = _run("report", str(log), flag, out)
        assert res.exit_code == 2 and "is an event log this report reads" in res.output, res.output
    assert log.read_bytes() == before


def test_report_refuses_one_file_for_both_outputs(tmp_path: Path, log: Path) -> None:
    out = str(tmp_path / "r.png")
    res = _run("report", str(log), "-o", out, "--html", out)
    assert res.exit_code == 2 and "given for both -o and --html" in res.output, res.output


def test_report_figure_is_named_png_and_small_runs_are_not_zero_bytes(tmp_path: Path, log: Path) -> None:
    """-o report.pdf wrote PNG bytes under that name and said "figure: report.pdf"; a run of a few
    hundred kB said "0.000 GB committed"."""
    for name in ("r.pdf", "r.svg", "r"):
        res = _run("report", str(log), "-o", str(tmp_path / name))
        assert res.exit_code == 2 and "the figure is a PNG; name it *.png" in res.output, res.output
        assert not (tmp_path / name).exists()
    res = _run("report", str(log))  # one save of 4 kB
    assert re.search(r" \d[\d.]* kB committed;", res.output) and "0.000 GB" not in res.output, res.output


def test_the_exporters_url_of_an_ipv6_address_parses(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from fastckpt.metrics import LogExporter

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    exporter = LogExporter([str(tmp_path / "e.jsonl")], 0, "::1")
    try:
        parts = urllib.parse.urlsplit(exporter.url)
        assert parts.hostname == "::1" and parts.port == exporter.port, exporter.url
    finally:
        exporter.close()
