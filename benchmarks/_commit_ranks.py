"""Simulated ranks for commit_scale.py: one process runs ranks [lo, hi) of a W-rank job.

Each rank is a real ``Checkpointer(rank=r, world_size=W, store=...)``; all of this process's
ranks share one client of the benchmark's TCPStore (wrapped in ``CountingStore``), one
``CountingOps`` (the FileOps seam: every system call on a file) and, through a patched
``Homes.resolve``, ``CountingTarget`` wrappers around every Target they reach (the storage
requests: puts, gets, listings, stats, deletes). A round is: every rank saves a small file into
``ROOT/step{N}`` and commits it right away, as a training loop would; the process then waits for
every handle and reports when each rank's file became durable and its commit resolved.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from dataclasses import dataclass

import torch

ELEMENTS = 1024  # 8 KiB of int64 per rank: the commit, not the write, is measured


def _kind(key: str) -> str:
    base = key.rstrip("/").rsplit("/", 1)[-1]
    if "/.fastckpt/rank-" in f"/{key}":
        return "marker"
    if base in ("fastckpt-manifest.json", "latest"):
        return "manifest" if base.endswith(".json") else "pointer"
    if base in ("attempt.json", "outcome.json"):
        return "record"
    return "data" if base.endswith(".pt") else "other"


class Counts:
    """A thread-safe counter, read and reset between rounds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: collections.Counter = collections.Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._c[key] += n

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self._c = dict(self._c), collections.Counter()
        return out


def counting_ops(counts: Counts) -> object:
    from fastckpt.io.ops import FileOps

    class CountingOps(FileOps):
        """The FileOps seam, counting every call by name."""

    def wrap(name: str) -> object:
        base = getattr(FileOps, name)

        def call(self: FileOps, *args: object) -> object:
            counts.add(name)
            return base(self, *args)

        return call

    for name in ("open", "pwrite", "preadv", "fsync", "ftruncate", "close", "replace", "unlink", "rmdir",
                 "makedirs", "fsync_dir", "exchange", "link"):
        setattr(CountingOps, name, wrap(name))
    return CountingOps()


TARGET_CALLS = ("put_file", "put_bytes", "get_bytes", "read_range", "read_object", "read_manifest", "size",
                "exists", "list", "delete", "delete_tree", "exchange", "link", "verify", "check_size")


class CountingTarget:
    """A Target wrapper counting storage requests by call and by what they touch."""

    def __init__(self, target: object, counts: Counts, local: bool) -> None:
        self._t, self._counts, self._local = target, counts, local

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._t, name)
        if name not in TARGET_CALLS:
            return attr

        def call(*args: object, **kw: object) -> object:
            key = args[1] if name == "put_file" else (args[0] if args else kw.get("prefix", ""))
            where = "" if self._t.mounted or not self._local else "remote "  # type: ignore[attr-defined]
            self._counts.add(f"{where}{name} {_kind(str(key))}")
            return attr(*args, **kw)

        return call


def count_targets(counts: Counts, local: bool) -> None:
    """Wrap every Target that ``Homes.resolve`` hands out (this process only). ``local``: a
    burst buffer is in use, and the requests to object stores ("remote ...") are the ones
    that count; the burst buffer's own files are counted apart."""
    from fastckpt.storage import homes

    orig = homes.Homes.resolve
    if getattr(orig, "_counting", False):
        return

    def resolve(self: homes.Homes, name: str) -> homes.Location:
        loc = orig(self, name)
        return homes.Location(CountingTarget(loc.target, counts, local), loc.key)  # type: ignore[arg-type]

    resolve._counting = True  # type: ignore[attr-defined]
    homes.Homes.resolve = resolve  # type: ignore[method-assign]


