"""Whether a single file read from its URL is the save its sidecar published.

At a URL a single file is published by its sidecar ``NAME.fastckpt.json``, written after the
object. The object verifies against the manifest in its own bytes, so an object overwritten
with another save's whole bytes (a sync or restore tool, an operator's copy of an older
checkpoint) verified too, and loaded silently under the newer name: a resume from ``latest()``
(which the sidecar names) went back a checkpoint. So an object read is compared with its sidecar,
and the run told (a WARNING, not an error: two saves of one path from two writers can leave the
same state, the one called first landing last, and that object is a whole save):

- the same checksum, no sidecar (a file copied in without one; a group's file, which has none
  and is judged by its group), or one that cannot be read (damaged, a store not answering): the
  object verified itself, and is loaded, as before;
- the object's save is newer (its manifest's ``requested_at``, ``file_order``): a save to the
  same key whose object landed before its sidecar (docs/faults.md): loaded;
- its save is older: its manifest is read again, since the sidecar may have been read after the
  object, while a save of the same key replaced both (then what was read was a published save),
  and the sidecar too (the object's own sidecar may have landed since). If they still disagree,
  the WARNING names both; the object is loaded.

The sidecar costs one small GET: once per load (``fallback.home_sidecar``), shared with
``load.verdict``, which reads it before the object when it judges a burst-buffer copy.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable

from ..commit.names import SIDECAR
from ..commit.protocol import read_sidecar
from ..format.manifest import file_order
from ..storage.homes import Location
from .fallback import home_sidecar

log = logging.getLogger("fastckpt")


def check_published(home: Location, manifest: dict | None, deadline_s: float) -> None:
    """Log a WARNING when the object at ``home`` (its manifest ``manifest``, verified) holds an
    older save than its sidecar published (see the module's docstring)."""
    if home.target.mounted or not manifest or manifest.get("group"):
        return
    sidecar = _sidecar(lambda: home_sidecar(home, deadline_s))
    if sidecar is None:  # none, damaged, or the store does not answer: it cannot say
        return
    ours = manifest["checksum"]["value"]
    if sidecar["checksum"]["value"] == ours or landed_first(manifest, file_order(sidecar)):
        return
    now = home.target.read_manifest(home.key)
    if (now or {}).get("checksum", {}).get("value") != ours:
        return  # replaced while the load ran: the save read was published, before it
    sidecar = _sidecar(lambda: read_sidecar(home, deadline_s=deadline_s)) or sidecar  # its own save's may have landed
    if sidecar["checksum"]["value"] == ours:
        return
    log.warning(
        "fastckpt: %s is not the save its sidecar %s%s published: the object holds an older save (requested at %s, "
        "checksum %s) than the sidecar's (requested at %s, checksum %s). Either it was overwritten with older bytes "
        "after its save (a sync or restore tool, a copy: copy the save the sidecar names back), or two saves of "
        "this path raced and the one called first landed last (its sidecar write failed, or is still under way). "
        "Loaded what the object holds; fastckpt verify %s says whether it is whole.",
        home.url, home.url, SIDECAR, _when(manifest), ours, _when(sidecar), sidecar["checksum"]["value"], home.url)


def landed_first(manifest: dict, published_at: float) -> bool:
    """Whether the object whose own manifest is ``manifest`` holds a save of its URL no older than
    the one its sidecar published (``published_at``, its ``file_order``): the object of that later
    save landed and its sidecar did not follow (docs/faults.md). Such an object loads, judged by
    its own manifest, and ``fastckpt latest``/``verify`` judge it so too (``cli._files.as_landed``)."""
    return file_order(manifest) >= published_at


def _sidecar(read: Callable[[], dict | None]) -> dict | None:
    """What ``read`` returns; None when the sidecar is damaged or the store does not answer."""
    try:
        return read()
    except (OSError, ValueError):
        return None


def _when(manifest: dict) -> str:
    return datetime.datetime.fromtimestamp(file_order(manifest), datetime.timezone.utc).isoformat(
        timespec="milliseconds")
