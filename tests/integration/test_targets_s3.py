"""FsspecTarget against a real S3 endpoint (SeaweedFS, see tests/s3server.py).

Outages are made by killing the server from the upload's own progress callback and
restarting it from the retry callback: every step is triggered by the code under test, so
nothing depends on timing.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("s3fs", reason="the S3 target needs s3fs (pip install 'fastckpt[s3]')")
pytest.importorskip("boto3", reason="the S3 fixture needs boto3 (pip install 'fastckpt[dev]')")

import botocore.exceptions

from fastckpt.errors import CheckpointWriteError, ConfigError, CorruptCheckpointError  # noqa: E402
from fastckpt.format import checksum  # noqa: E402
from fastckpt.storage.fsspec import FsspecTarget  # noqa: E402
from fastckpt.storage.s3_errors import client_error as _client_error  # noqa: E402
from fastckpt.storage.types import (  # noqa: E402
    Expected,
    RetryNotice,
    TargetNotFoundError,
    TargetPermissionError,
    TargetUnavailableError,
)
from tests.helpers import claim_race  # noqa: E402
from tests.s3server import MAX_VOLUMES, S3Server  # noqa: E402

MiB = 1 << 20
PART = 5 * MiB


def _file(path: Path, size: int) -> bytes:
    block = bytes((i * 7 + 3) % 251 for i in range(MiB))
    data = (block * (size // MiB + 1))[:size]
    path.write_bytes(data)
    return data


def _target(s3: S3Server, bucket: str, **kw: object) -> FsspecTarget:
    opts = kw.pop("storage_options", None) or s3.storage_options()
    return FsspecTarget(f"s3://{bucket}/ckpt", opts, **kw)  # type: ignore[arg-type]


def _open_uploads(s3: S3Server, bucket: str) -> list:
    return s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.fixture
def big(tmp_path: Path) -> tuple[Path, bytes]:
    p = tmp_path / "big.bin"
    return p, _file(p, 4 * PART + 12345)  # 5 parts of 5 MiB


def test_a_bucket_costs_one_volume_slot_whatever_the_free_disk(s3_server: S3Server, s3_bucket: str) -> None:
    # Each bucket is a SeaweedFS collection with volumes of its own. Grown 7 at a time under a
    # cap of free disk / volume size, the slots ran out after ~55 buckets on a 25 GB disk, and
    # a CI machine with less free disk failed every later upload with InternalError.
    s3_server.client().put_object(Bucket=s3_bucket, Key="first", Body=b"x")
    total, per_bucket = s3_server.process.volumes()
    assert total == MAX_VOLUMES and per_bucket[s3_bucket] == 1


def test_round_trip_small_objects(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    t = _target(s3_server, s3_bucket)
    local = tmp_path / "small.bin"
    data = _file(local, 300_000)
    res = t.put_file(local, "run/step_1/rank0.pt", chunk_bytes=PART)
    assert (res.parts, res.size_bytes, res.retries) == (1, len(data), 0)
    assert res.url == f"s3://{s3_bucket}/ckpt/run/step_1/rank0.pt"
    t.put_bytes("run/step_1/fastckpt-manifest.json", b'{"v": 1}')
    t.put_bytes("run/step_1/fastckpt-manifest.json", b'{"v": 2}')
    assert t.get_bytes("run/step_1/fastckpt-manifest.json") == b'{"v": 2}'
    assert t.list() == ["run/step_1/fastckpt-manifest.json", "run/step_1/rank0.pt"]
    assert t.list("run/step_1/r") == ["run/step_1/rank0.pt"]
    assert t.size("run/step_1/rank0.pt") == len(data)
    t.put_bytes("run/step_1/sub/deeper.pt", b"xyz")  # in a directory below: not in its sizes
    assert t.sizes("run/step_1/") == {"run/step_1/fastckpt-manifest.json": 8, "run/step_1/rank0.pt": len(data)}
    assert t.sizes("run/step_1/sub/") == {"run/step_1/sub/deeper.pt": 3} and t.sizes("run/gone/") == {}
    t.delete("run/step_1/sub/deeper.pt")
    assert t.read_range("run/step_1/rank0.pt", 1000, 50) == data[1000:1050]
    assert t.exists("run/step_1/rank0.pt") and not t.exists("run/step_1/nope")
    t.verify("run/step_1/rank0.pt", len(data), checksum.checksum_bytes(data))
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="ckpt/run/step_1/rank0.pt")["Body"].read()
    assert body == data  # where a plain S3 client expects it
    t.delete("run/step_1/rank0.pt")
    t.delete("run/step_1/rank0.pt")
    assert t.list() == ["run/step_1/fastckpt-manifest.json"]
    with pytest.raises(TargetNotFoundError):
        t.get_bytes("run/step_1/rank0.pt")


def test_a_key_holding_versionid_is_read_by_its_own_name(s3_server: S3Server, s3_bucket: str,
                                                          tmp_path: Path) -> None:
    """s3fs takes '?versionId=' in a path for the version to ask for: ``get_bytes`` of a key holding
    it (listed as it is) read another key, ``b.pt`` (missing), so the sidecar of ``b.pt?versionId=3``
    'vanished' and ``latest()`` of its directory was None. Every S3 GET now sends the key as is."""
    import torch

    import fastckpt

    t = _target(s3_server, s3_bucket)
    t.put_bytes("odd/b.pt?versionId=3", b"not b.pt")
    t.put_bytes("odd/b.pt", b"b.pt")
    assert t.get_bytes("odd/b.pt?versionId=3") == b"not b.pt"
    opts, url = s3_server.storage_options(), f"s3://{s3_bucket}/run/b.pt?versionId=3"
    with fastckpt.Checkpointer(storage_options=opts, local_dir=str(tmp_path / "nvme")) as ck:
        ck.save({"w": torch.arange(5)}, url).wait()
    assert fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=opts) == url
    assert torch.equal(fastckpt.load(url, storage_options=opts)["w"], torch.arange(5))


def test_put_new_is_a_conditional_put_that_one_of_racing_callers_wins(s3_server: S3Server, s3_bucket: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A commit's claim (commit/claim.py) on S3: the callers all pass the existence check (forced
    # here), and the store's If-None-Match decides; the losers get the winner's bytes.
    t = _target(s3_server, s3_bucket)
    key = "g/.fastckpt/claim-a.json"
    monkeypatch.setattr(t, "exists", lambda k: False)
    won = claim_race(t.put_new, key, 6)
    assert t.get_bytes(key) == won
    monkeypatch.undo()
    assert t.put_new(key, b"late") == won  # found by the check: no write
    assert t.put_new("g/.fastckpt/claim-b.json", b"first") is None


def test_targets_share_the_parsed_botocore_data_and_still_talk_to_the_store(s3_server: S3Server, s3_bucket: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each target has a session of its own (``fs.session``), as every ``fastckpt.load`` of a URL
    makes one; parsing botocore's JSON again for each took 100-250 ms per call."""
    a, b = _target(s3_server, s3_bucket), _target(s3_server, s3_bucket)
    assert a.fs.session is not b.fs.session
    a.put_bytes("k", b"v")
    assert b.get_bytes("k") == b"v"
    assert a.fs.session.get_component("data_loader") is b.fs.session.get_component("data_loader")
    monkeypatch.setenv("AWS_DATA_PATH", str(Path(s3_bucket).resolve()))  # another data path: another loader
    c = _target(s3_server, s3_bucket)
    assert c.get_bytes("k") == b"v"
    assert c.fs.session.get_component("data_loader") is not a.fs.session.get_component("data_loader")


