"""``fastckpt latest ROOT``: print the newest complete checkpoint under a directory or URL."""

from __future__ import annotations

import click


@click.command()
@click.argument("root")
def latest(root: str) -> None:
    """Print the newest complete checkpoint under ROOT (a directory or an s3:// URL).

    Exit 1 when there is none.
    """
    from .. import latest as find_latest

    found = find_latest(root)
    if found is None:
        click.echo(f"no complete checkpoint under {root}", err=True)
        raise SystemExit(1)
    click.echo(found)
