"""``fastckpt doctor`` on this machine: real probes of real directories and a real S3 endpoint."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastckpt import sysinfo
from tests.cli_child import CliChild
from tests.helpers import tmpfs

Doctor = Callable[..., tuple[int, dict | str]]


@pytest.fixture
def doctor(cli_child: CliChild) -> Doctor:
    """``fastckpt doctor ARGS`` (in ``cwd``): its exit code and its JSON, or its text. The runs of
    this module share one child process: a child each spent most of this file's time starting
    Python and importing torch and the CLI. A test that needs a fresh process starts its own."""
    def run(*args: str, cwd: Path | None = None) -> tuple[int, dict | str]:
        res = cli_child.run("doctor", *args, cwd=cwd)
        if "--json" in args and res.returncode in (0, 1):
            return res.returncode, json.loads(res.stdout)
        return res.returncode, res.stdout + res.stderr
    return run


def _by_check(out: dict) -> dict[str, dict]:
    return {f["check"]: f for f in out["findings"]}


def test_burst_buffer_and_target_directories(doctor: Doctor, tmp_path: Path) -> None:
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--target", str(tmp_path / "home"),
                       "--state-size", "64MiB", "--probe-size", "64MiB", "--json")
    f = _by_check(out)
    assert code == 0 and out["ok"], out
    assert f["local_dir.writable"]["status"] == "ok"
    # a directory that did not exist is created, and said so (a typo in a path is then visible)
    assert f["local_dir.writable"]["summary"] == f"{tmp_path / 'bb'} did not exist: created it (as the first save " \
        "would), and it is writable"
    assert f["local_dir.filesystem"]["data"]["fstype"]  # from /proc/mounts
    assert f["local_dir.odirect"]["status"] in ("ok", "warn")
    assert f["local_dir.free_space"]["data"]["need_bytes"] == 2 * (64 << 20)
    bw = f["local_dir.bandwidth"]["data"]
    assert bw["probe_bytes"] == 64 << 20 and bw["write_Bps"] > 0 and bw["read_Bps"] > 0
    assert "target.bandwidth" not in f  # saves write to the burst buffer: the target's is not probed
    assert f["target.separate"]["status"] == "warn"  # both live on the same filesystem here
    assert f["tier.auto.cpu"]["data"]["tier"] == "nvme"
    assert [d["local_dir"] for d in f["tier.auto.cpu"]["data"]["drives"]] == [str(tmp_path / "bb")]
    assert out["auto"]["cpu"] == "nvme"
    assert set(out["auto"]) == ({"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"})
    assert os.listdir(tmp_path / "bb") == []  # every probe file was removed


def test_direct_tier_probes_the_target(doctor: Doctor, tmp_path: Path) -> None:
    code, out = doctor("--target", str(tmp_path), "--probe-size", "16MiB", "--json")
    f = _by_check(out)
    assert code == 0
    assert f["target.bandwidth"]["data"]["write_Bps"] > 0
    assert out["auto"]["cpu"] == "direct"
    assert "local_dir.writable" not in f


def test_a_file_url_target_is_the_local_directory(doctor: Doctor, tmp_path: Path) -> None:
    """``file:///DIR`` is the directory DIR to the library (a save there is direct, no burst buffer):
    doctor took it for a remote URL, failed ``target.burst_buffer``, named no tier and exited 1."""
    code, out = doctor("--target", f"file://{tmp_path / 'home'}", "--probe-size", "0", "--json")
    f = _by_check(out)
    assert code == 0 and out["ok"], out
    assert "target.burst_buffer" not in f
    assert f["target.writable"]["status"] == "ok" and str(tmp_path / "home") in f["target.writable"]["summary"]
    assert out["auto"]["cpu"] == "direct"


def test_tier_probes_a_relative_target_itself(doctor: Doctor, tmp_path: Path) -> None:
    """The tier probes once ran in the target's parent: '' for a one-part relative target."""
    code, out = doctor("--target", "bd", "--probe-size", "0", "--json", cwd=tmp_path)
    assert code == 0, out
    f = _by_check(out)
    assert f["tier.auto.cpu"]["data"]["tier"] == "direct"
    assert f["tier.auto.cpu"]["data"]["odirect"] is True  # probed in tmp_path/bd, a file system that allows it
    assert os.listdir(tmp_path / "bd") == []  # the probe's file was removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="here GDS may work: the failure path needs no GPU")
