"""``fastckpt latest ROOT``: print the newest complete checkpoint under a directory or URL.

The answer is ``fastckpt.latest``'s, unless a file its manifest names is missing or of another
size (deleted, or cut short, after the commit): a resume script would then fail to load it, so
the newest older checkpoint whose files are all there is printed instead, and the one passed
over is named on stderr.
"""

from __future__ import annotations

import click

from ._common import LOCATION, must_exist, storage_options_option
from ._discovery import homes, whole_latest


@click.command()
@click.argument("root", type=LOCATION)
@storage_options_option
def latest(root: str, storage_options: dict | None) -> None:
    """Print the newest complete checkpoint under ROOT (a directory or an s3:// URL).

    Checkpoints written by torch.save, Lightning or DeepSpeed before a run switched to fastckpt
    count too (unverified). A checkpoint with a missing or truncated file is passed over (named
    on stderr) for the newest older one that is whole. A complete checkpoint given as ROOT is
    printed as is. Exit 1 when there is none, ROOT does not exist, or is a file that is no
    complete checkpoint.
    """
    must_exist(root)
    h = homes(storage_options)
    try:
        found, passed = whole_latest(h, root, storage_options)
    finally:
        h.close()
    for path, gone in passed:
        click.echo(f"fastckpt: passing over {path}: {', '.join(gone)} missing or not the committed size "
                   "(`fastckpt verify` checks it)", err=True)
    if found is None:
        click.echo(f"no complete checkpoint under {root}", err=True)
        raise SystemExit(1)
    click.echo(found)
