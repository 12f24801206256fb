"""What is on disk (or in a bucket): checkpoints, their files and what each file must hold.

Built on the core's discovery (``commit.discovery.scan``) and storage (``storage.homes``): ``ls``
and ``verify`` have one code path for a directory and a URL. Complete once its manifest is out: a group's
``fastckpt-manifest.json``; a single file's own manifest (in its zip comment) on a mounted
file system, its sidecar ``NAME.fastckpt.json`` on an object store (or its own manifest, for a
file copied in without one). A group directory with rank markers (or files naming it their group)
and no manifest is incomplete (a commit that never finished). Checkpoints of torch.save,
Lightning or DeepSpeed are listed as **unverified**: found, but with no checksum to check.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass

from ..commit.discovery import Damaged, Found, scan
from ..commit.foreign import pickle_step, resaved_by, tag_step
from ..commit.membership import group_dir
from ..commit.names import framework_files, outside_burst_buffers, stays_inside
from ..commit.protocol import GROUP_MANIFEST, MARKER_DIR, NEXT_TAG, SIDECAR, member_files, read_group_manifest
from ..errors import CorruptCheckpointError, FastCkptError
from ..storage.homes import Homes, Location
from ..storage.types import TargetNotFoundError
from ..urls import is_url, join, nameable, normalize
from ._attempts import attempted_at
from ._files import FileSpec, as_landed, file_manifest, gone, single_file

STEP_KEYS = ("step", "global_step", "iteration")  # fastckpt groups, Lightning, Megatron
RECHECKS = 3  # looks at a checkpoint saved again while it is checked, before giving up on it
WHOLE = ("complete", "replicated", "unverified")  # the statuses `fastckpt latest` may name


@dataclass(frozen=True)
class Entry:
    """One checkpoint as ``ls`` shows it. ``status``: complete, incomplete, local only,
    replicated (complete at the home and in the burst buffer), or damaged (its manifest is:
    ``problem`` says how; readers skip it)."""

    path: str
    name: str
    kind: str
    status: str
    step: int | None
    bytes: int | None
    files: int
    time: float | None
    latest: bool = False
    problem: str | None = None

    @property
    def age_s(self) -> float | None:
        return None if self.time is None else max(0.0, time.time() - self.time)


def homes(storage_options: dict | None) -> Homes:
    return Homes(storage_options, retry_deadline_s=60.0, parallelism=8)


def group_manifest(loc: Location) -> dict | None:
    """The group manifest of ``loc`` (a group directory or URL prefix), None if there is none."""
    try:
        return read_group_manifest(loc.place())
    except OSError:  # a key that cannot be a directory, an unreadable place: not a group
        return None


class NotFastckpt(FastCkptError):
    """A checkpoint fastckpt did not write, or that another backend saved again since: whole as
    far as anyone knows, but not verifiable here (the drill does not count it as corrupt)."""


def checkpoint_files(h: Homes, path: str) -> tuple[list[FileSpec], dict]:
    """The files of the checkpoint at ``path`` and its manifest. ``FastCkptError`` (saying what it
    is) when ``path`` is not a complete fastckpt checkpoint, or no longer fastckpt's."""
    loc = h.resolve(path)
    m = group_manifest(loc)
    if m is not None:
        extra = framework_files(m)
        if (other := resaved_by(loc.target, loc.key, extra)) is not None:
            raise NotFastckpt(f"{path} was saved again by megatron's {other!r} backend after fastckpt committed it: "
                                "it is megatron's checkpoint now, which fastckpt cannot verify (load it with megatron)")
        return [FileSpec(join(loc.url, rel), int(f["size"]), f.get("checksum"), loc.url)
                for rel, f in sorted(member_files(m, loc.url).items())] + [
                FileSpec(join(loc.url, rel), None, str(digest), loc.url, whole=True)
                for rel, digest in sorted(extra.items()) if stays_inside(rel) and "/" not in rel], m
    m = file_manifest(loc)
    if not m:
        raise NotFastckpt(f"{path} is not a complete fastckpt checkpoint: no {GROUP_MANIFEST} there, and no "
                            "published fastckpt manifest for a single file. `fastckpt ls` on its parent shows "
                            "what is there.")
    return [single_file(loc.url, m)], m


def step_of(manifest: dict, loaded: dict[str, object] | None = None) -> int | None:
    """The training step a checkpoint records: its manifest's, else a loaded file's."""
    for obj in (manifest, *(loaded or {}).values()):
        if isinstance(obj, dict):
            for key in STEP_KEYS:
                if isinstance(obj.get(key), int):
                    return obj[key]
    return None


def size_of(loc: Location) -> int | None:
    try:
        return loc.target.size(loc.key)
    except OSError:
        return None


def _sizes(h: Homes, paths: list[str]) -> dict[str, int | None]:
    """Each path's size (None: not there); at a URL, one listing a directory, not a request a file."""
    out: dict[str, int | None] = {}
    by_dir: dict[tuple[int, str], list[tuple[str, Location]]] = {}
    for p in paths:  # a local file: a stat each, as cheap as a listing
        loc = h.resolve(p)
        by_dir.setdefault((id(loc.target), posixpath.dirname(loc.key) if is_url(p) else p), []).append((p, loc))
    for (_, d), locs in by_dir.items():
        try:
            listed = locs[0][1].target.sizes(f"{d}/" if d else "") if len(locs) > 1 else None
        except OSError:
            listed = None
        for p, loc in locs:
            out[p] = size_of(loc) if listed is None else listed.get(loc.key)
    return out


