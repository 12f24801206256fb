"""``fastckpt rm PATH...``: delete checkpoints the way ``Checkpointer.remove`` does.

Each PATH must be one checkpoint that ``fastckpt ls`` lists (a file, a group, a DeepSpeed tag, a
Megatron iteration, also a damaged one); a directory holding checkpoints, a ``latest`` pointer's
folder, a bucket or a file that is no checkpoint is refused before anything is deleted. A group
goes with its manifest first, so no reader ever takes what is left for a checkpoint. With
``--local-dir`` the node's burst-buffer copies go too.
"""

from __future__ import annotations

import os

import click

from ._common import LOCATION, fail_with, storage_options_option
from ._discovery import homes
from ._localdir import LocalDir


def _checked(paths: tuple[str, ...], storage_options: dict | None) -> tuple[list[str], list[str]]:
    """(the PATHs to delete, those where nothing is), having checked every PATH first.

    Raises:
        ConfigError: a PATH is no single checkpoint (``commit.removable``): nothing is deleted.
    """
    from ..commit.protocol import SIDECAR
    from ..commit.removable import check_removable, refuse_root
    from ..urls import is_url, local_path

    there, missing = [], []
    h = homes(storage_options)
    try:
        for path in paths:
            loc = h.resolve(path)
            refuse_root(loc)
            if is_url(path):  # a sidecar whose object is gone too: ls lists it (missing), remove() deletes it
                found = loc.target.exists(loc.key) or loc.target.exists(loc.key + SIDECAR) \
                    or bool(loc.target.list(loc.key.rstrip("/") + "/"))
            else:
                found = os.path.lexists(local_path(path))
            check_removable(loc)
            (there if found else missing).append(path)
    finally:
        h.close()
    return there, missing


@click.command()
@click.argument("paths", nargs=-1, required=True, type=LOCATION)
@click.option("--local-dir", "local_dirs", type=LocalDir(), multiple=True,
              help="The node's burst buffer (local_dir) whose copies of PATH go too; repeat it for each directory "
                   "of a striped one (local_dir=[...]).")
@storage_options_option
def rm(paths: tuple[str, ...], local_dirs: tuple[str, ...], storage_options: dict | None) -> None:
    """Delete the checkpoints PATH... (files, groups, tags, iterations; directories or URLs).

    Only what `fastckpt ls` lists as one checkpoint is deleted: a directory that holds
    checkpoints, one file of a group, tag or iteration, a bucket, a file that is no checkpoint
    or a PATH where nothing is is refused (exit 1) before anything goes. Run it where no job is
    saving to PATH: a job's own remove() waits for its saves in flight, this command cannot see
    another process's.
    """
    import fastckpt

    from ..errors import ConfigError

    for local_dir in local_dirs:  # a mistyped one would be made, and the node's copies left to load
        if not os.path.isdir(local_dir):
            raise click.BadParameter(f"{local_dir} does not exist: give the burst buffer's directory (the local_dir "
                                     "the checkpoints were saved with), or leave --local-dir out",
                                     param_hint="--local-dir")
    real = [os.path.realpath(d) for d in local_dirs]
    if len(set(real)) < len(real):  # a typo for a striped buffer's other drive would leave its copies
        raise click.BadParameter(f"{', '.join(local_dirs)} name one directory twice: give each drive of the burst "
                                 "buffer once", param_hint="--local-dir")
    try:
        there, missing = _checked(paths, storage_options)
    except ConfigError as exc:
        fail_with(f"fastckpt: {exc}\nNothing was deleted.")
    if missing:  # a mistyped PATH beside good ones: nothing goes (rm a.pt b.pt with b.pt a typo)
        fail_with(f"{', '.join(missing)}: nothing there (check the path: `fastckpt ls` lists the checkpoints)\n"
                  "Nothing was deleted.")
    with fastckpt.Checkpointer(local_dir=list(local_dirs) or None, storage_options=storage_options) as ck:
        for path in dict.fromkeys(there):  # a PATH given twice goes once
            ck.remove(path)
            click.echo(f"removed {path}")
