"""``fastckpt ls DIR_OR_URL``: the checkpoints there, complete or not, and which is latest."""

from __future__ import annotations

import os

import click

from ..urls import local_path
from ._common import (
    LOCATION,
    console,
    emit_json,
    exit_with,
    fail_with,
    fmt_bytes,
    json_option,
    must_exist,
    storage_options_option,
    table,
)
from ._discovery import WHOLE, homes
from ._listing import list_checkpoints
from ._localdir import LocalDir


def _is_file(root: str) -> str:
    return (f"{root} is a file: `fastckpt ls` lists the checkpoints under a directory; `fastckpt verify {root}` "
            "checks one checkpoint file")


def _url_problem(root: str, storage_options: dict | None) -> str | None:
    """What is wrong with a URL that listed nothing, as ``must_exist`` and the file check say it of
    a local path: an object (a checkpoint file, as `fastckpt latest` prints it), or nothing at it
    and none below it (a store has no directories: a missing prefix and an empty one read the
    same). None: something is there, just no checkpoint."""
    from ..urls import is_url

    if not is_url(root):
        return None
    h = homes(storage_options)
    try:
        loc = h.resolve(root)
        if not loc.key:  # the bucket itself: listing it answered for it
            return None
        if loc.target.exists(loc.key):
            return _is_file(root)
        if not loc.target.list(f"{loc.key}/", max_depth=0):
            return f"{root} does not exist: check the URL (no checkpoint was saved there yet)"
        return None
    finally:
        h.close()


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= scale:
            return f"{s / scale:.1f} {unit}"
    return f"{s:.0f} s"


@click.command()
@click.argument("root", type=LOCATION)
@click.option("--local-dir", type=LocalDir(),
              help="The burst buffer: mark each checkpoint replicated or local only.")
@storage_options_option
@json_option
def ls(root: str, local_dir: str | None, storage_options: dict | None, as_json: bool) -> None:
    """List the checkpoints under ROOT (a directory or a URL), oldest first.

    Shows step (or name), size, files, status (complete, incomplete, local only, replicated, or
    unverified: written by torch.save, Lightning or DeepSpeed, with no checksum), age, and which
    one `latest` names. A checkpoint whose manifest is damaged is listed as damaged, with what
    is wrong (readers skip it; `fastckpt verify` fails on it). Exit 1 when ROOT holds no
    complete checkpoint.
    """
    must_exist(root)
    if local_dir is not None and not os.path.exists(local_dir):  # else nothing would be marked, silently
        raise click.BadParameter(f"{local_dir} does not exist: give the burst buffer's directory (the local_dir the "
                                 f"checkpoints were saved with), or leave --local-dir out to list {root} alone",
                                 param_hint="--local-dir")
    if os.path.isfile(local_path(root)):
        fail_with(_is_file(root))
    entries = list_checkpoints(root, storage_options, local_dir)
    if not entries and (problem := _url_problem(root, storage_options)):
        fail_with(problem)
    if as_json:
        emit_json({"root": root, "checkpoints": [e.__dict__ | {"age_s": e.age_s} for e in entries],
                   "latest": next((e.path for e in entries if e.latest), None)})
    else:
        rows = [[e.name, e.kind, "-" if e.step is None else e.step, fmt_bytes(e.bytes), e.files, e.status,
                 _age(e.age_s), "<- latest" if e.latest else ""] for e in entries]
        console().print(table(f"Checkpoints under {root}", ["name", "kind", "step", "size", "files", "status",
                                                            "age", "latest"], rows, right_from=2, text=(5, 7)))
        for e in entries:
            if e.status == "damaged":
                console().print(f"- {e.path} is damaged ({e.problem}): readers skip it", markup=False)
            elif e.status == "incomplete" and e.problem:  # a re-save's leftover directory: what it is
                console().print(f"- {e.path}: {e.problem}", markup=False)
            elif e.problem:  # complete, but a committed file is gone or cut short: loading it fails
                console().print(f"- {e.path}: {e.problem}; `fastckpt latest` passes over it, "
                                "`fastckpt verify` fails on it", markup=False)
    whole = any(e.status in WHOLE for e in entries)
    if not whole:  # exit 1 says why, as `fastckpt latest` does (the table alone may be empty)
        click.echo(f"no complete checkpoint under {root}", err=True)
    exit_with(whole)
