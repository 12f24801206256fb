"""checkpointer.py end to end on real files: tiers, records, events, load preference."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.testing import FaultyOps
from tests.helpers import read_file_manifest


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((1 << 20,), step, dtype=torch.int32)}, "step": step}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["model"]["w"], b["model"]["w"])


def test_direct_round_trip_and_record(tmp_path) -> None:
    path = tmp_path / "run" / "a.pt"
    with fastckpt.Checkpointer() as ck:
        rec = ck.save(_state(1), str(path)).wait()
        assert rec.tier == "direct" and rec.path == str(path) and rec.local_durable_s is None
        assert 0 < rec.blocked_s <= rec.write_s <= rec.commit_s == rec.durable_s
        assert rec.bytes == path.stat().st_size and rec.write_GBps > 0
        assert _same(ck.load(str(path)), _state(1))
    assert fastckpt.latest(str(tmp_path)) == str(path)


def test_nvme_tier_copies_to_path_and_prefers_local(tmp_path, caplog) -> None:
    local, dest = tmp_path / "nvme", tmp_path / "shared" / "s.pt"
    with fastckpt.Checkpointer(local_dir=str(local)) as ck:
        rec = ck.save(_state(2), str(dest)).wait()
        assert rec.tier == "nvme"
        assert rec.local_durable_s is not None and rec.local_durable_s <= rec.durable_s
        local_copy = ck.local_path(str(dest))
        assert local_copy.startswith(str(local)) and os.path.exists(local_copy)
        with open(local_copy, "rb") as f:
            assert f.read() == dest.read_bytes()
        # corrupt the burst-buffer copy: load warns and falls back to the durable copy
        with open(local_copy, "r+b") as f:
            f.seek(8192 + 100)
            b = f.read(1)
            f.seek(8192 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            out = ck.load(str(dest))
        assert _same(out, _state(2))
        assert any("falling back" in r.getMessage() for r in caplog.records)


def test_event_log_has_every_phase(tmp_path) -> None:
    log_path = tmp_path / "events.jsonl"
    before = time.time()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), event_log=str(log_path)) as ck:
        built = time.time()
        ck.save(_state(3), str(tmp_path / "d" / "x.pt")).wait()
        ck.load(str(tmp_path / "d" / "x.pt"))
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [e["name"] for e in events] == ["start", "snapshot", "write", "commit", "queued", "replicate", "load"]
    # what serve-metrics replays with: the options, and when the Monitor's clock started (before the first event's)
    m = re.fullmatch(r"overhead_budget=0\.02 overhead_window_s=3600\.0 started_at=(\S+)", events[0]["detail"])
    assert m and before <= float(m.group(1)) <= built <= events[0]["start"] == events[1]["start"]
    assert all(e["tier"] for e in events) and all(e["error"] is None for e in events)
    assert all(e["end"] >= e["start"] for e in events)


@pytest.mark.parametrize("raised", [OSError(28, "No space left on device (metrics spool)"), SystemExit(3)],
                         ids=["OSError", "SystemExit"])
def test_a_sink_that_raises_neither_fails_nor_hangs_a_save(tmp_path, caplog, raised: BaseException) -> None:
    """A user's sink that raises (here on the event emitted when a replication is queued, and on
    every write) loses those events only: the saves are durable, the other sinks get every
    event, and the failure is logged once for that sink. A sys.exit() there (on a writer thread)
    failed the save and was raised by wait()."""
    from fastckpt.events import Event

    class Broken:
        def emit(self, ev: Event) -> None:
            if ev.name in ("queued", "write"):
                raise raised

    seen: list[str] = []

    class Recorder:
        def emit(self, ev: Event) -> None:
            seen.append(ev.name)

    broken = Broken()
    # close_timeout_s: without the fix close() would wait forever for the handle that never resolves
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), sinks=(broken, Recorder()), close_timeout_s=30,
                               rank=0, world_size=1) as ck:
        for step in (1, 2):
            rec = ck.save(_state(step), str(tmp_path / "home" / f"s{step}.pt")).wait(timeout=30)
            assert rec.durable_s is not None and ck.load(rec.path)["step"] == step
    assert seen.count("queued") == 2 and seen.count("write") == 2 and seen.count("replicate") == 2
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "event sink" in r.getMessage()]
    assert len(errors) == 1 and repr(broken) in errors[0].getMessage()
    assert errors[0].exc_info is not None


def test_a_sys_exit_from_a_signal_handler_inside_a_sink_on_the_training_thread_goes_through(tmp_path) -> None:
    """A SIGTERM handler's sys.exit() runs in whatever the main thread runs, a sink's emit (the event
    log's) included: swallowed there, the preemption was ignored and training went on to SIGKILL."""
    from fastckpt.events import Event

    class Preempted:
        signalled = False

        def emit(self, ev: Event) -> None:
            if ev.name == "snapshot" and threading.current_thread() is threading.main_thread() and not self.signalled:
                self.signalled = True
                raise SystemExit(143)

    with fastckpt.Checkpointer(sinks=(Preempted(),), rank=0, world_size=1, close_timeout_s=30) as ck:
        with pytest.raises(SystemExit):
            ck.save(_state(1), str(tmp_path / "a.pt"))
        assert ck.save(_state(2), str(tmp_path / "b.pt")).wait(30).durable_s is not None  # (an exit handler's)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_ctrl_c_right_after_the_snapshot_gives_the_staging_buffer_back(tmp_path, lazy: bool) -> None:
    """A KeyboardInterrupt between the snapshot and the hand-over to the writer (here raised by a
    sink on the snapshot event, as a Ctrl-C lands; a notebook catches it and saves again): the
    buffer goes back, so the next save gets it (before: it waited for ever, or was skipped)."""
    from fastckpt.events import Event

    class CtrlC:
        fired = False

        def emit(self, ev: Event) -> None:
            if ev.name == "snapshot" and not self.fired:
                self.fired = True
                raise KeyboardInterrupt

    with fastckpt.Checkpointer(staging_buffers=1, when_busy="skip", sinks=(CtrlC(),)) as ck:
        with pytest.raises(KeyboardInterrupt):
            ck.save(_state(1), str(tmp_path / "a.pt"), lazy=lazy)
        ck.fence()
        rec = ck.save(_state(2), str(tmp_path / "a.pt"), lazy=lazy).wait(timeout=30)
        assert not rec.skipped and ck.load(rec.path)["step"] == 2


def test_a_sinks_time_on_the_training_thread_is_blocked_time(tmp_path) -> None:
    """The snapshot event's sinks run in save(), on the training thread (an event_log's write):
    blocked_s, the overhead and its alarm left that time out. (A lazy save's is not counted: its
    copy may have ended and been counted while they ran.)"""
    import time

    from fastckpt.events import Event

    class Slow:
        def emit(self, ev: Event) -> None:
            if ev.name == "snapshot":
                end = time.monotonic() + 0.05  # a sink's work on this thread, not a wait for anything
                while time.monotonic() < end:
                    pass

    with fastckpt.Checkpointer(sinks=(Slow(),), overhead_budget=0.99) as ck:
        t0 = time.monotonic()
        h = ck.save(_state(1), str(tmp_path / "a.pt"))
        called = time.monotonic() - t0
        ck.fence()
        rec = h.wait(timeout=30)
        assert 0.05 <= rec.blocked_s <= called and ck.stats().blocked_s >= 0.05


def test_a_save_whose_replication_cannot_be_queued_fails_instead_of_hanging(tmp_path) -> None:
    """Whatever the replicator's submit raises resolves the save's handle with it (a done-callback
    would otherwise swallow it and leave the handle pending for ever)."""
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), close_timeout_s=30, rank=0, world_size=1) as ck:
        def refuse(job: object) -> None:
            raise ValueError("the replicator refused the job")

        ck._replicator.submit = refuse  # type: ignore[method-assign]
        with pytest.raises(ValueError, match="refused"):
            ck.save(_state(1), str(tmp_path / "home" / "a.pt")).wait(timeout=30)


