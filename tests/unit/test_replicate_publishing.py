"""Right before a copy home is published (renamed into place; at an S3 URL, before the object becomes visible),
the Replicator checks that it still may be (``save.localcopy.check_publishable``).

A copy ``close()`` gave up on (``close_timeout_s``) ran on in its daemon thread and renamed an old save over a
newer save of the same path made since by another Checkpointer of the process (a second ``fit()``, a sweep, a
notebook): the home ended with the older state. Likewise a copy whose local source another Checkpointer
sharing the burst buffer replaced with a newer save (whose own upload may have landed); one that the same
Checkpointer's next save replaced is published all the same (that save's upload follows it). Each copy is held
just before it is published by a FaultyOps hook on its temp file's fsync (the last call before the rename).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.testing import FaultyOps


def _held_before_publish(home: str):  # noqa: ANN202
    """FaultyOps ``on_call``: the first copy into ``home`` waits at its temp file's fsync until ``release``."""
    entered, release = threading.Event(), threading.Event()

    def hold(op: str, path: str) -> None:
        if op == "fsync" and path.startswith(f"{home}/.fastckpt-tmp") and not entered.is_set():
            entered.set()
            assert release.wait(60)

    return hold, entered, release


def test_a_copy_close_gave_up_on_never_lands_over_a_newer_save(tmp_path: Path) -> None:
    nvme, home = str(tmp_path / "bb"), str(tmp_path / "home")
    path = f"{home}/last.pt"
    hold, entered, release = _held_before_publish(home)
    ck1 = fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=hold), close_timeout_s=0.5)
    try:
        old = ck1.save({"w": torch.ones(1000), "v": 1}, path)
        kept = ck1.local_path(path)
        assert entered.wait(60)
        with pytest.raises(fastckpt.errors.ReplicationError, match="still pending"):
            ck1.close()  # gives up on the copy held above
        with fastckpt.Checkpointer(local_dir=nvme) as ck2:  # a second fit() of the process saves the path again
            ck2.save({"w": torch.ones(10), "v": 2}, path).wait()
            release.set()
            with pytest.raises(fastckpt.errors.ReplicationError) as err:
                old.wait(60)
            assert ck2.load(path)["v"] == 2
    finally:
        release.set()
    assert "its Checkpointer was closed before the copy ended" in str(err.value)
    assert f"the local copy is kept at {kept}" in str(err.value)
    assert fastckpt.load(path)["v"] == 2


@pytest.mark.parametrize("policy", ["coalesce", "all"])
def test_a_verified_copy_is_published_though_the_same_checkpointers_next_save_replaced_its_source(
        tmp_path: Path, policy: str) -> None:
    """Saves of one path (last.pt) faster than an upload: the copy home, complete and verified, is published
    though the next save of this Checkpointer replaced the local copy meanwhile (that save's own upload follows
    it). Dropping it right before its rename kept the home at the first save for the whole run."""
    nvme, home = str(tmp_path / "bb"), str(tmp_path / "home")
    path = f"{home}/last.pt"
    hold, entered, release = _held_before_publish(home)
    written = threading.Event()

    class SecondWrite:  # the second save's local copy is in place (it replaced the first's): its commit event
        def __init__(self) -> None:
            self.n = 0

        def emit(self, e) -> None:  # noqa: ANN001
            if e.name == "commit" and e.error is None:
                self.n += 1
                if self.n == 2:
                    written.set()

    try:
        with fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=hold), replicate_policy=policy,
                                   sinks=(SecondWrite(),)) as ck:
            first = ck.save({"w": torch.ones(1000), "v": 1}, path)
            assert entered.wait(60)  # its copy home is complete and verified, about to be renamed into place
            second = ck.save({"w": torch.ones(1000) * 2, "v": 2}, path)
            assert written.wait(60)
            release.set()
            r1, r2 = first.wait(60), second.wait(60)
    finally:
        release.set()
    assert (r1.superseded, r2.superseded) == (False, False) and r1.durable_s is not None
    assert fastckpt.load(path)["v"] == 2


def test_a_copy_whose_local_source_another_checkpointers_newer_save_replaced_is_superseded(tmp_path: Path) -> None:
    nvme, home = str(tmp_path / "bb"), str(tmp_path / "home")
    path = f"{home}/last.pt"
    hold, entered, release = _held_before_publish(home)
    try:
        with fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=hold)) as ck1, \
                fastckpt.Checkpointer(local_dir=nvme) as ck2:  # two Checkpointers sharing a burst buffer
            old = ck1.save({"w": torch.ones(1000), "v": 1}, path)
            assert entered.wait(60)
            assert ck2.save({"w": torch.ones(10), "v": 2}, path).wait().durable_s is not None
            release.set()
            rec = old.wait(60)
    finally:
        release.set()
    assert (rec.superseded, rec.durable_s) == (True, None)
    assert fastckpt.load(path)["v"] == 2
