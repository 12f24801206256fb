"""keep_persistent deletions that failed, for ``Retention`` (docs/burst-buffer.md, step 6).

A keep_persistent deletion that fails (EIO, an object store down for longer than
``retry_deadline_s``) was forgotten: the name had left the persistent list before it was
deleted, so no later trim tried again and the home kept that checkpoint for good. It goes back
into the list as its oldest entry, so the next trim tries it again, up to ``TRIM_TRIES`` times.
"""

from __future__ import annotations

TRIM_TRIES = 3  # failed keep_persistent deletions of one checkpoint before it is left to the user


class FailedTrims:
    """The keep_persistent deletions that failed, by name; its methods run under Retention's lock."""

    def __init__(self) -> None:
        self._tries: dict[str, int] = {}

    def failed(self, listed: dict[str, int], path: str) -> str:
        """Deleting ``path`` failed: list it again in ``listed`` (name -> token), the oldest, unless
        it failed ``TRIM_TRIES`` times. Returns what happens next, for the warning."""
        tries = self._tries[path] = self._tries.get(path, 0) + 1
        if tries >= TRIM_TRIES:
            self.done(path)
            return (f"; gave up after {tries} tries: it stays at its home (delete it yourself, or with "
                    "Checkpointer.remove)")
        listed.setdefault(path, min(listed.values(), default=0) - 1)
        return f"; the next trim tries again ({tries} of {TRIM_TRIES})"

    def done(self, path: str) -> None:
        self._tries.pop(path, None)
