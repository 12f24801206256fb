"""fastckpt bench on real files: threads and processes, O_DIRECT and buffered, verify, the
capacity gate, cleanup on Ctrl-C and SIGTERM, two nodes through torchrun (gloo), GDS's reason."""

from __future__ import annotations

import errno
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
from click.testing import CliRunner

from fastckpt.cli import cli
from fastckpt.cli.bench_io import Job, percentiles, run_posix
from fastckpt.io.ops import resident_bytes
from tests.helpers import tmpfs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench(tmp_path, *args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--json", *args])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def leftovers(*dirs) -> list[str]:
    return [os.path.join(d, n) for d in dirs for n in os.listdir(d)]


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_write_and_read_with_verify(tmp_path, engine: str) -> None:
    code, d = bench(tmp_path, "--workers", "2", "--engine", engine, "--size", "32MiB", "--block-size", "4MiB",
                    "--verify")
    assert code == 0
    assert d["write_Bps"] > 0 and d["read_Bps"] > 0
    assert d["write_bytes"] == d["read_bytes"] == 2 * (32 << 20)
    assert [(w["op"], w["worker"]) for w in d["workers"]] == [("write", 0), ("write", 1), ("read", 0), ("read", 1)]
    assert all(w["checked_blocks"] == 8 and w["bad_blocks"] == 0 for w in d["workers"] if w["op"] == "read")
    lat = d["latency"]["write"]
    assert 0 < lat["p50_s"] <= lat["p99_s"] <= lat["max_s"]
    assert leftovers(tmp_path) == []


def test_a_block_of_256_mib(tmp_path) -> None:
    """Before: the block's random body came from one ``randbytes`` call, which overflows at 2**28
    bytes: ``--block-size 256MiB`` (a size gdsio users pick) ended in an OverflowError."""
    code, d = bench(tmp_path, "--workers", "1", "--size", "256MiB", "--block-size", "256MiB", "--verify")
    assert code == 0
    assert d["write_bytes"] == d["read_bytes"] == 256 << 20
    assert [(w["checked_blocks"], w["bad_blocks"]) for w in d["workers"] if w["op"] == "read"] == [(1, 0)]
    assert leftovers(tmp_path) == []


def test_buffered_read_only_striped_over_two_dirs(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    r = CliRunner().invoke(cli, ["bench", "--dir", str(a), "--dir", str(b), "--workers", "2", "--size", "8MiB",
                                 "--block-size", "1MiB", "--buffered", "--mode", "read", "--verify", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["write_Bps"] is None and d["read_Bps"] > 0
    paths = [w["path"] for w in d["workers"]]
    assert paths[0].startswith(str(a)) and paths[1].startswith(str(b))
    assert not any(w["odirect"] for w in d["workers"]) and d["workers"][0]["odirect_reason"] == "--buffered"
    assert leftovers(a, b) == []


def test_duration_passes_over_the_file_again(tmp_path) -> None:
    code, d = bench(tmp_path, "--workers", "1", "--size", "4MiB", "--block-size", "1MiB", "--duration", "0.5s",
                    "--mode", "write")
    assert code == 0
    assert d["write_seconds"] >= 0.5
    assert d["write_bytes"] >= 4 << 20  # at least one pass over the 4 MiB file


def test_duration_with_both_modes_reads_whole_files(tmp_path) -> None:
    """The last timed write pass runs to the end of the file, so the read phase (the whole
    --size) reads what was written; it used to stop part-way and the read failed with EIO."""
    code, d = bench(tmp_path, "--workers", "2", "--size", "4MiB", "--block-size", "1MiB", "--duration", "0.3s",
                    "--verify")
    assert code == 0
    writes = [w for w in d["workers"] if w["op"] == "write"]
    # each worker has its own deadline, so the two may run different numbers of passes: each whole
    assert len(writes) == 2 and all(w["bytes"] % (4 << 20) == 0 and w["bytes"] >= 4 << 20 for w in writes)
    assert d["write_bytes"] == sum(w["bytes"] for w in writes)
    assert d["read_bytes"] > 0 and d["read_seconds"] >= 0.3
    reads = [w for w in d["workers"] if w["op"] == "read"]
    assert all(w["checked_blocks"] > 0 and w["bad_blocks"] == 0 for w in reads)
    assert leftovers(tmp_path) == []


def test_cleanup_leaves_a_folder_of_the_same_name_that_another_run_made(tmp_path, monkeypatch) -> None:
    """Two benches with one host name and PID (containers on a shared --dir): the folder this run
    could not create is another's, and stays; the random suffix makes such a clash unlikely."""
    import secrets
    import socket

    monkeypatch.setattr(os, "getpid", lambda: 4242)
    monkeypatch.setattr(secrets, "token_hex", lambda n: "feedbeef")
    host = socket.gethostname()
    theirs = [tmp_path / f"fastckpt-bench-{host}-4242-r0", tmp_path / f"fastckpt-bench-{host}-4242-feedbeef-r0"]
    for t in theirs:
        t.mkdir()
        (t / "worker-000.dat").write_text("another bench's live file")
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--workers", "1", "--size", "1MiB",
                                 "--block-size", "1MiB", "--mode", "write"])
    assert all((t / "worker-000.dat").read_text() == "another bench's live file" for t in theirs)
    assert r.exit_code == 1 and "File exists" in r.output
    monkeypatch.undo()
    from fastckpt.cli.bench import Settings, _run_dirs

    s = Settings((str(tmp_path),), 1, "threads", 1 << 20, 1 << 20, None, "write", True, False, False)
    assert _run_dirs(s, 0) != _run_dirs(s, 0)


def _passes(job: Job, passes: int, each: Callable[[int], None]) -> None:
    """Run ``job`` (with a long ``duration_s``) for ``passes`` passes and the first block of the
    next; ``each(k)`` after the k-th block (1-based)."""
    stop, moved = threading.Event(), [0]

    def progress(n: int) -> None:
        moved[0] += 1
        each(moved[0])
        if moved[0] == passes * (job.file_bytes // job.block_bytes) + 1:
            stop.set()

    run_posix(job, progress, stop, lambda: None)


def test_buffered_reads_come_from_storage_every_pass(tmp_path) -> None:
    """A read without O_DIRECT (--buffered, or refused by the filesystem) must not be served from
    the page cache: not the pages a write just left (once, dropped only when --buffered was
    asked, not when O_DIRECT was refused), nor those its own last pass cached (--duration)."""
    path, mib = str(tmp_path / "f.dat"), 1 << 20
    run_posix(Job("write", 0, 0, path, 16 * mib, mib, direct=False), lambda n: None, threading.Event(),
              lambda: None)  # buffered: the whole file is in the page cache now
    fd = os.open(path, os.O_RDONLY)
    cached = {}
    try:
        def each(k: int) -> None:
            if k in (1, 17):  # the first block of each pass read: is the last block in the cache?
                cached[k] = resident_bytes(fd, 15 * mib, mib)
        _passes(Job("read", 0, 0, path, 16 * mib, mib, direct=False, duration_s=600.0), 1, each)
    finally:
        os.close(fd)
    assert cached == {1: 0, 17: 0}


def test_duration_writes_a_new_file_each_pass(tmp_path) -> None:
    """A checkpoint writes a new file: overwriting the blocks a pass allocated measured ~2x too fast."""
    path, mib = str(tmp_path / "f.dat"), 1 << 20
    inodes = {}
    _passes(Job("write", 0, 0, path, 4 * mib, mib, direct=True, duration_s=600.0), 1,
            lambda k: inodes.update({k: os.stat(path).st_ino}) if k in (1, 5) else None)
    assert inodes[1] != inodes[5]
    assert os.path.getsize(path) == mib  # the second pass's file, one block so far


def test_fabric_capacity_gate(tmp_path) -> None:
    args = ["--workers", "1", "--size", "8MiB", "--block-size", "1MiB", "--mode", "write"]
    code, d = bench(tmp_path, *args, "--fabric-capacity", "1PB/s")
    assert code == 1 and d["missed"] == ["write"] and d["write_fraction_of_capacity"] < 0.8
    code, d = bench(tmp_path, *args, "--fabric-capacity", "1MB/s")
    assert code == 0 and d["passed"] and d["write_fraction_of_capacity"] > 0.8
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), *args, "--fabric-capacity", "1MB/s"])
    assert "PASS" in r.stdout and "Aggregate" in r.stdout and "fabric capacity 1 MB/s" in r.stdout