def test_a_requested_tier_that_cannot_work_exits_1(doctor: Doctor, tmp_path: Path) -> None:
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--tier", "gds", "--probe-size", "0", "--json")
    f = _by_check(out)
    assert code == 1 and not out["ok"]
    assert f["tier.requested"]["status"] == "fail" and "tier='gds'" in f["tier.requested"]["summary"]
    assert f["tier.requested"]["fix"]
    code, text = doctor("--local-dir", str(tmp_path / "bb"), "--tier", "gds", "--probe-size", "0")
    assert code == 1 and "fail tier.requested" in text and "fix:" in text


def test_tier_asked_for_against_the_setup(doctor: Doctor, tmp_path: Path) -> None:
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--tier", "direct", "--probe-size", "0", "--json")
    assert code == 1 and "drop local_dir" in _by_check(out)["tier.requested"]["summary"]
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--tier", "nvme", "--probe-size", "0", "--json")
    assert code == 0 and _by_check(out)["tier.requested"]["status"] == "ok"


def test_not_enough_space_and_unwritable_dirs(doctor: Doctor, tmp_path: Path) -> None:
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--state-size", "900TB", "--probe-size", "0", "--json")
    f = _by_check(out)
    assert code == 1 and f["local_dir.free_space"]["status"] == "fail" and f["local_dir.free_space"]["fix"]
    from fastckpt.doctor import DoctorOptions, diagnose

    blocker = tmp_path / "a-file"  # the CLI refuses a path below a file (exit 2): diagnose() itself checks it
    blocker.write_text("x")
    dx = diagnose(DoctorOptions(str(blocker / "bb"), probe_bytes=0))
    f = {x.check: x for x in dx.findings}
    assert dx.exit_code == 1 and f["local_dir.writable"].status == "fail"
    assert f["local_dir.writable"].fix.startswith(f"{blocker} is a file, so no directory can be made below it")
    assert not any(c.startswith("tier.") for c in f) and not dx.auto  # no tier decision where it cannot write


def test_a_full_burst_buffer_is_named_full_with_its_fix(doctor: Doctor, tmp_path: Path) -> None:
    """Not "not writable, create it and make it writable": the free-space finding says how much."""
    with tmpfs(tmp_path / "bb", "size=1m") as bb:
        (bb / "fill").write_bytes(b"\0" * (1 << 20))  # tmpfs rounds: fill what is left
        with contextlib.suppress(OSError), open(bb / "fill2", "wb") as f:
            f.write(b"\0" * (1 << 20))
        code, out = doctor("--local-dir", str(bb), "--state-size", "1MiB", "--probe-size", "0", "--json")
    f = _by_check(out)
    assert code == 1 and f["local_dir.writable"]["status"] == "fail"
    fix = f["local_dir.writable"]["fix"]
    assert "free space" in fix and "writable by this user" not in fix
    assert f["local_dir.free_space"]["status"] == "fail"


def test_the_probe_never_fills_a_nearly_full_drive(doctor: Doctor, tmp_path: Path) -> None:
    """About 1 MiB free: the probe's 1 MiB floor overrode "a quarter of the free space", filled
    the drive, and printed "a 0.00 GB checkpoint takes about 0.0 s". Now it is skipped, saying why."""
    with tmpfs(tmp_path / "fs", "size=4m") as fs:
        (fs / "fill").write_bytes(b"\0" * (3 << 20))
        before = os.statvfs(fs).f_bavail
        code, out = doctor("--target", str(fs), "--state-size", "1KiB", "--json")
        assert os.statvfs(fs).f_bavail == before and sorted(os.listdir(fs)) == ["fill"]
    f = _by_check(out)["target.bandwidth"]
    assert f["status"] == "warn" and f["data"]["probe_bytes"] == 0, f
    assert f["summary"].startswith(f"bandwidth not measured: {fs} has ") and "it would fill the drive" in f["summary"]
    assert "--probe-size 0" in f["fix"]


