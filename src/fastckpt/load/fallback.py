"""Judging a burst-buffer copy by its home: as a group's file (``check_group``), and whether it
may stand in for a damaged home copy (``load.verdict``'s
``HOME_FIRST``: the home file's manifest does not read, or it is no complete zip).

Such a home file cannot say which save it holds. It may be this save's copy with a damaged tail
(then the local copy is the same save, intact), or another node's newer save of the same path
that got damaged (then the local copy is older state, and loading it would silently resume from
the past). So the local copy is the fallback only when the home shows it is the same save: for a
group's file, the group published at the home names the local copy's checksum; otherwise every
byte the home file still holds of the local copy's covered range (all of them, or the part left
by a cut) equals the local copy's. A home file zeroed whole, or holding other bytes, proves
nothing: the load raises ``CorruptCheckpointError`` naming both copies (``refused``).

A load may ask the home's group manifest twice about one burst-buffer copy (whether the copy is
of the save the home holds, or may stand in for it; then whether the copy read is of the group):
within ``one_load`` it is read once (``home_group``), not once per question. So is a single
file's sidecar at a URL (``home_sidecar``: which copy to read, and whether the copy may stand in
for the damaged object, in ``load.verdict``; whether the object read is the save it published, in
``load.published``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from ..commit.membership import InGroup, group_entry, require_complete_group
from ..commit.names import GROUP_MANIFEST, SIDECAR
from ..commit.protocol import read_group_manifest, read_sidecar
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format.checksum import BLOCK_BYTES
from ..storage.homes import Homes, Location
from ..storage.places import Place
from ..storage.types import TargetUnavailableError

log = logging.getLogger("fastckpt")

#: ``where`` of a burst-buffer copy that is not of the damaged home's save: never read
OTHER_SAVE = "local (another save)"
#: How long the check that the burst-buffer copy is of the save at an object-store home retries
#: a store that does not answer, before the local copy is loaded anyway (as without the check):
#: the sidecar's read (``home_sidecar``) and ``load.verdict``'s read of the object's tail.
SAME_SAVE_CHECK_S = 5.0
#: The home group manifests (and sidecars) this thread's load in progress has read (``one_load``), by URL
_READ: ContextVar[dict[str, dict | None] | None] = ContextVar("fastckpt_home_groups", default=None)


@contextlib.contextmanager
def one_load() -> Iterator[None]:
    """The scope of ``home_group``'s memo: one ``Loader.load``. Never longer: a re-save of the
    group published between two loads must be seen by the second (per-file loads that must all
    be of one save use ``Checkpointer.reading``, which reads the manifest once for all of them)."""
    token = _READ.set({})
    try:
        yield
    finally:
        _READ.reset(token)


def read_again() -> None:
    """Forget what this load read: ``Loader._read_current`` reads a file again because its group
    was published anew meanwhile, which only a fresh read of the manifest shows."""
    memo = _READ.get()
    if memo is not None:
        memo.clear()


def home_group(place: Place) -> dict | None:
    """``read_group_manifest`` of a group at a home, once per ``one_load`` (a load of each of a
    group's 600 files from the burst buffer whose home copies are damaged read it twice each)."""
    return once(place.url(GROUP_MANIFEST), lambda: read_group_manifest(place))


def once(url: str, read: Callable[[], dict | None]) -> dict | None:
    """``read()`` of the record at ``url``, once per ``one_load`` (a read that raises is not kept)."""
    memo = _READ.get()
    if memo is None:
        return read()
    if url not in memo:
        memo[url] = read()
    return memo[url]


def home_sidecar(home: Location, deadline_s: float) -> dict | None:
    """``read_sidecar`` of the single file at the URL ``home``, once per ``one_load``; None also
    when it is damaged: it says nothing, and the object's bytes decide, as without one."""
    def read() -> dict | None:
        try:
            return read_sidecar(home, deadline_s=deadline_s)
        except ValueError:
            return None

    return once(home.url + SIDECAR, read)


def home_entry(homes: Homes, url: str, manifest: dict) -> InGroup | None:
    """``group_entry`` of the file at the home ``url``, its group manifest read by ``home_group``."""
    return group_entry(homes, url, manifest, read=home_group)


def local_where(local: Location, home: Location, in_group: Callable[[Location, dict], dict | None]) -> str:
    """``"local"`` when the burst-buffer copy may be read after the damaged home copy fails, else
    ``OTHER_SAVE``. ``in_group``: ``Loader._in_group``; at a URL a single file's sidecar says which
    save was published there, as a group's manifest does (an emptied object under an intact
    sidecar naming ours: the copy loads; a damaged sidecar cannot say, as ``load.verdict`` and
    ``load.published`` take it, and the bytes decide, as without one). A home that cannot even be
    read for the comparison (EIO, a store that does not answer) shows no damage either: the copy
    is read, as the burst buffer is there for, with a WARNING naming the risk."""
    try:
        ours = local.target.read_manifest(local.key)
    except (OSError, ValueError):
        return OTHER_SAVE  # the copy's own manifest does not read: nothing vouches for it
    try:
        published = ((in_group(home, ours) or {}).get("checksum") or {}).get("value") if ours else None
        if published is None and ours and not ours.get("group") and not home.target.mounted:  # a single file's
            sidecar = home_sidecar(home, SAME_SAVE_CHECK_S)  # vouches as a group's manifest does
            published = ((sidecar or {}).get("checksum") or {}).get("value")
        return "local" if same_save(local, home, ours, published) else OTHER_SAVE
    except ValueError:  # the home's group manifest is damaged: it cannot vouch for the copy
        return OTHER_SAVE
    except OSError as exc:
        log.warning("fastckpt: %s could not be read to compare it with its burst-buffer copy %s (%s): loading the "
                    "copy; if another node saved %s since, that is older state", home.url, local.url, exc, home.url)
        return "local"


def same_save(local: Location, home: Location, ours: dict | None, published: str | None) -> bool:
    """Whether the local copy (its manifest ``ours``) is of the save the damaged home file holds.
    ``published``: the checksum the home's published group gives the file (None: no group says)."""
    if not ours:
        return False  # a local copy without a manifest proves nothing about the home's bytes
    if published is not None:
        return published == ours["checksum"]["value"]
    length = min(home.target.size(home.key), int(ours["covered"]))
    if length <= 0:
        return False
    for offset in range(0, length, BLOCK_BYTES):
        n = min(BLOCK_BYTES, length - offset)
        if home.target.read_range(home.key, offset, n) != local.target.read_range(local.key, offset, n):
            return False
    return True


def refused(home_error: BaseException, path: str, local: Location) -> BaseException:
    """The error of a load whose home copy failed and whose burst-buffer copy is of another save:
    a damaged home is corruption, never a reason to return older state."""
    if not isinstance(home_error, CorruptCheckpointError):
        home_error.add_note(f"Its burst-buffer copy {local.url} could not be shown to be of the same save (it may be "
                            "older state): not loaded instead.")
        return home_error
    err = CorruptCheckpointError(
        f"{path} is damaged ({home_error}), and its burst-buffer copy {local.url} could not be shown to be of the "
        "same save (what the home still holds of it differs or is empty: another node may have saved the path "
        "since, or another attempt of its group is published there), so it is not loaded instead: that could "
        f"resume from older state. If {path} is this save's copy, damaged, copy {local.url} over it; else restore "
        "it from another copy, or load an earlier checkpoint (fastckpt.latest(...)).")
    err.__cause__ = home_error
    return err


def check_group(homes: Homes, url: str, home: str, manifest: dict) -> None:
    """``require_complete_group`` for a copy at ``url`` of the file at ``home``. A burst-buffer
    copy is judged by the group published at its home: on a file system whenever it has one (a
    cheap read; the burst-buffer directory may keep an earlier attempt's manifest after another job
    saved the tag again), at a URL when its own directory holds no published group (a prefetch's
    download on a fresh node, a local re-save under way) or one that does not name it (an earlier
    attempt's, while the download is of the one published now). Its own directory's group decides
    only while the home cannot (nothing published there yet, or a store that does not answer)."""
    if url != home and homes.resolve(home).target.mounted:
        try:
            found = home_entry(homes, home, manifest)
        except TargetUnavailableError:
            found = None
        if found is not None and found.published is not None:
            require_complete_group(homes, home, manifest, {found.dir: found.published})
            return
    try:
        require_complete_group(homes, url, manifest)
    except IncompleteCheckpointError:
        if url == home:
            raise
        require_complete_group(homes, home, manifest)
