"""``fastckpt verify PATH_OR_URL``: recompute every file's checksum against its manifest.

The checksum (``fastckpt.format.checksum``: xxh3 over 16 MiB blocks, combined) covers each file up
to its own manifest, which records it; a group's manifest records each file's size and
checksum too, and both must agree. Local files are read with O_DIRECT in parallel chunks
(bounded memory), files in parallel; files at a URL are read back with parallel ranged GETs.
"""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import click

from ..commit.discovery import Damaged, alone
from ..commit.names import SIDECAR
from ..errors import CorruptCheckpointError, FastCkptError
from ..storage.homes import Homes, Location
from ..urls import is_url, normalize
from ._checkfile import MISSING, REPLACED, check_file, file_size, vanished
from ._common import (
    LOCATION,
    console,
    emit_json,
    exit_with,
    fail_with,
    fmt_bytes,
    json_option,
    must_exist,
    progress,
    storage_options_option,
    table,
)
from ._discovery import RECHECKS, checkpoint_files, group_manifest, homes, size_of
from ._files import FileSpec
from ._listing import list_checkpoints

UNVERIFIED = "unverified"


@dataclass(frozen=True)
class Checked:
    checkpoint: str
    path: str
    bytes: int | None
    problem: str | None


@dataclass(frozen=True)
class Picked:
    """What one listing of PATH gives ``verify``: the checkpoints to check (each with its files),
    the incomplete ones seen, the ones whose manifest is damaged (reported bad, their files not
    read), and those deleted since they were listed."""

    todo: list[tuple[str, list[FileSpec]]]
    incomplete: list[str] = field(default_factory=list)
    broken: list[Checked] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    chosen: str | None = None  # --latest: the newest whole checkpoint (the one `fastckpt latest` names)
    listed: bool = False  # PATH is a directory (or prefix) of checkpoints, as it was listed


def _gone(h: Homes, checkpoint: str, group: bool) -> bool:
    """Whether ``checkpoint`` was deleted since it was listed (retention, or `fastckpt`'s
    ``remove``): a group's manifest is deleted first, a single file's sidecar at a URL too (a
    file that is missing under its sidecar was lost, not deleted). A damaged manifest or a
    truncated file is still there."""
    loc = h.resolve(checkpoint)
    try:
        if group:
            return group_manifest(loc) is None
        loc.target.size(loc.key)
    except CorruptCheckpointError:
        return False
    except OSError as exc:
        if not vanished(exc):
            return False
        try:
            return not loc.target.exists(loc.key + SIDECAR)
        except OSError:
            return True
    return False


def _cut_file(h: Homes, path: str) -> Picked | None:
    """A file without its manifest, judged alone (not by a scan of all its directory holds): one
    file of the group published there (checked against the group's manifest), or a checkpoint
    damaged (cut short past its manifest), as ``ls`` lists it; None when it is neither."""
    parent = os.path.dirname(path)
    try:
        mine = [f for f in checkpoint_files(h, parent)[0] if f.path == path]
    except FastCkptError:
        mine = []
    if mine:
        return Picked([(parent, mine)])
    loc = h.resolve(path)
    damaged: list[Damaged] = []
    alone(loc, Location(loc.target, posixpath.dirname(loc.key)), damaged)
    bad = [Checked(path, path, size_of(loc), f"damaged: {d.problem.removeprefix(f'{d.path}: ')}")
           for d in damaged if d.path == loc.url]
    return Picked([], broken=bad) if bad else None


def _is_file(h: Homes, path: str) -> bool:
    """Whether ``path`` is a file: a local one, or an object at a URL (an object cut short without
    its sidecar is judged as a local file is: alone, by the listing's rules, ``_cut_file``; a
    prefix holding objects is no file)."""
    loc = h.resolve(path)
    return bool(loc.key) and loc.target.exists(loc.key)


