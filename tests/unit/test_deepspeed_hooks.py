"""The engine wrappers (``_deepspeed.hooks``): which tag ``engine.load_checkpoint(save_dir)``
loads without a tag (``resolve_tag``, on directories laid out as the group commit leaves them),
and how long a flush waits."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

import fastckpt  # noqa: E402
from fastckpt.commit.protocol import GROUP_MANIFEST, MARKER_DIR  # noqa: E402
from fastckpt.integrations._deepspeed.compat import Store  # noqa: E402
from fastckpt.integrations._deepspeed.hooks import StepFence  # noqa: E402
from fastckpt.integrations.deepspeed import resolve_tag  # noqa: E402
from tests.helpers import StubEngine  # noqa: E402


def _group(root: Path, tag: str, order: float, **extra: object) -> None:
    (root / tag / MARKER_DIR).mkdir(parents=True)
    (root / tag / MARKER_DIR / "rank-00000.json").write_text("{}")
    manifest = {"kind": "group", "files": {}, "requested_at": order, "committed_at": order, **extra}
    (root / tag / GROUP_MANIFEST).write_text(json.dumps(manifest))


def _attempt(root: Path, tag: str) -> None:
    (root / tag / MARKER_DIR).mkdir(parents=True)
    (root / tag / MARKER_DIR / "rank-00001.json").write_text("{}")


def _resolve(root: Path) -> tuple[str | None, bool]:
    return resolve_tag(Store(None), os.path.abspath(root), None)


def test_latest_names_a_complete_tag(tmp_path: Path) -> None:
    _group(tmp_path, "global_step1", 1.0)
    _group(tmp_path, "global_step2", 2.0)
    (tmp_path / "latest").write_text("global_step2")
    assert _resolve(tmp_path) == ("global_step2", False)


def test_no_latest_file_means_the_newest_complete_tag(tmp_path: Path) -> None:
    assert _resolve(tmp_path) == (None, False)
    _group(tmp_path, "global_step1", 1.0)
    _attempt(tmp_path, "global_step2")
    assert _resolve(tmp_path) == ("global_step1", True)


def test_latest_lagging_behind_a_committed_tag_moves_forward(tmp_path: Path) -> None:
    """A crash between a manifest's publication and the pointer's move."""
    _group(tmp_path, "global_step1", 1.0)
    _group(tmp_path, "global_step2", 2.0)
    (tmp_path / "latest").write_text("global_step1")
    assert _resolve(tmp_path) == ("global_step2", True)


def test_latest_naming_an_attempt_under_way_falls_back(tmp_path: Path) -> None:
    _group(tmp_path, "global_step1", 1.0)
    _attempt(tmp_path, "global_step2")  # a re-save of the tag latest names: its manifest is gone
    (tmp_path / "latest").write_text("global_step2")
    assert _resolve(tmp_path) == ("global_step1", True)


def test_a_tag_saved_without_save_latest_does_not_win(tmp_path: Path) -> None:
    _group(tmp_path, "global_step1", 1.0)
    _group(tmp_path, "best", 2.0, save_latest=False)
    (tmp_path / "latest").write_text("global_step1")
    assert _resolve(tmp_path) == ("global_step1", False)


def test_without_latest_a_tag_saved_without_save_latest_is_never_loaded(tmp_path: Path) -> None:
    """As DeepSpeed's own engine: no ``latest`` file, nothing to load (it warns, returns None)."""
    _group(tmp_path, "export", 1.0, save_latest=False)
    assert _resolve(tmp_path) == (None, False)
    _group(tmp_path, "global_step1", 2.0)  # its commit died before writing latest
    _group(tmp_path, "export2", 3.0, save_latest=False)
    assert _resolve(tmp_path) == ("global_step1", True)


def test_a_lagging_latest_moves_past_newer_tags_saved_without_save_latest(tmp_path: Path) -> None:
    _group(tmp_path, "global_step1", 1.0)
    _group(tmp_path, "global_step2", 2.0)  # its commit died before moving latest
    _group(tmp_path, "best", 3.0, save_latest=False)
    (tmp_path / "latest").write_text("global_step1")
    assert _resolve(tmp_path) == ("global_step2", True)


def test_deepspeeds_own_tags_are_trusted(tmp_path: Path) -> None:
    """A tag written by DeepSpeed's default engine has neither manifest nor markers."""
    _group(tmp_path, "global_step1", 1.0)
    (tmp_path / "global_step2").mkdir()
    (tmp_path / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"not read here")
    (tmp_path / "latest").write_text("global_step2")
    assert _resolve(tmp_path) == ("global_step2", False)


