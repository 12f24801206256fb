"""Directories on the command line: ``--local-dir`` is a node-local directory, never a URL nor a
URL that lost its '://'; a repeated option names each directory once."""

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


def distinct_dirs(ctx: click.Context, param: click.Parameter, dirs: tuple[str, ...]) -> tuple[str, ...]:
    """A click callback: a repeated option's directories, each given once: by device and inode
    where it exists (a bind mount shows one directory at two paths, which a real path misses),
    else by real path (a symlink, a trailing '/')."""
    seen: dict[object, str] = {}
    for d in dirs:
        try:
            st = os.stat(d)
            key: object = (st.st_dev, st.st_ino)
        except OSError:  # not there yet (doctor creates it): no inode to compare
            key = os.path.realpath(d)
        if key in seen:
            raise click.BadParameter(f"{d} is given twice (as {seen[key]}); give each directory once",
                                     ctx=ctx, param=param)
        seen[key] = d
    return dirs
