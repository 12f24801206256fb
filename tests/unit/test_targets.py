"""PosixTarget on real files (plus the fsspec code path on fsspec's in-memory filesystem).

Faults come three ways: FaultyOps (ENOSPC, EIO, transient errors at a chosen call), real
tiny or read-only tmpfs mounts where this process may mount (root), and mode bits where it
is not root (root ignores them).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from fastckpt.errors import ConfigError, CorruptCheckpointError, ReplicationError
from fastckpt.format import checksum
from fastckpt.io import atomic
from fastckpt.storage import reads as targets
from fastckpt.storage import retry
from fastckpt.storage.fsspec import FsspecTarget
from fastckpt.storage.homes import open_target
from fastckpt.storage.posix import PosixTarget
from fastckpt.storage.types import (
    PutResult,
    RetryNotice,
    TargetNotFoundError,
    TargetPermissionError,
    TargetUnavailableError,
    TargetUnreachableError,
    TokenBucket,
    as_limiter,
)
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import claim_race, tmp_files, tmpfs

KiB, MiB = 1 << 10, 1 << 20


def _file(path: Path, size: int, seed: int = 0) -> bytes:
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    data = bytes([(b + seed) % 256 for b in data[:4096]]) + data[4096:] if seed else data
    path.write_bytes(data)
    return data


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "target"
    r.mkdir()
    return r


@pytest.fixture
def src(tmp_path: Path) -> tuple[Path, bytes]:
    p = tmp_path / "local.bin"
    return p, _file(p, 3 * MiB + 17)


# ---------------------------------------------------------------------- round trip


@pytest.mark.parametrize("parallelism", [1, 4])
def test_posix_round_trip(root: Path, src: tuple[Path, bytes], tmp_path: Path, parallelism: int) -> None:
    local, data = src
    t = PosixTarget(root, parallelism=parallelism)
    seen: list[tuple[int, int]] = []
    res = t.put_file(local, "run/step_1/rank0.pt", chunk_bytes=1 * MiB, on_progress=lambda d, n: seen.append((d, n)))
    assert isinstance(res, PutResult)
    assert (res.key, res.size_bytes, res.parts, res.retries) == ("run/step_1/rank0.pt", len(data), 1, 0)
    assert res.url == str(root / "run/step_1/rank0.pt")
    assert seen == [(min((i + 1) * MiB, len(data)), len(data)) for i in range(4)]
    assert (root / "run/step_1/rank0.pt").read_bytes() == data
    assert t.size("run/step_1/rank0.pt") == len(data)
    assert t.exists("run/step_1/rank0.pt") is True
    assert t.exists("run/step_1/nope.pt") is False
    assert t.read_range("run/step_1/rank0.pt", 1000, 300) == data[1000:1300]
    t.verify("run/step_1/rank0.pt", len(data), checksum.checksum_bytes(data))

    t.put_bytes("run/step_1/fastckpt-manifest.json", b'{"v": 1}')
    t.put_bytes("run/step_1/fastckpt-manifest.json", b'{"v": 2}')  # replaces atomically
    assert t.get_bytes("run/step_1/fastckpt-manifest.json") == b'{"v": 2}'
    assert t.list() == ["run/step_1/fastckpt-manifest.json", "run/step_1/rank0.pt"]
    assert t.list("run/step_1/r") == ["run/step_1/rank0.pt"]
    assert t.list("other/") == []

    out = tmp_path / "restored.bin"
    assert t.download("run/step_1/rank0.pt", out, chunk_bytes=1 * MiB) == len(data)
    assert out.read_bytes() == data

    t.delete("run/step_1/rank0.pt")
    t.delete("run/step_1/rank0.pt")  # idempotent
    t.delete("run/step_1/fastckpt-manifest.json")
    assert t.list() == []
    assert list(root.iterdir()) == []  # emptied directories are pruned
    assert tmp_files(root) == []


def test_verify_multi_block_parallel_ranges(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2.5 checksum blocks read as three ranges on three threads: same digest as in memory.
    monkeypatch.setattr(targets, "READ_CHUNK_BYTES", checksum.BLOCK_BYTES)
    local = tmp_path / "big.bin"
    data = _file(local, checksum.BLOCK_BYTES * 5 // 2, seed=3)
    t = PosixTarget(root, parallelism=3)
    t.put_file(local, "big.bin", chunk_bytes=7 * MiB)
    t.verify("big.bin", len(data), checksum.checksum_bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        t.verify("big.bin", len(data), checksum.checksum_bytes(data[:-1] + b"\x00"))


def test_verify_detects_corruption_and_truncation(root: Path, src: tuple[Path, bytes]) -> None:
    local, data = src
    t = PosixTarget(root)
    t.put_file(local, "a.pt")
    good = checksum.checksum_bytes(data)
    with open(root / "a.pt", "r+b") as f:  # flip one byte at rest
        f.seek(123456)
        b = f.read(1)
        f.seek(123456)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=r"a\.pt: checksum .* was recorded") as ei:
        t.verify("a.pt", len(data), good)
    assert "copy it again" in str(ei.value)
    os.truncate(root / "a.pt", 1000)
    with pytest.raises(CorruptCheckpointError, match=f"is 1000 bytes, expected {len(data)}"):
        t.verify("a.pt", len(data), good)
    with pytest.raises(TargetNotFoundError):
        t.verify("missing.pt", len(data), good)


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/./b", "../up", "a/..", "a\\b", "end/"])
def test_bad_keys_are_refused(root: Path, key: str) -> None:
    with pytest.raises(ConfigError, match="relative to the target root"):
        PosixTarget(root).put_bytes(key, b"x")


def test_missing_root_is_not_created(tmp_path: Path, src: tuple[Path, bytes]) -> None:
    t = PosixTarget(tmp_path / "not-mounted")
    with pytest.raises(TargetNotFoundError, match=r"does not exist.*mkdir -p") as ei:
        t.put_file(src[0], "a.pt")
    assert ei.value.errno == errno.ENOENT
    assert not (tmp_path / "not-mounted").exists()
    with pytest.raises(TargetNotFoundError):
        t.get_bytes("a.pt")


# ---------------------------------------------------------------------- atomicity


def test_interrupted_upload_leaves_nothing_and_keeps_previous(root: Path, src: tuple[Path, bytes],
                                                              tmp_path: Path) -> None:
    local, data = src
    t = PosixTarget(root)
    old = _file(tmp_path / "old.bin", 1000)
    t.put_file(tmp_path / "old.bin", "a.pt")

    class Stop(Exception):
        pass

    def stop_after_first_chunk(done: int, total: int) -> None:
        raise Stop(f"cancelled at {done}/{total}")

    with pytest.raises(Stop):  # the callback's own exception, unchanged
        t.put_file(local, "a.pt", chunk_bytes=MiB, on_progress=stop_after_first_chunk)
    assert (root / "a.pt").read_bytes() == old
    assert tmp_files(root) == []


@pytest.mark.parametrize("fault, cls, code", [
    (Fault("pwrite", errno.ENOSPC, nth=2), ReplicationError, errno.ENOSPC),
    (Fault("fsync", errno.EIO), ReplicationError, errno.EIO),
    (Fault("replace", errno.EACCES), TargetPermissionError, errno.EACCES),
    (Fault("open", errno.EROFS), ReplicationError, errno.EROFS),
])
def test_permanent_faults_raise_at_once_and_clean_up(root: Path, src: tuple[Path, bytes], fault: Fault,
                                                     cls: type, code: int) -> None:
    ops = FaultyOps([fault])
    retried: list = []
    t = PosixTarget(root, ops=ops, on_retry=retried.append)
    with pytest.raises(cls) as ei:
        t.put_file(src[0], "d/a.pt", chunk_bytes=MiB)
    ops.assert_all_reached()
    assert ei.value.errno == code
    assert str(root) in str(ei.value) and "d/a.pt" in str(ei.value)
    assert retried == []  # permanent: no retries
    assert not (root / "d/a.pt").exists()
    assert tmp_files(root) == []


def test_enospc_message_names_the_fix(root: Path, src: tuple[Path, bytes]) -> None:
    t = PosixTarget(root, ops=FaultyOps([Fault("pwrite", errno.ENOSPC)]))
    with pytest.raises(ReplicationError, match="free space on the target"):
        t.put_file(src[0], "a.pt")


def test_transient_error_is_retried(root: Path, src: tuple[Path, bytes]) -> None:
    local, data = src
    ops = FaultyOps([Fault("pwrite", errno.ETIMEDOUT, nth=2)])
    notices: list[RetryNotice] = []
    t = PosixTarget(root, ops=ops, on_retry=notices.append, retry_deadline_s=30)
    seen: list[int] = []
    res = t.put_file(local, "a.pt", chunk_bytes=MiB, on_progress=lambda d, n: seen.append(d))
    ops.assert_all_reached()
    assert res.retries == 1
    assert [(n.attempt, getattr(n.error, "errno", None)) for n in notices] == [(1, errno.ETIMEDOUT)]
    assert "a.pt" in notices[0].what
    assert seen == sorted(seen) and seen[-1] == len(data)  # a retry never reports bytes twice
    assert (root / "a.pt").read_bytes() == data
    assert tmp_files(root) == []


def test_transient_errors_past_the_deadline(root: Path, src: tuple[Path, bytes]) -> None:
    ops = FaultyOps([Fault("open", errno.ECONNRESET) for _ in range(1000)])
    t = PosixTarget(root, ops=ops, retry_deadline_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TargetUnavailableError, match=r"kept failing for .*retry_deadline_s \(now 0.3 s\)") as ei:
        t.put_file(src[0], "a.pt")
    assert time.monotonic() - t0 < 0.3 + 5.0  # one backoff step at most past the deadline
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, ReplicationError)
    assert ei.value.errno == errno.ETIMEDOUT
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ECONNRESET
    assert tmp_files(root) == []


def test_the_last_attempt_starts_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries ride out an outage for the whole deadline: a long random backoff near the end is
    cut short to the deadline, instead of giving up a backoff early."""
    monkeypatch.setattr(retry, "BACKOFF_FIRST_S", 0.5)  # backoffs up to BACKOFF_MAX_S from the start
    starts: list[float] = []

    def down() -> None:
        starts.append(time.monotonic())
        raise ConnectionResetError("down")

    t0 = time.monotonic()
    with pytest.raises(TargetUnavailableError):
        retry.retry_call(down, what="upload", url="s3://b", deadline_s=1.0, is_transient=lambda e: True,
                         permanent=lambda e, w: None)
    assert starts[-1] - t0 >= 1.0 - 0.05  # (the clock's resolution)


