"""The S3 upload behind ``FsspecTarget.put_file`` (how S3 errors are classified: ``s3_errors``).

A file no larger than one part is one ``PutObject``; a larger one is a multipart upload with
parts on ``parallelism`` threads, each retried on its own; S3 makes the object visible only at
``CompleteMultipartUpload``. Any failure aborts the upload.

Integrity in flight. Every body (part, object) is sent with its CRC32 (``x-amz-checksum-crc32``,
computed here from the bytes read); the store recomputes it over the bytes it received,
refuses the request on a mismatch (``BadDigest``, retried like a transient error) and returns
it, and the returned value is compared with the one sent. With ``expect`` (``put_file``), the
same bytes are hashed with the ``fastckpt.format.checksum`` tree (parts are then whole multiples of
its 16 MiB block) and the upload is completed only if they hash to the manifest's checksum;
``PutResult.verified`` is then True when the store returned a checksum for every part (a store
that returns none leaves it False, and the caller reads the object back). Because the CRC32
protects the body, the SigV4 signature does not hash it (``payload_signing_enabled=False``,
the ``UNSIGNED-PAYLOAD`` of the S3 API), which saves a SHA-256 pass over every byte on plain
``http://`` endpoints (on ``https://`` botocore already skips it when a checksum is sent); give
``config_kwargs={"s3": {"payload_signing_enabled": True}}`` to sign bodies anyway.

A multipart upload aborted by someone else while its parts upload (``s3_errors.ABORTERS``) answers
``NoSuchUpload``: the upload starts again from its first part, ``UPLOAD_STARTS`` times in all, and
then fails naming the cause. Not after a Complete that may have landed (``_complete``)."""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime

from ..errors import ConfigError, CorruptCheckpointError, ReplicationError
from ..format import checksum
from ..io.ops import FileOps, pread_exact
from ..units import MiB
from .s3_errors import ABORTERS, client_error
from .types import (
    Expected,
    TokenBucket,
    source_changed,
    storage_error,
)

log = logging.getLogger(__name__)
S3_MIN_PART_BYTES = 5 * MiB
S3_MAX_PARTS = 10_000
UPLOAD_STARTS = 3  # multipart uploads of one file, each aborted behind fastckpt's back, before it gives up


class _UploadGone(ReplicationError):
    """The multipart upload answered ``NoSuchUpload`` to a part or to its first Complete: something
    aborted it (its parts are gone with it). Never retried as is, never wrapped (``retry._FINAL``)."""


def _gone(exc: BaseException) -> bool:
    return (ce := client_error(exc)) is not None and ce[0] == "NoSuchUpload"


def drop_expect_100(request: object, **_: object) -> None:
    """botocore ``before-send`` hook: send bodies at once instead of awaiting ``100 Continue``."""
    request.headers.pop("Expect", None)  # type: ignore[attr-defined]


_loaders: dict[object, object] = {}
_loaders_lock = threading.Lock()


def share_loader(session: object) -> None:
    """Give ``session`` the process's botocore data loader for its data path, so that a new
    session (every ``fastckpt.load``, ``latest`` or CLI call on a URL makes one) does not parse
    botocore's endpoint and S3 model JSON again: that took 100-250 ms of every such call.
    The loader only reads and caches those files, as it does for every client of one session."""
    key = session.get_config_variable("data_path")  # type: ignore[attr-defined]
    with _loaders_lock:
        loader = _loaders.get(key)
        if loader is None:
            loader = _loaders[key] = session.get_component("data_loader")  # type: ignore[attr-defined]
    session.register_component("data_loader", loader)  # type: ignore[attr-defined]


def mtime(info: dict) -> float:
    """Modification time from an fsspec info dict (keys differ by backend); unknown: now."""
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return time.time()


@dataclass(frozen=True)
class S3Session:
    """What an upload needs from its ``FsspecTarget``: one S3 request (``call(method, **kwargs)``, no retries),
    its retry policy (``retry(what, fn, progress=, cancel=, deadline_s=)``), a HEAD, the file seam, the limits."""

    call: Callable[..., dict]
    retry: Callable[..., object]
    head: Callable[[str], dict]
    ops: FileOps
    parallelism: int
    retry_deadline_s: float
    pool: Callable[[int, str], AbstractContextManager]  # the target's ``transient_pool``