def test_verify_finds_a_damaged_block(tmp_path) -> None:
    path = str(tmp_path / "f.dat")
    job = Job("write", 0, 3, path, 4 << 20, 1 << 20, direct=True)
    never = threading.Event()
    w = run_posix(job, lambda n: None, never, lambda: None)
    assert (w.bytes, w.odirect) == (4 << 20, True)
    with open(path, "r+b") as f:  # one flipped byte in the third block's body
        f.seek(2 * (1 << 20) + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = run_posix(Job("read", 0, 3, path, 4 << 20, 1 << 20, direct=True, verify=True), lambda n: None, never,
                  lambda: None)
    assert (r.checked_blocks, r.bad_blocks) == (4, 1)


def test_percentiles_nearest_rank() -> None:
    assert percentiles([]) == {"p50_s": None, "p99_s": None, "max_s": None}
    xs = [float(i) for i in range(1, 101)]
    assert percentiles(xs) == {"p50_s": 50.0, "p99_s": 99.0, "max_s": 100.0}


@pytest.mark.parametrize("args, msg", [(["--block-size", "1000"], "multiple of 4096"),
                                       (["--size", "1MiB", "--block-size", "2MiB"],
                                        "Invalid value for --size: 1,048,576 bytes per worker is smaller than one "
                                        "--block-size block (2,097,152 bytes), so no block would be written: give "
                                        "--size 2097152 or more, or --block-size 1048576 or less"),
                                       (["--verify", "--mode", "write"], "--verify checks reads"),
                                       (["--size", "1PB"], "free"),
                                       (["--duration", "0"], "'0' must be more than 0"),
                                       (["--dir", "s3://bucket/ckpt"], "`fastckpt doctor --target URL` probes it")])
def test_bad_usage_exits_2(tmp_path, args: list[str], msg: str) -> None:
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), *args])
    assert r.exit_code == 2 and msg in " ".join(r.output.split()), r.output