def _checkpoints(h: Homes, path: str, opts: dict | None, newest_only: bool) -> Picked:
    """What to check at ``path``: one checkpoint, or those a directory holds (``--latest``: its newest)."""
    try:
        files, _ = checkpoint_files(h, path)
        return Picked([(path, files)])
    except CorruptCheckpointError as exc:
        return Picked([], broken=[Checked(path, path, None, str(exc).removeprefix(f"{path}: "))])
    except FastCkptError as exc:  # not one checkpoint: a directory (or prefix) holding them, or not one at all
        if _is_file(h, path):
            judged = _cut_file(h, path)  # a checkpoint cut short has lost its manifest: judged as ls does
            if judged is None:
                fail_with(str(exc))
            return judged
    entries = list_checkpoints(path, opts)
    if not entries and _absent(h, path):  # as must_exist says it of a local path
        fail_with(f"{path} does not exist: check the URL (no checkpoint was saved there yet)")
    complete = [e for e in entries if e.status in ("complete", "replicated")]
    newer = entries  # a damaged manifest makes readers skip the checkpoint: never a silent pass
    named, chosen = [], []
    if newest_only:  # the newest whole one (what `fastckpt latest` names), the damaged ones it passes over, and
        named = [e for e in entries if e.latest]  # the complete ones that are not whole: fastckpt.latest() may
        chosen = [e for e in named if e in complete] or ([] if named else complete[-1:])  # name them
        newer = entries[entries.index((named or chosen)[0]) + 1:] if named or chosen else entries
        complete = chosen + [e for e in complete if e.problem and e not in chosen]
    # written without fastckpt (torch.save, DeepSpeed): no checksum to check it against, so never a pass (--latest:
    # the one a resume loads fails the check; under a directory each is named, and the others decide)
    unverified = [Checked(e.path, e.path, e.bytes, f"{UNVERIFIED}: written by {e.kind}, not fastckpt: no checksum "
                          "was recorded to check it against") for e in (named if newest_only else entries)
                  if e.status == "unverified"]
    incomplete = [e.path for e in entries if e.status == "incomplete"]
    broken = unverified + [Checked(e.path, e.path, e.bytes, f"damaged: {e.problem}")
                           for e in newer if e.status == "damaged"]
    todo, deleted = [], []
    for e in complete:
        try:
            todo.append((e.path, checkpoint_files(h, e.path)[0]))
        except CorruptCheckpointError as exc:
            broken.append(Checked(e.path, e.path, None, str(exc).removeprefix(f"{e.path}: ")))
        except (FastCkptError, OSError):
            if not _gone(h, e.path, e.kind == "group"):
                raise
            deleted.append(e.path)
    return Picked(todo, incomplete, broken, deleted, chosen[0].path if chosen else None, listed=True)


def _absent(h: Homes, path: str) -> bool:
    """A URL with nothing at it: no object, none below it (a store has no directories to tell a
    missing one from an empty one, so both are absent). Only asked when nothing was listed there."""
    if not is_url(path):
        return False  # must_exist said it already
    loc = h.resolve(path)
    return bool(loc.key) and not loc.target.exists(loc.key) and not loc.target.list(f"{loc.key}/", max_depth=0)


def _check_all(h: Homes, todo: list[tuple[str, list[FileSpec]]], jobs: int, quiet: bool) -> list[Checked]:
    """Every file of ``todo`` checked, ``jobs`` at once, with a progress bar unless ``quiet``."""
    specs = [(ck, s) for ck, files in todo for s in files]
    sizes = [file_size(h, s) for _, s in specs]
    with progress(f"verifying {len(specs)} files", sum(x or 0 for x in sizes), enabled=not quiet) as bar, \
            ThreadPoolExecutor(jobs, thread_name_prefix="fastckpt-verify") as files:
        futures = [files.submit(check_file, h, s, bar.advance) for _, s in specs]
        return [Checked(ck, s.path, n, fut.result()) for (ck, s), n, fut in zip(specs, sizes, futures, strict=True)]


def _verdict(problem: str) -> str:
    """A file that failed the check: BAD, or unverified (nothing to check it against: no pass either)."""
    return problem if problem.startswith(f"{UNVERIFIED}:") else f"BAD: {problem}"


@click.command()
@click.argument("path", type=LOCATION)
@click.option("--latest", "newest_only", is_flag=True,
              help="Under a directory: only the newest complete checkpoint (and damaged ones newer than it).")
