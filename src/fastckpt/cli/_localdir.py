"""``--local-dir``: a node-local directory, never a URL nor a URL that lost its '://'."""

from __future__ import annotations

import os

import click


class LocalDir(click.Path):
    """A node-local directory (``--local-dir``): a URL, or a URL that lost a slash or its colon
    (``s3:/b/bb``, which ``os.path`` takes for the folder ``./s3:``), is a usage error naming it."""

    def __init__(self, file_okay: bool = False) -> None:
        super().__init__(file_okay=file_okay)  # doctor: True, it names a file itself (and the fix)

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        from ..config import check_local_dir
        from ..errors import ConfigError

        value = super().convert(value, param, ctx)
        try:
            check_local_dir(os.fspath(value), os.fspath(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        return value
