"""Agreement between the ranks of a DeepSpeed job: every rank calls these at the same point of a
``save_checkpoint`` or ``load_checkpoint``, so that an outcome seen on one rank (a failed save, a
load that raised, a tag saved again during its load) is acted on by all of them. An error raised
on one rank only would leave the others in DeepSpeed's next collective, waiting for ever, or
training on with a state the failed rank does not have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
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


def _ident(text: str) -> int:
    """A hash of ``text`` that fits an int64 with its negation (the MAX all-reduce of both is
    the largest and the smallest any rank has: equal on every rank exactly when all agree)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


def agree_on_load(error: BaseException | None, changed: bool, save: str) -> LoadOutcome:
    """Every rank calls this after its load of a tag: ``save`` names what it loaded (the tag and
    its files' checksums), so that ranks that loaded different saves know it and load again."""
    ident = _ident(save)
    failed, chg, hi, neg_lo = _max_on_any_rank([int(error is not None), int(changed), ident, -ident])
    return LoadOutcome(bool(failed), bool(chg), hi != -neg_lo)


def agree_on_save(outcome: int, home: str, tag: str) -> tuple[int, bool]:
    """Every rank calls this as its ``save_checkpoint`` begins, with the outcome of its
    preparations (``COMMITTED`` or ``FAILED``) and the checkpoint it was asked for (``home``,
    ``tag``). Returns the worst outcome of any rank, and whether the ranks were asked for
    different checkpoints: one all-reduce for both, the one every save makes anyway."""
    ident = _ident(f"{home}\0{tag}")
    worst, hi, neg_lo = _max_on_any_rank([outcome, ident, -ident])
    return worst, hi != -neg_lo


def different_tags_error(home: str, tag: str) -> errors.ConfigError:
    """The error every rank raises once ``agree_on_save`` found that the ranks called
    ``save_checkpoint`` with different save_dirs or tags (a collective: every rank calls it),
    naming each rank's."""
    from deepspeed import comm as dist

    ranks = _by_key(_gathered((home, tag)), tuple)
    one_dir = len({h for h, _ in ranks}) == 1
    asked = _listed(ranks, lambda ht: f"tag {ht[1]!r}{'' if one_dir else f' in {ht[0]}'}", "tags")
    return errors.ConfigError(
        f"save_checkpoint was called with different {'tags' if one_dir else 'save_dirs or tags'} on the ranks "
        f"({asked}{f', under {home}' if one_dir else ''}); this is rank {dist.get_rank()}, asked for {tag!r}. "
        "A checkpoint is one tag that every rank saves its files into: pass the same save_dir and tag on every "
        "rank (nothing rank-specific in the tag, such as a timestamp taken on each rank: derive it from the step, "
        "e.g. f'global_step{engine.global_steps}', or broadcast rank 0's). Nothing was saved, on any rank")


def _gathered(mine: object) -> list:
    """Every rank's ``mine``, by rank (a collective: every rank calls it)."""
    from deepspeed import comm as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _by_key(everyone: list, key: Callable[[object], Hashable]) -> dict[Hashable, list[int]]:
    """The ranks of each ``key`` of what they gave, in the order the keys first come."""
    ranks: dict[Hashable, list[int]] = {}
    for rank, theirs in enumerate(everyone):
        ranks.setdefault(key(theirs), []).append(rank)
    return ranks


def _listed(ranks: dict[Hashable, list[int]], say: Callable[[Hashable], str], kind: str) -> str:
    """``say(key) on ranks ...`` for the first 4 keys of ``ranks``, and how many ``kind`` more."""
    each = "; ".join(f"{say(k)} on {_ranks(r)}" for k, r in list(ranks.items())[:4])
    return each + (f"; and {len(ranks) - 4} other {kind}" if len(ranks) > 4 else "")


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 1, 2, 3 and 4 more``, for the errors naming what each rank asked for."""
    return (f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(map(str, ranks[:4]))
            + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""))


def asked_differently(asked: dict[str, object]) -> bool:
    """Every rank calls this as its ``load_checkpoint`` begins, with what it was asked for (its
    load_dir, tag and load options): whether any rank was asked for something else. One all-reduce
    for all of them, before any rank reads or resolves a tag."""
    ident = _ident(repr(sorted(asked.items())))
    hi, neg_lo = _max_on_any_rank([ident, -ident])
    return hi != -neg_lo


def different_loads_error(asked: dict[str, object]) -> errors.ConfigError:
    """The error every rank raises once ``asked_differently`` found that the ranks called
    ``load_checkpoint`` with different arguments (a collective: every rank calls it), naming each
    rank's values of the arguments that differ."""
    from deepspeed import comm as dist

    everyone = _gathered(asked)
    differ = [k for k in asked if len({repr(e[k]) for e in everyone}) > 1]
    ranks = _by_key(everyone, lambda theirs: ", ".join(f"{k}={theirs[k]!r}" for k in differ))
    each = _listed(ranks, str, "combinations")
    return errors.ConfigError(
        f"load_checkpoint was called with different {', '.join(differ)} on the ranks ({each}); this is rank "
        f"{dist.get_rank()}. Every rank loads one and the same checkpoint, the same way: pass the same load_dir, tag "
        "(or none on every rank: the newest complete one) and load options on every rank (nothing rank-specific in "
        "the tag, such as a timestamp taken on each rank: derive it from the step, or broadcast rank 0's). Nothing "
        "was loaded, on any rank")


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