def test_flush_gives_up_after_close_timeout_s(tmp_path: Path) -> None:
    """Rank 1 never commits: destroy() and exit stop waiting after close_timeout_s."""
    import torch
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from fastckpt import Checkpointer, ReplicationError
    from fastckpt.integrations._deepspeed.engine import FastCkptEngine
    from fastckpt.integrations._deepspeed.hooks import EngineHooks

    ck = Checkpointer(rank=0, world_size=2, close_timeout_s=0.5, commit_timeout_s=60)
    fe = FastCkptEngine(ck)
    hooks = EngineHooks(StubEngine(), fe, None, flush_at_exit=False)
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    fe.begin(None, True, 0)
    fe.create(info)
    fe.save(state_dict={"w": torch.ones(4)}, path=str(tmp_path / "t1" / "mp_rank_00_model_states.pt"))
    fe.commit(info)
    fe.end()
    with pytest.raises(ReplicationError, match="still not committed after close_timeout_s=0.5"):
        hooks.flush()
    assert len(fe.pending) == 1  # still reported later, if it ever completes
    with pytest.raises(ReplicationError):
        ck.close()


def test_destroy_closes_the_owned_checkpointer_even_when_a_pending_save_failed(tmp_path: Path) -> None:
    """close() stopped at the flush's raise: the Checkpointer the integration made stayed open
    (its threads, a metrics port), and exit tried to flush it again."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from fastckpt import ReplicationError
    from fastckpt.integrations._deepspeed.engine import FastCkptEngine
    from fastckpt.integrations._deepspeed.hooks import EngineHooks, OwnedCheckpointer

    owned = OwnedCheckpointer({"rank": 0, "world_size": 2, "close_timeout_s": 0.5, "commit_timeout_s": 60})
    fe = FastCkptEngine(owned)
    hooks = EngineHooks(StubEngine(), fe, owned, flush_at_exit=False)
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    fe.begin(None, True, 0)
    fe.create(info)
    fe.save(state_dict={"w": torch.ones(4)}, path=str(tmp_path / "t1" / "mp_rank_00_model_states.pt"))
    fe.commit(info)  # rank 1 never commits
    fe.end()
    ck = owned()
    with pytest.raises(ReplicationError, match="close_timeout_s=0.5"):
        hooks.destroy()
    assert hooks.closed and owned._ck is None and ck._closed  # noqa: SLF001  (before: left open)


# --------------------------------------------------------------------------- the lazy snapshot's fence
def test_the_step_fence_runs_before_the_step_and_comes_off_again() -> None:
    """``StepFence`` is set on the optimizer instance as a bound method: the fence runs before
    every step, a torch LR scheduler built afterwards still wraps it (it takes ``step.__func__``),
    and ``remove`` puts the optimizer's own step back."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    order: list[str] = []
    fence = StepFence(opt, lambda: order.append("fence") or 0.0)
    fence.install()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance
    w.grad = torch.ones(2)
    opt.register_step_pre_hook(lambda *_: order.append("step"))
    opt.step()
    sched.step()
    assert order == ["fence", "step"] and torch.equal(w.detach(), torch.zeros(2))
    fence.remove()  # the scheduler's wrapper sits on top: it stays, the fence goes quiet
    opt.step()
    assert order == ["fence", "step", "step"]

    bare = torch.optim.SGD([w], lr=1.0)
    fence = StepFence(bare, lambda: order.append("fence") or 0.0)
    fence.install()
    assert "step" in bare.__dict__
    fence.remove()
    assert "step" not in bare.__dict__  # the class's step again