def test_overhead_callback_and_stats(tmp_path) -> None:
    seen = []
    with fastckpt.Checkpointer(overhead_budget=1e-6, on_overhead_exceeded=seen.append) as ck:
        for i in range(3):
            ck.save(_state(i), str(tmp_path / f"{i}.pt")).wait()
        st = ck.stats()
    assert st.saves == 3 and st.over_budget and st.alarms == 1 and len(seen) == 1
    assert st.blocked_s > 0 and st.overhead > 1e-6


def test_overwrite_same_path_keeps_a_complete_file(tmp_path) -> None:
    path = str(tmp_path / "last.pt")
    with fastckpt.Checkpointer() as ck:
        for i in range(4):
            ck.save(_state(i), path)
        ck.wait()
        assert _same(ck.load(path), _state(3))
    assert [n for n in os.listdir(tmp_path) if ".fastckpt-tmp-" in n] == []


@pytest.mark.parametrize("burst_buffer", [False, True], ids=["direct", "burst buffer"])
def test_a_save_that_replaces_a_file_is_durable_before_the_old_one_is_freed(tmp_path, burst_buffer) -> None:
    # freeing a large file can take a third of its write (ext4 with discard): not on the path to durable
    from fastckpt.testing import FaultyOps
    from tests.helpers import tmp_files

    ops = FaultyOps()
    gate = ops.gate("unlink", ".fastckpt-tmp-")  # only removals of replaced files unlink temp names here
    path, local = tmp_path / "home" / "last.pt", tmp_path / "nvme"
    with fastckpt.Checkpointer(ops=ops, local_dir=str(local) if burst_buffer else None) as ck:
        ck.save(_state(1), str(path)).wait()
        homes = [path, ck.local_path(str(path))] if burst_buffer else [path]
        first = [os.stat(p).st_ino for p in homes]
        rec = ck.save(_state(2), str(path)).wait()  # returns with the removal held at the gate
        assert gate.wait_entered()
        assert rec.durable_s is not None and _same(ck.load(str(path)), _state(2))
        held = {os.stat(t).st_ino for t in tmp_files(tmp_path)}
        assert held and held <= set(first)  # the old files, under temp names only
        gate.open()
        ck.wait()  # and once waited for, they are gone
        assert tmp_files(tmp_path) == []


