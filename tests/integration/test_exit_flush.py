"""A save still in flight when the script returns from main is flushed, not lost (issue #9.2).

The flush has to run before concurrent.futures' own exit hook stops accepting work: the pending
save still submits chunks, its replication and its group commit after that point.

Each script runs as ``python -c SCRIPT``, forked by the session's ``torch_python`` server
(tests/integration/conftest.py): it imports fastckpt itself and ends through the interpreter's
normal exit, as a fresh interpreter would.
"""

from __future__ import annotations

import os
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import fastckpt
from tests.integration._fork_server import ForkServer

SCRIPT = textwrap.dedent("""
    import sys, torch, fastckpt

    def main(path, local_dir, group):
        ck = fastckpt.Checkpointer(local_dir=local_dir or None, rank=0, world_size=1)
        state = {"w": torch.arange(1 << 20), "step": 7}
        if group:
            ck.save(state, path, group=group)
            ck.commit(group, step=7)
        else:
            ck.save(state, path)
        # no wait(), no close(): the script just ends

    main(*sys.argv[1:4])
""")


@pytest.mark.parametrize("mode", ["direct", "burst-buffer", "group"])
def test_a_save_in_flight_at_exit_is_flushed(torch_python: ForkServer, tmp_path: Path, mode: str) -> None:
    group = str(tmp_path / "home" / "step-7") if mode == "group" else ""
    path = f"{group}/model.pt" if group else str(tmp_path / "home" / "a.pt")
    local = str(tmp_path / "nvme") if mode == "burst-buffer" else ""
    r = torch_python.run_code(SCRIPT, [path, local, group], 120)
    assert r.returncode == 0, r.stderr
    assert "flushing 1 pending save" in r.stderr or "flushing 2 pending save" in r.stderr
    assert "(replicating: [])" not in r.stderr and "(replicating )" not in r.stderr  # names copies only if any
    assert fastckpt.load(path)["step"] == 7
    assert fastckpt.latest(str(tmp_path / "home")) == (group or path)


FORK = textwrap.dedent("""
    import multiprocessing as mp, sys, torch, fastckpt

    def child():
        pass  # exits at once: it must not flush (and wait on) the parent's Checkpointer

    ck = fastckpt.Checkpointer()
    ck.save({"w": torch.arange(1 << 20), "step": 3}, sys.argv[1])
    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    sys.exit(0 if p.exitcode == 0 else 3)
""")


def test_a_forked_child_does_not_flush_the_parents_checkpointer(torch_python: ForkServer, tmp_path: Path) -> None:
    path = str(tmp_path / "a.pt")
    r = torch_python.run_code(FORK, [path], 120)
    assert r.returncode == 0, r.stderr
    assert fastckpt.load(path)["step"] == 3


FORK_SAVES = textwrap.dedent("""
    import multiprocessing as mp, sys, torch, fastckpt

    def child():  # saves through the Checkpointer it inherited
        try:
            ck.save({"step": 4}, sys.argv[1] + ".child")
        except fastckpt.ClosedError as exc:  # it had run threads: they stayed in the parent
            sys.exit(0 if used and "fork()" in str(exc) and "create a new one" in str(exc) else 4)
        ck.close()  # (hung here when the pools' threads were the parent's)
        sys.exit(5 if used else 0)  # unused before the fork (Lightning's ddp_fork): the child's own

    used = sys.argv[2] == "used"
    ck = fastckpt.Checkpointer()
    if used:
        ck.save({"w": torch.arange(1 << 20), "step": 3}, sys.argv[1]).wait()  # the pools have threads now
    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    ck.save({"step": 5}, sys.argv[1])  # the parent's own Checkpointer is untouched
    ck.close()
    sys.exit(p.exitcode if p.exitcode is not None else 6)
""")


@pytest.mark.parametrize("used", ["used", "unused"])
def test_a_forked_child_saving_through_an_inherited_checkpointer_is_told_to_make_its_own(
        torch_python: ForkServer, tmp_path: Path, used: str) -> None:
    """One that ran work before the fork is closed in the child (its threads stayed in the parent: a save
    there hung in close(), or was lost); one that never did (Lightning's ddp_fork with checkpointer=) works."""
    path = str(tmp_path / "a.pt")
    r = torch_python.run_code(FORK_SAVES, [path, used], 180)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert fastckpt.load(path)["step"] == 5
    assert os.path.exists(path + ".child") == (used == "unused")


