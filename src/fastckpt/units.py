"""Byte units, defined once (binary: a MiB is 2**20 bytes; SI GB = 1e9 is spelled out where used),
and how sizes are printed: in SI units everywhere (tables, logs, progress), as storage is rated."""

from collections.abc import Callable

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SI_BYTES = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))


def in_unit(x: float, units: tuple[tuple[str, float], ...], rnd: Callable[[float], float]) -> tuple[float, str]:
    """``x`` rounded (``rnd``) in the largest of ``units`` (largest first) where it is at least 1,
    else in the last: rounded first, then the unit chosen, so 999.7e6 B is 1 GB, never 1e+03 MB."""
    for unit, scale in units:
        value = rnd(x / scale)
        if abs(value) >= 1:
            return value, unit
    unit, scale = units[-1]
    return rnd(x / scale), unit


def fmt_bytes(n: float | None, digits: int = 3) -> str:
    """SI bytes, ``digits`` significant figures: ``1.12 TB``; ``-`` for None."""
    if n is None:
        return "-"
    value, unit = in_unit(n, _SI_BYTES, lambda v: float(f"{v:.{digits}g}"))
    return f"{value:,.0f} {unit}" if unit == "B" or abs(value) >= 1000 else f"{value:.{digits}g} {unit}"


def sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant figures, whole numbers never in e-notation: ``217``,
    ``0.0123``, and ``43,200`` (not ``4.32e+04``) once it has more whole digits than that."""
    r = float(f"{x:.{digits}g}")
    return f"{x:,.0f}" if abs(r) >= 10 ** digits else f"{r:.{digits}g}"
