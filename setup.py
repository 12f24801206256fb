"""Package discovery (the rest of the build is in pyproject.toml): every package under src/,
plus the integrations/ folder, which ships as ``fastckpt.integrations``."""

from setuptools import find_packages, setup

setup(packages=[*find_packages("src"),
                *(f"fastckpt.{p}" for p in find_packages(".", include=["integrations", "integrations.*"]))])
