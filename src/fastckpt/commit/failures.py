"""What the ranks of a group commit raise when it does not complete: one message each, shared by
rank 0 and the others, with a store (``attempt.py``) and without one (``fallback.py``)."""

from __future__ import annotations

import threading

from ..errors import CheckpointWriteError, CommitTimeoutError, GroupRemovedError
from ..storage.places import Place


class Unsaved:
    """Per group, the files of this rank's attempt whose save did not happen, each with why
    (``Coordinator``: ``commit`` then raises ``unsaved_error``); a later save of the path clears it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._why: dict[str, dict[str, str]] = {}  # group -> path -> why its save did not happen

    def mark(self, group: str, path: str, why: str) -> None:
        with self._lock:
            self._why.setdefault(group, {})[path] = why

    def clear(self, group: str, path: str) -> None:
        with self._lock:
            self._why.get(group, {}).pop(path, None)

    def groups(self) -> dict[str, dict[str, str]]:
        """Every group with a file whose save did not happen, each with its files' whys."""
        with self._lock:
            return {g: dict(why) for g, why in self._why.items() if why}

    def pop(self, group: str) -> dict[str, str] | None:
        """The group's marks, which end with its attempt."""
        with self._lock:
            return self._why.pop(group, None)


def aborted_error(label: str, why: str) -> CheckpointWriteError:
    """What the other ranks raise when one rank's save into the group failed (``why``: which
    rank, and its error; kept on the exception for the outcome record)."""
    err = CheckpointWriteError(f"checkpoint group {label} not committed: its save failed on another rank ({why}). "
                               "The group stays incomplete; the previous checkpoint is intact.")
    err.why = why  # type: ignore[attr-defined]
    return err


def closed_error(label: str, rank: int, unsaved: str | None = None) -> CheckpointWriteError:
    """Why a rank that closed its Checkpointer (``close()``, the exit flush) ends the attempts it began
    and never committed (``Coordinator.close``): what the other ranks' commits then raise names it
    (``unsaved``: the files whose save raised, each with why, where that is all it did in the group)."""
    why = f": its save of {unsaved} did not happen" if unsaved else ""
    return CheckpointWriteError(f"rank {rank} closed its Checkpointer without committing group {label}{why}")


def unsaved_error(label: str, files: str) -> CheckpointWriteError:
    """What a rank raises at ``commit`` when its save of ``files`` (each with why) into the group
    did not happen: the group would lack them, so it is not committed (``Teller.refuse``)."""
    return CheckpointWriteError(
        f"checkpoint group {label} not committed: this rank's save of {files} did not happen, and the group would "
        "lack it. It ends on every rank; the group stays incomplete and the previous checkpoint is intact. To "
        "commit a group after such a failure, save the file again before commit() (a save of the same path that "
        "succeeds counts).")


def removed_error(place: Place) -> GroupRemovedError:
    return GroupRemovedError(f"checkpoint group {place.label} was removed while it was being committed "
                             "(Checkpointer.remove); nothing of it is published")


def vanished_error(place: Place) -> GroupRemovedError:
    """What a rank without a store raises when the group's directory went while it waited for the
    manifest, and no deletion of its published attempt was recorded (``trimmed.py``): removed
    before it was published."""
    return GroupRemovedError(f"checkpoint group {place.label} was deleted while this rank waited for rank 0 to "
                             "publish it, and no deletion of this attempt once published was recorded (retention "
                             "and remove() record one): it was removed before it was published (Checkpointer.remove "
                             "on some rank), or deleted outside fastckpt. Save the group again to commit it")


def not_committed(place: Place, missing: list[int], world_size: int, timeout_s: float,
                  why: str = "") -> CommitTimeoutError:
    return CommitTimeoutError(
        f"checkpoint group {place.label} not committed: ranks {missing} of {world_size} did "
        f"not commit within {timeout_s:.0f} s{why}. The group stays incomplete (readers skip it); "
        "check those ranks' logs, or raise commit_timeout_s for slow storage.")


def left_behind(place: Place, me: int | None, newer: str | None, why: str | None = None) -> CommitTimeoutError:
    """What a rank raises when rank 0 ended its attempt (``why``: the recorded outcome) or moved
    on to the ``newer`` one without it (``own_attempt``)."""
    what = f"moved on to a newer attempt ({newer})" if newer is not None else \
        f"ended this rank's attempt without it ({why})"
    return CommitTimeoutError(
        f"checkpoint group {place.label} not committed on rank {me}: rank 0 {what} before this rank "
        "committed its files (rank 0 gave up waiting for this rank, or was restarted). This rank's "
        "files are not part of any published attempt; save the group again on this rank to join "
        "rank 0's current attempt (the previous checkpoint is intact).")