def test_manifest_records_versions_and_timings(tmp_path) -> None:
    path = str(tmp_path / "m.pt")
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(1), path).wait()
    m = read_file_manifest(path)
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["fastckpt"] == fastckpt.__version__
    assert m["blocked_s"] > 0 and m["rank"] == 0 and m["group"] is None and m["format"] == 1


def test_plain_torch_file_loads_unverified(tmp_path) -> None:
    path = tmp_path / "plain.pt"
    torch.save(_state(5), path)
    assert _same(fastckpt.load(str(path)), _state(5))


def test_weights_only_refusal_says_how(tmp_path) -> None:
    path = str(tmp_path / "obj.pt")
    with fastckpt.Checkpointer() as ck:
        ck.save({"cfg": fastckpt.ConfigError("x")}, path).wait()
        with pytest.raises(Exception) as info:
            ck.load(path)
        assert "weights_only=False" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
        assert isinstance(ck.load(path, weights_only=False)["cfg"], fastckpt.ConfigError)


def test_remove_waits_for_inflight_and_deletes_both_copies(tmp_path) -> None:
    dest = str(tmp_path / "shared" / "r.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), dest)
        ck.remove(dest)  # the save is in flight: remove waits for it, then deletes
        assert not os.path.exists(dest) and not os.path.exists(ck.local_path(dest))
        assert ck.stats().pending == 0


def test_closed_checkpointer_refuses(tmp_path) -> None:
    ck = fastckpt.Checkpointer()
    ck.close()
    ck.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ck.save(_state(1), str(tmp_path / "x.pt"))
    with pytest.raises(fastckpt.ClosedError, match=r"fastckpt\.load"):  # the project's error, and the way out
        ck.load(str(tmp_path / "x.pt"))


def test_remove_after_close_refuses_as_save_and_load_do(tmp_path) -> None:
    """remove() was the one call that still worked on a closed Checkpointer (and deleted)."""
    dest = str(tmp_path / "shared" / "r.pt")
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"))
    ck.save(_state(1), dest)
    ck.close()
    with pytest.raises(fastckpt.ClosedError, match=r"closed by close\(\); create a new one"):
        ck.remove(dest)
    assert os.path.exists(dest) and os.path.exists(ck.local_path(dest))  # nothing deleted


def test_load_of_none_says_nothing_is_complete_yet(tmp_path) -> None:
    assert fastckpt.latest(str(tmp_path)) is None
    with pytest.raises(fastckpt.ConfigError, match=r"no complete checkpoint yet.*wait\(\)"):
        fastckpt.load(fastckpt.latest(str(tmp_path)))  # the README's pattern, before anything was saved


def test_config_errors_name_the_fix() -> None:
    with pytest.raises(fastckpt.ConfigError, match="fraction"):
        fastckpt.Checkpointer(overhead_budget=2)
    with pytest.raises(fastckpt.ConfigError, match="'wait'"):
        fastckpt.Checkpointer(when_busy="never")
    with pytest.raises(fastckpt.ConfigError, match="node-local"):
        fastckpt.Checkpointer(local_dir="s3://b/x")


@pytest.mark.parametrize("typo", ["s3:/bucket/bb", "s3:bucket/bb", "s3//bucket/bb"])
def test_a_local_dir_that_is_a_url_typo_is_refused(tmp_path, monkeypatch, typo: str) -> None:
    """A URL that lost a slash or its colon was taken for the local folder ./s3: (docs/core.md
    promises the refusal of such typos everywhere): the burst buffer landed in the working
    directory. Refused, nothing created; the fix names the ./ spelling for a folder of that name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fastckpt.ConfigError, match=r"looks like a URL without its '://'.*write '\./s3"):
        fastckpt.Checkpointer(local_dir=["/tmp/fine", typo])
    assert not list(tmp_path.iterdir())
    with fastckpt.Checkpointer(local_dir=f"./{typo}") as ck:  # a folder of that name, said so
        ck.save({"w": torch.ones(2)}, str(tmp_path / "home" / "a.pt")).wait()
    assert (tmp_path / typo.split("/")[0]).is_dir()


@pytest.mark.parametrize("root", ["/", "//", "/tmp/..", "link"])
def test_a_local_dir_that_is_the_root_is_refused(tmp_path, root: str) -> None:
    """Each file's burst-buffer copy is its path under local_dir: with local_dir="/" that is the file
    itself, so it was "committed locally" at its home and never replicated, silently."""
    if root == "link":  # a symlink to /
        (tmp_path / "link").symlink_to("/")
        root = str(tmp_path / "link")
    for local in (root, [str(tmp_path / "nvme"), root]):
        with pytest.raises(fastckpt.ConfigError, match=r"is the root directory: .*Point local_dir at a node-local"):
            fastckpt.Checkpointer(local_dir=local)


def test_a_path_object_is_taken_wherever_a_path_is(tmp_path) -> None:
    """local_dir=Path(...) was refused as "must be a directory" (only a str passed), in the core and
    in FastCkptIO, though save, load and event_log take any os.PathLike."""
    from fastckpt.integrations.lightning import FastCkptIO

    FastCkptIO(local_dir=tmp_path / "nvme-lightning")
    for local in (tmp_path / "nvme", [tmp_path / "nvme0", str(tmp_path / "nvme1")]):
        with fastckpt.Checkpointer(local_dir=local, event_log=tmp_path / "events.jsonl") as ck:
            rec = ck.save({"w": torch.ones(4)}, tmp_path / "home" / "x.pt").wait()
            assert all(isinstance(d, str) for d in ck.config.local_dirs)
        assert rec.tier == "nvme" and torch.equal(fastckpt.load(tmp_path / "home" / "x.pt")["w"], torch.ones(4))
    assert os.path.isfile(tmp_path / "nvme" / tmp_path.relative_to("/") / "home" / "x.pt")


@pytest.mark.parametrize("bad", ['{"endpoint_url": "http://127.0.0.1:9", "secret": "s3cr3t"}', ["s3cr3t", "x"]])
def test_storage_options_that_are_no_dict_are_refused_where_they_are_given(tmp_path, bad: object) -> None:
    """A JSON string (what --storage-options takes) or a list was accepted, and the first URL
    failed in dict() with "dictionary update sequence element #0 has length 1; 2 is required"."""
    from fastckpt.integrations.lightning import FastCkptIO

    calls = (lambda: fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=bad),
             lambda: FastCkptIO(local_dir=str(tmp_path / "nvme"), storage_options=bad),
             lambda: fastckpt.latest("s3://bucket/run", storage_options=bad),
             lambda: fastckpt.load("s3://bucket/run/x.pt", storage_options=bad))
    for call in calls:
        with pytest.raises(fastckpt.ConfigError, match=r"storage_options must be a dict of fsspec options") as err:
            call()
        assert "s3cr3t" not in str(err.value)  # it may hold secrets: never repeated
    assert not (tmp_path / "nvme").exists()


def test_an_overhead_callback_that_is_not_callable_is_refused_at_once() -> None:
    with pytest.raises(fastckpt.ConfigError, match=r"on_overhead_exceeded=5 must be a function that takes an "
                                                   r"OverheadReport"):
        fastckpt.Checkpointer(on_overhead_exceeded=5)


class _Sink:
    def emit(self, event: object) -> None:
        pass


@pytest.mark.parametrize(("options", "words"), [
    ({"ops": 5}, "ops=5 lacks open, pwrite"), ({"ops": "posix"}, "ops='posix' lacks open"),
    ({"ops": FaultyOps}, "is a class, not an instance"),
    ({"sinks": 5}, "sinks=5 must be a list or tuple of EventSinks"), ({"sinks": None}, "sinks=None must be"),
    ({"sinks": [5]}, r"sinks=\[5\] must be"), ({"sinks": "events.jsonl"}, "sinks='events.jsonl' must be"),
    ({"sinks": (_Sink,)}, "instances of their class"), ({"sinks": print}, "emit\\(event\\) method"),
])
def test_ops_and_sinks_that_are_no_seam_are_refused_at_once(tmp_path, options: dict, words: str) -> None:
    """FastCkptIO's (and the Checkpointer's) test hooks took any value: the first save then raised
    an AttributeError or TypeError deep in a background thread, or the Trainer's first step did."""
    from fastckpt.integrations.lightning import FastCkptIO

    for build in (fastckpt.Checkpointer, FastCkptIO):
        with pytest.raises(fastckpt.ConfigError, match=words):
            build(**options)
    with fastckpt.Checkpointer(ops=FaultyOps(), sinks=[_Sink()]) as ck:  # a list is taken, as a tuple
        ck.save({"w": torch.ones(2)}, tmp_path / "x.pt").wait()


