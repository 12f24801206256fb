"""``fastckpt latest ROOT``: print the newest complete checkpoint under a directory or URL."""

from __future__ import annotations

import click

from ._common import storage_options_option


@click.command()
@click.argument("root")
@storage_options_option
def latest(root: str, storage_options: dict | None) -> None:
    """Print the newest complete checkpoint under ROOT (a directory or an s3:// URL).

    Checkpoints written by torch.save, Lightning or DeepSpeed before a run switched to fastckpt
    count too (unverified). Exit 1 when there is none, or ROOT does not exist.
    """
    import os

    from .. import latest as find_latest
    from ..urls import is_url

    if not is_url(root) and not os.path.exists(root):
        click.echo(f"{root} does not exist: check the path (no checkpoint was saved there yet)", err=True)
        raise SystemExit(1)
    found = find_latest(root, storage_options)
    if found is None:
        click.echo(f"no complete checkpoint under {root}", err=True)
        raise SystemExit(1)
    click.echo(found)
