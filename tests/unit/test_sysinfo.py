"""Node storage facts: mounts, free space, /proc/stat, NVMe SMART through nvme-cli."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fastckpt import sysinfo

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


def test_cpu_times(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  100 0 50 800 {2 * hz} 0 0 0 7 7\ncpu0 1 2 3\n")
    iowait, total = sysinfo.cpu_times(str(stat))
    assert iowait == 2 and total == pytest.approx((950 + 2 * hz) / hz)
    assert sysinfo.cpu_times(str(tmp_path / "none")) is None
