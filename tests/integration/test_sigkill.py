"""SIGKILL a process that is saving, at random moments, and check what a restart finds.

The child (``_kill_child.py``) saves step-numbered states to the same path and to step-named
paths and reports each step on stdout before its saves, while they are in flight, and once
they are durable. The parent kills it after a random number of durable steps, at a random
line: right before a save (snapshot, planning), while writes are in flight, or just after a
step became durable. Then ``fastckpt.latest`` must name a complete checkpoint whose content
is exactly the state of the step it records, no older than the last step reported durable;
every visible file must load; and the next round runs over the stray temp files the killed
process left behind. In "lockstep" rounds the child announces each file operation and waits
for the parent, which kills it before a randomly chosen one (mid-write, before an fsync,
between a rename and the directory fsync...). Rounds alternate between the direct tier and
the nvme (burst buffer) tier. ``FASTCKPT_SIGKILL_SEED=N`` draws other kill points.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

import fastckpt
from fastckpt.io.atomic import TMP_TAG
from tests.integration._kill_child import make_state

CHILD = os.path.join(os.path.dirname(__file__), "_kill_child.py")
SEED = int(os.environ.get("FASTCKPT_SIGKILL_SEED", "20240611"))  # set it to explore other kill points
LINE_TIMEOUT_S = 60.0
_STEP_FILE = re.compile(r"step-(\d{6})\.pt")


def _equal_state(got: object, step: int) -> bool:
    want = make_state(step)
    return (isinstance(got, dict) and got["step"] == step and got["optim"][1] == want["optim"][1]
            and torch.equal(got["model"]["w"], want["model"]["w"])
            and torch.equal(got["model"]["b"], want["model"]["b"])
            and torch.equal(got["optim"][0], want["optim"][0]))


class _Child:
    """The child process and a thread that forwards its stdout lines to a queue."""

    def __init__(self, args: list[str], stderr_path: str) -> None:
        self._stderr = open(stderr_path, "wb")  # noqa: SIM115 (closed in kill_and_drain())
        self._stderr_path = stderr_path
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, CHILD, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self) -> str:
        line = self.lines.get(timeout=LINE_TIMEOUT_S)
        if line is None:
            self.proc.wait()
            with open(self._stderr_path, encoding="utf-8", errors="replace") as f:
                raise AssertionError(f"child exited with {self.proc.returncode} before it was killed:\n{f.read()}")
        self.seen.append(line)
        return line

    def proceed(self) -> None:
        """Let a --lockstep child run the operation it announced."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def kill_and_drain(self) -> list[str]:
        """SIGKILL now; return every line the child printed (it printed them before dying)."""
        if self.proc.poll() is None:  # it may have died on its own (reported by next_line)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=LINE_TIMEOUT_S)
        while not self.lines.empty():
            line = self.lines.get_nowait()
            if line is not None:
                self.seen.append(line)
        self._stderr.close()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        return self.seen


def _load(path: str, why: str) -> dict:
    try:
        return fastckpt.load(path)
    except Exception as exc:  # noqa: BLE001 (re-raised as the test's failure, with the round's story)
        raise AssertionError(f"{why}: {path} does not load: {exc!r}") from exc


def _durable_steps(lines: list[str]) -> list[int]:
    return [int(x.split()[1]) for x in lines if x.startswith("durable ")]


def _check_directory(d: str, last_durable: int, local_dir: str | None, why: str) -> None:
    found = fastckpt.latest(d)
    assert found is not None, f"{why}: latest() found nothing although step {last_durable} was durable"
    assert TMP_TAG not in found and not os.path.basename(found).startswith("."), why
    obj = _load(found, why)
    step = obj["step"]
    assert _equal_state(obj, step), f"{why}: {found} does not hold the state of step {step}"
    assert step >= last_durable, f"{why}: latest() is step {step}, older than durable step {last_durable}"
    # Every visible file is a complete checkpoint of the step it records; step files of their name.
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if name.startswith("."):
            assert TMP_TAG in name, f"{why}: unexpected hidden file {name}"
            continue
        got = _load(path, why)
        assert _equal_state(got, got["step"]), f"{why}: {path} is not the state of step {got['step']}"
        m = _STEP_FILE.fullmatch(name)
        if m:
            assert got["step"] == int(m.group(1)), f"{why}: {name} holds step {got['step']}"
        else:
            assert name == "last.pt", f"{why}: unexpected file {name}"
            assert got["step"] >= last_durable, f"{why}: last.pt is step {got['step']} < {last_durable}"
    if local_dir is not None and os.path.exists(os.path.join(d, "last.pt")):
        # A restart with the burst buffer: its copy may be newer than the path (killed while
        # replicating); load(path) must still return what is at the path.
        with fastckpt.Checkpointer(local_dir=local_dir) as ck:
            at_path = _load(os.path.join(d, "last.pt"), why)["step"]
            assert ck.load(os.path.join(d, "last.pt"))["step"] == at_path, why


