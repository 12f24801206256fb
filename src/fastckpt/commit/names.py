"""The names fastckpt keeps for its own files beside the checkpoints, and the check that a
checkpoint is not saved under one of them.

A checkpoint saved as ``run/latest`` would replace the directory's pointer, one saved as
``a.pt.fastckpt.json`` would be replaced by ``a.pt``'s publication record at a URL, and one
inside ``.fastckpt/`` would be taken for a commit marker and deleted with it. ``save`` refuses
such names before anything is written, and names the storage would refuse only once the
snapshot is taken: a part of a path (or of a URL's key: its burst-buffer copy keeps the key's
parts) longer than a file system's name, a key longer than an object store takes, and, at a URL,
a publication record's key (``NAME.fastckpt.json``) or a group's manifest and markers' keys the
store would refuse: those PUTs come only after the whole upload.
"""

from __future__ import annotations

import posixpath

from ..errors import ConfigError
from ..io.atomic import NAME_MAX
from ..urls import is_url, mirrored, split_url

GROUP_MANIFEST = "fastckpt-manifest.json"
NEXT_TAG = ".fastckpt-next"  # a re-saved group's new attempt, beside it: .TAG.fastckpt-next-<digest>
NEXT_DIGEST_CHARS = 12  # hex digits of that digest (protocol.staged_place)
GROUP_NAME_MAX = NAME_MAX - len(f".{NEXT_TAG}-") - NEXT_DIGEST_CHARS  # bytes (227): the re-save's name fits
MARKER_DIR = ".fastckpt"
TRIMMED_DIR = ".fastckpt-trimmed"  # beside groups: retention's records of those it trimmed (trimmed.py)
LATEST = "latest"
SIDECAR = ".fastckpt.json"  # a single file's publication record at a URL: NAME.fastckpt.json
# A group manifest's files that are not fastckpt files (a framework writes them in place, as
# megatron's common.pt and metadata.json): name -> checksum of the whole file
# (format.checksum.checksum_bytes). ``fastckpt verify`` checks them with the group's own files.
FRAMEWORK_FILES = "framework_files"
LEGACY_FRAMEWORK_FILES = "megatron_files"  # the same, in group manifests the Megatron strategy saved before
# Each burst-buffer directory's mark, at its root: the copies under it (``urls.mirror_path``,
# the checkpoint's whole path below the directory) are no checkpoints of a folder holding it.
BURST_BUFFER_MARK = ".fastckpt-burst-buffer"
KEY_MAX_BYTES = 1024  # an object key, at most: S3's limit (GCS's too)
PART_MAX_BYTES = 255  # one '/'-separated part of an s3:// key, at most: SeaweedFS's and MinIO's limit (AWS has none)
# bytes of key a group at a URL keeps for what its commit writes in it, after GROUP/: the longest is
# a claim, .fastckpt/claim-<attempt id>.json (claim.claim_name), its id 16 hex digits without a store
# (coordinator) and '<session>.<attempt>' with one; its manifest (22) and markers (rank-NNNNN.json, 25) are shorter
GROUP_RECORD_ROOM = len(f"{MARKER_DIR}/claim-{'0' * 16}.json")  # 37
_KEY_LIMITED = ("s3", "s3a", "gs", "gcs")  # schemes whose stores take keys of at most KEY_MAX_BYTES


def framework_files(manifest: object) -> dict:
    """A group manifest's ``FRAMEWORK_FILES`` (or its legacy name): name -> checksum; {} if none."""
    if not isinstance(manifest, dict):
        return {}
    got = manifest.get(FRAMEWORK_FILES, manifest.get(LEGACY_FRAMEWORK_FILES))
    return got if isinstance(got, dict) else {}


def burst_buffers(rels: list[str]) -> set[str]:
    """The burst buffers below a folder: the directories (relative to it) holding
    ``BURST_BUFFER_MARK`` among ``rels``, the names listed under it. ``local_dir="/ckpt/bb"`` with
    saves to ``/ckpt/step-N.pt`` mirrors each at ``/ckpt/bb/ckpt/step-N.pt``, a copy that may
    never reach its home, which a scan of ``/ckpt`` took for a checkpoint (and named latest).
    A folder that is itself a burst buffer is not counted: asked of it, its copies are wanted."""
    return {d for r in rels if posixpath.basename(r) == BURST_BUFFER_MARK and (d := posixpath.dirname(r))}


