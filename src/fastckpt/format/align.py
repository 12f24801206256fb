"""The page alignment of a file's large records, and rounding up to it (without torch: the
readers of the command line import it, ``format.layout`` lays files out by it, ``io`` and
``load`` size their O_DIRECT reads and buffers by it)."""

ALIGN = 4096  # page alignment, as O_DIRECT and GDS need


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a
