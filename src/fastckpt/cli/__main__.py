"""``python -m fastckpt.cli ...``: the same as the ``fastckpt`` script."""

import sys

from . import main

sys.exit(main())