def found_entry(h: Homes, f: Found, root: str, status: str) -> Entry:
    name = f.path[len(root):].lstrip("/") or posixpath.basename(f.path)
    if f.foreign:  # written by torch.save, Lightning or DeepSpeed: found, but it carries no checksum
        loc = h.resolve(f.path)
        names = [join(loc.url, r) for r in keys_under(loc)] if f.kind == "group" else [loc.url]
        sizes = list(_sizes(h, names).values())
        return Entry(f.path, name, f.foreign, "unverified", f.step, sum(s or 0 for s in sizes), len(sizes), f.time)
    if f.kind == "group":
        files = f.manifest.get("files", {})
        size = sum(int(v["size"]) for v in files.values())
        step = step_of(f.manifest)  # else its tag's, as for an incomplete group (DeepSpeed's global_step1200)
        step = step if step is not None else tag_step(str(f.manifest.get("tag") or posixpath.basename(f.path)))
        return Entry(f.path, name, "group", status, step, size, len(files), f.time)
    loc = h.resolve(f.path)
    step = f.step if f.step is not None else step_of(f.manifest)
    return Entry(f.path, name, "file", status, step if step is not None else pickled_step_of(loc), size_of(loc), 1,
                 f.time)


def pickled_step_of(loc: Location) -> int | None:
    """The step a file records at its top level (Lightning's ``global_step``, a ``step`` key): one
    small read of its pickle; None when it has none, or cannot be read."""
    try:
        return pickle_step(loc.target, loc.key)
    except (OSError, ValueError, FastCkptError):
        return None


def damaged_entry(h: Homes, d: Damaged, root: str) -> Entry:
    loc = h.resolve(d.path)
    rels = [join(loc.url, r) for r in keys_under(loc)] if d.kind == "group" else [loc.url]
    sizes = list(_sizes(h, rels).values())
    try:
        when = loc.target.modified(posixpath.join(loc.key, GROUP_MANIFEST) if d.kind == "group" else loc.key)
    except OSError:
        when = None
    return Entry(d.path, d.path[len(root):].lstrip("/") or posixpath.basename(d.path), d.kind, "damaged", None,
                 sum(s or 0 for s in sizes), len(sizes), when, problem=d.problem.removeprefix(f"{d.path}: "))


def keys_under(loc: Location) -> list[str]:
    """Every key under ``loc`` that could name a checkpoint (``urls.nameable``), relative to it,
    but those inside a burst buffer below it (``names.burst_buffers``)."""
    prefix = f"{loc.key}/" if loc.key else ""
    try:
        return outside_burst_buffers([k[len(prefix):] for k in loc.target.list(prefix) if nameable(k)])
    except TargetNotFoundError:
        return []


def incomplete_groups(h: Homes, loc: Location) -> list[Entry]:
    """Group directories under ``loc`` (or ``loc`` itself) with no manifest: with rank markers, or
    holding files whose own manifests name their group there (a store leaves no marker)."""
    rels = keys_under(loc)
    marker = f"/{MARKER_DIR}/"
    resaves = {d for r in rels if (d := _resave_dir(r)) is not None}
    out = [_resave_entry(h, loc, d, [r for r in rels if r.startswith(f"{d}/") and marker not in f"/{r}"
                                     and posixpath.basename(r) != GROUP_MANIFEST]) for d in sorted(resaves)]
    groups = {g for r in rels if marker in f"/{r}" and (g := ("/" + r).split(marker)[0].lstrip("/")) not in resaves}
    groups |= _unpublished_groups(h, loc, rels, groups)
    for g in sorted(groups):  # g "": ``loc`` is the group itself (``ls GROUP``)
        members = [r for r in rels if r.startswith(f"{g}/" if g else "") and marker not in f"/{r}"]
        if (f"{g}/{GROUP_MANIFEST}" if g else GROUP_MANIFEST) in members:
            continue
        sizes, where = list(_sizes(h, [join(loc.url, r) for r in members]).values()), h.resolve(join(loc.url, g))
        status, problem = "incomplete", None
        try:  # not listed, but there as something else (a directory in its place): damaged, not incomplete
            read_group_manifest(where.place())
        except CorruptCheckpointError as exc:
            status, problem = "damaged", str(exc).removeprefix(f"{where.url}/")
        except OSError:  # unreadable now: as listed
            pass
        name = g or posixpath.basename(where.url.rstrip("/"))
        keys = [join(loc.url, r) for r in rels if r.startswith(f"{g}/" if g else "")]  # files and markers
        out.append(Entry(where.url, name, "group", status, tag_step(name), sum(s or 0 for s in sizes), len(members),
                         attempted_at(h, where, keys), problem=problem))
    return out


