"""fastckpt.progress: log lines or a rich bar, rendered off the caller's thread."""

from __future__ import annotations

import io
import logging
import threading

import pytest

from fastckpt.progress import Progress, human


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_mode_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fastckpt")
    with Progress("copying", total=4096, stream=io.StringIO(), every_s=3600) as p:
        assert p.mode == "log"
        p.advance(1024)
        p.advance(1024)
    assert p.lines >= 1
    assert "copying: 2.05 kB of 4.1 kB (50%)" in caplog.messages[-1]


def test_read_is_polled_on_the_progress_thread(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fastckpt")
    callers = set()

    def read() -> float:
        callers.add(threading.current_thread().name)
        return 3

    with Progress("saving", total=None, unit="files", read=read, mode="log", every_s=3600):
        pass
    assert callers == {"fastckpt-progress"}
    assert "saving: 3 files" in caplog.messages[-1]


def test_quick_operations_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fastckpt")
    with Progress("waiting", total=10, mode="log", delay_s=3600) as p:
        p.update(10)
    assert p.lines == 0 and caplog.messages == []


def test_bar_on_a_terminal() -> None:
    tty = _Tty()
    with Progress("probe write", total=1 << 20, stream=tty) as p:
        assert p.mode == "bar"
        p.update(1 << 20)
    out = tty.getvalue()
    assert "probe write" in out and "100%" in out


def test_off_and_bad_arguments() -> None:
    with Progress("x", mode="off") as p:
        p.advance(1)
    assert p.lines == 0 and p.done == 1
    with pytest.raises(ValueError, match="mode"):
        Progress("x", mode="loud")
    assert human(1536) == "1.54 kB" and human(12, "files") == "12 files" and human(3) == "3 B"
