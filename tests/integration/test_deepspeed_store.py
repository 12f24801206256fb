"""The DeepSpeed hooks' reads of the small files at an S3 ``save_dir`` (rank 0's listing of a
tag before its save, the resolution of ``latest`` before a load) during a short outage of an
endpoint that has answered before: retried for the configured ``retry_deadline_s``, as every
other request of a save, not taken for a wrong endpoint (a real SeaweedFS, no DeepSpeed
processes: the hooks run over a stand-in engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from fastckpt import Checkpointer  # noqa: E402
from fastckpt.integrations._deepspeed.engine import FastCkptEngine  # noqa: E402
from fastckpt.integrations._deepspeed.hooks import EngineHooks  # noqa: E402
from fastckpt.storage.types import TargetUnavailableError, TargetUnreachableError  # noqa: E402
from tests.helpers import StubEngine  # noqa: E402


def test_an_outage_after_the_endpoint_answered_is_retried_for_retry_deadline_s(s3_server, s3_bucket: str,
                                                                              tmp_path: Path) -> None:
    """Each call made a new Store (a new target, the default deadline): "connection refused" on
    its first request was taken for a wrong endpoint, and save_checkpoint raised at once."""
    url = f"s3://{s3_bucket}/run"
    with Checkpointer(storage_options=s3_server.storage_options(), local_dir=str(tmp_path / "nvme"),
                      retry_deadline_s=1) as ck:
        hooks = EngineHooks(StubEngine(), FastCkptEngine(ck), None, flush_at_exit=False)
        hooks._clear_leftover(f"{url}/global_step1")  # noqa: SLF001  (the endpoint answers: it is the right one)
        assert hooks._resolve(url) is None  # noqa: SLF001
        s3_server.stop()
        try:
            for call in (lambda: hooks._clear_leftover(f"{url}/global_step2"),  # noqa: SLF001  (a save's first)
                         lambda: hooks._resolve(url)):  # noqa: SLF001  (load_checkpoint(url)'s first)
                with pytest.raises(TargetUnavailableError, match=r"retry_deadline_s \(now 1 s\)") as info:
                    call()  # before: "... taken for a wrong or missing endpoint", at once
                assert not isinstance(info.value, TargetUnreachableError)
        finally:
            s3_server.start()
        hooks._clear_leftover(f"{url}/global_step2")  # noqa: SLF001  (back: the same Store goes on)
