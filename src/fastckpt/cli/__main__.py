"""``python -m fastckpt.cli ...``: the ``fastckpt`` command without its script on PATH."""

import sys

from . import main

sys.exit(main())
