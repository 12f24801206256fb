"""A read-only, seekable file over any source of byte ranges (for torch's and zipfile's readers).

In format/ (the lowest layer) because the layout reads sparse images through it too."""

from __future__ import annotations

import io
from collections.abc import Callable


class RangeReader(io.RawIOBase):
    """A file of ``size`` bytes whose ``read`` asks ``fetch(lo, hi)`` for ``[lo, hi)``."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes]) -> None:
        self._size, self._fetch, self._pos = size, fetch, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._size}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        data = self._fetch(self._pos, end) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return data

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)
