"""What the node says about its storage and memory: mounts, free space, I/O wait, NVMe SMART, memory.

Shared by the metrics exporter (storage health) and ``fastckpt doctor``. Every reader returns
None (or an empty result) when its source is absent here, never zeros: the caller reports the
source as absent. Nothing here raises for a missing source.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger("fastckpt")
#: One SMART "data unit" is 1000 blocks of 512 bytes (NVMe base specification).
DATA_UNIT_BYTES = 512_000
#: Keys under which a smart-log's JSON reports writes to the media (not every device does).
MEDIA_WRITE_KEYS = ("media_units_written", "physical_media_units_written", "nand_data_units_written")
#: Where the cgroup filesystem is mounted (v2 unified, or v1 with one folder per controller).
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Mount:
    """One line of /proc/mounts."""

    device: str
    mountpoint: str
    fstype: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class Space:
    """A filesystem's size and free bytes (``free``: what an unprivileged user may still use);
    both None where it reports no size (``f_blocks == 0``: a ramfs, some FUSE mounts; ``df``
    shows 0/0): it has no limit fastckpt can tell, which is not a full drive."""

    mountpoint: str
    size: int | None
    free: int | None
    in_memory: bool = False  # a ramfs: its files take the node's memory, which bounds them (``room``)


@dataclass(frozen=True)
class Smart:
    """The fields of ``nvme smart-log -o json`` that fastckpt reports; None where absent."""

    device: str
    temperature_c: float | None
    percentage_used: float | None
    data_written_bytes: int | None
    media_errors: int | None
    write_amplification: float | None


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def mounts(path: str = "/proc/mounts") -> list[Mount]:
    """The mount table ([] where there is none, e.g. not Linux)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 4:
            out.append(Mount(_unescape(parts[0]), _unescape(parts[1]), parts[2], tuple(parts[3].split(","))))
    return out