def outside_burst_buffers(rels: list[str], buffers: set[str] | None = None) -> list[str]:
    """``rels`` less the burst-buffer copies among them (``buffers``: the burst buffers, if known):
    the names below a buffer where ``urls.mirrored`` says copies go, not a run's own checkpoints
    in it (``local_dir`` set to the run's folder, or holding it)."""
    buffers = burst_buffers(rels) if buffers is None else buffers
    if not buffers:
        return rels
    return [r for r in rels if not any(r.startswith(f"{d}/") and mirrored(r[len(d) + 1:]) for d in buffers)]


def stays_inside(rel: object) -> bool:
    """``rel``, a name a manifest lists, stays inside its checkpoint: a relative, '/'-separated
    path without '.', '..' or empty parts."""
    return isinstance(rel, str) and not rel.startswith("/") and "\\" not in rel \
        and all(p not in ("", ".", "..") for p in rel.split("/"))


def check_group_name(group: str) -> None:
    """Refuse a group (normalised path or URL) whose name is too long to be saved again: the
    re-save is written beside it as ``.NAME.fastckpt-next-<digest>`` (``protocol.staged_place``),
    which must fit one directory entry (``NAME_MAX`` bytes). Its first save would commit, and
    every later one fail in the background with "File name too long". Not at a URL: an object
    store's group is never saved again beside itself (``resave.place_of``).

    Raises:
        ConfigError: naming the limit and a shorter name.
    """
    if is_url(group):
        return
    size = len(posixpath.basename(group).encode())
    if size > GROUP_NAME_MAX:
        raise ConfigError(f"cannot save a checkpoint group as {group}: its name is {size} bytes long, and fastckpt "
                          f"saves a group again beside it as '.NAME{NEXT_TAG}-<{NEXT_DIGEST_CHARS} hex digits>', "
                          f"which must fit the file system's {NAME_MAX} bytes per name. Use a group name of at most "
                          f"{GROUP_NAME_MAX} bytes")


def check_save_name(path: str, group: str | None = None) -> None:
    """Refuse a checkpoint name (normalised path or URL; ``group``: the group it is saved into)
    that fastckpt uses for its own files (a group named ``latest`` would stand where every group
    commit in its parent writes the pointer), or that the storage would refuse only after the
    snapshot: a part or a key too long (``_check_parts_fit``, ``_check_sidecar_fits``,
    ``_check_group_keys_fit``).

    Raises:
        ConfigError: naming the file and a name to use instead.
    """
    if group is not None:
        check_group_name(group)
    if group is not None and posixpath.basename(group) == LATEST:
        parent = posixpath.dirname(group)
        raise ConfigError(f"cannot save a checkpoint group as {group}: {LATEST!r} is the name of {parent}'s pointer to "
                          f"its newest checkpoint, which every group commit there writes, so the group's directory "
                          f"would stand where the pointer goes. Choose another name, e.g. "
                          f"{posixpath.join(parent, 'last')!r}, or a folder per step ('step-100')")
    if "\\" in path:  # here, before a byte is written: the storage refuses the key only once the file is whole
        safe = path.replace("\\", "_")
        raise ConfigError(f"cannot save a checkpoint as {path}: it holds a backslash ('\\'), which fastckpt refuses "
                          "in checkpoint names (they are '/'-separated on every storage, so such a file could not "
                          f"be published, listed or loaded). Choose another name, e.g. {safe!r}")
    _check_parts_fit(path)
    if group is None and is_url(path):  # a file of a group has no sidecar: its group's manifest publishes it
        _check_sidecar_fits(path)
    elif group is not None and is_url(path):
        _check_group_keys_fit(path, group)
    parts = path.split("/")
    base = parts[-1]
    if base == LATEST:
        why = "the name of the directory's pointer to its newest checkpoint"
    elif base == GROUP_MANIFEST:
        why = "the name of a group's manifest"
    elif base.endswith(SIDECAR):
        why = f"how a checkpoint's publication record at a URL is named (NAME{SIDECAR})"
    elif any(p.startswith(".") and "fastckpt" in p for p in parts[-2:]):  # a folder higher up is the user's
        why = "a hidden name of the kind fastckpt gives its markers, temp files and attempts"
    else:
        return
    stem = posixpath.splitext(base.lstrip("."))[0] or "checkpoint"
    raise ConfigError(f"cannot save a checkpoint as {path}: {base!r} is {why}, so fastckpt's own file would "
                      f"replace it or it would replace fastckpt's. Choose another name, e.g. "
                      f"{posixpath.join(posixpath.dirname(path), stem.replace('fastckpt', 'ckpt') + '.pt')!r}")


