"""The Prometheus exporter, scraped over HTTP on loopback during and after real saves.

``Checkpointer(metrics_port=0)`` serves in the process; ``fastckpt serve-metrics`` follows the
event log of a Checkpointer from another process. Values are checked against SaveRecords.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import Checkpointer, CheckpointWriteError, CommitTimeoutError, sysinfo
from fastckpt.io.atomic import TMP_TAG
from fastckpt.metrics import sample_names
from fastckpt.report import load_run
from fastckpt.testing import Fault, FaultyOps
from tests.cli_child import CliChild
from tests.integration._fork_server import ForkServer

from ._scrape import names, scrape, value

pytest.importorskip("prometheus_client")
R0 = {"rank": "0"}


Serve = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def serve(cli_child: CliChild) -> Serve:
    """``fastckpt serve-metrics ARGS``, run in the child this module's one-shot commands share: a
    child each spent most of their time starting Python and importing torch and the CLI. The
    exporter that follows a running job's log keeps a process of its own."""
    return functools.partial(cli_child.run, "serve-metrics")


def _state(n: int = 256 * 1024) -> dict:
    return {"w": torch.randn(n), "step": 1}


def test_scrape_during_and_after_a_real_save(tmp_path: Path) -> None:
    """While the replication of a save is held: it is pending and lagging; once durable, the
    counters and histograms equal its SaveRecord."""
    local, home = tmp_path / "bb", tmp_path / "home"
    ops = FaultyOps()
    with Checkpointer(local_dir=str(local), metrics_port=0, ops=ops) as ck:
        assert ck.metrics_url.startswith("http://127.0.0.1:")
        before = scrape(ck.metrics_url)
        assert value(before, "fastckpt_saves_total", **R0) is None  # no save yet: no series, not 0
        gate = ops.gate("preadv", path_contains=str(local))  # holds the copy to the home path
        handle = ck.save(_state(), str(home / "a.pt"))
        assert gate.wait_entered()
        during = scrape(ck.metrics_url)
        lab = {"rank": "0", "tier": "nvme"}
        assert value(during, "fastckpt_saves_total", **lab) == 1
        assert value(during, "fastckpt_pending_saves", **R0) == 1
        assert value(during, "fastckpt_replication_pending_saves", **R0) == 1
        assert value(during, "fastckpt_replication_lag_seconds", **R0) > 0
        assert value(during, "fastckpt_rpo_seconds", **R0) is None  # nothing replicated yet
        assert value(during, "fastckpt_replicated_bytes_total", **lab) is None
        gate.open()
        rec = handle.wait()
        stats = ck.stats()
        after = scrape(ck.metrics_url)
    assert value(after, "fastckpt_saved_bytes_total", **lab) == rec.bytes
    assert value(after, "fastckpt_replicated_bytes_total", **lab) == rec.bytes
    assert value(after, "fastckpt_save_blocked_seconds_count", **lab) == 1
    assert value(after, "fastckpt_save_blocked_seconds_sum", **lab) == pytest.approx(rec.blocked_s, abs=0.02)
    assert value(after, "fastckpt_last_save_blocked_seconds", **lab) == pytest.approx(rec.blocked_s, abs=0.02)
    assert value(after, "fastckpt_save_durable_seconds_sum", **lab) == pytest.approx(rec.durable_s, abs=0.05)
    assert value(after, "fastckpt_save_write_seconds_count", **lab) == 1
    assert value(after, "fastckpt_replicate_seconds_count", **lab) == 1
    assert value(after, "fastckpt_pending_saves", **R0) == 0
    assert value(after, "fastckpt_replication_lag_seconds", **R0) == 0
    assert value(after, "fastckpt_rpo_seconds", **R0) > 0
    assert value(after, "fastckpt_overhead_budget_ratio", **R0) == 0.02
    assert value(after, "fastckpt_overhead_alarm", **R0) == float(stats.over_budget)
    assert value(after, "fastckpt_overhead_alarms_total", **R0) == stats.alarms
    assert 0 < value(after, "fastckpt_overhead_ratio", rank="0", window="run") <= stats.overhead
    assert value(after, "fastckpt_write_bandwidth_bytes_per_second", **lab) > 0
    assert names(after) <= sample_names()  # every sample is a documented family


