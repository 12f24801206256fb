"""Tier selection: gds, nvme or direct, probed once per directory, with reasons.

``auto`` picks gds when the state has CUDA tensors and GPUDirect Storage really works (kvikio
importable, libcuda loadable, a CUDA device, kvikio not in compat mode, a probe write
succeeds); else nvme when a ``local_dir`` burst buffer is set; else direct. It logs one line
with the choice and why each other tier was rejected. An explicitly requested tier that
cannot work raises ``TierUnavailableError`` with the reason. See docs/tiers.md.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import sysinfo
from ..errors import TierUnavailableError
from ..io.atomic import discard, probe_name
from ..io.ops import FileOps

log = logging.getLogger("fastckpt")


@dataclass(frozen=True)
class TierChoice:
    tier: str
    reasons: dict[str, str] = field(default_factory=dict)  # rejected tier -> why
    odirect: bool = True
    odirect_reason: str | None = None

    def describe(self) -> str:
        rej = "; ".join(f"{t} rejected: {why}" for t, why in self.reasons.items())
        od = "O_DIRECT" if self.odirect else f"buffered ({self.odirect_reason})"
        return f"tier={self.tier} ({od})" + (f"; {rej}" if rej else "")


def probe_odirect(directory: str, ops: FileOps | None = None) -> tuple[bool, str | None]:
    """Write one aligned block with O_DIRECT in ``directory``; (honoured, reason if not).

    The probe file is named so that ``io.atomic.sweep_stale_tmp`` removes it if this process
    is killed before it does.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False, "O_DIRECT not available on this OS"
    ops = ops or FileOps()
    ops.makedirs(directory)
    path = probe_name(directory)
    buf = mmap.mmap(-1, 4096)
    try:
        fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
    except OSError as exc:
        discard(ops, path)  # ramfs (tmpfs before Linux 6.6) makes the file, then refuses O_DIRECT
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False, f"filesystem at {directory} refused O_DIRECT"
        raise
    try:
        ops.pwrite(fd, memoryview(buf), 0)
        return True, None
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False, f"filesystem at {directory} refused O_DIRECT writes"
        raise
    finally:
        ops.close(fd)
        discard(ops, path)


def gds_unavailable_reason(has_cuda_tensors: bool) -> str | None:
    """None when GPUDirect Storage can be used; else why not (never raises)."""
    if not has_cuda_tensors:
        return "the state has no CUDA tensors"
    try:
        import kvikio  # noqa: F401
        import kvikio.defaults
    except ImportError:
        return "kvikio is not installed (pip install 'fastckpt[gds]')"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"libcuda.so.1 cannot be loaded ({exc}): no NVIDIA driver here"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return ("kvikio would run in compat mode (POSIX I/O through a bounce buffer, not GDS): "
                    "cuFile/nvidia-fs is not usable here (set KVIKIO_COMPAT_MODE=OFF to see why)")
    except Exception as exc:  # noqa: BLE001 (kvikio raises its own types; report, never crash)
        return f"kvikio could not report its mode: {exc!r}"
    return None


def gds_probe_write(directory: str, ops: FileOps | None = None) -> str | None:
    """Write 4 KiB from the GPU with kvikio into ``directory``; None on success, else why."""
    try:
        import kvikio
        import torch

        path = probe_name(directory)
        t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        try:
            with kvikio.CuFile(path, "w") as f:
                n = f.write(t)
            if n != 4096:
                return f"kvikio probe wrote {n} of 4096 bytes"
        finally:
            discard(ops or FileOps(), path)
    except Exception as exc:  # noqa: BLE001
        return f"kvikio probe write failed: {exc!r}"
    return None


def _file_system(directory: str) -> int | str:
    """The file system ``directory`` is on (or will be: its nearest existing parent's), as its
    device number; the directory itself where none can be read."""
    try:
        return os.stat(sysinfo.existing_parent(directory)).st_dev
    except OSError:
        return directory


class TierSelector:
    """Chooses and caches the tier per (file system written first, CUDA or not).

    Args:
        requested: the ``tier`` option (validated by ``CheckpointerConfig``).
        local_dir: the burst buffer (one directory, or several striped), or None.
        odirect: the ``odirect`` option.
        ops: the FileOps the probes write through.
    """

    def __init__(self, requested: str, local_dir: str | Sequence[str] | None, odirect: bool,
                 ops: FileOps | None = None) -> None:
        self.requested = requested
        self.local_dir = (local_dir if isinstance(local_dir, str) else local_dir[0]) if local_dir else None
        self.odirect = odirect
        self.ops = ops or FileOps()
        self._cache: dict[tuple[int | str, bool] | tuple[int | str, bool, str], TierChoice] = {}
        self._lock = threading.Lock()

    def choose(self, path: str, has_cuda: bool, local_dir: str | None = None) -> TierChoice:
        """The tier for a save to ``path`` (a URL only with local_dir: the config checks that);
        ``local_dir``: the burst-buffer directory this save writes to, when there are several."""
        dest_dir = os.path.dirname(path) if self.local_dir is None else (local_dir or self.local_dir)
        self.ops.makedirs(dest_dir)  # a directory that cannot be made fails the save at the call
        key = (_file_system(dest_dir), has_cuda)  # one probe per file system, not per directory (iter_N/...)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._decide(dest_dir, has_cuda)
                log.info("fastckpt: %s for %s", self._cache[key].describe(), dest_dir)
            return self._cache[key]

    def choose_bypass(self, path: str, has_cuda: bool) -> TierChoice:
        """The tier of a save that skips a full burst buffer (``Saver``): direct, to the path's
        directory, with or without O_DIRECT as a probe there says."""
        dest_dir = os.path.dirname(path)
        key = (_file_system(dest_dir), has_cuda, "bypass")
        with self._lock:
            if key not in self._cache:
                self._cache[key] = TierChoice("direct", {"nvme": "the burst buffer has no room for it"},
                                              *self._odirect(dest_dir))
            return self._cache[key]

    def _decide(self, dest_dir: str, has_cuda: bool) -> TierChoice:
        reasons: dict[str, str] = {}
        write_dir = dest_dir
        if self.requested in ("auto", "gds"):
            why = gds_unavailable_reason(has_cuda) or gds_probe_write(write_dir, self.ops)
            if why is None:
                return TierChoice("gds", {"nvme": "gds is faster", "direct": "gds is faster"})
            if self.requested == "gds":
                raise TierUnavailableError(f"tier='gds' requested but {why}. Use tier='auto' to fall back.")
            reasons["gds"] = why
        if self.requested == "nvme" and self.local_dir is None:
            raise TierUnavailableError("tier='nvme' needs local_dir=<node-local directory>")
        if self.requested == "direct" and self.local_dir is not None:
            raise TierUnavailableError("tier='direct' writes straight to the path: drop local_dir, or use 'nvme'")
        tier = "nvme" if self.local_dir is not None else "direct"
        if tier == "nvme":
            reasons["direct"] = "local_dir is set (burst buffer)"
        elif self.requested == "auto":
            reasons["nvme"] = "no local_dir set"
        return TierChoice(tier, reasons, *self._odirect(write_dir))

    def _odirect(self, directory: str) -> tuple[bool, str | None]:
        """Whether writes in ``directory`` use O_DIRECT, and why not."""
        return probe_odirect(directory, self.ops) if self.odirect else (False, "O_DIRECT disabled by odirect=False")
