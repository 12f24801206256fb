"""Byte units, defined once (binary: a MiB is 2**20 bytes; SI GB = 1e9 is spelled out where used),
and how sizes are printed: in SI units everywhere (tables, logs, progress), as storage is rated."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def fmt_bytes(n: float | None) -> str:
    """SI bytes: ``1.12 TB``; ``-`` for None."""
    if n is None:
        return "-"
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
