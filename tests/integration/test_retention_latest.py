"""keep_persistent never deletes the group ``latest`` names. A group's place in retention's
order is its commit's (as in ``latest``'s), not its first save's: once, a rank 0 that saved no
file into step 1 gave it a place after step 2 (the token came when the commit ended), and a
group saved first but committed last was listed as the older; retention then deleted the newest
committed group right after its commit moved ``latest`` to it, and a restart went back a step."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from tests.helpers import place


def _state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


@pytest.mark.parametrize("with_store", [True, False])
def test_a_rank_with_no_file_in_a_group_never_costs_the_newest_group(tmp_path, with_store: bool) -> None:
    run = str(tmp_path / "run")
    one, two = os.path.join(run, "global_step1"), os.path.join(run, "global_step2")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) if with_store else None
    r0, r1 = (fastckpt.Checkpointer(rank=r, world_size=2, store=store, keep_persistent=1, commit_timeout_s=60)
              for r in range(2))
    try:
        r1.save(_state(1), one + "/r1.pt", group=one)  # rank 0 saves nothing into step 1
        h0 = r0.commit(one, step=1)
        r0.save(_state(2), two + "/r0.pt", group=two)  # rank 0 goes on before rank 1 commits step 1
        h1 = r1.commit(one, step=1)
        h0.wait(60)
        h1.wait(60)
        r1.save(_state(2), two + "/r1.pt", group=two)
        for h in (r0.commit(two, step=2), r1.commit(two, step=2)):
            h.wait(60)
        r0.wait()
        r1.wait()
    finally:
        r0.close()
        r1.close()
    assert fastckpt.latest(run) == two and P.read_group_manifest(place(two)) is not None
    assert fastckpt.load(two + "/r0.pt")["step"] == 2
    assert not os.path.exists(one)  # keep_persistent=1: the older one went


def test_groups_committed_in_another_order_than_saved_keep_the_one_latest_names(tmp_path) -> None:
    run = str(tmp_path / "run")
    a, b = os.path.join(run, "step_a"), os.path.join(run, "step_b")
    with fastckpt.Checkpointer(keep_persistent=1) as ck:
        ck.save(_state(1), a + "/model.pt", group=a)  # a's save begins first
        ck.save(_state(2), b + "/model.pt", group=b)
        ck.commit(b).wait()
        ck.commit(a).wait()  # ...and is committed last: latest names it
        ck.wait()
    assert fastckpt.latest(run) == a and fastckpt.load(a + "/model.pt")["step"] == 1
    assert not os.path.exists(b)


def test_retention_never_deletes_what_latest_names(tmp_path, caplog) -> None:
    """The last line of defence: whatever the lists say, the checkpoint ``latest`` names stays."""
    from fastckpt.save.retention import Retention
    from fastckpt.storage.homes import Homes

    run = str(tmp_path / "run")
    g = os.path.join(run, "step_1")
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(1), g + "/model.pt", group=g)
        ck.commit(g).wait()
    r = Retention(None, 1, Homes(), lambda p: [])
    with caplog.at_level("WARNING", logger="fastckpt"):
        r._trim_persistent(g)
    assert fastckpt.latest(run) == g and "latest names it" in caplog.text


def test_a_failed_re_save_leaves_the_published_group_to_retention(tmp_path) -> None:
    """A re-save of a published tag whose commit fails (rank 1 never commits it) took the tag out
    of retention's lists for good: the old group, still published, was never trimmed again."""
    run = str(tmp_path / "run")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, keep_persistent=1, commit_timeout_s=2)
           for r in range(2)]

    def step(n: int, ranks: tuple[int, ...] = (0, 1)) -> None:
        g = os.path.join(run, f"global_step{n}")
        for r in ranks:
            cks[r].save(_state(n), f"{g}/r{r}.pt", group=g)
        for h in [cks[r].commit(g, step=n) for r in ranks]:
            h.wait(60)

    try:
        step(1)
        step(2)
        with pytest.raises(fastckpt.CommitTimeoutError):
            step(2, ranks=(0,))  # the re-save: rank 1 never commits it
        step(3)
        step(4)
        for ck in cks:
            ck.wait()
    finally:
        for ck in cks:
            ck.close()
    assert sorted(d for d in os.listdir(run) if not d.startswith(".") and d != "latest") == ["global_step4"]


