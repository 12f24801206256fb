"""The drill's trials: run the job, SIGKILL it, restart, and measure the restore.

Built-in job (drill_job.py): the job itself restores on start and reports the moment the
state is in memory (RTO = that moment minus the restart) and whether the content is exactly
the state of the step it restored. Kill moments are aimed at a phase (snapshot, write,
commit, replicate, or idle training) from the event log of the checkpoints before, and the
phases actually under way are read back from the log after the kill.

A user's command: killed at a random moment in [min_run, max_run]; a probe process (a
restart's restore: find the newest complete checkpoint, load and checksum-verify every file)
measures the RTO; then the command is started again and resumes by itself. If it writes its
current step to ``$FASTCKPT_DRILL_STEP_FILE``, RPO is counted in steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..eventlog import read_events
from ..urls import is_url
from . import drill_phases as ph
from ._signals import sigterm_interrupts
from .drill_job import FILES
from .drill_proc import Child, DrillError


@dataclass(frozen=True)
class DrillConfig:
    home: str
    trials: int = 10
    state_bytes: int = 256 << 20
    local_dir: str | None = None
    lose_local: bool = False
    rto_target_s: float = 180.0
    seed: int = 0
    every: int = 5
    step_time_s: float = 0.05
    storage_options: dict | None = None
    command: tuple[str, ...] = ()
    trial_timeout_s: float = 300.0
    min_run_s: float = 5.0
    max_run_s: float = 30.0
    device: str = "cpu"


@dataclass(frozen=True)
class Trial:
    """One kill and restore. ``corrupt``: what the newest complete checkpoint held was not
    intact (a checksum or completeness error, or content that is not its step's)."""

    trial: int
    aimed: str | None
    hit: tuple[str, ...]
    killed_at_step: int | None
    durable_step: int | None
    restored_step: int | None
    source: str | None
    rto_s: float | None
    rpo_steps: int | None
    restored: bool
    corrupt: bool
    error: str | None = None


@dataclass
class _Incarnation:
    """One run of the built-in job, from its restart to its kill, and what it reported."""

    proc: Child
    events_path: str
    start_step: int = 0
    saves: dict[int, float] = field(default_factory=dict)
    durables: dict[int, float] = field(default_factory=dict)
    step: int = 0

    def note(self, line: dict) -> None:
        ev, s = line.get("ev"), line.get("step")
        if ev == "save":
            self.saves[s] = line["t"]
        elif ev == "durable":
            self.durables[s] = line["t"]
        elif ev == "step":
            self.step = max(self.step, s)

    def events(self) -> list:
        return read_events(self.events_path, warn=False) if os.path.exists(self.events_path) else []

    def until(self, want: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
        """The job's next line that ``want``s, within ``timeout_s`` (--trial-timeout) in all: a job
        that keeps saying other things (its steps) does not hold the drill past it."""
        deadline, said = time.monotonic() + timeout_s, 0
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.proc.next(left)
            except TimeoutError:
                break
            said += 1
            self.note(line)
            if want(line):
                return line
        doing = f"it said {said} other line(s) meanwhile" if said else "it said nothing"
        raise DrillError(f"{self.proc.who} did not {what} within --trial-timeout ({timeout_s:g} s; {doing}): give a "
                         f"longer --trial-timeout, or check that it saves (the built-in job every --every steps). "
                         f"Its log {self.proc.log_path} ends:\n{self.proc.tail()}")


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def lose_local_problem(home: str, local_dir: str) -> str | None:
    """Why ``--lose-local`` must not wipe ``local_dir`` (None when it may): only what the drill's
    jobs write there is the drill's to delete, so it must start empty, and not hold ``home``."""
    inside = os.path.commonpath([home, local_dir]) == local_dir if not is_url(home) else False
    if inside:
        return (f"--dir {home} is inside --local-dir {local_dir}, which --lose-local wipes before each restart: "
                "give a burst buffer apart from the home")
    try:
        held = sorted(os.listdir(local_dir))
    except FileNotFoundError:
        return None
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return (f"--local-dir {local_dir} already holds {shown}: --lose-local wipes it before each restart and "
                "would delete them. Give an empty or new directory (the drill's own burst buffer)")
    return None


def wipe(local_dir: str) -> None:
    """A lost node: the burst buffer is gone (everything in it: the drill's jobs wrote it all,
    ``lose_local_problem``); the directory itself stays, as a mount point would."""
    for name in os.listdir(local_dir):
        path = os.path.join(local_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


PROBE = "the drill's restore probe (not your job)"
# what a launcher (torchrun, a Kubeflow PyTorchJob, an srun wrapper) exports to the ranks of a job:
# the built-in job and the probe are one process each, and a Checkpointer that read WORLD_SIZE=8
# would wait at every commit for 7 ranks that never exist
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def single_process_env() -> dict[str, str]:
    """The drill's environment less ``LAUNCHER_ENV``: for its own processes (a user's job keeps it all)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}


class Drill:
    """Runs the trials of one drill; ``run(on_trial)`` returns them."""

    def __init__(self, cfg: DrillConfig, workdir: str) -> None:
        self.cfg, self.workdir = cfg, workdir
        self.rng = random.Random(cfg.seed)
        self._n = 0
        self._children: list[Child] = []

    def _child(self, argv: list[str], log_path: str, env: dict | None = None, json_lines: bool = True,
               who: str = "the job") -> Child:
        """Start a child; ``run`` kills it (and its process group) however it ends."""
        self._children.append(Child(argv, log_path, env, json_lines, who))
        return self._children[-1]

    def _log(self, what: str) -> str:
        self._n += 1
        return os.path.join(self.workdir, f"{self._n:03d}-{what}")

    def _job_argv(self, events_path: str, probe: bool = False) -> list[str]:
        c = self.cfg
        argv = [sys.executable, "-m", "fastckpt.cli.drill_job", "--dir", c.home, "--state-size", str(c.state_bytes),
                "--every", str(c.every), "--step-time", str(c.step_time_s), "--seed", str(c.seed),
                "--device", c.device]
        argv += ["--event-log", events_path] if events_path else []
        argv += ["--local-dir", c.local_dir] if c.local_dir else []
        argv += ["--storage-options", json.dumps(c.storage_options)] if c.storage_options else []
        return argv + (["--probe"] if probe else [])

    def _start(self) -> _Incarnation:
        ev = self._log("events.jsonl")
        return _Incarnation(self._child(self._job_argv(ev), self._log("job.log"), single_process_env()), ev)

    def _restore(self, inc: _Incarnation) -> tuple[dict, dict]:
        """Wait for the restarted job's ``loaded`` and ``restored`` (or ``fresh``) lines."""
        first = inc.until(lambda ln: ln["ev"] in ("loaded", "fresh"), self.cfg.trial_timeout_s, "start")
        if first["ev"] == "fresh":
            return first, {"ev": "fresh", "step": None, "verified": False, "source": None,
                           "error": "no complete checkpoint was found"}
        second = inc.until(lambda ln: ln["ev"] == "restored", self.cfg.trial_timeout_s, "restore")
        inc.start_step = second["step"] if second.get("verified") else 0
        inc.step = inc.start_step
        return first, second

    def _aim(self, inc: _Incarnation, last: ph.Windows | None, phase: str) -> tuple[str, float, ph.Windows]:
        """Wait until the job has made a new checkpoint durable, then for the anchor line of a
        kill moment in ``phase`` (or the next phase seen, when this one never was); return
        (the phase, the wall time to kill at, the windows used)."""
        timeout = self.cfg.trial_timeout_s
        while not inc.durables:  # the restarted job must checkpoint again before the next kill
            inc.until(lambda ln: ln["ev"] == "durable", timeout, "make a checkpoint durable")
        w = ph.windows(inc.events(), inc.saves, inc.durables) or last
        if w is None:
            raise DrillError("the job's event log shows no complete checkpoint; is it saving?")
        order = [phase] + [p for p in ph.PHASES if p != phase]
        for p in order:
            picked = w.pick(p, self.rng)
            if picked is None:
                continue
            anchor, delay = picked
            while True:  # the next anchor line whose kill moment is still ahead
                line = inc.until(lambda ln, a=anchor: ln["ev"] == a, timeout, f"reach a {anchor!r} line")
                if line["t"] + delay > time.time():
                    return p, line["t"] + delay, w
        raise DrillError("no phase of a checkpoint was seen in the event log; is the job saving?")

    def _builtin(self, on_trial: Callable[[Trial], None]) -> list[Trial]:
        c = self.cfg
        plan = [p for p in ph.PHASES if p != "replicate" or c.local_dir]
        inc = self._start()
        _, first = self._restore(inc)
        if first.get("ev") != "fresh":
            inc.proc.kill()
            raise DrillError(f"{c.home} already holds a checkpoint ({first.get('path')}); the built-in job needs "
                             "an empty --dir")
        trials, windows = [], None
        try:
            for k in range(1, c.trials + 1):
                aimed, at, windows = self._aim(inc, windows, plan[(k - 1) % len(plan)])
                time.sleep(max(0.0, at - time.time()))
                for line in inc.proc.kill():
                    inc.note(line)
                hit = ph.in_progress(inc.events(), inc.saves, inc.durables, tuple(FILES), c.local_dir is not None)
                durable = max(inc.durables, default=inc.start_step)
                if c.lose_local and c.local_dir:
                    wipe(c.local_dir)
                killed = inc
                inc = self._start()
                loaded, rest = self._restore(inc)
                r = rest.get("step")
                ok = bool(rest.get("verified")) and r is not None and r >= durable
                err = rest.get("error") or (None if ok else f"restored step {r}, but step {durable} was durable")
                trial = Trial(k, aimed, hit, killed.step, durable, r, rest.get("source"),
                              loaded["t"] - inc.proc.t_spawn if loaded["ev"] == "loaded" else None,
                              killed.step - r if r is not None else None,
                              ok, bool(rest.get("corrupt")), err)
                trials.append(trial)
                on_trial(trial)
                if rest.get("step") is None or not rest.get("verified"):
                    break  # the job cannot go on from a bad restore
        finally:
            inc.proc.kill()
        return trials

    def _user(self, on_trial: Callable[[Trial], None]) -> list[Trial]:
        c = self.cfg
        step_file = os.path.join(self.workdir, "step")
        env = dict(os.environ, FASTCKPT_DRILL_STEP_FILE=step_file, FASTCKPT_DRILL_DIR=c.home,
                   FASTCKPT_DRILL_LOCAL_DIR=c.local_dir or "")
        trials = []
        for k in range(1, c.trials + 1):
            with contextlib.suppress(FileNotFoundError):  # the last trial's step is not this one's
                os.unlink(step_file)
            job = self._child(list(c.command), self._log("job.log"), env, json_lines=False)
            ran_s = self.rng.uniform(c.min_run_s, c.max_run_s)
            try:
                job.proc.wait(ran_s)
            except subprocess.TimeoutExpired:
                job.kill()
            else:
                tail = job.tail()
                job.kill()  # its children, if any are left
                raise DrillError(f"the job exited with {job.proc.returncode} before it was killed; its log "
                                 f"{job.log_path} ends:\n{tail}")
            killed_at = _read_step(step_file)
            if c.lose_local and c.local_dir:
                wipe(c.local_dir)
            probe = _Incarnation(self._child(self._job_argv("", probe=True), self._log("probe.log"),
                                             single_process_env(), who=PROBE), "")
            try:
                loaded, rest = self._restore(probe)
            finally:
                probe.proc.kill()
            r = rest.get("step")
            ok = bool(rest.get("verified"))
            if rest["ev"] == "fresh":  # nothing durable yet: say how long the job had
                last = f"its last step report was {killed_at}" if killed_at is not None else "it reported no step"
                rest["error"] += (f" after the job ran {ran_s:.1f} s ({last}): if it needs longer to start and make "
                                  "its first checkpoint durable, raise --min-run")
            trial = Trial(k, None, (), killed_at, None, r, rest.get("source"),
                          loaded["t"] - probe.proc.t_spawn if loaded["ev"] == "loaded" else None,
                          killed_at - r if killed_at is not None and r is not None else None, ok,
                          bool(rest.get("corrupt")), rest.get("error"))
            trials.append(trial)
            on_trial(trial)
        return trials

    def run(self, on_trial: Callable[[Trial], None] = lambda t: None) -> list[Trial]:
        """The trials; no child outlives it, also on Ctrl-C or SIGTERM (KeyboardInterrupt)."""
        try:
            with sigterm_interrupts():
                return self._user(on_trial) if self.cfg.command else self._builtin(on_trial)
        finally:
            for child in self._children:
                child.kill()


def _read_step(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def summarize(cfg: DrillConfig, trials: list[Trial]) -> dict:
    """The drill's verdict: every trial restored, nothing corrupt loaded, RTO within target."""
    ok = [t for t in trials if t.restored]
    rto = [t.rto_s for t in ok if t.rto_s is not None]
    hits: dict[str, int] = {}
    for t in trials:
        for p in t.hit:
            hits[p] = hits.get(p, 0) + 1
    corrupt = sum(t.corrupt for t in trials)
    passed = len(ok) == cfg.trials and corrupt == 0 and bool(rto) and max(rto) <= cfg.rto_target_s
    return {"trials": cfg.trials, "run": len(trials), "restored": len(ok), "corrupt_loads": corrupt,
            "rto_seconds": _summary(rto), "rpo_steps": _summary([t.rpo_steps for t in ok if t.rpo_steps is not None]),
            "rto_target_seconds": cfg.rto_target_s, "phases_hit": hits, "passed": passed,
            "rows": [t.__dict__ | {"hit": list(t.hit)} for t in trials]}
