"""Groups at an S3 URL (SeaweedFS), with simulated ranks sharing a TCPStore: a group commits
through the store and its burst-buffer copy serves loads; re-saving a published group is
refused (an object store cannot swap it in atomically) and leaves it whole."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.errors import ConfigError


def _state(version: int, rank: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.int64) * version + rank, "version": version}


def test_a_group_at_a_url_commits_and_a_published_one_is_not_resaved(s3_server, s3_bucket, tmp_path: Path) -> None:
    opts = s3_server.storage_options()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    g = f"s3://{s3_bucket}/run/global_step1"
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, storage_options=opts, overhead_budget=0.99,
                                 local_dir=str(tmp_path / "nvme"), commit_timeout_s=60) for r in (0, 1)]
    try:
        for ck in cks:
            ck.save(_state(1, ck.rank), f"{g}/rank{ck.rank}.pt", group=g)
        records = [h.wait(60) for h in [ck.commit(g, step=1) for ck in cks]]
        assert all(rec.store_ops > 0 for rec in records)
        assert cks[1].load(f"{g}/rank1.pt")["version"] == 1
        assert cks[1].stats().last_restore_from == "local"
        with pytest.raises(ConfigError, match="object store cannot replace a group atomically"):
            cks[0].save(_state(2, 0), f"{g}/rank0.pt", group=g)
    finally:
        for ck in cks:
            ck.close()
    assert fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=opts) == g
    assert fastckpt.load(f"{g}/rank0.pt", storage_options=opts)["version"] == 1
