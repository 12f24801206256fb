"""io.gds.finish_gds_file on CPU: the part of the gds tier that runs after kvikio wrote the
file (checksum by read-back, manifest appended) must produce a verified fastckpt file."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fastckpt
from fastckpt.format import layout as F
from fastckpt.format import segments
from fastckpt.format.manifest import file_manifest, tail_bytes
from fastckpt.io.gds import finish_gds_file
from fastckpt.io.ops import FileOps


@pytest.mark.parametrize("packed", [False, True])
def test_finish_after_a_record_by_record_write(tmp_path, monkeypatch, packed) -> None:
    if packed:  # the metadata kept compressed and inflated in pieces that spans cross
        monkeypatch.setattr(segments, "PACK_ABOVE", -1)
        monkeypatch.setattr(segments, "INFLATE_BYTES", 100)
    state = {"w": torch.randn(1 << 18), "b": torch.arange(10)}
    layout = F.plan(state, page_aligned=True)  # what the gds tier plans
    path = tmp_path / "g.pt"
    with open(path, "wb") as f:  # what gds_write does through kvikio: segments, then each record
        for off, data in layout.segments:
            f.seek(off)
            f.write(data)
        for rec in layout.storages:
            f.seek(rec.offset)
            f.write(torch.empty(0, dtype=torch.uint8).set_(rec.storage).numpy().tobytes())

    def tail(digest: str) -> bytes:
        return tail_bytes(file_manifest(covered=layout.covered_bytes, digest=digest, rank=0, group_name=None,
                                        group_rel=None, tier="gds", payload_bytes=layout.payload_bytes,
                                        blocked_s=0.0, fastckpt_version="test"))

    with ThreadPoolExecutor(2) as pool:
        res = finish_gds_file(FileOps(), pool, str(path), layout, tail, 16 << 20)
    assert res.bytes == os.path.getsize(path)
    out = fastckpt.load(str(path))  # verified against the manifest's checksum
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
