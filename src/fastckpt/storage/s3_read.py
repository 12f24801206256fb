"""One ranged GET of an S3 object, of one version of it: the S3 side of
``Target.read_range(version=)`` (``storage.reads`` says why a read asks for one version); and a
listing with sizes (``Target.sizes``, ``list``).

s3fs's ``cat_file`` neither sends a condition nor returns the answer's ETag, and it parses the
key out of a path, where it takes ``?versionId=`` for a version to ask for (a key holding it is
legal, and listed as such: another key was read). So the GET is made here through s3fs's client,
with the key as it is: ``If-Match`` with the ETag the read saw first (SeaweedFS and AWS S3
answer another version with 412 PreconditionFailed), and the ETag of the answer compared too,
for a store that ignores the condition.
"""

from __future__ import annotations

from collections.abc import Callable

from .s3_errors import client_error
from .types import ObjectChangedError


def get_range(fs: object, bucket: str, obj: str, start: int, end: int | None, version: str | None, url: str,
              timeout_s: float) -> bytes:
    """Bytes ``[start, end)`` of ``obj`` in ``bucket`` through the s3fs file system ``fs`` (the whole
    object: ``end`` None, ``start`` 0), in one request bounded by ``timeout_s``; with ``version``
    (an ETag), of that version only.

    Raises:
        ObjectChangedError: naming ``url``: the object is another version now.
    """
    from fsspec.asyn import sync

    if end is not None and end <= start:
        return b""
    cond = ({"IfMatch": version} if version else {}) | ({} if end is None else {"Range": f"bytes={start}-{end - 1}"})

    async def get() -> tuple[bytes, str | None]:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=obj, **cond)  # type: ignore[attr-defined]
        try:
            return await resp["Body"].read(), resp.get("ETag")
        finally:
            resp["Body"].close()

    try:
        data, etag = sync(fs.loop, get, timeout=timeout_s)  # type: ignore[attr-defined]
    except OSError as exc:
        ce = client_error(exc)
        if version is None or ce is None or (ce[0] != "PreconditionFailed" and ce[1] != 412):
            raise
        etag = None
    if version is not None and etag != version:
        raise ObjectChangedError(f"{url} is no longer version {version} (now {etag or 'another'})")
    return data


def list_sizes(page: Callable[..., dict], base: str, prefix: str, **kw: str) -> dict[str, int]:
    """Key (less ``base``) -> size of the objects whose keys start with ``base + prefix``, page by
    page; ``page``: one ``list_objects_v2`` request with these arguments."""
    out: dict[str, int] = {}
    token: dict = {}
    while True:
        got = page(Prefix=base + prefix, **kw, **token)
        out.update((c["Key"][len(base):], int(c["Size"])) for c in got.get("Contents", []))
        if not got.get("IsTruncated"):
            return out
        token = {"ContinuationToken": got["NextContinuationToken"]}
