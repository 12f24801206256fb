"""``FsspecTarget.clean_incomplete``: the leftovers of interrupted uploads to an object store, found
and removed (temp keys of an fsspec store; open multipart uploads on S3). Apart from the target's
transfer code, which is at its size limit, since it shares none of it but the retry loop."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..io.atomic import is_tmp
from .s3 import mtime

if TYPE_CHECKING:
    from .fsspec import FsspecTarget


def clean_incomplete(t: FsspecTarget, prefix: str, older_than_s: float) -> int:
    """``Target.clean_incomplete`` for ``t``: how many leftovers started before ``older_than_s``
    ago were removed."""
    cutoff = time.time() - older_than_s
    removed = 0
    if not t.is_s3:
        t.fs.invalidate_cache()
        for p, info in t.fs.find(t.root, detail=True).items():
            key = p[len(t.root) + 1:]
            if is_tmp(key.rsplit("/", 1)[-1]) and key.startswith(prefix) and mtime(info) < cutoff:
                t.fs.rm_file(p)
                removed += 1
        return removed
    base = f"{t.prefix}/" if t.prefix else ""
    marker: dict = {}
    while True:
        page = t._retry(f"listing of multipart uploads under {t.url}/{prefix}", lambda m=marker: t._s3(
            "list_multipart_uploads", Prefix=base + prefix, **m))
        for up in page.get("Uploads", []):
            if up["Initiated"].timestamp() < cutoff:
                t._retry(f"abort of a stale multipart upload of {up['Key']}", lambda u=up: t._s3(
                    "abort_multipart_upload", Key=u["Key"], UploadId=u["UploadId"]))
                removed += 1
        if not page.get("IsTruncated"):
            return removed
        marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
