"""Rank 0 publishes a group, then its store connection fails as it tells the others (the store,
hosted elsewhere as by torchrun's agent, lives on): the other ranks learn the outcome at once,
not after waiting out commit_timeout_s twice and reporting a published group not committed.

Two real processes (forked from one that imported torch) in a gloo process group over a
TCPStore the test hosts; the default process group's store is the Checkpointer's. The fault is
injected in rank 0's process only: from its ``set`` of the outcome on, every call on that one
client connection fails with the error a reset connection raises (its clones, other connections
to the same live store, still work).
"""

from __future__ import annotations

import datetime
import json
import textwrap
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.errors import IncompleteCheckpointError
from tests.integration._fork_server import ForkServer

COMMIT_TIMEOUT_S = 60  # rank 1 waited it (and its grace) twice, then reported the published group failed

RANK = textwrap.dedent("""
    import datetime, json, os, sys, time, torch, torch.distributed as dist, fastckpt

    root, port, timeout_s, fault = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    r = int(os.environ["RANK"])
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    fault, _, where = fault.partition(" ")
    store = None  # "nostore": the ranks commit through marker files (the TCPStore is the test's alone)
    if where != "nostore":
        dist.init_process_group("gloo", store=client, rank=r, world_size=2)
        t = torch.ones(1)
        dist.all_reduce(t)  # a real gloo group over the store
        assert t.item() == 2
        store = dist.distributed_c10d._get_default_store()
    if r == 0:  # this connection of rank 0's resets as it tells the outcome (or: every one fails to tell it)
        broken = []

        def faulty(name):
            real = getattr(dist.PrefixStore, name)

            def call(self, *args):
                told = name == "set" and args[0].endswith("/outcome") and args[1].startswith(fault)
                if (where == "everywhere" and told) or (self is store and (broken or told)):
                    broken.append(name)
                    raise dist.DistNetworkError("Connection reset by peer (fault injected)")
                return real(self, *args)
            return call

        for name in ("set", "get", "add", "append", "compare_set", "delete_key", "check", "wait"):
            setattr(dist.PrefixStore, name, faulty(name))
    ops = None
    if r == 0 and fault == "failed":  # rank 0 cannot publish: the manifest's fsync fails (EIO)
        import errno
        from fastckpt.testing import Fault, FaultyOps
        ops = FaultyOps([Fault("fsync", errno.EIO, path_contains="fastckpt-manifest.json")])
    resave = where == "resave"  # the group "last" is saved twice: the second save's move of latest is held and fails
    if r == 0 and fault == "latest":  # rank 0 is slow to move latest, past rank 1's deadline, then fails to (EIO)
        import errno
        from fastckpt.testing import Fault, FaultyOps
        LATEST = "latest".encode().hex()  # a temp file carries its final name in hex
        nth = 2 if resave else 1
        told = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=120))
        moves = []

        def hold(op, path):
            if op == "fsync" and path.endswith(LATEST) and where != "nostore":
                moves.append(path)
                try:  # until rank 1 has answered (its own connection: the Checkpointer's stays free)
                    if len(moves) == nth:
                        told.wait(["test/rank1.done"])
                except RuntimeError:  # (a DistStoreError past 120 s: fail the move all the same)
                    pass
        ops = FaultyOps([Fault("fsync", errno.EIO, nth=nth, path_contains=LATEST)], on_call=hold)
    ck = fastckpt.Checkpointer(store=store, commit_timeout_s=timeout_s, io_threads=1, ops=ops, rank=r, world_size=2)
    g = f"{root}/last" if resave else f"{root}/step1"
    for step in (1, 2) if resave else (1,):
        ck.save({"w": torch.arange(1 << 12) + r + step, "step": step}, f"{g}/rank{r}.pt", group=g).wait()
        began = time.monotonic()
        try:
            ck.commit(g, step=step).wait()
            said = "ok"
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
            break
    print(json.dumps({"said": said, "took_s": time.monotonic() - began}), flush=True)
    if r == 1:
        client.set("test/rank1.done", "1")
    ck.close()
    os._exit(0)  # (the process group's teardown would use rank 0's reset connection)
""")


def _run(server: ForkServer, root: Path, port: int, fault: str, timeout_s: float) -> list[tuple[str, str]]:
    """Both ranks, forked by the session's ``torch_python`` server (tests/integration/conftest.py);
    each one's stdout and stderr once both ended. A rank still running after 400 s is killed and
    fails the test."""
    pids, outs = [], []
    for rank in (0, 1):
        stem = server.out_dir / f"tell-fails-{uuid.uuid4().hex[:12]}"
        outs.append((Path(f"{stem}.out"), Path(f"{stem}.err")))
        pids.append(server.start([str(root), str(port), str(timeout_s), fault], {"RANK": str(rank), "WORLD_SIZE": "2"},
                                 str(outs[-1][0]), str(outs[-1][1]), code=RANK))
    for pid in pids:
        server.wait(pid, 400)
    return [(out.read_text(), err.read_text()) for out, err in outs]