@pytest.mark.parametrize("fails", ["the fence's tensors", "the clone of the 2nd file"])
def test_a_file_whose_copy_raised_before_its_save_is_never_published_without(tmp_path: Path, monkeypatch,
                                                                             fails: str) -> None:
    """A lazy snapshot clones what the optimizer step does not change before it calls save; a
    clone that raised (CUDA out of memory) left the file unsaved but unrecorded, and the commit
    that ends the attempt published the tag without it, with latest moved to it."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    import fastckpt
    from fastckpt.integrations._deepspeed import engine as E

    real, calls = E.copy_unfenced, []

    def copy(state: dict, protected: list) -> dict:
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(state, protected)

    def fenced() -> list:
        if fails == "the fence's tensors":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return []

    monkeypatch.setattr(E, "copy_unfenced", copy)
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        fe = E.FastCkptEngine(ck, fenced=fenced)
        fe.begin(None, True, 0)
        info = CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path), save_latest=True)
        fe.create(info)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            fe.save({"w": torch.ones(4)}, str(tmp_path / "global_step1" / name))
        with pytest.raises(torch.OutOfMemoryError):
            fe.commit(info)
        ck.wait()
    assert fastckpt.latest(str(tmp_path)) is None
    assert not (tmp_path / "global_step1" / GROUP_MANIFEST).exists()


# --------------------------------------------------------------------------- found by the DeepSpeed review
def test_a_commit_made_after_deepspeeds_own_latest_was_written_wins(tmp_path: Path) -> None:
    """A run that switched to fastckpt: `latest` names DeepSpeed's own global_step1; the first
    fastckpt commit (global_step2) was killed between its manifest and the pointer's move. The
    resume loaded step 1. `latest`'s modification time tells the two cases apart."""
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"DeepSpeed's own")
    (tmp_path / "latest").write_text("global_step1")
    os.utime(tmp_path / "latest", (1000.0, 1000.0))
    _group(tmp_path, "global_step2", 2000.0)
    assert _resolve(tmp_path) == ("global_step2", True)  # before: ("global_step1", False)
    os.utime(tmp_path / "latest", (3000.0, 3000.0))  # written after that commit: a user's choice
    assert _resolve(tmp_path) == ("global_step1", False)


def test_a_load_moves_latest_only_forward_and_loads_where_it_may_not_write(tmp_path: Path, caplog) -> None:
    """An evaluation job resolved global_step2 (latest lagged at step 1) while training committed
    global_step3 and moved latest there: the load's move set it back to step 2. On a read-only
    mount the move raised a ReplicationError and the load never happened."""
    from fastckpt import Checkpointer
    from fastckpt.integrations._deepspeed.engine import FastCkptEngine
    from fastckpt.integrations._deepspeed.hooks import EngineHooks
    from tests.helpers import tmpfs

    for i in (1, 2, 3):
        _group(tmp_path, f"global_step{i}", float(i))
    (tmp_path / "latest").write_text("global_step3")
    assert Store(None).set_pointer(str(tmp_path), "global_step2", 2.0) is False  # before: it moved back
    assert (tmp_path / "latest").read_text() == "global_step3"
    with tmpfs(tmp_path / "ro", "size=1m") as mnt:
        for i in (1, 2):
            _group(mnt, f"global_step{i}", float(i))
        (mnt / "latest").write_text("global_step1")
        import subprocess

        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with Checkpointer() as ck, caplog.at_level("WARNING", logger="fastckpt"):
            hooks = EngineHooks(StubEngine(), FastCkptEngine(ck), None, flush_at_exit=False)
            assert hooks._resolve(str(mnt)) == "global_step2"  # noqa: SLF001  (before: ReplicationError)
        assert any("could not move" in r.getMessage() for r in caplog.records)
        assert (mnt / "latest").read_text() == "global_step1"


def test_a_save_checkpoint_that_raised_before_its_commit_leaves_the_next_tag_clean(tmp_path: Path) -> None:
    """DeepSpeed raised between its saves and the commit (a full disk copying zero_to_fp32.py):
    the tag's deferred files stayed, and the next tag's save failed with "... is not inside its
    group directory"."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    import fastckpt
    from fastckpt.integrations._deepspeed.engine import FastCkptEngine

    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        fe = FastCkptEngine(ck)
        for tag, commits in (("global_step2", False), ("global_step3", True)):
            info = CheckpointCommitInfo(tag=tag, save_dir=str(tmp_path), save_latest=True)
            fe.begin(None, True, 0)
            fe.create(info)
            fe.save({"w": torch.ones(4)}, str(tmp_path / tag / "mp_rank_00_model_states.pt"))
            if commits:
                assert fe.commit(info)
            fe.end()  # (save_checkpoint's finally)
        ck.wait()
    m = json.loads((tmp_path / "global_step3" / GROUP_MANIFEST).read_text())
    assert sorted(m["files"]) == ["mp_rank_00_model_states.pt"]
    assert not (tmp_path / "global_step2").exists() or not (tmp_path / "global_step2" / GROUP_MANIFEST).exists()


@pytest.mark.parametrize("tag", ["latest", "latest_universal"])
def test_a_tag_named_as_the_pointer_beside_the_tags_is_refused(tag: str) -> None:
    """A tag 'latest' saved right after another tag made that tag's commit fail ("Is a
    directory", when it moved the pointer); refused up front, naming it."""
    from fastckpt.errors import ConfigError
    from fastckpt.integrations._deepspeed.compat import checked_tag

    with pytest.raises(ConfigError, match=f"tag '{tag}' is the name of a file beside the tags"):
        checked_tag("/ckpt", tag)
    assert checked_tag("/ckpt", "latest_step") == "latest_step"


