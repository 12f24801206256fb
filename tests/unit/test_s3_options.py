"""``check_s3_options``: every endpoint a user can give is checked, wherever it is given."""

from __future__ import annotations

import pytest

from fastckpt.errors import ConfigError
from fastckpt.storage.s3_options import check_s3_options


@pytest.mark.parametrize("opts", [
    {"client_kwargs": {"endpoint_url": "minio:9000"}},
    {"endpoint_url": None, "client_kwargs": {"endpoint_url": "minio:9000"}},  # was passed: top-level None won
    {"endpoint_url": "http://127.0.0.1:8333", "client_kwargs": {"endpoint_url": "http://[::1"}},
])
def test_a_bad_endpoint_in_client_kwargs_is_named(opts: dict) -> None:
    with pytest.raises(ConfigError, match=r": client_kwargs\.endpoint_url is not a URL of the form"):
        check_s3_options("s3://bucket", opts)


def test_a_bad_top_level_endpoint_is_named_as_such() -> None:
    with pytest.raises(ConfigError, match=r"s3://bucket: endpoint_url is not a URL of the form"):
        check_s3_options("s3://bucket", {"endpoint_url": "minio:9000",
                                         "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}})


def test_good_endpoints_pass() -> None:
    check_s3_options("s3://bucket", {"endpoint_url": None, "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}})
    check_s3_options("s3://bucket", {"endpoint_url": "https://s3.example:443", "client_kwargs": {"region_name": "x"}})