def _resave_dir(rel: str) -> str | None:
    """The re-save directory (``.TAG.fastckpt-next-<digest>``, relative) ``rel`` lies in, if any."""
    parts = rel.split("/")
    i = next((i for i, p in enumerate(parts[:-1]) if p.startswith(".") and NEXT_TAG in p), None)
    return None if i is None else "/".join(parts[: i + 1])


def _resave_entry(h: Homes, loc: Location, d: str, members: list[str]) -> Entry:
    """A re-save's hidden directory beside its published group (docs/groups.md): a whole copy of
    the group's new attempt, which never loads. One a killed process left stays until the next
    re-save of the tag (or a remove of it) deletes it, so ``ls`` shows it and where it is."""
    where, tag = h.resolve(join(loc.url, d)), posixpath.basename(d)[1:].split(NEXT_TAG)[0]
    return Entry(where.url, d, "group", "incomplete", tag_step(tag), sum(s or 0 for s in _sizes(
        h, [join(loc.url, r) for r in members]).values()), len(members),
        attempted_at(h, where, [join(loc.url, r) for r in members]), problem=(
        f"an attempt to save {tag} again that never replaced it (a re-save under way, or one whose process was "
        f"killed); it never loads: the next re-save of {tag} deletes it, or delete it once none runs"))


def own_manifest(h: Homes, loc: Location, rel: str) -> tuple[Location, dict | None]:
    """The file ``rel`` under ``loc`` and the manifest in its tail (None: none, or unreadable)."""
    f = h.resolve(join(loc.url, rel))
    try:
        return f, f.target.read_manifest(f.key)
    except (OSError, CorruptCheckpointError):
        return f, None


def _unpublished_groups(h: Homes, loc: Location, rels: list[str], known: set[str]) -> set[str]:
    """Directories (relative to ``loc``) without a group manifest whose files name them as their group."""
    published = {posixpath.dirname(r) for r in rels if posixpath.basename(r) == GROUP_MANIFEST}
    out: set[str] = set()
    tops = [r for r in rels if "/" not in r][:8]  # ``loc`` itself ("") may be the group: its first few files
    for rel in rels:
        d = posixpath.dirname(rel)
        if (not d and rel not in tops) or d in published | known | out or rel.endswith((SIDECAR, GROUP_MANIFEST)) \
                or any(p.startswith(".") for p in rel.split("/")):
            continue
        f, m = own_manifest(h, loc, rel)
        g = group_dir(f.url, m) if m else None
        if g is not None and g.rstrip("/") == join(loc.url, d).rstrip("/"):
            out.add(d)
    return out


def missing_files(h: Homes, path: str) -> list[str] | None:
    """The files of ``path`` that are not there as committed (none for a checkpoint written
    without fastckpt: it records no sizes); None: it was removed while they were looked at."""
    out: list[str] = []
    for _ in range(RECHECKS):  # a checkpoint saved again while its files were looked at: look again
        try:
            files, m = checkpoint_files(h, path)
        except FastCkptError as exc:  # not fastckpt's (nothing to size), or removed since it was listed
            return None if isinstance(exc, NotFastckpt) and gone(h, path) else []
        sizes = _sizes(h, [f.path for f in files])
        out = [f.path for f in files if (n := sizes[f.path]) is None or not (f.fits(n) or as_landed(h, f).fits(n))]
        try:
            if not out or checkpoint_files(h, path)[1] == m:
                return out
        except FastCkptError as exc:  # NotFastckpt: removed (retention) or re-saved by megatron meanwhile: gone
            return None if isinstance(exc, NotFastckpt) else out  # not damaged, and no longer there to name
    return out


def whole_latest(h: Homes, root: str, storage_options: dict | None
                 ) -> tuple[str | None, list[tuple[str, list[str]]]]:
    """``fastckpt.latest``'s answer for ``root``, unless a file its manifest names is missing or not
    its committed size (a resume would fail to load it): then the newest older checkpoint whose
    files are all there. Also what was passed over, with its files.

    Never None because checkpoints vanished while they were checked: a job's retention removing
    each one it found (keep one, saves close together) makes it ask ``latest`` again,
    ``RECHECKS`` times at most, as ``latest`` lists again when one vanishes under its scan."""
    from .. import latest

    for _ in range(RECHECKS):
        found, passed, vanished = _whole(h, root, latest(root, storage_options))
        if found is not None or not vanished:
            break
    return found, passed


def _whole(h: Homes, root: str, found: str | None) -> tuple[str | None, list[tuple[str, list[str]]], bool]:
    """``whole_latest`` for one answer of ``latest``, and whether a checkpoint it checked was removed meanwhile."""
    passed: list[tuple[str, list[str]]] = []
    if found is None or (gone := missing_files(h, found)) == []:
        return found, passed, False
    vanished = gone is None  # removed meanwhile, not damaged: never named
    passed += [(found, gone)] if gone else []
    for f in reversed(scan(h.resolve(normalize(root)))):
        if f.path == found:
            continue
        if (gone := missing_files(h, f.path)) == []:
            return f.path, passed, vanished
        vanished |= gone is None
        passed += [(f.path, gone)] if gone else []
    return None, passed, vanished
