"""storage/reach.py: which failures to connect are this node's set-up (raised at once, naming the
fix) and which an outage to ride out (retried): the S3 end to end is tests/integration/test_s3_endpoint.py."""

from __future__ import annotations

import socket
import ssl

import pytest

from fastckpt.storage.reach import proxy_refused, unreachable
from fastckpt.storage.types import TargetUnreachableError


def _chain(*errors: BaseException) -> BaseException:
    for outer, inner in zip(errors, errors[1:]):
        outer.__cause__ = inner
    return errors[0]


def _ssl(reason: str) -> ssl.SSLError:
    err = ssl.SSLError(1, f"[SSL: {reason}] {reason.lower().replace('_', ' ')}")
    err.reason = reason
    return err


@pytest.mark.parametrize("reason", ["WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE",
                                    "UNKNOWN_PROTOCOL", "UNEXPECTED_EOF_WHILE_READING"])
def test_a_first_handshake_failed_by_the_set_up_is_raised_at_once_however_openssl_words_it(reason: str) -> None:
    """https:// at a plain-HTTP port reads as any of these, by OpenSSL version (w5: "packet length
    too long" was retried for retry_deadline_s)."""
    got = unreachable(_chain(RuntimeError("SSL validation failed"), _ssl(reason)), "listing", "https://h:1")
    assert isinstance(got, TargetUnreachableError) and "give its endpoint as http://" in str(got)
    assert unreachable(_ssl(reason), "listing", "https://h:1", reached=True) is None  # answered: an outage


def test_a_terminators_alert_is_an_outage_and_an_untrusted_certificate_never_is() -> None:
    assert unreachable(_ssl("TLSV1_ALERT_INTERNAL_ERROR"), "listing", "https://h:1") is None
    cert = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    for reached in (False, True):
        assert isinstance(unreachable(cert, "listing", "https://h:1", reached=reached), TargetUnreachableError)
    assert unreachable(ConnectionRefusedError(111, "refused"), "listing", "http://h:1", reached=True) is None
    assert isinstance(unreachable(socket.gaierror(-2, "no such host"), "listing", "http://h:1"), TargetUnreachableError)


def test_a_proxy_that_refuses_the_tunnel_is_set_up_and_one_that_is_down_an_outage() -> None:
    from aiohttp import ClientHttpProxyError
    from botocore.exceptions import ProxyConnectionError

    def refusal(status: int) -> BaseException:
        return ClientHttpProxyError(None, (), status=status, message="no")

    assert proxy_refused(_chain(ProxyConnectionError(proxy_url="http://p:3128"), refusal(407)))
    assert proxy_refused(_chain(ProxyConnectionError(proxy_url="http://p:3128"), refusal(403)))
    assert not proxy_refused(_chain(ProxyConnectionError(proxy_url="http://p:3128"), refusal(502)))
    assert not proxy_refused(_chain(ProxyConnectionError(proxy_url="http://p:3128"),
                                    ConnectionRefusedError(111, "refused")))  # w5: a proxy restarting
