"""The drill's built-in training job, and the restore probe used for a user's own job.

Run as ``python -m fastckpt.cli.drill_job --dir HOME [--local-dir BB] ...``. On start it
restores the newest complete checkpoint under HOME (through a Checkpointer, so the burst
buffer copy is preferred when there is one), checks every tensor against what that step must
hold, then trains: each step adds 1 to every tensor in place (as an optimizer step mutates
weights while the previous save is still being written), and every ``--every`` steps saves
a group ``HOME/step-NNNNNNNN`` of two files (model.pt, optim.pt) and commits it with its step.
The state at step s is ``base + s``, with ``base`` drawn from ``--seed``, so any loaded
checkpoint can be checked exactly.

With ``--probe`` it only restores (any fastckpt checkpoint: every file of the newest one is
loaded and checksum-verified, and unpickled whole, with ``weights_only=False``, as the user's job
that wrote it resumes: numpy RNG states and the like too) and exits: the drill's stand-in for a
user job's restore.

It reports on stdout, one JSON object per line, flushed (the drill reads them):
``loaded`` (state in memory: t = wall time), ``restored`` (step, path, source, verified,
error) or ``fresh``, then ``step`` after each step, ``save`` before a save's calls, ``saved``
after they returned (the snapshot is taken), ``durable`` once the group is committed at HOME.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import threading
import time
from collections.abc import Callable

import torch

import fastckpt
from fastckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, FastCkptError, IncompleteCheckpointError

from ._checkfile import check_whole
from ._common import parse_duration, parse_size
from ._discovery import NotFastckpt, checkpoint_files, homes, step_of

FILES = {"model.pt": 1, "optim.pt": 3}  # shares of the state: weights, and master + Adam moments
TENSORS_PER_FILE = 2
_out_lock = threading.Lock()


def say(ev: str, **fields: object) -> None:
    line = json.dumps({"ev": ev, **fields}, sort_keys=True)
    with _out_lock:  # commit watchers print from their own threads
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def make_base(nbytes: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """The step-0 tensors of each file: int32, so ``base + s`` is exact for any step."""
    gen = torch.Generator().manual_seed(seed)
    total_share = sum(FILES.values())
    base: dict[str, list[torch.Tensor]] = {}
    for name, share in FILES.items():
        n = max(1024, nbytes * share // total_share // 4 // TENSORS_PER_FILE)
        base[name] = [torch.randint(-(2**30), 2**30, (n,), dtype=torch.int32, generator=gen)
                      for _ in range(TENSORS_PER_FILE)]
    return base


def group_path(home: str, step: int) -> str:
    return f"{home.rstrip('/')}/step-{step:08d}"


def _mismatch(state: dict[str, dict], base: dict[str, list[torch.Tensor]], step: int) -> str | None:
    """None when every file holds exactly ``base + step``; else what differs."""
    for name, tensors in base.items():
        got = state[name]
        if got.get("step") != step:
            return f"{name} records step {got.get('step')}, expected {step}"
        for i, t in enumerate(tensors):
            if not torch.equal(got["tensors"][i].cpu(), t + step):
                return f"{name} tensor {i} does not hold the state of step {step}"
    return None


def restore(ck: fastckpt.Checkpointer, home: str, base: Callable[[], dict[str, list[torch.Tensor]]] | None,
            opts: dict | None, weights_only: bool = True) -> tuple[int, dict[str, dict] | None]:
    """Load every file of the newest complete checkpoint (verified by ``load``); report
    ``loaded`` and ``restored`` (or ``fresh``); with ``base``, check the content exactly
    against the state it builds, only after ``loaded``: the drill's RTO ends at that line, and
    building the synthetic state (seconds per GiB) is no part of a restore.

    Returns the step restored (0 when fresh, -1 when the restore failed) and the loaded
    files by name. ``weights_only=False`` (the probe, on what the user's own job saved) unpickles
    any object; one this process cannot rebuild (a class of the job's script) fails the restore
    naming the probe, never as damage.
    """
    path = ck.latest(home)
    if path is None:
        say("fresh", t=time.time())
        return 0, None
    loaded: dict[str, object] = {}
    try:
        h = homes(opts)
        try:
            files, manifest = checkpoint_files(h, path)
            for spec in files:
                if spec.whole:  # a framework's own file (megatron's metadata.json): read whole and checked
                    if (why := check_whole(h, spec)) is not None:  # against the group's checksum, as verify does
                        raise CorruptCheckpointError(f"{spec.path}: {why}")
                    continue
                loaded[spec.path.rsplit("/", 1)[-1]] = ck.load(spec.path, map_location="cpu",
                                                               weights_only=weights_only)
        finally:
            h.close()
    except (pickle.UnpicklingError, ImportError, AttributeError) as exc:  # verified intact: the probe cannot
        say("loaded", t=time.time(), path=path)                            # rebuild an object it holds
        say("restored", step=None, path=path, source=None, verified=False, corrupt=False, error=(
            f"the drill's restore probe could not unpickle {path} ({type(exc).__name__}: {exc}): it loads in its "
            "own process (python -m fastckpt.cli.drill_job), so the classes the checkpoint holds must be importable "
            "there: define them in a module on PYTHONPATH, not in the job's script"))
        return -1, None
    except (FastCkptError, OSError, ValueError) as exc:
        say("loaded", t=time.time(), path=path)
        # latest() named it complete: damaged or partial content behind it is a corrupt load
        # (a file of it gone: partial; one fastckpt did not write is not corrupt, only unverifiable)
        corrupt = isinstance(exc, (CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError))
        foreign = "" if not isinstance(exc, NotFastckpt) else (
            " (the drill restores and verifies checkpoints fastckpt wrote: save through fastckpt, docs/migration.md)")
        say("restored", step=None, path=path, source=None, verified=False, corrupt=corrupt,
            error=f"{type(exc).__name__}: {exc}{foreign}")
        return -1, None
    say("loaded", t=time.time(), path=path)
    source = ck.stats().last_restore_from
    step = step_of(manifest, loaded)
    error = None
    if base is not None:
        if step is None or sorted(loaded) != sorted(FILES):
            error = f"the checkpoint holds {sorted(loaded)} with step {step}, not this drill's files"
        else:
            error = _mismatch(loaded, base(), step)
    say("restored", step=step, path=path, source=source, verified=error is None, corrupt=error is not None,
        error=error)
    return (step if error is None and step is not None else -1), loaded


def train(ck: fastckpt.Checkpointer, args: argparse.Namespace, state: dict[str, list[torch.Tensor]],
          step: int) -> None:
    """Forever: one in-place update per step, a group save every ``args.every`` steps."""
    def watch(handle: fastckpt.SaveHandle, s: int) -> None:
        try:
            rec = handle.wait()
        except (FastCkptError, OSError) as exc:  # reported to the drill, which counts it against the run
            say("save_failed", step=s, error=f"{type(exc).__name__}: {exc}")
            return
        if not rec.superseded:
            say("durable", step=s, t=time.time())

    while True:
        step += 1
        for tensors in state.values():
            for t in tensors:
                t.add_(1)
        time.sleep(args.step_time)  # the forward and backward pass
        say("step", step=step)
        if step % args.every:
            continue
        group = group_path(args.dir, step)
        say("save", step=step, t=time.time())
        for name, tensors in state.items():
            ck.save({"tensors": tensors, "step": step}, f"{group}/{name}", group=group)
        handle = ck.commit(group, step=step)
        say("saved", step=step, t=time.time())
        threading.Thread(target=watch, args=(handle, step), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastckpt.cli.drill_job")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--local-dir")
    ap.add_argument("--state-size", type=parse_size, default=parse_size("256MiB"))
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-time", type=parse_duration, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--event-log")
    ap.add_argument("--storage-options", type=json.loads)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--probe", action="store_true")
    args = ap.parse_args(argv)
    keep = {"keep_local": 2} if args.local_dir else {}
    with fastckpt.Checkpointer(local_dir=args.local_dir, event_log=args.event_log, overhead_budget=0.99,
                               storage_options=args.storage_options, keep_persistent=3, **keep) as ck:
        if args.probe:
            step, _ = restore(ck, args.dir, None, args.storage_options, weights_only=False)
            return 0 if step >= 0 else 3
        step, loaded = restore(ck, args.dir, lambda: make_base(args.state_size, args.seed), args.storage_options)
        if step < 0:
            return 3
        if loaded is None:  # fresh: step 0 holds the base itself
            state = make_base(args.state_size, args.seed)
        else:
            state = {name: list(loaded[name]["tensors"]) for name in FILES}
        if args.device != "cpu":
            state = {name: [t.to(args.device) for t in ts] for name, ts in state.items()}
        train(ck, args, state, step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
