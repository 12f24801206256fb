"""io.engine.write_file behind a copy still in progress: chunks are written as their bytes
arrive, and hashed only once the copy is done (hashing would take cores from the copy), by
whichever worker is free; the checksum is the same as for a write after the copy."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastckpt.format import checksum
from fastckpt.io import engine
from fastckpt.io.ops import FileOps

MiB = 1 << 20


def test_hashing_waits_for_the_copy(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 5 * 16 * MiB + 4321
    src = os.urandom(size)
    image = memoryview(engine.alloc_aligned(size + (1 << 17)))
    filled = threading.Condition()
    state = {"upto": 0, "copying": True, "hashed_while_copying": 0, "hashed": 0}
    real = checksum.block_digest

    def spy(block):  # noqa: ANN001, ANN202
        with filled:
            state["hashed"] += 1
            state["hashed_while_copying"] += state["copying"]
        return real(block)

    monkeypatch.setattr(checksum, "block_digest", spy)

    def ready(end: int) -> None:
        with filled:
            filled.wait_for(lambda: state["upto"] >= end)

    def copy() -> None:  # the snapshot, 16 MiB at a time
        for off in range(0, size, 16 * MiB):
            image[off : min(size, off + 16 * MiB)] = src[off : off + 16 * MiB]
            with filled:
                state["upto"] = min(size, off + 16 * MiB)
                filled.notify_all()
        with filled:
            state["copying"] = False

    copier = threading.Thread(target=copy)
    with ThreadPoolExecutor(3) as pool:
        copier.start()
        res = engine.write_file(FileOps(), pool, str(tmp_path / "f"), image, size, lambda d, b: b"",
                                chunk_bytes=16 * MiB, ready=ready, copying=lambda: state["copying"])
    copier.join()
    assert state["hashed"] == 6 and state["hashed_while_copying"] == 0
    assert res.checksum == checksum.checksum_bytes(src)
    assert (tmp_path / "f").read_bytes() == src