def put_s3(t: S3Session, fd: int, local_path: str, url: str, obj: str, size: int, limiter: TokenBucket | None,
           chunk_bytes: int, progress, expect: Expected | None) -> int:
    """Upload the open file ``fd`` to the object ``obj`` (``url`` for messages); return the number of
    parts. Sets ``progress.verified`` when the store confirmed every part's CRC32 and ``expect`` held."""
    if chunk_bytes < S3_MIN_PART_BYTES:
        raise ConfigError(f"chunk_bytes={chunk_bytes} is below S3's minimum part size: use >= 5 MiB")
    part = max(chunk_bytes, -(-size // S3_MAX_PARTS))  # S3 allows 10,000 parts: grow parts to fit
    if expect is not None:  # whole checksum blocks per part, so that parts hash independently
        part = -(-part // checksum.BLOCK_BYTES) * checksum.BLOCK_BYTES
    covered = size if expect is None else expect.covered
    n_parts = max(1, -(-size // part))
    digests: list[list[int]] = [[] for _ in range(n_parts)]
    confirmed = [False] * n_parts
    buffers = threading.local()  # one part buffer per sending thread, reused: no page faults per part

    def read(i: int) -> tuple[bytearray, str]:
        """Part ``i``'s bytes and CRC32; their tree digests go to ``digests[i]``."""
        off = i * part
        n = min(part, size - off)
        data = getattr(buffers, "buf", None)
        if data is None or len(data) != n:
            data = buffers.buf = bytearray(n)
        pread_exact(t.ops, fd, memoryview(data), off, n, local_path)
        if expect is not None:
            mv = memoryview(data)[: max(0, covered - off)]
            digests[i] = [checksum.block_digest(mv[o:o + checksum.BLOCK_BYTES])
                          for o in range(0, len(mv), checksum.BLOCK_BYTES)]
        return data, crc32_header(data)

    def call(method: str, body: bytearray, **kw: object) -> dict:
        if limiter is not None:  # each try sends the body again: each counts against the cap
            limiter.consume(len(body))
        return t.call(method, Key=obj, Body=body, **kw)

    def check_echo(i: int, what: str, crc: str, resp: dict) -> None:
        echoed = resp.get("ChecksumCRC32")
        if echoed is not None and echoed != crc:
            raise CorruptCheckpointError(f"{what}: the store acknowledged CRC32 {echoed}, {crc} was sent: the "
                                         "bytes it stored are not the bytes sent; upload again")
        confirmed[i] = echoed is not None

    def check_source() -> None:  # and that it may still be published (``Expected.publishing``)
        if expect is not None:
            got = checksum.combine(d for ds in digests for d in ds)
            if got != expect.xxh3:
                raise source_changed(local_path, f"hashes to {got} ({checksum.ALGO}), its manifest says "
                                     f"{expect.xxh3}")
            expect.publishing()

    if size <= part:
        data, crc = read(0)
        check_source()  # before the PutObject: a single object is visible as soon as it lands
        what = f"upload of {url}"
        check_echo(0, what, crc, t.retry(what, lambda: call("put_object", data, ChecksumCRC32=crc), progress=progress))
        progress.verified = expect is not None and all(confirmed)
        progress.add(size)
        return 1
    reported = [0] * n_parts  # each part's bytes counted in ``progress``: a fresh upload counts none twice

    def upload(upload_id: str) -> None:
        parts: list[dict] = [{}] * n_parts
        cancel = threading.Event()

        def send(i: int) -> None:
            if cancel.is_set():
                return
            data, crc = read(i)
            what = f"upload of part {i + 1}/{n_parts} of {url}"

            def one() -> dict:
                try:
                    return call("upload_part", data, UploadId=upload_id, PartNumber=i + 1, ChecksumCRC32=crc)
                except Exception as exc:
                    if _gone(exc):
                        raise _UploadGone(f"{what}: the upload was aborted (NoSuchUpload)") from exc
                    raise

            resp = t.retry(what, one, progress=progress, cancel=cancel)
            check_echo(i, what, crc, resp)
            parts[i] = {"PartNumber": i + 1, "ETag": resp["ETag"], "ChecksumCRC32": crc}
            progress.add(len(data) - reported[i])
            reported[i] = len(data)

        with t.pool(min(t.parallelism, n_parts), "fastckpt-put") as pool:
            futures = [pool.submit(send, i) for i in range(n_parts)]
            try:  # a part that failed for good stops the others at once, wherever it is in the order
                wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in futures if f.done() and f.exception() is not None]
                for f in [f for f in failed if isinstance(f.exception(), _UploadGone)] + failed + futures:
                    f.result()  # the upload gone first: the other parts' errors follow from it
            except BaseException:
                cancel.set()  # parts not started are skipped; running ones stop retrying
                raise
        check_source()  # before Complete: nothing becomes visible unless the bytes were right
        _complete(t, url, obj, upload_id, parts, size, progress)

    for start in range(1, UPLOAD_STARTS + 1):
        upload_id = t.retry(f"start of the multipart upload of {url}", lambda: t.call(
            "create_multipart_upload", Key=obj, ChecksumAlgorithm="CRC32")["UploadId"], progress=progress)
        try:
            upload(upload_id)
            break
        except _UploadGone as exc:  # nothing to abort: it is gone
            if start == UPLOAD_STARTS:
                raise storage_error(ReplicationError, f"upload of {url}: its multipart upload was aborted while it "
                                    f"ran, {start} times in a row (NoSuchUpload): something aborts incomplete uploads "
                                    f"under this key: {ABORTERS}. Stop it while jobs save there, or make the rule's "
                                    "DaysAfterInitiation longer than an upload takes; then save again", exc,
                                    errno.EIO) from exc
            log.warning("fastckpt: %s; starting the upload again (%d of %d): %s may have aborted it", exc, start + 1,
                        UPLOAD_STARTS, ABORTERS)
        except BaseException as exc:
            _abort(t, url, obj, upload_id, exc)
            raise
    progress.verified = expect is not None and all(confirmed)
    return n_parts

def _complete(t: S3Session, url: str, obj: str, upload_id: str, part_list: list[dict], size: int,
              progress) -> None:
    parts = {"Parts": part_list}
    made = multipart_etag(part_list)
    tried = False

    def complete() -> None:
        nonlocal tried
        try:
            t.call("complete_multipart_upload", Key=obj, UploadId=upload_id, MultipartUpload=parts)
        except Exception as exc:
            # A retried Complete whose first try did land (the reply was lost) finds no upload, and
            # the object that upload made: its ETag says so, not its size. An upload aborted in the
            # meantime (clean_incomplete, a lifecycle rule) leaves the previous object at the key,
            # often of the same size (a re-saved last.ckpt): that one never counts as this upload.
            if not tried and _gone(exc):  # no Complete of it landed: aborted after its last part
                raise _UploadGone(f"completion of the multipart upload of {url}: the upload was aborted "
                                  "(NoSuchUpload)") from exc
            if tried and _gone(exc):
                head = t.head(obj)
                if int(head["ContentLength"]) == size and made is not None and head.get("ETag") == made:
                    return
                raise storage_error(ReplicationError, f"completion of the multipart upload of {url}: the upload is "
                                    f"gone (NoSuchUpload), and the object there is not the one it makes (ETag "
                                    f"{head.get('ETag')}, not {made}): it was aborted meanwhile (clean_incomplete, "
                                    "a lifecycle rule); upload again", exc, errno.EIO) from exc
            tried = True
            raise

    t.retry(f"completion of the multipart upload of {url}", complete, progress=progress)


def multipart_etag(part_list: list[dict]) -> str | None:
    """The ETag S3 gives the object a multipart upload of ``part_list`` makes: the MD5 of its
    parts' MD5s (their ETags), then ``-N``; None when a part's ETag is no MD5 (a store that
    makes them otherwise: nothing then passes for this upload's object)."""
    try:
        md5s = b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in part_list)
    except ValueError:
        return None
    return f'"{hashlib.md5(md5s).hexdigest()}-{len(part_list)}"'

def _abort(t: S3Session, url: str, obj: str, upload_id: str, exc: BaseException) -> None:
    try:
        t.retry(f"abort of the multipart upload of {url}", lambda: t.call(
            "abort_multipart_upload", Key=obj, UploadId=upload_id), deadline_s=min(10.0, t.retry_deadline_s))
    except Exception as abort_exc:
        log.warning("could not abort multipart upload %s of %s: %s", upload_id, url, abort_exc)
        exc.add_note(f"The multipart upload {upload_id} of {url} could not be aborted ({abort_exc}); "
                     "clean_incomplete() or a bucket lifecycle rule (AbortIncompleteMultipartUpload) removes it.")


def crc32_header(data: bytes) -> str:
    """The ``x-amz-checksum-crc32`` value of ``data``: base64 of the big-endian CRC32."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def put_if_absent(call: Callable[..., dict], obj: str, body: bytes) -> bool:
    """One ``PutObject`` of ``obj`` with ``If-None-Match: *``; False when it had an object
    already (412 PreconditionFailed). A store that ignores the header overwrites: check first."""
    try:
        call("put_object", Key=obj, Body=body, ChecksumCRC32=crc32_header(body), IfNoneMatch="*")
    except Exception as exc:
        if (ce := client_error(exc)) is not None and (ce[0] == "PreconditionFailed" or ce[1] == 412):
            return False
        raise
    return True