def test_multipart_upload_verify_download(s3_server: S3Server, s3_bucket: str, big: tuple[Path, bytes],
                                          tmp_path: Path) -> None:
    local, data = big
    t = _target(s3_server, s3_bucket, parallelism=4)
    seen: list[int] = []
    res = t.put_file(local, "step_2/rank0.pt", chunk_bytes=PART, on_progress=lambda d, n: seen.append(d))
    assert (res.parts, res.size_bytes) == (5, len(data))
    assert seen == sorted(seen) and seen[-1] == len(data) and len(seen) == 5
    assert _open_uploads(s3_server, s3_bucket) == []
    t.verify("step_2/rank0.pt", len(data), checksum.checksum_bytes(data))
    out = tmp_path / "back.bin"
    assert t.download("step_2/rank0.pt", out, chunk_bytes=3 * MiB) == len(data)
    assert out.read_bytes() == data
    with pytest.raises(ConfigError, match=">= 5 MiB"):
        t.put_file(local, "x.pt", chunk_bytes=MiB)
    t.close(wait=False)  # close() past close_timeout_s: every pool the target made, stopped at once
    assert t.put_file(local, "step_3/rank0.pt", chunk_bytes=PART).parts == 5  # a later call makes new ones
    t.close()


def test_verify_detects_a_corrupted_object(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "f.bin"
    data = _file(local, 2 * MiB)
    t = _target(s3_server, s3_bucket)
    t.put_file(local, "a.pt")
    good = checksum.checksum_bytes(data)
    t.verify("a.pt", len(data), good)
    flipped = bytearray(data)
    flipped[MiB + 5] ^= 0x01
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpt/a.pt", Body=bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match=r"s3://.*/ckpt/a\.pt: checksum .* was recorded"):
        t.verify("a.pt", len(data), good)
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpt/a.pt", Body=data[:-1])
    with pytest.raises(CorruptCheckpointError, match=f"is {len(data) - 1} bytes, expected {len(data)}"):
        t.verify("a.pt", len(data), good)


def test_missing_bucket(s3_server: S3Server, tmp_path: Path) -> None:
    t = _target(s3_server, "fastckpt-no-such-bucket")
    local = tmp_path / "f.bin"
    _file(local, 1000)
    for call in (lambda: t.put_file(local, "a.pt"), lambda: t.put_bytes("latest", b"x"), lambda: t.list()):
        with pytest.raises(TargetNotFoundError, match=r"bucket 'fastckpt-no-such-bucket' does not exist at "
                           r"http://127\.0\.0\.1:\d+: create it") as ei:
            call()
        assert isinstance(ei.value, FileNotFoundError)


def test_wrong_credentials(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "f.bin"
    _file(local, 1000)
    bad_secret = "definitely-not-the-secret-42"
    retried: list[RetryNotice] = []
    for opts in (s3_server.storage_options(secret=bad_secret), s3_server.storage_options(key="nobody")):
        t = _target(s3_server, s3_bucket, storage_options=opts, on_retry=retried.append)
        with pytest.raises(TargetPermissionError, match="refused the request .*check the credentials") as ei:
            t.put_file(local, "a.pt")
        assert bad_secret not in str(ei.value) and s3_server.secret_key not in str(ei.value)
        assert isinstance(ei.value, PermissionError)
    assert retried == []  # permanent: refused at once
    assert s3_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0


def test_credentials_and_endpoint_from_the_environment(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    t = FsspecTarget(f"s3://{s3_bucket}")
    t.put_bytes("hello", b"world")
    assert t.get_bytes("hello") == b"world"


def test_interrupted_multipart_upload_is_aborted(s3_server: S3Server, s3_bucket: str,
                                                 big: tuple[Path, bytes]) -> None:
    local, _ = big
    t = _target(s3_server, s3_bucket, parallelism=2)

    class Cancelled(Exception):
        pass

    def cancel(done: int, total: int) -> None:
        raise Cancelled(f"{done}/{total}")

    with pytest.raises(Cancelled):
        t.put_file(local, "a.pt", chunk_bytes=PART, on_progress=cancel)
    assert not t.exists("a.pt")
    assert _open_uploads(s3_server, s3_bucket) == []


def test_server_killed_mid_upload_then_restarted(s3_server: S3Server, s3_bucket: str,
                                                 big: tuple[Path, bytes]) -> None:
    local, data = big
    events: list[str] = []

    def on_progress(done: int, total: int) -> None:
        if done == PART:  # first part stored: take the endpoint away
            s3_server.stop()
            events.append("killed")

    def on_retry(notice: RetryNotice) -> None:
        events.append(f"retry {notice.what}")
        if not s3_server.running:  # the next part failed: bring it back, then let the retry run
            s3_server.start()
            events.append("restarted")

    t = _target(s3_server, s3_bucket, parallelism=1, retry_deadline_s=60, on_retry=on_retry)
    try:
        res = t.put_file(local, "a.pt", chunk_bytes=PART, on_progress=on_progress)
    finally:
        if not s3_server.running:
            s3_server.start()
    assert events[0] == "killed" and events[1].startswith("retry upload of part 2/5") and events[2] == "restarted"
    assert res.retries >= 1 and res.parts == 5
    t.verify("a.pt", len(data), checksum.checksum_bytes(data))
    assert _open_uploads(s3_server, s3_bucket) == []


class CorruptParts:
    """A botocore ``before-send`` hook that flips one byte of the body of the first ``times``
    UploadPart requests after they were signed and checksummed: damage in transit."""

    def __init__(self, times: int) -> None:
        self.times, self.corrupted = times, 0

    def __call__(self, request, **_: object) -> None:
        if "partNumber=" not in request.url or self.corrupted >= self.times:
            return
        body = request.body
        raw = bytearray(body.read() if hasattr(body, "read") else body)
        raw[1234] ^= 0x01
        request.body = bytes(raw)
        self.corrupted += 1


def _corrupting_target(s3: S3Server, bucket: str, hook: CorruptParts, **kw: object) -> FsspecTarget:
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register("before-send.s3.UploadPart", hook, unique_id="test-corrupt-parts")
    return _target(s3, bucket, storage_options=s3.storage_options(session=session), **kw)


def test_store_rejects_a_part_whose_bytes_do_not_match_its_checksum(s3_server: S3Server, s3_bucket: str) -> None:
    # What in-flight verification rests on: the store recomputes the CRC32 over the bytes it
    # received and refuses the part when they differ, also with an unsigned payload.
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, aws_access_key_id=s3_server.access_key,
                          aws_secret_access_key=s3_server.secret_key, region_name=s3_server.region,
                          config=Config(s3={"addressing_style": "path", "payload_signing_enabled": False},
                                        retries={"max_attempts": 0}))
    hook = CorruptParts(times=1)
    client.meta.events.register("before-send.s3.UploadPart", hook)
    data = bytes(range(256)) * (PART // 256)
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    up = client.create_multipart_upload(Bucket=s3_bucket, Key="k", ChecksumAlgorithm="CRC32")["UploadId"]
    with pytest.raises(botocore.exceptions.ClientError, match="BadDigest"):
        client.upload_part(Bucket=s3_bucket, Key="k", UploadId=up, PartNumber=1, Body=data, ChecksumCRC32=crc)
    assert hook.corrupted == 1
    resp = client.upload_part(Bucket=s3_bucket, Key="k", UploadId=up, PartNumber=1, Body=data, ChecksumCRC32=crc)
    assert resp["ChecksumCRC32"] == crc  # the intact body is accepted, and its checksum returned
    client.abort_multipart_upload(Bucket=s3_bucket, Key="k", UploadId=up)


def test_put_with_expect_is_verified_in_flight(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "f.bin"
    data = _file(local, 2 * checksum.BLOCK_BYTES + 12345)  # 3 parts of whole checksum blocks
    covered = len(data) - 100
    expect = Expected(len(data), checksum.checksum_bytes(data[:covered]), covered)
    hook = CorruptParts(times=1)
    retried: list[RetryNotice] = []
    t = _corrupting_target(s3_server, s3_bucket, hook, parallelism=2, on_retry=retried.append)
    res = t.put_file(local, "a.pt", chunk_bytes=PART, expect=expect)
    assert (res.parts, res.verified) == (3, True)
    assert hook.corrupted == 1 and len(retried) == 1 and _client_error(retried[0].error)[0] == "BadDigest"
    assert res.retries == 1
    t.verify("a.pt", len(data), expect.xxh3, covered)  # and a read-back agrees
    assert t.put_file(local, "b.pt", chunk_bytes=PART).verified is False  # no expect: not verified
    small = tmp_path / "s.bin"
    sdata = _file(small, 1000)
    one = t.put_file(small, "c.pt", expect=Expected(len(sdata), checksum.checksum_bytes(sdata), len(sdata)))
    assert (one.parts, one.verified) == (1, True)  # a single PutObject is checked the same way


def test_put_with_expect_refuses_a_local_file_that_changed(s3_server: S3Server, s3_bucket: str,
                                                           tmp_path: Path) -> None:
    local = tmp_path / "f.bin"
    data = _file(local, checksum.BLOCK_BYTES + 5)
    wrong = Expected(len(data), checksum.checksum_bytes(data[:-1] + b"x"), len(data))
    t = _target(s3_server, s3_bucket)
    with pytest.raises(CheckpointWriteError, match="changed after it was committed"):
        t.put_file(local, "multi.pt", chunk_bytes=PART, expect=wrong)
    small = tmp_path / "s.bin"
    sdata = _file(small, 1000)
    with pytest.raises(CheckpointWriteError, match="changed after it was committed"):
        t.put_file(small, "single.pt", expect=Expected(len(sdata), "0" * 16, len(sdata)))
    with pytest.raises(CheckpointWriteError, match="is 1000 bytes, its manifest says 999"):
        t.put_file(small, "single.pt", expect=Expected(999, "0" * 16, 999))
    assert t.list() == [] and _open_uploads(s3_server, s3_bucket) == []


def test_damage_in_every_attempt_fails_and_leaves_nothing(s3_server: S3Server, s3_bucket: str,
                                                          big: tuple[Path, bytes]) -> None:
    local, data = big
    t = _corrupting_target(s3_server, s3_bucket, CorruptParts(times=1 << 30), retry_deadline_s=0.5)
    with pytest.raises(TargetUnavailableError, match="kept failing") as ei:
        t.put_file(local, "a.pt", chunk_bytes=PART, expect=Expected(len(data), checksum.checksum_bytes(data),
                                                                    len(data)))
    assert _client_error(ei.value)[0] == "BadDigest"
    assert t.list() == [] and _open_uploads(s3_server, s3_bucket) == []


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP port that accepts connections (kernel backlog) and never answers."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def test_server_that_never_answers(s3_server: S3Server, silent_endpoint: str) -> None:
    opts = s3_server.storage_options(endpoint_url=silent_endpoint,
                                     config_kwargs={"connect_timeout": 0.5, "read_timeout": 0.5,
                                                    "retries": {"max_attempts": 0}})
    retried: list[RetryNotice] = []
    # the deadline is several request timeouts long, so at least one retry happens even on a
    # loaded machine; how long it takes is not asserted (timed assertions belong in benchmarks)
    t = FsspecTarget("s3://some-bucket/ckpt", opts, retry_deadline_s=4.0, on_retry=retried.append)
    with pytest.raises(TargetUnavailableError, match=r"kept failing for .*retry_deadline_s \(now 4 s\)") as ei:
        t.put_bytes("latest", b"x")
    assert len(retried) >= 1 and isinstance(ei.value, TimeoutError)


def test_endpoint_refusing_connections(s3_server: S3Server) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = FsspecTarget("s3://some-bucket/ckpt", s3_server.storage_options(endpoint_url=f"http://127.0.0.1:{port}"),
                     retry_deadline_s=60)
    # never answered: a wrong endpoint, raised at once (a TargetUnavailableError too); tests/integration/
    # test_s3_endpoint.py has the rest, test_burst_buffer.py the outage of an endpoint that did answer
    with pytest.raises(TargetUnavailableError, match=f"127.0.0.1:{port}: connection refused"):
        t.get_bytes("latest")


def test_clean_incomplete_aborts_orphaned_uploads(s3_server: S3Server, s3_bucket: str) -> None:
    c = s3_server.client()
    up = c.create_multipart_upload(Bucket=s3_bucket, Key="ckpt/run/orphan.pt")["UploadId"]
    c.upload_part(Bucket=s3_bucket, Key="ckpt/run/orphan.pt", UploadId=up, PartNumber=1, Body=b"x" * 1000)
    c.create_multipart_upload(Bucket=s3_bucket, Key="elsewhere/keep.pt")
    t = _target(s3_server, s3_bucket)
    assert t.clean_incomplete("run/", older_than_s=3600) == 0  # too young
    assert t.clean_incomplete("run/", older_than_s=0) == 1
    assert [u["Key"] for u in _open_uploads(s3_server, s3_bucket)] == ["elsewhere/keep.pt"]


def test_parallel_uploads_share_one_bandwidth_cap(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    from fastckpt.storage.types import TokenBucket

    cap = TokenBucket(8 * MiB, burst_bytes=MiB)
    files = []
    for i in range(2):
        p = tmp_path / f"f{i}.bin"
        _file(p, 2 * MiB)
        files.append(p)
    t = _target(s3_server, s3_bucket)
    t0 = time.monotonic()
    threads = [threading.Thread(target=t.put_file, args=(p, p.name), kwargs={"bandwidth_Bps": cap}) for p in files]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert time.monotonic() - t0 >= (4 * MiB - MiB) / (8 * MiB) * 0.95
    assert t.list() == ["f0.bin", "f1.bin"]


def test_stalled_body_write_is_cut_and_reported(silent_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The peer never reads: a large body fills the socket buffers and the write stalls, where
    # read_timeout (30 s here) does not apply; the per-request limit must.
    import fastckpt.storage.fsspec as tf

    monkeypatch.setattr(tf, "REQUEST_FLOOR_S", 1.0)
    monkeypatch.setattr(tf, "REQUEST_MIN_Bps", float(1 << 40))
    opts = {"endpoint_url": silent_endpoint, "key": "k", "secret": "s",
            "config_kwargs": {"connect_timeout": 0.5, "read_timeout": 30}}
    t = FsspecTarget("s3://some-bucket/ckpt", opts, retry_deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(TargetUnavailableError, match="kept failing"):
        t.put_bytes("big", b"\0" * (64 * MiB))
    assert time.monotonic() - t0 < 10.0


# ---------------------------------------------------------------------- an object replaced while read
def _versions(tmp_path: Path, sizes: tuple[int, int]) -> list[tuple[bytes, object]]:
    """Two fastckpt files (bytes, state) of the given numbers of float32 elements."""
    import torch

    import fastckpt

    out = []
    for i, n in enumerate(sizes):
        state, path = {"w": torch.full((n,), float(i + 1))}, tmp_path / f"v{i}.pt"
        with fastckpt.Checkpointer() as ck:
            ck.save(state, str(path)).wait()
        out.append((path.read_bytes(), state))
    return out


def _replace_at_first_read(monkeypatch: pytest.MonkeyPatch, s3: S3Server, bucket: str, key: str,
                           bodies: list[bytes]) -> list[int]:
    """Each ranged read of the object's first byte (the zip directory's parse reads it, after the
    size and the tail were read) first replaces the object with the next of ``bodies``: the read
    then spans two versions, as when another job saves the same URL during a load."""
    client, done = s3.client(), []
    real = FsspecTarget.read_range

    def read_range(self: FsspecTarget, k: str, offset: int, length: int, **kw: object) -> bytes:
        if offset == 0 and k.endswith(key) and len(done) < len(bodies):
            client.put_object(Bucket=bucket, Key=f"ckpt/{key}", Body=bodies[len(done)])
            done.append(offset)
        return real(self, k, offset, length, **kw)

    monkeypatch.setattr(FsspecTarget, "read_range", read_range)
    return done


@pytest.mark.parametrize("sizes", [(3 << 20, 3 << 20), (3 << 20, (3 << 20) + 4096)], ids=["same size", "larger"])
def test_an_object_replaced_while_loaded_is_read_again_not_called_corrupt(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        sizes: tuple[int, int]) -> None:
    """Every ranged GET of one read asks for the version whose size it read first (If-Match on
    its ETag): a read that would mix two versions starts again, on the new one."""
    import torch

    import fastckpt

    (old, _), (new, state) = _versions(tmp_path, sizes)
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpt/last.ckpt", Body=old)
    done = _replace_at_first_read(monkeypatch, s3_server, s3_bucket, "last.ckpt", [new])
    got = fastckpt.load(f"s3://{s3_bucket}/ckpt/last.ckpt", storage_options=s3_server.storage_options())
    assert done == [0] and torch.equal(got["w"], state["w"])


def test_an_object_that_keeps_changing_is_not_called_corrupt(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaced during every read: after a few reads the load gives up, saying so (not damage)."""
    import fastckpt
    from fastckpt.storage.reads import READ_ATTEMPTS
    from fastckpt.storage.types import ObjectChangedError

    (old, _), (new, _) = _versions(tmp_path, (3 << 20, 3 << 20))
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpt/busy.ckpt", Body=old)
    _replace_at_first_read(monkeypatch, s3_server, s3_bucket, "busy.ckpt", [new, old] * READ_ATTEMPTS)
    with pytest.raises(ObjectChangedError, match=f"replaced {READ_ATTEMPTS} times while it was read") as err:
        fastckpt.load(f"s3://{s3_bucket}/ckpt/busy.ckpt", storage_options=s3_server.storage_options())
    assert not isinstance(err.value, CorruptCheckpointError)


# ---------------------------------------------------------------------- a Complete whose reply was lost
@pytest.mark.parametrize("first_complete", ["landed", "upload aborted"])
def test_a_retried_complete_accepts_only_its_own_object(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, first_complete: str) -> None:
    """The first CompleteMultipartUpload gets no reply; its retry finds no upload. That upload
    completed (the reply was lost), or it was aborted meanwhile (clean_incomplete, a lifecycle
    rule), and the object at the key is still the previous save's, of the same size (a re-saved
    last.ckpt). Only the object this upload makes (its ETag, from its parts') may count as landed."""
    local = tmp_path / "new.bin"
    old, new = bytes(reversed(_file(tmp_path / "old.bin", 3 * PART))), _file(local, 3 * PART)
    assert len(old) == len(new) and old != new
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpt/last.ckpt", Body=old)  # the previous save
    real = FsspecTarget._s3
    completes: list[str] = []

    def s3(self: FsspecTarget, method: str, **kw: object) -> dict:
        if method == "complete_multipart_upload" and not completes:
            completes.append(first_complete)
            if first_complete == "landed":
                real(self, method, **kw)
            else:
                real(self, "abort_multipart_upload", Key=kw["Key"], UploadId=kw["UploadId"])
            raise TimeoutError("the reply to CompleteMultipartUpload was lost")
        return real(self, method, **kw)

    monkeypatch.setattr(FsspecTarget, "_s3", s3)
    t = _target(s3_server, s3_bucket)
    if first_complete == "landed":
        assert t.put_file(local, "last.ckpt", chunk_bytes=PART).parts == 3
    else:
        with pytest.raises(CheckpointWriteError, match="NoSuchUpload"):
            t.put_file(local, "last.ckpt", chunk_bytes=PART)
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="ckpt/last.ckpt")["Body"].read()
    assert completes == [first_complete] and body == (new if first_complete == "landed" else old)


# ---------------------------------------------------------------------- an upload aborted behind its back
def _aborting(s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch, at: str, times: int) -> list[str]:
    """Make the store abort the first ``times`` multipart uploads just before their part 2 (``at="part"``)
    or their Complete (``at="complete"``) is sent, as another node's clean_incomplete() or a lifecycle rule
    does: the real abort, then the real request, which SeaweedFS answers NoSuchUpload. Returns the
    upload ids started, in order."""
    real, started, aborted = FsspecTarget._s3, [], []

    def s3(self: FsspecTarget, method: str, **kw: object) -> dict:
        if method == "create_multipart_upload":
            out = real(self, method, **kw)
            started.append(out["UploadId"])
            return out
        upload = kw.get("UploadId")
        if len(aborted) < times and upload not in aborted and (
                (at == "part" and method == "upload_part" and kw["PartNumber"] == 2)
                or (at == "complete" and method == "complete_multipart_upload")):
            s3_server.client().abort_multipart_upload(Bucket=bucket, Key=kw["Key"], UploadId=upload)
            aborted.append(upload)
        return real(self, method, **kw)

    monkeypatch.setattr(FsspecTarget, "_s3", s3)
    return started


@pytest.mark.parametrize("at", ["part", "complete"])
def test_a_multipart_upload_aborted_behind_its_back_starts_again(s3_server: S3Server, s3_bucket: str,
                                                                 big: tuple[Path, bytes],
                                                                 monkeypatch: pytest.MonkeyPatch, at: str) -> None:
    """Its next part (or its first Complete) answered NoSuchUpload, reported as "not found ... check
    that bucket exists", and the upload failed: a fresh one now sends every part again."""
    local, data = big
    started = _aborting(s3_server, s3_bucket, monkeypatch, at, times=2)
    done: list[int] = []
    t = _target(s3_server, s3_bucket, parallelism=2)
    res = t.put_file(local, "run/step-2/state.pt", chunk_bytes=PART, on_progress=lambda n, total: done.append(n))
    assert len(started) == 3 and res.parts == 5
    assert max(done) == len(data)  # the parts sent again count once
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="ckpt/run/step-2/state.pt")["Body"].read()
    assert body == data and _open_uploads(s3_server, s3_bucket) == []
    t.close()


def test_a_multipart_upload_aborted_again_and_again_names_the_abort_and_the_fix(
        s3_server: S3Server, s3_bucket: str, big: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    local, _ = big
    started = _aborting(s3_server, s3_bucket, monkeypatch, "part", times=99)
    t = _target(s3_server, s3_bucket, parallelism=2)
    with pytest.raises(CheckpointWriteError) as err:
        t.put_file(local, "run/x.pt", chunk_bytes=PART)
    msg = str(err.value)
    assert "aborted while it ran, 3 times in a row (NoSuchUpload)" in msg and "check that bucket" not in msg
    assert "clean_incomplete()" in msg and "AbortIncompleteMultipartUpload" in msg and "save again" in msg
    assert not isinstance(err.value, TargetNotFoundError) and len(started) == 3
    assert not t.exists("run/x.pt") and _open_uploads(s3_server, s3_bucket) == []
    t.close()


def test_no_such_upload_is_named_an_abort_not_a_missing_bucket(s3_server: S3Server, s3_bucket: str) -> None:
    """Any request that finds its upload aborted, also one fastckpt does not start again."""
    from fastckpt.storage.s3_errors import permanent_error

    client = s3_server.client()
    up = client.create_multipart_upload(Bucket=s3_bucket, Key="k")["UploadId"]
    client.abort_multipart_upload(Bucket=s3_bucket, Key="k", UploadId=up)
    with pytest.raises(botocore.exceptions.ClientError) as got:
        client.upload_part(Bucket=s3_bucket, Key="k", UploadId=up, PartNumber=1, Body=b"x")
    err = permanent_error(got.value, "upload of k", s3_bucket, lambda: s3_server.endpoint_url)
    assert not isinstance(err, TargetNotFoundError) and "check that bucket" not in str(err)
    assert "aborted meanwhile, by another node's clean_incomplete()" in str(err)


def test_a_part_that_fails_for_good_stops_the_other_parts_at_once(s3_server: S3Server, s3_bucket: str,
                                                                   big: tuple[Path, bytes], monkeypatch) -> None:
    """The parts' futures were awaited in order, so a permanent failure of part 2 (credentials
    expired: 403) went unseen while part 1 was still in flight, and every other part was read and
    sent for an upload that was then aborted. Parts 1 and 3 are held until the upload is
    cancelled (or 30 s): now at most part 3, which may have begun, is sent after part 2 failed."""
    from fastckpt.storage import s3 as s3mod

    cancelled = threading.Event()

    class Cancel(threading.Event):  # the upload's cancel event: tells the held parts when it is set
        def set(self) -> None:
            super().set()
            cancelled.set()

    monkeypatch.setattr(s3mod, "threading", type("T", (), {"Event": Cancel, "local": threading.local}))
    local, _ = big
    t = _target(s3_server, s3_bucket, parallelism=2, retry_deadline_s=30)
    call, after = t._s3, []  # noqa: SLF001

    def s3(method: str, **kw: object) -> dict:
        if method == "upload_part":
            n = kw["PartNumber"]
            if n == 2:
                raise botocore.exceptions.ClientError(
                    {"Error": {"Code": "ExpiredToken", "Message": "The provided token has expired."},
                     "ResponseMetadata": {"HTTPStatusCode": 403}}, "UploadPart")
            if n != 1:
                after.append(n)
            if n in (1, 3):
                cancelled.wait(30)  # before: never set while part 1 was awaited; both went on after 30 s
        return call(method, **kw)

    t._s3 = s3  # noqa: SLF001
    with pytest.raises(CheckpointWriteError, match="ExpiredToken|expired"):
        t.put_file(local, "run/x.pt", chunk_bytes=PART)
    # Part 3 starts on part 2's thread, before or after the cancel: sent or skipped, never part 4
    assert after in ([], [3]), after  # before: [3, 4] (part 4 sent while part 1 was awaited)
    assert _open_uploads(s3_server, s3_bucket) == []
    t.close()


@pytest.mark.parametrize("size", [1000, 3 * PART - 7], ids=["one PutObject", "multipart"])
def test_a_retried_body_counts_against_the_bandwidth_cap_again(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                                               size: int) -> None:
    """The cap was charged when a part was read, once: a part sent three times (a store that
    throttles, a flaky link) put three times its bytes on the wire for one charge."""
    from fastckpt.storage.types import TokenBucket

    charged: list[int] = []  # list.append: safe from the parts' threads

    class Counted(TokenBucket):
        def consume(self, n: int) -> float:
            charged.append(n)
            return super().consume(n)

    local = tmp_path / "f.bin"
    _file(local, size)
    t = _target(s3_server, s3_bucket, parallelism=2, retry_deadline_s=30)
    call, sent, failed = t._s3, [], set()  # noqa: SLF001

    def s3(method: str, **kw: object) -> dict:
        if method in ("put_object", "upload_part"):
            body = kw["Body"]
            sent.append(len(body))  # type: ignore[arg-type]
            n = kw.get("PartNumber", 1)
            if n == 1 and n not in failed:  # the first try of the first body is throttled
                failed.add(n)
                raise botocore.exceptions.ClientError(
                    {"Error": {"Code": "SlowDown", "Message": "Reduce your request rate."},
                     "ResponseMetadata": {"HTTPStatusCode": 503}}, method)
        return call(method, **kw)

    t._s3 = s3  # noqa: SLF001
    t.put_file(local, "x.pt", chunk_bytes=PART, bandwidth_Bps=Counted(1 << 40))
    assert sum(sent) > size  # the throttled body was sent twice
    assert sum(charged) == sum(sent)  # before: == size
    t.close()