# (tier, mode) per round. "free": the child runs at full speed and is killed right after a
# line (before a save, while its writes are in flight, or after a step became durable).
# "lockstep": the child announces every file operation and waits; it is killed before one.
ROUNDS = [("direct", "free"), ("nvme", "lockstep"), ("direct", "lockstep"), ("nvme", "free"),
          ("direct", "lockstep"), ("nvme", "lockstep")]


def test_sigkill_at_random_moments_leaves_a_loadable_latest(tmp_path) -> None:
    rng = random.Random(SEED)
    d = str(tmp_path / "ckpt")
    local = str(tmp_path / "nvme")
    os.makedirs(d)
    hit_write = False  # some kill left a temp file: it landed between a file's creation and its rename
    for rnd, (tier, mode) in enumerate(ROUNDS):
        local_dir = local if tier == "nvme" else None
        first = rnd * 1000 + 1
        want_durable = rng.randint(1, 4)
        kill_after = rng.choice(["saving", "writing", "durable"]) if mode == "free" else "op "
        extra = rng.randint(kill_after != "durable", 2) if mode == "free" else rng.randint(1, 40)
        if rnd == len(ROUNDS) - 1 and not hit_write:
            kill_after, extra = "op pwrite", 1  # no kill so far hit a write in flight: this one does
        why = (f"seed={SEED} round={rnd} tier={tier} mode={mode}: kill after {want_durable} durable "
               f"steps and {extra} more {kill_after.strip()!r} line(s)")
        args = [d, str(first)] + (["--local-dir", local_dir] if local_dir else [])
        child = _Child(args + (["--lockstep"] if mode == "lockstep" else []),
                       str(tmp_path / f"child-{rnd}.stderr"))
        try:
            durable, more = 0, 0
            while True:
                line = child.next_line()
                more += durable >= want_durable and line.startswith(kill_after)
                durable += line.startswith("durable ")
                if durable >= want_durable and more >= extra:
                    break  # kill now (a --lockstep child is waiting before the announced op)
                if line.startswith("op "):
                    child.proceed()
        finally:
            lines = child.kill_and_drain()
        hit_write = hit_write or bool(_temp_files(tmp_path))  # before a restart cleans them up
        steps = _durable_steps(lines)
        assert steps and steps[-1] >= first + want_durable - 1, why
        why += f" (last line printed {lines[-1]!r}, last durable step {steps[-1]})"
        _check_directory(d, steps[-1], local_dir, why)
    # The kills really hit writes in flight, whatever the seed: the last round makes sure of it.
    assert hit_write


def _temp_files(root: object) -> list[str]:
    """The temp files killed writes left under ``root``."""
    return [n for _, _, names in os.walk(root) for n in names if TMP_TAG in n]


@pytest.mark.parametrize("tier", ["direct", "nvme"])
def test_fresh_process_restores_after_kill_mid_write(tmp_path, tier: str) -> None:
    """Kill between two pwrites of step 3, then restore and save again in a new process."""
    d = str(tmp_path / "ckpt")
    os.makedirs(d)
    args = [d, "1", "--lockstep"] + (["--local-dir", str(tmp_path / "nvme")] if tier == "nvme" else [])
    child = _Child(args, str(tmp_path / "child.stderr"))
    try:
        pwrites = 0
        while True:
            line = child.next_line()
            if child.seen.count("saving 3") and line.startswith("op pwrite"):
                pwrites += 1
                if pwrites == 2:
                    break  # the first chunk of step 3 is written, the next one never will be
            if line.startswith("op "):
                child.proceed()
    finally:
        lines = child.kill_and_drain()
    assert _durable_steps(lines)[-1] == 2
    assert any(TMP_TAG in n for _, _, names in os.walk(tmp_path) for n in names)  # killed mid-write
    code = ("import os, sys, torch, fastckpt\n"
            "d = sys.argv[1]\n"
            "p = fastckpt.latest(d)\n"
            "print(os.path.basename(p), fastckpt.load(p)['step'])\n"
            "with fastckpt.Checkpointer(local_dir=sys.argv[2] or None) as ck:\n"
            "    ck.save({'step': 99, 'w': torch.full((8,), 99)}, os.path.join(d, 'last.pt')).wait()\n"
            "    print(ck.load(os.path.join(d, 'last.pt'))['step'], os.path.basename(fastckpt.latest(d)))\n")
    nvme = str(tmp_path / "nvme") if tier == "nvme" else ""
    out = subprocess.run([sys.executable, "-c", code, d, nvme], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    (name, step), (step_after, latest_after) = (ln.split() for ln in out.stdout.splitlines())
    assert int(step) == 2 and name in ("last.pt", "step-000002.pt")
    assert _equal_state(fastckpt.load(os.path.join(d, name)), 2)
    assert (int(step_after), latest_after) == (99, "last.pt")
