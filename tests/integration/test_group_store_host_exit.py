"""A rank hears rank 0's outcome through the store that rank 0's process hosts (a plain
``TCPStore`` with ``is_master=True``, as ``init_process_group`` without torchrun makes it). When
that process has ended before the rank reads the outcome, the group's manifest at its home says
whether rank 0 published this attempt: a published group is not reported failed, and one whose
``latest`` rank 0 never moved (a restart redoes it) is not reported committed."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os

import pytest

import fastckpt


def _context() -> mp.context.BaseContext:
    """Processes forked from multiprocessing's fork server, which imported torch, fastckpt and this
    module once (as test_group_kills' ranks are): spawned, each imported them again (about 2 s of
    CPU each). Each process still has its own store connections, patches and exit."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "fastckpt", __name__])
    return ctx


def _rank0(tag: str, port_q, how: str, rank1_hearing) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    port_q.put(store.port)
    def end(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        rank1_hearing.wait(120)
        os._exit(0)  # the process, and its store, end as rank 0 was about to publish (or to move latest)

    if how == "end before publishing":
        from fastckpt.commit import attempt

        attempt.publish = end
    elif how == "end before latest":
        from fastckpt.commit import protocol

        protocol.move_pointer = end
    ck = fastckpt.Checkpointer(rank=0, world_size=2, store=store, commit_timeout_s=60)
    ck.save({"w": torch.zeros(4)}, f"{tag}/rank0.pt", group=tag).wait()
    ck.commit(tag, step=1).wait()
    ck.close()  # published; the process and the store it hosts end


def _rank1(tag: str, port: int, rank1_hearing, rank0_gone, out, value: float) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from fastckpt.commit import store as S

    hear = S.Channel.hear

    def late(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 (this rank reads the outcome late)
        rank1_hearing.set()
        rank0_gone.wait(120)
        return hear(self, *args, **kwargs)

    S.Channel.hear = late
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    ck = fastckpt.Checkpointer(rank=1, world_size=2, store=store, commit_timeout_s=60)
    ck.save({"w": torch.full((4,), value)}, f"{tag}/rank1.pt", group=tag)
    try:
        ck.commit(tag, step=1).wait()
        out.put("ok")
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        out.put(f"{type(exc).__name__}: {exc}")
    try:
        ck.close()
    except Exception:  # noqa: BLE001 (the store is gone: nothing more to say)
        pass


def _launch(tag: str, how: str, value: float) -> str:
    """One launch of a 2-rank job on a new store that rank 0's process hosts: what rank 1's commit said."""
    ctx = _context()
    port_q, out, rank1_hearing, rank0_gone = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    p0 = ctx.Process(target=_rank0, args=(tag, port_q, how, rank1_hearing))
    p0.start()
    p1 = ctx.Process(target=_rank1, args=(tag, port_q.get(timeout=120), rank1_hearing, rank0_gone, out, value))
    p1.start()
    p0.join(120)
    rank0_gone.set()
    said = out.get(timeout=180)
    p1.join(60)
    assert p0.exitcode == 0
    return said


@pytest.mark.parametrize("case", ["published", "not published", "an earlier launch's publication"])
def test_a_rank_that_hears_late_from_a_store_whose_host_ended_reports_what_was_published(tmp_path, case: str) -> None:
    tag = str(tmp_path / "step-1")
    if case == "an earlier launch's publication":  # whose store gave the same attempt id ("1.0")
        assert _launch(tag, "publish", 1.0) == "ok"
    said = _launch(tag, "publish" if case == "published" else "end before publishing", 2.0)
    if case == "published":
        assert fastckpt.latest(str(tmp_path)) == tag
        assert said == "ok"  # was: StoreError "... The group stays incomplete."
    else:
        assert said.startswith("StoreError:") and "stopped answering" in said, said
        assert fastckpt.latest(str(tmp_path)) == (tag if case != "not published" else None)


def test_a_group_published_without_its_latest_is_not_reported_committed(tmp_path) -> None:
    """Rank 0's process (and its store) ended between the group's manifest and ``latest``: the
    resumed launch starts from the older checkpoint ``latest`` names and saves the group again, so
    rank 1 must not report it committed (it did: "latest never behind a reported commit" broke)."""
    assert _launch(str(tmp_path / "step-1"), "publish", 1.0) == "ok"
    said = _launch(str(tmp_path / "step-2"), "end before latest", 2.0)
    assert said.startswith("StoreError:") and "not committed" in said, said
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step-1")


def _store_host(port_q) -> None:  # noqa: ANN001 (torchrun's agent: it hosts the store, runs no rank)
    import threading

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    port_q.put(store.port)
    threading.Event().wait()  # until SIGKILLed


def _agent_rank(rank: int, port: int, run: str, opts: dict, nvme: str, published, host_dead, out) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from fastckpt.commit import protocol

    move = protocol.move_pointer

    def moved_then_host_killed(parent, name, order):  # noqa: ANN001, ANN202
        done = move(parent, name, order)
        if name == "step2":  # published, latest names it: now the store's host dies
            published.set()
            host_dead.wait(120)
        return done

    protocol.move_pointer = moved_then_host_killed
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=20))
    ck = fastckpt.Checkpointer(rank=rank, world_size=2, store=store, local_dir=nvme, storage_options=opts,
                               commit_timeout_s=20, overhead_budget=0.99)
    said = {}
    for step in (1, 2):
        g = f"{run}/step{step}"
        ck.save({"w": torch.full((1 << 12,), float(step * 10 + rank))}, f"{g}/rank{rank}.pt", group=g)
        try:
            ck.commit(g, step=step).wait(60)
            said[step] = "ok"
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            said[step] = f"{type(exc).__name__}: {exc}"
    out.put((rank, said))
    out.close()
    out.join_thread()  # flushed before the exit below
    os._exit(0)  # close() would wait on the dead store


def test_rank_0_reports_a_group_committed_when_the_agents_store_dies_after_it_moved_latest(s3_server, s3_bucket,
                                                                                          tmp_path) -> None:
    """Under torchrun the agent hosts the store. SIGKILLed right after rank 0 published a group and
    moved ``latest`` to it, rank 0's announcement of the outcome fails: the group is committed all
    the same (rank 1 reads it from the manifest), so rank 0 says so, with a WARNING (it raised
    ``StoreError``, "the group stays incomplete", for the group ``latest()`` names)."""
    ctx = _context()
    opts = s3_server.storage_options()
    run = f"s3://{s3_bucket}/run"
    port_q, out, published, host_dead = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    host = ctx.Process(target=_store_host, args=(port_q,))
    host.start()
    try:
        port = port_q.get(timeout=120)
        ranks = [ctx.Process(target=_agent_rank, args=(r, port, run, opts, str(tmp_path / f"nvme{r}"), published,
                                                        host_dead, out)) for r in (0, 1)]
        for p in ranks:
            p.start()
        assert published.wait(180)
        host.kill()
        host.join(60)
        host_dead.set()
        said = dict(out.get(timeout=180) for _ in ranks)
        for p in ranks:
            p.join(60)
    finally:
        host.kill()
    assert fastckpt.latest(run, storage_options=opts) == f"{run}/step2"
    assert said == {0: {1: "ok", 2: "ok"}, 1: {1: "ok", 2: "ok"}}
    assert [fastckpt.load(f"{run}/step2/rank{r}.pt", storage_options=opts)["w"][0].item() for r in (0, 1)] == [20, 21]