class CountingStore:
    """A c10d Store wrapper counting operations, bytes (keys and values) and distinct keys."""

    def __init__(self, store: object, counts: Counts, keys: set) -> None:
        self._s, self._counts, self._keys = store, counts, keys

    def _do(self, op: str, keys: list[str], nbytes: int, fn: object, *args: object) -> object:
        self._counts.add(f"store {op}")
        self._keys.update(keys)
        out = fn(*args)
        self._counts.add("store bytes", nbytes + sum(map(len, keys)) + (len(out) if isinstance(out, bytes) else 0))
        return out

    def set(self, k: str, v: str) -> None:
        self._do("set", [k], len(v), self._s.set, k, v)

    def get(self, k: str) -> bytes:
        return self._do("get", [k], 0, self._s.get, k)  # type: ignore[return-value]

    def add(self, k: str, n: int) -> int:
        return self._do("add", [k], 8, self._s.add, k, n)  # type: ignore[return-value]

    def append(self, k: str, v: str) -> None:
        self._do("append", [k], len(v), self._s.append, k, v)

    def compare_set(self, k: str, old: str, new: str) -> bytes:
        return self._do("compare_set", [k], len(old) + len(new), self._s.compare_set, k, old, new)  # type: ignore[return-value]

    def check(self, keys: list[str]) -> bool:
        return self._do("check", keys, 0, self._s.check, keys)  # type: ignore[return-value]

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self._do("wait", keys, 0, self._s.wait, keys, timeout)

    def delete_key(self, k: str) -> bool:
        return self._do("delete_key", [k], 0, self._s.delete_key, k)  # type: ignore[return-value]

    def clone(self) -> CountingStore:
        self._counts.add("store clone")
        return CountingStore(self._s.clone(), self._counts, self._keys)


@dataclass(frozen=True)
class Job:
    lo: int
    hi: int
    world: int
    root: str  # a directory or s3://bucket/prefix
    store_port: int | None
    local_dir: str | None
    storage_options: dict | None
    timeout_s: float = 600.0


class Ranks:
    """This process's simulated ranks."""

    def __init__(self, job: Job) -> None:
        import torch.distributed as dist

        import fastckpt

        self.job = job
        self.ops, self.targets, self.store_counts, self.keys = Counts(), Counts(), Counts(), set()
        count_targets(self.targets, job.local_dir is not None)
        store = None
        if job.store_port is not None:
            client = dist.TCPStore("127.0.0.1", job.store_port, job.world, False,
                                   timeout=datetime.timedelta(seconds=job.timeout_s))
            store = CountingStore(client, self.store_counts, self.keys)
        self.published: list[float] = []
        sinks = (self,)
        ops = counting_ops(self.ops)
        self.cks = [fastckpt.Checkpointer(rank=r, world_size=job.world, store=store, local_dir=job.local_dir,
                                          storage_options=job.storage_options, io_threads=1, replicate_workers=1,
                                          commit_timeout_s=job.timeout_s, overhead_budget=0.99, ops=ops,
                                          sinks=sinks if r == 0 else ())
                    for r in range(job.lo, job.hi)]

    def emit(self, event: object) -> None:  # rank 0's EventSink: when its commit published the group
        if event.name == "commit" and event.detail == "group" and event.error is None:  # type: ignore[attr-defined]
            self.published.append(event.end)  # type: ignore[attr-defined]

    def round(self, step: int) -> dict:
        """Every rank saves and commits ``step``; returns the timings and this round's counts."""
        self.ops.take(), self.targets.take(), self.store_counts.take()
        self.keys.clear()
        group = f"{self.job.root}/step{step}"
        calls = []
        for ck in self.cks:
            w_save = time.time()
            h = ck.save({"w": torch.arange(ELEMENTS, dtype=torch.int64) + ck.rank, "step": step},
                        f"{group}/rank{ck.rank:05d}.pt", group=group)
            w_commit = time.time()
            calls.append((w_save, h, w_commit, ck.commit(group, step=step)))
        durable, resolved, cpu0, ops = [], [], None, 0
        for w_save, h, w_commit, c in calls:
            rec, crec = h.wait(self.job.timeout_s), c.wait(self.job.timeout_s)
            durable.append(w_save + rec.durable_s)
            resolved.append(w_commit + crec.durable_s)
            ops += crec.store_ops
            if crec.rank == 0:
                cpu0 = crec.commit_cpu_s
        return {"last_durable": max(durable), "first_commit_call": min(c[2] for c in calls),
                "last_resolved": max(resolved), "published": self.published[-1] if cpu0 is not None else None,
                "rank0_cpu_s": cpu0, "store_ops_self": ops, "ops": self.ops.take(), "targets": self.targets.take(),
                "store": self.store_counts.take(), "keys": sorted(self.keys)}

    def close(self) -> None:
        for ck in self.cks:
            ck.close()


def serve(job: Job, conn: object) -> None:
    """A worker process: build the ranks, then run each round the driver asks for."""
    ranks = Ranks(job)
    conn.send(("ready", job.lo))  # type: ignore[attr-defined]
    while True:
        cmd, step = conn.recv()  # type: ignore[attr-defined]
        if cmd == "stop":
            ranks.close()
            conn.send(("closed", job.lo))  # type: ignore[attr-defined]
            return
        conn.send(("round", ranks.round(step)))  # type: ignore[attr-defined]
