"""GPUDirect Storage writes through kvikio: GPU memory -> file with no host bounce.

Used by the gds tier only after ``tiers.gds_unavailable_reason`` found GDS usable (kvikio in
compat mode is never called GDS). The storages are written at their record offsets straight
from device memory; the metadata segments are written from host memory. The checksum is then
computed by reading the file back (there is no host copy to hash), in the background.
"""

from __future__ import annotations

import os

from ..format import FileLayout


def gds_write(path: str, layout: FileLayout) -> None:
    """Write every storage and metadata segment of ``layout`` to ``path`` (blocking).

    The caller holds the training thread until this returns: the GPU tensors are read in
    place, so they must not change before the write completes.
    """
    import kvikio
    import numpy as np
    import torch

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


def append_tail_and_sync(path: str, offset: int, tail: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        done = 0
        while done < len(tail):
            n = os.pwrite(fd, tail[done:], offset + done)
            if n <= 0:
                raise OSError(5, f"short write of the manifest to {path}")
            done += n
        os.ftruncate(fd, offset + len(tail))
        os.fsync(fd)
    finally:
        os.close(fd)


def finish_gds_file(ops, pool, tmp: str, layout: FileLayout, tail, chunk_bytes: int):  # noqa: ANN001
    """Checksum the GDS-written file by reading it back, append the manifest, fsync."""
    from .engine import WriteResult, read_file

    res = read_file(ops, pool, tmp, layout.data_size, layout.covered_bytes, chunk_bytes=chunk_bytes)
    extra = tail(res.checksum)
    append_tail_and_sync(tmp, layout.covered_bytes, extra)
    res.buffer.close()
    return WriteResult(tmp, layout.covered_bytes + len(extra), res.checksum, True, None)
