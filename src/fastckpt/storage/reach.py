"""Whether a target's endpoint was never reached: a first request that could not connect at all
(no such host, connection refused) means a wrong or missing endpoint, to be told in seconds, not
an outage to retry for ``retry_deadline_s``. Apart from ``storage/s3.py`` since every fsspec
protocol asks it, each with its own advice (an S3 endpoint is set apart from the URL; an http(s)://
host is in it)."""

from __future__ import annotations

import errno
import socket

from .types import TargetUnreachableError, storage_error

S3_FIX = ("Set it with AWS_ENDPOINT_URL, or storage_options={'endpoint_url': 'http://host:port'} (Checkpointer, "
          "fastckpt.latest/load, FastCkptIO; --storage-options on the command line)")


def unreachable(exc: BaseException, what: str, endpoint: str, fix: str = S3_FIX) -> TargetUnreachableError | None:
    """The error for a first request that could not connect at all (``exc``'s chain holds a DNS
    failure or a refused connection), naming ``endpoint`` and how to ``fix`` it, or None: the
    endpoint is wrong or missing, not down for a while, so the caller should hear it in seconds
    rather than after ``retry_deadline_s``."""
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return None
        if isinstance(cur, (socket.gaierror, ConnectionRefusedError)):
            break
        cur = cur.__cause__ or cur.__context__
    else:
        return None
    why = "no such host" if isinstance(cur, socket.gaierror) else "connection refused"
    default = " (AWS's default: no endpoint_url was given)" if "amazonaws.com" in endpoint else ""
    return storage_error(TargetUnreachableError, f"{what}: cannot reach the endpoint {endpoint}{default}: {why} "
                         f"({cur}). The first request to it failed, so this is taken for a wrong or missing "
                         f"endpoint rather than an outage. {fix}, and check that the store is up and reachable "
                         "from this node", exc,
                         errno.EHOSTUNREACH if isinstance(cur, socket.gaierror) else errno.ECONNREFUSED)
