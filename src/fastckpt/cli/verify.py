"""``fastckpt verify PATH_OR_URL``: recompute every file's checksum against its manifest.

The checksum (``fastckpt.checksum``: xxh3 over 16 MiB blocks, combined) covers each file up
to its own manifest, which records it; a group's manifest records each file's size and
checksum too, and both must agree. Local files are read with O_DIRECT in parallel chunks
(bounded memory), files in parallel; files at a URL are read back with parallel ranged GETs.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import click

from ..errors import CorruptCheckpointError, FastCkptError
from ..io.ops import FileOps
from . import _compat as core
from ._common import console, emit_json, exit_with, fmt_bytes, json_option, progress, storage_options_option, table
from ._discovery import FileSpec, checkpoint_files, file_covered, list_checkpoints, targets

CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Checked:
    checkpoint: str
    path: str
    bytes: int | None
    problem: str | None


def _size(spec: FileSpec, opts: dict | None) -> int | None:
    try:
        if core.is_url(spec.path):
            target, key = targets(opts).get(spec.path)
            return target.size(key)
        return os.path.getsize(spec.path)
    except (OSError, core.TargetNotFoundError):
        return None


def check_file(spec: FileSpec, opts: dict | None, pool: ThreadPoolExecutor, on_bytes=None) -> str | None:  # noqa: ANN001
    """None when the file is intact; else what is wrong with it."""
    try:
        size, covered, own = file_covered(spec, opts)
    except (FileNotFoundError, core.TargetNotFoundError):
        return "missing"
    except CorruptCheckpointError as exc:
        return str(exc)
    want = own["checksum"]["value"]
    if spec.size is not None and size != spec.size:
        return f"{size} bytes, but {spec.size} were committed"
    if spec.checksum is not None and want != spec.checksum:
        return f"its manifest records checksum {want}, the checkpoint's manifest {spec.checksum}"
    if core.is_url(spec.path):
        target, key = targets(opts).get(spec.path)
        try:
            target.verify(key, size, want, covered)
        except CorruptCheckpointError as exc:
            return str(exc)
        if on_bytes:
            on_bytes(size)
        return None
    got = core.checksum_file(FileOps(), pool, spec.path, size, covered, chunk_bytes=CHUNK_BYTES, odirect=True,
                             throttle=on_bytes)
    return None if got == want else f"checksum {got}, but {want} was recorded when it was written"


def _checkpoints(path: str, opts: dict | None, newest_only: bool) -> tuple[list[tuple[str, list[FileSpec]]], list[str]]:
    """The checkpoints to check (each with its files) and the incomplete ones seen."""
    try:
        files, _ = checkpoint_files(path, opts)
        return [(path, files)], []
    except FastCkptError:
        pass  # not one checkpoint: a directory (or prefix) holding them
    entries = list_checkpoints(path, opts)
    complete = [e for e in entries if e.status in ("complete", "replicated")]
    if newest_only:
        complete = [e for e in complete if e.latest] or complete[-1:]
    incomplete = [e.path for e in entries if e.status == "incomplete"]
    return [(e.path, checkpoint_files(e.path, opts)[0]) for e in complete], incomplete


@click.command()
@click.argument("path")
@click.option("--latest", "newest_only", is_flag=True, help="Under a directory: only the newest checkpoint.")
@click.option("--jobs", type=click.IntRange(1, 64), default=4, show_default=True, help="Files checked at once.")
@storage_options_option
@json_option
def verify(path: str, newest_only: bool, jobs: int, storage_options: dict | None, as_json: bool) -> None:
    """Recompute the checksum of every file of PATH against its manifest.

    PATH is a checkpoint (a file or a group directory, or their URL) or a directory holding
    checkpoints (each complete one is checked; --latest: the newest). Exit 1 naming each bad
    or missing file, or when there is no complete checkpoint to check.
    """
    path = core.normalize(path)
    todo, incomplete = _checkpoints(path, storage_options, newest_only)
    specs = [(ck, s) for ck, files in todo for s in files]
    sizes = [_size(s, storage_options) for _, s in specs]
    results: list[Checked] = []
    with progress(f"verifying {len(specs)} files", sum(x or 0 for x in sizes), enabled=not as_json) as bar, \
            ThreadPoolExecutor(8, thread_name_prefix="fastckpt-verify-io") as io, \
            ThreadPoolExecutor(jobs, thread_name_prefix="fastckpt-verify") as files:
        futures = [files.submit(check_file, s, storage_options, io, bar.advance) for _, s in specs]
        for (ck, s), n, fut in zip(specs, sizes, futures):
            results.append(Checked(ck, s.path, n, fut.result()))
    bad = [r for r in results if r.problem]
    passed = bool(results) and not bad
    if as_json:
        emit_json({"path": path, "checkpoints": len(todo), "checked": len(results), "passed": passed,
                   "bad": [{"path": r.path, "problem": r.problem} for r in bad], "incomplete": incomplete,
                   "files": [r.__dict__ for r in results]})
    else:
        out = console()
        rows = [[r.checkpoint, os.path.relpath(r.path, r.checkpoint) if r.path != r.checkpoint else "-",
                 fmt_bytes(r.bytes), "ok" if r.problem is None else f"BAD: {r.problem}"] for r in results]
        out.print(table(f"verify {path}", ["checkpoint", "file", "size", "result"], rows, right_from=2,
                        text=(3,)))
        if not results:
            out.print(f"- no complete checkpoint under {path}")
        for p in incomplete:
            out.print(f"- {p} is incomplete (never committed): not checked; readers skip it")
        out.print(f"- {len(results) - len(bad)} of {len(results)} files intact")
    for r in bad:
        click.echo(f"BAD {r.path}: {r.problem}", err=True)
    exit_with(passed)
