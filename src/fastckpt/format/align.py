"""The page alignment of a file's large records (a constant of its own, without torch: the
readers of the command line import it, ``format.layout`` lays files out by it)."""

ALIGN = 4096  # page alignment, as O_DIRECT and GDS need