def test_both_exporters_and_the_report_count_a_replication_still_running_as_pending(tmp_path: Path) -> None:
    """Two replication workers: held.pt's upload is held while next.pt, saved after it, replicates.
    The in-process exporter (``stats()``), ``serve-metrics``' replay of the log and the report all
    count held.pt pending. Before: next.pt's replicate made the replay take held.pt as coalesced
    away (pending 0, 1 superseded), though it was being copied, not dropped."""
    from fastckpt.metrics import LogExporter

    local, home, log = tmp_path / "bb", tmp_path / "home", tmp_path / "events.jsonl"
    ops = FaultyOps()
    gate = ops.gate("preadv", path_contains="held.pt")  # held.pt's copy to its home
    with Checkpointer(local_dir=str(local), metrics_port=0, ops=ops, event_log=str(log), replicate_workers=2,
                      overhead_budget=0.99) as ck:
        held = ck.save(_state(1024), str(home / "held.pt"))
        try:
            assert gate.wait_entered()
            ck.save(_state(1024), str(home / "next.pt")).wait()  # its replicate event is logged before it resolves
            exporter = LogExporter([str(log)], 0, "127.0.0.1")
            try:
                in_process, replay = scrape(ck.metrics_url), scrape(exporter.url)
            finally:
                exporter.close()
            stats, (_, summary) = ck.stats(), load_run([str(log)], budget=0.99)
        finally:
            gate.open()
        assert stats.pending == value(in_process, "fastckpt_pending_saves", **R0) == 1
        assert value(replay, "fastckpt_pending_saves", **R0) == 1  # was 0
        assert value(replay, "fastckpt_replication_pending_saves", **R0) == 1
        assert (summary.durable, summary.pending, summary.superseded) == (1, 1, 0)  # was (1, 0, 1)
        assert held.wait(60).durable_s is not None
    _, summary = load_run([str(log)], budget=0.99)
    assert (summary.durable, summary.pending, summary.superseded) == (2, 0, 0)


def test_storage_health_absent_sources_are_not_zeros(tmp_path: Path) -> None:
    local = tmp_path / "bb"
    with Checkpointer(local_dir=str(local), metrics_port=0) as ck:
        ck.save(_state(1024), str(tmp_path / "home" / "a.pt")).wait()
        got = scrape(ck.metrics_url)
    smart = sysinfo.read_smart()
    assert value(got, "fastckpt_health_source_available", source="nvme_smart") == (1.0 if smart else 0.0)
    nvme = {n for n in names(got) if n.startswith("fastckpt_nvme_")}
    if not smart:
        assert nvme == set()  # absent, never zeros
    assert value(got, "fastckpt_health_source_available", source="iowait") == 1.0
    assert value(got, "fastckpt_node_iowait_seconds_total") > 0
    assert 0 <= value(got, "fastckpt_node_iowait_ratio") <= 1
    space = sysinfo.space(str(local))
    free = value(got, "fastckpt_filesystem_free_bytes", role="burst_buffer", mountpoint=space.mountpoint)
    assert free == pytest.approx(space.free, rel=0.05)
    assert value(got, "fastckpt_filesystem_size_bytes", role="target", mountpoint=space.mountpoint) == space.size


def test_direct_tier_has_no_burst_buffer_series(tmp_path: Path) -> None:
    with Checkpointer(metrics_port=0) as ck:
        rec = ck.save(_state(1024), str(tmp_path / "a.pt")).wait()
        got = scrape(ck.metrics_url)
    assert value(got, "fastckpt_health_source_available", source="burst_buffer_space") == 0
    assert value(got, "fastckpt_filesystem_free_bytes", role="burst_buffer") is None
    assert value(got, "fastckpt_saved_bytes_total", rank="0", tier="direct") == rec.bytes
    assert value(got, "fastckpt_save_durable_seconds_sum", rank="0", tier="direct") == pytest.approx(
        rec.durable_s, abs=0.05)
    assert value(got, "fastckpt_replication_lag_seconds", **R0) == 0
    assert 0 <= value(got, "fastckpt_rpo_seconds", **R0) < 60  # durable at its path: the point a loss goes back to


def test_a_failed_write_is_counted_by_phase_and_type(tmp_path: Path) -> None:
    ops = FaultyOps([Fault("pwrite", errno.ENOSPC, path_contains=TMP_TAG)])  # the file's write, not the tier probe
    with Checkpointer(metrics_port=0, ops=ops) as ck:
        with pytest.raises(CheckpointWriteError):
            ck.save(_state(1024), str(tmp_path / "a.pt")).wait()
        got = scrape(ck.metrics_url)
    ops.assert_all_reached()
    failures = {lab: v for (n, lab), v in got.items() if n == "fastckpt_failures_total"}
    assert list(failures.values()) == [1.0]
    assert {("phase", "write"), ("error", "CheckpointWriteError")} <= set(next(iter(failures)))  # what was raised


