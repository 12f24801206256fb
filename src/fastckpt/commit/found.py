"""What a scan finds (``discovery``): complete checkpoints (``Found``) and damaged ones
(``Damaged``), and the order it gives them."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..storage.homes import Location
from . import foreign


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: its path or URL, ``kind`` ("file" or "group"), its order and manifest.

    ``foreign``: what wrote it, when not fastckpt (``"torch.save"``, ``"DeepSpeed"``): it has no
    fastckpt manifest (``manifest`` is empty) and loads unverified. ``step``: the training step it
    records, when that was read (ordering among foreign checkpoints needs it).
    """

    path: str
    kind: str
    time: float
    manifest: dict
    foreign: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class Damaged:
    """A checkpoint whose publication record (a group's manifest, a file's own manifest or
    sidecar) is damaged: never a candidate, but an operator's listing must show it."""

    path: str
    kind: str
    problem: str


def ordered(loc: Location, prefix: str, own: list[Found], others: list[Found]) -> list[Found]:
    """Oldest first: by time, or, with foreign checkpoints among them and a step for every one,
    by step, then time."""
    if others:
        own = [replace(f, step=_step(loc, prefix, f)) for f in own]
    found = own + others
    by_step = bool(others) and all(f.step is not None for f in found)
    found.sort(key=lambda f: (f.step if by_step else 0, f.time, f.path))
    return found


def one_copy_each(own: list[Found]) -> list[Found]:
    """One entry per save. Two copies of one save carry the same manifest: a burst-buffer copy
    inside the scanned root (a ``local_dir`` under the checkpoint directory) or a file copied
    within it. The copy nearest the root stands for the save (the burst-buffer copy, deeper
    by its mirrored path, is never named by ``latest``)."""
    best: dict[str, Found] = {}
    for f in own:
        key = f"{f.kind} {json.dumps(f.manifest, sort_keys=True, default=str)}"
        have = best.get(key)
        if have is None or (f.path.count("/"), f.path) < (have.path.count("/"), have.path):
            best[key] = f
    return list(best.values())


def _step(loc: Location, prefix: str, f: Found) -> int | None:
    if f.kind == "group":
        step = f.manifest.get("step")
        return step if isinstance(step, int) else None
    key = prefix + f.path[len(loc.url):].lstrip("/")
    try:
        return foreign.pickle_step(loc.target, key)
    except OSError:
        return None