def test_the_time_to_write_a_small_checkpoint_is_not_printed_as_zero(tmp_path: Path) -> None:
    from fastckpt.doctor.local import bandwidth

    f = bandwidth("target", str(tmp_path), 1 << 20, 1 << 20, "off")
    assert f.status == "ok" and "; a 1.05 MB checkpoint takes about " in f.summary, f.summary
    assert " 0.0 s" not in f.summary and f.data["write_s_for_state"] > 0


def test_a_read_only_filesystem_is_named_read_only_not_create_and_chmod(doctor: Doctor, tmp_path: Path) -> None:
    """EROFS on a directory that exists (a ro mount; an NFS/Lustre export the server serves
    read-only, whose client options still say rw) was told "create DIR and make it writable by
    this user": it exists, and no chmod makes a read-only filesystem writable."""
    with tmpfs(tmp_path / "bb", "size=1m,ro") as bb:
        code, out = doctor("--local-dir", str(bb), "--probe-size", "0", "--json")
    f = _by_check(out)["local_dir.writable"]
    assert code == 1 and f["status"] == "fail" and f["data"]["errno"] == errno.EROFS
    assert f["fix"] == (f"{bb} is on a read-only filesystem: remount it read-write (NFS, Lustre: ask for a writable "
                        "export), or choose another local_dir")


def test_a_target_below_a_file_is_not_to_be_created(tmp_path: Path) -> None:
    """diagnose() (the CLI refuses it first, exit 2): the fix was "create FILE/sub", below a file."""
    from fastckpt.doctor import DoctorOptions, diagnose

    (tmp_path / "step-100.pt").write_text("x")
    dx = diagnose(DoctorOptions(target=str(tmp_path / "step-100.pt" / "ckpt"), probe_bytes=0))
    w = {f.check: f for f in dx.findings}["target.writable"]
    assert w.status == "fail" and w.data == {"errno": errno.ENOTDIR}
    assert w.fix == (f"{tmp_path / 'step-100.pt'} is a file, so no directory can be made below it: give a directory "
                     "path, or choose another target")