def test_a_save_that_fails_at_the_call_is_counted_and_logged(serve: Serve, tmp_path: Path) -> None:
    """Its folder cannot be made (a file stands where it must be): save() raises CheckpointWriteError
    itself. A job that catches it to keep training was in no metric and no event; now it counts once,
    as a failed snapshot, in process, in serve-metrics' replay of the log and in the report."""
    (tmp_path / "run").write_text("a stray file named like the run's folder")
    log = tmp_path / "events.jsonl"
    with Checkpointer(metrics_port=0, event_log=str(log)) as ck:
        with pytest.raises(CheckpointWriteError), ck.one_save():  # a block whose only file failed: no save
            ck.save(_state(1024), str(tmp_path / "run" / "step-1.pt"))
        ck.save(_state(1024), str(tmp_path / "ok.pt")).wait()  # the job goes on
        got = scrape(ck.metrics_url)
    from ._scrape import parse

    replayed = parse(serve("--event-log", str(log), "--once").stdout)
    for metrics in (got, replayed):
        failures = {(dict(lab)["phase"], dict(lab)["error"]): v for (n, lab), v in metrics.items()
                    if n == "fastckpt_failures_total"}
        assert failures == {("snapshot", "CheckpointWriteError"): 1.0}, failures
        assert value(metrics, "fastckpt_saves_total", rank="0", tier="direct") == 1  # the save that failed is none
    _, summary = load_run([str(log)])
    assert summary.failures == {"snapshot: CheckpointWriteError": 1}
    assert "one_save" not in [json.loads(line)["name"] for line in log.read_text().splitlines()]


def test_a_failed_group_commit_is_counted_once(tmp_path: Path) -> None:
    """Rank 1 saved into the group but never commits: rank 0's commit times out. Before, a group
    commit emitted its event only on success, so neither fastckpt_failures_total nor the event
    log ``fastckpt report`` reads showed the failure; now each counts it once."""
    g, log = tmp_path / "G", tmp_path / "events.jsonl"
    ck1 = Checkpointer(rank=1, world_size=2, commit_timeout_s=60)
    try:
        with Checkpointer(rank=0, world_size=2, commit_timeout_s=0.5, metrics_port=0, event_log=str(log)) as ck0:
            for ck in (ck0, ck1):
                ck.save(_state(1024), str(g / f"r{ck.rank}.pt"), group=str(g)).wait(60)
            with pytest.raises(CommitTimeoutError, match=r"ranks \[1\] of 2 did not"):
                ck0.commit(str(g)).wait(60)
            got = scrape(ck0.metrics_url)
    finally:
        ck1.close()
    failures = {(dict(lab)["phase"], dict(lab)["error"]): v for (n, lab), v in got.items()
                if n == "fastckpt_failures_total"}
    assert failures == {("commit", "CommitTimeoutError"): 1.0}
    assert value(got, "fastckpt_group_commit_seconds_count", rank="0") is None  # a failure is no commit time
    _, summary = load_run([str(log)])
    assert summary.failures == {"commit: CommitTimeoutError": 1} and summary.group_commits == 0
    from click.testing import CliRunner

    from fastckpt.cli import cli

    got = CliRunner().invoke(cli, ["report", str(log)])
    assert got.exit_code == 1 and "commit: CommitTimeoutError x1" in got.output, got.output  # before: exit 0


def test_the_rpo_counts_a_group_once_published_from_its_files_saves(tmp_path: Path) -> None:
    """A group's files replicated from the burst buffer moved the RPO although the group was
    never published (another file failed); without a burst buffer the RPO counted from the
    commit() call, not from the saves whose state a node loss goes back to."""
    ops = FaultyOps()
    ops.inject(Fault("pwrite", errno.EIO, path_contains="optim"))
    with Checkpointer(local_dir=str(tmp_path / "nvme"), ops=ops, overhead_budget=0.99) as ck:
        g = str(tmp_path / "home" / "step-1")
        for name in ("model.pt", "optim.pt"):
            ck.save(_state(1024), f"{g}/{name}", group=g)
        with pytest.raises(CheckpointWriteError):
            ck.commit(g).wait(60)
        ck.wait()  # (the failure was raised once, by the commit)
        assert ck.stats().rpo_s is None  # nothing was published
    with Checkpointer(overhead_budget=0.99) as ck:
        g = str(tmp_path / "home2" / "step-1")
        handle = ck.save(_state(16 << 20), f"{g}/model.pt", group=g)  # 64 MiB: the write takes a while
        saved = time.time()  # the state's time is before this: save() returned with its snapshot
        handle.wait(60)
        commit_call = time.time()
        ck.commit(g).wait(60)
        asked = time.time()
        rpo, since_commit = ck.stats().rpo_s, asked - commit_call
        assert rpo > since_commit and rpo >= asked - saved  # from the save, not the commit
        g = str(tmp_path / "home2" / "step-2")  # a refused save, then the file saved twice: the last save counts
        with pytest.raises(fastckpt.UnsupportedObjectError):
            ck.save({"w": lambda: 0}, f"{g}/model.pt", group=g)
        ck.save(_state(16 << 20), f"{g}/model.pt", group=g).wait(60)
        last_save = time.time()
        ck.save(_state(16 << 20), f"{g}/model.pt", group=g).wait(60)
        ck.commit(g).wait(60)
        assert ck.stats().rpo_s <= time.time() - last_save