def test_a_size_under_the_smallest_block_offers_no_smaller_block(tmp_path) -> None:
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--size", "1000", "--block-size", "4096"])
    assert r.exit_code == 2 and " ".join(r.output.split()).endswith("give --size 4096 or more"), r.output


def test_a_worker_failing_before_the_start_is_named_without_a_traceback(tmp_path, monkeypatch) -> None:
    """Worker 1 cannot open its file (EMFILE) after worker 0 opened its own and went to the start
    barrier. Before: the BrokenBarrierError that its failure gave worker 0 (or the main thread) could
    be raised instead of its OSError, and as a traceback; now exit 1 naming the cause."""
    from fastckpt.cli import bench_io

    opened = threading.Event()

    class Ops(bench_io.FileOps):
        def open(self, path: str, flags: int, mode: int = 0o644) -> int:
            if path.endswith("worker-001.dat"):
                assert opened.wait(60)
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
            fd = super().open(path, flags, mode)
            opened.set()
            return fd

    monkeypatch.setattr(bench_io, "FileOps", Ops)
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--workers", "2", "--engine", "threads",
                                 "--size", "4MiB", "--block-size", "1MiB"])
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit)
    assert "bench failed: [Errno 24] Too many open files" in r.output and "worker-001.dat" in r.output
    assert leftovers(tmp_path) == []


def test_a_read_only_dir_names_the_remount_fix(tmp_path) -> None:
    """Before: `bench failed: [Errno 30] Read-only file system: '...'` and no fix."""
    with tmpfs(tmp_path / "ro", "size=8m,ro") as ro:
        r = CliRunner().invoke(cli, ["bench", "--dir", str(ro), "--workers", "1", "--size", "1MiB",
                                     "--block-size", "1MiB"])
    assert r.exit_code == 1, r.output
    assert "bench failed: [Errno 30] Read-only file system" in r.output
    assert r.output.rstrip().endswith(": the file system is mounted read-only: remount it read-write or choose "
                                      "another target"), r.output


# bench in a process whose address space ends 128 MiB past what it uses, asked for a 1 GiB block:
# the worker's pattern (bench_job.pattern) is refused with a MemoryError, as on a node without room
_NO_ROOM = """
import resource, sys
from fastckpt.cli import main
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (128 << 20), resource.RLIM_INFINITY))
sys.exit(main(["bench", "--dir", sys.argv[1], "--workers", "1", "--engine", "threads", "--size", "1GiB",
               "--block-size", "1GiB"]))
"""


