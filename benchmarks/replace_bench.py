"""Saving over the last checkpoint: the time to durable when a save replaces a file.

Run (from the repository root, with the project's venv):

    python benchmarks/replace_bench.py [--size 1GiB] [--repeat 5] [--dir DIR] [--local-dir DIR]

A loop that saves one name again and again (``last.pt``, Lightning's ``save_last``, and the
burst-buffer copy of every file saved again) replaces a file of the state's size at each save,
and the old file has to be freed. On some file systems that is slow: ext4 mounted with
``discard`` frees a 1 GiB file in a few tenths of a second. Variants, interleaved round by
round, one Checkpointer with default settings:

  new name    a fastckpt save to a name not used before: nothing to free
  same name   a fastckpt save to the name of the round before: one file freed per save
  fio         fio's O_DIRECT write of the same bytes, with a final fsync (the device limit)
  unlink      removing a file of the same size, alone: what freeing one costs on this disk

*durable* is until ``handle.wait()`` returns. Between variants the Checkpointer is waited for
(``wait()``, untimed), so a removal never runs into the next variant's write. With
``--local-dir`` both copies are replaced (the burst buffer's and the one at --dir). Target:
same name <= 1.05 x new name (freeing the old file is off the path to durable).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import _common as c


def mount_options(path: Path) -> str:
    mnt, _ = c.mount_of(path)
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[1] == mnt:
                return fields[3]
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=c.REPO.parent / "bench_tmp")
    ap.add_argument("--local-dir", default=None, help="a burst buffer (both copies are then replaced)")
    args = ap.parse_args()
    Checkpointer = c.import_fastckpt()
    nbytes = c.parse_size(args.size)
    state = c.make_state(nbytes)
    d = args.dir / "replace_bench"
    d.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {k: [] for k in ("new name", "same name", "fio", "unlink")}
    with Checkpointer(local_dir=args.local_dir) as ck:
        ck.save(state, str(d / "same.pt")).wait()  # the file the first measured save replaces
        for r in range(args.warmup + args.repeat):
            row = {}
            for name in ("new name", "same name"):
                path = d / (f"new{r}.pt" if name == "new name" else "same.pt")
                t0 = time.perf_counter()
                ck.save(state, str(path)).wait()
                row[name] = time.perf_counter() - t0
                ck.wait()  # the replaced file's removal, untimed
                if name == "new name":
                    ck.remove(str(path))
            row["fio"] = c.fio_seconds(d / "fio.dat", nbytes, "write")
            victim = d / "fio.dat"
            t0 = time.perf_counter()
            os.unlink(victim)
            c.fsync_path(d)
            row["unlink"] = time.perf_counter() - t0
            label = "warm-up" if r < args.warmup else f"round {r - args.warmup + 1}/{args.repeat}"
            print(label, " ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
            if r >= args.warmup:
                for k, v in row.items():
                    times[k].append(v)
        ck.remove(str(d / "same.pt"))
    med = {k: c.median(v) for k, v in times.items()}
    mnt, fstype = c.mount_of(d)
    print(f"\n## replacing the last checkpoint, {nbytes / 2**30:.3f} GiB, median of {args.repeat}, "
          f"{fstype} at {mnt} ({mount_options(d)}){', burst buffer ' + args.local_dir if args.local_dir else ''}\n")
    print("| variant | durable s |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {c.fmt(v)} |")
    ratio = med["same name"] / med["new name"]
    print(f"\n| target | ratio | bound | result |\n|---|---:|---:|---|\n| same name <= 1.05 x new name | "
          f"{ratio:.2f} | <= 1.05 | {'PASS' if ratio <= 1.05 else 'MISS'} |")
    print(f"| new name / fio O_DIRECT write | {med['new name'] / med['fio']:.2f} | (for scale) | — |")


if __name__ == "__main__":
    sys.exit(main())
