"""The repository passes ruff with the rules pyproject.toml selects (pycodestyle, pyflakes,
import order, bugbear), at the ruff release the dev extra pins."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs it)")
    res = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True, text=True, timeout=120,
                         check=False, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
