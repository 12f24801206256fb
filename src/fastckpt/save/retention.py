"""Retention and every deletion: how many checkpoints to keep in the burst buffer and at the
durable home, and ``remove``.

A checkpoint enters the lists only once it is verified at its durable home, so a local copy is never deleted
before its replica is verified. The lists are in the order the saves began, not the order they became durable (two
uploads run at once, and a large older one may finish last), so the newest verified save is never deleted (both
limits are >= 1).

The one exception is a group that replication dropped (``replicate_policy="coalesce"``): it never gets a replica.
One that would have moved its directory's ``latest`` is listed, in its place in save order, once a group of a
later step in the same directory, saved after it, is verified at its home and moves ``latest``: so a DeepSpeed or
Megatron job whose replication falls behind does not fill its burst buffer. A single file that replication dropped
stays: it may be a checkpoint the user still names (a Lightning top-k file) and loads from this node.

Deletions wait for nothing: only finished checkpoints are listed, a name being saved again leaves the lists until
that save is durable (each save of a name is told apart by the token ``replacing`` returns: an older save of the
name that ends later changes nothing), and ``Checkpointer.remove`` waits for saves in flight before it calls
``remove`` here. A new save of a name waits for a trim still deleting an older save of it (``replacing``). Each
deletion goes through the checkpoint's home (``storage.homes``) and removes its publication record first
(``commit.deletion.delete_checkpoint``).

The burst buffer outlives the process: a restarted job finds the copies its earlier runs left there. The first
time a checkpoint in a directory becomes durable, the local list takes in, oldest first, the other checkpoints in
that directory's burst-buffer copy whose copy at the durable home is the same save (same checksum; a group's
local copy is complete only once it was published): the single files this rank wrote and, the first time a group
of a known step there is durable (a single file durable first knows no step), its groups of earlier steps; a
single file in a numbered directory (``step-5/state.pt``) also takes in this rank's single files in the numbered
directories beside it of earlier steps, once per run. A checkpoint whose step is unknown or not below the one
just saved is left alone: a job resumed from an older checkpoint saves those tags again, and another rank may be
writing into them. So ``keep_local`` bounds the burst buffer across restarts, and a local copy that never reached
its home is never deleted. A group earlier runs left unpublished at an earlier step can never load: this rank's
files of it (their manifest names it as their group; a single file in a numbered directory is not one) are
removed. ``keep_persistent`` counts the checkpoints this process saved: what earlier runs left at the durable
home is the user's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import posixpath
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager

from ..commit.deletion import delete_checkpoint, only_checkpoint
from ..commit.foreign import group_step
from ..commit.protocol import pointed_name, read_group_manifest
from ..commit.removable import check_removable
from ..commit.trimmed import keep_for
from ..storage.homes import Homes
from ..urls import same_place
from .failed import FailedGroups, FailedTrims, delete_failed, push
from .restarts import Looked, delete_own_group_files, earlier_copies, earlier_steps, numbered_dirs

log = logging.getLogger("fastckpt")


class Retention:
    """Args:
        keep_local, keep_persistent: the options of the same names.
        homes: resolves names to their targets.
        local_copies: the burst-buffer copies of a name (several with striped ``local_dir``s: a
            group's files may live on every drive); ``remove`` asks for them ``spelled=True``.
        rank: this process's rank: of the single files earlier runs left, only its own count.
        in_flight: the futures of a group's saves and commits in flight (``InFlight.of_group``).
        commit_timeout_s: how long the other ranks wait for a group: a trim's record stays longer.
    """

    def __init__(self, keep_local: int | None, keep_persistent: int | None, homes: Homes,
                 local_copies: Callable[..., list[str]], rank: int = 0,
                 in_flight: Callable[[str], list[Future]] = lambda group: [], commit_timeout_s: float = 600.0) -> None:
        self._keep_local, self._keep_persistent, self._rank = keep_local, keep_persistent, rank
        self._trimmed_keep_s = keep_for(commit_timeout_s)  # (``commit.trimmed``)
        self._homes, self._local_copies = homes, local_copies
        self._local: dict[str, int] = {}  # listed name -> its save's token: the lists are in save order
        self._persistent: dict[str, int] = {}
        self._lock = threading.Lock()
        self._looked = Looked()  # what earlier runs left, taken in
        self._tokens = itertools.count(1)  # one per save, in the order the saves began
        self._busy: dict[str, int] = {}  # name -> its newest save in flight (a failed save's name stays: save.failed)
        self._dropped: dict[str, tuple[int, int]] = {}  # group -> (token, step) of a save replication dropped
        self._listed_drops: set[str] = set()  # dropped groups in the local list: this rank deletes its files only
        self._replaced: dict[str, int] = {}  # name being saved again -> its persistent-list token before
        self._deleting: dict[str, int] = {}  # name -> deletions of it decided and not yet done
        self._deleted = threading.Condition(self._lock)
        self._next_export: dict[str, bool] = {}  # path -> whether its next save is an export (save(export=True))
        self._exports: set[int] = set()  # the tokens of those saves: keep_persistent neither counts nor deletes them
        self._trims = FailedTrims(self._persistent, "at its home (delete it yourself, or with Checkpointer.remove)")
        self._local_trims = FailedTrims(self._local, "in the burst buffer (delete it yourself)")  # save.failed
        self._failed = FailedGroups(keep_local is not None, self._lock, self._busy, in_flight, self._deciding,
                                    self._delete_failed)  # this rank's group attempts that failed
        # a group's copy other ranks of this node may still use (replication dropped it): only this rank's files of it
        self._delete_own_files = functools.partial(delete_own_group_files, homes, local_copies, rank=rank)

    def exempt(self, path: str, export: bool) -> None:
        """The next save of ``path`` is an export or not: the mark goes with that save's token."""
        with self._lock:
            self._next_export[path] = export

    def replacing(self, path: str) -> int:
        """A new save of ``path`` (a file or group) began: until it is durable, no trim may delete
        the copies it is replacing (a group's burst-buffer directory is the one it writes into).
        A trim of an older save of ``path`` that is still deleting it (a slow object-store
        request) is waited for: it would delete what this save writes. Returns the save's
        token, for ``durable`` and ``dropped``."""
        with self._lock:
            while path in self._deleting:
                self._deleted.wait()
            if path in self._persistent:  # a re-save of it whose commit fails lists the published one again
                self._replaced[path] = self._persistent[path]
            self._forget(path)
            token = self._busy[path] = next(self._tokens)
            if self._next_export.pop(path, False):
                self._exports.add(token)
            return token

    def exporting(self, token: int) -> bool:
        """Whether save ``token`` is an export (replication never coalesces it with checkpoints)."""
        with self._lock:
            return token in self._exports

    def watch_commit(self, commit: Future, group: str, token: int, step: int | None = None) -> None:
        """If the commit ``token`` of ``group`` (of ``step``) fails, the group published before it
        (if this rank listed one) is still whole at its home: it takes its old place in the
        persistent list again (else no later trim would ever delete it); see ``failing`` too."""
        commit.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                 or self._commit_failed(group, token, step))

    def _commit_failed(self, group: str, token: int, step: int | None) -> None:
        with self._lock:
            old = self._replaced.pop(group, None)
            if old is not None and self._busy.get(group) == token and group not in self._persistent:
                self._persistent[group] = old
        self._failed.mark(group, token, step)

    def failing(self, group: str, step: int | None) -> AbstractContextManager[None]:
        """An error raised in the block ends this rank's attempt at ``group`` (of ``step``): its
        files leave the burst buffer later (``failed.FailedGroups``)."""
        return self._failed.failing(group, step)

    def saving(self, path: str) -> int | None:
        """The token of the newest save of ``path`` in flight."""
        with self._lock:
            return self._busy.get(path)

    def committing(self, group: str) -> int:
        """This rank commits ``group``: a group's place in the lists is its commit's, as its place
        in ``latest``'s order is (``requested_at``), not its first save's: a rank that saved no
        file into it, or groups saved in one order and committed in another, must never make
        retention delete the group ``latest`` names. Returns the token for ``ended``."""
        with self._lock:
            token = self._busy[group] = next(self._tokens)
            return token

    def ended(self, path: str, dropped: bool, has_local: bool, owns_persistent: bool, token: int | None = None,
              step: int | None = None) -> None:
        """Save ``token`` of ``path`` ended: verified at its home, or ``dropped`` for a newer one."""
        if dropped:
            self.dropped(path, token, step)
        else:
            self.durable(path, has_local, owns_persistent, token, step)

    def durable(self, path: str, has_local: bool, owns_persistent: bool, token: int | None = None,
                step: int | None = None) -> None:
        """``path`` (a file or group; ``token``: its save, None for the newest; ``step``: a
        group's that moves ``latest``) is verified at its durable home; trim both lists."""
        with self._lock:
            mine = self._busy.get(path) if token is None else token  # None: the newest save's, as of now
            if self._busy.get(path, mine) != mine:
                return  # a newer save of path is in flight: it takes path into the lists once durable
        earlier = self._earlier_local(path, step) if has_local and self._keep_local is not None else []
        with self._lock:  # it ends only now: a save of path may have begun during the scan
            if listed := self._busy.get(path, mine) == mine:
                self._busy.pop(path, None)
                self._replaced.pop(path, None)
            token = next(self._tokens) if token is None else token
            ahead = [p for p in earlier if p not in self._local and p not in self._busy]
            self._local.update({p: i - len(ahead) for i, p in enumerate(ahead)})  # before any save of this run
            if ahead:
                log.info("fastckpt: keep_local=%d also counts %d burst-buffer copies that earlier runs left beside %s",
                         self._keep_local, len(ahead), path)
            self._local.update(self._replaced_drops(path, token, step) if has_local else {})
            failed = self._failed.beside(path, token, step) if has_local and listed else []  # decided
            drop_local = push(self._local, path, token, self._keep_local) if has_local and listed else []
            drop_persistent = push(self._persistent, path, token, self._keep_persistent) \
                if owns_persistent and listed and token not in self._exports else []
            self._exports.discard(token)
            own = {p for p in drop_local if p in self._listed_drops}
            self._listed_drops -= own
            self._deciding([*drop_local, *drop_persistent])
        for g in failed:
            self._delete_failed(g)
        for p in drop_local:  # (a dropped group's files of this rank: not listed again, its other ranks' may stay)
            self._run(self._delete_own_files if p in own else self._delete_local, p, "burst-buffer copy",
                      None if p in own else self._local_trims)
        for p in drop_persistent:
            self._run(self._trim_persistent, p, "persistent copy", self._trims)

    def bypassed(self, path: str, token: int) -> None:
        """Save ``token`` of the single file ``path`` went straight to its home (no room in the burst buffer) and
        is durable there: an earlier save's burst-buffer copy is stale, so it goes (unless a newer save is in flight)"""
        with self._lock:
            if self._busy.get(path, token) != token:
                return
            self._local.pop(path, None)
            self._deciding([path])
        self._run(self._delete_local, path, "stale burst-buffer copy")

    def dropped(self, path: str, token: int | None = None, step: int | None = None) -> None:
        """Replication dropped the save ``token`` of ``path`` for a newer checkpoint: only its
        burst-buffer copy exists. A group of a known ``step`` that moves ``latest`` counts once a
        later one beside it is durable; anything else stays."""
        with self._lock:
            if self._ended(path, token) and self._keep_local is not None and token is not None \
                    and step is not None:
                self._dropped[path] = (token, step)

    def _ended(self, path: str, token: int | None) -> bool:
        """Save ``token`` of ``path`` ended; False when a newer save of path is in flight."""
        if token is not None and self._busy.get(path, token) != token:
            return False
        self._busy.pop(path, None)
        return True

    def _replaced_drops(self, path: str, token: int, step: int | None) -> dict[str, int]:
        """The dropped groups beside group ``path`` (save ``token``, ``step``) that began before it
        and are of earlier steps, with their tokens."""
        if step is None:
            return {}
        parent = posixpath.dirname(path)
        old = {p: t for p, (t, s) in sorted(self._dropped.items(), key=lambda kv: kv[1]) if t < token and s < step
               and posixpath.dirname(p) == parent and p not in self._busy and p not in self._local}
        for p in old:
            del self._dropped[p]
        self._listed_drops.update(old)
        if old:
            log.info("fastckpt: keep_local=%d now counts the burst-buffer copies of %s: replication dropped them for "
                     "newer checkpoints", self._keep_local, ", ".join(old))
        return old

    def _forget(self, path: str) -> None:
        self._dropped.pop(path, None)
        self._trims.done(path)
        self._local_trims.done(path)
        self._failed.forget(path)
        self._listed_drops.discard(path)
        self._local.pop(path, None)
        self._persistent.pop(path, None)

    def remove(self, path: str, check: bool = True) -> None:
        """Delete both copies of ``path`` (a file or a group) now and stop tracking it.

        Raises:
            ConfigError: with ``check``, a copy of ``path`` is no checkpoint (``commit.removable``): nothing goes.
        """
        if check:
            check_removable(self._homes.resolve(path))
            for local in self._local_copies(path, spelled=True):  # a file is ours: not read; a directory is checked
                if not (loc := self._homes.resolve(local)).target.exists(loc.key):
                    check_removable(loc)
        with self._lock:  # the save's own spelling too (through a link, or not): it is tracked, and its copy goes
            for spelt in (same := same_place(path, [*self._local, *self._persistent, *self._dropped])):
                self._forget(spelt)
        for spelt in same:
            self._delete_local(spelt, spelled=True)  # also a copy saved through the folder a link in path names
        self._delete_persistent(path)

    def _earlier_local(self, path: str, step: int | None) -> list[str]:
        """Once per directory for its single files, and once more for its groups at its first
        durable group of a known ``step`` (a single file durable first knows no step to count
        groups below): the checkpoints beside ``path`` that earlier runs left in the burst buffer
        and that are safe at their home, oldest first."""
        parent = posixpath.dirname(path)
        with self._lock:
            files, groups, steps = self._looked.first(path, step)
        if not files and not groups:
            return []
        try:
            group = read_group_manifest(self._homes.resolve(path).place()) if groups else None
            mine = group_step(group or {}, path) if groups else None
            mirrors = self._local_copies(parent)
            earlier, complete = earlier_copies(self._homes, mirrors, path, self._rank, files, mine)
            earlier = (earlier_steps(self._homes, self._local_copies, path, self._rank) if steps else []) + earlier
            unpublished = self._unpublished_earlier(  # only below the step its published manifest records
                numbered_dirs(mirrors, parent, complete, mine) if group is not None and mine is not None else set())
        except (OSError, ValueError) as exc:  # retention must not fail a save: say so, count none of them
            log.warning("fastckpt: retention could not look at what earlier runs left in the burst buffer "
                        "beside %s: %s", path, exc)
            return []
        for g in unpublished:
            self._run(self._delete_own_files, g, "files this rank left in the unpublished burst-buffer copy")
        return earlier

    def _unpublished_earlier(self, names: set[str]) -> list[str]:
        """Of the numbered directories ``names`` (of steps below a group just durable), those
        that hold nothing this run saved, is saving or tracks: groups that earlier runs left
        unpublished in the burst buffer (a job killed before their commit, or one whose
        replication dropped them). They can never load (a group loads once published), and this
        run goes on from a later step: this rank's files of them are removed."""
        with self._lock:
            used = [*self._busy, *self._local, *self._dropped]
            gone = sorted(n for n in names if not any(u == n or u.startswith(n + "/") for u in used))
            self._deciding(gone)
            return gone

    def _delete_local(self, path: str, spelled: bool = False) -> None:
        for local in self._local_copies(path, spelled=True) if spelled else self._local_copies(path):
            delete_checkpoint(self._homes.resolve(local))

    def _delete_failed(self, group: str) -> None:
        self._run(lambda g: delete_failed(self._homes, self._local_copies, g, self._rank), group,
                  "files this rank left in the failed group's burst-buffer copy")

    def _delete_persistent(self, path: str) -> None:  # remove(): a published group's deletion is recorded too
        delete_checkpoint(self._homes.resolve(path), self._trimmed_keep_s)  # (a late rank reports it committed)

    def _trim_persistent(self, path: str) -> None:
        """keep_persistent's deletion: never of what its directory's ``latest`` names among other
        checkpoints (a last line of defence; ``remove`` deletes it, as asked): it is listed again, the
        oldest, for later. A file alone in its folder goes with that folder's pointer (``commit.deletion``).
        A group's trim is recorded first (``commit.trimmed``): a rank still waiting for it is told."""
        loc = self._homes.resolve(path)
        if pointed_name(loc.place().parent()) == posixpath.basename(loc.key.rstrip("/")) \
                and not (loc.target.exists(loc.key) and only_checkpoint(loc)):
            log.warning("fastckpt: retention kept %s: its directory's latest names it (until it moves on)", path)
            with self._lock:
                self._persistent.setdefault(path, min(self._persistent.values(), default=0) - 1)
            return
        delete_checkpoint(loc, self._trimmed_keep_s)

    def _deciding(self, names: list[str]) -> None:
        """(Under the lock.) ``names`` are to be deleted: a new save of one waits in ``replacing``
        until ``_run`` has done it, so that the deletion, decided for an older save, never
        removes the new one's copies (at an object store a delete can take seconds)."""
        for n in names:
            self._deleting[n] = self._deleting.get(n, 0) + 1

    def _run(self, fn: Callable[[str], None], path: str, what: str, trims: FailedTrims | None = None) -> None:
        try:
            fn(path)
            log.info("fastckpt: retention removed the %s of %s", what, path)
        except FileNotFoundError:  # another rank sharing this burst buffer removed it first
            log.debug("fastckpt: the %s of %s was already removed", what, path)
        except Exception as exc:  # noqa: BLE001 (retention must not fail a save; say so and go on)
            with self._lock:  # a keep_local or keep_persistent deletion (``trims``) is tried again later
                again, trims = trims.failed(path) if trims else "", None
            log.warning("fastckpt: retention could not remove the %s of %s: %s%s", what, path, exc, again)
        finally:
            with self._lock:
                if trims:  # removed, or gone already
                    trims.done(path)
                if (left := self._deleting.get(path, 0) - 1) > 0:
                    self._deleting[path] = left
                else:
                    self._deleting.pop(path, None)
                self._deleted.notify_all()