@click.option("--jobs", type=click.IntRange(1, 64), default=4, show_default=True, help="Files checked at once.")
@storage_options_option
@json_option
def verify(path: str, newest_only: bool, jobs: int, storage_options: dict | None, as_json: bool) -> None:
    """Recompute the checksum of every file of PATH against its manifest.

    PATH is a checkpoint (a file or a group directory, or their URL) or a directory holding
    checkpoints (each complete one is checked, each with a damaged manifest is BAD, each written
    without fastckpt is named unverified: it has no checksum, so it is no pass;
    --latest: only the newest complete one, the one `fastckpt latest` prints, and the damaged ones
    newer than it, which a resume passes over; one written without fastckpt is reported
    unverified, exit 1). Exit 1 naming each bad or missing file or damaged
    checkpoint, or when there is no complete checkpoint to check.
    """
    path = normalize(path)
    must_exist(path)
    h = homes(storage_options)
    deleted: list[str] = []
    replaced: list[str] = []
    try:
        for _ in range(RECHECKS):
            picked = _checkpoints(h, path, storage_options, newest_only)
            checked = _check_all(h, picked.todo, jobs, as_json)
            # a job's retention may delete a checkpoint while it is read: gone, not bad (a file found missing only;
            # a damaged manifest or a checksum that differs is bad, wherever it lies)
            gone = {r.checkpoint for r in checked
                    if r.problem == MISSING and _gone(h, r.checkpoint, r.path != r.checkpoint)}
            again = {r.checkpoint for r in checked if r.problem == REPLACED}  # a job saving it now
            deleted += [p for p in picked.deleted + sorted(gone) if p not in deleted]
            replaced += [p for p in sorted(again) if p not in replaced]
            lost = set(picked.deleted) | gone | again
            results = [r for r in picked.broken + checked if r.checkpoint not in lost]
            tried = {ck for ck, _ in picked.todo} | set(picked.deleted)
            # under a directory, the newest one (--latest), or every one, deleted or saved again while it was
            # checked: a job is saving there, and what it holds now is checked instead (not "no fastckpt checkpoint")
            if not picked.listed or not (picked.chosen in lost if newest_only else tried and tried <= lost):
                break
    finally:
        h.close()
    kept = {r.checkpoint for r in results}  # checked after all (saved again under its name, then listed again)
    deleted, replaced = [p for p in deleted if p not in kept], [p for p in replaced if p not in kept]
    incomplete, todo = picked.incomplete, picked.todo
    skipped = [r for r in results if r.problem and r.problem.startswith(f"{UNVERIFIED}:")]  # "unverified" in both modes
    bad = [r for r in results if r.problem and r not in skipped]
    # an unverified checkpoint is never a pass; with --latest it is the one a resume loads: a failure
    passed = len(results) > len(skipped) and not bad and not (newest_only and skipped)
    if as_json:
        emit_json({"path": path, "checkpoints": len(todo), "checked": len(results), "passed": passed,
                   "bad": [{"path": r.path, "problem": r.problem} for r in bad], "incomplete": incomplete,
                   "unverified": [r.path for r in skipped],
                   "deleted": deleted, "replaced": replaced,
                   "files": [r.__dict__ for r in results]})
    else:
        out = console()
        rows = [[r.checkpoint, os.path.relpath(r.path, r.checkpoint) if r.path != r.checkpoint else "-",
                 fmt_bytes(r.bytes), "ok" if r.problem is None else _verdict(r.problem)] for r in results]
        out.print(table(f"verify {path}", ["checkpoint", "file", "size", "result"], rows, right_from=2,
                        text=(3,)))
        if newest_only and skipped:
            out.print(f"- the newest checkpoint under {path} was written without fastckpt: no checksum to check, "
                      "so no pass (`fastckpt.load` loads it unverified; a fastckpt save there is verified)",
                      markup=False)
        for p in incomplete:
            out.print(f"- {p} is incomplete (never committed): not checked; readers skip it", markup=False)
        for p in deleted:
            out.print(f"- {p} was deleted during the check (retention, or a remove): not checked", markup=False)
        for p in replaced:
            out.print(f"- {p} was {REPLACED} (a job saving it): not checked, check it again", markup=False)
        if len(results) > len(skipped):  # (after "no fastckpt checkpoint ... to verify": not "0 of 0")
            out.print(f"- {len(results) - len(bad) - len(skipped)} of {len(results) - len(skipped)} files intact")
    for r in skipped + bad:
        word, _, why = _verdict(r.problem).partition(": ")
        click.echo(f"{word.upper()} {r.path}: {why}", err=True)
    if len(results) == len(skipped) and not (newest_only and skipped):  # exit 1 says why, in --json too (as ls)
        click.echo(_nothing_checked(path, len(skipped), len(incomplete), bool(deleted or replaced)), err=True)
    exit_with(passed)


def _nothing_checked(path: str, unverified: int, incomplete: int, raced: bool) -> str:
    """Why nothing under ``path`` was verified, and what to do: the exit 1's reason on stderr."""
    if raced and not unverified:
        return (f"nothing left to verify under {path}: what was listed there was deleted or saved again while it "
                "was checked (a job saving there): check again")
    if unverified:
        why = (f"{unverified} written without fastckpt, with no checksum to check (`fastckpt.load` loads them "
               "unverified; a fastckpt save there is verified)")
    elif incomplete:
        why = (f"{incomplete} incomplete (never committed; readers skip them): verify a committed checkpoint, or "
               "save again")
    else:
        why = f"check the path (the directory or URL the job saves to; `fastckpt ls {path}` lists what is there)"
    return f"no fastckpt checkpoint under {path} to verify: {why}"