@pytest.mark.parametrize("fault", ["published", "failed"])
def test_the_others_learn_the_outcome_when_rank_0_cannot_tell_it(torch_python: ForkServer, tmp_path: Path,
                                                                   fault: str) -> None:
    """Before: rank 1 waited commit_timeout_s and its grace twice (132 s here), then raised "rank 0
    did not publish the group" for a group rank 0 had published, or without rank 0's cause for
    one it failed to publish."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outs = _run(torch_python, tmp_path, store.port, fault, COMMIT_TIMEOUT_S)
    said = _said(outs)
    assert "made again on another connection to it, which answered" in outs[0][1], outs[0][1][-3000:]
    assert said[1]["took_s"] < COMMIT_TIMEOUT_S / 2, said[1]  # at once, not after commit_timeout_s
    if fault == "published":
        assert said[0]["said"] == said[1]["said"] == "ok", said
        assert fastckpt.latest(str(tmp_path)) == f"{tmp_path}/step1"
        return
    assert said[0]["said"].startswith("ReplicationError: publish of ") and "Input/output error" in said[0]["said"], said
    assert said[1]["said"].startswith("CommitTimeoutError: ") and "rank 0 could not publish it" in said[1]["said"]
    assert "Input/output error" in said[1]["said"], said[1]  # rank 0's cause
    assert not (tmp_path / "step1" / P.GROUP_MANIFEST).exists() and fastckpt.latest(str(tmp_path)) is None


def _said(outs: list[tuple[str, str]]) -> dict[int, dict]:
    return {r: json.loads(out.splitlines()[-1]) if out.strip() else {"said": err[-3000:]}
            for r, (out, err) in enumerate(outs)}


def test_the_others_read_the_manifest_when_no_connection_of_rank_0_can_tell_them(torch_python: ForkServer,
                                                                                  tmp_path: Path) -> None:
    """Every connection of rank 0's fails to set the outcome of the group it published (the store
    lives on): rank 1 waited commit_timeout_s and its grace twice, then said "rank 0 did not publish
    the group". Rank 0 holds the attempt's claim, so at its deadline rank 1 reads the group's
    manifest: this attempt's, with its files, and latest names it: published."""
    timeout_s = 8.0  # rank 1 waits 9 s (its grace: 1 s) for the outcome, then reads the manifest
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outs = _run(torch_python, tmp_path, store.port, "published everywhere", timeout_s)
    said = _said(outs)
    assert said[0]["said"] == "ok", outs[0][1][-3000:]
    assert "before the other ranks were told" in outs[0][1]  # rank 0's warning: they learn it from the manifest
    assert said[1]["said"] == "ok", said[1]
    assert said[1]["took_s"] < 2 * timeout_s, said[1]  # at its deadline, not after a second wait
    assert fastckpt.latest(str(tmp_path)) == f"{tmp_path}/step1"


def test_a_rank_does_not_read_a_first_group_committed_before_latest_names_it(torch_python: ForkServer,
                                                                              tmp_path: Path) -> None:
    """At its deadline, rank 0 holding the claim, rank 1 took the group's manifest for a commit
    unless latest named an older checkpoint: on a job's first checkpoint (no latest yet) it said
    "ok" while rank 0 was still moving latest, a move that then failed (EIO): the ranks disagreed.
    It keeps waiting for rank 0's outcome until latest names the group."""
    timeout_s = 4.0
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outs = _run(torch_python, tmp_path, store.port, "latest", timeout_s)
    said = _said(outs)
    assert said[0]["said"].startswith("ReplicationError: publish of ") and "Input/output error" in said[0]["said"], said
    assert said[1]["said"].startswith("CommitTimeoutError: "), said[1]
    assert not (tmp_path / P.LATEST).exists()
    assert not (tmp_path / "step1" / P.GROUP_MANIFEST).exists()  # taken back
    assert fastckpt.latest(str(tmp_path)) is None  # before: the scan found the group both ranks reported failed
    with pytest.raises(IncompleteCheckpointError):
        fastckpt.load(str(tmp_path / "step1" / "rank1.pt"))


def test_a_rank_without_a_store_does_not_take_a_first_group_before_latest_names_it(torch_python: ForkServer,
                                                                                   tmp_path: Path) -> None:
    """The same without a store (marker files): rank 1 took the group's manifest for a commit once
    no pointer named an older checkpoint, so it said "ok" while rank 0's move of latest failed
    (EIO) and rank 0 reported the commit failed, and latest() found the group by its scan. Rank 1
    now waits for latest, rank 0 takes the group back, and both report it failed."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outs = _run(torch_python, tmp_path, store.port, "latest nostore", 20.0)
    said = _said(outs)
    assert said[0]["said"].startswith("ReplicationError: publish of ") and "Input/output error" in said[0]["said"], said
    assert said[1]["said"].startswith("CommitTimeoutError: ") and "Input/output error" in said[1]["said"], said[1]
    assert fastckpt.latest(str(tmp_path)) is None


def test_a_resaved_group_whose_latest_already_names_it_commits_on_every_rank(torch_python: ForkServer,
                                                                              tmp_path: Path) -> None:
    """A group re-saved under one path (a ``last`` group, a fixed DeepSpeed tag): latest names it from
    the previous save. Rank 0 swapped the re-save in, then its move of latest was held past rank 1's
    deadline, and failed (EIO). Rank 1, at its deadline, read the manifest and latest naming the
    group and said "ok"; rank 0 reported the commit failed, though latest() resumed the re-save.
    Rank 0 now writes no pointer that names the group already: both report it committed."""
    timeout_s = 4.0
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outs = _run(torch_python, tmp_path, store.port, "latest resave", timeout_s)
    said = _said(outs)
    assert said[0]["said"] == said[1]["said"] == "ok", said
    assert fastckpt.latest(str(tmp_path)) == f"{tmp_path}/last"
    assert fastckpt.load(f"{tmp_path}/last/rank1.pt")["step"] == 2