def test_a_port_past_the_last_one_for_this_local_rank_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's second rank on a node (LOCAL_RANK=1) with metrics_port=65535 would serve on
    65536: before, bind() raised a raw OverflowError from deep inside prometheus-client."""
    from fastckpt import ConfigError

    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"metrics_port=65535 with LOCAL_RANK=1 would serve on port 65536, past the "
                                          r"last TCP port 65535 .*65534 or lower.*metrics_port=0 for any free port"):
        Checkpointer(metrics_port=65535)


def test_port_in_use_names_the_fix(tmp_path: Path) -> None:
    from fastckpt import ConfigError

    with Checkpointer(metrics_port=0) as ck:
        port = int(ck.metrics_url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(ConfigError, match="LOCAL_RANK"):
            Checkpointer(metrics_port=port)


@pytest.mark.parametrize("bad", [-1, 65536, 1.5, "9400", True])
def test_metrics_port_is_validated(bad: object) -> None:
    from fastckpt import ConfigError

    with pytest.raises(ConfigError, match="metrics_port"):
        Checkpointer(metrics_port=bad)


def test_serve_metrics_follows_a_running_jobs_log(tmp_path: Path) -> None:
    """The standalone exporter, another process, follows the log while saves are appended. Its
    timed poll is an hour away: what each scrape shows, it read at that scrape."""
    log = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "fastckpt.cli", "serve-metrics", "--event-log", str(log), "--port", "0",
           "--addr", "127.0.0.1", "--poll-s", "3600", "--json", "--local-dir", str(tmp_path / "bb")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = json.loads(proc.stdout.readline())["url"]  # printed once it serves
        first = scrape(url)
        assert value(first, "fastckpt_saves_total", **R0) is None  # the log does not exist yet
        assert value(first, "fastckpt_health_source_available", source="burst_buffer_space") == 0  # nor the bb
        recs = []
        with Checkpointer(local_dir=str(tmp_path / "bb"), event_log=str(log)) as ck:
            for i in range(2):
                recs.append(ck.save(_state(), str(tmp_path / "home" / f"s{i}.pt")).wait())
                got = scrape(url)  # each scrape reads the log first: this save's events are in it
                assert value(got, "fastckpt_replicated_bytes_total", rank="0") == sum(r.bytes for r in recs)
                assert value(got, "fastckpt_saves_total", rank="0", tier="nvme") == i + 1
        lab = {"rank": "0", "tier": "nvme"}
        assert value(got, "fastckpt_saved_bytes_total", **lab) == sum(r.bytes for r in recs)
        assert value(got, "fastckpt_save_blocked_seconds_sum", **lab) == pytest.approx(
            sum(r.blocked_s for r in recs), abs=0.02)
        assert value(got, "fastckpt_save_durable_seconds_count", **lab) == 2
        assert value(got, "fastckpt_pending_saves", **R0) == 0
        assert value(got, "fastckpt_rpo_seconds", **R0) > 0
        assert value(got, "fastckpt_health_source_available", source="burst_buffer_space") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "bb does not exist: give the burst buffer's directory" in err  # said once, at the start


def test_serve_metrics_names_a_missing_log_and_an_unexpanded_pattern(serve: Serve, tmp_path: Path) -> None:
    """``--event-log '/logs/events-*.jsonl'`` (a Kubernetes args: list, a systemd unit: no shell to
    expand it) served an empty exporter for ever without a word. Now each missing log is named once
    at the start, and a name holding a glob character is said to be one, with the fix."""
    for r in (0, 1):
        with Checkpointer(event_log=str(tmp_path / f"events-{r}.jsonl")) as ck:
            ck.save(_state(1024), str(tmp_path / f"r{r}.pt")).wait()
    pattern, later = str(tmp_path / "events-*.jsonl"), str(tmp_path / "later.jsonl")
    cmd = [sys.executable, "-m", "fastckpt.cli", "serve-metrics", "--event-log", pattern, "--event-log", later,
           "--event-log", str(tmp_path / "events-0.jsonl"), "--port", "0", "--addr", "127.0.0.1", "--poll-s", "0.05",
           "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = json.loads(proc.stdout.readline())["url"]  # printed once it serves
        for _ in range(3):  # polled many times (and scraped): said once all the same
            assert value(scrape(url), "fastckpt_saves_total", **R0) == 1  # events-0.jsonl, given by name
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    for path in (pattern, later):
        assert err.count(f"the event log {path} does not exist; waiting for it to appear") == 1, err
    assert err.count("looks like a pattern no shell expanded") == 1, err
    assert f"{pattern} looks like a pattern no shell expanded (it matches 2 file(s): {tmp_path / 'events-0.jsonl'}, " \
           f"{tmp_path / 'events-1.jsonl'}): list each log with its own --event-log" in err
    once = serve("--event-log", pattern, "--once")
    assert once.returncode == 2 and "looks like a pattern no shell expanded" in once.stderr, once.stderr


def test_serve_metrics_once_prints_the_exposition(serve: Serve, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log)) as ck:
        rec = ck.save(_state(1024), str(tmp_path / "a.pt")).wait()
    text, as_json = serve("--event-log", str(log), "--once"), serve("--event-log", str(log), "--once", "--json")
    assert text.returncode == as_json.returncode == 0, text.stderr + as_json.stderr
    from ._scrape import parse

    got = parse(text.stdout)
    assert value(got, "fastckpt_saved_bytes_total", rank="0", tier="direct") == rec.bytes
    js = json.loads(as_json.stdout)
    assert js["events"] == 4 and js["ranks"][0]["pending"] == 0  # start, snapshot, write, commit
    assert os.path.exists(log)




def test_serve_metrics_once_on_a_log_that_does_not_exist_is_a_usage_error(serve: Serve, tmp_path: Path) -> None:
    """A server may start before its job writes the log; a one-shot read of a path that is not
    there is a typo, and printed zero events with exit 0."""
    r = serve("--event-log", str(tmp_path / "typo.jsonl"), "--once", "--json")
    assert r.returncode == 2 and "typo.jsonl does not exist" in r.stderr and r.stdout == ""


def test_serve_metrics_once_on_a_file_that_is_no_event_log_names_it(serve: Serve, tmp_path: Path) -> None:
    """A text, JSON or binary file given as --event-log printed zero events and exited 0: a
    monitoring check read "no saves" from a typo. It exits 1 naming the file, what is wrong and
    the fix; an empty log, and a real one whose last line a crash cut short, still read."""
    wrong = {"notes.txt": b"hello\nworld\n", "config.json": json.dumps({"lr": 0.1}).encode(),  # json.dump: no newline
             "rows.jsonl": b'{"step": 1}\n{"step": 2}\n', "blob.bin": bytes(range(256)) * 4,
             "zeros.bin": bytes(64)}
    for name, data in wrong.items():
        (tmp_path / name).write_bytes(data)
        for flags in ([], ["--json"]):
            r = serve("--event-log", str(tmp_path / name), "--once", *flags)
            assert r.returncode == 1 and r.stdout == "", (name, r.stdout, r.stderr)
            assert f"{tmp_path / name} is not a fastckpt event log: it holds no event ({tmp_path / name}:1: " \
                in r.stderr, r.stderr
            assert "Give --event-log the file a Checkpointer's event_log= writes" in r.stderr
    assert "missing name, rank, path" in serve("--event-log", str(tmp_path / "rows.jsonl"), "--once").stderr
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    r = serve("--event-log", str(empty), "--once", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["events"] == 0, r.stderr
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log)) as ck:
        ck.save(_state(1024), str(tmp_path / "a.pt")).wait()
    whole = log.read_bytes()
    lines = whole.count(b"\n")
    for cut in (len(whole) - 20, 30):  # a crash mid-write: the last line, or the only one, cut short
        log.write_bytes(whole[:cut])
        r = serve("--event-log", str(log), "--once", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["events"] == (lines - 1 if cut > 30 else 0)


def test_serve_metrics_once_refuses_a_local_dir_that_does_not_exist(serve: Serve, tmp_path: Path) -> None:
    """A misspelt --local-dir (or one not mounted in the exporter's container) reported the free
    space of the parent its path climbs to (/, here) as the burst buffer's."""
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log)) as ck:
        ck.save(_state(1024), str(tmp_path / "a.pt")).wait()
    r = serve("--event-log", str(log), "--local-dir", str(tmp_path / "nvme-typo"), "--once")
    assert r.returncode == 2 and r.stdout == ""
    assert f"{tmp_path / 'nvme-typo'} does not exist: give the burst buffer's directory" in r.stderr


