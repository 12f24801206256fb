"""Switching a run to fastckpt: the checkpoints the other checkpointer wrote are found by
``fastckpt.latest`` and resumed from (docs/migration.md), with the real writers: Lightning's
TorchCheckpointIO and AsyncCheckpointIO, DeepSpeed's own engine, and a fastckpt file copied into
a bucket without its sidecar (``aws s3 cp``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli.ls import ls
from fastckpt.commit import discovery
from fastckpt.storage.homes import Homes
from tests.helpers import scan
from tests.s3server import free_ports

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.parametrize("io_name", ["TorchCheckpointIO", "AsyncCheckpointIO"])
def test_lightning_run_switches_to_fastckpt_and_resumes(tmp_path: Path, io_name: str) -> None:
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO

    run = tmp_path / "run"

    def trainer(max_steps: int, plugin: object) -> L.Trainer:
        return L.Trainer(max_steps=max_steps, plugins=[plugin], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[ModelCheckpoint(dirpath=str(run), every_n_train_steps=20, save_last=True)])

    old = trainer(40, TorchCheckpointIO() if io_name == "TorchCheckpointIO" else AsyncCheckpointIO())
    old.fit(BoringModel())
    before = fastckpt.latest(str(run))
    assert before is not None and fastckpt.load(before, weights_only=False)["global_step"] == 40
    assert {f.foreign for f in scan(run)} == {"torch.save"}

    new = trainer(60, fastckpt.FastCkptIO())
    new.fit(BoringModel(), ckpt_path=before)  # the switched run resumes from what it had
    assert new.ckpt_path == before and new.global_step == 60
    after = fastckpt.latest(str(run))
    assert fastckpt.load(after, weights_only=False)["global_step"] == 60
    assert [f.foreign for f in scan(run)][-1] is None  # fastckpt's own, verified, is the newest now


def test_lightning_checkpoints_are_ordered_by_the_step_they_record_not_their_dates(tmp_path: Path) -> None:
    """Checkpoints Lightning wrote (its state_dict an OrderedDict), copied so that their
    modification times no longer follow their steps (rsync without -t, a restore from a backup):
    ``latest`` reads each one's global_step without running its pickle, and names the newest step."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    run = tmp_path / "run"
    L.Trainer(max_steps=20, logger=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=str(tmp_path),
              callbacks=[ModelCheckpoint(dirpath=str(run), every_n_train_steps=10, save_top_k=-1)]).fit(BoringModel())
    names = sorted(p.name for p in run.iterdir())
    assert names == ["epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"]
    os.utime(run / names[1], (1_000_000_100, 1_000_000_100))  # the newer step copied first
    os.utime(run / names[0], (1_000_000_200, 1_000_000_200))
    assert [f.step for f in scan(run)] == [10, 20]
    assert fastckpt.latest(str(run)) == str(run / "epoch=0-step=20.ckpt")


DEEPSPEED_RUN = """
import os, sys, torch
import deepspeed
import fastckpt
{import_line}
model = torch.nn.Linear(16, 4)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 0}})
ck = None
if sys.argv[2] == "switched":  # the same script after the switch: one line more, and it resumes
    ck = fastckpt.Checkpointer()
    {new_line}
    path, client = engine.load_checkpoint(sys.argv[1])   # DeepSpeed's latest names the tag to resume from
    print("RESUMED", os.path.basename(os.path.dirname(path)), engine.global_steps)
    print("WEIGHTS_ONLY", engine.checkpoint_engine.weights_only)
for _ in range(3 if ck is None else 1):
    engine.backward(engine(torch.randn(2, 16)).square().mean())
    engine.step()
    engine.save_checkpoint(sys.argv[1])   # before: DeepSpeed's own engine (torch.save); after: fastckpt's
if ck is not None:
    ck.close()
"""


