"""``fastckpt verify PATH_OR_URL``: recompute every file's checksum against its manifest.

The checksum (``fastckpt.format.checksum``: xxh3 over 16 MiB blocks, combined) covers each file up
to its own manifest, which records it; a group's manifest records each file's size and
checksum too, and both must agree. Local files are read with O_DIRECT in parallel chunks
(bounded memory), files in parallel; files at a URL are read back with parallel ranged GETs.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import click

from ..commit.membership import require_complete_group
from ..commit.names import SIDECAR, framework_files
from ..errors import CorruptCheckpointError, FastCkptError, IncompleteCheckpointError
from ..format.checksum import checksum_bytes
from ..storage.homes import Homes
from ..storage.types import TargetNotFoundError
from ..urls import is_url, normalize
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
from ._discovery import RECHECKS, checkpoint_files, group_manifest, homes, list_checkpoints
from ._files import FileSpec, file_covered, file_manifest, single_file

MISSING = "missing"
REPLACED = f"saved again during each of {RECHECKS} checks"
UNVERIFIED = "unverified"
NOT_A_FILE = "a directory stands where this file should be: move it away, then restore the file from a replica"


@dataclass(frozen=True)
class Checked:
    checkpoint: str
    path: str
    bytes: int | None
    problem: str | None


def _size(h: Homes, spec: FileSpec) -> int | None:
    loc = h.resolve(spec.path)
    try:
        return loc.target.size(loc.key)
    except OSError:
        return None


def _vanished(exc: OSError) -> bool:
    """A file (or the directory it was in) that is not there, also as the storage layer wraps it."""
    return isinstance(exc, FileNotFoundError) or exc.errno in (errno.ENOENT, errno.ENOTDIR)


def _unreadable(exc: OSError) -> str | None:
    """What a checkpoint's file that cannot be read is, when that is its own fault (not the
    storage's: those stop the check); None otherwise."""
    if _vanished(exc):
        return MISSING
    return NOT_A_FILE if isinstance(exc, IsADirectoryError) or exc.errno == errno.EISDIR else None


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
        if not _vanished(exc):
            return False
        try:
            return not loc.target.exists(loc.key + SIDECAR)
        except OSError:
            return True
    return False


def check_file(h: Homes, spec: FileSpec, on_bytes=None) -> str | None:  # noqa: ANN001
    """None when the file is intact; else what is wrong with it (read back in parallel through
    its target: O_DIRECT chunks on a file system, ranged reads at a URL).

    A file whose checkpoint was saved again while it was checked (its manifest, or its group's,
    now records another save than the one checked: the reads saw parts of both) is checked again,
    ``RECHECKS`` times at most, then ``REPLACED``: never reported damaged for that."""
    for _ in range(RECHECKS):
        why = _check(h, spec, on_bytes)
        if why is None or (now := _published(h, spec)) is None or now == spec:
            return why
        if isinstance(now, str):
            return now
        spec = now
    return REPLACED


def _published(h: Homes, spec: FileSpec) -> FileSpec | str | None:
    """``spec`` as its checkpoint's manifest records it now (``REPLACED``: its group was saved
    again without it); None when that cannot be read."""
    try:
        if spec.group is not None:
            m, rel = group_manifest(h.resolve(spec.group)), spec.path[len(spec.group.rstrip("/")) + 1:]
            if spec.whole:
                digest = framework_files(m).get(rel)
                return (REPLACED if m is not None else None) if digest is None else replace(spec, checksum=str(digest))
            entry = ((m or {}).get("files") or {}).get(rel)
            if entry is None:
                return REPLACED if m is not None else None
            return FileSpec(spec.path, int(entry["size"]), entry["checksum"], spec.group)
        m = file_manifest(h.resolve(spec.path))
        return single_file(spec.path, m) if m else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_whole(h: Homes, spec: FileSpec, on_bytes=None) -> str | None:  # noqa: ANN001
    """A framework's file of a group (``FRAMEWORK_FILES``): its whole bytes against the checksum
    the group's manifest records, as the framework's loader checks it."""
    loc = h.resolve(spec.path)
    try:
        data = loc.target.get_bytes(loc.key)
    except TargetNotFoundError:
        return "missing"
    except OSError as exc:
        return _unreadable(exc) or f"cannot be read: {exc}"
    if checksum_bytes(data) != spec.checksum:
        return (f"{len(data)} bytes whose checksum is not the one committed with the group (a framework wrote it "
                "again in place: a killed save into this checkpoint?)")
    if on_bytes:
        on_bytes(len(data))
    return None