def test_a_local_dir_that_cannot_be_made_is_refused_at_once_or_left_out(tmp_path, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(fastckpt.ConfigError) as ei:
        fastckpt.Checkpointer(local_dir=str(blocker / "nvme"))  # was: a CheckpointWriteError at the first save
    assert f"local_dir {blocker / 'nvme'} cannot hold checkpoints: {blocker} is a file, not a directory (choose " \
           "another path, or move that file away). Point local_dir at a writable directory" in str(ei.value)
    assert "Not a directory" not in str(ei.value)  # was the bare errno text, naming neither the file nor the fix
    good = tmp_path / "nvme1"
    with caplog.at_level("WARNING", logger="fastckpt"):
        with fastckpt.Checkpointer(local_dir=[str(blocker / "nvme0"), str(good)]) as ck:
            for i in range(3):
                ck.save({"i": torch.tensor(i)}, str(tmp_path / "home" / f"s{i}.pt")).wait()
    assert f"{blocker / 'nvme0'} cannot be used ({blocker} is a file, not a directory" in caplog.text
    assert sorted(os.listdir(good / tmp_path.relative_to("/") / "home")) == ["s0.pt", "s1.pt", "s2.pt"]


def test_a_local_dir_that_is_a_link_to_nothing_names_the_missing_target(tmp_path) -> None:
    """``/scratch/me`` -> ``/local_nvme/me``, a drive not mounted on this node: the link was called
    "a file, not a directory" with "move that file away" as the fix; the missing target is the problem."""
    link = tmp_path / "scratch"
    link.symlink_to(tmp_path / "local_nvme" / "me")
    with pytest.raises(fastckpt.ConfigError) as ei:
        fastckpt.Checkpointer(local_dir=str(link))
    assert f"{link} is a symbolic link to {tmp_path / 'local_nvme' / 'me'}, which does not exist (create it or mount " \
           "its drive, or choose another path)" in str(ei.value), ei.value
    chain = tmp_path / "nvme"  # nvme -> scratch -> local_nvme/me: the missing one is named, not the link between
    chain.symlink_to(link)
    with pytest.raises(fastckpt.ConfigError) as ei:
        fastckpt.Checkpointer(local_dir=str(chain))
    assert f"{chain} is a symbolic link to {tmp_path / 'local_nvme' / 'me'}, which does not exist" in str(ei.value)
    loop_a, loop_b = tmp_path / "a", tmp_path / "b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    with pytest.raises(fastckpt.ConfigError) as ei:
        fastckpt.Checkpointer(local_dir=str(loop_a))
    assert f"{loop_a} is a symbolic link that leads back to itself (a loop): point it at a directory, or remove it" \
        in str(ei.value), ei.value


def test_an_event_log_that_cannot_be_written_is_a_config_error(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(fastckpt.ConfigError, match=r"event_log=.*a-file/run/events.jsonl' cannot be written"):
        fastckpt.Checkpointer(event_log=str(blocker / "run" / "events.jsonl"))  # was: a raw FileNotFoundError


@pytest.mark.parametrize("name", ["commit_timeout_s", "retry_deadline_s", "close_timeout_s", "overhead_window_s"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "10"])
def test_a_time_that_is_no_finite_number_of_seconds_is_refused_at_once(name: str, bad: object) -> None:
    # NaN passed every `x <= 0` check: close_timeout_s=nan made destroy() report a commit "still not
    # committed after nan s", and retry_deadline_s=nan failed only at the first save
    with pytest.raises(fastckpt.ConfigError, match=f"{name}=.* must be a finite number of seconds"):
        fastckpt.Checkpointer(**{name: bad})


@pytest.mark.parametrize(("options", "what"), [
    ({"keep_persistent": True}, "the count"), ({"keep_local": True}, "the count"),
    ({"keep_persistent": False}, "the count"), ({"io_threads": True}, "the count"),
    ({"staging_buffers": True}, "the count"), ({"replicate_workers": True}, "the count"),
    ({"chunk_bytes": True}, "a number of bytes"), ({"replicate_bandwidth_Bps": True}, "a number of bytes/s"),
    ({"rank": True, "world_size": 2}, "this process's rank"), ({"world_size": True, "rank": 0}, "the count")],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_a_bool_given_for_a_number_is_refused_at_once(options: dict, what: str) -> None:
    # a bool is an int to Python: keep_persistent=True passed as 1, and every save trimmed the
    # checkpoints to the newest one without a word; the time options already refused bools
    name, value = next(iter(options.items()))
    with pytest.raises(fastckpt.ConfigError,
                       match=rf"{name}={value} must be .*; {value} is a bool \(Python would take it as {int(value)}\): "
                             f"give {what}"):
        fastckpt.Checkpointer(**options)


@pytest.mark.parametrize(("name", "bad"), [("io_threads", 2.5), ("io_threads", "4"), ("replicate_workers", 1.5),
                                           ("keep_persistent", 1.5), ("chunk_bytes", float(16 << 20))])
def test_a_count_that_is_no_whole_number_is_refused_at_once(name: str, bad: object) -> None:
    # io_threads=2.5 reached ThreadPoolExecutor, io_threads="4" a raw TypeError from the comparison
    with pytest.raises(fastckpt.ConfigError, match=f"{name}={bad!r} must be a (whole number|positive multiple)"):
        fastckpt.Checkpointer(**{name: bad})


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_write_round_trip(tmp_path, overlap) -> None:
    sd = {f"t{i}": torch.full((1 << 20,), i, dtype=torch.int32) for i in range(24)}  # 96 MiB, several chunks
    with fastckpt.Checkpointer(overlap_write=overlap, chunk_bytes=16 << 20) as ck:
        h = ck.save(sd, str(tmp_path / "o.pt"))
        for t in sd.values():
            t.add_(100)  # after save returned: must not reach the file
        h.wait()
        out = ck.load(str(tmp_path / "o.pt"))
    assert all(bool((out[f"t{i}"] == i).all()) for i in range(24))


def test_large_storages_of_odd_lengths_and_offsets_round_trip(tmp_path) -> None:
    # large storages are copied as 8-byte words with a byte tail: lengths that are not a multiple
    # of 8, one-byte dtypes, a view into the middle of a storage (the whole storage is saved)
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, 255, ((1 << 20) * 3 + 5,), dtype=torch.uint8, generator=gen)
    sd = {"odd_u8": torch.randint(0, 255, ((1 << 20) + 3,), dtype=torch.uint8, generator=gen),
          "bool": torch.rand((1 << 21) + 1, generator=gen) > 0.5,
          "f16": torch.randn((1 << 20) + 1, generator=gen).half(),
          "view": base[7 : (1 << 21) + 3], "f64": torch.randn(1 << 18, generator=gen, dtype=torch.float64)}
    with fastckpt.Checkpointer() as ck:
        ck.save(sd, str(tmp_path / "odd.pt")).wait()
        out = ck.load(str(tmp_path / "odd.pt"))
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert torch.equal(torch.load(str(tmp_path / "odd.pt"), weights_only=True)["view"], sd["view"])


def test_overlapped_write_failure_surfaces_once_and_keeps_previous(tmp_path) -> None:
    import errno

    from fastckpt.testing import Fault, FaultyOps

    path = str(tmp_path / "f.pt")
    ops = FaultyOps()
    with fastckpt.Checkpointer(ops=ops, overlap_write=True) as ck:
        ck.save(_state(1), path).wait()
        ops.inject(Fault("pwrite", error=errno.ENOSPC, path_contains=".fastckpt-tmp-"))
        h = ck.save(_state(2), path)
        with pytest.raises(fastckpt.CheckpointWriteError) as info:
            h.wait()
        assert info.value.errno == errno.ENOSPC
        ck.wait()  # already seen: not raised again
        assert _same(ck.load(path), _state(1))
    ops.assert_all_reached()
    assert [n for n in os.listdir(tmp_path) if ".fastckpt-tmp-" in n] == []


def test_reserve_allocates_ahead_and_the_saves_reuse_it(tmp_path, monkeypatch) -> None:
    """reserve() allocates on its own thread; saves, including one a few bytes larger, reuse it."""
    import threading

    from fastckpt.save import staging

    allocs: list[str] = []
    real = staging._new_buffer
    monkeypatch.setattr(staging, "_new_buffer",
                        lambda cap, pinned: allocs.append(threading.current_thread().name) or real(cap, pinned))
    path = str(tmp_path / "r.pt")
    with fastckpt.Checkpointer() as ck:
        assert ck.reserve(4 << 20).result(30) == 1
        ck.save(_state(1), path).wait()
        grown = {**_state(2), "extra": "a few more bytes of metadata"}
        ck.save(grown, path).wait()
        assert ck.load(path)["extra"] == grown["extra"]
        with pytest.raises(ValueError, match="nbytes"):
            ck.reserve(-1)
    assert allocs == ["fastckpt-reserve"]


@pytest.mark.parametrize(("staging_buffers", "skipped"), [(1, True), (2, False)])
def test_second_staging_buffer_serves_a_save_while_the_first_is_written(tmp_path, staging_buffers,
                                                                       skipped) -> None:
    """With staging_buffers=2 a second save (save_last's last.ckpt) takes the other buffer at
    once while the first one's write is held; with 1 it would wait (here: when_busy='skip')."""
    from fastckpt.testing import FaultyOps

    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains="first.pt")
    with fastckpt.Checkpointer(ops=ops, when_busy="skip", staging_buffers=staging_buffers) as ck:
        h1 = ck.save(_state(1), str(tmp_path / "first.pt"))
        assert gate.wait_entered()
        if skipped:
            with pytest.warns(UserWarning, match="skipped"):
                h2 = ck.save(_state(2), str(tmp_path / "last.pt"))
        else:
            h2 = ck.save(_state(2), str(tmp_path / "last.pt"))
        gate.open()
        assert h1.wait().skipped is False
        assert h2.wait().skipped is skipped
        assert len(ck._staging.capacities()) == staging_buffers
    if not skipped:
        assert _same(fastckpt.load(str(tmp_path / "last.pt")), _state(2))


def test_staging_buffers_is_bounded() -> None:
    for bad in (0, 5, 1.5):
        with pytest.raises(fastckpt.ConfigError, match="staging_buffers"):
            fastckpt.Checkpointer(staging_buffers=bad)


def test_stats_tell_durability_and_rpo_without_a_burst_buffer(tmp_path) -> None:
    """On the default tier (no local_dir) a save is durable at its path when its handle resolves:
    stats() (and so the Prometheus gauges) say so, as they do for a replicated save."""
    with fastckpt.Checkpointer() as ck:
        assert ck.stats().last_durable_s is None and ck.stats().rpo_s is None
        rec = ck.save({"w": torch.ones(8)}, str(tmp_path / "a.pt")).wait()
        s = ck.stats()
        assert s.last_durable_s == rec.durable_s and 0.0 <= s.rpo_s < 60.0
        group = str(tmp_path / "g")
        for name in ("a.pt", "b.pt"):
            ck.save({"w": torch.ones(8)}, f"{group}/{name}", group=group)
        rec = ck.commit(group, step=1).wait()
        assert ck.stats().last_durable_s == rec.durable_s and ck.stats().rpo_s <= s.rpo_s + 60.0



@pytest.mark.parametrize(("env", "match"), [
    ({"RANK": "1"}, r"\$RANK='1' in the environment must be a whole number from 0 to 0 \(\$WORLD_SIZE=1, unset\)"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, r"\$RANK='4' .* from 0 to 3 \(\$WORLD_SIZE=4\)"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, r"\$RANK='abc' .* whole number from 0 to 1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, r"\$WORLD_SIZE='0' .* whole number >= 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, r"\$RANK='-1'")])
def test_a_rank_from_the_environment_is_checked_as_rank_is(monkeypatch, env: dict, match: str) -> None:
    """RANK=1 with no WORLD_SIZE made rank 1 of a one-rank job: its first commit waited
    commit_timeout_s for a rank 0 that cannot exist; RANK=abc raised a bare ValueError."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(fastckpt.ConfigError, match=match + ".*torchrun sets RANK and WORLD_SIZE together"):
        fastckpt.Checkpointer()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fastckpt.Checkpointer(rank=0, world_size=1).close()  # given explicitly: the environment is not read


def test_a_local_rank_from_the_environment_is_checked(monkeypatch) -> None:
    from fastckpt.metrics.exporter import local_rank

    for bad in ("abc", "-1"):
        monkeypatch.setenv("LOCAL_RANK", bad)
        with pytest.raises(fastckpt.ConfigError, match=rf"\$LOCAL_RANK='{bad}' in the environment must be a whole "
                                                       "number >= 0"):
            local_rank()
    monkeypatch.setenv("LOCAL_RANK", "")
    assert local_rank() == 0
