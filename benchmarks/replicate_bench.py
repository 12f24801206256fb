"""Replication benchmark: fastckpt's background replication against plain uploads and copies,
and what replication costs a training loop that runs beside it. One run, one disk, one server.

Run (from the repository root, with the project's venv):

    python benchmarks/replicate_bench.py [--size 512MiB] [--files 2] [--repeat 3] [--warmup 1]
        [--dir ../bench_tmp] [--bg-size 1GiB] [--cap-Bps 200e6 [20e6 ...]] [--steps 150]
        [--only {1,2}] [--json OUT]

The script starts its own SeaweedFS S3 server on 127.0.0.1 (tests/s3server.py, through
benchmarks/_s3.py) with its data under --dir, and removes everything it made (bucket, folders,
the server) when it ends, also on an error, Ctrl-C or SIGTERM. --dir must be a disk, not tmpfs;
the POSIX target is --dir/<run>/target, on the same disk as the local (burst-buffer) directory.
Variants are interleaved; warm-up rounds are dropped; tables show medians. Times are
time.perf_counter seconds; GB/s are decimal (1e9 B/s).

Part 1, replication throughput: the same state (--size, split into --files float32 files).
  fastckpt      Checkpointer(local_dir=...).save(part, dest) for each part; the time is from the
                first local commit (t_save + rec.local_durable_s) to the last verified copy at
                the destination (t_save + rec.durable_s): upload *and* verification (S3: in
                flight, each part's CRC32 checked by the store, then a HEAD; a read-back with
                replicate_verify="readback"; POSIX: an O_DIRECT read-back of each chunk as it is
                written). Its "replicate" events split that into upload/copy (first event's
                start to the last upload's end) and verify (what follows, to the last end).
  s3fs          fs.put([local files], [remote paths]) with default settings (no verification).
  boto3 default upload_file per file, default TransferConfig (8 MiB parts, 10 threads).
  boto3 tuned   upload_file per file, TransferConfig(max_concurrency=8, 16 MiB parts).
  cp + sync     `cp` of the files into the POSIX target, then `sync FILE...` (fsync of each).
  The peers read torch.save files of the same parts, evicted from the page cache first.
  ratio = fastckpt GB/s / best plain GB/s for the same kind of target; target >= 0.9.
  CPU columns: CPU seconds per GB used by this process and its children (the client; for
  fastckpt from its first local commit on), by the weed server, and the share of all CPUs that
  other processes used meanwhile ("other": anything above a few % means a noisy measurement).
Part 2, training-step slowdown: a CPU MLP training step is timed for
  --steps steps with nothing in the background, and for as long as fastckpt replicates a
  --bg-size checkpoint (steps from its local commit until the replica is verified; the step
  that straddles the end is dropped), to S3 and to the POSIX target, uncapped and with
  replicate_bandwidth_Bps=each --cap-Bps. The POSIX rows show fastckpt's own cost; the S3 rows
  add the server's, which shares these CPUs here (and would not in production). Per trial: mean
  step time; table: medians over rounds, and the "quiet" round (least CPU used by other
  processes: interference only ever adds time); target: < 2 % slowdown to S3 with the first cap.
  Layout (--node, the default): the training step runs on one core with one torch thread, as
  the Python thread that drives a GPU does; the S3 server, which in production runs on other
  machines, is confined to another core; fastckpt's threads may run anywhere, so the CPU and
  GIL they take from the step is counted. --no-node lets everything share every core (the
  server then takes CPU from the step, which a training node would not see).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import _s3  # noqa: E402

MiB = 1 << 20
S3_PEERS = ("s3fs", "boto3_default", "boto3_tuned")
LABELS = {"fastckpt_s3": "fastckpt → S3 (commit → verified)", "s3fs": "s3fs fs.put",
          "boto3_default": "boto3 upload_file (default)", "boto3_tuned": "boto3 upload_file (8 thr, 16 MiB)",
          "fastckpt_posix": "fastckpt → POSIX (commit → verified)", "cp_sync": "cp + sync"}


def cpu_now(server: object) -> tuple[float, float, float, float]:
    """(perf_counter, busy CPU s of the whole machine, of this process + reaped children, of weed)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    t = os.times()
    return (time.perf_counter(), (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"),
            t.user + t.system + t.children_user + t.children_system, _s3.server_cpu_s(server))


def cpu_use(a: tuple, b: tuple) -> dict:
    client, server = b[2] - a[2], b[3] - a[3]
    return {"client_cpu_s": client, "server_cpu_s": server, "server_frac": server / ((b[0] - a[0]) * os.cpu_count()),
            "other_frac": max(0.0, b[1] - a[1] - client - server) / ((b[0] - a[0]) * os.cpu_count())}


class Sink:
    """An EventSink that keeps every event and, at each local commit, sets ``committed`` and
    samples the CPU counters (list.append is atomic: no lock needed)."""

    def __init__(self, server: object) -> None:
        self.events: list = []
        self.commit_cpu: list = []
        self.committed = threading.Event()
        self._server = server

    def emit(self, event) -> None:  # noqa: ANN001
        if event.name == "commit":
            self.commit_cpu.append((len(self.events), cpu_now(self._server)))
            self.committed.set()
        self.events.append(event)


def fastckpt_api() -> tuple[type | None, bool, str]:
    """(Checkpointer, whether it replicates to S3 with a bandwidth cap, why not)."""
    try:
        ck = c.import_fastckpt()
    except ImportError as e:
        return None, False, f"fastckpt is not importable ({e})"
    fields = sys.modules["fastckpt"].config.CheckpointerConfig.__dataclass_fields__
    ok = "replicate_bandwidth_Bps" in (*inspect.signature(ck).parameters, *fields)
    return ck, ok, "" if ok else "this fastckpt has no replicate_bandwidth_Bps (S3 replication not landed)"


# ---------------------------------------------------------------- part 1 variants
def run_fastckpt(ctx: dict, ck: object, dest: str) -> dict:
    sink = ctx["sink"]
    mark, handles = len(sink.events), []
    for i, part in enumerate(ctx["parts"]):
        handles.append((time.perf_counter(), ck.save(part, f"{dest}/part{i}.pt")))
    recs = [(t, h.wait()) for t, h in handles]
    if any(r.durable_s is None for _, r in recs):
        raise RuntimeError(f"a save under {dest} was not replicated (superseded or skipped)")
    for _, r in recs:  # make sure the bytes really are at the destination
        size = (ctx["client"].head_object(Bucket=ctx["bucket"], Key=r.path.split("/", 3)[3])["ContentLength"]
                if dest.startswith("s3://") else os.path.getsize(r.path))
        if size != r.bytes:
            raise RuntimeError(f"{r.path} is {size} bytes at the destination, expected {r.bytes}")
    start = min(t + r.local_durable_s for t, r in recs)
    res = {"bytes": sum(r.bytes for _, r in recs), "s": max(t + r.durable_s for t, r in recs) - start,
           "cpu0": next(s for i, s in sink.commit_cpu if i >= mark)}
    # phase windows from the "replicate" events (detail "upload_s=.. verify_s=.." or "copy_s=.. ...")
    ev = [(e, dict(kv.split("=", 1) for kv in (e.detail or "").split() if "=" in kv))
          for e in sink.events[mark:] if e.name == "replicate"]
    if ev and all("verify_s" in d for _, d in ev):
        up_end = max(e.start + float(d.get("upload_s", d.get("copy_s", 0))) for e, d in ev)
        res["upload_s"] = up_end - min(e.start for e, _ in ev)
        res["verify_s"] = max(e.end for e, _ in ev) - up_end
    return res


def run_s3fs(ctx: dict, tag: str) -> dict:
    import s3fs

    fs = s3fs.S3FileSystem(**ctx["server"].storage_options(), skip_instance_cache=True)
    remote = [f"{ctx['bucket']}/{tag}/{p.name}" for p in ctx["src"]]
    t0 = time.perf_counter()
    fs.put([str(p) for p in ctx["src"]], remote)
    return {"bytes": ctx["src_bytes"], "s": time.perf_counter() - t0}


def run_boto3(ctx: dict, tag: str, tuned: bool) -> dict:
    from boto3.s3.transfer import TransferConfig

    tc = TransferConfig(max_concurrency=8, multipart_chunksize=16 * MiB) if tuned else TransferConfig()
    t0 = time.perf_counter()
    for p in ctx["src"]:  # a plain client: botocore's defaults, path-style addressing for a loopback IP
        ctx["plain_client"].upload_file(str(p), ctx["bucket"], f"{tag}/{p.name}", Config=tc)
    return {"bytes": ctx["src_bytes"], "s": time.perf_counter() - t0}


def run_cp_sync(ctx: dict, tag: str) -> dict:
    d = ctx["target"] / tag
    d.mkdir(parents=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", *map(str, ctx["src"]), str(d)], check=True)
    subprocess.run(["sync", *(str(d / p.name) for p in ctx["src"])], check=True)
    return {"bytes": ctx["src_bytes"], "s": time.perf_counter() - t0}


def part1(ctx: dict, args: argparse.Namespace, errors: dict) -> dict[str, list[dict]]:
    s3, posix = ctx["ck_s3"], ctx["ck_posix"]
    variants = {"fastckpt_s3": s3 and (lambda tag: run_fastckpt(ctx, s3, f"s3://{ctx['bucket']}/{tag}")),
                "s3fs": lambda tag: run_s3fs(ctx, tag),
                "boto3_default": lambda tag: run_boto3(ctx, tag, tuned=False),
                "boto3_tuned": lambda tag: run_boto3(ctx, tag, tuned=True),
                "fastckpt_posix": posix and (lambda tag: run_fastckpt(ctx, posix, str(ctx["target"] / tag))),
                "cp_sync": lambda tag: run_cp_sync(ctx, tag)}
    variants = {k: fn for k, fn in variants.items() if fn is not None}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(args.warmup + args.repeat):
        for name, fn in list(variants.items()):
            tag = f"p1-{name}-{r}"
            c.drop_cache(ctx["src"][0].parent)
            try:
                a = cpu_now(ctx["server"])
                res = fn(tag)
                res |= cpu_use(res.pop("cpu0", a), cpu_now(ctx["server"]))
            except Exception as e:  # one broken variant must not cost the others' numbers
                traceback.print_exc()
                errors[name] = f"{type(e).__name__}: {e}"
                del variants[name]
                continue
            finally:
                clean_trial(ctx, tag)
            print(f"  round {r} {name}: {res['s']:.3f} s, {res['bytes'] / res['s'] / c.GB:.3f} GB/s, other CPU "
                  f"{res['other_frac']:.0%}" + (" (warm-up)" if r < args.warmup else ""), file=sys.stderr)
            if r >= args.warmup:
                runs[name].append(res)
    return runs


def clean_trial(ctx: dict, tag: str) -> None:
    _s3.delete_prefix(ctx["client"], ctx["bucket"], f"{tag}/")
    shutil.rmtree(ctx["target"] / tag, ignore_errors=True)


# ---------------------------------------------------------------- part 2
def make_step() -> callable:
    """One training step of a 2-layer MLP (about 1.1 GFLOP forward, x3 with backward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 1024)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    return step


def train_trial(ctx: dict, variant: str, tag: str, steps: int) -> dict:
    """Mean step time: --steps steps (variant "none"), or every step that ran entirely between
    the local commit of a background save and its verified replica."""
    times, h = [], None
    if variant != "none":
        dest = f"s3://{ctx['bucket']}" if ctx["bg"][variant][0] == "s3" else str(ctx["target"])
        ctx["sink"].committed.clear()
        h = ctx["ck_bg"][variant].save(ctx["bg_state"], f"{dest}/{tag}/state.pt")
        if not ctx["sink"].committed.wait(600):  # from the local commit on, only replication runs
            raise TimeoutError("no local commit within 600 s")
    a = cpu_now(ctx["server"])
    if ctx["train_cpus"]:  # this thread only: fastckpt's threads, started elsewhere, stay free
        os.sched_setaffinity(0, ctx["train_cpus"])
    try:
        while len(times) < steps if h is None else not h.done():
            t0 = time.perf_counter()
            ctx["step"]()
            t1 = time.perf_counter()
            if h is None or not h.done():  # a step that straddles the end of replication is not counted
                times.append(t1 - t0)
    finally:
        if ctx["train_cpus"]:
            os.sched_setaffinity(0, ctx["all_cpus"])
    res = {"step_s": sum(times) / len(times) if times else None, "steps": len(times)}
    res |= cpu_use(a, cpu_now(ctx["server"]))
    if h is not None:
        rec = h.wait()
        res["rep_GBps"] = rec.bytes / (rec.durable_s - rec.local_durable_s) / c.GB
    return res


def part2(ctx: dict, args: argparse.Namespace) -> dict[str, list[dict]]:
    ctx["all_cpus"], ctx["train_cpus"] = os.sched_getaffinity(0), None
    if args.node and len(ctx["all_cpus"]) >= 2:
        # A training node: the thread that drives training is one core (on a GPU node it
        # launches kernels; the rest of the host is idle), and the store is on other machines.
        # Here: the step runs on one core with one torch thread, the S3 server is confined to
        # another, and fastckpt's threads may use any core (they compete with both).
        first, last = min(ctx["all_cpus"]), max(ctx["all_cpus"])
        if _s3.pin_server(ctx["server"], {last}):
            torch.set_num_threads(1)
            ctx["train_cpus"] = {first}
            print(f"part 2 layout: training step on CPU {first} (1 torch thread), S3 server on CPU {last}, "
                  "fastckpt's threads on any CPU", file=sys.stderr)
        else:
            print("note: could not pin the S3 server's threads; part 2 runs with the default layout", file=sys.stderr)
    ctx["step"], ctx["bg_state"] = make_step(), c.make_state(c.parse_size(args.bg_size), seed=99)
    for _ in range(5):
        ctx["step"]()  # warm-up: allocator, thread pool
    names = ["none", *ctx["ck_bg"]]
    train: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(args.repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
            res = train_trial(ctx, name, f"bg/r{r}", args.steps)
            clean_trial(ctx, f"bg/r{r}")
            print(f"  train round {r} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in res.items() if v is not None),
                  file=sys.stderr)
            train[name].append(res)
    return train


# ---------------------------------------------------------------- driver
def run(args: argparse.Namespace, root: Path, server: object, ctx: dict) -> dict:
    nbytes = c.parse_size(args.size)
    ctx["parts"] = [c.make_state(nbytes // args.files, seed=i) for i in range(args.files)]
    ctx["src"] = [root / "src" / f"part{i}.pt" for i in range(args.files)]  # the peers' input
    for part, p in zip(ctx["parts"], ctx["src"], strict=True):
        torch.save(part, p)
        c.fsync_path(p)
    ctx["src_bytes"] = sum(p.stat().st_size for p in ctx["src"])
    ck_cls, s3_ok, why = fastckpt_api()

    def checkpointer(name: str, kind: str, **kw: object) -> object:
        (root / "nvme" / name).mkdir(parents=True)
        # saves run back to back here, so the overhead alarm would only add noise
        ck = ck_cls(local_dir=str(root / "nvme" / name), overhead_budget=0.99, sinks=(ctx["sink"],),
                    **({"storage_options": server.storage_options()} if kind == "s3" else {}), **kw)
        ctx["closers"].append(ck)
        return ck

    if ck_cls is not None:  # "all": the parts of one state must all be replicated, none coalesced away
        ctx["ck_posix"] = checkpointer("posix", "posix", **({"replicate_policy": "all"} if s3_ok else {}))
    if s3_ok:
        ctx["ck_s3"] = checkpointer("s3", "s3", replicate_bandwidth_Bps=None, replicate_policy="all")
        caps = enumerate([None, *args.cap_Bps])
        ctx["bg"] = {f"{kind}{i}": (kind, cap) for i, cap in caps for kind in ("s3", "posix")}
        ctx["ck_bg"] = {k: checkpointer(f"bg-{k}", kind, replicate_bandwidth_Bps=cap)
                        for k, (kind, cap) in ctx["bg"].items()}
    else:
        print(f"note: {why}: running the peer rows only", file=sys.stderr)
    print(f"state: {nbytes / MiB:.0f} MiB in {args.files} files; dir {root} on {' '.join(c.mount_of(root))}; "
          f"{os.cpu_count()} CPUs (load {os.getloadavg()[0]:.2f}); torch threads {torch.get_num_threads()}; "
          f"S3 {server.endpoint_url}", file=sys.stderr)
    errors: dict[str, str] = {}
    runs = part1(ctx, args, errors) if args.only != 2 else {}
    if "fastckpt_s3" in errors:
        why = f"fastckpt → S3 failed in part 1 ({errors['fastckpt_s3']})"
    train = part2(ctx, args) if s3_ok and not errors.get("fastckpt_s3") and args.only != 1 else {}
    return {"runs": runs, "train": train, "why": why, "errors": errors, "nbytes": nbytes, "bg": ctx.get("bg"),
            "threads": torch.get_num_threads(), "node": bool(ctx.get("train_cpus"))}


def report(res: dict) -> str:
    runs, out, checks = res["runs"], [], []
    med = {k: {f: c.median([r.get(f) for r in v]) for f in v[0]} for k, v in runs.items() if v}
    gbps = {k: m["bytes"] / m["s"] / c.GB for k, m in med.items()}
    if med:
        n = max(map(len, runs.values()))
        out += [f"### Replication: {res['nbytes'] / MiB:.0f} MiB state, median of {n}", "",
                "| variant | target | bytes | s | GB/s | upload/copy GB/s | verify s | client CPU s/GB "
                "| server CPU s/GB | other CPU |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, m in med.items():
            gb = m["bytes"] / c.GB
            out.append(f"| {LABELS[k]} | {'posix' if k in ('cp_sync', 'fastckpt_posix') else 's3'} | {m['bytes']:,} "
                       f"| {m['s']:.3f} | {gbps[k]:.3f} | {c.fmt(m.get('upload_s') and gb / m['upload_s'])} "
                       f"| {c.fmt(m.get('verify_s'))} | {m['client_cpu_s'] / gb:.2f} | {m['server_cpu_s'] / gb:.2f} "
                       f"| {m['other_frac']:.0%} |")
        best_s3 = max((gbps[k] for k in S3_PEERS if k in gbps), default=None)
        for k, base, what in (("fastckpt_s3", best_s3, "best plain S3 upload"),
                              ("fastckpt_posix", gbps.get("cp_sync"), "cp + sync")):
            if k in gbps and base:
                up = med[k].get("upload_s") and med[k]["bytes"] / med[k]["upload_s"] / c.GB / base
                checks.append((f"{k}: {gbps[k]:.3f} GB/s / {what} {base:.3f} GB/s = {gbps[k] / base:.2f} (>= 0.9; "
                               f"upload/copy only, without the read-back: {c.fmt(up, '.2f')})", gbps[k] / base >= 0.9))
            else:
                checks.append((f"{k} vs {what}: n/a ({res['why'] or 'no data'})", None))
    if res["train"]:
        t = {k: {f: c.median([r.get(f) for r in v]) for f in v[-1]} for k, v in res["train"].items()}
        q = {k: min(v, key=lambda r: r["other_frac"]) for k, v in res["train"].items()}  # least disturbed
        base, qbase = t["none"]["step_s"], q["none"]["step_s"]
        layout = ("training-node layout: the step on one core, the S3 server on another, fastckpt on any"
                  if res.get("node") else "every process on every core")
        out += ["", f"### Training step beside replication ({layout}; {res['threads']} torch threads, "
                f"median of {len(res['train']['none'])} rounds; quiet: the round with the least other CPU)", "",
                "| background | mean step ms | slowdown | other CPU | quiet: step ms | slowdown | other CPU "
                "| steps timed | replication GB/s | S3 server CPU |", "|---" + "|---:" * 9 + "|"]
        for k, m in t.items():
            kind, cap = res["bg"].get(k, (None, None))
            label = "none" if k == "none" else \
                f"fastckpt → {kind.upper()}, {f'cap {cap / 1e6:g} MB/s' if cap else 'uncapped'}"
            out.append(f"| {label} | {m['step_s'] * 1e3:.2f} | {(m['step_s'] / base - 1) * 100:+.1f} % "
                       f"| {m['other_frac']:.0%} | {q[k]['step_s'] * 1e3:.2f} "
                       f"| {(q[k]['step_s'] / qbase - 1) * 100:+.1f} % | {q[k]['other_frac']:.0%} "
                       f"| {m['steps']:.0f} | {c.fmt(m.get('rep_GBps'))} | {m['server_frac']:.0%} |")
        for name, v, b0, other in (("median", t, base, max(t["s31"]["other_frac"], t["none"]["other_frac"])),
                                   ("quiet", q, qbase, max(q["s31"]["other_frac"], q["none"]["other_frac"]))):
            slow = v["s31"]["step_s"] / b0 - 1
            checks.append((f"step slowdown ({name}), S3 with a cap of {res['bg']['s31'][1] / 1e6:g} MB/s: "
                           f"{slow * 100:+.1f} % (< 2 %)" + (f"; noisy: other processes used up to {other:.0%} "
                                                            "of the CPUs" if other > 0.05 else ""), slow < 0.02))
    else:
        checks.append((f"step slowdown with the cap: n/a ({res['why'] or 'part 2 not run'})", None))
    checks += [(f"{k} failed: {e}", False) for k, e in res["errors"].items()]
    out += [""] + [f"{'n/a ' if ok is None else 'PASS' if ok else 'MISS'} {text}" for text, ok in checks]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="512MiB", help="part 1 state size")
    p.add_argument("--files", type=int, default=2, help="files the part 1 state is split into")
    p.add_argument("--repeat", type=int, default=3, help="measured rounds")
    p.add_argument("--warmup", type=int, default=1, help="discarded part 1 rounds first")
    p.add_argument("--dir", type=Path, default=c.REPO.parent / "bench_tmp", help="a folder on the disk under test")
    p.add_argument("--bg-size", default="1GiB", help="part 2 checkpoint size")
    p.add_argument("--cap-Bps", type=float, nargs="+", default=[200e6], help="part 2 caps; the first is checked")
    p.add_argument("--steps", type=int, default=150, help="part 2 steps timed without replication")
    p.add_argument("--node", action=argparse.BooleanOptionalAction, default=True,
                   help="part 2 on a training-node layout: the step on one core and one torch thread, the S3 "
                        "server on another core, fastckpt free (--no-node: everything shares every core)")
    p.add_argument("--only", type=int, choices=(1, 2), help="run only this part")
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = p.parse_args(argv)

    def on_term(*_: object) -> None:
        raise KeyboardInterrupt  # so that the cleanup below runs
    signal.signal(signal.SIGTERM, on_term)
    root = args.dir.resolve() / f"replicate-{uuid.uuid4().hex[:8]}"
    (root / "src").mkdir(parents=True)
    (root / "target").mkdir()
    cwd = os.getcwd()
    os.chdir(root)  # anything written to a relative path by mistake lands here and is removed
    ctx: dict = {"target": root / "target", "closers": [], "ck_posix": None, "ck_s3": None}
    try:
        with _s3.seaweed(root / "weed") as server:
            ctx |= {"server": server, "client": _s3.client(server), "plain_client": _s3.client(server, plain=True),
                    "sink": Sink(server)}
            ctx["bucket"] = server.make_bucket("bench")
            try:
                res = run(args, root, server, ctx)
            finally:  # a failed clean-up is reported, and costs neither the results nor the run's own error
                for what, fn in [*((f"close {ck!r}", ck.close) for ck in ctx["closers"]),
                                 ("delete the bucket", lambda: _s3.delete_bucket(ctx["client"], ctx["bucket"]))]:
                    try:
                        fn()
                    except Exception as e:  # noqa: BLE001
                        print(f"warning: could not {what}: {e!r}", file=sys.stderr)
    finally:
        os.chdir(cwd)
        shutil.rmtree(root, ignore_errors=True)
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
