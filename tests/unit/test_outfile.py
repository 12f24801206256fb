"""cli/outfile.write_output: a report in a folder its writer may not write."""

from __future__ import annotations

import os
import resource
import signal
import tempfile
from pathlib import Path

import pytest

from fastckpt.cli.outfile import write_output


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the write as another user (nobody)")
def test_a_report_in_a_folder_the_writer_may_not_write_is_refused_never_left_partial() -> None:
    """da9212f rewrote a writable report in place when no temp file could be made beside it: a
    write that failed midway (a full disk, a quota; here RLIMIT_FSIZE) left a part of the new
    report where the old one was. It is refused instead (report names the fix)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as top:  # pytest's folders are 0700: nobody could not reach it
        os.chmod(top, 0o755)  # root's folder: nobody cannot make a temp file in it ...
        _refused(Path(top))


def _refused(d: Path) -> None:
    f = d / "report.html"
    old = b"<html>yesterday's report</html>\n" * 300
    f.write_bytes(old)
    f.chmod(0o666)  # ... but may write the report itself
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        os.setgid(65534)
        os.setuid(65534)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))  # fails midway, as ENOSPC would
        try:
            write_output(str(f), b"N" * 40000)
            os.write(w, b"written")
        except PermissionError:
            os.write(w, b"refused")
        except OSError as exc:
            os.write(w, str(exc).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as pipe:
        assert pipe.read() == b"refused"
    assert f.read_bytes() == old and os.listdir(d) == ["report.html"]
