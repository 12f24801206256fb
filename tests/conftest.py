"""Shared fixtures. The SeaweedFS S3 fixture lives in tests/conftest_s3.py."""

import importlib.util

if importlib.util.find_spec("tests.conftest_s3") is not None:
    pytest_plugins = ["tests.conftest_s3"]
