"""Whether a target's endpoint was never reached: a first request that could not connect at all
(no such host, connection refused, a TLS handshake that failed) means a wrong or missing endpoint,
to be told in seconds, not an outage to retry for ``retry_deadline_s``. Apart from ``storage/s3_errors.py``
since every fsspec protocol asks it, each with its own advice (an S3 endpoint is set apart from the
URL; an http(s):// host is in it)."""

from __future__ import annotations

import errno
import socket
import ssl
import urllib.parse

from .types import TargetUnreachableError, storage_error

S3_FIX = ("Set it with AWS_ENDPOINT_URL, or storage_options={'endpoint_url': 'http://host:port'} (Checkpointer, "
          "fastckpt.latest/load, FastCkptIO; --storage-options on the command line)")
S3_TRUST = "AWS_CA_BUNDLE=/path/ca.pem, or storage_options={'client_kwargs': {'verify': '/path/ca.pem'}}"
HTTP_TRUST = "SSL_CERT_FILE=/path/ca.pem"
# The endpoints (``s3_options.endpoint_key``) that answered a request in this process: a refused connection
# after that is an outage to ride out for every target there (each bucket of one store: Homes makes a target
# per bucket; each fastckpt.latest/load call makes its own), not a wrong endpoint.
_answered: set[str] = set()


def answered(endpoint: str) -> bool:
    """Whether a request to ``endpoint`` had an answer (any response, an error too) in this process."""
    return endpoint in _answered


def mark_answered(endpoint: str) -> None:
    """A request to ``endpoint`` had an answer: from now on its failures to connect are outages."""
    _answered.add(endpoint)


def _tls_setup(err: ssl.SSLError) -> bool:
    """Whether a failed handshake is this node's set-up (an HTTP port, a certificate: however the
    OpenSSL in use words it), not a busy terminator's alert (``..._ALERT_...``: retried). aiohttp's
    wrapper has no ``reason``: its text has."""
    return "ALERT" not in (getattr(err, "reason", None) or str(err)).upper()


def unreachable(exc: BaseException, what: str, endpoint: str, fix: str = S3_FIX,
                trust: str = S3_TRUST, reached: bool = False) -> TargetUnreachableError | None:
    """The error for a first request that could not connect at all (``exc``'s chain holds a DNS
    failure, a refused connection or a TLS handshake failed by this node's setup), naming
    ``endpoint`` and how to ``fix`` it (``trust``: how to trust a certificate), or None: the
    endpoint is wrong or missing, not down for a while, so the caller should hear it in seconds
    rather than after ``retry_deadline_s``. Once the endpoint was ``reached``, only a certificate
    this node does not trust (one rotated or expired) is no outage."""
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return None
        if isinstance(cur, ssl.SSLCertVerificationError) or (not reached and (
                isinstance(cur, (socket.gaierror, ConnectionRefusedError))
                or isinstance(cur, ssl.SSLError) and _tls_setup(cur))):
            break
        cur = cur.__cause__ or cur.__context__
    else:
        return None
    if isinstance(cur, ssl.SSLError):  # https:// at a plain-HTTP port, an untrusted certificate
        return storage_error(TargetUnreachableError, f"{what}: the TLS handshake with the endpoint {endpoint} "
                             f"failed ({cur}). This is taken for a wrong scheme or certificate rather than an "
                             "outage: if the store serves plain HTTP, give its endpoint as "
                             "http://, not https://; if its certificate is self-signed or from a private CA, have "
                             f"this node trust it ({trust})", exc, errno.EPROTO)
    why = "no such host" if isinstance(cur, socket.gaierror) else "connection refused"
    default = " (AWS's default: no endpoint_url was given)" if "amazonaws.com" in endpoint else ""
    return storage_error(TargetUnreachableError, f"{what}: cannot reach the endpoint {endpoint}{default}: {why} "
                         f"({cur}). The first request to it failed, so this is taken for a wrong or missing "
                         f"endpoint rather than an outage. {fix}, and check that the store is up and reachable "
                         "from this node", exc,
                         errno.EHOSTUNREACH if isinstance(cur, socket.gaierror) else errno.ECONNREFUSED)


def proxy_refused(exc: BaseException) -> bool:
    """A proxy (HTTPS_PROXY) that answered it would not connect to the store (407: credentials,
    403: a host it does not allow; aiohttp's error in the chain carries the status): set-up, not an
    outage, though botocore counts it a ConnectionError. A proxy down or slow is an outage."""
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return False
        if getattr(cur, "status", None) in (403, 407) and "proxy" in type(cur).__name__.lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def silent_endpoint(exc: BaseException) -> str | None:
    """The endpoint (``scheme://host:port``) whose answer ``exc``'s chain timed out waiting for
    (botocore's read timeout): it accepted the connection but sent nothing in time (a hung
    server, a load balancer with no backend behind it), or None when no read timed out."""
    try:
        from botocore.exceptions import ReadTimeoutError
    except ImportError:  # no S3 client here: no S3 request timed out
        return None
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return None
        if isinstance(cur, ReadTimeoutError):
            url = urllib.parse.urlsplit(str(cur.kwargs.get("endpoint_url", "")))
            return f"{url.scheme}://{url.netloc.rpartition('@')[2]}" if url.netloc else "the endpoint"
        cur = cur.__cause__ or cur.__context__
    return None