def test_an_existing_directory_this_user_cannot_write_is_not_to_be_created(tmp_path: Path) -> None:
    """As another user (nobody) than the directory's owner (root): EACCES on a directory that
    exists asks for its owner or mode, not for it to be created."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to run doctor as another user than the directory's owner")
    base = Path(tempfile.mkdtemp())  # /tmp: a path nobody can reach (pytest's tmp_path is 0700)
    try:
        base.chmod(0o755)
        (base / "bb").mkdir()
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                              "fastckpt.cli", "doctor", "--local-dir", str(base / "bb"), "--probe-size", "0", "--json"],
                             capture_output=True, text=True, env={**os.environ, "HOME": str(base)})
        if res.returncode not in (0, 1):
            pytest.skip(f"fastckpt cannot run as nobody here (its files unreadable to that user): {res.stderr[-300:]}")
        f = _by_check(json.loads(res.stdout))["local_dir.writable"]
    finally:
        shutil.rmtree(base)
    assert res.returncode == 1 and f["status"] == "fail" and f["data"]["errno"] == errno.EACCES
    assert f["fix"] == f"make {base / 'bb'} writable by this user (owner, mode), or choose another local_dir"


@pytest.mark.parametrize("size, verdict", [("12MiB", "ok"), ("20MiB", "fail")])
def test_a_striped_burst_buffer_needs_a_share_of_the_state_on_each_drive(doctor: Doctor, tmp_path: Path, size: str,
                                                                          verdict: str) -> None:
    """Striping spreads a checkpoint's files over the drives: each drive was checked against the
    whole state, so two 8 MiB drives failed for a 12 MiB checkpoint that a save stripes over them."""
    with tmpfs(tmp_path / "nvme0", "size=8m") as d0, tmpfs(tmp_path / "nvme1", "size=8m") as d1:
        code, out = doctor("--local-dir", str(d0 / "bb"), "--local-dir", str(d1 / "bb"), "--target",
                           str(tmp_path / "home"), "--state-size", size, "--keep", "1", "--probe-size", "0", "--json")
    f = _by_check(out)
    share = -(-int(size.removesuffix("MiB")) * (1 << 20) // 2)
    for i in (0, 1):
        assert f[f"local_dir[{i}].free_space"]["data"]["need_bytes"] == share  # before: the whole state
        assert "a 1/2 share striped over 2 drives" in f[f"local_dir[{i}].free_space"]["summary"]
    whole = f["local_dir.free_space"]  # the sum of the drives against the whole state
    assert whole["status"] == verdict and whole["data"]["need_bytes"] == 2 * share
    assert (code == 0) == (verdict == "ok")  # before: 1 for both


@pytest.mark.parametrize("size, verdict", [("3MiB", "ok"), ("5MiB", "fail")])
def test_a_target_on_the_burst_buffers_filesystem_needs_room_for_both(doctor: Doctor, tmp_path: Path, size: str,
                                                                       verdict: str) -> None:
    """The burst buffer keeps its copies and the target its own on the one filesystem. Before: each
    free_space was checked alone against all of it, both said ok (exit 0) for two 5 MiB copies on
    8 MiB, and the job ran out of space once the second copy landed."""
    with tmpfs(tmp_path / "fs", "size=8m") as fs:
        code, out = doctor("--local-dir", str(fs / "bb"), "--target", str(fs / "home"), "--state-size", size,
                           "--keep", "1", "--probe-size", "0", "--json")
    f = _by_check(out)
    assert f["local_dir.free_space"]["status"] == "ok" and f["target.free_space"]["status"] == "ok"  # alone
    both = f["target.shared_free_space"]
    need = int(size.removesuffix("MiB")) << 20
    assert both["status"] == verdict and both["data"]["need_bytes"] == 2 * need
    assert (code == 0) == (verdict == "ok")
    if verdict == "fail":
        assert "other than the burst buffer's" in both["fix"]


def test_no_shared_space_finding_for_separate_filesystems(doctor: Doctor, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "nvme", "size=8m") as bb:
        code, out = doctor("--local-dir", str(bb / "bb"), "--target", str(tmp_path / "home"), "--state-size",
                           "5MiB", "--keep", "1", "--probe-size", "0", "--json")
    assert code == 0 and "target.shared_free_space" not in _by_check(out)


def test_a_striped_burst_buffer_names_the_drive_that_refuses_o_direct(doctor: Doctor, tmp_path: Path) -> None:
    """The tier decision probed the first drive only: with the second on a ramfs it said
    "tier=nvme (O_DIRECT)" (data "odirect": true) while saves write that drive's files buffered."""
    nvme = tmp_path / "nvme0"
    with tmpfs(tmp_path / "ram", "defaults", fstype="ramfs") as ram:
        code, out = doctor("--local-dir", str(nvme), "--local-dir", str(ram / "bb"), "--target",
                           str(tmp_path / "home"), "--probe-size", "0", "--json")
        _, both = doctor("--local-dir", str(nvme), "--local-dir", str(tmp_path / "nvme1"), "--target",
                         str(tmp_path / "home"), "--probe-size", "0", "--json")
    assert code == 0, out
    tier = _by_check(out)["tier.auto.cpu"]
    refused = f"filesystem at {ram / 'bb'} refused O_DIRECT"
    assert f"tier=nvme (O_DIRECT on 1 of 2 drives; buffered on {ram / 'bb'}: {refused}); " in tier["summary"]
    assert tier["data"]["tier"] == "nvme" and tier["data"]["odirect"] is False
    assert tier["data"]["drives"] == [
        {"local_dir": str(nvme), "tier": "nvme", "odirect": True, "odirect_reason": None},
        {"local_dir": str(ram / "bb"), "tier": "nvme", "odirect": False, "odirect_reason": refused}]
    tier = _by_check(both)["tier.auto.cpu"]
    assert "tier=nvme (O_DIRECT on 2 of 2 drives); " in tier["summary"] and tier["data"]["odirect"] is True


