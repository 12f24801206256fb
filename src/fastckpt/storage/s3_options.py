"""Checks of the S3 ``storage_options`` a user gives, before the client is built from them.

s3fs builds its botocore client at the first request, so a typo there ("minio:9000", a port
out of range, ``{"client_kwargs": 5}``) surfaced as a Python ``ValueError``, ``TypeError`` or
``AttributeError`` from deep inside botocore, on a background thread or as a CLI traceback.
Each is refused here with a ``ConfigError`` naming the option and the form it takes; no value
is repeated (the options hold secrets). The same holds for the endpoint botocore takes from the
environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``) when the options give none; one from
elsewhere (a profile's ``endpoint_url``) is caught as the client is built (``bad_endpoint``).
"""

from __future__ import annotations

import hashlib
import os
from urllib.parse import urlsplit

from ..errors import ConfigError, ReplicationError
from ..urls import split_url
from .types import TargetUnreachableError, storage_error

_STRINGS = ("key", "secret", "token", "profile")
_OBJECTS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs")


def check_s3_options(url_root: str, opts: dict) -> None:
    """Raise ``ConfigError`` for an ``endpoint_url`` that is not ``http(s)://host[:port]``, a
    credential that is not a string, or a ``*_kwargs`` option that is not an object."""
    given = _endpoints(opts)
    where = f"storage_options for {url_root}" if given else f"S3 endpoint for {url_root}"
    for name, endpoint in given or _env_endpoint():
        ok = isinstance(endpoint, str)
        try:
            parts = urlsplit(endpoint) if ok else None
            ok = ok and parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 1) > 0
        except ValueError:  # "http://[::1", a port out of range
            ok = False
        if not ok:
            raise ConfigError(f"{where}: {name} is not a URL of the form http://host:port or https://host[:port] "
                              "(e.g. http://127.0.0.1:8333); fix the scheme, host and port")
    for name in _STRINGS:
        if opts.get(name) is not None and not isinstance(opts[name], str):
            raise ConfigError(f"{where}: {name} must be a string (it is a {type(opts[name]).__name__}); quote it "
                              "in the JSON")
    for name in _OBJECTS:
        if opts.get(name) is not None and not isinstance(opts[name], dict):
            raise ConfigError(f"{where}: {name} must be a JSON object of botocore options (it is a "
                              f"{type(opts[name]).__name__}), e.g. {{\"region_name\": \"us-east-1\"}}")
    retries = (opts.get("config_kwargs") or {}).get("retries")
    if retries is not None and not isinstance(retries, dict):
        raise ConfigError(f"{where}: config_kwargs.retries must be an object such as {{\"max_attempts\": 3}}, "
                          f"not a {type(retries).__name__}")


def bad_endpoint(exc: ValueError, what: str) -> ReplicationError | None:
    """The ``ConfigError`` for botocore's ``ValueError`` ("Invalid endpoint: ...") as it builds the
    client from an endpoint no check above saw (a profile's ``endpoint_url``); None for another."""
    if type(exc) is not ValueError or not any(w in str(exc).lower() for w in ("endpoint", "url")):
        return None
    return storage_error(TargetUnreachableError, f"{what}: the S3 endpoint is not a valid URL ({exc}): set "
                         "endpoint_url (storage_options, AWS_ENDPOINT_URL or the profile's endpoint_url) to "
                         "http://host:port or https://host[:port]", exc)


def _endpoints(opts: dict) -> tuple[tuple[str, object], ...]:
    """The endpoints ``opts`` give (either place s3fs takes one from), with the option's name."""
    ck = opts.get("client_kwargs")
    given = (("endpoint_url", opts.get("endpoint_url")),
             ("client_kwargs.endpoint_url", ck.get("endpoint_url") if isinstance(ck, dict) else None))
    return tuple((n, e) for n, e in given if e is not None)  # (s3fs passes a top-level None on)


def _env_endpoint() -> tuple[tuple[str, str], ...]:
    """botocore's own endpoint when the options give none: the S3 variable wins over the general one."""
    env = next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(v)), None)
    ignored = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"
    return () if env is None or ignored else ((f"the environment variable {env}", os.environ[env]),)


def store_tag(url: str, opts: dict | None) -> str:
    """Which store ``url`` is at, as the burst buffer tells stores apart (``urls.mirror_path``):
    ``""`` for the default endpoint, else ``"@"`` and 10 hex digits of the SHA-256 of the endpoint
    (``storage_options``, or for ``s3://`` the environment's): one bucket and key on two stores are
    two checkpoints, whose local copies must not replace each other. The endpoint is hashed in one
    spelling of it (``_spelled_once``), so runs that write one store two ways share its place."""
    endpoint = _given(url, opts or {})
    return "" if endpoint is None else "@" + hashlib.sha256(_spelled_once(endpoint).encode()).hexdigest()[:10]


def endpoint_key(url_root: str, opts: dict) -> str:
    """Where the requests of a target at ``url_root`` go, for whether that endpoint has answered
    (``reach.answered``), whichever bucket a request was for: for s3:// the endpoint given
    (``storage_options``, else the environment's) in ``store_tag``'s spelling, with none the profile
    that picks one (its endpoint_url, else AWS's); for another protocol its bucket (an http(s) URL's: its host)."""
    if url_root.split("://", 1)[0] not in ("s3", "s3a"):
        return split_url(url_root)[0]
    endpoint = _given(url_root, opts)
    return _spelled_once(endpoint) if endpoint is not None else f"s3 profile {opts.get('profile') or _profile()}"


def _given(url: str, opts: dict) -> str | None:
    """The endpoint ``opts`` give for ``url``, or for s3:// the environment's; None: the default."""
    given = _endpoints(opts) or (_env_endpoint() if url.split("://", 1)[0] in ("s3", "s3a") else ())
    return given[0][1] if given and isinstance(given[0][1], str) else None


def _profile() -> str:
    """The AWS profile the environment names (botocore's variables for it), when the options name none."""
    return ",".join(os.environ.get(v, "") for v in ("AWS_DEFAULT_PROFILE", "AWS_PROFILE"))


def _spelled_once(endpoint: str) -> str:
    """``endpoint`` as one URL has it however written: scheme and host in lower case (both are
    case-insensitive), no default port (``:80`` for http, ``:443`` for https), no trailing '/'
    (``HTTP://Store:80/`` is ``http://store``), no user and password (the same store for any). A
    host name and its IP address stay two places: telling them apart takes a lookup, whose answer can
    change."""
    try:
        parts = urlsplit(endpoint.strip())
        port = parts.port
    except ValueError:  # malformed: check_s3_options refuses it before any copy is placed
        return endpoint.rstrip("/")
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
    port_s = "" if port is None or (scheme, port) in (("http", 80), ("https", 443)) else f":{port}"
    rest = parts.path.rstrip("/") + (f"?{parts.query}" if parts.query else "")
    return f"{scheme}://{host}{port_s}{rest}"