def test_a_block_the_node_cannot_hold_is_named_out_of_memory_with_the_fix(tmp_path) -> None:
    """Before: `Error: bench failed: ` and nothing after it (a MemoryError's str() is empty, and the
    fallback to its repr never ran: an exception object is always true)."""
    r = subprocess.run([sys.executable, "-c", _NO_ROOM, str(tmp_path)], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "Error: bench failed: out of memory (MemoryError): each of the 1 worker(s) holds its --block-size block "
        "of 1.07 GB twice (the aligned buffer and its pattern); lower --block-size or --workers")
    assert leftovers(tmp_path) == []


def test_free_space_is_checked_per_filesystem(tmp_path, monkeypatch) -> None:
    """Two --dir on one filesystem share its free space. Before: each was checked alone, so two
    workers of 64 MiB passed a check of 100 MiB free, and the disk filled up mid-run."""
    from fastckpt.cli import bench as B

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    real = os.statvfs

    def statvfs(path):  # noqa: ANN001, ANN202 (the real numbers, with 100 MiB available)
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, st.f_bfree, (100 << 20) // 4096, st.f_files,
                                  st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(B.os, "statvfs", statvfs)
    args = ["bench", "--dir", str(a), "--dir", str(b), "--size", "64MiB", "--block-size", "4MiB"]
    r = CliRunner().invoke(cli, [*args, "--workers", "2"])
    assert r.exit_code == 2, r.output
    assert f"{a}, {b} (one filesystem) has 105 MB free, and a bench fills at most 95% of it (99.6 MB: " in r.output
    assert "this one needs 134 MB there" in r.output
    assert leftovers(a, b) == []


def test_a_ramfs_dir_is_bounded_by_the_memory_available(tmp_path) -> None:
    """A ramfs reports no size (statvfs f_blocks == 0). Before: `... has 0 B free, and a bench fills
    at most 95% of it (0 B ...)`, exit 2, for any --size; then no bound at all, though its pages can
    be neither swapped nor reclaimed: a bench larger than memory ran the node out of it."""
    from fastckpt import sysinfo
    from fastckpt.cli import bench as B

    with tmpfs(tmp_path / "ram", "defaults", fstype="ramfs") as ram:
        code, d = bench(ram, "--workers", "1", "--size", "1MiB", "--block-size", "1MiB", "--buffered")
        assert code == 0 and d["write_bytes"] == d["read_bytes"] == 1 << 20
        assert leftovers(ram) == []
        too_big = B.Settings(dirs=(str(ram),), workers=2, engine="threads", block_bytes=1 << 20, duration_s=None,
                             file_bytes=sysinfo.mem_available(), mode="write", direct=False, gds=False, verify=False)
        refused = B._refusal(too_big)
        assert refused is not None and refused[0] == 2 and \
            "of memory available (a ramfs keeps its files in memory)" in refused[1], refused
        assert leftovers(ram) == []


def test_a_refusal_for_space_states_the_share_of_free_space_a_bench_may_fill(tmp_path, monkeypatch) -> None:
    """A small drive: 8.39 MB free, two 4 MiB workers. It said "has 8.39 MB free; this bench needs
    8.39 MB" (a margin it did not name): now it says the bench fills at most 95 % of it, 7.97 MB."""
    from fastckpt.cli import bench as B

    real = os.statvfs

    def statvfs(path):  # noqa: ANN001, ANN202 (the real numbers, with 2049 blocks of 4 KiB available)
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, st.f_bfree, 2049, st.f_files,
                                  st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(B.os, "statvfs", statvfs)
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--size", "4MiB", "--block-size", "1MiB",
                                 "--workers", "2"])
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.replace("│", " ").split())
    assert (f"{tmp_path} has 8.39 MB free, and a bench fills at most 95% of it (7.97 MB: the rest is left for the "
            "filesystem and other writers); this one needs 8.39 MB there (--workers x --size)") in said, said
    assert leftovers(tmp_path) == []


def test_gds_says_why_not_on_a_machine_without_it(tmp_path) -> None:
    from fastckpt.save.tiers import gds_unavailable_reason

    why = gds_unavailable_reason(True)
    if why is None:
        pytest.skip("GDS is usable here (tests/gpu covers it)")
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--gds", "--json"])
    assert r.exit_code == 1
    assert json.loads(r.stdout) == {"gds": True, "gds_unavailable_reason": why, "passed": False}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("engine, sig", [("threads", signal.SIGINT), ("processes", signal.SIGINT),
                                         ("threads", signal.SIGTERM)])