def test_a_ramfs_is_a_drive_without_a_size_limit_not_a_full_one(doctor: Doctor, tmp_path: Path) -> None:
    """A ramfs reports no size (statvfs f_blocks == 0). Before: `fail local_dir.free_space: 0 GB free
    of 0 GB`, target.free_space and target.shared_free_space the same, exit 1, and the probe capped
    to nothing (`bandwidth not measured: ... has 0 B free`). Its bound is the memory available (its
    pages can be neither swapped nor reclaimed): checkpoints larger than that fail the check."""
    with tmpfs(tmp_path / "ram", "defaults", fstype="ramfs") as ram:
        code, out = doctor("--local-dir", str(ram / "bb"), "--target", str(ram / "home"), "--state-size", "1MiB",
                           "--probe-size", "1MiB", "--json")
        too_big = sysinfo.mem_available() * 2  # (two copies: --keep's default)
        _, big = doctor("--local-dir", str(ram / "bb"), "--target", str(ram / "home"), "--state-size", str(too_big),
                        "--probe-size", "0", "--json")
    f = _by_check(out)
    assert code == 0 and out["ok"], out
    for role in ("local_dir", "target"):
        assert f[f"{role}.free_space"]["status"] == "ok"
        assert f"GB of memory available to {ram}, a ramfs (it keeps its files in memory" in \
            f[f"{role}.free_space"]["summary"], f[f"{role}.free_space"]
        assert f[f"{role}.free_space"]["data"]["size_bytes"] is None
        assert _by_check(big)[f"{role}.free_space"]["status"] == "fail", _by_check(big)[f"{role}.free_space"]
    assert "target.shared_free_space" not in f
    assert f["local_dir.bandwidth"]["data"]["probe_bytes"] == 1 << 20


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_memory_filesystem_as_burst_buffer_is_a_warning(doctor: Doctor, tmp_path: Path) -> None:
    bb = Path("/dev/shm") / f"fastckpt-doctor-{os.getpid()}"
    try:
        code, out = doctor("--local-dir", str(bb), "--target", str(tmp_path), "--probe-size", "0", "--json")
    finally:
        if bb.exists():
            bb.rmdir()
    fs = _by_check(out)["local_dir.filesystem"]
    if fs["data"]["fstype"] != "tmpfs":
        pytest.skip(f"/dev/shm is {fs['data']['fstype']} here")
    assert code == 0 and fs["status"] == "warn" and "RAM" in fs["summary"]


def test_bad_usage_exits_2(doctor: Doctor) -> None:
    assert doctor("--state-size", "lots")[0] == 2
    assert doctor("--tier", "fast")[0] == 2


@pytest.mark.parametrize("size, problem", [("8Gb", "is in bits"), ("0", "must be more than 0"),
                                           ("8G", "cannot read '8G' as a size")])
def test_sizes_are_read_as_every_other_command_reads_them(doctor: Doctor, tmp_path: Path, size: str,
                                                          problem: str) -> None:
    code, text = doctor("--target", str(tmp_path), "--state-size", size, "--probe-size", "0")
    assert code == 2 and problem in text and "--state-size" in text
    code, out = doctor("--target", str(tmp_path), "--state-size", "1e9", "--probe-size", "0", "--json")
    assert code in (0, 1) and _by_check(out)["target.free_space"]["data"]["need_bytes"] == 2e9


@pytest.mark.parametrize("asked, probed", [("32MiB", 32 << 20), ("1MiB", 1 << 20), ("3.5MiB", 3 << 20)])
def test_the_probe_writes_what_was_asked_in_whole_mib(doctor: Doctor, tmp_path: Path, asked: str, probed: int) -> None:
    code, out = doctor("--target", str(tmp_path), "--probe-size", asked, "--json")
    assert code in (0, 1)
    assert _by_check(out)["target.bandwidth"]["data"]["probe_bytes"] == probed


