"""tiers.py: the choice and the reasons, GDS rejected on a CPU machine with real kvikio."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

import fastckpt
from fastckpt.errors import TierUnavailableError
from fastckpt.save.tiers import TierSelector, gds_unavailable_reason, probe_odirect

needs_kvikio = pytest.mark.skipif(importlib.util.find_spec("kvikio") is None, reason="kvikio not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only rejection")
@needs_kvikio
def test_gds_rejected_with_reason_on_cpu_with_real_kvikio() -> None:
    import kvikio  # noqa: F401  (the real package imports on a CPU machine)

    why = gds_unavailable_reason(has_cuda_tensors=True)
    assert why is not None
    assert "libcuda" in why or "CUDA" in why or "compat" in why


def test_gds_rejected_without_cuda_tensors() -> None:
    assert gds_unavailable_reason(False) == "the state has no CUDA tensors"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only rejection")
def test_explicit_gds_raises_with_reason(tmp_path) -> None:
    ck = fastckpt.Checkpointer(tier="gds")
    with pytest.raises(TierUnavailableError, match="tier='gds' requested but"):
        ck.save({"a": torch.ones(2)}, str(tmp_path / "a.pt"))
    ck.close()


def test_auto_logs_choice_and_rejections(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        sel = TierSelector("auto", None, True)
        c = sel.choose(str(tmp_path), has_cuda=False)
        again = sel.choose(str(tmp_path), has_cuda=False)
    assert c is again  # probed once per directory
    assert c.tier == "direct" and "gds" in c.reasons and "nvme" in c.reasons
    lines = [r.getMessage() for r in caplog.records if "tier=" in r.getMessage()]
    assert len(lines) == 1 and "gds rejected" in lines[0] and "nvme rejected: no local_dir" in lines[0]


def test_nvme_with_local_dir(tmp_path) -> None:
    c = TierSelector("auto", str(tmp_path / "nvme"), True).choose(str(tmp_path / "dst"), False)
    assert c.tier == "nvme" and c.reasons["direct"].startswith("local_dir is set")


def test_bad_requests(tmp_path) -> None:
    with pytest.raises(TierUnavailableError, match="needs local_dir"):
        TierSelector("nvme", None, True).choose(str(tmp_path), False)
    with pytest.raises(TierUnavailableError, match="drop local_dir"):
        TierSelector("direct", str(tmp_path), True).choose(str(tmp_path), False)
    with pytest.raises(fastckpt.ConfigError, match="tier='fast'"):
        fastckpt.Checkpointer(tier="fast")


def test_a_tier_that_cannot_work_with_the_local_dir_given_is_refused_when_built(tmp_path) -> None:
    """tier='nvme' without local_dir was accepted, and failed at the first save, after training
    ran (the Lightning plugin promises invalid values fail when it is built)."""
    with pytest.raises(fastckpt.ConfigError, match="tier='nvme' needs local_dir"):
        fastckpt.Checkpointer(tier="nvme")
    with pytest.raises(fastckpt.ConfigError, match="drop local_dir"):
        fastckpt.Checkpointer(tier="direct", local_dir=str(tmp_path))
    pytest.importorskip("lightning")
    with pytest.raises(fastckpt.ConfigError, match="tier='nvme' needs local_dir"):
        fastckpt.FastCkptIO(tier="nvme")


def test_odirect_probe_reports_tmpfs(tmp_path) -> None:
    ok, why = probe_odirect(str(tmp_path))
    assert ok or "O_DIRECT" in why
    import shutil
    import tempfile

    if os.path.isdir("/dev/shm"):  # tmpfs: O_DIRECT refused, with the reason
        d = tempfile.mkdtemp(dir="/dev/shm")
        try:
            ok, why = probe_odirect(d)
            assert ok or "refused O_DIRECT" in why
        finally:
            shutil.rmtree(d)


def test_a_file_system_refusing_o_direct_at_open_keeps_no_probe_file(tmp_path, caplog) -> None:
    """ramfs (tmpfs before Linux 6.6) creates the file, then open(O_DIRECT) fails with EINVAL:
    the probe's file was left in the user's checkpoint directory."""
    from tests.helpers import tmpfs

    with tmpfs(tmp_path / "home", "defaults", fstype="ramfs") as home:
        with caplog.at_level(logging.INFO, logger="fastckpt"), fastckpt.Checkpointer() as ck:
            ck.save({"w": torch.randn(10)}, str(home / "a.pt")).wait()
        assert f"buffered (filesystem at {home} refused O_DIRECT)" in caplog.text
        assert sorted(os.listdir(home)) == ["a.pt"]
        assert fastckpt.load(str(home / "a.pt"))["w"].shape == (10,)


def test_one_probe_per_file_system_not_per_directory(tmp_path) -> None:
    """Megatron and DeepSpeed save each checkpoint into a new directory (iter_0000100/, ...): the
    O_DIRECT probe, on the training thread, runs once for their file system, not once a save."""
    from fastckpt.io.atomic import PROBE_TAG
    from fastckpt.testing import FaultyOps

    probes: list[str] = []
    ops = FaultyOps(on_call=lambda op, path: probes.append(path) if op == "open" and PROBE_TAG in path else None)
    with fastckpt.Checkpointer(ops=ops) as ck:
        for step in (100, 200, 300):
            ck.save({"w": torch.ones(4)}, str(tmp_path / f"iter_{step:07d}" / "model.pt")).wait()
    assert len(probes) == 1, probes


def test_a_file_system_refusing_o_direct_is_named_in_the_record_and_the_write_event(tmp_path) -> None:
    """The probe's refusal reached only the tier line: SaveRecord.odirect_reason and the write
    event said "O_DIRECT disabled", the text for odirect=False (docs/tiers.md promises the
    refusal in all three)."""
    from tests.helpers import WriteDetails, tmpfs

    with tmpfs(tmp_path / "home", "defaults", fstype="ramfs") as home:
        writes = WriteDetails()
        with fastckpt.Checkpointer(sinks=[writes]) as ck:
            rec = ck.save({"w": torch.randn(10)}, str(home / "a.pt")).wait()
        refused = f"filesystem at {home} refused O_DIRECT"
        assert (rec.odirect, rec.odirect_reason) == (False, refused)
        assert writes.details == [f"buffered: {refused}"]
        with fastckpt.Checkpointer(sinks=[writes], odirect=False) as ck:  # asked for: said so
            rec = ck.save({"w": torch.randn(10)}, str(tmp_path / "b.pt")).wait()
        assert (rec.odirect, rec.odirect_reason) == (False, "O_DIRECT disabled by odirect=False")
        assert writes.details[-1] == "buffered: O_DIRECT disabled by odirect=False"
