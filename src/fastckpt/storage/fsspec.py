"""``FsspecTarget``: replication to an object store through fsspec (S3 through s3fs).

S3: a file no larger than one part is one ``PutObject``; a larger one is a multipart upload
(parts on ``parallelism`` threads, each retried on its own) that S3 makes visible only at
``CompleteMultipartUpload``, whole; any failure aborts it (``storage/s3.py``, with integrity in flight).

Endpoint and credentials come from where boto always looks (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws/config`` and ``credentials``, instance roles) unless
``storage_options`` gives them (``endpoint_url``, ``key``, ``secret``). They are never logged or put in messages.

Retries: botocore's retries (unless ``config_kwargs`` sets them) and s3fs's own loop are
switched off, so that ``Target``'s loop, bounded by ``retry_deadline_s``, is the only one.

Hangs: every S3 request is bounded. botocore's ``read_timeout`` covers a server that stops
answering, except while aiohttp waits for ``100 Continue`` before sending a body: no timeout
applies there, and a PUT to a silent peer hung forever (tests/integration/test_targets_s3.py
``test_server_that_never_answers``). So the ``Expect`` header, which is not signed, is
dropped before sending; and a body write that stalls (a peer that stops reading) is cut by an
overall limit of ``REQUEST_FLOOR_S + bytes / REQUEST_MIN_Bps`` per request. Either way the
request is retried.

Other fsspec protocols: a temp key beside the final one, then ``mv`` (a server-side copy on
object stores, itself atomic), best effort removal of the temp key on failure.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from ..config import DEFAULT_RETRY_DEADLINE_S
from ..errors import ConfigError, ReplicationError
from ..io.atomic import is_tmp, tmp_name
from ..io.ops import READ, FileOps, pread_exact
from ..units import MiB
from ..urls import check_key, root_url
from .base import T, Target
from .fsspec_clean import clean_incomplete
from .reach import HTTP_TRUST, answered, mark_answered, proxy_refused, unreachable
from .reads import info_version
from .s3 import S3Session, crc32_header, drop_expect_100, mtime, put_if_absent, put_s3, share_loader
from .s3_errors import TRANSIENT_CODES, client_error, permanent_error, transient_status, transient_types
from .s3_options import bad_endpoint, check_s3_options, endpoint_key
from .s3_read import get_range, list_sizes
from .types import (
    Expected,
    ObjectChangedError,
    Progress,
    RetryCallback,
    TargetNotFoundError,
    TokenBucket,
    is_transient_oserror,
    storage_error,
)

log = logging.getLogger(__name__)
REQUEST_FLOOR_S = 120.0
REQUEST_MIN_Bps = 1 * MiB
class FsspecTarget(Target):
    """A ``Target`` rooted at an fsspec URL, e.g. ``s3://bucket/prefix``.

    Args:
        url_root: the root URL; for S3 the bucket must exist.
        storage_options: passed to ``fsspec.filesystem`` (s3fs: ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``, ``config_kwargs``...). Defaults added for S3:
            ``skip_instance_cache=True``, ``config_kwargs`` with ``retries={"max_attempts": 0}``,
            ``connect_timeout=10``, ``read_timeout=60``, ``s3={"payload_signing_enabled": False}``
            (see the module docstring; each only where not given), and a
            ``before-send`` hook on the botocore session (``session``, or one made here).
        retry_deadline_s, parallelism, on_retry, ops, executor: see ``Target``.
    """

    def __init__(self, url_root: str, storage_options: dict | None = None, *,
                 retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S, parallelism: int = 4,
                 on_retry: RetryCallback | None = None, ops: FileOps | None = None,
                 executor: Executor | None = None) -> None:
        import fsspec

        super().__init__(retry_deadline_s=retry_deadline_s, parallelism=parallelism, on_retry=on_retry, ops=ops,
                         executor=executor)
        protocol, _ = fsspec.core.split_protocol(url_root)
        if not protocol:
            raise ConfigError(f"{url_root!r} is not a URL: use PosixTarget (or storage.homes.open_target) for a "
                              "directory")
        self.protocol = protocol
        self.is_s3 = protocol in ("s3", "s3a")
        opts = dict(storage_options or {})
        if self.is_s3:
            from aiobotocore.session import AioSession

            check_s3_options(url_root, opts)
            opts.setdefault("skip_instance_cache", True)
            cfg = dict(opts.get("config_kwargs") or {})
            cfg.setdefault("retries", {"max_attempts": 0, "mode": "standard"})
            cfg.setdefault("connect_timeout", 10)
            cfg.setdefault("read_timeout", 60)
            # bodies carry a CRC32 the store checks (module docstring): no SHA-256 of them to sign
            cfg["s3"] = {"payload_signing_enabled": False, **(cfg.get("s3") or {})}
            opts["config_kwargs"] = cfg
            if opts.get("session") is None:  # our own, so that the hook below reaches every client
                session_args = ("profile", "session_vars", "event_hooks", "include_builtin_handlers")
                opts["session"] = AioSession(**{k: opts.pop(k) for k in session_args if k in opts})
                share_loader(opts["session"])
            opts["session"].register("before-send.s3", drop_expect_100, unique_id="fastckpt-drop-expect-100")
        try:
            self.fs = fsspec.filesystem(protocol, **opts)
        except ImportError as exc:
            raise ConfigError(f"{url_root!r} needs the fsspec backend for {protocol!r}: "
                              f"pip install {'s3fs' if self.is_s3 else 'the matching fsspec package'}") from exc
        if self.is_s3:
            self.fs.retries = 1  # s3fs's own loop: one attempt, ours does the rest
        self.root = self.fs._strip_protocol(url_root).rstrip("/")
        self._url = root_url(protocol, url_root, self.root)  # as given, never memory:///b for memory://b
        self.bucket, _, self.prefix = self.root.partition("/")
        if self.is_s3 and not self.bucket:
            raise ConfigError(f"{url_root!r} names no bucket: use s3://<bucket>[/<prefix>]")
        self._transient = transient_types()
        self._at = endpoint_key(url_root, storage_options or {})  # its requests' endpoint (reach.answered)

    @property
    def url(self) -> str:
        return self._url

    def part_bytes(self, chunk_bytes: int) -> int:
        """Smaller than the local I/O chunk: more parts in flight per upload (>= 8 MiB each)."""
        return max(chunk_bytes // 4, 8 * MiB)

    def _full(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _obj(self, key: str) -> str:
        """The S3 object key (bucket prefix + key)."""
        return f"{self.prefix}/{check_key(key)}" if self.prefix else check_key(key)

    def _s3(self, method: str, **kwargs: object) -> dict:
        body = kwargs.get("Body")
        limit_s = REQUEST_FLOOR_S + (len(body) if isinstance(body, (bytes, bytearray)) else 0) / REQUEST_MIN_Bps
        out = self.fs.call_s3(method, Bucket=self.bucket, timeout=limit_s, **kwargs)  # timeout: fsspec's sync()
        mark_answered(self._at)
        return out

    def _cat(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if not self.is_s3:
            return self.fs.cat_file(self._full(key), start=start, end=end)
        limit_s = REQUEST_FLOOR_S + max((end or 0) - (start or 0), 0) / REQUEST_MIN_Bps  # _retry marks it answered
        return get_range(self.fs, self.bucket, self._obj(key), start or 0, end, None, self.url_of(key), limit_s)

    def _endpoint(self) -> str:
        try:
            return str(self.fs.s3.meta.endpoint_url)
        except Exception:  # only for messages: no endpoint is better than a second error
            return "the S3 endpoint"

    # ------------------------------------------------------------------ errors
    def _retry(self, what: str, fn: Callable[[], T], **kw: object) -> T:
        """``Target._retry``; a request that succeeds marks the store reached, whatever its protocol: a
        refused connection after it is an outage to retry, not a wrong URL (``_is_transient``)."""
        def reached() -> T:
            out = fn()
            mark_answered(self._at)
            return out

        return super()._retry(what, reached, **kw)  # type: ignore[arg-type]

    def _is_transient(self, exc: BaseException) -> bool:
        ce = client_error(exc)
        if ce is not None:
            mark_answered(self._at)  # an error response: the endpoint is there
            code, status, _ = ce
            return code in TRANSIENT_CODES or transient_status(status)
        if unreachable(exc, "", "", reached=answered(self._at)) is not None:  # never reached, or untrusted
            return False
        return isinstance(exc, self._transient) and not proxy_refused(exc) or is_transient_oserror(exc)

    def _permanent(self, exc: BaseException, what: str) -> ReplicationError | None:
        if self.is_s3 and not answered(self._at) and isinstance(exc, ValueError) and (bad := bad_endpoint(exc, what)):
            return bad  # botocore could not build the client (a profile's malformed endpoint_url)
        far = unreachable(exc, what, *((self._endpoint(),) if self.is_s3 else (
            self.url, f"Check the host and port in {self.url}", HTTP_TRUST)), reached=answered(self._at))
        return far or permanent_error(exc, what, self.bucket, self._endpoint)

    # ------------------------------------------------------------------ writing
    def _put_file(self, local_path: str, key: str, size: int, limiter: TokenBucket | None, chunk_bytes: int,
                  progress: Progress, expect: Expected | None) -> int:
        fd = self.ops.open(local_path, READ)
        try:
            if self.is_s3:
                session = S3Session(self._s3, self._retry, self._head, self.ops, self.parallelism,
                                    self.retry_deadline_s, self.transient_pool)
                return put_s3(session, fd, local_path, self.url_of(key), self._obj(key), size, limiter, chunk_bytes,
                              progress, expect)
            return self._put_generic(fd, local_path, key, size, limiter, chunk_bytes, progress)
        finally:
            self.ops.close(fd)

    def _put_generic(self, fd: int, local_path: str, key: str, size: int, limiter: TokenBucket | None,
                     chunk_bytes: int, progress: Progress) -> int:
        def copy(tmp: str) -> int:
            reported = progress.done
            with self.fs.open(tmp, "wb") as f:
                for off in range(0, size, chunk_bytes):
                    data = bytearray(min(chunk_bytes, size - off))
                    pread_exact(self.ops, fd, memoryview(data), off, len(data), local_path)
                    if limiter is not None:
                        limiter.consume(len(data))
                    f.write(data)
                    if off + len(data) > reported:
                        progress.add(off + len(data) - reported)
                        reported = off + len(data)
            return 1

        return self._via_tmp(f"upload of {self.url_of(key)}", key, copy, progress=progress)

    def put_bytes(self, key: str, data: bytes) -> None:
        what = f"publish of {self.url_of(key)}"
        if not self.is_s3:
            return self._via_tmp(what, key, lambda tmp: self.fs.pipe_file(tmp, bytes(data)))
        body = bytes(data)
        self._retry(what, lambda: self._s3("put_object", Key=self._obj(key), Body=body,
                                           ChecksumCRC32=crc32_header(body)))

    def _via_tmp(self, what: str, key: str, write: Callable[[str], T], progress: Progress | None = None) -> T:
        """``write`` a temp key beside ``key``, move it into place, retried; failing, remove the temp key."""
        final = self._full(key)
        tmp = tmp_name(final)

        def attempt() -> T:
            out = write(tmp)
            self.fs.mv(tmp, final)
            return out

        try:
            return self._retry(what, attempt, progress=progress)
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except FileNotFoundError:  # it was never written
                pass
            except Exception as rm_exc:  # the write's error is the one to raise
                log.warning("could not remove temp object %s: %s", tmp, rm_exc)
            raise

    def _create(self, key: str, data: bytes) -> bool:
        if not self.is_s3:
            return super()._create(key, data)
        return self._retry(f"creation of {self.url_of(key)}",
                           lambda: put_if_absent(self._s3, self._obj(key), bytes(data)))

    # ------------------------------------------------------------------ reading
    def get_bytes(self, key: str, *, deadline_s: float | None = None) -> bytes:
        return self._retry(f"read of {self.url_of(key)}", lambda: self._cat(key), deadline_s=deadline_s)

    def read_range(self, key: str, offset: int, length: int, *, version: str | None = None) -> bytes:
        url = self.url_of(key)

        def read() -> bytes:
            end = offset + length
            data = self._get(key, offset, end, version) if self.is_s3 else self._cat(key, offset, end)
            if len(data) != length:
                self._confirm_version(key, version)  # cut short by a re-save, not damage
                raise storage_error(ReplicationError, f"{url} returned {len(data)} bytes for the range "
                                    f"[{offset}, {end}): the object is shorter", err_no=errno.EIO)
            return data

        return self._retry(f"read of {url}", read)

    def _get(self, key: str, start: int, end: int, version: str | None) -> bytes:
        data = get_range(self.fs, self.bucket, self._obj(key), start, end, version, self.url_of(key),
                         REQUEST_FLOOR_S + (end - start) / REQUEST_MIN_Bps)
        mark_answered(self._at)
        return data

    def version(self, key: str) -> tuple[int, str | None]:
        if not self.is_s3:  # a token only _confirm_version checks (reads.info_version): no If-Match here
            info = self._info(key)
            return int(info["size"]), info_version(info)
        head = self._retry(f"size of {self.url_of(key)}", lambda: self._head(self._obj(key)))
        return int(head["ContentLength"]), head.get("ETag")

    def _confirm_version(self, key: str, version: str | None) -> None:
        if version is not None and not self.is_s3 and (now := info_version(self._info(key))) != version:
            raise ObjectChangedError(f"{self.url_of(key)} is no longer version {version} (now {now or 'another'})")

    def _head(self, obj: str) -> dict:
        return self._s3("head_object", Key=obj)

    def size(self, key: str) -> int:
        if self.is_s3:
            return self._retry(f"size of {self.url_of(key)}", lambda: int(self._head(self._obj(key))["ContentLength"]))
        return int(self._info(key)["size"])

    def _info(self, key: str) -> dict:
        full = self._full(key)
        self.fs.invalidate_cache(full)
        return self._retry(f"size of {self.url_of(key)}", lambda: self.fs.info(full))

    def modified(self, key: str) -> float:
        if self.is_s3:
            return self._retry(f"date of {self.url_of(key)}", lambda: self._s3(
                "head_object", Key=self._obj(key))["LastModified"].timestamp())
        return self._retry(f"date of {self.url_of(key)}", lambda: mtime(self.fs.info(self._full(key))))

    def exists(self, key: str) -> bool:  # a file, as PosixTarget's: not a prefix gs/az/hdfs/memory call a directory
        try:
            return self.size(key) >= 0 if self.is_s3 else self._info(key).get("type") != "directory"
        except TargetNotFoundError:
            return False

    def list(self, prefix: str = "", *, max_depth: int | None = None) -> list[str]:
        base_depth = prefix.count("/")
        return [k for k in self._list(prefix) if max_depth is None or k.count("/") - base_depth <= max_depth]

    def _list(self, prefix: str) -> list[str]:
        if not self.is_s3:
            self.fs.invalidate_cache()
            found = self._retry(f"listing of {self.url}", lambda: self.fs.find(self.root))
            keys = (p[len(self.root) + 1:] for p in found)
            return sorted(k for k in keys if k.startswith(prefix) and not is_tmp(k.rsplit("/", 1)[-1]))
        return sorted(self._objects(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:  # S3: one listing gives the sizes, not a request each
        return self._objects(prefix, Delimiter="/") if self.is_s3 else super().sizes(prefix)

    def _objects(self, prefix: str, **kw: str) -> dict[str, int]:
        return list_sizes(lambda **a: self._retry(f"listing of {self.url}/{prefix}", lambda: self._s3(
            "list_objects_v2", **a)), f"{self.prefix}/" if self.prefix else "", prefix, **kw)

    def delete(self, key: str) -> None:
        self._delete_listed(check_key(key))

    def _delete_listed(self, key: str) -> None:  # as listed, unchecked: a folder marker 'run/s1/' too
        what = f"delete of {self.url_of(key)}"
        if self.is_s3:
            self._retry(what, lambda: self._s3("delete_object", Key=f"{self.prefix}/{key}" if self.prefix else key))
            return

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{self.root}/{key}")

        self._retry(what, rm)

    def clean_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        return clean_incomplete(self, prefix, older_than_s)
