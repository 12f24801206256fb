"""The group protocol's small files the DeepSpeed integration reads and writes (manifest, rank
markers, DeepSpeed's ``latest`` file) at a directory or a URL, and a group's files downloaded
into the burst buffer: all through ``storage.homes``, as the core does.
"""

from __future__ import annotations

import json
import os

from fastckpt.commit.discovery import scan
from fastckpt.commit.membership import group_dir
from fastckpt.commit.names import GROUP_NAME_MAX
from fastckpt.commit.protocol import GROUP_MANIFEST, LATEST, MARKER_DIR, group_order, move_pointer
from fastckpt.commit.removable import LOOKED_AT
from fastckpt.config import DEFAULT_RETRY_DEADLINE_S
from fastckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from fastckpt.io.atomic import NAME_MAX
from fastckpt.storage.homes import Homes
from fastckpt.storage.places import Place
from fastckpt.urls import is_url, normalize

__all__ = ["GROUP_MANIFEST", "is_url", "normalize", "Store"]


def pointer_name(data: bytes | None) -> str | None:
    """The tag the bytes of a ``latest`` file name (stripped); None for no file, or an empty one."""
    name = data.decode(errors="replace").strip() if data is not None else ""
    return name or None


class Store:
    """The small files of checkpoints under one root (a directory or URL).

    Made once and kept (one per Checkpointer, see ``EngineHooks._store``): a URL's target takes
    "connection refused" on its first request for a wrong endpoint and raises at once; only a
    target that has been answered before treats it as an outage and retries.

    Args:
        storage_options: fsspec options for URLs (the Checkpointer's).
        retry_deadline_s: how long a request keeps retrying transient errors (the Checkpointer's).
    """

    def __init__(self, storage_options: dict | None, *, retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S) -> None:
        self._homes = Homes(storage_options, retry_deadline_s=retry_deadline_s)

    def close(self) -> None:
        """End its targets' worker threads and connections, without waiting."""
        self._homes.close(wait=False)

    def place(self, where: str) -> Place:
        return self._homes.resolve(where).place()

    def latest_file(self, root: str) -> bytes | None:
        """The bytes of ``root/latest`` as they are, or None when there is none.

        Raises:
            ConfigError: ``root/latest`` is a directory (DeepSpeed's pointer is a file).
        """
        try:
            return self.place(root).get(LATEST)
        except IsADirectoryError as exc:
            where = f"{root.rstrip('/')}/{LATEST}"
            raise ConfigError(f"{where} is a directory, but it is where DeepSpeed and fastckpt keep the name of "
                              f"the newest tag (a file holding the tag alone), so no tag can be resumed from "
                              f"{root}: move that directory away (mv {where} {where}.bak); load a tag explicitly "
                              f"with load_checkpoint({root!r}, tag=...); list the tags with: fastckpt ls "
                              f"{root}") from exc

    def pointer(self, root: str) -> str | None:
        """What ``root/latest`` says (stripped), or None when there is none."""
        return pointer_name(self.latest_file(root))

    def set_pointer(self, root: str, name: str, committed: float) -> bool:
        """Point ``root/latest`` at ``name``, a group committed at ``committed`` (``order``), only
        forward: not over a pointer a writer moved to a newer commit meanwhile (atomic: temp,
        fsync, rename; one PUT at a URL). Returns whether it moved."""
        return move_pointer(self.place(root), name, committed)

    def pointer_written(self, root: str) -> float | None:
        """When ``root/latest`` was last written (its modification time); None when unknown."""
        loc = self._homes.resolve(f"{root.rstrip('/')}/{LATEST}")
        try:
            return loc.target.modified(loc.key)
        except OSError:
            return None

    def newest_group(self, root: str) -> tuple[str, dict] | None:
        """The newest complete group directly under ``root`` whose commit was to move ``latest``
        (not saved with ``save_latest=False``), by a scan (not the pointer: the caller compares
        the two): its path and manifest, or None."""
        loc = self._homes.resolve(root)
        groups = [f for f in scan(loc, max_depth=1, candidates_depth=1)  # a tag is a direct child of root
                  if f.kind == "group" and not f.foreign and _tag(loc.url, f.path)
                  and f.manifest.get("save_latest", True)]
        return (groups[-1].path, groups[-1].manifest) if groups else None

    def manifest(self, group: str) -> dict | None:
        data = self.place(group).get(GROUP_MANIFEST)
        return json.loads(data) if data is not None else None

    def attempted(self, group: str) -> bool:
        """fastckpt started saving ``group``: rank markers or a manifest exist, or files whose own
        manifests name it their group (ranks with a store write no markers: a run killed before
        its commit leaves only its files)."""
        place = self.place(group)
        if place.names(MARKER_DIR) or place.get(GROUP_MANIFEST) is not None:
            return True
        return any(_of_group(place, group, rel) for rel in place.files()[:LOOKED_AT])

    def check_exists(self, url: str, local: str, tag: str) -> None:
        """Raise ``CheckpointNotFoundError`` when ``url/tag`` (nor its burst-buffer copy ``local``)
        was never saved: no manifest and no rank marker (an incomplete one is told apart at the fetch)."""
        if not self.attempted(f"{url}/{tag}") and self.manifest(local) is None:
            raise CheckpointNotFoundError(f"checkpoint {url}/{tag} does not exist (no tag {tag!r} was saved under "
                                          f"{url}); load the newest complete one with load_checkpoint({url!r}) "
                                          "and no tag, or list the tags with: fastckpt ls " + url)

    def download_group(self, url: str, local: str, names: list[str], replace: bool = False) -> None:
        """Copy ``names`` (files of the committed group at ``url``) that are missing in
        ``local`` (``replace``: all of them, over a copy of another save, unpublished there
        first), then its manifest, so loads there read the burst buffer."""
        home = self._homes.resolve(url)
        os.makedirs(local, exist_ok=True)
        if replace:
            self.place(local).delete(GROUP_MANIFEST)
        for name in names:
            dest = os.path.join(local, *name.split("/"))
            if replace or not os.path.exists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                home.target.download(f"{home.key}/{name}", dest)
        data = self.place(url).get(GROUP_MANIFEST)
        if data is not None:
            self.place(local).put(GROUP_MANIFEST, data)


