"""Retention's restart scan: what earlier runs left in a directory's burst-buffer copy, and which
of it may go (``retention``'s docstring and docs/burst-buffer.md, "Restarts", say why).

A numbered directory that the scan does not find complete is not always a group: a single
file may sit in one (``ep3/model.pt``, an export ``step100/model.pt``), and its burst-buffer
copy may be the only copy of that save (a job killed while uploading it, or replication dropped
it). So only files whose own manifest places them in that directory as their group are removed.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable

from ..commit.discovery import scan
from ..commit.foreign import group_step, tag_step
from ..commit.membership import group_dir
from ..storage.homes import Homes
from ..urls import join


class Looked:
    """Which restart scans ``Retention`` made, once per run each: per directory, of its single files
    (``"file"``) and of its groups (``"group"``); per parent of numbered directories, of the single
    files in them (``"steps"``)."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}

    def first(self, path: str, step: int | None) -> tuple[bool, bool, bool]:
        """(Under ``Retention``'s lock.) Which scans ``path`` (a group's ``step``), just durable, is
        the first to ask for: ``earlier_copies``' single files and groups, and ``earlier_steps``."""
        parent = posixpath.dirname(path)
        looked = self._seen.setdefault(parent, set())
        files, groups = "file" not in looked, step is not None and "group" not in looked
        looked.update({"file"} | ({"group"} if step is not None else set()))
        up = self._seen.setdefault(posixpath.dirname(parent), set())
        steps = files and step is None and tag_step(posixpath.basename(parent)) is not None and "steps" not in up
        up.update({"steps"} if steps else set())
        return files, groups, steps


def earlier_copies(homes: Homes, mirrors: list[str], path: str, rank: int, files: bool,
                   step: int | None, parent: str | None = None) -> tuple[list[str], set[str]]:
    """The checkpoints directly beside ``path`` in its directory's burst-buffer copies
    ``mirrors`` that are safe at their home, oldest first: with ``files``, the single files
    ``rank`` wrote whose home holds the same save; with a ``step``, the groups of lower steps.
    Also the names (relative to the directory) of every complete checkpoint found there.
    ``parent``: the directory ``mirrors`` copy, when it is not ``path``'s (``earlier_steps``)."""
    parent = posixpath.dirname(path) if parent is None else parent
    found = [(f, rel) for mirror in mirrors for f in scan(homes.resolve(mirror), max_depth=1, pass_unlisted=True)
             if "/" not in (rel := posixpath.relpath(f.path, mirror))]
    found.sort(key=lambda fr: fr[0].time)
    earlier = [name for f, rel in found if (name := join(parent, rel)) != path and not f.foreign
               and (_earlier_group(f.manifest, rel, step) if f.kind == "group"
                    else files and f.manifest.get("rank", 0) == rank and _same_at_home(homes, name, f.manifest))]
    return earlier, {rel for _, rel in found}


def earlier_steps(homes: Homes, copies: Callable[[str], list[str]], path: str, rank: int) -> list[str]:
    """For the single file ``path`` in a numbered directory (``run7/step-5/state.pt``, the README's
    layout): the single files ``rank`` wrote into the burst-buffer copies of the numbered
    directories beside that one, of lower steps (the rule groups in numbered directories are
    counted by: a job resumed from an older step saves the later ones again), whose home holds the
    same save (``earlier_copies``), oldest step first."""
    folder = posixpath.dirname(path)
    parent, mine = posixpath.dirname(folder), tag_step(posixpath.basename(folder))
    if mine is None:
        return []
    below = sorted(numbered_dirs(copies(parent), parent, set(), mine), key=lambda d: tag_step(posixpath.basename(d)))
    return [name for d in below for name in earlier_copies(homes, copies(d), path, rank, True, None, parent=d)[0]]


def numbered_dirs(mirrors: list[str], parent: str, complete: set[str], step: int) -> set[str]:
    """The numbered directories in ``parent``'s burst-buffer copies ``mirrors``, of steps below
    ``step``, that hold no complete checkpoint (``complete``): groups earlier runs left
    unpublished, or directories holding single files (``own_group_files`` tells them apart)."""
    return {join(parent, e.name) for mirror in mirrors if os.path.isdir(mirror)
            for e in os.scandir(mirror) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
            and e.name not in complete and (s := tag_step(e.name)) is not None and s < step}


def delete_own_group_files(homes: Homes, copies: Callable[[str], list[str]], group: str, rank: int) -> None:
    """Delete the files ``rank`` wrote into ``group``'s burst-buffer copies as files of that group
    (their manifest names it as their group: ``membership.group_dir``). Another rank's file, a
    partial or foreign one, and a single file saved into the directory (it may be the only copy
    of its save) stay. ``Target.delete`` prunes the directories it empties, so the last goes."""
    for local in copies(group):
        loc = homes.resolve(local)
        top = loc.key.rstrip("/")
        for key in loc.target.list(top + "/"):
            try:
                m = loc.target.read_manifest(key) or {}
            except (OSError, ValueError):  # a partial or foreign file: not this rank's to delete
                continue
            if m.get("rank", -1) == rank and group_dir(key, m) == top:
                loc.target.delete(key)


def _earlier_group(manifest: dict, rel: str, mine: int | None) -> bool:
    """A group of an earlier run counts only if its step is below the one just durable: a job
    resumed from an older checkpoint saves the later tags again, and another rank may already be
    writing into their burst-buffer directory when this one would delete it."""
    theirs = group_step(manifest, rel)
    return mine is not None and theirs is not None and theirs < mine


def _same_at_home(homes: Homes, name: str, local_manifest: dict) -> bool:
    """Whether the durable home holds the save that ``local_manifest`` describes."""
    home = homes.resolve(name)
    try:
        m = home.target.read_manifest(home.key)
    except (OSError, ValueError):  # absent (never replicated) or unreadable: keep the local copy
        return False
    return bool(m) and m.get("checksum") == local_manifest.get("checksum")
