"""Checks of a URL target: credentials (never printed) and reachability, with fastckpt's own client."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ..config import DEFAULT_RETRY_DEADLINE_S
from ..errors import FastCkptError
from . import _core
from .findings import Finding

if TYPE_CHECKING:
    from ..storage.base import Target

T = TypeVar("T")
MIN_REQUEST_S = 1.0  # a step that starts at the deadline still gets this long (the probe object is then removed)

SECRET_KEYS = ("key", "secret", "token", "password", "access_key", "secret_key", "session_token")
AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


def _secrets(storage_options: dict) -> list[str]:
    vals = [str(v) for k, v in storage_options.items() if k in SECRET_KEYS and v]
    vals += [os.environ[k] for k in AWS_ENV[:3] if os.environ.get(k)]
    return [v for v in vals if len(v) >= 4]


def redact(text: str, secrets: list[str]) -> str:
    """``text`` with every secret value replaced by ``***``."""
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def credentials(url: str, storage_options: dict) -> Finding:
    """Where the credentials would come from; names the sources, never the values."""
    if not url.startswith(("s3://", "s3a://")):
        return Finding("target.credentials", "info", f"{url.split('://')[0]}:// credentials come from its fsspec "
                       "backend's own configuration", data={"sources": []})
    sources = [f"storage_options[{k!r}]" for k in SECRET_KEYS if storage_options.get(k)]
    sources += [f"${k}" for k in AWS_ENV if os.environ.get(k)]
    creds = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", os.path.expanduser("~/.aws/credentials"))
    if os.path.exists(creds):
        sources.append(f"{creds} (shared credentials file)")
    if storage_options.get("anon"):
        return Finding("target.credentials", "info", "anonymous access (storage_options anon=True)",
                       data={"sources": ["anon"]})
    if not sources:
        return Finding("target.credentials", "warn", "no S3 credentials found in storage_options, the environment "
                       "or ~/.aws/credentials (an instance role may still provide them)",
                       "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or pass key/secret in "
                       "storage_options", {"sources": []})
    return Finding("target.credentials", "ok", f"credentials from {', '.join(sources)} (values not shown)",
                   data={"sources": sources})


def _bounded(url: str, storage_options: dict, left_s: float) -> dict:
    """``storage_options`` with each S3 request's connect and read timeouts at most ``left_s``:
    botocore's own (60 s a read) let one request to a silent endpoint outlast the deadline."""
    if not url.lower().startswith(("s3://", "s3a://")):
        return dict(storage_options)
    cfg = dict(storage_options.get("config_kwargs") or {})
    for k in ("connect_timeout", "read_timeout"):
        given = cfg.get(k)  # None (botocore: no timeout) or not a number: the deadline's alone
        cfg[k] = min(float(given), left_s) if isinstance(given, (int, float)) and not isinstance(given, bool) \
            else left_s
    return {**storage_options, "config_kwargs": cfg}


def reachable(url: str, storage_options: dict, deadline_s: float) -> Finding:
    """List the prefix, then write and delete one small object, as replication would: each
    request (its retries included) bounded by what is left of ``deadline_s``."""
    secrets = _secrets(storage_options)
    t0 = time.monotonic()
    doing = "a listing of the prefix"

    def call(what: str, step: Callable[[Target], T]) -> T:
        nonlocal doing
        doing, left = what, max(deadline_s - (time.monotonic() - t0), MIN_REQUEST_S)
        target = _core.open_target(root, _bounded(url, storage_options, left), retry_deadline_s=left, parallelism=1)
        try:
            return step(target)
        finally:
            target.close(wait=False)

    try:
        root, key = _core.split_url(url.rstrip("/"))
        listed = call(doing, lambda t: len(t.list(key)))
        probe = "/".join(p for p in (key, f".fastckpt-doctor-{uuid.uuid4().hex[:8]}") if p)
        call("the write of a probe object", lambda t: t.put_bytes(probe, b"fastckpt doctor probe"))
        call("the removal of the probe object", lambda t: t.delete(probe))
    except (FastCkptError, OSError, ValueError) as exc:
        if (silent := _core.silent_endpoint(exc)) is not None:  # no refusal to name: no answer at all
            return Finding("target.reachable", "fail", redact(
                f"{url}: {silent} accepted the connection but did not answer {doing} within the {deadline_s:g} s "
                "doctor gives a URL target (its retries included)", secrets),
                "check the store's server behind that endpoint (hung or overloaded, or a load balancer with no "
                "healthy backend) and that endpoint_url names the store's S3 port",
                {"error": type(exc).__name__, "endpoint": silent, "deadline_s": deadline_s})
        if isinstance(exc, _core.TargetUnavailableError) and not isinstance(exc, _core.TargetUnreachableError):
            # kept failing (its advice, raise retry_deadline_s, is a save's option); unreachable: its own message
            return Finding("target.reachable", "fail", redact(
                f"{url}: {doing} kept failing for the {deadline_s:g} s doctor gives a URL target (its retries "
                f"included; last error: {exc.__cause__!r})", secrets),
                "check that the store is up and reachable from this node (its status, a proxy or load balancer in "
                f"front of it); a save retries such errors for its retry_deadline_s (default "
                f"{DEFAULT_RETRY_DEADLINE_S:g} s), then fails",
                {"error": type(exc).__name__, "deadline_s": deadline_s})
        return Finding("target.reachable", "fail", redact(f"{url}: {exc}", secrets),
                       redact("fix the URL, the endpoint (storage_options endpoint_url) or the credentials; the "
                              "message above names what the store refused", secrets),
                       {"error": type(exc).__name__})
    return Finding("target.reachable", "ok", f"{url} is reachable: listed {listed} object(s), wrote and deleted a "
                   "probe object", data={"listed": listed})
