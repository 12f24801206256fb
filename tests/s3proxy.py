"""Proxies in front of the test S3 server (``tests/s3server.py``) that answer as some stores and
networks do, for the tests of how fastckpt tells an outage from a wrong endpoint:

- ``TLSProxy``: an https endpoint (a self-signed certificate, made with the ``openssl`` command)
  that forwards the bytes to the plain-HTTP server; the connections numbered in ``fail`` (0 is
  the first) get a TLS fatal alert (internal_error) instead of a handshake, as an overloaded TLS
  terminator answers.

Each serves on 127.0.0.1 from daemon threads; ``close()`` stops taking connections.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading

import pytest

HOST = "127.0.0.1"
TLS_ALERT_INTERNAL_ERROR = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 80])  # a fatal alert record


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
