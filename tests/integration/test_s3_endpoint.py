"""A wrong or missing S3 endpoint fails in seconds, naming the endpoint and how to set one; an
endpoint that answered once and then goes away is an outage, retried (tests/integration/
test_burst_buffer.py: the outage tests), at every bucket on it. A TLS handshake that fails is
either (a wrong scheme or an untrusted certificate at the first request; a refused handshake
after it), a store that does not implement what a request asks (501) fails at once, and a passing
5xx outside botocore's four (a CDN's 520-524, MinIO's 507) is retried.
Real SeaweedFS, behind real TLS and HTTP proxies (tests/s3proxy.py) where a store's answer is
needed that SeaweedFS does not give."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit.names import SIDECAR
from fastckpt.errors import ReplicationError
from fastckpt.events import Event
from fastckpt.storage.fsspec import FsspecTarget
from fastckpt.storage.types import RetryNotice, TargetUnavailableError, TargetUnreachableError
from tests.s3proxy import NotImplementedProxy, StatusProxy, TLSProxy
from tests.s3server import S3Server, free_ports

KEYS = {"key": "k", "secret": "s", "client_kwargs": {"region_name": "us-east-1"}}


def _refusing_endpoint() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there: connection refused


def test_refused_first_request_is_a_config_error_in_seconds() -> None:
    endpoint = _refusing_endpoint()
    t0 = time.monotonic()
    with pytest.raises(TargetUnreachableError) as info:
        fastckpt.latest("s3://bucket/run7", storage_options={"endpoint_url": endpoint, **KEYS})
    assert time.monotonic() - t0 < 30  # the default retry deadline is 300 s
    msg = str(info.value)
    assert endpoint in msg and "connection refused" in msg and "AWS_ENDPOINT_URL" in msg and "storage_options" in msg
    assert isinstance(info.value, fastckpt.ConfigError) and isinstance(info.value, TargetUnavailableError)


def test_unknown_host_is_a_config_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(TargetUnreachableError, match=r"no-such-host\.invalid.*no such host.*AWS_ENDPOINT_URL"):
        fastckpt.load("s3://bucket/run7/step-1.pt",
                      storage_options={"endpoint_url": "http://no-such-host.invalid:9000", **KEYS})
    assert time.monotonic() - t0 < 60  # one name lookup, not five minutes of retries


def test_replication_to_a_refusing_endpoint_fails_the_save_once_and_keeps_the_local_copy(tmp_path) -> None:
    endpoint = _refusing_endpoint()
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options={"endpoint_url": endpoint, **KEYS})
    url = "s3://bucket/run7/step-1.pt"
    h = ck.save({"w": torch.arange(10)}, url)
    with pytest.raises(TargetUnreachableError, match=endpoint):
        h.wait()
    assert os.path.exists(ck.local_path(url))
    ck.close()  # seen through the handle: not raised again


def test_cli_names_the_endpoint_without_a_traceback() -> None:
    endpoint = _refusing_endpoint()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
               AWS_DEFAULT_REGION="us-east-1")
    done = subprocess.run([sys.executable, "-m", "fastckpt.cli", "latest", "s3://bucket/run7"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "TargetUnreachableError" in done.stderr and endpoint in done.stderr and "Traceback" not in done.stderr


def test_a_tls_handshake_refused_after_the_endpoint_answered_is_retried(s3_server: S3Server, s3_bucket: str,
                                                                         tmp_path: Path) -> None:
    """A TLS alert on one connection of an upload (a part's, after the endpoint answered the
    CreateMultipartUpload) failed the whole upload at once: botocore's SSLError was not among the
    errors retried, although botocore's own retry mode retries it (botocore.exceptions.ConnectionError)."""
    proxy = TLSProxy(("127.0.0.1", s3_server.process.ports["s3"]), str(tmp_path), fail=frozenset({1}))
    notices: list[RetryNotice] = []
    opts = s3_server.storage_options(endpoint_url=proxy.endpoint_url,
                                     client_kwargs={"region_name": s3_server.region, "verify": proxy.cert})
    t = FsspecTarget(f"s3://{s3_bucket}", opts, parallelism=4, retry_deadline_s=60, on_retry=notices.append)
    data = bytes(range(256)) * (20 << 12)  # 20 MiB: 4 parts on parallel connections
    (tmp_path / "a.bin").write_bytes(data)
    try:
        t.put_file(str(tmp_path / "a.bin"), "run/a.bin", chunk_bytes=5 << 20)
        assert proxy.refused == 1  # the fault was reached
        assert [type(n.error).__name__ for n in notices] == ["SSLError"]
        assert t.get_bytes("run/a.bin") == data
    finally:
        t.close()
        proxy.close()


