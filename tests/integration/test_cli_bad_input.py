"""Bad input to doctor, drill, latest, ls, verify and bench: exit 2 (1 for a path that does not
exist or holds no checkpoint) with a message that names the problem and the fix, never a
traceback. Real files and processes.

The file's commands run one after another in the child process the module shares
(``cli_child``, tests/cli_child.py), each through the CLI's ``main`` with its own stdout, stderr
and environment; a test that injects a fault (``prelude``) runs its commands in a child of its
own. A child per command spent most of this file's time starting Python and importing the CLI,
torch and s3fs again and again. An exception that escapes ``main`` is printed as its traceback,
as the ``fastckpt`` script would print it, so ``_refused`` still fails on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_child import CliChild
from tests.helpers import bind_mount

_BATCH = """
import contextlib, io, json, os, sys, traceback
calls = json.loads(sys.argv[1])
exec(calls["prelude"])
from fastckpt.cli import main
results = []
for argv, env in calls["runs"]:
    saved = dict(os.environ)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException:  # what the script would print: _refused fails on the traceback
            traceback.print_exc()
            code = 1
    os.environ.clear()
    os.environ.update(saved)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


class Cli:
    """``cli(*args)`` runs one command line; ``cli.all(*runs)`` runs each of ``runs`` (an argv or
    ``(argv, extra environment)``) in order, in ``cwd``: in the module's shared child, or, after
    running ``prelude`` (a fault it injects), in one child process of their own."""

    def __init__(self, child: CliChild) -> None:
        self._child = child

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        return self.all(list(args))[0]

    def all(self, *runs: list[str] | tuple[list[str], dict[str, str]], cwd: Path | None = None,
            prelude: str = "") -> list[subprocess.CompletedProcess]:
        calls = [r if isinstance(r, tuple) else (list(r), {}) for r in runs]
        if not prelude:
            return [self._child.run(*argv, env=env, cwd=cwd) for argv, env in calls]
        child = subprocess.run([sys.executable, "-c", _BATCH, json.dumps({"prelude": prelude, "runs": calls})],
                               capture_output=True, text=True, timeout=240, cwd=cwd)
        assert child.returncode == 0, child.stderr[-4000:]
        return [subprocess.CompletedProcess(argv, code, out, err) for (argv, _), (code, out, err)
                in zip(calls, json.loads(child.stdout.splitlines()[-1]), strict=True)]


@pytest.fixture
def cli(cli_child: CliChild) -> Cli:
    return Cli(cli_child)


