"""A loaded state's memory goes back tensor by tensor, as after ``torch.load``.

A read puts each large record in heap memory of its own (``load/image.py``), which its tensors
free as ``torch.load``'s do; a mapped file's records give their pages back when their last
tensor dies (``load/deserialize.py``). Before either, the buffer stayed whole while any tensor
of it lived: keeping a state's model weights kept its optimizer's bytes resident too.
"""

from __future__ import annotations

import collections
import gc
import sys
from pathlib import Path

import psutil
import pytest
import torch

import fastckpt

MiB = 1 << 20


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _mapped(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (heap noise of other threads aside)."""
    gc.collect()
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.rstrip("\n").split(maxsplit=5)  # the path is the rest of the line, spaces and all
            if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                mine = len(head) == 6 and head[5].removesuffix(" (deleted)") == path
            elif mine and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"model": torch.randn((4 << 20) + 3, generator=gen),  # 16 MiB + 12 B: its last page is shared
            "optim": torch.randn(24 << 20, generator=gen),  # 96 MiB
            "tiny": [torch.arange(5) + i for i in range(50)], "step": 7}


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
def test_dropping_part_of_a_loaded_state_gives_its_memory_back(tmp_path: Path, mapped: bool) -> None:
    path, state = str(tmp_path / "s.pt"), _state()
    # A mapped load is measured by its mapping's own resident pages: the process's RSS also moves
    # with whatever the save's threads free meanwhile (once 72 MB grew where 112 MiB were mapped).
    rss = (lambda: _mapped(path)) if mapped else _rss
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
        base = rss()
        out = ck.load(path, mmap=mapped)
        loaded = rss()
        if mapped:  # mapped and hashed page by page (a read may reuse heap memory freed before)
            assert loaded - base > 100 * MiB, f"{(loaded - base) / MiB:.1f} MiB of the file mapped"
        optim = out.pop("optim")
        assert torch.equal(optim, state["optim"])
        del optim
        freed = loaded - rss()
        # what is kept is whole, the records that share a page with the freed ones among it
        assert torch.equal(out["model"], state["model"]) and out["step"] == 7
        assert all(torch.equal(a, b) for a, b in zip(out["tiny"], state["tiny"], strict=True))
        del out
        gone = loaded - rss()
    assert freed > 90 * MiB, f"dropping 96 MiB of a loaded state gave back {freed / MiB:.1f} MiB"
    # The heap may keep the read's 16 MiB model for the next allocation, as after torch.load.
    assert gone > (100 if mapped else 90) * MiB, f"dropping the whole state gave back {gone / MiB:.1f} MiB"


def test_a_tensor_outlives_the_state_it_was_loaded_with(tmp_path: Path) -> None:
    path, state = str(tmp_path / "s.pt"), _state()
    with fastckpt.Checkpointer() as ck:
        ck.save(state, path).wait()
        kept = ck.load(path)["tiny"][49]  # a view of a piece (or the buffer) that must stay alive
        model = ck.load(path)["model"]
    gc.collect()
    assert torch.equal(kept, state["tiny"][49]) and torch.equal(model, state["model"])


def test_a_damaged_record_past_the_buffer_gives_back_only_its_pages(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A flipped bit in data.pkl that names the last record for a large tensor's storage makes its
    slice run past the end of the file: the load is damage, and the pages given back when the
    slice dies stop at the buffer's end (madvise raised "start out of bounds" in a finalizer,
    printed as "Exception ignored in <finalize ...>" beside the real error)."""
    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(5000.0), "step": 7, "od": collections.OrderedDict(a=torch.ones(3))}, path)
    data = path.read_bytes()
    key = b"X\x01\x00\x00\x000"  # the pickle's storage key '0' (of "w"), before the key '1' of "od"'s tensor
    assert data.count(key) == 1
    path.write_bytes(data.replace(key, b"X\x01\x00\x00\x001"))  # one bit: '0' -> '1'
    with pytest.raises(fastckpt.CorruptCheckpointError, match="damaged"):
        fastckpt.load(path)
    gc.collect()
    assert unraisable == []
