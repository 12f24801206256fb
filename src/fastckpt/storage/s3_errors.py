"""How S3 errors are classified: transient (retried with backoff until ``retry_deadline_s``:
``TRANSIENT_CODES``, ``transient_status``, ``transient_types``) or permanent (``permanent_error``:
a ``ReplicationError`` naming the fix, raised at once). The upload itself is ``s3.py``'s."""

from __future__ import annotations

import errno
from collections.abc import Callable

from ..errors import ReplicationError
from .types import BucketNotFoundError, TargetNotFoundError, TargetPermissionError, storage_error

TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "RequestTimeoutException", "InternalError",
                              "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                              "TooManyRequests", "500", "502", "503", "504",
                              # the body's checksum did not match what the store received: send it again
                              "BadDigest", "XAmzContentSHA256Mismatch",
                              # a conditional put raced another write of the key: S3 asks to retry
                              "ConditionalRequestConflict"})
AUTH_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                         "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "403"})
# 5xx statuses that retrying cannot mend, failed at once: a feature or HTTP version the store
# lacks (501 NotImplemented, 505), a server or proxy misconfigured (506, 508, 510) or asking for a
# login (511 Network Authentication Required). Every other 5xx is retried (``transient_status``).
PERMANENT_5XX = frozenset({501, 505, 506, 508, 510, 511})
# what aborts a multipart upload behind its writer's back (NoSuchUpload at its next request)
ABORTERS = ("another node's clean_incomplete(), a bucket lifecycle rule AbortIncompleteMultipartUpload whose "
            "DaysAfterInitiation is shorter than an upload takes, or a cleanup script")


def transient_status(status: int) -> bool:
    """Whether an HTTP error status is retried, whatever the error's code: 429 Too Many Requests and
    every 5xx but ``PERMANENT_5XX``. A 5xx is the server's or a gateway's failure, not the request's
    (RFC 9110, 15.6): botocore's standard mode retries only 500, 502, 503 and 504 (its legacy mode
    509 too), but a CDN's 520-524 in front of the store, or MinIO's 507 while a drive is briefly
    full, pass as those do."""
    return status == 429 or (500 <= status <= 599 and status not in PERMANENT_5XX)


def permanent_error(exc: BaseException, what: str, bucket: str, endpoint: Callable[[], str]) -> ReplicationError | None:
    """The ``ReplicationError`` for a permanent error of a request to ``bucket`` (None: not a
    storage error, re-raise it): a missing bucket or object, refused credentials, any other
    refusal; each message names ``what`` and the fix."""
    ce = client_error(exc)
    name = type(exc).__name__
    if ce is not None:
        code, status, message = ce
        if code == "NoSuchBucket":
            return storage_error(BucketNotFoundError, f"{what}: bucket {bucket!r} does not exist at "
                                 f"{endpoint()}: create it (e.g. `aws s3 mb s3://{bucket}`) or fix the "
                                 "target URL", exc, errno.ENOENT)
        if code == "NoSuchUpload":  # the bucket and key are fine: the upload was ended under its writer
            return storage_error(ReplicationError, f"{what}: the multipart upload is gone (NoSuchUpload): it was "
                                 f"aborted meanwhile, by {ABORTERS}; stop that while jobs save there, then save "
                                 "again", exc, errno.EIO)
        if code in ("NoSuchKey", "404") or status == 404:
            return storage_error(TargetNotFoundError, f"{what}: not found ({code or status}); if the object "
                                 f"should be there, check that bucket {bucket!r} exists", exc, errno.ENOENT)
        if code == "NotImplemented" or status == 501:
            return storage_error(ReplicationError, f"{what}: the store at {endpoint()} does not implement what "
                                 f"{_operation(exc)} asked for ({code}, HTTP {status}: {message}). Retrying cannot "
                                 "help: fastckpt sends the CRC32 of every upload (x-amz-checksum-crc32) and creates "
                                 "claim files with If-None-Match, as S3 does; upgrade the store to a version that "
                                 "implements them, or save to another store or a file system path", exc,
                                 errno.EOPNOTSUPP)
        if code in AUTH_CODES or status == 403:
            return storage_error(TargetPermissionError, f"{what}: {endpoint()} refused the request "
                                 f"({code}: {message}); check the credentials (AWS_ACCESS_KEY_ID/"
                                 "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options key/secret) and that "
                                 f"they may read and write bucket {bucket!r}", exc, errno.EACCES)
        return storage_error(ReplicationError, f"{what}: {code} (HTTP {status}): {message}", exc, errno.EIO)
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return storage_error(TargetPermissionError, f"{what}: no usable credentials ({exc}); set "
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options "
                             "key/secret", exc, errno.EACCES)
    if isinstance(exc, FileNotFoundError):
        return storage_error(TargetNotFoundError, f"{what}: not found ({exc})", exc, errno.ENOENT)
    if isinstance(exc, PermissionError):
        return storage_error(TargetPermissionError, f"{what}: permission denied ({exc}); check the credentials",
                             exc, errno.EACCES)
    if isinstance(exc, OSError) or type(exc).__module__.startswith(("botocore", "aiobotocore", "s3fs")):
        return storage_error(ReplicationError, f"{what}: {name}: {exc}", exc)
    return None


def transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from botocore import exceptions as b

        # ConnectionError, as botocore's standard retry mode has it: a refused or failed connection, a TLS
        # handshake that failed (SSLError), a proxy that failed (ProxyConnectionError). An endpoint never
        # reached is a wrong one, not an outage: FsspecTarget tells that apart first (reach.unreachable).
        types += [b.ConnectionError, b.ConnectionClosedError, b.ReadTimeoutError, b.HTTPClientError,
                  b.IncompleteReadError, b.ResponseStreamingError]
    except ImportError:
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:
        pass
    from fsspec.exceptions import FSTimeoutError

    return (*types, FSTimeoutError)


def client_error(exc: BaseException) -> tuple[str, int, str] | None:
    """(code, HTTP status, message) of the botocore ClientError in ``exc``'s chain, if any."""
    if (cur := _answer(exc)) is None:
        return None
    err, status = cur.response["Error"], cur.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(err.get("Code", "")), int(status or 0), str(err.get("Message", ""))


def _operation(exc: BaseException) -> str:
    """The S3 operation (``PutObject``) whose error response is in ``exc``'s chain, for messages."""
    return str(getattr(_answer(exc), "operation_name", None) or "the request")


def _answer(exc: BaseException) -> BaseException | None:
    """The botocore ClientError (an error response) in ``exc``'s chain, if any."""
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None or (isinstance(resp := getattr(cur, "response", None), dict) and "Error" in resp):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None
