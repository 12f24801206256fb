"""Reading event logs whole and following one while it is written."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.eventlog import LogFollower, may_start_event, parse_event, read_events, unique_paths
from fastckpt.events import Event, JsonlSink


def _ev(name: str, start: float, rank: int = 0, path: str = "/c/a.pt", **kw: object) -> Event:
    return Event(name, rank, path, kw.pop("bytes", 10), start, start + kw.pop("dur", 0.1), "direct", **kw)


def test_round_trip_through_the_jsonl_sink(tmp_path: Path) -> None:
    log = tmp_path / "e.jsonl"
    sink = JsonlSink(str(log))
    evs = [_ev("snapshot", 1.0), _ev("write", 1.2, detail="buffered: x"), _ev("commit", 1.4, error="OSError(5)")]
    for e in reversed(evs):
        sink.emit(e)
    sink.close()
    assert read_events(str(log)) == [replace(e, session=sink.session) for e in evs]  # sorted by start


def test_each_sink_is_a_session_and_old_lines_have_none(tmp_path: Path) -> None:
    """A resumed job's Checkpointer appends to the log with a session of its own; lines written
    before sessions existed read as session None."""
    log = tmp_path / "e.jsonl"
    old = _ev("snapshot", 0.5).to_json().replace(', "session": null', "")
    log.write_text(old + "\n")
    sinks = [JsonlSink(str(log)), JsonlSink(str(log))]
    for t, sink in zip((1.0, 2.0), sinks):
        sink.emit(_ev("snapshot", t))
        sink.close()
    assert '"session"' not in old and sinks[0].session != sinks[1].session
    assert [e.session for e in read_events(str(log))] == [None, sinks[0].session, sinks[1].session]


def test_bad_lines_are_named(tmp_path: Path) -> None:
    log = tmp_path / "e.jsonl"
    log.write_text(_ev("snapshot", 1.0).to_json() + "\n{\"name\": \"write\"}\n")
    with pytest.raises(ValueError, match=r"e.jsonl:2: missing rank"):
        read_events(str(log))
    with pytest.raises(ValueError, match="not JSON"):
        parse_event("not json")


@pytest.mark.parametrize("change, words", [
    ({"rank": float("inf")}, "wrong type"), ({"bytes": float("inf")}, "wrong type"),
    ({"error": 5}, "not a message"), ({"start": float("nan")}, "not a time span"),
    ({"start": "1e999", "end": "1e999"}, "not a time span"), ({"end": 0.5}, "not a time span"),
    ({"rank": -1}, "negative"), ({"bytes": -10}, "negative"),
    ({"name": "superseded", "detail": 5}, "detail is a int, not a message"),
    ({"start": -1e308, "end": 1e308}, "not a time span"),
    ({"bytes": int("9" * 400)}, "400-digit number, more than any file holds"),  # plan --from-run: OverflowError
])
def test_a_line_whose_values_make_no_event_is_named_and_skipped_between_events(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict, words: str) -> None:
    """Damage that still parses as JSON (a non-finite time, an end before its start, a number
    too large for an int, an error or detail that is no message, a span too long to be a float)
    is no event: it once reached the report's arithmetic (nan or negative overhead, a silenced
    alarm, Infinity in --json) or crashed it (a superseded event's detail is matched as text)."""
    bad = json.dumps({**json.loads(_ev("write", 1.0).to_json()), **change})
    log = tmp_path / "e.jsonl"
    log.write_text(_ev("snapshot", 1.0).to_json() + "\n" + bad + "\n" + _ev("commit", 2.0).to_json() + "\n")
    assert [e.name for e in read_events(str(log))] == ["snapshot", "commit"]
    assert "e.jsonl:2" in caplog.text and words in caplog.text
    with pytest.raises(ValueError, match=words):
        parse_event(bad)


def test_a_save_timed_across_a_clock_stepped_back_logs_a_zero_span(tmp_path: Path) -> None:
    """The wall clock stepped back between a phase's start and end (an NTP step): the event's
    end is its start, never before it, so the reader keeps it."""
    log = tmp_path / "e.jsonl"
    with fastckpt.Checkpointer(event_log=str(log)) as ck:
        ck._emit("retry", "x.pt", 0, time.time() + 3600, "replicate")
    start, ev = read_events(str(log))  # the Checkpointer's start event, then the retry
    assert start.name == "start" and ev.name == "retry" and ev.end == ev.start


def test_an_incomplete_last_line_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = tmp_path / "e.jsonl"
    log.write_text(_ev("snapshot", 1.0).to_json() + "\n" + _ev("write", 2.0).to_json()[:20])
    assert [e.name for e in read_events(str(log))] == ["snapshot"]
    assert "incomplete line" in caplog.text


def test_follower_reads_only_complete_lines_and_restarts_on_truncation(tmp_path: Path) -> None:
    log = tmp_path / "e.jsonl"
    f = LogFollower(str(log))
    assert f.poll() == []  # not created yet
    line = _ev("snapshot", 1.0).to_json() + "\n"
    log.write_text(line[:15])
    assert f.poll() == []
    with open(log, "a") as out:
        out.write(line[15:] + _ev("write", 2.0).to_json()[:5])
    assert [e.name for e in f.poll()] == ["snapshot"]
    with open(log, "a") as out:
        out.write(_ev("write", 2.0).to_json()[5:] + "\n")
    assert [e.name for e in f.poll()] == ["write"]
    assert f.poll() == []
    log.write_text(_ev("load", 3.0).to_json() + "\n")  # a new job truncated the file
    assert [e.name for e in f.poll()] == ["load"]


def test_follower_reads_on_in_a_log_replaced_by_an_updated_copy(tmp_path: Path) -> None:
    """A log shipped by rsync (without --inplace) or a copy renamed over it is a new inode holding
    the lines read and new ones: read on from the offset. Before, any new inode was read from byte 0,
    and serve-metrics counted every save of the log again at each shipment."""
    log, tmp = tmp_path / "e.jsonl", tmp_path / "e.jsonl.tmp"
    lines = [_ev(n, t).to_json() + "\n" for n, t in (("snapshot", 1.0), ("write", 1.2), ("commit", 1.4),
                                                      ("snapshot", 2.0), ("write", 2.2))]

    def ship(text: str) -> None:  # the old file still exists while the copy is written: another inode
        tmp.write_text(text)
        os.replace(tmp, log)

    f = LogFollower(str(log))
    ship("".join(lines[:2]) + lines[2][:9])  # a line cut short by the copy, completed by the next one
    ino = log.stat().st_ino
    assert [e.name for e in f.poll()] == ["snapshot", "write"]
    ship("".join(lines[:4]))
    assert log.stat().st_ino != ino
    assert [(e.name, e.start) for e in f.poll()] == [("commit", 1.4), ("snapshot", 2.0)]
    ship("".join(lines))
    assert [(e.name, e.start) for e in f.poll()] == [("write", 2.2)]
    ship("".join(lines) + _ev("load", 2.5).to_json()[:20])  # bytes past the offset, nothing complete yet
    assert f.poll() == []
    newer = [_ev("snapshot", 9.0).to_json() + "\n", _ev("write", 9.1).to_json() + "\n"] * 5
    ship("".join(newer))  # a new job's log renamed over it, longer than the old one: from its start
    assert [e.start for e in f.poll()] == [9.0, 9.1] * 5


def test_the_sink_creates_its_directory(tmp_path: Path) -> None:
    log = tmp_path / "core_ckpt" / "sub" / "events.jsonl"  # saves create their directories: so does the log
    sink = JsonlSink(str(log))
    sink.emit(_ev("snapshot", 1.0))
    sink.close()
    sink.emit(_ev("write", 2.0))  # after close: dropped, the file is not opened again
    assert [e.name for e in read_events(str(log))] == ["snapshot"]


def test_follower_skips_a_bad_line_counts_it_and_keeps_the_events_after_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = tmp_path / "e.jsonl"
    f = LogFollower(str(log))
    torn = _ev("snapshot", 1.0).to_json()[:12]  # a writer killed mid-line, then another appending
    log.write_bytes((_ev("snapshot", 0.5).to_json() + "\n" + torn + _ev("write", 1.5).to_json() + "\n").encode()
                    + b"\x00\xff\xfe junk\n" + (_ev("commit", 2.0).to_json() + "\n").encode())
    assert [e.name for e in f.poll()] == ["snapshot", "commit"]
    assert f.bad_lines == 2
    assert f"{log}:2: not JSON" in caplog.text and f"{log}:3: not UTF-8" in caplog.text
    with open(log, "a") as out:
        out.write('{"name": "x", "rank": null, "path": "p", "bytes": 1, "start": 0, "end": 1, "tier": "t"}\n')
        out.write(_ev("load", 3.0).to_json() + "\n")
    assert [e.name for e in f.poll()] == ["load"]
    assert f.bad_lines == 3 and f"{log}:5: a field has the wrong type" in caplog.text


def test_a_binary_log_names_the_file_and_line(tmp_path: Path) -> None:
    log = tmp_path / "e.jsonl"
    log.write_bytes((_ev("snapshot", 1.0).to_json() + "\n").encode() + b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match=rf"{log}:2: not UTF-8"):
        read_events(str(log))


def test_a_log_given_twice_or_through_a_symlink_is_read_once(tmp_path: Path) -> None:
    log = tmp_path / "e.jsonl"
    log.write_text(_ev("snapshot", 1.0).to_json() + "\n")
    (tmp_path / "link.jsonl").symlink_to(log)
    assert len(read_events([str(log), str(log), str(tmp_path / "link.jsonl")])) == 1


def test_a_log_given_again_through_a_hard_link_is_read_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A hard link (or the same directory through a bind mount) has a real path of its own: the
    log was counted twice, twice its saves and bytes in report and serve-metrics. A log not
    there yet is still kept, once per name it has."""
    log = tmp_path / "e.jsonl"
    log.write_text(_ev("snapshot", 1.0).to_json() + "\n")
    os.link(log, tmp_path / "hard.jsonl")
    assert len(read_events([str(log), str(tmp_path / "hard.jsonl")])) == 1
    assert f"{tmp_path / 'hard.jsonl'} is a log already given ({log}); read once" in caplog.text
    later = str(tmp_path / "later.jsonl")
    assert unique_paths([str(log), later, str(tmp_path / "hard.jsonl"), later]) == [str(log), later]


def test_follower_starts_over_when_the_log_is_rewritten_and_grows_past_its_offset(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A new job truncates the log in place (or deletes and writes it again, and the filesystem
    gives it the old inode number), and it grows past the follower's offset before the next
    poll: neither the inode nor the size tells. Before: the follower went on from its old
    offset, dropping the new job's first events without a warning."""
    log = tmp_path / "e.jsonl"
    f = LogFollower(str(log))
    log.write_text(_ev("snapshot", 1.0).to_json() + "\n")
    assert [e.name for e in f.poll()] == ["snapshot"]
    with open(log, "r+") as out:
        out.truncate(0)
        out.write("".join(_ev(n, 10.0 + i, rank=1).to_json() + "\n"
                          for i, n in enumerate(["load", "snapshot", "write"])))
    assert [(e.name, e.rank) for e in f.poll()] == [("load", 1), ("snapshot", 1), ("write", 1)]
    assert "replaced or truncated" in caplog.text
    with open(log, "a") as out:  # appends after that are read once, as before
        out.write(_ev("commit", 14.0).to_json() + "\n")
    assert [e.name for e in f.poll()] == ["commit"] and f.poll() == []


def test_a_line_cut_short_by_a_crash_may_start_an_event_and_other_bytes_do_not(tmp_path: Path) -> None:
    """serve-metrics --once tells a log whose only line a crash cut short (an event log) from a
    file given by mistake: a real event line cut anywhere (in an escaped character too) may start
    an event; a whole JSON value that is none, text or binary does not."""
    from fastckpt.eventlog import may_start_event

    log = tmp_path / "e.jsonl"
    sink = JsonlSink(str(log))
    sink.emit(_ev("snapshot", 1.0, path="/c/ü.pt"))
    sink.close()
    line = log.read_bytes().rstrip(b"\n")
    cut_char = line.index(b"\\u00fc") + 3  # within the escape of the ü
    assert all(may_start_event(line[:n]) for n in (1, 10, cut_char, len(line) - 1, len(line)))
    others = (b'{"lr": 0.1}', b"hello", b"\x00" * 8, b"{\xff\xfe", '{"ü": 1'.encode(), b"")
    assert not any(may_start_event(raw) for raw in others)
    f = LogFollower(str(log))
    log.write_bytes(line[:cut_char])
    assert f.poll() == [] and f.not_an_event_log() is None
    log.write_bytes(b'{"lr": 0.1}')  # replaced by another file: judged anew
    assert f.poll() == [] and f.not_an_event_log() == (
        f"{log} is not a fastckpt event log: it holds no event ({log}:1: neither an event nor the start of one, "
        "cut short by a crash)")


def test_a_log_of_torn_lines_a_crash_loop_left_is_an_event_log(tmp_path: Path) -> None:
    """A job killed mid-way through its first event line, restarted (its sink ends the torn line
    before its first event) and killed the same way again leaves torn line, newline, torn line:
    an event log with no event yet, not a file given by mistake. A line among them that could
    not start an event still makes it none."""
    from fastckpt.events import _end_torn_line

    log = tmp_path / "e.jsonl"
    sink = JsonlSink(str(log))
    sink.emit(_ev("snapshot", 1.0))
    sink.close()
    line = log.read_bytes().split(b"\n")[0]
    log.write_bytes(line[:40])  # launch 1 killed mid-line
    for cut in (60, 25):  # each next launch ends the torn line, then is killed writing its first event
        _end_torn_line(str(log))
        with open(log, "ab") as out:
            out.write(line[:cut])
    f = LogFollower(str(log))
    assert f.poll() == [] and f.bad_lines == 2 and f.not_an_event_log() is None
    with open(log, "ab") as out:  # a line that could start no event: another file after all
        out.write(b"\nhello\n")
    assert f.poll() == [] and f.not_an_event_log() == (
        f"{log} is not a fastckpt event log: it holds no event ({log}:4: not JSON (Expecting value))")


def test_a_trainers_stdout_of_python_dicts_is_no_event_log(tmp_path: Path) -> None:
    """A line starting with ``{`` that fails to parse counted as a torn event line, so a trainer's
    stdout of Python dict reprs given as ``--event-log`` by mistake was taken for an event log
    with no event (all-zero metrics, exit 0). ``Event.to_json`` starts every line with ``{"``."""
    log = tmp_path / "train.log"
    log.write_text("{'loss': 2.31, 'epoch': 0.01}\n{'loss': 2.2, 'epoch': 0.02}\n")
    f = LogFollower(str(log))
    assert f.poll() == [] and f.not_an_event_log() is not None
    assert may_start_event(b'{"duration_s": 0.1') and may_start_event(b"{")
    assert not may_start_event(b"{'loss': 2.31")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write fails with ENOSPC)")