@pytest.mark.parametrize("case", ["https at a plain-HTTP store", "an untrusted certificate"])
def test_a_failed_tls_handshake_at_the_first_request_is_a_config_error_naming_scheme_and_certificate(
        s3_server: S3Server, tmp_path: Path, case: str) -> None:
    if case == "https at a plain-HTTP store":
        endpoint, proxy = s3_server.endpoint_url.replace("http://", "https://"), None
    else:
        proxy = TLSProxy(("127.0.0.1", s3_server.process.ports["s3"]), str(tmp_path))  # its certificate: not trusted
        endpoint = proxy.endpoint_url
    t0 = time.monotonic()
    try:
        with pytest.raises(TargetUnreachableError) as info:
            fastckpt.latest("s3://bucket/run7", storage_options=s3_server.storage_options(endpoint_url=endpoint))
    finally:
        if proxy is not None:
            proxy.close()
    assert time.monotonic() - t0 < 30  # the default retry deadline is 300 s
    msg = str(info.value)
    assert isinstance(info.value, fastckpt.ConfigError)
    assert f"the TLS handshake with the endpoint {endpoint} failed" in msg, msg
    assert "give its endpoint as http://, not https://" in msg and "certificate is self-signed" in msg
    assert "AWS_CA_BUNDLE" in msg


def test_an_outage_at_the_first_request_to_a_second_bucket_of_an_answered_endpoint_is_retried(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """Whether the endpoint had answered was kept per bucket (a target each): the first save into a
    second bucket on the same store, during a restart of the store, failed at once as a wrong
    endpoint ("Set it with AWS_ENDPOINT_URL"), a ConfigError, instead of riding the outage out."""
    exports = s3_server.make_bucket()
    seen, events = threading.Event(), []

    class Sink:
        def emit(self, ev: Event) -> None:
            if ev.name in ("retry", "replicate") and exports in ev.path:
                events.append(ev)
                seen.set()

    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options(),
                               retry_deadline_s=120, sinks=(Sink(),)) as ck:
        ck.save({"w": torch.zeros(10), "step": 1}, f"s3://{s3_bucket}/run/step-1.pt").wait()  # the endpoint answered
        s3_server.stop()
        try:
            h = ck.save({"w": torch.ones(10)}, f"s3://{exports}/model.pt", export=True)
            assert seen.wait(60)
            assert events[-1].name == "retry", events[-1].error  # before: replicate, failed at once
        finally:
            s3_server.start()
        assert h.wait().durable_s is not None
    assert torch.equal(fastckpt.load(f"s3://{exports}/model.pt", storage_options=s3_server.storage_options())["w"],
                       torch.ones(10))


def test_a_store_that_does_not_implement_a_header_fails_at_once_naming_it(s3_server: S3Server, s3_bucket: str,
                                                                          tmp_path: Path) -> None:
    """A 501 NotImplemented (a store that lacks the x-amz-checksum-crc32 header fastckpt sends with
    every body) was retried as an outage until retry_deadline_s, then reported as one ("kept
    failing ... check that the target is up"): botocore retries 500, 502, 503 and 504, not 501."""
    proxy = NotImplementedProxy(s3_server.process.ports["s3"])
    url = f"s3://{s3_bucket}/run/a.pt"
    t0 = time.monotonic()
    try:
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), retry_deadline_s=30,
                                   storage_options=s3_server.storage_options(endpoint_url=proxy.endpoint_url)) as ck:
            h = ck.save({"w": torch.zeros(10)}, url)
            with pytest.raises(ReplicationError) as info:
                h.wait()
            assert os.path.exists(ck.local_path(url))
    finally:
        proxy.close()
    assert time.monotonic() - t0 < 20 and proxy.refused == 1  # sent once, not again and again
    msg = str(info.value)
    assert not isinstance(info.value, TargetUnavailableError), msg
    assert f"the store at {proxy.endpoint_url} does not implement what PutObject asked for" in msg, msg
    assert "Header 'x-amz-checksum-crc32' with value 'AAAAAA==' not implemented" in msg and "HTTP 501" in msg
    assert "upgrade the store to a version that implements them" in msg
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])
    assert [o["Key"] for o in listed if o["Key"].endswith(SIDECAR)] == []


STORAGE_FULL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>XMinioStorageFull</Code><Message>Storage '
                b"backend has reached its minimum free drive threshold. Please delete a few objects to proceed."
                b"</Message></Error>")


@pytest.mark.parametrize(("status", "content_type", "body"), [
    (507, "application/xml", STORAGE_FULL),  # MinIO, a drive briefly full
    (520, "text/html", b"<html><body>error code: 520</body></html>"),  # a CDN in front of the store
    (524, "text/plain", b"error code: 524"),
    (509, "text/plain", b"Bandwidth Limit Exceeded")])