def test_interrupt_removes_the_files(tmp_path, engine: str, sig: int) -> None:
    p = subprocess.Popen([sys.executable, "-u", "-c", _WATCHED, str(tmp_path), engine], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    assert p.stdout.readline().strip() == "started"  # a worker has written its first block
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "Aborted" in err
    assert leftovers(tmp_path) == []


def test_a_worker_process_killed_mid_run_ends_the_bench_with_its_exit_code(tmp_path) -> None:
    """Before: the other workers ran on to the end of --duration, then the RuntimeError about the
    dead worker ended bench in a traceback. Now they are stopped, and bench exits 1 naming it."""
    p = subprocess.Popen([sys.executable, "-u", "-c", _KILLED, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    pid = int(p.stdout.readline())  # worker 0, released at the start barrier
    os.kill(pid, signal.SIGKILL)
    _, err = p.communicate(timeout=50)  # well before --duration's 60 s
    assert p.returncode == 1, err
    assert "bench failed: bench workers [0] ended without a result (exit codes [-9])" in err
    assert "Traceback" not in err
    assert leftovers(tmp_path) == []


def test_a_bench_killed_with_sigkill_takes_its_worker_processes(tmp_path) -> None:
    """Its worker processes (daemon=True, which acts only at a clean exit) went on writing for the
    rest of --duration after bench was SIGKILLed (the OOM killer, ``timeout -s KILL``)."""
    p = subprocess.Popen([sys.executable, "-u", "-c", _KILLED.replace("self._procs[0].pid",
                                                                      "*[q.pid for q in self._procs]"),
                          str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
    fds = [os.pidfd_open(int(pid)) for pid in p.stdout.readline().split()]  # both workers, released to write
    try:
        p.kill()
        p.wait()
        ends = [fd for fd in fds if select.select([fd], [], [], 30)[0]]  # a pidfd reads once its process ended
        for fd in set(fds) - set(ends):  # what a failure leaves, this test removes
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        for fd in fds:
            os.close(fd)
    assert len(fds) == 2 and ends == fds, "a worker still wrote 30 s after bench was SIGKILLed"
    assert [n[:len("fastckpt-bench-")] for n in os.listdir(tmp_path)] == ["fastckpt-bench-"]  # all it leaves


_KILLED = """
import sys
from fastckpt.cli import bench_io, main
go = bench_io.Phase.go
def announced(self):
    t = go(self)
    print(self._procs[0].pid, flush=True)
    return t
bench_io.Phase.go = announced
sys.exit(main(["bench", "--dir", sys.argv[1], "--workers", "2", "--size", "16MiB", "--block-size", "1MiB",
               "--duration", "60s", "--engine", "processes"]))
"""


# Runs bench for a minute in a child and prints "started" once the first block is written
# (spied on through FileOps.pwrite), so the parent interrupts it mid-run without sleeping.
_WATCHED = """
import signal
import socket
import sys
# Ctrl-C as in a terminal, even when the suite runs in the background: a shell without job
# control starts background commands with SIGINT ignored, and children inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
from fastckpt.io.ops import FileOps
from fastckpt.cli import main
real = FileOps.pwrite
said = []
def pwrite(self, fd, data, offset):
    n = real(self, fd, data, offset)
    if not said:
        said.append(1)
        print("started", flush=True)
    return n
FileOps.pwrite = pwrite
engine = sys.argv[2]
if engine == "processes":  # spawned workers do not inherit the spy: announce at the start barrier
    from fastckpt.cli import bench_io
    go = bench_io.Phase.go
    def announced(self):
        t = go(self)
        print("started", flush=True)
        return t
    bench_io.Phase.go = announced
sys.exit(main(["bench", "--dir", sys.argv[1], "--workers", "2", "--size", "16MiB", "--block-size", "1MiB",
               "--duration", "60s", "--engine", engine]))
"""


def test_two_nodes_through_torchrun(tmp_path) -> None:
    """Two gloo processes on one machine stand for two nodes: both ranks' workers count."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fastckpt.cli", "bench", "--dir", str(tmp_path), "--workers", "1", "--size", "8MiB",
           "--block-size", "1MiB", "--verify", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)  # rank 0 prints; rank 1 prints nothing
    assert d["world_size"] == 2
    assert sorted((w["op"], w["rank"]) for w in d["workers"]) == [("read", 0), ("read", 1), ("write", 0), ("write", 1)]
    assert d["write_bytes"] == 2 * (8 << 20)
    assert leftovers(tmp_path) == []



def test_a_node_that_refuses_to_run_ends_every_nodes_run(tmp_path) -> None:
    """A node whose --dir was missing (or short of space, or without GDS) exited alone at once, and
    every other node waited for it in the process group's set-up for 30 minutes. Two launchers
    stand for two nodes (one torchrun would tear its other worker down itself)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "d").mkdir()

    def node(rank: int, where: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
             str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "fastckpt.cli", "bench",
             "--dir", where, "--workers", "1", "--size", "1MiB", "--block-size", "1MiB"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)

    nodes = [node(0, str(tmp_path / "d")), node(1, str(tmp_path / "unmounted"))]
    try:
        out = [p.communicate(timeout=120)[0] for p in nodes]  # before: node 0 waited 30 minutes
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    assert f"Directory '{tmp_path / 'unmounted'}' does not exist" in out[1], out[1][-3000:]
    assert re.search(r"bench not run: rank 1 \(.+\) refused to: Invalid value for '--dir'", out[0]), out[0][-3000:]
    assert leftovers(tmp_path / "d") == []


def test_a_process_group_that_cannot_form_is_one_line_not_a_traceback(tmp_path) -> None:
    """The group moved ahead of the try that names failures (ce0b76b): a master port in use ended
    in torch's raw DistNetworkError traceback."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = dict(_env(), WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(busy.getsockname()[1]))
        r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "bench", "--dir", str(tmp_path), "--workers", "1",
                            "--size", "1MiB", "--block-size", "1MiB"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "bench failed: the nodes could not form their process group:" in r.stderr and "EADDRINUSE" in r.stderr


def _bare_env(**extra: str) -> dict:
    """``_env()`` without any launcher's variables, and with ``extra``."""
    env = {k: v for k, v in _env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                         "MASTER_PORT")}
    return dict(env, **extra)


@pytest.mark.parametrize("given, missing", [({}, "$RANK, $MASTER_ADDR and $MASTER_PORT are not set"),
                                            ({"RANK": "0"}, "$MASTER_ADDR and $MASTER_PORT are not set")])
def test_world_size_without_the_rendezvous_variables_is_one_line(tmp_path, given: dict, missing: str) -> None:
    """Before: $WORLD_SIZE=2 alone (a launcher's environment filled for another program) ended in
    torch's ValueError traceback ("environment variable RANK expected, but not set")."""
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "bench", "--dir", str(tmp_path), "--workers", "1",
                        "--size", "1MiB", "--block-size", "1MiB"], env=_bare_env(WORLD_SIZE="2", **given),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"fastckpt: ConfigError: $WORLD_SIZE=2 in the environment makes bench one of 2 nodes, but {missing} (torch's "
        "rendezvous needs $RANK, $MASTER_ADDR and $MASTER_PORT too): run bench under torchrun, which sets them all "
        "(docs/readiness.md), or unset WORLD_SIZE to bench this node alone"]
    assert leftovers(tmp_path) == []


def test_a_node_says_what_it_waits_for_while_its_peers_start(tmp_path) -> None:
    """Before: a node whose peers had not started was silent for up to 30 minutes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def node(rank: int) -> subprocess.Popen:
        (tmp_path / f"d{rank}").mkdir()
        return subprocess.Popen([sys.executable, "-m", "fastckpt.cli", "bench", "--dir", str(tmp_path / f"d{rank}"),
                                 "--workers", "1", "--size", "1MiB", "--block-size", "1MiB", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=_bare_env(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK="0",
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))

    nodes = [node(0)]
    silent = threading.Timer(120, nodes[0].kill)  # the old code said nothing: end its 30-minute wait
    silent.start()
    try:
        # rank 1 not started yet: rank 0 is in the rendezvous, and says so (its first line)
        first = nodes[0].stderr.readline()
        silent.cancel()
        assert first.strip() == (
            f"fastckpt bench: rank 0 waiting for 2 nodes at 127.0.0.1:{port} (every node must start bench; the "
            "wait ends after 30 minutes)")
        nodes.append(node(1))
        outs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert json.loads(outs[0][0])["world_size"] == 2 and "waiting for 2 nodes" in outs[1][1]
