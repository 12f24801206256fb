"""GPU checks: CUDA, libcuda, kvikio, and whether GPUDirect Storage would really run (not compat)."""

from __future__ import annotations

import ctypes

from . import _core
from .findings import Finding

GDS_FIX = ("true GDS needs the nvidia-fs kernel module (lsmod | grep nvidia_fs), a filesystem cuFile supports "
           "(ext4/xfs on local NVMe, or a GDS-enabled parallel filesystem) and cuFile's config "
           "(/etc/cufile.json); run `gdscheck -p`, and set KVIKIO_COMPAT_MODE=OFF to see kvikio's reason")


def cuda() -> tuple[Finding, bool]:
    """(finding, a CUDA device is usable)."""
    import torch

    if not torch.cuda.is_available():
        return Finding("gpu.cuda", "info", f"torch {torch.__version__} sees no CUDA device: states are on the CPU, "
                       "so the gds tier does not apply", data={"devices": 0}), False
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return Finding("gpu.cuda", "ok", f"{n} CUDA device(s): {name}", data={"devices": n, "name": name}), True


def libcuda() -> Finding:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return Finding("gpu.libcuda", "info", f"libcuda.so.1 cannot be loaded ({exc}): no NVIDIA driver here",
                       "install the NVIDIA driver where GPUs are expected", {"loaded": False})
    return Finding("gpu.libcuda", "ok", "libcuda.so.1 loads (NVIDIA driver present)", data={"loaded": True})


def kvikio() -> Finding:
    try:
        import kvikio as kv
    except ImportError:
        return Finding("gpu.kvikio", "info", "kvikio is not installed: the gds tier is unavailable",
                       "pip install 'fastckpt[gds]' on GPU machines with GPUDirect Storage", {"installed": False})
    version = getattr(kv, "__version__", "?")
    return Finding("gpu.kvikio", "ok", f"kvikio {version} is installed", data={"installed": True, "version": version})


def gds(has_cuda: bool, directory: str | None) -> Finding:
    """GDS mode and a probe write: ok only for true GDS (never for kvikio's compat mode)."""
    if not has_cuda:
        return Finding("gpu.gds", "info", "GPUDirect Storage not checked: no CUDA device", data={"mode": None})
    why = _core.gds_unavailable_reason(True)
    if why is not None:
        mode = "compat" if "compat mode" in why else None
        return Finding("gpu.gds", "warn", f"gds unavailable: {why}", GDS_FIX, {"mode": mode, "reason": why})
    if directory is None:
        return Finding("gpu.gds", "ok", "kvikio runs true GDS (not compat mode); no directory given for a probe "
                       "write", "pass --local-dir to probe a GPU -> file write", {"mode": "gds"})
    why = _core.gds_probe_write(directory)
    if why is not None:
        return Finding("gpu.gds", "warn", f"kvikio is in GDS mode but a probe write to {directory} failed: {why}",
                       GDS_FIX, {"mode": "gds", "probe": why})
    return Finding("gpu.gds", "ok", f"true GDS: a 4 KiB GPU -> {directory} write through cuFile worked",
                   data={"mode": "gds", "probe": "ok"})