def test_a_passing_5xx_outside_botocores_four_is_retried(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                                         status: int, content_type: str, body: bytes) -> None:
    """Only 429, 500, 502, 503 and 504 were retried, as botocore's standard mode has them: a CDN's
    520-524 or MinIO's 507 while a drive was briefly full failed the upload at once. Every 5xx is
    retried now but those retrying cannot mend (501, 505, 506, 508, 510, 511)."""
    proxy = StatusProxy(s3_server.process.ports["s3"], status, content_type, body, times=2)
    url, retried = f"s3://{s3_bucket}/run/a.pt", []

    class Sink:
        def emit(self, ev: Event) -> None:
            if ev.name == "retry":
                retried.append(ev.error)

    try:
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), retry_deadline_s=60, sinks=(Sink(),),
                                   storage_options=s3_server.storage_options(endpoint_url=proxy.endpoint_url)) as ck:
            assert ck.save({"w": torch.arange(10)}, url).wait().durable_s is not None
    finally:
        proxy.close()
    assert proxy.refused == 2 and len(retried) == 2, retried
    assert all(str(status) in str(e) or "XMinioStorageFull" in str(e) for e in retried), retried  # the code, if any
    assert torch.equal(fastckpt.load(url, storage_options=s3_server.storage_options())["w"], torch.arange(10))


@pytest.mark.parametrize("status", [505, 511])
def test_a_5xx_that_retrying_cannot_mend_fails_at_once(s3_server: S3Server, s3_bucket: str, tmp_path: Path,
                                                       status: int) -> None:
    """505 HTTP Version Not Supported and 511 Network Authentication Required (a captive portal)
    stay as they are whatever the wait: raised at once, not retried until retry_deadline_s."""
    proxy = StatusProxy(s3_server.process.ports["s3"], status, "text/plain", b"no", times=100)
    t0 = time.monotonic()
    try:
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), retry_deadline_s=60,
                                   storage_options=s3_server.storage_options(endpoint_url=proxy.endpoint_url)) as ck:
            h = ck.save({"w": torch.zeros(10)}, f"s3://{s3_bucket}/run/a.pt")
            with pytest.raises(ReplicationError, match=f"HTTP {status}") as info:
                h.wait()
    finally:
        proxy.close()
    assert time.monotonic() - t0 < 30 and proxy.refused == 1
    assert not isinstance(info.value, TargetUnavailableError), str(info.value)


def test_tls_alerts_at_the_first_request_are_an_outage_retried(s3_server: S3Server, s3_bucket: str,
                                                              tmp_path: Path) -> None:
    """A busy TLS terminator's alerts on a fresh process's first connections are no wrong scheme
    or certificate (the ConfigError said to switch to http:// or trust the certificate)."""
    proxy = TLSProxy(("127.0.0.1", s3_server.process.ports["s3"]), str(tmp_path), fail=frozenset({0, 1}))
    opts = s3_server.storage_options(endpoint_url=proxy.endpoint_url,
                                     client_kwargs={"region_name": s3_server.region, "verify": proxy.cert})
    try:
        assert fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=opts) is None
        assert proxy.refused == 2
    finally:
        proxy.close()


def test_a_certificate_untrusted_after_the_endpoint_answered_fails_at_once(s3_server: S3Server, s3_bucket: str,
                                                                           tmp_path: Path) -> None:
    """A certificate rotated to one this node does not trust is no outage: it was retried for
    retry_deadline_s once the endpoint had answered (w3)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proxy = TLSProxy(("127.0.0.1", s3_server.process.ports["s3"]), str(tmp_path / "a"))
    opts = s3_server.storage_options(endpoint_url=proxy.endpoint_url,
                                     client_kwargs={"region_name": s3_server.region, "verify": proxy.cert})
    rotated = TLSProxy(("127.0.0.1", s3_server.process.ports["s3"]), str(tmp_path / "b"))
    try:
        assert fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=opts) is None  # answered
        proxy._ctx = rotated._ctx  # new connections get the other certificate
        t0 = time.monotonic()
        with pytest.raises(TargetUnreachableError, match="CERTIFICATE_VERIFY_FAILED.*have this node trust it"):
            fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=opts)
        assert time.monotonic() - t0 < 30  # the default retry deadline is 300 s
    finally:
        proxy.close()
        rotated.close()


def test_a_proxy_that_refuses_the_tunnel_fails_at_once() -> None:
    """HTTPS_PROXY answering CONNECT with 407 (credentials) is set-up, not an outage to retry."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))

    def refuse() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=x\r\n"
                             b"Content-Length: 0\r\nConnection: close\r\n\r\n")

    threading.Thread(target=refuse, daemon=True).start()
    opts = {**KEYS, "endpoint_url": _refusing_endpoint().replace("http://", "https://"),
            "config_kwargs": {"proxies": {"https": f"http://127.0.0.1:{server.getsockname()[1]}"}}}
    t0 = time.monotonic()
    try:
        with pytest.raises(ReplicationError, match="ProxyConnectionError"):
            fastckpt.latest("s3://proxied/run", storage_options=opts)
    finally:
        server.close()
    assert time.monotonic() - t0 < 30  # the default retry deadline is 300 s
