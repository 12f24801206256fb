"""``fastckpt ls``: every checkpoint under a directory or URL (``_discovery``'s looks, agreed), and
with ``--local-dir`` what the burst buffer holds beside them: a home checkpoint is *replicated*
when the burst buffer's copy is the same save (every file it holds has the checksum the home's
manifest records for that file), and a copy that is not (a re-save of a fixed name, ``last.pt``,
whose upload a killed job never finished) is its own *local only* row, not hidden behind the
older save of that name at the home."""

from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..commit.discovery import Damaged, scan
from ..commit.membership import group_dir
from ..commit.protocol import GROUP_MANIFEST
from ..errors import FastCkptError
from ..storage.homes import Homes, Location
from ..urls import is_within, join, mirror_path, normalize
from ._discovery import (
    RECHECKS,
    WHOLE,
    Entry,
    checkpoint_files,
    damaged_entry,
    found_entry,
    homes,
    incomplete_groups,
    keys_under,
    missing_files,
    own_manifest,
    pickled_step_of,
    size_of,
    step_of,
    whole_latest,
)
from ._files import as_landed

CHECKS_AT_ONCE = 8  # checkpoints ls checks for missing files at once (their requests overlap at a URL)


@dataclass(frozen=True)
class LocalCopy:
    """A checkpoint in the burst buffer, as ``ls`` shows it, and the checksum of each file it holds
    (by its name relative to the checkpoint: ``""`` for a single file)."""

    entry: Entry
    sums: dict[str, str]


def list_checkpoints(root: str, storage_options: dict | None = None, local_dir: str | None = None) -> list[Entry]:
    """Every checkpoint under ``root`` (a directory or URL), oldest first, incomplete ones too, each path once (latest:
    a whole one); with ``local_dir`` each is marked replicated by its burst-buffer copy when that is the same save,
    and each copy that is not (or has none at the home) is listed, local only."""
    root = normalize(root)
    h = homes(storage_options)
    try:
        loc = h.resolve(root)
        for _ in range(RECHECKS):  # a commit or a remove between the looks (scan, incomplete, latest): look again
            entries, newest, passed = _looks(h, loc, root, storage_options)
            whole = {e.path.rstrip("/") for e in entries if e.status in WHOLE}
            odd = [e for e in entries if e.status not in WHOLE and e.path.rstrip("/") in whole]
            if not entries or (not odd and (newest is None or newest.rstrip("/") in whole)):  # (none: a file's URL)
                break
        entries = [e for e in entries if e not in odd]  # still not: one row a path (its complete one), and
        newest = newest if newest is not None and newest.rstrip("/") in whole else None  # latest a whole one
        if local_dir is not None:
            entries = _with_local_copies(h, entries, mirror_path(local_dir, root, h.store_of(root)), loc.url)
        gone = {p.rstrip("/"): files for p, files in passed}  # fastckpt.latest() may name them: a resume fails
        todo = [e.path for e in entries if e.status in ("complete", "replicated") and e.path.rstrip("/") not in gone]
        with ThreadPoolExecutor(CHECKS_AT_ONCE) as pool:  # an older one too: a rollback to it would fail
            for p, missing in zip(todo, pool.map(lambda p: missing_files(h, p), todo)):
                if missing:  # (one small request per file at a URL: at once, not one after another)
                    gone[p.rstrip("/")] = missing
    finally:
        h.close()
    entries = [replace(e, latest=e.path.rstrip("/") == (newest or "").rstrip("/"),
                       problem=e.problem or (f"{', '.join(gone[k])} missing or not the committed size"
                                             if (k := e.path.rstrip("/")) in gone else None)) for e in entries]
    return sorted(entries, key=lambda e: (e.time or 0.0, e.name))


def _looks(h: Homes, loc: Location, root: str, storage_options: dict | None
           ) -> tuple[list[Entry], str | None, list[tuple[str, list[str]]]]:
    """The checkpoints under ``loc`` and the one ``fastckpt latest`` names, with those it passed over:
    three looks, which a job committing or removing between them can make disagree."""
    damaged: list[Damaged] = []
    entries = [found_entry(h, f, loc.url, "complete") for f in scan(loc, damaged=damaged, every_copy=True)]
    entries += incomplete_groups(h, loc) + [damaged_entry(h, d, loc.url) for d in damaged]
    return entries, *whole_latest(h, root, storage_options)


def _with_local_copies(h: Homes, entries: list[Entry], mirror: str, root_url: str) -> list[Entry]:
    """``entries`` with the burst buffer's copies (at ``mirror``): a complete one whose copy is the
    same save marked replicated; every other copy a local only row of its own. A copy at the
    mirror's root is of the checkpoint listed itself (``ls GROUP --local-dir``)."""
    out, home = list(entries), {e.name: i for i, e in enumerate(entries)}
    for local in _local_copies(h, mirror):
        i = home.get(local.entry.name) if local.entry.name else next(
            (j for j, e in enumerate(entries) if e.path.rstrip("/") == root_url.rstrip("/")), None)
        if i is None or entries[i].status != "complete" or not _same_save(h, entries[i], local):
            out.append(local.entry)
        else:
            out[i] = replace(entries[i], status="replicated")
    return out


def _same_save(h: Homes, home: Entry, local: LocalCopy) -> bool:
    """Whether the home checkpoint ``home`` holds the save ``local`` copies: each file of the copy
    (a node's burst buffer may hold only its ranks' files of a group) has the checksum the home's
    manifest records for it (a single file: the save its object holds, ``as_landed``)."""
    try:
        files, _ = checkpoint_files(h, home.path)
    except FastCkptError:  # not fastckpt's, or removed since it was listed: nothing to match the copy with
        return False
    at_home = {posixpath.relpath(f.path, home.path) if f.group else "": as_landed(h, f).checksum for f in files}
    return all(at_home.get(rel) == value for rel, value in local.sums.items())


def _local_copies(h: Homes, mirror: str) -> list[LocalCopy]:
    """Checkpoints in a burst buffer: single files with their manifest, and group directories
    whose files carry manifests naming the group, each file by its place in the group (``group_rel``)."""
    loc = h.resolve(mirror)
    groups: dict[str, list[tuple[str, int | None, dict]]] = {}
    out: list[LocalCopy] = []
    for rel in keys_under(loc):
        if any(part.startswith(".") for part in rel.split("/")) or posixpath.basename(rel) == GROUP_MANIFEST:
            continue
        f, m = own_manifest(h, loc, rel)
        if not m:
            continue
        g = group_dir(f.url, m)  # (a file in a subfolder of its group: Megatron's iter_N/mp_rank_00/...)
        if g is not None and is_within(g, loc.url):
            d = g[len(loc.url):].strip("/")
            groups.setdefault(d, []).append((m.get("group_rel") or posixpath.relpath(rel, d or "."), size_of(f), m))
        else:
            step = step_of(m)  # else the step its pickle records, as for the complete files
            step = step if step is not None else pickled_step_of(f)
            out.append(LocalCopy(Entry(f.url, rel, "file", "local only", step, size_of(f), 1,
                                       float(m.get("written_at", 0.0))), {"": m["checksum"]["value"]}))
    for d, files in groups.items():
        out.append(LocalCopy(Entry(join(loc.url, d), d, "group", "local only", None, sum(s or 0 for _, s, _ in files),
                                   len(files), max(float(m.get("written_at", 0.0)) for _, _, m in files)),
                             {name: m["checksum"]["value"] for name, _, m in files}))
    return out
