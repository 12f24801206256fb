"""``check_s3_options``: every endpoint a user can give is checked, wherever it is given."""

from __future__ import annotations

import pytest

from fastckpt.errors import ConfigError
from fastckpt.storage.s3_options import check_s3_options, endpoint_key


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


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_a_bad_endpoint_in_the_environment_is_named(monkeypatch, var: str) -> None:
    """The documented way to name the endpoint, with its scheme forgotten, was a bare ValueError
    ("Invalid endpoint") from inside aiobotocore: a CLI traceback, a ValueError from latest/load."""
    import fastckpt

    monkeypatch.setenv(var, "127.0.0.1:9000")
    with pytest.raises(ConfigError, match=rf"the environment variable {var} is not a URL of the form http://"):
        fastckpt.latest("s3://some-bucket/run")
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")  # botocore ignores it then: so do we
    check_s3_options("s3://bucket", {})
    monkeypatch.delenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
    check_s3_options("s3://bucket", {"endpoint_url": "http://127.0.0.1:8333"})  # the options' endpoint wins


def test_a_bad_endpoint_in_the_profile_is_a_config_error(monkeypatch, tmp_path) -> None:
    """An endpoint no check sees before the client is built (the profile's ``endpoint_url``):
    botocore's ValueError as it builds the client becomes a ConfigError naming where to fix it."""
    from fastckpt.storage.fsspec import FsspecTarget

    (tmp_path / "config").write_text("[profile p]\nendpoint_url = 127.0.0.1:9000\nregion = us-east-1\n")
    for k, v in {"AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_PROFILE": "p", "AWS_ACCESS_KEY_ID": "k",
                 "AWS_SECRET_ACCESS_KEY": "s"}.items():
        monkeypatch.setenv(k, v)
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    t = FsspecTarget("s3://some-bucket/run", retry_deadline_s=0)
    with pytest.raises(ConfigError, match=r"the S3 endpoint is not a valid URL .*AWS_ENDPOINT_URL or the profile"):
        t.list("")


def test_every_bucket_of_one_endpoint_has_one_endpoint_key(monkeypatch) -> None:
    """Whether an endpoint answered (``reach.answered``) is kept by this key: every bucket of one
    store, however its endpoint is spelt, shares it; another store, or another profile's default, does not."""
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    at = {"endpoint_url": "http://127.0.0.1:8333"}
    one = {endpoint_key(f"s3://{b}", o) for b, o in (("ckpts", at), ("exports", {"endpoint_url": "HTTP://127.0.0.1:8333/"}),
                                                      ("x", {"client_kwargs": at}), ("y", {**at, "key": "other"}))}
    assert len(one) == 1
    assert endpoint_key("s3://ckpts", {"endpoint_url": "http://127.0.0.1:9000"}) not in one
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")
    assert endpoint_key("s3a://z", {}) in one  # the environment's endpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert endpoint_key("s3://a", {}) == endpoint_key("s3://b", {}) != endpoint_key("s3://a", {"profile": "minio"})
    assert endpoint_key("http://host:8080", {}) != endpoint_key("http://other:8080", {})
