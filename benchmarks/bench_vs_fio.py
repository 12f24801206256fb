"""`fastckpt bench` against fio: the same directory and settings, in one invocation.

Run (from the repository root, with the project's venv; fio must be on PATH):

    python benchmarks/bench_vs_fio.py --dir ../bench_tmp [--workers 4] [--block-size 8MiB]
        [--size 1GiB] [--repeat 3] [--engine threads] [--json OUT]

Each round runs `fastckpt bench --mode both --direct` and fio's matching jobs, alternating
which goes first: `--numjobs=W --bs=B --size=S --direct=1 --ioengine=psync` (one blocking
pwrite/pread per block, as fastckpt's workers do), `--rw=write --end_fsync=1`, then
`--rw=read` on the files just written, `--group_reporting` for the aggregate. Both report
decimal GB/s (1e9 B/s) of all workers together. The table shows medians over the rounds and
the ratio fastckpt / fio; the target is within 10 % (ratio >= 0.9). Exit 1 when a ratio
misses it. Every file either tool writes is removed, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import GB, fio_available, median, mount_of

TARGET = 0.9


def fastckpt_bench(d: Path, a: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "fastckpt.cli", "bench", "--dir", str(d), "--workers", str(a.workers),
           "--block-size", a.block_size, "--size", a.size, "--mode", "both", "--direct", "--engine", a.engine, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"fastckpt bench failed ({out.returncode}):\n{out.stderr}")
    data = json.loads(out.stdout)
    return {"write": data["write_Bps"], "read": data["read_Bps"]}


def fio(d: Path, a: argparse.Namespace) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="fio-", dir=d))
    common = ["fio", "--name=fastckpt_vs_fio", f"--directory={work}", f"--numjobs={a.workers}",
              f"--bs={a.block_size.replace('iB', '')}", f"--size={a.size.replace('iB', '')}", "--direct=1",
              "--ioengine=psync", "--group_reporting", "--output-format=json"]
    try:
        res = {}
        for rw, extra in (("write", ["--end_fsync=1"]), ("read", [])):
            out = subprocess.run([*common, f"--rw={rw}", *extra], capture_output=True, text=True, check=True).stdout
            job = json.loads(out[out.index("{"):])["jobs"][0]
            if job["error"]:
                raise OSError(job["error"], f"fio {rw} in {work} failed")
            res[rw] = float(job[rw]["bw_bytes"])
        return res
    finally:
        shutil.rmtree(work)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="a directory on the storage to test (not tmpfs)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--block-size", default="8MiB", help="K/M/G with iB (fio reads 8M as 8 MiB)")
    ap.add_argument("--size", default="1GiB", help="per worker")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engine", choices=["threads", "processes"], default="threads")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if not fio_available():
        print("fio is not on PATH: install it (Debian/Ubuntu: apt-get install -y fio)", file=sys.stderr)
        return 2
    a.dir.mkdir(parents=True, exist_ok=True)
    mnt, fstype = mount_of(a.dir)
    print(f"# {a.dir} on {mnt} ({fstype}); {a.workers} workers x {a.size}, {a.block_size} blocks, O_DIRECT, "
          f"{a.repeat} rounds, fastckpt on {a.engine}")
    runs: dict[str, dict[str, list[float]]] = {"fastckpt": {"write": [], "read": []}, "fio": {"write": [], "read": []}}
    for i in range(a.repeat):
        order = [("fastckpt", fastckpt_bench), ("fio", fio)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            for op, bps in fn(a.dir, a).items():
                runs[name][op].append(bps)
        print(f"round {i + 1}: " + ", ".join(f"{n} {op} {runs[n][op][-1] / GB:.2f}" for n in runs for op in runs[n]))
    rows, ok = [], True
    print("\n| op | fastckpt bench GB/s | fio psync GB/s | ratio | target | result |\n|---|---:|---:|---:|---:|---|")
    for op in ("write", "read"):
        f, r = median(runs["fastckpt"][op]), median(runs["fio"][op])
        ratio = f / r
        ok &= ratio >= TARGET
        rows.append({"op": op, "fastckpt_Bps": f, "fio_Bps": r, "ratio": ratio})
        verdict = "PASS" if ratio >= TARGET else "MISS"
        print(f"| {op} | {f / GB:.2f} | {r / GB:.2f} | {ratio:.2f} | >= {TARGET} | {verdict} |")
    if a.json:
        a.json.write_text(json.dumps({"settings": vars(a) | {"dir": str(a.dir), "json": str(a.json)}, "runs": runs,
                                      "rows": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