def test_a_full_disk_under_the_log_warns_once_names_it_and_drops_its_events(
        capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """/dev/full fails every write with ENOSPC, as a full disk does: one WARNING naming the log,
    the errno and the fix, no traceback per event on stderr, and close() does not raise."""
    sink = JsonlSink("/dev/full")
    with caplog.at_level("WARNING", logger="fastckpt"):
        for t in range(5):
            sink.emit(_ev("snapshot", float(t)))
        sink.close()
    warned = [r.getMessage() for r in caplog.records if "/dev/full" in r.getMessage()]
    assert len(warned) == 1
    assert "ENOSPC" in warned[0] and "dropped" in warned[0] and "Free space" in warned[0]
    assert "Logging error" not in capfd.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write fails with ENOSPC)")
def test_close_with_the_event_log_on_a_full_disk_finishes_its_work(tmp_path: Path) -> None:
    """close() neither raises the log's OSError nor skips what comes after it (the exporter stops)."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    ck = fastckpt.Checkpointer(event_log="/dev/full", metrics_port=0)
    ck.save({"w": torch.arange(4)}, str(tmp_path / "a.pt")).wait()
    url = ck.metrics_url
    assert url is not None
    ck.close()
    with pytest.raises(OSError):  # refused: the exporter was closed
        urllib.request.urlopen(url, timeout=5)
    assert torch.equal(fastckpt.load(str(tmp_path / "a.pt"))["w"], torch.arange(4))