def mount_of(path: str, table: list[Mount] | None = None) -> Mount | None:
    """The mount holding ``path`` (the longest mountpoint prefix of its real path); the last
    mount on a mountpoint wins, as the kernel shows it."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts() if table is None else table:
        mp = m.mountpoint.rstrip("/") or "/"
        inside = real == mp or real.startswith(mp + "/") or mp == "/"
        if inside and (best is None or len(mp) >= len(best.mountpoint.rstrip("/") or "/")):
            best = m
    return best


def existing_parent(path: str) -> str:
    """``path`` or its nearest existing ancestor (a directory not created yet lives there)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def space(path: str) -> Space | None:
    """Size and free bytes of the filesystem holding ``path`` (or the nearest existing parent)."""
    where = existing_parent(path)
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    m = mount_of(where)
    if not st.f_blocks:
        return Space(m.mountpoint if m else where, None, None, m is not None and m.fstype == "ramfs")
    return Space(m.mountpoint if m else where, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def room(sp: Space) -> int | None:
    """Bytes that may still be written there: its free space; on a ramfs, which reports no size,
    the memory available (its pages can be neither swapped nor reclaimed: a write past it runs
    the node out of memory); None where nothing bounds it that fastckpt can tell."""
    if sp.free is not None:
        return sp.free
    return mem_available() if sp.in_memory else None


def mem_available(path: str = "/proc/meminfo", cgroup_root: str = CGROUP_ROOT,
                  self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes of memory available to new allocations, or None where unknown: the smaller of the
    node's ``MemAvailable`` and what this process's memory cgroup has left (``cgroup_room``).
    In a container ``/proc/meminfo`` is the whole node's: sizing by it alone let an allocation
    pass the check and then have the kernel kill the process at the container's limit."""
    node = None
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    node = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = cgroup_room(cgroup_root, self_cgroup)
    return node if room is None else room if node is None else min(node, room)


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())  # cgroup v2 writes "max" for no limit: ValueError, None
    except (OSError, ValueError):
        return None


def cgroup_room(root: str = CGROUP_ROOT, self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still allocate (limit - working set, the tightest of
    its ancestors' too: limits are hierarchical), or None without a limit. Reads cgroup v2's
    ``memory.max``/``memory.current`` and v1's ``memory/memory.limit_in_bytes``/``usage_in_bytes``
    below ``root``, at the path ``self_cgroup`` names and at ``root`` itself (a container that sees
    its own cgroup as the root, with a host path in /proc/self/cgroup that is not mounted there)."""
    paths = {"v2": "/", "v1": "/"}
    try:
        with open(self_cgroup, encoding="utf-8") as f:
            for line in f:  # "0::/a/b" (v2), "4:memory:/a/b" (v1)
                _, controllers, where = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths["v2"] = where
                elif "memory" in controllers.split(","):
                    paths["v1"] = where
    except (OSError, ValueError):
        pass
    rooms = []
    for version, base, limit_file, usage_file in (("v2", root, "memory.max", "memory.current"),
                                                  ("v1", os.path.join(root, "memory"), "memory.limit_in_bytes",
                                                   "memory.usage_in_bytes")):
        parts = [p for p in paths[version].split("/") if p]
        for depth in range(len(parts), -1, -1):  # the process's own cgroup, then each ancestor up to root
            where = os.path.join(base, *parts[:depth])
            limit = _read_int(os.path.join(where, limit_file))
            if limit is not None:
                used = (_read_int(os.path.join(where, usage_file)) or 0) - _inactive_file(where)
                rooms.append(max(0, limit - max(0, used)))
    return min(rooms) if rooms else None


def _inactive_file(where: str) -> int:
    """Page cache the kernel reclaims before it kills (``inactive_file``, v1 ``total_inactive_file``):
    usage counts it, and a cgroup that just wrote a checkpoint would otherwise look full (the
    working set, as kubelet and ``docker stats`` compute it)."""
    try:
        with open(os.path.join(where, "memory.stat"), encoding="utf-8") as f:
            stat = dict(line.split() for line in f if line.count(" ") == 1)
        return int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        return 0


def cpu_times(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(iowait seconds, total seconds) of all CPUs since boot, or None without /proc/stat."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline().split()
    except OSError:
        return None
    if len(first) < 6 or first[0] != "cpu":
        return None
    ticks = [int(x) for x in first[1:]]
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # guest time is already counted in user/nice: leave the two guest columns out of the total
    return ticks[4] / hz, sum(ticks[:8]) / hz


def nvme_controllers(sys_class: str = "/sys/class/nvme") -> list[str]:
    """``/dev/nvmeN`` of every NVMe controller the kernel knows ([] without any)."""
    return sorted(f"/dev/{os.path.basename(p)}" for p in glob.glob(os.path.join(sys_class, "nvme*")))


def _number(value: object) -> float | None:
    """A SMART field as a number: nvme-cli prints plain numbers, or strings for 128-bit ones
    (with thousands separators in some versions)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).replace(",", "").strip().split(" ")[0]
    try:
        return float(text)
    except ValueError:
        return None


def parse_smart(device: str, data: dict) -> Smart:
    """``nvme smart-log DEV -o json`` output -> Smart. Temperature is in kelvin there (NVMe
    reports kelvin; values below 200 are taken as Celsius, as a few tools print them)."""
    temp = _number(data.get("temperature"))
    if temp is not None and temp >= 200:
        temp -= 273.15
    used = _number(data.get("percent_used", data.get("percentage_used")))
    units = _number(data.get("data_units_written"))
    errors = _number(data.get("media_errors"))
    media = next((v for k in MEDIA_WRITE_KEYS if (v := _number(data.get(k))) is not None), None)
    waf = media / units if media is not None and units else None
    return Smart(device, temp, used, None if units is None else int(units) * DATA_UNIT_BYTES,
                 None if errors is None else int(errors), waf)


def read_smart(nvme: str = "nvme", devices: list[str] | None = None, timeout_s: float = 10.0) -> list[Smart]:
    """SMART of each NVMe controller through nvme-cli; [] when nvme-cli or a device is absent
    (or nvme-cli cannot read any, e.g. without the privileges it needs)."""
    exe = shutil.which(nvme)
    devs = nvme_controllers() if devices is None else devices
    if exe is None or not devs:
        return []
    out = []
    for dev in devs:
        try:
            res = subprocess.run([exe, "smart-log", dev, "-o", "json"], capture_output=True, text=True,
                                 timeout=timeout_s, check=False)
            if res.returncode != 0:
                log.debug("fastckpt: nvme smart-log %s failed: %s", dev, res.stderr.strip())
                continue
            out.append(parse_smart(dev, json.loads(res.stdout)))
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            log.debug("fastckpt: nvme smart-log %s unreadable: %r", dev, exc)
    return out