def test_the_probe_is_capped_by_the_memory_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe holds its bytes twice: one larger than the node's memory had the kernel kill
    doctor (or the training job beside it) instead of measuring anything."""
    from fastckpt import sysinfo
    from fastckpt.doctor.local import bandwidth

    monkeypatch.setattr(sysinfo, "mem_available", lambda: 16 << 20)
    f = bandwidth("target", str(tmp_path), 64 << 20, None, "off")
    assert f.status == "ok" and f.data["probe_bytes"] == 4 << 20
    assert "--probe-size capped at a quarter of the 0.0168 GB of memory available" in f.summary
    assert os.listdir(tmp_path) == []


_NO_ROOM = """
import json, resource, sys
from fastckpt import sysinfo
from fastckpt.doctor.local import bandwidth
sysinfo.mem_available = lambda: 1 << 50  # not capped: the limit below is what refuses it
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), resource.RLIM_INFINITY))
f = bandwidth("target", sys.argv[1], 256 << 20, None, "off")
print(json.dumps([f.status, f.summary, f.fix]))
"""


def test_a_probe_this_process_cannot_allocate_is_a_fail_naming_probe_size(tmp_path: Path) -> None:
    """An allocation refused by a limit on the process's memory (RLIMIT_AS, as a cgroup or a
    batch system sets) was outside the probe's try: a raw ``OSError: [Errno 12]`` traceback."""
    res = subprocess.run([sys.executable, "-c", _NO_ROOM, str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    status, summary, fix = json.loads(res.stdout)
    assert status == "fail" and "256 MiB does not fit in this process's memory" in summary
    assert fix == "give a smaller --probe-size (0 skips the probe)"
    assert os.listdir(tmp_path) == []


# Runs doctor and holds the bandwidth probe's first write (spied on through FileOps) until the
# parent closes stdin, printing "started" first: the parent stops it mid-probe without sleeping.
_HELD = """
import sys
from fastckpt.io.ops import FileOps
from fastckpt.cli import main
real_open, real_pwrite, probe = FileOps.open, FileOps.pwrite, set()
def open_(self, path, flags, mode=0o644):
    fd = real_open(self, path, flags, mode)
    if ".fastckpt-doctor-bw-" in path:
        probe.add(fd)
    return fd
def pwrite(self, fd, data, offset):
    n = real_pwrite(self, fd, data, offset)
    if fd in probe and offset == 0:
        print("started", flush=True)
        sys.stdin.readline()  # until the parent has sent its signal
    return n
FileOps.open, FileOps.pwrite = open_, pwrite
sys.exit(main(["doctor", "--local-dir", sys.argv[1], "--target", sys.argv[2], "--probe-size", "8MiB"]))
"""


def test_sigterm_mid_probe_removes_the_probe_file(tmp_path: Path) -> None:
    """SIGTERM (a scheduler's cancel, ``timeout 60 fastckpt doctor``) killed doctor before the
    probe's ``finally``: up to --probe-size bytes stayed hidden in the burst buffer for good."""
    bb = tmp_path / "bb"
    p = subprocess.Popen([sys.executable, "-u", "-c", _HELD, str(bb), str(tmp_path / "home")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "started"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(input="\n", timeout=120)
    assert p.returncode == 1 and "Aborted" in err, err
    assert os.listdir(bb) == []


@pytest.mark.parametrize("then", ["doctor", "save"])
def test_a_probe_file_a_sigkill_left_is_removed_by_the_next_doctor_or_save(doctor: Doctor, tmp_path: Path,
                                                                          then: str) -> None:
    """SIGKILL (``timeout -s KILL`` in a node health check, the OOM killer) runs no clean-up, and the
    probe file's name (``.fastckpt-doctor-bw-<random>``) did not say whose it was: each killed doctor
    left up to --probe-size bytes hidden in the burst buffer for good. Now it names its host and
    process, and the next doctor or save there removes a dead process's probe."""
    bb, home = tmp_path / "bb", tmp_path / "home"
    p = subprocess.Popen([sys.executable, "-u", "-c", _HELD, str(bb), str(home)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout.readline().strip() == "started"
    p.kill()
    p.communicate()
    left = os.listdir(bb)
    assert len(left) == 1 and left[0].startswith(".fastckpt-doctor-bw-")
    if then == "doctor":
        code, _ = doctor("--local-dir", str(bb), "--target", str(home), "--probe-size", "1MiB", "--json")
        assert code == 0
    else:
        import fastckpt

        with fastckpt.Checkpointer(local_dir=str(bb)) as ck:
            ck.save({"w": torch.zeros(4)}, str(home / "s.pt")).wait()
    assert left[0] not in os.listdir(bb)


# As _HELD, but the probe's first write never returns (a hung NFS/FUSE mount): the worker stays stuck,
# and the watchdog ends the process. It waits 3 s here, not CLEANUP_S's 10: the same path, 7 s sooner.
_HUNG = _HELD.replace("import sys\n", "import sys, threading\nfrom fastckpt.cli import _signals\n"
                      "_signals.CLEANUP_S = 3.0\n").replace(
    "sys.stdin.readline()  # until the parent has sent its signal", "threading.Event().wait()  # never returns")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_one_signal_ends_doctor_while_its_probe_write_hangs(tmp_path: Path, sig: int) -> None:
    """SIGTERM's KeyboardInterrupt unwound into the probe's thread pool, which joined the worker
    stuck in its write for ever (and the interpreter's exit joined it again): doctor outlived the
    signal on exactly the storage it was run to diagnose. Now the pool is left, the probe file
    removed, and the watchdog of cli/_signals.py ends the process within CLEANUP_S, after Ctrl-C
    too (r6_doctor_ctrlc_hangs_on_stuck_probe: it hung there once SIGTERM's case was mended)."""
    assert "never returns" in _HUNG and "CLEANUP_S = 3.0" in _HUNG
    bb = tmp_path / "bb"
    p = subprocess.Popen([sys.executable, "-u", "-c", _HUNG, str(bb), str(tmp_path / "home")],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "started"
        p.send_signal(sig)
        _, err = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode in (1, 128 + sig) and "Aborted" in err, err  # 143/130: the watchdog ended the stuck exit
    assert os.listdir(bb) == []


# ----------------------------------------------------------------------------- S3 (SeaweedFS)
def _options(tmp_path: Path, opts: dict) -> str:
    p = tmp_path / "storage.json"
    p.write_text(json.dumps(opts))
    return str(p)


def test_s3_target_reachable_with_credentials_never_printed(doctor: Doctor, tmp_path: Path, s3_server,
                                                            s3_bucket) -> None:
    opts = s3_server.storage_options()
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--target", f"s3://{s3_bucket}/run", "--probe-size",
                       "0", "--storage-options", _options(tmp_path, opts), "--json")
    f = _by_check(out)
    assert code == 0, out
    assert f["target.reachable"]["status"] == "ok"
    creds = f["target.credentials"]
    assert creds["status"] == "ok" and "storage_options['secret']" in creds["summary"]
    assert out["auto"]["cpu"] == "nvme"
    text = json.dumps(out)
    assert opts["secret"] not in text and opts["key"] not in text
    assert s3_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0  # probe deleted


def test_s3_wrong_secret_or_bucket_fails_without_printing_the_secret(doctor: Doctor, tmp_path: Path, s3_server,
                                                                     s3_bucket) -> None:
    wrong = s3_server.storage_options(secret="not-the-secret-0123456789")
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--target", f"s3://{s3_bucket}/run", "--probe-size",
                       "0", "--storage-options", _options(tmp_path, wrong), "--json")
    f = _by_check(out)
    assert code == 1 and f["target.reachable"]["status"] == "fail"
    assert "not-the-secret-0123456789" not in json.dumps(out)
    code, out = doctor("--local-dir", str(tmp_path / "bb"), "--target", "s3://no-such-bucket-fastckpt/run",
                       "--probe-size", "0", "--storage-options", _options(tmp_path, s3_server.storage_options()),
                       "--json")
    assert code == 1 and "does not exist" in _by_check(out)["target.reachable"]["summary"]


def test_an_endpoint_that_never_answers_fails_within_the_deadline(tmp_path: Path) -> None:
    """Before: one listing waited out botocore's 60 s read timeout (target_deadline_s promises 20 s),
    then the finding advised raising retry_deadline_s, a deadline already overrun."""
    import time

    from fastckpt.doctor import DoctorOptions, diagnose

    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        opts = {"endpoint_url": endpoint, "key": "abcd", "secret": "secretvalue"}
        t0 = time.monotonic()
        dx = diagnose(DoctorOptions(str(tmp_path / "bb"), "s3://bucket/run", probe_bytes=0, storage_options=opts,
                                    target_deadline_s=3.0))
        took = time.monotonic() - t0
    f = {x.check: x for x in dx.findings}["target.reachable"]
    assert f.status == "fail" and took < 30, (took, f)  # generous: the old code took over 60 s
    assert f.summary == (f"s3://bucket/run: {endpoint} accepted the connection but did not answer a listing of the "
                         "prefix within the 3 s doctor gives a URL target (its retries included)")
    assert "retry_deadline_s" not in f"{f.summary} {f.fix}" and "load balancer" in f.fix


def test_a_store_failing_until_the_deadline_names_doctors_deadline_not_retry_deadline_s(tmp_path: Path, s3_server,
                                                                                       s3_bucket) -> None:
    """A store that answers 503 to every PUT (a real SeaweedFS behind a proxy): the probe write is
    retried until target_deadline_s. Before, the finding quoted the save's message, `... or raise
    retry_deadline_s (now 2.9 s) to ride out longer outages`: doctor has no retry_deadline_s, and
    the deadline it named was doctor's own, not the save's (300 s by default)."""
    from fastckpt.doctor import DoctorOptions, diagnose
    from tests.s3proxy import StatusProxy

    proxy = StatusProxy(s3_server.process.ports["s3"], 503, "text/plain", b"busy", times=1 << 30)
    try:
        dx = diagnose(DoctorOptions(str(tmp_path / "bb"), f"s3://{s3_bucket}/run", probe_bytes=0, target_deadline_s=3.0,
                                    storage_options=s3_server.storage_options(endpoint_url=proxy.endpoint_url)))
    finally:
        proxy.close()
    f = {x.check: x for x in dx.findings}["target.reachable"]
    assert f.status == "fail" and proxy.refused >= 2, f
    assert f.summary.startswith(f"s3://{s3_bucket}/run: the write of a probe object kept failing for the 3 s doctor "
                                "gives a URL target (its retries included; "), f.summary
    assert "Service Unavailable" in f.summary and "retry_deadline_s" not in f.summary, f.summary
    assert f.fix.startswith("check that the store is up and reachable from this node"), f.fix


def test_an_endpoint_that_refuses_connections_is_named_as_a_wrong_endpoint_not_an_outage(tmp_path: Path,
                                                                                           s3_server) -> None:
    """A wrong endpoint port (nothing listens): the store's client fails at once with
    TargetUnreachableError, a TargetUnavailableError, and the finding for a store that kept failing
    caught it too: "kept failing for the 3 s doctor gives a URL target", advice to wait out an outage."""
    import socket

    from fastckpt.doctor import DoctorOptions, diagnose

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dx = diagnose(DoctorOptions(str(tmp_path / "bb"), "s3://bucket/run", probe_bytes=0, target_deadline_s=3.0,
                                storage_options=s3_server.storage_options(endpoint_url=f"http://127.0.0.1:{port}")))
    f = {x.check: x for x in dx.findings}["target.reachable"]
    assert f.status == "fail" and "cannot reach the endpoint" in f.summary and "kept failing" not in f.summary, f


def test_url_target_needs_a_burst_buffer(doctor: Doctor, tmp_path: Path, s3_server, s3_bucket) -> None:
    code, out = doctor("--target", f"s3://{s3_bucket}/run", "--storage-options",
                       _options(tmp_path, s3_server.storage_options()), "--json")
    assert code == 1 and _by_check(out)["target.burst_buffer"]["status"] == "fail"
    assert not any(c.startswith("tier.") for c in _by_check(out)) and not out["auto"]  # a save there raises


def test_a_timeout_option_of_none_or_a_string_bounds_each_request_by_the_deadline() -> None:
    """botocore takes read_timeout=None (no timeout); doctor's per-request bound compared it with a
    float and died with a TypeError traceback."""
    from fastckpt.doctor.remote import _bounded

    opts = {"config_kwargs": {"read_timeout": None, "connect_timeout": "5", "retries": {"max_attempts": 0}}}
    got = _bounded("s3://b/run", opts, 7.5)["config_kwargs"]
    assert got == {"read_timeout": 7.5, "connect_timeout": 7.5, "retries": {"max_attempts": 0}}
    assert _bounded("s3://b/run", {"config_kwargs": {"read_timeout": 3}}, 7.5)["config_kwargs"]["read_timeout"] == 3
