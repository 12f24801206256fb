"""Reading checkpoints written without fastckpt through a ``Target``, for ``discovery``: a
complete ``torch.save`` zip (``format.foreign`` says how it is recognised) and a DeepSpeed tag
directory named by DeepSpeed's own ``latest`` file. A few small ranged reads each: the file's
tail, its zip directory, and its pickle when the step is wanted.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import posixpath
import re
from typing import Literal

from ..errors import ConfigError, CorruptCheckpointError
from ..format import foreign
from ..format.manifest import TAIL_BYTES
from ..storage.base import Target
from ..urls import nameable

#: DeepSpeed's per-rank files: never checkpoints on their own, only as part of their tag.
# DeepSpeed's per-rank file names (runtime/engine.py, runtime/pipe/module.py): mp_rank_00_model_states.pt,
# (bf16_)zero_pp_rank_0_mp_rank_00_optim_states.pt (and its old ..._mp_rank_00optim_states.pt),
# expp_rank_0_..., layer_3_expert_0_mp_rank_00_model_states.pt, a pipeline's layer_01-model_00-model_states.pt;
# not any name ending in model_states.pt (a user's step-200-model_states.pt is a checkpoint of its own)
DEEPSPEED_FILE = re.compile(r"(.*mp_rank_\d+_?(model|optim)_states|layer_\d+(-[^/]*)?-model_states)\.pt$")
MAX_DIRECTORY_BYTES = 64 << 20
MAX_POINTER_BYTES = 4096
MEGATRON_CONFIG = "metadata.json"  # megatron-core's dist_checkpointing config, rewritten by each save
DCP = "torch.distributed.checkpoint"  # what wrote a directory holding discovery.DCP_METADATA
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt")  # torch.save's and Lightning's: an empty one is a checkpoint emptied


def dcp_how_to_load(path: str) -> str:
    """How to load the DCP directory ``path``: fastckpt.load() reads torch.save files only, and
    latest() names such a directory (Lightning's FSDP sharded checkpoints resume through Lightning)."""
    return (f"fastckpt.load() reads torch.save files only: load it with torch.distributed.checkpoint.load(state, "
            f"checkpoint_id={path!r}), or convert it once with torch.distributed.checkpoint.format_utils."
            f"dcp_to_torch_save({path!r}, 'FILE.pt') and fastckpt.load that file; a Lightning FSDP checkpoint "
            f"loads through its strategy: trainer.fit(ckpt_path={path!r})")


def resaved_by(target: Target, group_key: str, framework_files: dict) -> str | None:
    """The backend that saved the fastckpt group at ``group_key`` again in place, if one did:
    megatron-core's ``metadata.json`` (one of the group's ``framework_files``) names another
    sharded backend than ours (``"torch_dist"``: megatron's own). None otherwise, also when it is
    missing or does not parse (a save of ours killed while writing it)."""
    if MEGATRON_CONFIG not in framework_files:
        return None
    try:
        config = json.loads(bytes(target.get_bytes(posixpath.join(group_key, MEGATRON_CONFIG))))
    except (OSError, ValueError):
        return None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    return backend if isinstance(backend, str) and backend != "fastckpt" else None


def cut_zip(target: Target, key: str, size: int | None = None) -> bool:
    """Whether ``key`` (of ``size`` bytes, when known) starts like a zip (a torch.save or fastckpt
    file) but does not end with a whole end record: a checkpoint cut short (also through its end
    record: its signature alone is left), damaged (two small reads; ``torch_zip`` gave None)."""
    size = target.size(key) if size is None else size
    if size < len(foreign.LOCAL_SIG) or bytes(target.read_range(key, 0, 4)) != foreign.LOCAL_SIG:
        return False
    tail = bytes(target.read_range(key, max(0, size - TAIL_BYTES), min(size, TAIL_BYTES)))
    return foreign.zip_end(tail, size) is None


def damage(target: Target, key: str) -> str | None:
    """What is wrong with the file at ``key`` (it has no fastckpt manifest and is no complete
    torch.save zip) when it is a damaged checkpoint, which a listing must show, never skip
    silently: cut short (``cut_zip``), or empty or cut inside its first 4 bytes under a checkpoint's
    name (``CHECKPOINT_SUFFIXES``, as ``load`` calls it: truncated). None for anything else (a log,
    an empty stray file)."""
    if (size := target.size(key)) < len(foreign.LOCAL_SIG):  # empty, or cut inside the zip's first signature
        if not key.endswith(CHECKPOINT_SUFFIXES):
            return None
        if size == 0:
            return foreign.EMPTY
        return foreign.CUT_SHORT if bytes(target.read_range(key, 0, size)) == foreign.LOCAL_SIG[:size] else None
    if cut_zip(target, key, size):
        return foreign.CUT_SHORT
    return None


def torch_zip(target: Target, key: str) -> foreign.Record | None:
    """The pickle record of the complete ``torch.save`` zip at ``key``; None for anything else
    (not a zip, a zip cut short, a zip without ``data.pkl``)."""
    size = target.size(key)
    if size < foreign.LOCAL_HEADER_LEN:
        return None
    tail = bytes(target.read_range(key, max(0, size - TAIL_BYTES), min(size, TAIL_BYTES)))
    end = foreign.zip_end(tail, size)
    if isinstance(end, int):  # zip64: one more read for its record
        end = foreign.zip_end(tail, size, bytes(target.read_range(key, end, 56))) if end + 56 <= size else None
    if end is None or not 0 < end.cd_size <= MAX_DIRECTORY_BYTES:
        return None
    record = foreign.pickle_record(bytes(target.read_range(key, end.cd_offset, end.cd_size)))
    return None if record is None else dataclasses.replace(record, limit=end.cd_offset)


def _pickle(target: Target, key: str, record: foreign.Record | None) -> bytes | None:
    record = record or torch_zip(target, key)
    if record is None or record.size > foreign.MAX_PICKLE_BYTES:
        return None
    end = record.header_offset + foreign.LOCAL_HEADER_LEN + record.size
    if record.limit and end > record.limit:  # a damaged record: its bytes would run past the directory
        return None
    head = bytes(target.read_range(key, record.header_offset, min(foreign.LOCAL_HEADER_LEN + 1024,
                                                                  (record.limit or end + 1024) - record.header_offset)))
    start = foreign.data_offset(head)
    if start is None or (record.limit and record.header_offset + start + record.size > record.limit):
        return None
    return bytes(target.read_range(key, record.header_offset + start, record.size))


def pickle_step(target: Target, key: str, record: foreign.Record | None = None) -> int | None:
    """The step the ``torch.save`` file at ``key`` records at its top level, or None."""
    data = _pickle(target, key, record)
    return None if data is None else foreign.step_in_pickle(data)


def pickle_plain(target: Target, key: str) -> object | None:
    """The plain values of the ``torch.save`` (or fastckpt) file at ``key``
    (``format.foreign.plain_in_pickle``), from a few ranged reads: no tensor data is read, nothing
    is verified. None when it is no complete zip or its pickle does not parse."""
    data = _pickle(target, key, None)
    return None if data is None else foreign.plain_in_pickle(data)


def deepspeed_tag(target: Target, prefix: str, rel: str, rels: set[str]) -> str | None:
    """The tag directory (relative to ``prefix``) that the DeepSpeed ``latest`` file at ``rel``
    names, when that directory holds DeepSpeed files written by DeepSpeed itself; None otherwise
    (fastckpt's own pointer names a file or a group; a tag written through fastckpt's DeepSpeed
    engine is a group, complete once its manifest is published, whatever DeepSpeed's ``latest``
    says)."""
    try:
        if target.size(prefix + rel) > MAX_POINTER_BYTES:
            return None
        tag = target.get_bytes(prefix + rel).decode("utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):  # gone meanwhile, or not a text file
        return None
    except OSError as exc:  # unreadable: the tag it names may be the newest
        raise unreadable(exc, target.url_of(prefix + rel)) from None
    if not tag or "/" in tag or tag.startswith("."):
        return None
    tag_rel = posixpath.join(posixpath.dirname(rel), tag)
    files = sorted(r for r in rels if r.startswith(f"{tag_rel}/") and DEEPSPEED_FILE.match(posixpath.basename(r)))
    if not files:
        return None
    try:
        return tag_rel if written_by_deepspeed(target, prefix, files[:1]) else None
    except OSError as exc:
        raise unreadable(exc, target.url_of(prefix + files[0])) from None


def written_by_deepspeed(target: Target, prefix: str, rels: list[str]) -> list[str]:
    """DeepSpeed's per-rank files (``DEEPSPEED_FILE``) among ``rels`` (keys below ``prefix``) that
    DeepSpeed's own engine wrote: they have no fastckpt manifest (one written through fastckpt's
    DeepSpeed engine has one, naming its group, which is complete only once the group's manifest
    is published). A file whose manifest is damaged is fastckpt's; one gone meanwhile is none.

    Raises:
        OSError: a file cannot be read.
    """
    out = []
    for rel in rels:
        if not DEEPSPEED_FILE.match(posixpath.basename(rel)) or not nameable(prefix + rel):
            continue
        try:
            if not target.read_manifest(prefix + rel):
                out.append(rel)
        except (FileNotFoundError, CorruptCheckpointError):
            continue
    return out


def lightning_meta(target: Target, key: str, listed: bool, lightning_name: bool) -> int | None | Literal[False]:
    """A DCP directory's ``meta.pt`` at ``key`` (Lightning's FSDP sharded checkpoints: it writes it
    with ``torch.save`` after ``dcp.save``): the step it records; False when the checkpoint is not
    complete: a ``meta.pt`` cut short, or none (``listed`` False) in a ``*.ckpt`` directory
    (``lightning_name``: a kill between the two)."""
    try:
        record = torch_zip(target, key) if listed else None
        if record is None:
            return False if listed or lightning_name else None
        return pickle_step(target, key, record)
    except FileNotFoundError:  # gone since the listing
        return False
    except OSError as exc:  # unreadable: it may be the newest
        raise unreadable(exc, target.url_of(key)) from None


def unreadable(exc: OSError, url: str) -> OSError:
    """``exc`` (reading ``url`` in a scan for the newest checkpoint), with a note naming the path
    and the fix: a checkpoint that cannot be read may be the newest, so no answer rather than an
    older one (a file gone since the listing is passed over instead: a race with retention)."""
    exc.add_note(f"{url} cannot be read, so whether it is the newest checkpoint is unknown: make it readable "
                 "(owner/mode), or move it away if it is no checkpoint")
    return exc


_BOOL_DTYPES = ("torch.bool", "bool")  # a tensor's, a numpy array's (numpy.bool_ has no __index__)


def check_step(extra: dict) -> dict:
    """``extra`` with its step as an ``int``. ``commit(group, step=...)``'s step orders the groups
    (``latest`` picks the highest, retention counts below it): one that is no whole number >= 0 was
    recorded and then passed over for the tag's number, so a misordered ``latest`` was the first
    sign of it. An integer of another type (numpy's, a 0-dim integer tensor) counts as its value,
    as in ``range``; a bool is no step, nor is a bool tensor or array (a flag passed by mistake);
    None is none.

    Raises:
        ConfigError: naming the value and the fix.
    """
    step = extra.get("step")
    if step is None:
        return extra
    try:
        n = -1 if isinstance(step, bool) or str(getattr(step, "dtype", "")) in _BOOL_DTYPES else operator.index(step)
    except TypeError:
        n = -1
    if n < 0:
        raise ConfigError(f"commit(step={step!r}): the step must be an integer >= 0 (the training step this group "
                          "holds, recorded in its manifest), or None for no step")
    return {**extra, "step": n}


def group_step(record: dict, name: str) -> int | None:
    """A group's step: the ``step`` its manifest (or ``commit(step=...)``'s extra) records, else the
    number its tag ``name`` ends with (global_step1200, iter_0000500)."""
    step = record.get("step")
    return step if isinstance(step, int) else tag_step(name)


def tag_step(tag_rel: str) -> int | None:
    """The step in a DeepSpeed tag's name (``global_step1200`` -> 1200), or None."""
    m = re.search(r"(\d+)$", posixpath.basename(tag_rel))
    return int(m.group(1)) if m else None
