"""Finding checkpoints: the one ``latest`` rule, for directories and URLs alike.

``latest(root)``: the checkpoint ``root/latest`` names, when that is complete (group commits
and published single files move it forward, never back; a file's object must still be there);
otherwise, when the pointer is stale or missing, the newest complete checkpoint a scan finds.
A scan lists the root down to ``MAX_DEPTH`` directories and counts:

* a group directory once its ``fastckpt-manifest.json`` exists (its files are not separate
  checkpoints; a directory with rank markers but no manifest is an incomplete group, skipped
  with everything inside it);
* a single file once it is published: by its sidecar ``NAME.fastckpt.json`` at a URL (beside
  its object: one deleted by another tool leaves a sidecar that names nothing; a damaged one says
  nothing, so its object is judged as one without a sidecar, as ``load`` judges it), or, on a
  target where a visible file is already verified (POSIX: copies are verified before their
  rename), by the fastckpt manifest in its own zip comment.

Checkpoints written without fastckpt count too, marked ``foreign`` (they load unverified: no
checksum was recorded): a complete ``torch.save`` zip (plain ``torch.save``, Lightning's
``TorchCheckpointIO``; recognised by its end-of-central-directory record, ``format.foreign``),
the DeepSpeed tag directory that DeepSpeed's own ``latest`` file names (DeepSpeed's per-rank
files never count on their own), and a ``torch.distributed.checkpoint`` directory once its
``.metadata`` is written (Lightning's FSDP sharded checkpoints, which Lightning loads itself:
fastckpt.load() refuses it, naming what loads it, and latest() warns when it names one). So a
run that switches to fastckpt resumes from the checkpoints it already has. A fastckpt file
copied in by another tool (``aws s3 cp``, ``rsync``) without its sidecar counts by the manifest
in its own zip comment, and is verified when loaded.

Hidden names (``.x``) and temp files are never checkpoints, nor is anything inside a burst buffer
below the root (``names.outside_burst_buffers``). Checkpoints are ordered by their
commit request (groups) or write time (files; foreign ones by their modification time), not by
name. When foreign checkpoints are among them and every candidate records a step (a group's
``step=``, a file's top-level ``global_step``, ``iteration`` or ``step``, a DeepSpeed tag's
number), they are ordered by step first.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import threading

from ..errors import ConfigError, CorruptCheckpointError
from ..format.manifest import file_order
from ..io.atomic import is_tmp
from ..storage.homes import Homes, Location
from ..storage.places import Place
from ..storage.types import BucketNotFoundError, TargetNotFoundError
from ..urls import join, nameable, named, spelled_as
from . import discovery_unlisted, foreign
from .found import Damaged, Found, one_copy_each, ordered
from .names import burst_buffers, outside_burst_buffers
from .protocol import (
    GROUP_MANIFEST,
    MARKER_DIR,
    SIDECAR,
    group_order,
    pointed_name,
    read_group_manifest,
    read_sidecar,
)

log = logging.getLogger("fastckpt")
MAX_DEPTH = 4
RESCANS = 3  # listings a scan makes at most when checkpoints it listed vanish before it reads them
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, once every rank's files are written


def scan(loc: Location, max_depth: int = MAX_DEPTH, damaged: list[Damaged] | None = None,
         every_copy: bool = False, pass_unlisted: bool = False, candidates_depth: int | None = None) -> list[Found]:
    """Every complete checkpoint under ``loc``, oldest first; ``every_copy``: also each copy of
    one save (``ls``, ``verify``: a damaged copy is checked too), not only the one nearest ``loc``,
    and a single file whose sidecar is listed without its object (lost: ``verify`` reports it).

    ``damaged``: when given, each checkpoint skipped for a damaged manifest is appended to it
    (``fastckpt ls`` and ``verify`` report them; ``latest`` only skips them).

    A checkpoint listed but gone when read (retention deleted it once a newer save was durable,
    which the listing may have missed: keep one, and the scan would find none) makes the scan
    list again, ``RESCANS`` times at most.

    A folder that cannot be listed and may hold a checkpoint raises (``discovery_unlisted``);
    ``pass_unlisted``: passed over too (the restart scan's housekeeping keeps what it does not see);
    ``candidates_depth``: only a folder at most that deep below ``loc`` is raised (the caller counts
    no candidate below it: DeepSpeed's tags are direct children of ``save_dir``).
    """
    for n in range(RESCANS):
        seen: list[Damaged] = []
        gone: list[str] = []
        found = _scan(loc, max_depth, seen, gone, every_copy, pass_unlisted, candidates_depth, n + 1 == RESCANS)
        if not gone:
            break
        log.debug("fastckpt: %s vanished while %s was scanned: listing it again", gone, loc.url)
    if damaged is not None:
        damaged.extend(seen)
    return found


def _scan(loc: Location, max_depth: int, damaged: list[Damaged], gone: list[str], every_copy: bool,
          pass_unlisted: bool, candidates_depth: int | None, last: bool) -> list[Found]:
    prefix = f"{loc.key}/" if loc.key else ""
    try:
        listing = loc.target.listing(prefix, max_depth=max_depth + 1)  # +1: the markers of the deepest groups
    except BucketNotFoundError:
        raise  # a typo in the URL or a deleted bucket: never "nothing saved yet, start fresh"
    except TargetNotFoundError:
        return []
    rels = [k[len(prefix):] for k in listing.keys if nameable(k)]
    buffers = burst_buffers(rels)  # the copies in a burst buffer below: no checkpoints of this folder
    rels = outside_burst_buffers(rels, buffers)
    groups = {d for r in rels if posixpath.basename(r) == GROUP_MANIFEST  # not a re-save's staging directory
              for d in [posixpath.dirname(r)] if not _hidden(d)}
    marked = {r.split(f"/{MARKER_DIR}/")[0] for r in rels if f"/{MARKER_DIR}/" in f"/{r}"}
    marked = {"" if m.startswith(f"{MARKER_DIR}/") else m for m in marked}
    found: list[Found] = []
    for g in sorted(groups):
        m = _group_manifest(loc.place().child(g) if g else loc.place(), damaged, join(loc.url, g), gone)
        if m is not None:
            found.append(Found(join(loc.url, g), "group", group_order(m), m))
    ds_tags = {t for r in rels if posixpath.basename(r) == "latest" and not _hidden(r)
               for t in [foreign.deepspeed_tag(loc.target, prefix, r, set(rels))] if t and t not in groups}
    dcp_dirs = {d for r in rels if posixpath.basename(r) == DCP_METADATA  # written last by dcp.save: complete
                for d in [posixpath.dirname(r)] if not _hidden(d) and d not in groups | ds_tags}  # ("": root)
    inside = groups | marked | ds_tags | dcp_dirs
    if not pass_unlisted:  # (a folder in a burst buffer holds none of this folder's checkpoints)
        gone += discovery_unlisted.check(loc.url, prefix, listing.unlisted, inside | buffers, candidates_depth,
                                         stale_gone=not last)
    sidecars, listed = {r[: -len(SIDECAR)] for r in rels if r.endswith(SIDECAR)}, set(rels)
    others: list[Found] = []
    for rel in rels:
        if rel.count("/") > max_depth or _hidden(rel) or any(rel.startswith(f"{g}/") or not g for g in inside):
            continue
        if rel.endswith(SIDECAR):
            if rel[: -len(SIDECAR)] not in listed and not every_copy:
                continue  # its object deleted by another tool (a plain run's top-k, aws s3 rm): no checkpoint
            f = _published(loc, prefix, rel[: -len(SIDECAR)], damaged, gone, rel[: -len(SIDECAR)] in listed)
            if f is not None:  # None: deleted since the listing (retention), or damaged
                (others if f.foreign else found).append(f)
        elif rel not in sidecars and posixpath.basename(rel) != "latest":
            f = _file(loc, prefix, rel, damaged, gone)
            if f is not None:
                (others if f.foreign else found).append(f)
    for t in sorted(ds_tags):  # ordered by when DeepSpeed's latest file named it
        written = loc.target.modified(prefix + posixpath.join(posixpath.dirname(t), "latest"))
        others.append(Found(join(loc.url, t), "group", written, {}, "DeepSpeed", foreign.tag_step(t)))
    for d in sorted(dcp_dirs):  # one checkpoint, the directory (not atomic: a re-save in place cut short is not seen)
        meta = foreign.lightning_meta(loc.target, prefix + posixpath.join(d, "meta.pt"),
                                      posixpath.join(d, "meta.pt") in rels, (d or loc.url).endswith(".ckpt"))
        if meta is not False:
            written = loc.target.modified(prefix + posixpath.join(d, DCP_METADATA))
            others.append(Found(join(loc.url, d), "group", written, {}, foreign.DCP, meta))
    return ordered(loc, prefix, found if every_copy else one_copy_each(found), others)


_judged = threading.local()  # ``_the_file``'s scan: only its file counts (``.url``), so only it is told of


def _warn(about: str, msg: str, *args: object) -> None:
    """Log ``msg`` about the checkpoint ``about``: in ``_the_file``'s scan only when it is the file
    judged or a folder holding it (its group), not when it is another file beside it."""
    judged = getattr(_judged, "url", None)
    if judged is None or judged == about or judged.startswith(about.rstrip("/") + "/"):
        log.warning(msg, *args)


def _group_manifest(place: Place, damaged: list[Damaged], path: str, gone: list[str]) -> dict | None:
    """The manifest of the group at ``place``, listed just now; None when it is damaged, which makes
    that group no candidate, and says so (in ``damaged`` too), or gone since the listing (in ``gone``)."""
    try:
        got = read_group_manifest(place)
    except CorruptCheckpointError as exc:
        _warn(path, "fastckpt: skipping a damaged checkpoint: %s", exc)
        damaged.append(Damaged(path, "group", str(exc)))
        return None
    if got is None:
        gone.append(path)
    return got


def _published(loc: Location, prefix: str, rel: str, damaged: list[Damaged], gone: list[str],
               listed: bool) -> Found | None:
    """The single file ``rel`` whose sidecar was listed (``listed``: its object too), by its sidecar.
    A damaged sidecar says nothing: the object is judged by itself (``_file``: its own manifest),
    as without a sidecar and as ``load`` judges it; one whose object is not there is damaged."""
    url = join(loc.url, rel)
    try:
        side = read_sidecar(Location(loc.target, prefix + rel))
    except CorruptCheckpointError as exc:
        if not listed:
            damaged.append(Damaged(url, "file", str(exc)))
            return None
        _warn(url, "fastckpt: %s: %s is judged by its own manifest, as a load judges it", exc, url)
        return _file(loc, prefix, rel, damaged, gone)
    if side is None:
        gone.append(url)
        return None
    return Found(url, "file", file_order(side), side)


def _file(loc: Location, prefix: str, rel: str, damaged: list[Damaged], gone: list[str]) -> Found | None:
    """A single file: fastckpt's (its manifest: verified on a mounted target, and on any target
    once copied in whole), or a complete torch.save zip written without fastckpt; else None."""
    if foreign.DEEPSPEED_FILE.match(posixpath.basename(rel)):
        return None
    try:
        m = loc.target.read_manifest(prefix + rel)
        if m:
            return None if m.get("group") else Found(join(loc.url, rel), "file", file_order(m), m)
        record = foreign.torch_zip(loc.target, prefix + rel)
        if record is None:
            if (why := foreign.damage(loc.target, prefix + rel)) is not None:  # no silent skip: cut short, emptied
                damaged.append(Damaged(join(loc.url, rel), "file", f"{join(loc.url, rel)} {why}"))
            return None
        return Found(join(loc.url, rel), "file", loc.target.modified(prefix + rel), {}, "torch.save",
                     foreign.pickle_step(loc.target, prefix + rel, record))
    except CorruptCheckpointError as exc:  # a damaged manifest: not a candidate, but no silent one either
        _warn(join(loc.url, rel), "fastckpt: skipping a damaged checkpoint: %s", exc)
        damaged.append(Damaged(join(loc.url, rel), "file", str(exc)))
        return None
    except OSError as exc:  # unreadable: it may be the newest, so no answer rather than an older one
        if isinstance(exc, FileNotFoundError) or exc.errno == errno.ESTALE:  # gone since the listing (NFS: ESTALE)
            gone.append(join(loc.url, rel))
            return None
        raise foreign.unreadable(exc, join(loc.url, rel)) from None


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def latest(homes: Homes, root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (a directory or URL), or None (see the
    module docstring for the rule). A checkpoint file given as ``root`` is its own answer, as a
    group directory is; any other file raises ``ConfigError`` (see ``_the_file``), as an empty one does.
    The answer is spelt as ``root`` was (``urls.spelled_as``)."""
    return spelled_as(_latest(homes, named(root, "latest()")), root)


def _latest(homes: Homes, root: str) -> str | None:
    loc = homes.resolve(root)
    name = pointed_name(loc.place())
    if name is not None:
        return join(loc.url, name)
    found = scan(loc)
    if not found:
        return _the_file(loc)
    if found[-1].foreign == foreign.DCP:  # named for Lightning's FSDP resume, which loads it itself
        log.warning("fastckpt: the newest checkpoint under %s, %s, is a %s directory, not fastckpt's: %s; "
                    "fastckpt's next save there supersedes it", loc.url, found[-1].path, foreign.DCP,
                    foreign.dcp_how_to_load(found[-1].path))
    elif found[-1].foreign:
        log.warning("fastckpt: the newest checkpoint under %s, %s, was written by %s, not fastckpt: it loads "
                    "unverified (no checksum was recorded); fastckpt's next save there supersedes it",
                    loc.url, found[-1].path, found[-1].foreign)
    return found[-1].path


def _the_file(loc: Location) -> str | None:
    """``root`` itself when it names a complete checkpoint file (as a group directory given as
    ``root`` is its own answer); None when ``root`` is no file (nothing saved there yet).

    A file that is no complete checkpoint raises ``ConfigError``: None would tell a resume script
    to start from scratch. The file is judged by the scan of its own directory, so by the same
    rules as when that directory is given; when that directory cannot be listed (mode 711: the
    file may be opened, its folder not listed), or the file is a symbolic link (``best.pt`` ->
    ``step-500.pt``: a scan lists no link), by the same rules applied to the file alone (its
    target's manifest, read through the link, as ``load`` reads it); the answer is the link.
    """
    if loc.key and loc.target.mounted and loc.target.is_link(loc.key) \
            and not os.path.exists(loc.target.url_of(loc.key)):  # dangling (None would say: start from scratch)
        raise ConfigError(f"{loc.url} is a symbolic link to a file or directory that does not exist (deleted by "
                          "retention?): point it at a checkpoint, or give latest() the directory holding the "
                          "checkpoints")
    if not loc.key or not loc.target.exists(loc.key) or loc.target.list(f"{loc.key}/"):
        return None  # nothing there, or a directory (fsspec's memory/gs/az answer "exists" for a prefix too)
    parent = Location(loc.target, posixpath.dirname(loc.key))
    damaged: list[Damaged] = []
    _judged.url = loc.url
    try:
        found = scan(parent, max_depth=0, damaged=damaged, every_copy=True, pass_unlisted=True)  # only loc counts
        if not any(f.path == loc.url for f in found) and (loc.target.is_link(loc.key) or parent.target.listing(
                f"{parent.key}/" if parent.key else "", max_depth=0).unlisted):  # a scan never follows a link
            found = [f for f in [alone(loc, parent, damaged)] if f is not None]
    finally:
        _judged.url = None
    for f in found:
        if f.path == loc.url:
            if f.foreign:
                log.warning("fastckpt: %s was written by %s, not fastckpt: it loads unverified (no checksum was "
                            "recorded)", f.path, f.foreign)
            return f.path
    why = next((f"it is damaged ({d.problem})" for d in damaged if d.path == loc.url), "it is no complete checkpoint")
    raise ConfigError(f"{loc.url} is a file, not a directory, and {why}: latest() takes the directory holding the "
                      f"checkpoints, e.g. latest({parent.url!r}); load a checkpoint file with load()")


def alone(loc: Location, parent: Location, damaged: list[Damaged]) -> Found | None:
    """The file ``loc`` judged by itself, as the scan of ``parent`` would judge it (``parent``
    cannot be listed, or ``verify FILE`` asks of that file alone, not of all its folder holds): by
    its sidecar, else by ``_file``; None when it is no checkpoint (damaged: in ``damaged``)."""
    rel = posixpath.basename(loc.key)
    if _hidden(rel) or is_tmp(rel) or rel == "latest" or rel.endswith(SIDECAR):
        return None
    folder = f"{parent.key}/" if parent.key else ""
    if any(parent.target.exists(folder + name) for name in (GROUP_MANIFEST, MARKER_DIR, DCP_METADATA)):
        return None  # a part of the checkpoint its folder is (a group's file, a DCP checkpoint's meta.pt)
    if parent.target.exists(loc.key + SIDECAR):
        return _published(parent, folder, rel, damaged, [], listed=True)
    return _file(parent, folder, rel, damaged, [])