def _of_group(place: Place, group: str, rel: str) -> bool:
    """The file ``rel`` in ``place`` (``group``'s directory) was written as a file of that group."""
    try:
        manifest = place.manifest(rel)
    except (OSError, CorruptCheckpointError):  # gone meanwhile, or damaged: not told by this one
        return False
    return bool(manifest) and group_dir(f"{place.url().rstrip('/')}/{rel}", manifest) == place.url().rstrip("/")


def _tag(root: str, path: str) -> bool:
    """``path`` is a directory right inside ``root`` (a tag), not ``root`` itself."""
    rel = path[len(root):].strip("/") if path.startswith(root) else ""
    return bool(rel) and "/" not in rel


def order(manifest: dict) -> float:
    """When a group was committed, for ordering (rank 0's commit call)."""
    return group_order(manifest)


def same_files(a: dict, b: dict) -> bool:
    """Two group manifests name the same files with the same checksums (one save)."""
    def sums(m: dict) -> dict:
        return {k: v.get("checksum") for k, v in (m.get("files") or {}).items()}
    return sums(a) == sums(b)


def checked_tag(save_dir: str, tag: str) -> str:
    """``tag`` if ``save_checkpoint(save_dir, tag)`` can commit it as one checkpoint.

    Raises:
        ConfigError: an empty ``save_dir`` (DeepSpeed's own engine refuses it too), a tag that
            is not one directory name: ``save_dir/epoch1/step1`` would be a group nested in
            ``save_dir/epoch1``, with its ``latest`` there, and a load of ``save_dir`` would find
            nothing; or a tag named as a file beside the tags (``latest``). Or a tag that
            would commit but never load as the newest: with leading or trailing whitespace
            (DeepSpeed and fastckpt read ``latest`` stripped, and look for another name), or
            starting with '.' (hidden: ``fastckpt.latest``, ``fastckpt ls`` and retention skip it).
            Or one longer than ``GROUP_NAME_MAX`` bytes, which could not be saved again
            (``fastckpt.commit.names.check_group_name``), refused before DeepSpeed makes its directory.
    """
    if not save_dir:
        raise ConfigError(f"save_checkpoint(save_dir={save_dir!r}): save_dir must be a non-empty directory or URL")
    if not tag or tag in (".", "..") or any(c in tag for c in ("/", os.sep, "\\", "\x00")):
        safe = "".join("_" if c in "/\\\x00" else c for c in tag.strip("/")) or "global_step1"
        raise ConfigError(f"save_checkpoint tag {tag!r} is not one directory name: fastckpt commits each tag as "
                          f"one checkpoint directly under save_dir, with save_dir/latest naming it. Use a tag "
                          f"without '/' or '\\' (e.g. {safe!r})")
    if tag in (LATEST, "latest_universal") or tag.startswith(".fastckpt"):
        raise ConfigError(f"save_checkpoint tag {tag!r} is the name of a file beside the tags (DeepSpeed's pointer "
                          "to the newest one, or fastckpt's own): use another tag (e.g. 'global_step1')")
    if tag != tag.strip() or tag.startswith("."):
        safe = tag.strip().lstrip(".").strip() or "global_step1"
        why = ("has leading or trailing whitespace: DeepSpeed and fastckpt read save_dir/latest stripped, so "
               f"load_checkpoint(save_dir) would look for {tag.strip()!r} and never find it" if tag != tag.strip()
               else "starts with '.', a hidden name: fastckpt.latest, fastckpt ls and retention skip it, so it "
               "would never be found as the newest")
        raise ConfigError(f"save_checkpoint tag {tag!r} {why}. Use a tag without leading or trailing whitespace, "
                          f"not starting with '.' (e.g. {safe!r})")
    if len(tag.encode()) > GROUP_NAME_MAX and not is_url(str(save_dir)):  # a URL's tag is never staged beside it
        raise ConfigError(f"save_checkpoint tag {tag[:40]!r}... is {len(tag.encode())} bytes long: fastckpt saves a "
                          f"tag again beside it under a name {NAME_MAX - GROUP_NAME_MAX} bytes longer, which must fit "
                          f"the file system's {NAME_MAX} bytes per name, so it could be saved once and never again. "
                          f"Use a tag of at most {GROUP_NAME_MAX} bytes")
    return tag