def _check_sidecar_fits(url: str) -> None:
    """Refuse a name at a URL whose sidecar's key is longer than stores take (``KEY_MAX_BYTES`` in
    all, ``PART_MAX_BYTES`` for its last part): the sidecar is written after the upload, which would
    then leave the object unpublished on every save of that name. Only where those limits are:
    S3's (its part limit SeaweedFS's and MinIO's) and Google Cloud Storage's (1024 in all)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _KEY_LIMITED:
        return
    key = split_url(url)[1].encode(errors="surrogateescape") + SIDECAR.encode()
    last = len(key.rsplit(b"/", 1)[-1])
    if len(key) > KEY_MAX_BYTES:
        over = f"a key of {len(key)} bytes, over the {KEY_MAX_BYTES} bytes S3 and Google Cloud Storage take"
        fix = (f"a shorter path after the bucket, of at most {KEY_MAX_BYTES - len(SIDECAR)} bytes (it has "
               f"{len(key) - len(SIDECAR)})")
    elif last > PART_MAX_BYTES and scheme in ("s3", "s3a"):
        over = (f"a last part of {last} bytes, over the {PART_MAX_BYTES} bytes SeaweedFS and MinIO take in one part "
                "of a key")
        fix = f"a shorter file name, of at most {PART_MAX_BYTES - len(SIDECAR)} bytes (it has {last - len(SIDECAR)})"
    else:
        return
    raise ConfigError(f"cannot save a checkpoint as {url}: its publication record there, NAME{SIDECAR}, would have "
                      f"{over}, so the save would fail only after its upload. Choose {fix}")


def _check_parts_fit(path: str) -> None:
    """Refuse a name (path or URL) with a '/'-separated part longer than a file system's name
    (``NAME_MAX`` bytes): the file, or a URL's burst-buffer copy, which keeps the key's parts, is
    written there, and only after the snapshot (SeaweedFS and MinIO take no longer part either)."""
    parts = split_url(path)[1].split("/") if is_url(path) else path.split("/")
    for part in parts:
        size = len(part.encode(errors="surrogateescape"))
        if size > NAME_MAX:
            why = " (the burst-buffer copy of a URL keeps its key's parts; SeaweedFS and MinIO take no longer " \
                "part either)" if is_url(path) else ""
            raise ConfigError(f"cannot save a checkpoint as {path}: its part {part[:40]!r}... is {size} bytes long, "
                              f"over the {NAME_MAX} bytes a file system takes in one name{why}, so the save "
                              f"would fail only after its snapshot. Choose a shorter name for it, of at most "
                              f"{NAME_MAX} bytes")


def _check_group_keys_fit(path: str, group: str) -> None:
    """Refuse a file of a group at a URL (``path``, inside ``group``) where its key, or the keys the
    group's commit writes (its manifest, markers, claims: ``GROUP_RECORD_ROOM`` bytes after
    ``GROUP/``), are longer than the store takes (``KEY_MAX_BYTES``): the upload would pass and the
    commit fail after it, or the upload itself after the snapshot. Only at S3 and Google Cloud Storage."""
    if path.split("://", 1)[0].lower() not in _KEY_LIMITED:
        return
    key, gkey = (split_url(u)[1].encode(errors="surrogateescape") for u in (path, group))
    manifest = len(gkey) + 1 + len(GROUP_MANIFEST)
    room = KEY_MAX_BYTES - 1 - GROUP_RECORD_ROOM
    if len(gkey) > room:
        raise ConfigError(f"cannot save a checkpoint group as {group}: its commit writes its manifest at key "
                          f"{split_url(group)[1]}/{GROUP_MANIFEST} ({manifest} bytes) and markers under "
                          f"{split_url(group)[1]}/{MARKER_DIR}/ (keys of up to {len(gkey) + 1 + GROUP_RECORD_ROOM} "
                          f"bytes), over the {KEY_MAX_BYTES} bytes S3 and Google Cloud Storage take in a key, so the "
                          f"group would fail only at its commit, after every upload. Choose a shorter group path "
                          f"after the bucket, of at most {room} bytes (it has {len(gkey)})")
    if len(key) > KEY_MAX_BYTES:
        raise ConfigError(f"cannot save a checkpoint as {path}: its key is {len(key)} bytes long, over the "
                          f"{KEY_MAX_BYTES} bytes S3 and Google Cloud Storage take, so its upload would fail only "
                          f"after the snapshot. Choose a shorter file name in the group, of at most "
                          f"{KEY_MAX_BYTES - len(gkey) - 1} bytes (it has {len(key) - len(gkey) - 1})")