def test_a_burst_buffer_that_is_not_here_is_absent_not_its_parents_space(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from fastckpt.metrics.collectors import NodeHealth

    from ._scrape import parse

    registry, bb = CollectorRegistry(auto_describe=False), tmp_path / "nvme" / "bb"
    registry.register(NodeHealth([str(bb)], lambda: []))
    got = parse(generate_latest(registry).decode())
    assert value(got, "fastckpt_health_source_available", source="burst_buffer_space") == 0
    assert value(got, "fastckpt_filesystem_free_bytes", role="burst_buffer") is None  # absent, never a number
    bb.mkdir(parents=True)  # created by the job's first save: from then on it is there
    got = parse(generate_latest(registry).decode())
    assert value(got, "fastckpt_health_source_available", source="burst_buffer_space") == 1
    assert value(got, "fastckpt_filesystem_free_bytes", role="burst_buffer") > 0


@pytest.fixture
def two_filesystems(tmp_path: Path) -> tuple[Path, Path]:
    """A directory under tmp_path and one in /dev/shm (tmpfs), where those are two file systems."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm") or sysinfo.space("/dev/shm").mountpoint == sysinfo.space(str(tmp_path)).mountpoint:
        pytest.skip("needs /dev/shm on a file system of its own")
    other = Path(tempfile.mkdtemp(prefix="fastckpt-test-", dir="/dev/shm"))
    yield tmp_path / "nvme0", other / "nvme1"
    shutil.rmtree(other, ignore_errors=True)


def test_a_striped_burst_buffer_exports_every_drives_free_space(two_filesystems: tuple[Path, Path],
                                                                 serve: Serve, tmp_path: Path) -> None:
    """local_dir=[a, b] on two file systems: both are burst_buffer series, in the process and from
    serve-metrics given --local-dir twice (only local_dir[0]'s, and the last --local-dir, were)."""
    drives = [str(d) for d in two_filesystems]
    mounts = {sysinfo.space(str(d.parent)).mountpoint for d in two_filesystems}
    log = tmp_path / "events.jsonl"
    with Checkpointer(local_dir=drives, metrics_port=0, event_log=str(log)) as ck:
        ck.save(_state(1024), str(tmp_path / "home" / "a.pt")).wait()
        got = scrape(ck.metrics_url)
    r = serve("--event-log", str(log), "--local-dir", drives[0], "--local-dir", drives[1], "--once")
    assert r.returncode == 0, r.stderr
    from ._scrape import parse

    for samples in (got, parse(r.stdout)):
        seen = {dict(lab)["mountpoint"] for (n, lab), _ in samples.items()
                if n == "fastckpt_filesystem_free_bytes" and dict(lab)["role"] == "burst_buffer"}
        assert seen == mounts


def test_two_burst_buffer_directories_on_one_file_system_are_one_series(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from fastckpt.metrics.collectors import NodeHealth

    from ._scrape import parse

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeHealth([str(tmp_path / "a"), str(tmp_path / "b")], lambda: []))
    got = parse(generate_latest(registry).decode())  # parse fails on a series that appears twice
    bb = [k for k in got if k[0] == "fastckpt_filesystem_free_bytes" and ("role", "burst_buffer") in k[1]]
    assert bb == [("fastckpt_filesystem_free_bytes",
                   (("mountpoint", sysinfo.space(str(tmp_path)).mountpoint), ("role", "burst_buffer")))]


def test_a_ramfs_burst_buffer_exports_no_free_space_rather_than_zero(tmp_path: Path) -> None:
    """A ramfs reports no size (statvfs f_blocks == 0): it has no limit. Before, its series said 0 bytes
    free of 0, and an alert on free space fired for a drive that cannot fill up before memory does."""
    from prometheus_client import CollectorRegistry, generate_latest

    from fastckpt.metrics.collectors import NodeHealth
    from tests.helpers import tmpfs

    from ._scrape import parse

    with tmpfs(tmp_path / "ram", "defaults", fstype="ramfs") as ram:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(NodeHealth([str(ram)], lambda: []))
        got = parse(generate_latest(registry).decode())
    assert value(got, "fastckpt_health_source_available", source="burst_buffer_space") == 1.0  # it was found
    assert [k for k in got if k[0].startswith("fastckpt_filesystem_") and ("mountpoint", str(ram)) in k[1]] == []


def test_a_line_that_is_not_an_event_is_skipped_while_serving(serve: Serve, tmp_path: Path) -> None:
    """A scrape, and the exporter's own poll, read past a bad line to the events after it."""
    from fastckpt.metrics import LogExporter

    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log)) as ck:
        ck.save(_state(1024), str(tmp_path / "a.pt")).wait()
    good = log.read_text()
    exporter = LogExporter([str(log)], 0, "127.0.0.1")
    try:
        assert value(scrape(exporter.url), "fastckpt_saves_total", rank="0", tier="direct") == 1
        with open(log, "ab") as f:
            f.write(b"not an event\n\x00\xff binary\n" + good.splitlines(keepends=True)[-1].encode())
        got = scrape(exporter.url)  # was HTTP 500, and the commit after the junk was lost
        assert exporter.bad_lines == 2 and exporter.events == good.count("\n") + 1
        with open(log, "ab") as f:
            f.write(b"more junk\n")
        assert exporter.poll() == 0 and exporter.bad_lines == 3  # the background poll: raised, rc 1
        assert value(got, "fastckpt_saves_total", rank="0", tier="direct") == 1
    finally:
        exporter.close()
    r = serve("--event-log", str(log), "--event-log", str(log), "--once", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["bad_lines"] == 3 and f"{log}:{good.count(chr(10)) + 1}" in r.stderr


_KILLED_MID_SAVE = """
import os, sys, torch, fastckpt
from fastckpt.testing import FaultyOps
ops = FaultyOps()
gate = ops.gate("fsync", "last.ckpt")
ck = fastckpt.Checkpointer(event_log=sys.argv[1], ops=ops, overhead_budget=0.99)
ck.save({"w": torch.ones(1000)}, sys.argv[2])
assert gate.wait_entered()
os._exit(9)  # killed while last.ckpt is being written
"""


def test_a_resumed_jobs_log_measures_each_save_from_its_own_call(cli_child: CliChild, serve: Serve,
                                                                 torch_python: ForkServer, tmp_path: Path) -> None:
    """A job killed mid-save, then resumed with the same event_log, saves the same fixed name
    (Lightning's last.ckpt) again: serve-metrics and report measure each new save from its own
    call, and the killed job's save is abandoned, not pending for ever."""
    log, path = tmp_path / "events.jsonl", str(tmp_path / "last.ckpt")
    killed = torch_python.run_code(_KILLED_MID_SAVE, [str(log), path], 120)
    assert killed.returncode == 9, killed.stderr
    with Checkpointer(event_log=str(log), overhead_budget=0.99) as ck:
        recs = [ck.save(_state(1024), path).wait() for _ in range(3)]
    r = serve("--event-log", str(log), "--once")
    assert r.returncode == 0, r.stderr
    from ._scrape import parse

    got, lab = parse(r.stdout), {"rank": "0", "tier": "direct"}
    assert value(got, "fastckpt_saves_total", **lab) == 4
    assert value(got, "fastckpt_save_durable_seconds_count", **lab) == 3
    assert value(got, "fastckpt_save_durable_seconds_sum", **lab) == pytest.approx(
        sum(rec.durable_s for rec in recs), abs=0.05)
    assert value(got, "fastckpt_pending_saves", **R0) == 0  # was 1 for good
    from fastckpt.report import load_run

    run, summary = load_run([str(log)], budget=0.99)
    saves = run.saves()
    snaps = [s.start for s in saves]
    # each save's commit is matched with its own call, not the previous one's (the killed one's, first)
    assert [s.start for s in saves if s.durable_at is not None] == snaps[1:]
    assert all(s.start < s.durable_at < later for s, later in zip(saves[1:], snaps[2:] + [float("inf")]))
    assert [s.abandoned for s in saves] == [True, False, False, False]
    assert (summary.durable, summary.pending, summary.abandoned, summary.failed) == (3, 0, 1, 0)
    rep = cli_child.run("report", str(log), "--json", "--overhead-budget", "0.99")
    assert rep.returncode == 0, rep.stderr
    assert json.loads(rep.stdout)["abandoned"] == 1


def test_the_same_log_twice_or_through_a_symlink_is_counted_once(serve: Serve, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log)) as ck:
        ck.save(_state(1024), str(tmp_path / "a.pt")).wait()
    (tmp_path / "link.jsonl").symlink_to(log)
    r = serve("--event-log", str(log), "--event-log", str(tmp_path / "link.jsonl"), "--once")
    assert r.returncode == 0, r.stderr
    from ._scrape import parse

    assert value(parse(r.stdout), "fastckpt_saves_total", rank="0", tier="direct") == 1