@pytest.mark.parametrize("tag, safe", [("epoch1/step1", "epoch1_step1"), ("epoch1\\step1", "epoch1_step1"),
                                       ("a\x00b", "a_b")])
def test_a_tag_that_is_not_one_directory_name_is_refused_naming_a_safe_one(tag: str, safe: str) -> None:
    """A backslash reached the storage layer and was refused there as 'key ... must be relative
    to the target root', which named no tag and no fix."""
    from fastckpt.errors import ConfigError
    from fastckpt.integrations._deepspeed.compat import checked_tag

    with pytest.raises(ConfigError, match=f"tag {re.escape(repr(tag))} is not one directory name.*{safe!r}"):
        checked_tag("/ckpt", tag)


@pytest.mark.parametrize("tag, words, safe", [
    ("step1 ", "whitespace", "step1"), (" step1", "whitespace", "step1"), ("step1\n", "whitespace", "step1"),
    (".step1", "starts with '.'", "step1"), ("..x", "starts with '.'", "x"), ("  ", "whitespace", "global_step1")])
def test_a_tag_that_would_commit_but_never_load_as_the_newest_is_refused(tag: str, words: str, safe: str) -> None:
    """'step1 ' committed and latest held it, but DeepSpeed and resolve_tag read latest stripped:
    every resume raised CheckpointNotFoundError. '.step1' committed, but fastckpt.latest skipped
    it (a hidden name) while latest named it."""
    from fastckpt.errors import ConfigError
    from fastckpt.integrations._deepspeed.compat import checked_tag

    with pytest.raises(ConfigError, match=f"tag {re.escape(repr(tag))} .*{words}.*Use a tag without .*{safe!r}"):
        checked_tag("/ckpt", tag)
    assert checked_tag("/ckpt", "step 1.5") == "step 1.5"  # inside a name: kept


def test_deepspeeds_own_assert_on_its_own_tag_is_kept(tmp_path: Path) -> None:
    """A tag written by DeepSpeed itself (its files there, no fastckpt manifest) whose load
    DeepSpeed refuses with an assert keeps DeepSpeed's message; only a tag holding nothing but
    what a killed fastckpt save leaves (temp files) is IncompleteCheckpointError."""
    import types

    import fastckpt
    from fastckpt.errors import IncompleteCheckpointError
    from fastckpt.integrations._deepspeed.hooks import EngineHooks
    from fastckpt.io.atomic import tmp_name

    native, killed = tmp_path / "native", tmp_path / "killed"
    native.mkdir(), killed.mkdir()
    torch.save({"module": {}}, native / "mp_rank_00_model_states.pt")
    (Path(tmp_name(str(killed / "mp_rank_00_model_states.pt")))).write_bytes(b"PK")
    with fastckpt.Checkpointer() as ck:
        hooks = EngineHooks.__new__(EngineHooks)
        hooks.fe = types.SimpleNamespace(checkpointer=ck, begin=lambda *a: None, end=lambda: None, last_read=None)
        hooks.engine = types.SimpleNamespace(global_samples=0, global_rank=0, has_moe_layers=False,
                                             zero_optimization_partition_weights=lambda: False)

        def refuse(where: str, tag: object = None, **kw: object) -> None:
            raise AssertionError("checkpoint zero stage 2 does not match engine's zero stage 3")

        hooks._load = refuse
        with pytest.raises(AssertionError, match="zero stage 2 does not match"):
            hooks._load_once(str(tmp_path), str(tmp_path), "native", {})
        with pytest.raises(IncompleteCheckpointError, match="killed cannot be loaded: it holds no complete save"):
            hooks._load_once(str(tmp_path), str(tmp_path), "killed", {})


