"""Checks of a directory: its filesystem and mount options, O_DIRECT, free space, bandwidth."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from concurrent.futures import ThreadPoolExecutor

from .. import sysinfo
from ..io.atomic import DOCTOR_PROBE_TAG, probe_name, sweep_stale_tmp
from ..io.engine import alloc_aligned, read_file, write_file
from ..io.ops import FileOps
from ..progress import Progress
from ..units import fmt_bytes, sig
from . import _core
from .findings import Finding

GB = 1e9
NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "9p", "wekafs")
CHUNK = 64 << 20
MIB = 1 << 20
MEMORY_SHARE = 4  # a probe is at most 1/4 of the memory available (it holds its bytes twice: _probe_size)
FREE_SHARE = 4  # ... and at most 1/4 of the free space, never a probe that fills the drive


def _kind(fstype: str) -> str:
    if fstype in NETWORK_FS or fstype.startswith("fuse"):
        return "network"
    return {"tmpfs": "memory", "ramfs": "memory", "overlay": "container"}.get(fstype, "disk")


def filesystem(role: str, path: str, burst_buffer: bool) -> Finding:
    """The filesystem type and mount options of ``path`` (from /proc/mounts)."""
    m = sysinfo.mount_of(sysinfo.existing_parent(path))
    check = f"{role}.filesystem"
    if m is None:
        return Finding(check, "info", f"no mount table here: the filesystem of {path} is unknown")
    data = {"fstype": m.fstype, "mountpoint": m.mountpoint, "device": m.device, "options": list(m.options)}
    what = f"{path} is on {m.fstype} ({m.device} at {m.mountpoint}, {','.join(m.options)})"
    if "ro" in m.options:
        return Finding(check, "fail", f"{what}: mounted read-only", f"choose a writable {role}", data)
    if {"sync", "dirsync"} & set(m.options):
        return Finding(check, "warn", f"{what}: every write is synchronous", "remount without sync/dirsync "
                       "(fastckpt fsyncs what must be durable itself)", data)
    kind = _kind(m.fstype)
    if burst_buffer and kind == "network":
        return Finding(check, "warn", f"{what}: a network filesystem is not node-local", "point local_dir at "
                       "a node-local NVMe directory; keep the network filesystem as the save path", data)
    if burst_buffer and kind == "memory":
        return Finding(check, "warn", f"{what}: RAM, lost on reboot and taken from host memory", "use a "
                       "node-local NVMe directory as local_dir", data)
    if kind == "container":
        return Finding(check, "warn", f"{what}: the container's overlay layer (slow, gone with the container)",
                       f"mount a host directory (NVMe) into the container for the {role}", data)
    return Finding(check, "ok", what, data=data)


def writable(role: str, path: str) -> Finding:
    check = f"{role}.writable"
    existed = os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = probe_name(path)  # named as the tier probes are: swept if a SIGKILL leaves it
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free space in {path} (or raise the quota)"
        elif exc.errno == errno.ENOTDIR and not os.path.isdir(blocker := sysinfo.existing_parent(path)):
            fix = f"{blocker} is a file, so no directory can be made below it: give a directory path"
        elif exc.errno == errno.EROFS:  # no chmod helps: the filesystem (or the server's export) is read-only
            fix = (f"{path} is on a read-only filesystem: remount it read-write (NFS, Lustre: ask for a writable "
                   "export)")
        else:
            fix = f"make {path} writable by this user (owner, mode)" if os.path.isdir(path) else \
                f"create {path} and make it writable by this user"
        return Finding(check, "fail", f"cannot write in {path}: {exc.strerror or exc}", f"{fix}, or choose another "
                       f"{role}", {"errno": exc.errno})
    return Finding(check, "ok", f"{path} is writable" if existed else
                   f"{path} did not exist: created it (as the first save would), and it is writable")


def odirect(role: str, path: str) -> Finding:
    ok, why = _core.probe_odirect(path)
    if ok:
        return Finding(f"{role}.odirect", "ok", f"O_DIRECT writes work in {path}", data={"odirect": True})
    return Finding(f"{role}.odirect", "warn", f"no O_DIRECT: {why}; fastckpt falls back to buffered writes, which "
                   "reached about a fifth of O_DIRECT's bandwidth on the reference machine (docs/performance.md)",
                   "use ext4 or xfs on a local NVMe device", {"odirect": False, "reason": why})


def free_space(role: str, path: str, state_size: int | None, copies: int, drives: int = 1) -> Finding:
    """Free space against ``copies`` checkpoints of ``state_size`` bytes, of which a burst buffer
    striped over ``drives`` filesystems puts an even share on each (``stripe_space`` checks the sum)."""
    sp = sysinfo.space(path)
    check = f"{role}.free_space"
    if sp is None:
        return Finding(check, "info", f"cannot stat the filesystem of {path}")
    free = sysinfo.room(sp)
    if free is None:  # no size and not a ramfs: no limit to check, and not a full drive
        return Finding(check, "info", f"{sp.mountpoint} reports no size (some FUSE mounts: df shows 0/0): no limit "
                       "to check its free space against", data={"free_bytes": None, "size_bytes": None,
                                                                   "mountpoint": sp.mountpoint})
    data = {"free_bytes": free, "size_bytes": sp.size, "mountpoint": sp.mountpoint}
    have = (f"{free / GB:.3g} GB free of {sp.size / GB:.3g} GB at {sp.mountpoint}" if sp.size is not None else
            f"{free / GB:.3g} GB of memory available to {sp.mountpoint}, a ramfs (it keeps its files in memory, "
            "which they can neither be swapped out of nor reclaimed from)")
    if state_size is None:
        return Finding(check, "info", have, "pass --state-size to check it against your checkpoints", data)
    need = -(-state_size * copies // drives)
    data.update(need_bytes=need, copies=copies, drives=drives)
    about = f"{have}; {copies} checkpoint(s) of {state_size / GB:.3g} GB need {need / GB:.3g} GB" + (
        f" here, a 1/{drives} share striped over {drives} drives" if drives > 1 else "")
    if free < need:
        return Finding(check, "fail", about, f"free {(need - free) / GB:.3g} GB, lower keep_local/keep_persistent, "
                       f"or choose a larger {role}", data)
    if free < 1.25 * need:
        return Finding(check, "warn", about + " (less than 25 % to spare)", "leave room for growth of the state",
                       data)
    return Finding(check, "ok", about, data=data)


def _probe_size(path: str, probe_bytes: int) -> tuple[int, str]:
    """The probe's size, in whole MiB, and a note when memory capped it. It holds its bytes
    twice (written, then read back): a probe the node's memory cannot hold would have the
    kernel kill doctor (or, on a training node, the job) instead of measuring anything.
    0, and why, when a quarter of the free space is under a MiB: the probe never fills a drive."""
    sp = sysinfo.space(path)
    free = sp.free if sp is not None else None  # None: cannot stat it, or no size limit (a ramfs)
    if free is not None and free // FREE_SHARE < MIB:
        return 0, (f"{path} has {fmt_bytes(free)} free, and the probe writes at most a quarter of the free "
                   "space, at least 1 MiB: it would fill the drive")
    size = min(probe_bytes, (free // FREE_SHARE) if free is not None else probe_bytes)  # at most a quarter of it
    avail, note = sysinfo.mem_available(), ""
    if avail is not None and size > avail // MEMORY_SHARE:
        size = avail // MEMORY_SHARE
        note = (f" (--probe-size capped at a quarter of the {avail / GB:.3g} GB of memory available: the probe "
                "holds its bytes twice)")
    return max(MIB, size // MIB * MIB), note


def _no_memory(check: str, size: int, exc: BaseException) -> Finding:
    why = exc.strerror if isinstance(exc, OSError) else str(exc) or type(exc).__name__
    return Finding(check, "fail", f"the bandwidth probe of {size >> 20} MiB does not fit in this process's memory "
                   f"({why})", "give a smaller --probe-size (0 skips the probe)", {"probe_bytes": size})


def bandwidth(role: str, path: str, probe_bytes: int, state_size: int | None, progress: str) -> Finding:
    """Write ``probe_bytes`` with fastckpt's own I/O engine (parallel, O_DIRECT where it works,
    checksummed, fsynced), read them back the same way, and time both."""
    check = f"{role}.bandwidth"
    ops = FileOps()
    sweep_stale_tmp(ops, path)  # a killed doctor's probe (SIGKILL runs no clean-up): its space counts too
    size, capped = _probe_size(path, probe_bytes)
    if not size:
        return Finding(check, "warn", f"bandwidth not measured: {capped}", f"free space in {path} (4 MiB free "
                       "lets a 1 MiB probe run), or give --probe-size 0 to skip the probe", {"probe_bytes": 0})
    buf, view = None, None
    target = probe_name(path, DOCTOR_PROBE_TAG)
    try:  # the allocation too: a limit on this process's memory (RLIMIT_AS, a cgroup) refuses it here
        buf = alloc_aligned(size + 4096)
        view = memoryview(buf)
        block = os.urandom(MIB)  # in place, a MiB at a time: no second copy of the probe in memory
        for off in range(0, size, MIB):
            view[off:off + MIB] = block
        pool = ThreadPoolExecutor(4, thread_name_prefix="fastckpt-doctor")
        try:
            with Progress(f"probing {role} write bandwidth", total=size, mode=progress, delay_s=1.0) as p:
                t0 = time.monotonic()
                res = write_file(ops, pool, target, view, size, lambda _d, _b: b"", chunk_bytes=CHUNK,
                                 ready=lambda end: p.update(end))
                w = time.monotonic() - t0
            t0 = time.monotonic()
            back = read_file(ops, pool, target, chunk_bytes=CHUNK, odirect=res.odirect, covered=size)
            r = time.monotonic() - t0
            back.buffer.close()
        except BaseException:  # Ctrl-C, SIGTERM: a worker stuck on a hung mount must not hold doctor
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    except MemoryError as exc:
        return _no_memory(check, size, exc)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:  # mmap's refusal
            return _no_memory(check, size, exc)
        return Finding(check, "fail", f"the bandwidth probe failed in {path}: {exc}", f"check that {path} is "
                       "writable and has room", {"errno": exc.errno})
    finally:  # the probe file first: a worker stuck in a write (hung mount) still holds the buffer
        if os.path.exists(target):
            os.unlink(target)
        with contextlib.suppress(BufferError):  # ... and then the process's exit frees it
            if view is not None:
                view.release()
            if buf is not None:
                buf.close()
    data = {"probe_bytes": size, "write_Bps": size / w, "read_Bps": size / r, "odirect": res.odirect}
    how = "O_DIRECT" if res.odirect else f"buffered ({res.odirect_reason}; the read may come from the page cache)"
    text = (f"{size >> 20} MiB written at {size / w / GB:.2f} GB/s (with fsync) and read at {size / r / GB:.2f} "
            f"GB/s, {how}{capped}")
    if state_size:
        text += f"; a {fmt_bytes(state_size)} checkpoint takes about {sig(state_size / (size / w))} s to write here"
        data["write_s_for_state"] = state_size / (size / w)
    return Finding(check, "ok", text, data=data)


def stripe_space(paths: tuple[str, ...], state_size: int | None, copies: int) -> Finding | None:
    """The striped burst buffer as a whole: the free space of its filesystems (each counted
    once) against every copy; None without ``state_size``."""
    if state_size is None:
        return None
    spaces = {sp.mountpoint: sp for p in paths if (sp := sysinfo.space(p)) is not None}
    if any(sp.free is None for sp in spaces.values()):  # a ramfs among them: no limit to sum (its free_space says so)
        return None
    free, need = sum(sp.free for sp in spaces.values()), state_size * copies
    about = (f"{free / GB:.3g} GB free on the {len(spaces)} filesystem(s) of the {len(paths)} directories; "
             f"{copies} checkpoint(s) of {state_size / GB:.3g} GB need {need / GB:.3g} GB (a checkpoint that is "
             "one file needs all of its size on one drive)")
    data = {"free_bytes": free, "need_bytes": need, "filesystems": sorted(spaces)}
    if free < need:
        return Finding("local_dir.free_space", "fail", about, "free space on the drives, lower keep_local, or add "
                       "a drive", data)
    return Finding("local_dir.free_space", "ok", about, data=data)


def shared_space(target: str, shared: list[str], state_size: int | None, copies: int, drives: int) -> Finding | None:
    """The filesystem that holds both the target and the burst buffer (``shared``: its directories
    there) against both sets of copies: each ``free_space`` alone sees the whole free space, but the
    burst buffer keeps its local copies (its 1/``drives`` share) while the target keeps its durable
    ones. None when nothing is shared or without ``state_size``."""
    sp = sysinfo.space(target) if shared and state_size is not None else None
    if sp is None or sp.free is None or state_size is None:  # (free None: a ramfs, no limit to share)
        return None
    local, home = -(-state_size * copies // drives), state_size * copies
    need = local + home
    data = {"free_bytes": sp.free, "need_bytes": need, "local_bytes": local, "target_bytes": home,
            "mountpoint": sp.mountpoint, "local_dirs": shared}
    about = (f"{sp.free / GB:.3g} GB free at {sp.mountpoint}, which holds both {target} and the burst buffer "
             f"{shared[0]}: {copies} checkpoint(s) of {state_size / GB:.3g} GB in each need {need / GB:.3g} GB "
             f"({local / GB:.3g} GB local + {home / GB:.3g} GB at the target)")
    if sp.free < need:
        return Finding("target.shared_free_space", "fail", about, f"free {(need - sp.free) / GB:.3g} GB, lower "
                       "keep_local/keep_persistent, or save to a filesystem other than the burst buffer's", data)
    if sp.free < 1.25 * need:
        return Finding("target.shared_free_space", "warn", about + " (less than 25 % to spare)",
                       "leave room for growth of the state", data)
    return Finding("target.shared_free_space", "ok", about, data=data)