def test_serve_metrics_bind_errors_name_the_flag(serve: Serve, tmp_path: Path) -> None:
    log = str(tmp_path / "events.jsonl")
    r = serve("--event-log", log, "--addr", "256.1.1.1", "--port", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot serve metrics on 256.1.1.1" in r.stderr
    with Checkpointer(metrics_port=0) as ck:
        port = ck.metrics_url.rsplit(":", 1)[1].split("/")[0]
        r = serve("--event-log", log, "--port", port)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "Choose another --port" in r.stderr and "LOCAL_RANK" not in r.stderr


# A Checkpointer made by a __del__ that a garbage collection at interpreter exit runs (DeepSpeedEngine.__del__
# calls destroy() again there): the exporter's thread could never start, and Thread.start() waited for it forever.
_AT_SHUTDOWN = """
import gc, logging, sys
from fastckpt import Checkpointer
logging.basicConfig(level=logging.WARNING, format="%(message)s")
Checkpointer(rank=0, world_size=1, metrics_port=0).close()  # everything the late one needs is imported by now

class Late:
    def __del__(self, sys=sys, print=print, Checkpointer=Checkpointer):
        ck = Checkpointer(rank=0, world_size=1, metrics_port=0)
        print("finalizing", sys.is_finalizing(), "url", ck.metrics_url, flush=True)
        ck.close()

gc.collect()
gc.set_threshold(10**9)  # the cycle is left to the collection after the exit hooks, with imports working
late = Late()
late.cycle = late
del late
"""


def test_an_exporter_started_at_interpreter_shutdown_does_not_hang_the_exit() -> None:
    r = subprocess.run([sys.executable, "-c", _AT_SHUTDOWN], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "finalizing True url None" in r.stdout
    assert "not serving Prometheus metrics on port 0: the exporter was started while the interpreter shuts down" \
        in r.stderr


def test_both_exporters_count_a_group_file_awaiting_its_commit_as_stats_does(serve: Serve, tmp_path: Path) -> None:
    """A file saved into a group, at its path, before commit(): stats().pending and the in-process
    gauge said 0, while serve-metrics (replaying the log) said 1 for the same job."""
    log = tmp_path / "events.jsonl"
    with Checkpointer(local_dir=str(tmp_path / "bb"), metrics_port=0, event_log=str(log),
                      overhead_budget=0.99) as ck:
        g = str(tmp_path / "home" / "step-1")
        ck.save(_state(1024), f"{g}/model.pt", group=g).wait(60)
        inproc = value(scrape(ck.metrics_url), "fastckpt_pending_saves", rank="0")
        replay = serve("--event-log", str(log), "--once")
        assert replay.returncode == 0, replay.stderr
        from ._scrape import parse

        assert (ck.stats().pending, inproc, value(parse(replay.stdout), "fastckpt_pending_saves", rank="0")) \
            == (0, 0.0, 0.0)
        ck.commit(g, step=1).wait(60)
    _, summary = load_run([str(log)])
    assert (summary.durable, summary.pending) == (1, 0)


def test_lazy_saves_export_the_fence_wait_that_stats_counts(serve: Serve, tmp_path: Path) -> None:
    """save(lazy=True) then fence(): the exported stall per save (in the process and replayed from
    the log) holds the fence's wait, as stats() does; it held the save() call's part only. A
    one_save() block of lazy files fenced after it ended counts its files' waits too."""
    from ._scrape import parse

    w, log = torch.randn(1 << 23), tmp_path / "events.jsonl"  # 32 MiB: the fence right after waits for its copy
    with Checkpointer(metrics_port=0, event_log=str(log), overhead_budget=0.99) as ck:
        for s in range(4):
            h = ck.save({"w": w}, str(tmp_path / f"s{s}.pt"), lazy=True)
            ck.fence()
            w.add_(1)
            h.wait()
        with ck.one_save():
            handles = [ck.save({"w": w}, str(tmp_path / f"{n}.pt"), lazy=True) for n in "ab"]
        ck.fence()
        for h in handles:
            h.wait()
        st, got = ck.stats(), scrape(ck.metrics_url)
    r = serve("--event-log", str(log), "--once")
    assert r.returncode == 0, r.stderr
    assert st.saves == 5 and st.blocked_s > 0.005  # the fences waited for the copies
    for samples in (got, parse(r.stdout)):
        assert value(samples, "fastckpt_save_blocked_seconds_count", rank="0") == st.saves
        assert value(samples, "fastckpt_save_blocked_seconds_sum", rank="0") == pytest.approx(st.blocked_s, abs=1e-3)
        assert value(samples, "fastckpt_last_save_blocked_seconds", rank="0") == pytest.approx(st.last_blocked_s,
                                                                                              abs=1e-3)
    run, _ = load_run([str(log)])
    assert sum(s.blocked_s for s in run.saves()) == pytest.approx(st.blocked_s, abs=1e-3)  # report's numbers too


def test_serve_metrics_replays_the_alarm_against_the_jobs_budget(serve: Serve, tmp_path: Path) -> None:
    """The log's start event records the job's overhead_budget: serve-metrics uses it unless
    --overhead-budget is given (it used its own default, 0.02, and raised an alarm the job had not)."""
    from ._scrape import parse

    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log), overhead_budget=0.9) as ck:
        for s in range(3):
            ck.save(_state(1 << 20), str(tmp_path / f"s{s}.pt")).wait()
        assert not ck.stats().over_budget
    got = parse(serve("--event-log", str(log), "--once").stdout)
    assert value(got, "fastckpt_overhead_budget_ratio", rank="0") == 0.9
    assert value(got, "fastckpt_overhead_alarm", rank="0") == 0
    given = parse(serve("--event-log", str(log), "--once", "--overhead-budget", "0.0001").stdout)
    assert value(given, "fastckpt_overhead_budget_ratio", rank="0") == 0.0001
    assert value(given, "fastckpt_overhead_alarm", rank="0") == 1
