"""Walking a ``PosixTarget``'s directory tree for the keys a prefix names.

A key prefix is a plain string prefix (``Target.list``), so ``run/.step_9.fastckpt-next`` names
files in every directory of ``run`` whose name starts with ``.step_9.fastckpt-next``, and in no
other. The walk starts in the deepest directory the prefix names and enters only directories
whose keys the prefix can still match: listing one group's re-save directories in a save_dir
of a thousand checkpoints reads one directory, not the whole tree. Symbolic links to
directories are never followed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..io import atomic
from ..io.ops import FileOps

Unlisted = list[tuple[str, OSError]] | None  # where a walk notes the directories it could not list


def _base(root: str, prefix: str) -> str:
    """The deepest directory ``prefix`` names: the only one worth walking."""
    return os.path.join(root, *prefix.split("/")[:-1]) if "/" in prefix else root


def _key_dir(root: str, d: str) -> str:
    """The key prefix of the files directly in directory ``d`` ('' at the root, else 'a/b/')."""
    rel = os.path.relpath(d, root)
    return "" if rel == "." else rel.replace(os.sep, "/") + "/"


def key_of(root: str, d: str) -> str:
    """The key of directory ``d`` ('' for the root itself)."""
    return _key_dir(root, d).rstrip("/")


def _entries(ops: FileOps, d: str, unlisted: Unlisted) -> tuple[list[str], list[str]]:
    """(sub-directories, regular files) directly in ``d``, from the directory's own entry types:
    no symbolic link, named pipe, socket or device is either (opening a pipe to read a manifest
    from it would block the scan for ever). Nothing, where ``d`` cannot be read (as ``os.walk``):
    then (``d``, the error) goes to ``unlisted`` (discovery judges whether it may hold the newest
    checkpoint), unless ``d`` is gone or no directory."""
    try:
        entries = ops.scandir(d)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    except OSError as exc:
        if unlisted is not None:
            unlisted.append((d, exc))
        return [], []
    sub = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    return sub, [e.name for e in entries if e.is_file(follow_symlinks=False)]


def _walk(ops: FileOps, root: str, prefix: str, max_depth: int | None = None,
          unlisted: Unlisted = None) -> Iterator[tuple[str, str, list[str]]]:
    """(directory, its key prefix, its regular files' names) of every directory that may hold a
    key starting with ``prefix``, to ``max_depth`` levels below the walk's base."""
    base = _base(root, prefix)
    todo = [(base, 0)]
    while todo:
        d, depth = todo.pop()
        at = _key_dir(root, d)
        sub, files = _entries(ops, d, unlisted)
        if max_depth is None or depth < max_depth:
            todo += [(os.path.join(d, x), depth + 1) for x in sub if not atomic.is_tmp(x)
                     and ((k := f"{at}{x}/").startswith(prefix) or prefix.startswith(k))]
        yield d, at, files


def keys(ops: FileOps, root: str, prefix: str, max_depth: int | None, unlisted: Unlisted = None) -> list[str]:
    """``Target.list``: the keys of the regular files (no temp files, symbolic links or pipes);
    ``unlisted`` (when given) gets the directories that could not be listed (``_entries``)."""
    out = []
    for _d, at, files in _walk(ops, root, prefix, max_depth, unlisted):
        out += [at + f for f in files if (at + f).startswith(prefix) and not atomic.is_tmp(f)]
    return sorted(out)


def temp_files(ops: FileOps, root: str, prefix: str) -> Iterator[str]:
    """Paths of the temp files whose keys start with ``prefix`` (``clean_incomplete``)."""
    for d, at, files in _walk(ops, root, prefix):
        yield from (os.path.join(d, f) for f in files if atomic.is_tmp(f) and (at + f).startswith(prefix))


def dirs(root: str, prefix: str) -> list[str]:
    """``Target.dirs``: keys of the directories (not symbolic links) directly in the directory
    ``prefix`` names whose keys start with ``prefix``, whatever they hold: nothing, or only the
    temp files of a writer that died."""
    base, head = _base(root, prefix), prefix.rsplit("/", 1)[-1]
    try:
        entries = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    at = _key_dir(root, base)
    return sorted(at + e.name for e in entries if e.name.startswith(head) and not atomic.is_tmp(e.name)
                  and e.is_dir(follow_symlinks=False))



def deletion_order(top: str, last: tuple[str, ...]) -> list[tuple[str, list[str], bool]]:
    """How a deletion of directory ``top`` goes, step by step: (a directory, the names in it to
    remove: files and symbolic links, whether the directory goes after them). Every directory
    goes after what is in it; the folders ``last`` names (relative to ``top``) after all the
    rest, ``top``'s own files included; ``top`` itself at the end."""
    held = [os.path.join(top, rel) for rel in last]

    def in_held(d: str) -> bool:
        return any(d == h or d.startswith(h + os.sep) for h in held)

    walk = [(d, files + [x for x in dirs if os.path.islink(os.path.join(d, x))])
            for d, dirs, files in os.walk(top, topdown=False)]
    return [(d, names, True) for d, names in walk if d != top and not in_held(d)] \
        + [(d, names, False) for d, names in walk if d == top] \
        + [(d, names, True) for d, names in walk if in_held(d)] + [(top, [], True)]
