"""``load(..., mmap=True)``: a file mapped copy-on-write instead of read, verified all the same
(issue #16: a checkpoint in the page cache restores without a copy or new memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import CorruptCheckpointError
from tests.helpers import flip_byte


def _state() -> dict:
    gen = torch.Generator().manual_seed(3)
    # 40 MiB: more than one 16 MiB checksum block, so the workers hash several chunks
    return {"w": torch.randn(10 << 20, generator=gen), "b": torch.arange(7, dtype=torch.int16), "step": 5}


def test_mapped_load_equals_the_state_and_writes_stay_private(tmp_path: Path) -> None:
    path = str(tmp_path / "m.pt")
    state = _state()
    with fastckpt.Checkpointer(chunk_bytes=16 << 20) as ck:
        ck.save(state, path).wait()
        before = Path(path).read_bytes()
        out = ck.load(path, mmap=True)
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 5
        out["w"].add_(1)  # copy-on-write: the file and the next load do not see it
        assert Path(path).read_bytes() == before
        assert torch.equal(ck.load(path, mmap=True)["w"], state["w"])
        assert torch.equal(ck.load(path)["w"], state["w"])


def test_mapped_load_of_a_damaged_file_raises_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(), str(path)).wait()
        flip_byte(path, 30 << 20)  # inside the tensor's bytes, in the second checksum block
        with pytest.raises(CorruptCheckpointError, match="m.pt is corrupt"):
            ck.load(str(path), mmap=True)


def test_mapped_load_falls_back_from_a_damaged_burst_buffer_copy(tmp_path: Path, caplog) -> None:
    path = str(tmp_path / "durable" / "m.pt")
    state = _state()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb")) as ck:
        ck.save(state, path).wait()
        local = ck.local_path(path)
        flip_byte(local, 1 << 20)
        out = ck.load(path, mmap=True)
    assert torch.equal(out["w"], state["w"])
    assert any("falling back" in r.getMessage() for r in caplog.records)


def test_mapped_load_of_an_empty_file_says_it_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    with fastckpt.Checkpointer() as ck, pytest.raises(CorruptCheckpointError, match="empty"):
        ck.load(str(path), mmap=True)


def test_a_file_system_that_cannot_map_files_is_read_instead(tmp_path: Path) -> None:
    import errno

    from fastckpt.testing import Fault, FaultyOps

    path = str(tmp_path / "m.pt")
    state = _state()
    ops = FaultyOps([Fault("map_private", errno.ENODEV)])
    with fastckpt.Checkpointer(ops=ops) as ck:
        ck.save(state, path).wait()
        out = ck.load(path, mmap=True)
    assert torch.equal(out["w"], state["w"])
    assert ops.calls("map_private") == 1 and ops.fired  # it tried, was refused, and read the file
