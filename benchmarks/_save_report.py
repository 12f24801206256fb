"""Tables, targets and the scaling plot of ``save_bench.py``."""

from __future__ import annotations

from pathlib import Path

import _common as c
from _save_variants import VARIANTS

CACHED_FACTOR = 1.5  # restore faster than this times fio's O_DIRECT read: "cached?"
KEYS = ("blocked_s", "durable_s", "local_durable_s", "written_s", "restore_s", "restore_cached_s", "restore_fresh_s",
        "restore_mmap_s", "restore_into_s", "file_bytes", "rss_growth_bytes")


def medians(runs: list[dict]) -> dict:
    return {k: c.median([r.get(k) for r in runs]) for k in KEYS}


def table(nbytes: int, runs: dict[str, list[dict]], med: dict[str, dict]) -> str:
    fio_read = med.get("fio", {}).get("restore_s")
    lines = ["| variant | blocked s | durable/total s | restore s | cached restore s | cached, new process s "
             "| save GB/s | restore GB/s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (label, _) in VARIANTS.items():
        if name not in med:
            continue
        m = med[name]
        save = m["durable_s"] or m["blocked_s"]  # memcpy: the copy rate
        restore = c.fmt(m["restore_s"])
        if fio_read and name != "fio" and m["restore_s"]:
            n = sum(1 for r in runs[name] if r.get("restore_s") and r["restore_s"] * CACHED_FACTOR < fio_read)
            if n:
                restore += f" cached? ({n}/{len(runs[name])})"
        durable = c.fmt(m["durable_s"])
        if m.get("local_durable_s"):
            durable += f" (local {c.fmt(m['local_durable_s'])})"
        lines.append(f"| {label} | {c.fmt(m['blocked_s'])} | {durable} | {restore} | {c.fmt(m['restore_cached_s'])} "
                     f"| {c.fmt(m['restore_fresh_s'])} | {c.fmt(save and nbytes / save / c.GB, '.2f')} "
                     f"| {c.fmt(m['restore_s'] and nbytes / m['restore_s'] / c.GB, '.2f')} |")
    return "\n".join(lines)


def targets(med: dict[str, dict], mode: str, staging: int | None, striped: bool) -> list[dict]:
    """fastckpt's medians against the issues' targets, one dict per target."""
    get = lambda v, k: med.get(v, {}).get(k)  # noqa: E731
    fc = lambda k: get("fastckpt", k)  # noqa: E731
    durable = fc("local_durable_s") if striped else fc("durable_s")
    what = "local durable" if striped else "durable"
    # each ratio is fastckpt / base, to stay <= bound
    if mode == "small":
        specs = [("file size <= 1.1 x torch.save's", fc("file_bytes"), get("torch", "file_bytes"), 1.10),
                 ("blocked <= torch.save's", fc("blocked_s"), get("torch", "blocked_s"), 1.00),
                 ("cached restore <= torch.load (cached)", fc("restore_cached_s"), get("torch", "restore_cached_s"),
                  1.00)]
    else:
        specs = [("blocked <= 1.05 x memcpy floor", fc("blocked_s"), get("memcpy", "blocked_s"), 1.05),
                 ("blocked <= DCP async_save blocked", fc("blocked_s"), get("dcp", "blocked_s"), 1.00),
                 (f"{what} <= 1.1 x fio O_DIRECT write", durable, get("fio", "durable_s"), 1.10),
                 ("restore (verified) <= 1.1 x fio O_DIRECT read", fc("restore_s"), get("fio", "restore_s"), 1.10),
                 ("restore into existing tensors (verified) <= 1.1 x fio O_DIRECT read", fc("restore_into_s"),
                  get("fio", "restore_s"), 1.10),
                 ("cached restore, new process <= torch.load's", fc("restore_fresh_s"),
                  get("torch", "restore_fresh_s"), 1.00),
                 ("cached restore, same process (2nd load) <= torch.load's", fc("restore_cached_s"),
                  get("torch", "restore_cached_s"), 1.00),
                 ("durable <= 0.5 x DCP async_save total", fc("durable_s"), get("dcp", "durable_s"), 0.50)]
    specs.append(("memory: RSS growth <= staging buffers + 5 % + 64 MiB", fc("rss_growth_bytes"),
                  staging and staging * 1.05 + (64 << 20), 1.00))
    out = []
    for name, value, base, bound in specs:
        if value is None or not base:
            continue
        ratio = value / base
        out.append({"target": name, "value": value, "base": base, "ratio": ratio, "bound": bound,
                    "result": "PASS" if ratio <= bound else "MISS"})
    return out


def _section(res: dict, s: dict) -> list[str]:
    gib = s["size_bytes"] / 2**30
    lines = [f"## save/restore, {gib:.3f} GiB ({s['tensors']} tensors), median of {res['repeat']}, "
             f"{res['fstype']} at {res['mount']}, {res['cpus']} CPUs", "",
             table(s["size_bytes"], s["runs"], s["medians"]), ""]
    recs = [r["record"] for r in s["runs"].get("fastckpt", []) if r.get("record")]
    if recs:  # what fastckpt says about itself, to check against what the clock said
        lines.append(f"fastckpt: tier {recs[-1]['tier']}, O_DIRECT {recs[-1]['odirect']}, file bytes "
                     f"{c.fmt(s['medians']['fastckpt']['file_bytes'], '.0f')}, staging buffers "
                     f"{c.fmt(s['staging_bytes'], '.0f')} bytes, RSS growth "
                     f"{c.fmt(s['medians']['fastckpt']['rss_growth_bytes'], '.0f')} bytes; restored state equal: "
                     f"{all(r['verified'] for r in s['runs']['fastckpt'])}.")
        into = s["medians"]["fastckpt"].get("restore_into_s")
        if into is not None:
            lines.append("fastckpt restore into existing tensors (load(..., into=...), the first restore's, page "
                         f"cache dropped; verified): {c.fmt(into)} s.")
        mapped = s["medians"]["fastckpt"].get("restore_mmap_s")
        if mapped is not None:
            lines.append("fastckpt cached restore with load(..., mmap=True) (verified, zero-copy): "
                         f"{c.fmt(mapped)} s.")
    for d in s.get("local_dir_stats", []):
        bw = d["bandwidth_Bps"]
        lines.append(f"burst-buffer directory {d['path']}: {d['files']} files, {d['bytes'] / 1e9:.2f} GB, "
                     f"{c.fmt(bw and bw / c.GB, '.2f')} GB/s while writing")
    if "torch" in s["medians"] and "fio" in s["medians"]:
        lines.append("torch.save is synchronous: blocked = durable, flush + fsync included. DCP: FileSystemWriter "
                     "defaults (fsync on, 1 IO thread); dcp.load reads into preallocated tensors.")
    lines += ["", "| target | ratio | bound | result |", "|---|---:|---:|---|"]
    lines += [f"| {t['target']} | {t['ratio']:.2f} | <= {t['bound']:.2f} | {t['result']} |" for t in s["targets"]]
    for name, err in s["errors"].items():
        lines.append(f"\n{name} FAILED: {err.strip().splitlines()[-1]}")
    return lines


def curve(res: dict) -> list[str]:
    """The scaling table: seconds and seconds per GiB at each size."""
    lines = ["## scaling", "", "| size | memcpy s | blocked s | durable s | fio write s | restore s | restore into s "
             "| fio read s | blocked s/GiB | durable s/GiB | restore s/GiB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in res["sections"]:
        m, gib = s["medians"], s["size_bytes"] / 2**30
        fc, fio = m.get("fastckpt", {}), m.get("fio", {})
        per = [c.fmt(fc.get(k) and fc[k] / gib) for k in ("blocked_s", "durable_s", "restore_s")]
        lines.append(f"| {s['size_bytes'] / 2**20:.0f} MiB | {c.fmt(m.get('memcpy', {}).get('blocked_s'))} "
                     f"| {c.fmt(fc.get('blocked_s'))} | {c.fmt(fc.get('durable_s'))} | {c.fmt(fio.get('durable_s'))} "
                     f"| {c.fmt(fc.get('restore_s'))} | {c.fmt(fc.get('restore_into_s'))} "
                     f"| {c.fmt(fio.get('restore_s'))} | {' | '.join(per)} |")
    return lines


def report(res: dict) -> str:
    lines: list[str] = []
    if res["mode"] == "scaling":
        lines += curve(res) + [""]
    for s in res["sections"]:
        lines += _section(res, s) + [""]
    if res["loadavg_5min"] > 0.5 * (res["cpus"] or 1):  # others' work shows up in every column
        lines.append(f"warning: the machine was busy (5-min load average {res['loadavg_5min']:.2f} on "
                     f"{res['cpus']} CPUs): numbers are noisy; rerun on an idle machine.")
    if not res["drop_caches_accepted"]:
        lines.append("drop_caches was refused: restores relied on POSIX_FADV_DONTNEED only.")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Seconds against size (log-log) for fastckpt's blocked, durable and restore, with the
    memcpy floor and fio: straight, parallel lines are linear scaling."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    sizes = [s["size_bytes"] / 2**30 for s in res["sections"]]
    series = [("fastckpt blocked", "fastckpt", "blocked_s", "-o"), ("memcpy floor", "memcpy", "blocked_s", ":o"),
              ("fastckpt durable", "fastckpt", "durable_s", "-s"), ("fio O_DIRECT write", "fio", "durable_s", ":s"),
              ("fastckpt restore", "fastckpt", "restore_s", "-^"), ("fio O_DIRECT read", "fio", "restore_s", ":^"),
              ("fastckpt restore into existing tensors", "fastckpt", "restore_into_s", "--v")]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, variant, key, style in series:
        ys = [s["medians"].get(variant, {}).get(key) for s in res["sections"]]
        if all(y is not None for y in ys):
            ax.plot(sizes, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("state size (GiB)")
    ax.set_ylabel("seconds (median)")
    ax.set_title("fastckpt scaling (benchmarks/save_bench.py --sizes)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
