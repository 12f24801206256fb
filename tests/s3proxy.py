"""Proxies in front of the test S3 server (``tests/s3server.py``) that answer as some stores and
networks do, for the tests of how fastckpt tells an outage from a wrong endpoint or a store that
lacks a feature:

- ``TLSProxy``: an https endpoint (a self-signed certificate, made with the ``openssl`` command)
  that forwards the bytes to the plain-HTTP server; the connections numbered in ``fail`` (0 is
  the first) get a TLS fatal alert (internal_error) instead of a handshake, as an overloaded TLS
  terminator answers.
- ``NotImplementedProxy``: answers each request carrying the ``x-amz-checksum-crc32`` header with
  the 501 NotImplemented error Cloudflare R2 and Backblaze B2 gave before they supported it, and
  forwards every other request.
- ``StatusProxy``: answers the first ``times`` PUTs with a given HTTP status and body (a CDN's
  520-524 page, MinIO's 507 XMinioStorageFull), and forwards every other request.

Each serves on 127.0.0.1 from daemon threads; ``close()`` stops taking connections.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

HOST = "127.0.0.1"
TLS_ALERT_INTERNAL_ERROR = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 80])  # a fatal alert record
NOT_IMPLEMENTED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code><Message>Header '
                   b"'x-amz-checksum-crc32' with value 'AAAAAA==' not implemented</Message></Error>")


class TLSProxy:
    """TLS in front of ``backend`` (host, port); ``cert``: the certificate a client must trust."""

    def __init__(self, backend: tuple[str, int], certdir: str, fail: frozenset[int] = frozenset()) -> None:
        if shutil.which("openssl") is None:
            pytest.skip("needs the openssl command to make a certificate")
        self.backend, self.fail, self.opened, self.refused = backend, fail, 0, 0
        self.cert, key = os.path.join(certdir, "cert.pem"), os.path.join(certdir, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", self.cert,
                        "-days", "1", "-subj", f"/CN={HOST}", "-addext", f"subjectAltName=IP:{HOST}"],
                       check=True, capture_output=True)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(self.cert, key)
        self._sock = socket.create_server((HOST, 0))
        self.endpoint_url = f"https://{HOST}:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            n, self.opened = self.opened, self.opened + 1
            threading.Thread(target=self._serve, args=(conn, n), daemon=True).start()

    def _serve(self, conn: socket.socket, n: int) -> None:
        try:
            if n in self.fail:
                conn.recv(4096)  # the ClientHello
                conn.sendall(TLS_ALERT_INTERNAL_ERROR)
                self.refused += 1
                conn.close()
                return
            tls = self._ctx.wrap_socket(conn, server_side=True)
            backend = socket.create_connection(self.backend)
        except OSError:  # ssl.SSLError too: a client that gave up on the handshake
            conn.close()
            return
        threading.Thread(target=_pump, args=(backend, tls), daemon=True).start()
        _pump(tls, backend)

    def close(self) -> None:
        self._sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _AnsweringProxy:
    """HTTP in front of the server at ``backend_port``: a request ``answer`` returns (status, content
    type, body) for is answered so, every other one forwarded."""

    def __init__(self, backend_port: int) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answer = outer.answer(self.command, {k.lower() for k in self.headers})
                if answer is not None:
                    status, content_type, data = answer
                    self._reply(status, [("Content-Type", content_type)], data)
                    return
                conn = http.client.HTTPConnection(HOST, backend_port, timeout=30)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                resp = conn.getresponse()
                drop = ("content-length", "transfer-encoding", "connection")
                size = resp.getheader("Content-Length") if self.command == "HEAD" else None  # the object's
                self._reply(resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in drop], resp.read(),
                            size)
                conn.close()

            def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes, size: str | None = None) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", size or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self.endpoint_url = f"http://{HOST}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def answer(self, method: str, headers: set[str]) -> tuple[int, str, bytes] | None:
        raise NotImplementedError

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class NotImplementedProxy(_AnsweringProxy):
    """Refuses ``x-amz-checksum-crc32`` with 501; ``refused``: how many requests it refused."""

    def __init__(self, backend_port: int) -> None:
        self.refused = 0
        super().__init__(backend_port)

    def answer(self, method: str, headers: set[str]) -> tuple[int, str, bytes] | None:
        if "x-amz-checksum-crc32" not in headers:
            return None
        with self._lock:
            self.refused += 1
        return 501, "application/xml", NOT_IMPLEMENTED


class StatusProxy(_AnsweringProxy):
    """Answers the first ``times`` PUTs with ``status`` (``body``, of ``content_type``), then
    forwards them; ``refused``: how many it answered so."""

    def __init__(self, backend_port: int, status: int, content_type: str, body: bytes, times: int) -> None:
        self.status, self.content_type, self.body, self.times, self.refused = status, content_type, body, times, 0
        super().__init__(backend_port)

    def answer(self, method: str, headers: set[str]) -> tuple[int, str, bytes] | None:
        with self._lock:
            if method != "PUT" or self.refused >= self.times:
                return None
            self.refused += 1
        return self.status, self.content_type, self.body