def _migration_lines() -> dict[str, str]:
    """The import and "the one new line" of migration.md's DeepSpeed recipe, which the switched
    run below runs (the page once used ``install``, Lightning's entry point: weights_only=False)."""
    page = (REPO / "docs" / "migration.md").read_text()
    block = page[page.index("## From DeepSpeed's own checkpoint engine"):]
    lines = block[block.index("```python"):].split("```")[1].splitlines()
    (imp,) = [ln for ln in lines if ln.startswith("from fastckpt.integrations.deepspeed import")]
    (new,) = [ln.split("#")[0].strip() for ln in lines if ln.endswith("# the one new line")]
    return {"import_line": imp, "new_line": new}


def test_deepspeed_engine_checkpoints_are_found_as_one_tag(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    script = DEEPSPEED_RUN
    for name, line in _migration_lines().items():
        script = script.replace("{" + name + "}", line)
    save_dir = tmp_path / "ds"
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions")))
    done = subprocess.run([sys.executable, "-c", script, str(save_dir), "before"], env=env,
                          capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert (save_dir / "latest").read_text().strip() == "global_step3"
    assert fastckpt.latest(str(save_dir)) == str(save_dir / "global_step3")
    found = scan(save_dir)  # one checkpoint: the tag DeepSpeed's latest names, not its per-rank files
    rows = [(Path(f.path).name, f.kind, f.foreign, f.step) for f in found]
    assert rows == [("global_step3", "group", "DeepSpeed", 3)]
    out = CliRunner().invoke(ls, [str(save_dir), "--json"])
    (row,) = json.loads(out.output)["checkpoints"]
    assert (row["kind"], row["status"], row["step"], row["latest"]) == ("DeepSpeed", "unverified", 3, True)
    # the run goes on with fastckpt's DeepSpeed engine: it resumes from DeepSpeed's tag, and its group takes over
    done = subprocess.run([sys.executable, "-c", script, str(save_dir), "switched"], env=env,
                          capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "RESUMED global_step3 3" in done.stdout
    assert "WEIGHTS_ONLY True" in done.stdout  # the old run's files are unpickled safely (deepspeed.md#safe-loading)
    assert fastckpt.latest(str(save_dir)) == str(save_dir / "global_step4")
    assert [(Path(f.path).name, f.foreign) for f in scan(save_dir)][-1] == ("global_step4", None)


def test_copied_into_a_bucket_without_the_sidecar(s3_server, s3_bucket: str, tmp_path: Path) -> None:
    opts = s3_server.storage_options()
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.arange(1000), "step": 9}, str(tmp_path / "step-9.pt"))
    torch.save({"w": torch.arange(10), "global_step": 5}, tmp_path / "old-5.pt")  # written before the switch
    client = s3_server.client()
    for name in ("old-5.pt", "step-9.pt"):  # aws s3 cp: the bytes, no fastckpt sidecar
        client.put_object(Bucket=s3_bucket, Key=f"run/{name}", Body=(tmp_path / name).read_bytes())
    url = fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=opts)
    assert url == f"s3://{s3_bucket}/run/step-9.pt"
    found = discovery.scan(Homes(opts).resolve(f"s3://{s3_bucket}/run"))
    assert [(f.foreign, f.step) for f in found] == [("torch.save", 5), (None, 9)]
    assert torch.equal(fastckpt.load(url, storage_options=opts)["w"], torch.arange(1000))  # verified
    body = bytearray((tmp_path / "step-9.pt").read_bytes())
    body[4096] ^= 0xFF  # damaged in the copy
    client.put_object(Bucket=s3_bucket, Key="run/step-9.pt", Body=bytes(body))
    with pytest.raises(fastckpt.CorruptCheckpointError):
        fastckpt.load(url, storage_options=opts)


def test_migration_page_names_each_source() -> None:
    page = (REPO / "docs" / "migration.md").read_text()
    for source in ("TorchCheckpointIO", "AsyncCheckpointIO", "async_save", "DeepSpeed"):
        assert source in page
    assert "migration.md" in (REPO / "mkdocs.yml").read_text()