def test_full_file_system(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "tiny", "size=2m") as mnt:
        t = PosixTarget(mnt)
        small = tmp_path / "small.bin"
        old = _file(small, 100 * KiB)
        t.put_file(small, "a.pt")
        big = tmp_path / "big.bin"
        _file(big, 4 * MiB)
        with pytest.raises(ReplicationError, match="No space left on device.*free space on the target") as ei:
            t.put_file(big, "a.pt", chunk_bytes=256 * KiB)
        assert ei.value.errno == errno.ENOSPC
        assert (mnt / "a.pt").read_bytes() == old
        assert tmp_files(mnt) == []
        assert shutil.disk_usage(mnt).used <= 200 * KiB  # the partial temp file's blocks were freed


def test_read_only_file_system(tmp_path: Path, src: tuple[Path, bytes]) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        t = PosixTarget(mnt)
        with pytest.raises(ReplicationError, match="read-only.*remount it read-write") as ei:
            t.put_file(src[0], "a.pt")
        assert ei.value.errno == errno.EROFS
        with pytest.raises(ReplicationError, match="read-only"):
            t.put_bytes("latest", b"step_1")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores mode bits (the read-only mount test covers root)")
def test_read_only_directory(root: Path, src: tuple[Path, bytes]) -> None:
    root.chmod(0o555)
    try:
        with pytest.raises(TargetPermissionError, match="owner/mode") as ei:
            PosixTarget(root).put_file(src[0], "a.pt")
        assert ei.value.errno == errno.EACCES
    finally:
        root.chmod(0o755)