def _check(h: Homes, spec: FileSpec, on_bytes=None) -> str | None:  # noqa: ANN001
    if spec.whole:
        return _check_whole(h, spec, on_bytes)
    try:
        size, covered, own = file_covered(h, spec)
    except OSError as exc:
        if (why := _unreadable(exc)) is not None:
            return why
        raise
    except CorruptCheckpointError as exc:  # no manifest in its tail: cut short, if it is not the committed size
        got = _size(h, spec)
        return f"{got} bytes, but {spec.size} were committed" if got is not None and not spec.fits(got) else str(exc)
    want = own["checksum"]["value"]
    if not spec.fits(size):
        return f"{size} bytes, but {spec.size} were committed"
    if spec.checksum is not None and want != spec.checksum:
        return f"its manifest records checksum {want}, the checkpoint's manifest {spec.checksum}"
    if spec.group is None and own.get("group"):  # a group's file named alone: it loads as its group allows
        try:
            require_complete_group(h, spec.path, own)
        except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
            return str(exc).removeprefix(f"{spec.path} ")
    loc = h.resolve(spec.path)
    try:
        loc.target.verify(loc.key, size, want, covered)
    except CorruptCheckpointError as exc:
        return str(exc).removeprefix(f"{loc.url}: ")
    except OSError as exc:  # deleted while it was read
        if (why := _unreadable(exc)) is not None:
            return why
        raise
    if on_bytes:
        on_bytes(size)
    return None


def _cut_file(h: Homes, path: str, opts: dict | None
              ) -> tuple[list[tuple[str, list[FileSpec]]], list[str], list[Checked], list[str]] | None:
    """A file without its manifest, as the listing of its directory sees it: one file of the
    group published there (checked against the group's manifest), or a checkpoint listed damaged
    (cut short past its manifest); None when it is neither."""
    parent = os.path.dirname(path)
    try:
        mine = [f for f in checkpoint_files(h, parent)[0] if f.path == path]
    except FastCkptError:
        mine = []
    if mine:
        return [(parent, mine)], [], [], []
    bad = [e for e in list_checkpoints(parent, opts) if e.path == path and e.status == "damaged"]
    return ([], [], [Checked(path, path, e.bytes, f"damaged: {e.problem}") for e in bad], []) if bad else None


def _checkpoints(h: Homes, path: str, opts: dict | None, newest_only: bool
                 ) -> tuple[list[tuple[str, list[FileSpec]]], list[str], list[Checked], list[str]]:
    """The checkpoints to check (each with its files), the incomplete ones seen, the ones
    whose manifest is damaged (reported bad, their files not read), and those deleted since
    they were listed."""
    try:
        files, _ = checkpoint_files(h, path)
        return [(path, files)], [], [], []
    except CorruptCheckpointError as exc:
        return [], [], [Checked(path, path, None, str(exc).removeprefix(f"{path}: "))], []
    except FastCkptError as exc:  # not one checkpoint: a directory (or prefix) holding them, or not one at all
        if os.path.isfile(path):
            judged = _cut_file(h, path, opts)  # a checkpoint cut short has lost its manifest: judged as ls does
            if judged is None:
                fail_with(str(exc))
            return judged
    entries = list_checkpoints(path, opts)
    if not entries and _absent(h, path):  # as must_exist says it of a local path
        fail_with(f"{path} does not exist: check the URL (no checkpoint was saved there yet)")
    complete = [e for e in entries if e.status in ("complete", "replicated")]
    newer = entries  # a damaged manifest makes readers skip the checkpoint: never a silent pass
    named = []
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
    return todo, incomplete, broken, deleted


def _absent(h: Homes, path: str) -> bool:
    """A URL with nothing at it: no object, none below it (a store has no directories to tell a
    missing one from an empty one, so both are absent). Only asked when nothing was listed there."""
    if not is_url(path):
        return False  # must_exist said it already
    loc = h.resolve(path)
    return bool(loc.key) and not loc.target.exists(loc.key) and not loc.target.list(f"{loc.key}/", max_depth=0)


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
    try:
        todo, incomplete, results, deleted = _checkpoints(h, path, storage_options, newest_only)
        specs = [(ck, s) for ck, files in todo for s in files]
        sizes = [_size(h, s) for _, s in specs]
        with progress(f"verifying {len(specs)} files", sum(x or 0 for x in sizes), enabled=not as_json) as bar, \
                ThreadPoolExecutor(jobs, thread_name_prefix="fastckpt-verify") as files:
            futures = [files.submit(check_file, h, s, bar.advance) for _, s in specs]
            checked = [Checked(ck, s.path, n, fut.result())
                       for (ck, s), n, fut in zip(specs, sizes, futures, strict=True)]
        results += checked
        # a job's retention may delete a checkpoint while it is read: gone, not bad (a file found missing only;
        # a damaged manifest or a checksum that differs is bad, wherever it lies)
        gone = {r.checkpoint for r in checked
                if r.problem == MISSING and _gone(h, r.checkpoint, r.path != r.checkpoint)}
        deleted += sorted(gone)
        replaced = sorted({r.checkpoint for r in checked if r.problem == REPLACED})  # a job saving it now
        results = [r for r in results if r.checkpoint not in gone and r.checkpoint not in replaced]
    finally:
        h.close()
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
        elif len(results) == len(skipped):
            out.print(f"- no fastckpt checkpoint under {path} to verify" + (
                f": {len(skipped)} written without fastckpt, with no checksum to check (`fastckpt.load` loads them "
                "unverified; a fastckpt save there is verified)" if skipped else ""), markup=False)
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
    exit_with(passed)
