"""Helpers shared by the benchmarks: sizes, a model-like state, cache dropping, fio.

Nothing here imports fastckpt; benchmarks import it themselves so that a missing or
broken package only removes its own rows.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GB = 1e9  # bandwidths are reported in decimal GB/s, like fio and disk vendors

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Parses "1GiB", "512MiB", "2GB" or a plain byte count into bytes (a multiple of 4)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}: use e.g. 1GiB, 512MiB, 2GB")
    nbytes = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if nbytes < 4096:
        raise ValueError(f"size {text!r} is too small: use at least 4KiB")
    return nbytes - nbytes % 4


def make_state(nbytes: int, n_layers: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat dict of float32 tensors totalling exactly `nbytes`: a small transformer's
    weights plus Adam's two moments (so weights are a third of the bytes), mixed sizes."""
    total = nbytes // 4
    # per layer: qkv 3d^2, proj d^2, fc1 4d^2, fc2 4d^2 -> 12 d^2; embedding 16 d^2
    d = max(8, int(math.sqrt(total / 3 / (12 * n_layers + 16))) // 8 * 8)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (16 * d, d)}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes |= {p + "ln1.weight": (d,), p + "attn.qkv.weight": (3 * d, d),
                   p + "attn.qkv.bias": (3 * d,), p + "attn.proj.weight": (d, d),
                   p + "attn.proj.bias": (d,), p + "ln2.weight": (d,),
                   p + "mlp.fc1.weight": (4 * d, d), p + "mlp.fc1.bias": (4 * d,),
                   p + "mlp.fc2.weight": (d, 4 * d), p + "mlp.fc2.bias": (d,)}
    shapes["final_ln.weight"] = (d,)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq."):
        for name, shape in shapes.items():
            state[prefix + name] = torch.randn(shape, generator=gen)
    rest = total - sum(t.numel() for t in state.values())
    if rest < 0:
        raise ValueError(f"size {nbytes} B is too small for a {n_layers}-layer state")
    if rest:  # makes the total exact; stands in for buffers and odd-sized heads
        state["model.lm_head.bias"] = torch.randn(rest, generator=gen)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in path.rglob("*") if p.is_file()]


def drop_cache(path: Path) -> bool:
    """Best effort: evicts `path` (a file or a directory's files) from the page cache.

    Returns whether the global drop (/proc/sys/vm/drop_caches) was accepted; the per-file
    POSIX_FADV_DONTNEED is always tried too, since the global drop is unreliable on VMs.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        dropped = True
    except OSError:
        dropped = False
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return dropped


def mount_of(path: Path) -> tuple[str, str]:
    """Returns (mount point, fs type) of the filesystem holding `path`."""
    best = ("/", "?")
    real = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fstype, *_ = line.split()
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[0]):
                best = (mnt, fstype)
    return best


def fio_available() -> bool:
    return shutil.which("fio") is not None


def fio_seconds(path: Path, nbytes: int, rw: str) -> float:
    """Runs one fio O_DIRECT sequential job ("write" or "read") on `path`; returns the
    time `nbytes` take at the bandwidth fio measured (fsync at the end for writes)."""
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", "--bs=1M",
           f"--size={nbytes}", "--direct=1", "--ioengine=libaio", "--iodepth=16",
           "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    if job["error"]:
        raise OSError(job["error"], f"fio {rw} on {path} failed")
    return nbytes / job[rw]["bw_bytes"]


def rss_bytes() -> int:
    """This process's resident memory (VmRSS), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def import_fastckpt():
    """Returns fastckpt's Checkpointer class, trying the checkout's src/ if not installed.
    Raises ImportError (with the reason) when neither works."""
    try:
        from fastckpt import Checkpointer
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
        sys.modules.pop("fastckpt", None)
        from fastckpt import Checkpointer
    return Checkpointer
