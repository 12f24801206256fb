"""Randomized SIGKILLs of 2-rank groups: no published group is ever lost or mixed, no load is
corrupt (issue #9: "a committed group never vanishes or mixes two attempts").

Each mode runs launches of 2 real rank processes (``_kill_group_worker.py``) against one
checkpoint directory: without a store (the storage-marker protocol), with a TCPStore the test
hosts (as torchrun's agent does; each launch under a prefix of its own, or every launch on the
same keys, as torchrun's agent store keeps them across restarts: a launch killed before one rank
made its Checkpointer must not leave the next launches' ranks disagreeing), with a POSIX burst
buffer (``local_dir``) besides, and with that burst buffer replicating to an S3 home (a real
SeaweedFS server), where a kill lands in multipart uploads too. A launch resumes from the newest
checkpoint, or (one launch in three, on a POSIX home) from an older published one, so that
published groups get re-saved (an object store refuses that: there a launch resumes from
``latest``, and re-saves in place only a group whose commit died before moving it). Each launch
is SIGKILLed after a random number of commits and a random delay, both ranks (as a launcher
tears a failed job down); on the kept keys, every third launch loses one rank before it makes
its Checkpointer instead, and the next launch must commit within ``RESTART_COMMIT_S``. After
every kill the test checks, from the stored objects alone:

* every group a rank reported durable (rank 0, or rank 1: it reports a group once rank 0 has
  published it and moved ``latest``) is still published;
* every published group loads, verified, and both of its files come from one launch;
* ``latest`` names a published group at least as new (in request order) as the last one a rank
  reported durable (a kill between a manifest and the pointer may leave it one unreported
  commit behind, never more);
* no rank's resume load ever returned other tensors than its file was saved with.

The random choices come from a seeded generator (the seed is in the failure message).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import random
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from pathlib import Path

import pytest
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P

from . import _kill_group_worker as K

KILLS_PER_MODE = 11
RESTART_COMMIT_S = 10.0  # a commit takes well under a second; a store session the ranks disagree on, forever
MODES = ("no store", "store", "store kept across launches", "store + burst buffer", "store + burst buffer + S3 home")


@pytest.fixture(scope="module")
def forkserver() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "fastckpt", K.__name__])
    return ctx


@dataclass(frozen=True)
class Home:
    """Where the launches' groups live: a directory, or ``s3://BUCKET/ckpt`` on ``server``."""

    root: str
    server: object = None  # tests.s3server.S3Server

    @property
    def options(self) -> dict | None:
        return self.server.storage_options() if self.server is not None else None

    def published(self) -> dict[int, tuple[dict, tuple]]:
        """step -> (manifest, stamp) of every published group, read from the store itself. The stamp
        (each object's name with its ETag and size, or inode, mtime and size) changes whenever
        any of the group's objects is written again."""
        if self.server is None:
            out = {}
            for d in Path(self.root).glob("step*"):
                with contextlib.suppress(FileNotFoundError):
                    stamp = tuple(sorted((f.name, f.stat().st_ino, f.stat().st_mtime_ns, f.stat().st_size)
                                         for f in d.iterdir() if f.is_file()))
                    out[int(d.name[4:])] = (json.loads((d / P.GROUP_MANIFEST).read_text()), stamp)
            return out
        bucket, prefix = self.root[len("s3://"):].split("/", 1)
        client, objects = self.server.client(), {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/step"):
            for obj in page.get("Contents", []):
                tag, _, rest = obj["Key"][len(prefix) + 1:].partition("/")
                objects.setdefault(tag, []).append((rest, obj["ETag"], obj["Size"]))
        out = {}
        for tag, stamp in objects.items():
            if any(rest == P.GROUP_MANIFEST for rest, _, _ in stamp):
                body = client.get_object(Bucket=bucket, Key=f"{prefix}/{tag}/{P.GROUP_MANIFEST}")["Body"].read()
                out[int(tag[4:])] = (json.loads(body), tuple(sorted(stamp)))
        return out

    def latest(self) -> str | None:
        return fastckpt.latest(self.root, storage_options=self.options)

    def load(self, step: int, rank: int) -> object:
        return fastckpt.load(f"{self.root}/step{step}/rank{rank}.pt", storage_options=self.options)


def _launch(ctx: mp.context.BaseContext, job: K.Launch) -> tuple[list, list]:
    procs, conns = [], []
    for rank in (0, 1):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=K.run_rank, args=(rank, job, send), daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    return procs, conns


def _events_until(conns: list, count: int, limit_s: float) -> list[tuple]:
    """Receive events until ``count`` "durable" ones arrived, both ranks finished, or ``limit_s``."""
    got: list[tuple] = []
    open_conns, deadline = list(conns), time.monotonic() + limit_s
    while open_conns and sum(e[0] == "durable" for e in got) < count:
        ready = wait_any(open_conns, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for c in ready:
            try:
                got.append(c.recv())
            except (EOFError, OSError):
                open_conns.remove(c)
    return got


def _drain(conns: list) -> list[tuple]:
    got = []
    for c in conns:
        try:
            while c.poll():
                got.append(c.recv())
        except (EOFError, OSError):  # a message cut short by the kill
            pass
        c.close()
    return got


def _check(home: Home, durable: dict[int, int], floor: float, local_dir: str | None, why: str,
           checked: dict[int, tuple]) -> None:
    """The invariants above. ``checked``: step -> the stamp of the group when its home copy was
    last loaded and found whole; a group none of whose objects changed since is not loaded again
    (an object store's GETs are slow, and the groups add up over the launches)."""
    found = home.published()
    published = {step: m for step, (m, _) in found.items()}
    lost = sorted(s for s in durable if s not in published)
    assert lost == [], f"{why}: groups reported durable but no longer published: {lost}"
    for step, (m, stamp) in found.items():
        assert sorted(m["files"]) == ["rank0.pt", "rank1.pt"], f"{why}: step{step} manifest {m['files']}"
        if checked.get(step) == stamp:
            continue
        launches = set()
        for rank in (0, 1):
            got = home.load(step, rank)  # verified: raises if corrupt
            assert K.matches(got, step, rank), f"{why}: step{step}/rank{rank}.pt holds {got!r:.200}"
            launches.add(got["launch"])
        assert len(launches) == 1, f"{why}: step{step} mixes launches {launches}"
        checked[step] = stamp
    newest = home.latest()
    if durable:
        assert newest is not None, why
        order = P.group_order(published[int(newest.rsplit("/", 1)[1][4:])])
        assert order >= floor, f"{why}: latest {newest} is older than the last group reported durable"
    if local_dir is not None:
        for rank in (0, 1):
            with fastckpt.Checkpointer(rank=rank, world_size=2, local_dir=local_dir,
                                       storage_options=home.options) as ck:
                for step in published:
                    assert K.matches(ck.load(f"{home.root}/step{step}/rank{rank}.pt"), step, rank), why


@pytest.mark.parametrize("mode", MODES)
def test_random_kills_never_lose_or_mix_a_published_group(tmp_path: Path, forkserver: mp.context.BaseContext,
                                                          mode: str, request: pytest.FixtureRequest) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    if "S3" in mode:
        server = request.getfixturevalue("s3_server")
        home = Home(f"s3://{request.getfixturevalue('s3_bucket')}/ckpt", server)
    else:
        home = Home(str(tmp_path / "ckpt"))
    local_dir = str(tmp_path / "nvme") if "burst" in mode else None
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) \
        if "store" in mode else None
    durable: dict[int, int] = {}  # step -> the launch one of whose ranks reported it durable
    floor = 0.0  # the request order of the last group reported durable
    checked: dict[int, tuple] = {}
    kills = 0
    died: int | None = None  # the rank the previous launch lost before it made its Checkpointer
    for launch in range(KILLS_PER_MODE):
        published = home.published()
        newest = home.latest()
        start = int(newest.rsplit("/", 1)[1][4:]) if newest else 0
        if published and home.server is None and rng.random() < 1 / 3:
            start = rng.choice(sorted(published))  # resume from an older checkpoint: re-saves published tags
        die = rng.choice((0, 1)) if "kept" in mode and launch % 3 == 0 else None
        job = K.Launch(home.root, launch, start, steps=4, local_dir=local_dir,
                       store_port=store.port if store is not None else None, storage_options=home.options,
                       launch_prefix="kept" not in mode, die_rank=die)
        why = f"seed={seed} mode={mode} launch={launch} start={start} die={die}"
        procs, conns = _launch(forkserver, job)
        if die is not None:  # it kills itself once the other rank's first commit is under way
            procs[die].join(30)
            assert procs[die].exitcode == -signal.SIGKILL, why
            events = []
        else:
            commits, delay = rng.randint(1 if died is not None else 0, 3), rng.uniform(0.0, 0.05)
            events = _events_until(conns, commits, limit_s=RESTART_COMMIT_S if died is not None else 60)
            time.sleep(delay)  # where inside the next save or commit the kill lands; every outcome must pass
        for p in rng.sample(procs, 2):
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):  # it may have ended since is_alive()
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(30)
        events += _drain(conns)
        kills += 1
        assert [e for e in events if e[0] == "bad-load"] == [], why
        if died is not None:
            assert [e for e in events if e[0] == "durable" and e[1] == 0], (
                f"{why}: no group committed within {RESTART_COMMIT_S} s after a launch lost rank {died} "
                "before its Checkpointer (do the ranks disagree on the store's session?)")
        died = die
        reported = [e[2] for e in events if e[0] == "durable"]  # by either rank: each may be the only one
        durable.update({step: launch for step in reported})
        if reported:
            floor = max(floor, P.group_order(home.published()[max(reported)][0]))
        _check(home, durable, floor, local_dir, why, checked)
    assert kills == KILLS_PER_MODE
    assert durable, f"seed={seed}: no launch got as far as one commit"
