"""Agreement between the ranks of a DeepSpeed job: every rank calls these at the same point of a
``save_checkpoint`` or ``load_checkpoint``, so that an outcome seen on one rank (a failed save, a
load that raised, a tag saved again during its load) is acted on by all of them. An error raised
on one rank only would leave the others in DeepSpeed's next collective, waiting for ever, or
training on with a state the failed rank does not have.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from fastckpt import errors

COMMITTED, SKIPPED, FAILED = 0, 1, 2  # a rank's outcome of ``commit``, worst last


def worst_on_any_rank(outcome: int) -> int:
    """The worst ``outcome`` of any rank of the job (every rank calls ``commit`` for each tag)."""
    return _max_on_any_rank([outcome])[0]


def _max_on_any_rank(values: list[int]) -> list[int]:
    """Each of ``values`` (int64), the largest any rank of the job called this with."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


@dataclass(frozen=True)
class LoadOutcome:
    """What the ranks' loads of one ``load_checkpoint`` try came to, agreed on every rank."""
    failed: bool  # a rank raised (see ``error_on_any_rank``)
    changed: bool  # a rank's tag was saved again and swapped in during its load
    mixed: bool  # the ranks loaded different saves (different tags resolved, or one saved again between them)


def agree_on_load(error: BaseException | None, changed: bool, save: str) -> LoadOutcome:
    """Every rank calls this after its load of a tag: ``save`` names what it loaded (the tag and
    its files' checksums), so that ranks that loaded different saves know it and load again."""
    ident = int.from_bytes(hashlib.blake2b(save.encode(), digest_size=8).digest(), "big") >> 2
    failed, chg, hi, neg_lo = _max_on_any_rank([int(error is not None), int(changed), ident, -ident])
    return LoadOutcome(bool(failed), bool(chg), hi != -neg_lo)


def error_on_any_rank(error: BaseException | None) -> BaseException:
    """The error to raise on this rank once some rank's load raised: its own, else the first
    failed rank's, of the same class when that is one of fastckpt's (a fallback such as ``except
    CorruptCheckpointError: load an older tag`` then takes the same branch on every rank)."""
    from deepspeed import comm as dist

    if error is not None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return error
    mine = None if error is None else (dist.get_rank(), type(error).__name__,
                                       "; ".join([str(error), *getattr(error, "__notes__", ())]))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if error is not None:
        return error
    rank, name, text = next(e for e in everyone if e is not None)
    cls = getattr(errors, name, None)
    cls = cls if isinstance(cls, type) and issubclass(cls, errors.FastCkptError) else errors.FastCkptError
    return cls(f"the checkpoint was not loaded: rank {rank} failed to load it ({name}: {text}); every rank raises")