def test_deepspeed_globs_the_directory_and_tag_as_written(tmp_path: Path) -> None:
    """DeepSpeed's own globs (run here over real files, no process group): a tag '[1]' matched
    tag '1''s files and loaded them, 'a*' matched several tags', and a save_dir 'exp[lr=0.1]'
    matched nothing, a bare AssertionError at every load."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    from fastckpt.integrations._deepspeed.globs import literal_globs

    class Module:  # a PipelineModule's layer lookup
        _local_start = 0
        ckpt_layer_path_list = PipelineModule.ckpt_layer_path_list

    class Engine:  # DeepSpeedEngine's lookup of a tag's model files
        _get_all_ckpt_names = DeepSpeedEngine._get_all_ckpt_names
        _get_ckpt_name = DeepSpeedEngine._get_ckpt_name

        def __init__(self) -> None:
            self.module = Module()

        def zero_optimization_partition_weights(self) -> bool:
            return False

        def load_universal_checkpoint(self) -> bool:
            return False

    root = tmp_path / "exp[lr=0.1]"
    for tag in ("1", "[1]", "ab", "a*"):
        (root / tag).mkdir(parents=True)
        (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
        (root / tag / "layer_00-model_states.pt").write_bytes(b"")
    engine = Engine()
    assert engine._get_all_ckpt_names(str(root), "[1]") == []  # noqa: SLF001  (DeepSpeed's own: nothing)
    undo = literal_globs(engine)
    for tag in ("1", "[1]", "a*"):
        assert engine._get_all_ckpt_names(str(root), tag) == [str(root / tag / "mp_rank_00_model_states.pt")]  # noqa: SLF001
        assert engine.module.ckpt_layer_path_list(str(root / tag), 0) == [str(root / tag / "layer_00-model_states.pt")]
    undo()
    assert "_get_all_ckpt_names" not in vars(engine) and "ckpt_layer_path_list" not in vars(engine.module)


def test_load_checkpoint_passes_over_folders_it_cannot_list_unless_named_like_a_tag(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """``load_checkpoint(save_dir)`` scans: a root-owned ``.Trash-0`` or another user's folder it
    cannot list is passed over, as is one below save_dir's children (a colleague's
    ``tensorboard/version_0``: a tag is a direct child of save_dir, whatever its name,
    ``d3_deepspeed_load_raises_for_unlisted_log_subfolder``); a tag folder it cannot list may hold
    the newest tag and is raised (EACCES injected at ``os.scandir``, what mode 700 of another owner
    gives a non-root user)."""
    import errno

    _group(tmp_path, "global_step1", 1.0)
    _group(tmp_path, "global_step2", 2.0)
    for d in (".Trash-0", "bob-run", "global_step3", "tensorboard/version_0"):
        (tmp_path / d).mkdir(parents=True)
    refused = {str(tmp_path / d) for d in (".Trash-0", "bob-run", "tensorboard/version_0")}
    real = os.scandir

    def scandir(d: str = "."):  # noqa: ANN202 (os.scandir's iterator)
        if os.fspath(d) in refused:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(d))
        return real(d)

    monkeypatch.setattr(os, "scandir", scandir)
    assert _resolve(tmp_path) == ("global_step2", True)
    refused.add(str(tmp_path / "global_step3"))
    with pytest.raises(PermissionError) as err:
        _resolve(tmp_path)
    assert f"{tmp_path / 'global_step3'} cannot be listed" in "\n".join(err.value.__notes__)


def test_a_latest_that_is_a_directory_is_named_not_a_raw_is_a_directory_error(tmp_path: Path) -> None:
    """``load_checkpoint(save_dir)`` reads ``save_dir/latest``: a directory there raised a bare
    ``IsADirectoryError`` ("name the file inside it", the wrong fix)."""
    from fastckpt.errors import ConfigError

    _group(tmp_path, "global_step1", 1.0)
    (tmp_path / "latest").mkdir()
    with pytest.raises(ConfigError) as err:
        _resolve(tmp_path)
    assert f"{tmp_path}/latest is a directory" in str(err.value) and f"mv {tmp_path}/latest" in str(err.value)
    assert isinstance(err.value.__cause__, IsADirectoryError)


@pytest.mark.parametrize("how", ["load_optimizer_states=False", "load_module_only=True"])
def test_a_weights_only_load_of_a_tag_with_glob_characters_names_the_argument_the_user_passed(how: str) -> None:
    """Under ZeRO-3 load_module_only=True now loads through the consolidation, as
    load_optimizer_states=False does; a tag holding glob characters was then refused as
    "load_checkpoint(..., load_optimizer_states=False)", an argument the caller never passed, with
    "Load with load_optimizer_states=True" as the fix, the default already in effect."""
    from fastckpt.integrations._deepspeed import fp32

    with pytest.raises(fastckpt.ConfigError) as ei:
        fp32.verify("/ckpt", "run[1]", lambda path: None, how)
    assert f"load_checkpoint('/ckpt', tag='run[1]', {how}) under ZeRO-3 loads the weights only" in str(ei.value)
    assert "Copy or rename the tag (and its save_dir) to names without them, or load the whole state " \
        "(load_optimizer_states=True, load_module_only=False)" in str(ei.value)