# ---------------------------------------------------------------------- housekeeping and helpers


def test_clean_incomplete_removes_only_stale_temp_files(root: Path) -> None:
    (root / "run").mkdir()
    stale = root / "run" / f".a.pt.fastckpt-tmp-{uuid.uuid4().hex[:12]}"
    fresh = root / "run" / f".b.pt.fastckpt-tmp-{uuid.uuid4().hex[:12]}"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    (root / "run" / "c.pt").write_bytes(b"z")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    t = PosixTarget(root)
    assert t.list() == ["run/c.pt"]
    assert t.clean_incomplete("run/", older_than_s=3600) == 1
    assert not stale.exists() and fresh.exists()
    assert t.clean_incomplete("other/", older_than_s=0) == 0
    assert t.clean_incomplete(older_than_s=0) == 1


def test_list_walks_only_the_directories_its_prefix_names(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A string prefix: "run/.s9.n" names run/.s9.next-a/..., run/.s9.nx (a file), not run/s1/.
    for rel in ["run/.s9.next-a/x.pt", "run/.s9.next-a/sub/y.pt", "run/.s9.nx", "run/s1/a.pt", "run/s1/b/c.pt",
                "other/z.pt", "top.pt"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / "run" / ".s9.next-b").mkdir()
    Path(atomic.tmp_name(str(root / "run" / ".s9.next-a" / "w.pt"))).write_bytes(b"t")
    (root / "run" / ".s9.next-link").symlink_to(root / "run" / "s1")
    scanned: list[str] = []
    real = os.scandir

    def spy(path: str | os.PathLike = ".") -> os.ScandirIterator:  # type: ignore[name-defined]
        scanned.append(os.path.relpath(os.fspath(path), root))
        return real(path)

    monkeypatch.setattr(os, "scandir", spy)
    t = PosixTarget(root)
    assert t.list("run/.s9.n") == ["run/.s9.next-a/sub/y.pt", "run/.s9.next-a/x.pt", "run/.s9.nx"]
    assert sorted(scanned) == ["run", "run/.s9.next-a", "run/.s9.next-a/sub", "run/.s9.next-b"]
    assert t.list("run/s1/", max_depth=0) == ["run/s1/a.pt"]
    assert t.list("ru") == ["run/.s9.next-a/sub/y.pt", "run/.s9.next-a/x.pt", "run/.s9.nx", "run/s1/a.pt",
                            "run/s1/b/c.pt"]
    assert t.list() == sorted(t.list("ru") + ["other/z.pt", "top.pt"])
    # dirs(): every directory the prefix names, also an empty one or one of temp files only; no links.
    (root / "run" / ".s9.next-c").mkdir()
    Path(atomic.tmp_name(str(root / "run" / ".s9.next-c" / "v.pt"))).write_bytes(b"t")
    assert t.dirs("run/.s9.next") == ["run/.s9.next-a", "run/.s9.next-b", "run/.s9.next-c"]
    assert t.dirs("run/") == ["run/.s9.next-a", "run/.s9.next-b", "run/.s9.next-c", "run/s1"]
    assert t.dirs("") == ["other", "run"]
    assert t.dirs("gone/x") == [] and t.dirs("top.pt/x") == []


def test_dirs_on_an_object_store_are_those_holding_objects() -> None:
    t = open_target(f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run", parallelism=1)
    for key in ["a/.s9.next-a/x.pt", "a/.s9.next-a/sub/y.pt", "a/.s9.nx", "a/s1/z.pt", "b/q.pt"]:
        t.put_bytes(key, b"x")
    assert t.dirs("a/.s9.n") == ["a/.s9.next-a"]
    assert t.dirs("a/") == ["a/.s9.next-a", "a/s1"]
    assert t.dirs("") == ["a", "b"]


@pytest.mark.parametrize("where", ["posix", "memory"])
def test_sizes_are_of_the_objects_directly_in_a_directory(root: Path, where: str) -> None:
    t = PosixTarget(root) if where == "posix" else open_target(f"memory://fastckpt-{uuid.uuid4().hex[:8]}/r")
    for key, n in [("g/a.pt", 3), ("g/b.pt", 5), ("g/sub/c.pt", 7), ("gx.pt", 1), ("top.pt", 2)]:
        t.put_bytes(key, b"x" * n)
    if where == "posix":  # a temp file of a write in progress is not an object
        Path(atomic.tmp_name(str(root / "g" / "w.pt"))).write_bytes(b"t")
    assert t.sizes("g/") == {"g/a.pt": 3, "g/b.pt": 5}
    assert t.sizes("") == {"gx.pt": 1, "top.pt": 2} and t.sizes("gone/") == {}


def test_put_new_creates_once_and_returns_what_won(root: Path) -> None:
    t = PosixTarget(root)
    won = claim_race(t.put_new, "run/.fastckpt/claim-a.json", 8)
    assert t.get_bytes("run/.fastckpt/claim-a.json") == won
    assert tmp_files(root) == []
    mem = open_target(f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run", parallelism=1)  # the two-step default
    assert mem.put_new("a/claim.json", b"first") is None
    assert mem.put_new("a/claim.json", b"second") == b"first"


def test_token_bucket_paces_without_real_sleeps() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    tb = TokenBucket(1_000_000, burst_bytes=250_000, clock=lambda: now[0], sleep=sleep)
    for _ in range(8):
        tb.consume(250_000)
    # The first 250 kB is the burst; the other 1.75 MB take 1.75 s at 1 MB/s.
    assert sum(slept) == pytest.approx(1.75)
    assert now[0] - 100.0 == pytest.approx(1.75)
    now[0] += 10.0  # idle: the bucket refills only up to the burst
    slept.clear()
    tb.consume(500_000)
    assert sum(slept) == pytest.approx(0.25)
    with pytest.raises(ConfigError, match="bandwidth_Bps"):
        TokenBucket(0)


def test_a_nan_bandwidth_cap_is_a_config_error_naming_it(root: Path, src: tuple[Path, bytes]) -> None:
    """The burst (one second's worth) was computed with int() before the rate was checked: a NaN cap
    raised ValueError, not the ConfigError naming the option."""
    with pytest.raises(ConfigError, match="bandwidth_Bps=nan must be > 0"):
        PosixTarget(root).put_file(src[0], "a.pt", bandwidth_Bps=float("nan"))
    assert as_limiter(float("inf"), MiB) is None  # no cap, as None
    assert as_limiter(0.5, MiB).burst_bytes == 1 and as_limiter(4e6, MiB).burst_bytes == MiB


def test_put_file_honours_bandwidth(root: Path, tmp_path: Path) -> None:
    local = tmp_path / "x.bin"
    _file(local, 2 * MiB)
    t0 = time.monotonic()
    PosixTarget(root).put_file(local, "x.bin", bandwidth_Bps=4 * MiB, chunk_bytes=256 * KiB)
    # burst = one chunk, then 1.75 MiB at 4 MiB/s
    assert time.monotonic() - t0 >= 0.4


def test_verify_read_back_is_paced_by_the_shared_bandwidth_cap(root: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The read-back takes its tokens from the same bucket as uploads (replicate_bandwidth_Bps).
    block = checksum.BLOCK_BYTES
    monkeypatch.setattr(targets, "READ_CHUNK_BYTES", block)
    local = tmp_path / "x.bin"
    data = _file(local, 2 * block + 5)
    t = PosixTarget(root, parallelism=2)
    t.put_file(local, "x.bin")
    now, slept, taken = [0.0], [], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    class Spy(TokenBucket):
        def consume(self, n: int) -> float:
            taken.append(n)
            return super().consume(n)

    cap = Spy(block, burst_bytes=block, clock=lambda: now[0], sleep=sleep)
    t.verify("x.bin", len(data), checksum.checksum_bytes(data), bandwidth_Bps=cap)
    assert sorted(taken) == [5, block, block]  # every byte read back was paid for
    assert sum(slept) == pytest.approx((block + 5) / block)  # after a one-range burst, `block` bytes/s


def test_download_failure_leaves_no_file(root: Path, src: tuple[Path, bytes], tmp_path: Path) -> None:
    ops = FaultyOps()
    t = PosixTarget(root, ops=ops)
    t.put_file(src[0], "a.pt")
    ops.inject(Fault("preadv", errno.EIO, path_contains="a.pt"))
    out = tmp_path / "dl" / "a.pt"
    out.parent.mkdir()
    with pytest.raises(OSError) as err:  # a read's failure: the OSError itself, not a write error
        t.download("a.pt", out, chunk_bytes=MiB)
    assert err.value.errno == errno.EIO and not isinstance(err.value, ReplicationError)
    assert list(out.parent.iterdir()) == []


def test_a_failed_read_raises_its_os_error_not_a_write_error(root: Path, src: tuple[Path, bytes]) -> None:
    """Every OSError of a read became a ReplicationError (a CheckpointWriteError), so a load that
    hit EIO or EACCES reported a failed write; the OSError itself is raised, with a note naming
    the read and the fix. A missing file is still TargetNotFoundError."""
    ops = FaultyOps()
    t = PosixTarget(root, ops=ops, retry_deadline_s=0)
    t.put_file(src[0], "a.pt")
    ops.inject(Fault("open", errno.EACCES, path_contains="a.pt"))
    with pytest.raises(PermissionError) as err:
        t.read_range("a.pt", 0, 10)
    assert not isinstance(err.value, ReplicationError)
    assert err.value.__notes__ == [f"read of {root / 'a.pt'} ({root}): fix the file's owner/mode, or run as a user "
                                   "who may read it"]
    ops.inject(Fault("preadv", errno.EIO, path_contains="a.pt"))
    with pytest.raises(OSError) as err:
        t.read_object("a.pt")
    assert err.value.errno == errno.EIO and not isinstance(err.value, ReplicationError)
    assert "check the mount (dmesg)" in err.value.__notes__[0]
    with pytest.raises(TargetNotFoundError):
        t.get_bytes("b.pt")


def test_open_target_chooses_by_scheme(root: Path) -> None:
    assert isinstance(open_target(root), PosixTarget)
    assert isinstance(open_target(f"file://{root}"), PosixTarget)
    assert open_target(f"file://{root}").url == str(root)
    with pytest.raises(ConfigError, match="storage_options apply to URL targets only"):
        open_target(root, {"key": "k"})


def test_open_target_s3_needs_no_connection() -> None:
    pytest.importorskip("s3fs")
    s3 = open_target("s3://some-bucket/prefix", {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"})
    assert isinstance(s3, FsspecTarget) and s3.url == "s3://some-bucket/prefix"
    assert (s3.bucket, s3.prefix) == ("some-bucket", "prefix")
    assert "secret" not in repr(s3) and "'s'" not in repr(s3)
    with pytest.raises(ConfigError, match="names no bucket"):
        open_target("s3://")


def test_fsspec_generic_path_on_memory_fs(src: tuple[Path, bytes], tmp_path: Path) -> None:
    local, data = src
    t = open_target(f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run", parallelism=2)
    assert isinstance(t, FsspecTarget) and not t.is_s3
    res = t.put_file(local, "s1/a.pt", chunk_bytes=MiB)
    assert (res.size_bytes, res.parts) == (len(data), 1)
    t.verify("s1/a.pt", len(data), checksum.checksum_bytes(data))
    t.put_bytes("s1/manifest.json", b"{}")
    assert t.list() == ["s1/a.pt", "s1/manifest.json"]
    assert t.read_range("s1/a.pt", 5, 10) == data[5:15]
    assert t.download("s1/a.pt", tmp_path / "back.bin") == len(data)
    assert (tmp_path / "back.bin").read_bytes() == data

    def boom(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        t.put_file(local, "s1/b.pt", chunk_bytes=MiB, on_progress=boom)
    assert t.list() == ["s1/a.pt", "s1/manifest.json"]
    assert not any(".fastckpt-tmp-" in p for p in t.fs.find(t.root))
    t.delete("s1/a.pt")
    t.delete("s1/a.pt")
    assert not t.exists("s1/a.pt")
    with pytest.raises(TargetNotFoundError):
        t.get_bytes("s1/a.pt")


@pytest.mark.parametrize("call", ["put_bytes", "put_file"])
def test_a_failed_publish_on_a_generic_object_store_leaves_no_temp_key(tmp_path: Path, call: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Other fsspec protocols write a temp key, then move it: a move refused for good must not
    leave the temp key behind (a bucket that fills with them, forever)."""
    t = open_target(f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run", parallelism=1)
    t.put_bytes("latest", b"old")

    def refused(*_a: object, **_k: object) -> None:
        raise PermissionError(errno.EACCES, "read-only bucket")

    monkeypatch.setattr(t.fs, "mv", refused)
    local = tmp_path / "f.bin"
    local.write_bytes(b"new" * 100)
    with pytest.raises(ReplicationError, match="permission denied"):
        t.put_bytes("latest", b"new") if call == "put_bytes" else t.put_file(local, "latest")
    assert sorted(p.rsplit("/", 1)[-1] for p in t.fs.find(t.root)) == ["latest"]
    assert t.get_bytes("latest") == b"old"


def test_a_refused_connection_after_a_generic_store_answered_is_an_outage_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only S3 requests marked the store as reached: at memory://, gs://, az://... a connection
    refused after hours of working reads was taken for a wrong URL (``TargetUnreachableError``, a
    ``ConfigError``, raised at once) instead of an outage to ride out for ``retry_deadline_s``."""
    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    down, notices = [False], []

    def back_up(notice: RetryNotice) -> None:  # the store comes back as the first retry is scheduled
        notices.append(notice)
        down[0] = False

    t = open_target(url, parallelism=1, retry_deadline_s=30, on_retry=back_up)
    orig = t.fs.cat_file

    def cat_file(path: str, *a: object, **k: object) -> bytes:
        if down[0]:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        return orig(path, *a, **k)

    monkeypatch.setattr(t.fs, "cat_file", cat_file)
    t.put_bytes("a.bin", b"x" * 16)
    assert t.get_bytes("a.bin") == b"x" * 16  # the store answered
    down[0] = True
    assert t.get_bytes("a.bin") == b"x" * 16
    assert [type(n.error) for n in notices] == [ConnectionRefusedError]

    down[0] = True  # a target whose very first request is refused (at a root never reached): a wrong URL, told at once
    fresh = FsspecTarget(f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run", retry_deadline_s=30, on_retry=back_up)
    with pytest.raises(TargetUnreachableError, match="connection refused"):
        fresh.get_bytes("a.bin")
    assert len(notices) == 1
