"""fastckpt's version, defined once (pyproject.toml reads the same number)."""

__version__ = "0.1.0"