FORK_UNCLOSED = textwrap.dedent("""
    import multiprocessing as mp, os, sys, torch, fastckpt

    def child(saves):  # saves through the Checkpointer it inherited and returns without close()
        for i in range(saves):
            ck.save({"w": torch.randn(4 << 20), "i": i}, os.path.join(sys.argv[1], f"step-{i}.pt"))

    saves, metrics = int(sys.argv[2]), sys.argv[3] == "metrics"
    ck = fastckpt.Checkpointer(metrics_port=0 if metrics else None)  # made in the parent; it has run nothing
    p = mp.get_context("fork").Process(target=child, args=(saves,))
    p.start()
    p.join(120)
    ck.close()
    sys.exit(p.exitcode if p.exitcode is not None else 6)
""")


@pytest.mark.parametrize(("saves", "metrics"), [(3, ""), (3, "metrics"), (0, "")])
def test_a_fork_childs_saves_through_an_unused_inherited_checkpointer_are_flushed_at_its_exit(
        torch_python: ForkServer, tmp_path: Path, saves: int, metrics: str) -> None:
    """An inherited Checkpointer that had run nothing works in the child (docs/core.md), so its
    pending saves are flushed at the child's exit, with the warning, like any process's (before:
    the child dropped it from the exit flush, and its last saves were lost silently). A child that
    never uses it (a DataLoader worker) exits without touching it; one with a metrics exporter
    (its thread stayed in the parent) does not hang in close()."""
    r = torch_python.run_code(FORK_UNCLOSED, [str(tmp_path), str(saves), metrics], 240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == [f"step-{i}.pt" for i in range(saves)]
    assert all(fastckpt.load(str(tmp_path / f"step-{i}.pt"))["i"] == i for i in range(saves))
    assert ("pending save(s) at interpreter exit" in r.stderr) == bool(saves)


THREAD = textwrap.dedent("""
    import threading, sys, torch, fastckpt

    go = threading.Event()
    threading._register_atexit(go.set)  # registered before fastckpt's exit flush, so it runs after it
    ck = fastckpt.Checkpointer()

    def train():  # a non-daemon training thread that saves after the main thread returned
        go.wait()
        try:
            ck.save({"w": torch.zeros(4)}, sys.argv[1])
        except fastckpt.ClosedError as exc:
            print(exc)

    threading.Thread(target=train).start()
""")


def test_a_save_after_the_exit_flush_closed_the_checkpointer_says_why(torch_python: ForkServer, tmp_path: Path) -> None:
    """The exit flush runs when the main thread ends, before Python joins the other threads: a
    thread that saves after that gets a ClosedError that says who closed it and what to do."""
    r = torch_python.run_code(THREAD, [str(tmp_path / "a.pt")], 120)
    assert r.returncode == 0, r.stderr
    assert "closed at interpreter exit (the main thread ended: join a thread that still saves first)" in r.stdout


SIGTERM_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch, fastckpt

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # docs/core.md
    ck = fastckpt.Checkpointer()
    ck.save({"w": torch.arange(16 << 20), "step": 9}, sys.argv[1])  # 128 MB: still being written
    os.kill(os.getpid(), signal.SIGTERM)  # as torchrun or SLURM stop a job
    signal.pause()  # never returns: the handler exits
""")


def test_a_sigterm_handler_that_exits_flushes_the_save_in_flight(torch_python: ForkServer, tmp_path: Path) -> None:
    """SIGTERM's default action kills the process at once, saves in flight with it; the one-line
    handler docs/core.md shows turns it into an exit, and the exit flush makes the save durable."""
    path = tmp_path / "a.pt"
    r = torch_python.run_code(SIGTERM_SCRIPT, [str(path)], 120)
    assert r.returncode == 128 + 15, r.stderr
    assert fastckpt.load(str(path))["step"] == 9


SIGTERM_AT_FLUSH = textwrap.dedent("""
    import logging, os, signal, sys, torch, fastckpt
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    class TermAtFlush(logging.Filter):  # the stop arrives just as the flush begins (its own warning)
        def filter(self, record):
            if "flushing" in record.getMessage():
                os.kill(os.getpid(), signal.SIGTERM)  # handled at the main thread's next bytecode
            return True

    logging.getLogger("fastckpt").addFilter(TermAtFlush())
    ck = fastckpt.Checkpointer(io_threads=1)
    for i in (1, 2, 3):
        ck.save({"w": torch.full((1 << 22,), float(i)), "step": i}, f"{sys.argv[1]}/step-{i}.pt")
""")


def test_a_sigterm_as_the_exit_flush_begins_still_flushes_every_save(torch_python: ForkServer, tmp_path: Path) -> None:
    """A SIGTERM handled as the flush logged its warning raised SystemExit before the close(): the
    Checkpointer was never closed and a save that had returned was lost. The flush goes on first,
    and says that Python ignores an exit asked for while it shuts down."""
    r = torch_python.run_code(SIGTERM_AT_FLUSH, [str(tmp_path)], 120)
    assert [fastckpt.load(str(tmp_path / f"step-{i}.pt"))["step"] for i in (1, 2, 3)] == [1, 2, 3], r.stderr
    assert "stopped by sys.exit(143) during the exit flush, which went on first" in r.stderr, r.stderr
    assert "failed at exit" not in r.stderr and "not durable by then are lost" not in r.stderr, r.stderr


HELD = textwrap.dedent("""
    import sys, torch, fastckpt
    from fastckpt.testing import FaultyOps

    ops = FaultyOps()
    gate = ops.gate("replace", path_contains="a.pt")  # the final rename hangs, as on a stalled mount
    ck = fastckpt.Checkpointer(ops=ops, close_timeout_s=0.5, local_dir=sys.argv[1] + "/nvme")
    ck.save({"w": torch.zeros(4)}, sys.argv[1] + "/home/a.pt")
    assert gate.wait_entered(30)
    try:
        ck.close()
    except fastckpt.ReplicationError:
        print("gave up", flush=True)
    # main returns with the write still held (the gate opens only after 120 s)
""")


def test_close_timeout_bounds_the_exit_too(torch_python: ForkServer, tmp_path: Path) -> None:
    """close() gave up after close_timeout_s, but the write stuck on the stalled mount kept its
    (non-daemon) worker thread busy and the interpreter joined it at exit: the process was held
    as long as the mount (here until the test gate's own 120 s limit). Now it exits."""
    r = torch_python.run_code(HELD, [str(tmp_path)], 60)
    assert r.returncode == 0 and r.stdout == "gave up\n", r.stderr
    assert "still busy (fastckpt-write_0" in r.stderr and "left to end with the process" in r.stderr, r.stderr


CTRL_C_IN_CLOSE = textwrap.dedent("""
    import os, signal, sys, threading, torch, fastckpt
    from fastckpt import checkpointer
    from fastckpt.testing import FaultyOps

    d = sys.argv[1]
    ops = FaultyOps()
    gate = ops.gate("replace", path_contains="nvme")  # the burst-buffer copy's rename, held
    stop_pools = checkpointer.stop_pools

    def stopping(executors, wait):  # close() stops its workers after the Ctrl-C: the write ends now
        gate.open()
        return stop_pools(executors, wait)

    checkpointer.stop_pools = stopping
    ck = fastckpt.Checkpointer(ops=ops, local_dir=d + "/nvme")
    closing, wait = threading.Event(), ck.wait

    def waiting(*args, **kwargs):  # close() waits: the Ctrl-C lands inside it, never before
        closing.set()
        return wait(*args, **kwargs)

    ck.wait = waiting
    ck.save({"w": torch.arange(1000), "step": 5}, d + "/home/a.pt")

    def ctrl_c():
        gate.wait_entered(30)
        closing.wait(30)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c).start()
    try:
        ck.close()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def test_ctrl_c_in_close_still_copies_the_save_in_flight_home(torch_python: ForkServer, tmp_path: Path) -> None:
    """docs/core.md: an interrupted close() still ends the pending work. close() closed the
    replicator before it drained the writers, so a local write that ended after the Ctrl-C was
    refused replication ("replicator is closed") and never reached its path."""
    r = torch_python.run_code(CTRL_C_IN_CLOSE, [str(tmp_path)], 120)
    assert "interrupted" in r.stdout, r.stderr
    assert "replicator is closed" not in r.stderr, r.stderr
    assert fastckpt.load(str(tmp_path / "home" / "a.pt"))["step"] == 5


SAVING_THROUGH_THE_FLUSH = textwrap.dedent("""
    import threading, sys, torch, fastckpt

    flushed = threading.Event()
    threading._register_atexit(flushed.set)  # registered before fastckpt's: runs right after the exit flush
    inside = threading.Event()

    class Hold:  # holds the save at its snapshot event (on the saving thread) until the flush has run
        def emit(self, ev):
            if ev.name == "snapshot" and threading.current_thread().name == "train":
                inside.set()
                flushed.wait(60)

    ck = fastckpt.Checkpointer(sinks=(Hold(),))

    def train():
        try:
            ck.save({"w": torch.zeros(1024)}, sys.argv[1])
            print("RESULT saved")
        except fastckpt.ClosedError as exc:
            print("RESULT ClosedError", exc)
        except BaseException as exc:
            print("RESULT", type(exc).__name__, exc)

    threading.Thread(target=train, name="train").start()
    inside.wait(60)
    # the main thread ends: fastckpt's exit flush closes ck while train() is inside save()
""")


def test_a_save_under_way_when_the_exit_flush_closes_the_checkpointer_is_a_closed_error(
        torch_python: ForkServer, tmp_path: Path) -> None:
    """It was concurrent.futures' bare "RuntimeError: cannot schedule new futures after shutdown"."""
    r = torch_python.run_code(SAVING_THROUGH_THE_FLUSH, [str(tmp_path / "a.pt")], 120)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), r.stderr)
    assert line.startswith("RESULT ClosedError") and "while this save was under way" in line, line


def test_a_commit_under_way_when_close_stops_the_workers_is_a_closed_error(tmp_path: Path) -> None:
    """As for a save: it was concurrent.futures' bare RuntimeError. close() runs on another thread
    while the commit is between its checks and its hand-off to the committer pool."""
    g = str(tmp_path / "step-1")
    ck = fastckpt.Checkpointer(rank=0, world_size=1)
    ck.save({"w": torch.zeros(4)}, f"{g}/rank0.pt", group=g).wait()
    committing = ck._retention.committing

    def closed_meanwhile(group: str) -> object:
        closer = threading.Thread(target=ck.close)
        closer.start()
        closer.join()
        return committing(group)

    ck._retention.committing = closed_meanwhile
    with pytest.raises(fastckpt.ClosedError, match="while this commit was under way: the group was not published"):
        ck.commit(g, step=1)


ATEXIT_SAVE = textwrap.dedent("""
    import atexit, sys, torch, fastckpt

    if sys.argv[2] == "earlier":
        fastckpt.Checkpointer().close()  # one Checkpointer used (and closed) before main returned

    def final_save():  # runs after the main thread ended: thread pools refuse work then
        try:
            ck = fastckpt.Checkpointer()
            ck.save({"step": 9}, sys.argv[1])
        except fastckpt.ClosedError as exc:
            print("RESULT", exc)

    atexit.register(final_save)
""")


@pytest.mark.parametrize("before", ["fresh", "earlier"])
def test_a_save_from_an_atexit_handler_says_it_cannot_run_at_exit(torch_python: ForkServer, tmp_path: Path,
                                                                   before: str) -> None:
    """It got threading's bare "can't register atexit after shutdown", or a ClosedError saying the new
    Checkpointer was closed and to create a new one (what the handler had just done)."""
    r = torch_python.run_code(ATEXIT_SAVE, [str(tmp_path / "a.pt"), before], 120)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), r.stderr[-2000:])
    assert "at interpreter exit" in line and "before the main thread returns" in line, line
    assert "was closed" not in line
