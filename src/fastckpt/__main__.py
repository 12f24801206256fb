"""``python -m fastckpt ...``: the ``fastckpt`` command, as ``python -m fastckpt.cli``."""

import sys

from .cli import main

sys.exit(main())
