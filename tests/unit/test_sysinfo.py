"""Node storage facts: mounts, free space, /proc/stat, NVMe SMART through nvme-cli."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fastckpt import sysinfo
from tests.helpers import tmpfs

# nvme-cli's JSON for `nvme smart-log /dev/nvme0 -o json` (field names of nvme-print-json.c)
SMART = {"critical_warning": 0, "temperature": 310, "avail_spare": 100, "spare_thresh": 10, "percent_used": 3,
         "endurance_grp_critical_warning_summary": 0, "data_units_read": 1234, "data_units_written": "2000",
         "host_read_commands": 1, "host_write_commands": 2, "media_errors": 0, "num_err_log_entries": 0}


def test_parse_smart() -> None:
    s = sysinfo.parse_smart("/dev/nvme0", SMART)
    assert s.temperature_c == pytest.approx(36.85)
    assert s.percentage_used == 3
    assert s.data_written_bytes == 2000 * 512_000
    assert s.media_errors == 0
    assert s.write_amplification is None  # the standard log has no media writes: absent, not 1.0
    waf = sysinfo.parse_smart("/dev/nvme0", dict(SMART, media_units_written=3000))
    assert waf.write_amplification == pytest.approx(1.5)
    bare = sysinfo.parse_smart("/dev/nvme1", {})
    assert (bare.temperature_c, bare.data_written_bytes, bare.media_errors) == (None, None, None)


def test_read_smart_without_nvme_cli_or_device() -> None:
    assert sysinfo.read_smart(nvme="no-such-nvme-cli") == []
    assert sysinfo.read_smart(devices=[]) == []


@pytest.mark.skipif(shutil.which("nvme") is None, reason="nvme-cli is not installed")
def test_read_smart_with_nvme_cli_and_a_missing_device() -> None:
    assert sysinfo.read_smart(devices=["/dev/nvme-does-not-exist"]) == []


def test_mounts_and_mount_of(tmp_path: Path) -> None:
    table = tmp_path / "mounts"
    table.write_text("/dev/vda / ext4 rw,relatime 0 0\n"
                     "tmpfs /dev/shm tmpfs rw,nosuid 0 0\n"
                     "/dev/nvme0n1 /mnt/my\\040disk xfs rw,noatime 0 0\n")
    ms = sysinfo.mounts(str(table))
    assert ms[2] == sysinfo.Mount("/dev/nvme0n1", "/mnt/my disk", "xfs", ("rw", "noatime"))
    assert sysinfo.mount_of("/mnt/my disk/ckpt", ms).fstype == "xfs"
    assert sysinfo.mount_of("/dev/shm/x", ms).fstype == "tmpfs"
    assert sysinfo.mount_of("/home/x", ms).mountpoint == "/"
    assert sysinfo.mounts(str(tmp_path / "none")) == []


def test_space_of_a_directory_not_created_yet(tmp_path: Path) -> None:
    sp = sysinfo.space(str(tmp_path / "not" / "yet"))
    st = os.statvfs(tmp_path)
    assert sp.size == st.f_blocks * st.f_frsize
    assert sp.free > 0


def test_a_ramfs_has_no_size_not_zero_bytes_free(tmp_path: Path) -> None:
    """statvfs of a ramfs says f_blocks == f_bavail == 0 (``df`` shows 0/0): it has no limit. Before,
    space() read that as 0 bytes free of 0, and doctor failed a ramfs burst buffer as full."""
    with tmpfs(tmp_path / "ram", "defaults", fstype="ramfs") as ram:
        sp = sysinfo.space(str(ram / "not-yet"))
        assert (sp.mountpoint, sp.size, sp.free) == (str(ram), None, None)
        (ram / "f").write_bytes(b"x" * 4096)  # a ramfs with files in it says 0/0 all the same
        assert sysinfo.space(str(ram)).free is None


def test_cpu_times(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  100 0 50 800 {2 * hz} 0 0 0 7 7\ncpu0 1 2 3\n")
    iowait, total = sysinfo.cpu_times(str(stat))
    assert iowait == 2 and total == pytest.approx((950 + 2 * hz) / hz)
    assert sysinfo.cpu_times(str(tmp_path / "none")) is None


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize(("cgroup", "files", "expect"), [
    # cgroup v2: 1 GiB limit, 300 MiB used of which 100 MiB is reclaimable page cache
    ("0::/\n", {"memory.max": "1073741824\n", "memory.current": str(300 << 20),
                "memory.stat": f"anon 1\ninactive_file {100 << 20}\n"}, (1 << 30) - (200 << 20)),
    ("0::/\n", {"memory.max": "max\n", "memory.current": "5"}, 8 << 30),  # no limit: the node's
    # cgroup v1, memory controller in its own folder
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": str(2 << 30), "memory/memory.usage_in_bytes": str(1 << 30),
                      "memory/memory.stat": "cache 1\ntotal_inactive_file 0\n"}, 1 << 30),
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, 8 << 30),  # v1's "unlimited"
    # the process's own cgroup (from /proc/self/cgroup) and an ancestor's tighter limit
    ("0::/job/step\n", {"job/step/memory.max": str(4 << 30), "job/memory.max": str(3 << 30)}, 3 << 30),
    ("0::/job/step\n", {"job/step/memory.max": str(1 << 30), "job/step/memory.current": str(1 << 31)}, 0),
    ("0::/\n", {}, 8 << 30),  # no cgroup files at all (not Linux, not mounted)
])
def test_mem_available_is_the_smaller_of_the_node_and_its_memory_cgroup(
        tmp_path: Path, cgroup: str, files: dict[str, str], expect: int) -> None:
    """In a container /proc/meminfo is the node's: doctor sized its probe (and drill its job) by
    a node's worth of memory, and the kernel killed it at the container's limit."""
    meminfo, self_cgroup, root = tmp_path / "meminfo", tmp_path / "self_cgroup", tmp_path / "cgroup"
    meminfo.write_text(f"MemTotal: {16 << 20} kB\nMemAvailable: {8 << 20} kB\n")
    self_cgroup.write_text(cgroup)
    _files(root, files)
    got = sysinfo.mem_available(str(meminfo), cgroup_root=str(root), self_cgroup=str(self_cgroup))
    assert got == expect


def test_mem_available_with_a_cgroup_limit_and_no_meminfo(tmp_path: Path) -> None:
    _files(tmp_path, {"memory.max": str(1 << 30)})
    assert sysinfo.mem_available(str(tmp_path / "absent"), str(tmp_path), str(tmp_path / "absent")) == 1 << 30
    assert sysinfo.mem_available(str(tmp_path / "absent"), str(tmp_path / "none"), str(tmp_path / "absent")) is None
