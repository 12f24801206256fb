"""GPUDirect Storage writes through kvikio: GPU memory -> file with no host bounce.

Used by the gds tier only after ``save.tiers`` found GDS usable (kvikio in compat mode is never
called GDS). The storages are written at their record offsets straight from device memory; the
metadata segments are written from host memory. The checksum is then computed by reading the
file back (there is no host copy to hash), in the background, and the manifest is appended
through ``FileOps`` like every other write.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Executor

from ..format.layout import FileLayout
from .engine import WriteResult, read_file
from .ops import FileOps, pwrite_all


def gds_write(path: str, layout: FileLayout) -> None:
    """Write every storage and metadata segment of ``layout`` to ``path`` (blocking).

    The caller holds the training thread until this returns: the GPU tensors are read in
    place, so they must not change before the write completes. cuFile reads device memory
    outside torch's stream order, so the kernels queued so far on each device's current
    stream (the optimizer step that produced the state) are waited for first.
    """
    import kvikio
    import numpy as np
    import torch

    for device in {rec.storage.device for rec in layout.storages if rec.storage.is_cuda}:
        torch.cuda.current_stream(device).synchronize()

    with kvikio.CuFile(path, "w") as f:
        futures = []
        for off, data in layout.segments:
            futures.append(f.pwrite(np.frombuffer(data, dtype=np.uint8), file_offset=off))
        for rec in layout.storages:
            if rec.nbytes == 0:
                continue
            src = torch.empty(0, dtype=torch.uint8, device=rec.storage.device).set_(rec.storage)
            if src.device.type == "cpu":
                src = src.numpy()
            futures.append(f.pwrite(src, file_offset=rec.offset))
        for fut in futures:
            fut.get()


def finish_gds_file(ops: FileOps, pool: Executor, tmp: str, layout: FileLayout, tail: Callable[[str], bytes],
                    chunk_bytes: int) -> WriteResult:
    """Checksum the GDS-written file by reading it back, append the manifest, fsync."""
    res = read_file(ops, pool, tmp, chunk_bytes=chunk_bytes, covered=layout.covered_bytes)
    res.buffer.close()
    extra = tail(res.checksum)
    fd = ops.open(tmp, os.O_WRONLY)
    try:
        pwrite_all(ops, fd, memoryview(extra), layout.covered_bytes, tmp)
        ops.ftruncate(fd, layout.covered_bytes + len(extra))
        ops.fsync(fd)
    finally:
        ops.close(fd)
    return WriteResult(tmp, layout.covered_bytes + len(extra), res.checksum, True, None)