def test_a_checkpoint_spared_while_latest_names_it_is_trimmed_once_latest_moves_on(tmp_path, caplog) -> None:
    """Two single files beside group step-1 (files move no pointer among groups) trim step-1 while
    ``latest`` still names it: spared, but already off the list, so no later trim deleted it."""
    run = str(tmp_path / "run")
    with fastckpt.Checkpointer(rank=0, world_size=1, keep_persistent=2) as ck:
        def group(step: int) -> None:
            g = os.path.join(run, f"step-{step}")
            ck.save(_state(step), g + "/model.pt", group=g)
            ck.commit(g, step=step).wait()

        group(1)
        with caplog.at_level("WARNING", logger="fastckpt"):
            ck.save(_state(10), os.path.join(run, "a.pt")).wait()
            ck.save(_state(11), os.path.join(run, "b.pt")).wait()
        assert "latest names it" in caplog.text and os.path.exists(os.path.join(run, "step-1"))
        for step in range(2, 5):
            group(step)
    assert sorted(n for n in os.listdir(run) if n != "latest") == ["step-3", "step-4"]  # step-1 stayed for good


def _keys(run: str, request) -> set[str]:
    """Every object or file under ``run``, relative to it."""
    if not run.startswith("s3://"):
        return {os.path.relpath(os.path.join(d, f), run) for d, _, fs in os.walk(run) for f in fs}
    bucket, prefix = run[len("s3://"):].split("/", 1)
    got = request.getfixturevalue("s3_server").client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:] for o in got.get("Contents", [])}


@pytest.mark.parametrize("at", ["posix", "s3"])
def test_keep_persistent_keeps_the_newest_files_saved_one_per_folder(request, tmp_path, caplog, at: str) -> None:
    """docs/burst-buffer.md's layout, one save per folder (``run7/step-N/state.pt``): at a URL each
    file's publication moves ``step-N/latest`` to it, and retention spared what its folder's
    ``latest`` names: keep_persistent=2 deleted nothing there, ever, with a WARNING more at each
    save. A file alone in its folder goes with that folder's pointer, as on POSIX (no pointer)."""
    opts = request.getfixturevalue("s3_server").storage_options() if at == "s3" else None
    run = f"s3://{request.getfixturevalue('s3_bucket')}/run7" if at == "s3" else str(tmp_path / "run7")
    with caplog.at_level("WARNING", logger="fastckpt"), fastckpt.Checkpointer(
            local_dir=str(tmp_path / "nvme"), storage_options=opts, keep_persistent=2, keep_local=1) as ck:
        for step in range(1, 6):
            ck.save(_state(step), f"{run}/step-{step}/state.pt").wait()
    assert "retention" not in caplog.text
    kept = {f"step-{s}/{name}" for s in (4, 5) for name in (
        ("state.pt", "state.pt.fastckpt.json", "latest") if at == "s3" else ("state.pt",))}
    assert _keys(run, request) == kept
    assert fastckpt.latest(run, storage_options=opts) == f"{run}/step-5/state.pt"
    assert fastckpt.load(f"{run}/step-5/state.pt", storage_options=opts)["step"] == 5


def test_retention_spares_the_file_latest_names_among_other_checkpoints_at_a_url(s3_server, s3_bucket, tmp_path,
                                                                                   caplog) -> None:
    """The last line of defence stays where the folder holds other checkpoints: its ``latest``
    is the resume point a restart of that folder asks for."""
    from fastckpt.save.retention import Retention
    from fastckpt.storage.homes import Homes

    run, opts = f"s3://{s3_bucket}/run", s3_server.storage_options()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        for step, name in ((1, "a.pt"), (2, "b.pt")):
            ck.save(_state(step), f"{run}/{name}")
    with caplog.at_level("WARNING", logger="fastckpt"):
        Retention(None, 1, Homes(opts), lambda p: [])._trim_persistent(f"{run}/b.pt")
    assert "latest names it" in caplog.text
    assert fastckpt.latest(run, storage_options=opts) == f"{run}/b.pt"
