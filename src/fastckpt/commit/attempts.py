"""Telling attempts at one group apart, through torch.distributed's key-value store.

A re-save of the same tag (a resumed run re-saving ``global_step{N}``) is a new attempt. Every
rank of one attempt agrees on a token without a collective (collectives must never run on
background threads): each rank adds 1 to a per-group counter in the process group's store at
its first touch of the group (``add``, ``check`` and ``get`` are safe from any thread), so
attempt k collects the counts k*W+1 .. (k+1)*W. Rank 0 also records each attempt's outcome
there, because the other ranks may never see the manifest itself (rank 0 can delete the group
or start a newer attempt before their next poll). Without an initialised process group there is
no store; attempts are then told apart by time (``protocol.STALE_MARKER_S``) and checksums.
"""

from __future__ import annotations


def _default_store():  # noqa: ANN202 (a torch.distributed Store, or None)
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, AttributeError):
        return None


def attempt_token(group: str, world_size: int) -> str | None:
    """A token every rank of one attempt at ``group`` (a normalised name) agrees on, or None
    without a store."""
    store = _default_store() if world_size > 1 else None
    if store is None:
        return None
    n = store.add(f"fastckpt/attempt/{group}", 1)
    return str((n - 1) // world_size)


def _outcome_key(group: str, token: str) -> str:
    return f"fastckpt/outcome/{group}/{token}"


def announce_outcome(group: str, token: str | None, superseded: bool = False) -> None:
    """Rank 0: record that this attempt was published (or dropped)."""
    store = _default_store() if token is not None else None
    if store is not None:
        store.set(_outcome_key(group, token), b"superseded" if superseded else b"published")  # type: ignore[arg-type]


def outcome(group: str | None, token: str | None) -> bytes | None:
    """What rank 0 announced for this attempt, or None (not yet, or no store)."""
    store = _default_store() if group is not None and token is not None else None
    if store is None:
        return None
    key = _outcome_key(group, token)  # type: ignore[arg-type]
    return bytes(store.get(key)) if store.check([key]) else None