def _refused(res: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert res.returncode == code, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


def test_doctor_storage_options_file_that_is_not_json(cli: Cli, tmp_path: Path) -> None:
    files = [tmp_path / "opts.txt", tmp_path / "opts.bin"]
    files[0].write_bytes(b"endpoint_url=http://x\n")
    files[1].write_bytes(b"\xff\xfe\x00")
    for f, res in zip(files, cli.all(*(["doctor", "--storage-options", str(f), "--probe-size", "0"] for f in files))):
        _refused(res, 2, f"{f} is not a JSON file", "endpoint_url")


def test_doctor_storage_options_file_that_cannot_be_read_is_not_called_not_json(cli: Cli, tmp_path: Path) -> None:
    """An unreadable file was "not a JSON file": the fix it gave (write JSON) was the wrong one. The
    permission error (another owner's mode 600, for a non-root user) is injected at ``open``."""
    f = tmp_path / "opts.json"
    f.write_text('{"endpoint_url": "http://127.0.0.1:1"}')
    prelude = ("import builtins, errno\n"
               "real = builtins.open\n"
               "def open_(p, *a, **k):\n"
               "    if str(p).endswith('opts.json'):\n"
               "        raise PermissionError(errno.EACCES, 'Permission denied', str(p))\n"
               "    return real(p, *a, **k)\n"
               "builtins.open = open_\n")
    (res,) = cli.all(["doctor", "--storage-options", str(f), "--probe-size", "0"], prelude=prelude)
    _refused(res, 2, f"{f} cannot be read (Permission denied)", "owner/mode")
    assert "not a JSON file" not in res.stderr


def test_storage_options_are_inline_json_or_a_file_in_every_command_and_never_echoed(cli: Cli, tmp_path: Path) -> None:
    """doctor took only a file, and echoed inline JSON, secret and all, in "File '...' does not
    exist"; ls, latest and verify took only inline JSON ("not JSON" for a file's path)."""
    secret = '{"key": "AKIA", "secret": "s3cr3t-value"'  # cut short: not JSON
    opts = tmp_path / "opts.json"
    opts.write_text('{"anon": true}')
    commands = (["doctor", "--probe-size", "0"], ["ls", str(tmp_path)], ["verify", str(tmp_path)])
    readable = [[*args, "--storage-options", given]  # a file's path is read as the inline JSON is
                for args in (["latest", str(tmp_path)], ["ls", str(tmp_path)])
                for given in (str(opts), '{"anon": true}')]
    results = iter(cli.all(*([*args, "--storage-options", given] for args in commands
                             for given in (secret, "s3cr3t-typo")), *readable))
    for _ in commands:
        res = next(results)
        _refused(res, 2, "--storage-options", "not JSON")
        assert "s3cr3t" not in res.stdout + res.stderr
        res = next(results)  # neither JSON nor a file
        _refused(res, 2, "the path of a JSON file")
        assert "s3cr3t" not in res.stdout + res.stderr
    for res in results:
        assert res.returncode == 1 and "--storage-options" not in res.stderr, res.stderr  # no usage error


def test_s3_storage_options_of_the_wrong_form_are_named_not_a_traceback(cli: Cli) -> None:
    """botocore built its client at the first request: a bad endpoint or an option of the wrong
    type was a ValueError, TypeError or AttributeError traceback from deep inside it."""
    cases = [(opts, words, cmd)
             for opts, words in (('{"endpoint_url": "notaurl"}', "endpoint_url is not a URL of the form"),
                                 ('{"endpoint_url": "http://[::1"}', "endpoint_url is not a URL"),
                                 ('{"endpoint_url": "http://127.0.0.1:99999"}', "endpoint_url is not a URL"),
                                 ('{"endpoint_url": ""}', "endpoint_url is not a URL"),
                                 ('{"client_kwargs": 5}', "client_kwargs must be a JSON object"),
                                 ('{"key": 5, "secret": "s3cr3t"}', "key must be a string"),
                                 ('{"config_kwargs": {"retries": 3}}', "config_kwargs.retries must be an object"))
             for cmd in ("ls", "latest", "verify")]
    results = cli.all(*([cmd, "s3://bucket/run", "--storage-options", opts] for opts, _, cmd in cases))
    for (_, words, _), res in zip(cases, results, strict=True):
        assert res.returncode in (1, 2) and "Traceback" not in res.stderr, res.stderr
        assert words in res.stderr and "s3cr3t" not in res.stderr, res.stderr


def test_doctor_local_dir_given_twice(cli: Cli, tmp_path: Path) -> None:
    """doctor measured both and approved them; the library refuses local_dir=[D, D]."""
    _refused(cli("doctor", "--local-dir", str(tmp_path), "--local-dir", f"{tmp_path}/", "--probe-size", "0"), 2,
            "given twice", "give each directory once")


def test_doctor_target_that_is_a_file(cli: Cli, tmp_path: Path) -> None:
    """It said "cannot write in FILE: File exists" with the fix "create FILE", which exists."""
    (tmp_path / "file").write_text("x")
    target, local, url = cli.all(["doctor", "--target", str(tmp_path / "file"), "--probe-size", "0"],
                                 ["doctor", "--local-dir", str(tmp_path / "file"), "--probe-size", "0"],
                                 ["doctor", "--target", f"file://{tmp_path / 'file'}", "--probe-size", "0"])
    _refused(target, 2, "--target", f"{tmp_path / 'file'} is a file: give the directory checkpoints are saved in")
    _refused(local, 2, "--local-dir", f"{tmp_path / 'file'} is a file: give the burst buffer's directory")
    _refused(url, 2,  # file:// is local
             "--target", f"{tmp_path / 'file'} is a file: give the directory checkpoints are saved in")


def test_doctor_path_below_a_file_names_the_file(cli: Cli, tmp_path: Path) -> None:
    """It said "cannot write in FILE/sub: Not a directory" with the fix "create FILE/sub", which no
    one can: FILE is a file."""
    blocker = tmp_path / "step-100.pt"
    blocker.write_text("x")
    target, local = cli.all(["doctor", "--target", str(blocker / "ckpt"), "--probe-size", "0"],
                            ["doctor", "--local-dir", str(blocker / "a" / "bb"), "--probe-size", "0"])
    _refused(target, 2, "--target", f"{blocker} is a file, so no directory can be made below it as {blocker}/ckpt: "
             "give the path of the directory checkpoints are saved in or a URL")
    _refused(local, 2, "--local-dir", f"{blocker} is a file, so no directory can be made below it as "
             f"{blocker}/a/bb: give the path of the burst buffer's directory")
    assert blocker.read_text() == "x"


def test_local_dir_that_is_a_url_or_a_url_typo(cli: Cli, tmp_path: Path) -> None:
    """doctor, drill, ls and serve-metrics took s3:/b/bb for the folder ./s3: and created it."""
    runs = [[*cmd, "--local-dir", d] for d in ("s3:/b/bb", "s3://b/bb")
            for cmd in (["doctor", "--probe-size", "0"], ["drill", "--dir", str(tmp_path / "home"), "--trials", "1"],
                        ["ls", str(tmp_path)],
                        ["serve-metrics", "--once", "--event-log", str(tmp_path / "events.jsonl")])]
    for argv, res in zip(runs, cli.all(*runs), strict=True):
        words = "looks like a URL without its '://'" if argv[-1] == "s3:/b/bb" else "must be a node-local directory"
        _refused(res, 2, "--local-dir", words)
    assert not (Path.cwd() / "s3:").exists()


def test_drill_local_dir_under_a_file(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _refused(cli("drill", "--dir", str(tmp_path / "home"), "--local-dir", str(tmp_path / "file" / "x"),
                 "--trials", "1"), 2, "--local-dir", "Not a directory", "give a directory path")


def test_drill_command_that_does_not_exist(cli: Cli, tmp_path: Path) -> None:
    cmds = ("fastckpt-no-such-program", str(tmp_path / "missing.sh"))
    for cmd, res in zip(cmds, cli.all(*(["drill", "--dir", str(tmp_path / "home"), "--trials", "1", "--", cmd]
                                        for cmd in cmds))):
        _refused(res, 2, f"not found or not executable: {cmd!r}")


def test_latest_of_a_path_that_does_not_exist(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    gone, empty = cli.all(["latest", str(missing)], ["latest", str(tmp_path)])
    _refused(gone, 1, f"{missing} does not exist")
    _refused(empty, 1, "no complete checkpoint")


def test_bench_launcher_variables_that_are_no_counts_are_named(cli: Cli, tmp_path: Path) -> None:
    """``bench`` read ``$WORLD_SIZE`` and ``$LOCAL_RANK`` with a bare ``int()``: a traceback."""
    bad = (("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("LOCAL_RANK", "-1"))
    results = cli.all(*((["bench", "--dir", str(tmp_path), "--size", "1MiB", "--block-size", "1MiB"], {name: value})
                        for name, value in bad))
    for (name, value), res in zip(bad, results, strict=True):
        _refused(res, 1, f"${name}={value!r} in the environment must be a whole number", "without a launcher")


def test_bench_the_same_dir_twice(cli: Cli, tmp_path: Path) -> None:
    _refused(cli("bench", "--dir", str(tmp_path), "--dir", f"{tmp_path}/", "--size", "1MiB", "--block-size", "1MiB"),
            2, "given twice", "give each directory once")


def test_bench_and_doctor_refuse_one_directory_bind_mounted_at_two_paths(cli: Cli, tmp_path: Path) -> None:
    """Before: bench took A and its bind mount B for two directories and failed on its own folder
    ("bench failed: [Errno 17] File exists", exit 1: a storage verdict); doctor measured it twice."""
    (tmp_path / "a").mkdir()
    with bind_mount(tmp_path / "a", tmp_path / "b"):
        a, b = str(tmp_path / "a"), str(tmp_path / "b")
        runs = cli.all(["bench", "--dir", a, "--dir", b, "--workers", "2", "--size", "1MiB", "--block-size", "1MiB"],
                       ["doctor", "--local-dir", a, "--local-dir", b, "--probe-size", "0"])
        leftovers = os.listdir(a)
    for res, option in zip(runs, ("--dir", "--local-dir"), strict=True):
        _refused(res, 2, option, f"{b} is given twice (as {a}); give each directory once")
    assert leftovers == []


def test_a_malformed_url_or_an_unknown_scheme_is_named(cli: Cli, tmp_path: Path) -> None:
    cases = (("http://[::1", ["ls"]), ("http://[::1", ["verify"]), ("foo://bar/x", ["latest"]),
             ("foo://bar/x", ["ls"]), ("http://[::1", ["drill", "--local-dir", str(tmp_path / "bb"), "--dir"]),
             ("foo://bar", ["doctor", "--probe-size", "0", "--target"]))
    for (url, _), res in zip(cases, cli.all(*([*args, url] for url, args in cases)), strict=True):
        _refused(res, 2, f"'{url}'", "s3://bucket/prefix")
    assert not (tmp_path / "bb").exists()
    from fastckpt.urls import check_url  # fsspec's chained URLs and upper-case schemes are no typos

    # an upper-case scheme is accepted in fsspec's lower case (fsspec knows "s3", not "S3")
    assert check_url("simplecache::s3://b/x") == "simplecache::s3://b/x" and check_url("S3://b/x") == "s3://b/x"


def test_a_url_typo_is_no_local_folder_for_doctor_latest_or_ls(cli: Cli, tmp_path: Path) -> None:
    """``doctor --target s3:/bucket`` created the local folder ./s3:/bucket and said "ok"."""
    cases = [(args, meant) for url, meant in (("s3:/bucket/run", "s3://bucket/run"), ("s3//bucket/run", "s3://bucket/run"))
             for args in (["doctor", "--probe-size", "0", "--target", url], ["latest", url], ["ls", url])]
    for (_, meant), res in zip(cases, cli.all(*(args for args, _ in cases), cwd=tmp_path), strict=True):
        _refused(res, 2, f"did you mean '{meant}'")
    assert not list(tmp_path.iterdir())


def test_a_url_without_a_bucket_is_named_and_never_read_as_a_local_folder(cli: Cli, tmp_path: Path) -> None:
    """``s3://`` (an empty variable after the scheme) was normalised to ``s3:``, a relative local
    path: ``ls`` and ``verify`` read the folder ./s3: in its stead (exit 0), ``drill`` wrote its
    checkpoints there, and ``doctor`` failed with a Python unpacking error."""
    (tmp_path / "s3:").mkdir()
    for res in cli.all(["ls", "s3://"], ["verify", "s3://"], ["latest", "http://"],
                       ["drill", "--trials", "1", "--local-dir", str(tmp_path / "bb"), "--dir", "s3://"],
                       ["doctor", "--probe-size", "0", "--target", "s3://"], cwd=tmp_path):
        _refused(res, 2, "names no bucket or host after", "://<bucket>[/<prefix>]")
    assert not list((tmp_path / "s3:").iterdir()) and not (tmp_path / "bb").exists()
    from fastckpt.urls import check_url, normalize

    assert normalize("s3://") == "s3://" and normalize("s3://b/x//") == "s3://b/x"
    assert check_url("memory://") == "memory://"  # fsspec's in-memory file system has no bucket


def test_an_empty_path_is_named_with_the_usage(cli: Cli, tmp_path: Path) -> None:
    """``latest ""`` (an unset shell variable) said " does not exist", naming nothing, and
    ``verify ""`` checked the current directory instead; ``verify file://`` (``file://$DIR``, unset)
    still did."""
    for res in cli.all(*([*args, empty, *after]
                         for args, after in ((["latest"], []), (["ls"], []), (["verify"], []),
                                             (["doctor", "--probe-size", "0", "--target"], []),
                                             (["drill", "--trials", "1", "--dir"], ["--", "fastckpt-no-such-program"]))
                         for empty in ("", "file://")), cwd=tmp_path):
        _refused(res, 2, "the path is empty: give a directory or a URL", "Usage: fastckpt")
    assert not list(tmp_path.iterdir())


def test_ls_and_verify_of_a_path_that_does_not_exist_or_is_not_a_checkpoint(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    ls_gone, verify_gone, verify_notes, ls_notes = cli.all(["ls", str(missing)], ["verify", str(missing)],
                                                           ["verify", str(notes)], ["ls", str(notes)])
    for res in (ls_gone, verify_gone):
        _refused(res, 1, f"{missing} does not exist")
    _refused(verify_notes, 1, f"{notes} is not a complete fastckpt checkpoint")
    _refused(ls_notes, 1, f"{notes} is a file", f"fastckpt verify {notes}")


def test_a_local_path_with_a_trailing_slash_is_the_path(cli: Cli, tmp_path: Path) -> None:
    """`fastckpt ls FILE/` (shell completion of a directory-looking name leaves the '/') said FILE/
    does not exist, and so did `latest FILE/`, while `verify FILE/` verified the file: each command
    now takes the path without the slash."""
    import torch

    import fastckpt

    f = tmp_path / "a.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.ones(3)}, str(f)).wait()
    ls_file, latest_file, verify_file, ls_dir = cli.all(["ls", f"{f}/"], ["latest", f"{f}/"], ["verify", f"{f}//"],
                                                        ["ls", f"{tmp_path}/"])
    _refused(ls_file, 1, f"{f} is a file: `fastckpt ls` lists the checkpoints under a directory")
    assert latest_file.returncode == 0 and latest_file.stdout.strip() == str(f), latest_file.stderr
    assert verify_file.returncode == 0, verify_file.stderr
    assert ls_dir.returncode == 0 and "a.pt" in ls_dir.stdout, ls_dir.stderr


def test_a_checkpoint_that_cannot_be_read_is_one_line_naming_it_not_a_traceback(cli: Cli, tmp_path: Path) -> None:
    """``ls``, ``latest`` and ``verify`` printed a 60-line traceback for a checkpoint they cannot
    read: the ``OSError`` (with its note naming the path and the fix) escaped ``main``. The
    permission error (what another owner's mode 600 gives a non-root user) is injected at
    ``os.open`` in the CLI's process."""
    import torch

    import fastckpt

    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.ones(3)}, str(tmp_path / "a.pt")).wait()
        ck.save({"w": torch.ones(3)}, str(tmp_path / "private.pt")).wait()
    prelude = ("import errno, os\n"
               "real = os.open\n"
               "def open_(p, *a, **k):\n"
               "    if os.fspath(p).endswith('private.pt'):\n"
               "        raise PermissionError(errno.EACCES, 'Permission denied', os.fspath(p))\n"
               "    return real(p, *a, **k)\n"
               "os.open = open_\n")
    for res in cli.all(*([*args, str(tmp_path)] for args in (["ls"], ["latest"], ["verify"], ["verify", "--latest"])),
                       prelude=prelude):
        _refused(res, 1, "fastckpt: PermissionError: [Errno 13] Permission denied",
                 f"{tmp_path / 'private.pt'} cannot be read", "owner/mode")


# os.scandir raises EACCES for the folders named in $HIDDEN (comma-separated), as it would for
# another owner's mode 700, for a non-root user; each command line names its own.
_UNLISTABLE = ("import errno, os\n"
               "real = os.scandir\n"
               "def scandir(p='.'):\n"
               "    if os.path.basename(os.fspath(p)) in os.environ['HIDDEN'].split(','):\n"
               "        raise PermissionError(errno.EACCES, 'Permission denied', os.fspath(p))\n"
               "    return real(p)\n"
               "os.scandir = scandir\n")


def test_a_step_folder_that_cannot_be_listed_is_named_by_ls_latest_and_verify(cli: Cli, tmp_path: Path) -> None:
    """``ls``, ``latest`` and ``verify --latest`` passed over a group folder they could not list
    and named (and verified) the older one: a resume went back in time. The folder named like a
    checkpoint (``step-2``) is raised; a root-owned ``.Trash-0`` and another user's ``bob-run``
    are still passed over. EACCES (another owner's mode 700, for a non-root user) is injected
    at ``os.scandir`` in the CLI's process."""
    import torch

    import fastckpt

    with fastckpt.Checkpointer() as ck:
        for step in (1, 2):
            g = str(tmp_path / f"step-{step}")
            ck.save({"w": torch.ones(3)}, f"{g}/m.pt", group=g)
            ck.commit(g, step=step).wait(60)
    (tmp_path / "latest").unlink()  # the scan, not the pointer, finds the newest
    (tmp_path / ".Trash-0").mkdir()
    (tmp_path / "bob-run").mkdir()

    commands = (["ls"], ["latest"], ["verify", "--latest"])
    results = iter(cli.all(*(([*args, str(tmp_path)], {"HIDDEN": hidden}) for args in commands
                             for hidden in (".Trash-0,bob-run,step-2", ".Trash-0,bob-run")), prelude=_UNLISTABLE))
    for _ in commands:
        _refused(next(results), 1, "fastckpt: PermissionError: [Errno 13]",
                 f"{tmp_path / 'step-2'} cannot be listed, and it may hold the newest checkpoint", "owner/mode")
        res = next(results)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "step-2" in res.stdout  # the newest, found
