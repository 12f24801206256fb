"""Whether the ranks' commits of one attempt are of one save: every rank announces the step its
``commit`` records with its files (the store entry, or its marker), and rank 0 publishes nothing
when they differ: every rank's commit raises ``ConfigError`` naming the steps and their ranks.

The ranks pair their commits of a group by order: with a store each rank numbers its own commits
(``Coordinator._channel``), and the n-th commit of every rank is one attempt; without one each
rank joins the attempt rank 0 runs when it commits. A ``commit`` made again on one rank alone (a
retry after an error on that rank only) puts that rank a commit ahead of the others: its commit
pairs with their commit of their next save, its next one with the save after that, for the rest
of the run. The ranks' own counts cannot tell such a retry from a rank with nothing new to save
at a commit (a legitimate commit that saves nothing), but the step, which every rank passes for
one save, can; without a step nothing tells them apart (docs/groups.md).

The ranks are brought back in step too: each rank also announces the step of its previous commit
of the group, and a rank that commits a step no later than one some rank committed before is
*behind* (it commits a save already committed: a retry), when another is not. Its next commit of
the group (of the save the others just committed, refused here) then fails at once, on that rank
alone, with no attempt begun (no attempt number, no marker, no ``attempt.json``): its commit
after that pairs with the others' again. A rank further behind is refused again, one commit each
time, until its step meets the others'. Steps that differ with no rank behind (a step each rank
counts on its own) move nothing: the next commits pair as before.
"""

from __future__ import annotations

from concurrent.futures import Future

from ..errors import ConfigError
from ..storage.places import Place
from . import protocol as P
from . import store as S

REFUSED = "refused"  # the outcome of an attempt whose ranks committed different steps


def refusal(why: str, behind: list[int]) -> ConfigError:
    """What every rank raises: ``why``; ``behind`` (kept on it): the ranks whose next commit is skipped."""
    err = ConfigError(why)
    err.behind = behind  # type: ignore[attr-defined]
    return err


def steps_apart(label: str, entries: dict[int, dict]) -> ConfigError | None:
    """Rank 0: the refusal of an attempt whose ranks committed different steps (``entries``: rank ->
    its store entry or marker: ``step``, the one its ``commit`` recorded, None: none; ``prev``, that
    of its previous commit of the group); None when they agree."""
    steps, prev = {r: e.get("step") for r, e in entries.items()}, {r: e.get("prev") for r, e in entries.items()}
    if len(set(steps.values())) < 2:
        return None
    by: dict[object, list[int]] = {}
    for r, s in sorted(steps.items()):
        by.setdefault(s, []).append(r)
    before = [p for p in prev.values() if isinstance(p, int)]
    behind = sorted(r for r, s in steps.items() if isinstance(s, int) and before and s <= max(before))
    if len(behind) == len(steps) or not all(isinstance(s, int) for s in steps.values()):
        behind = []  # no rank is ahead of another
    said = "; ".join(f"step={s!r} on ranks {rs}" for s, rs in by.items())
    then = (f" Ranks {behind} committed a step committed before: their next commit of the group (of the save the "
            "others committed here) fails at once too, so that their commit after it pairs with the others' "
            "again." if behind else "")
    return refusal(
        f"checkpoint group {label} not committed: its ranks committed different steps ({said}), so their files are "
        "not of one save (a commit() made again on some ranks alone, such as a retry after an error on one rank, or "
        "a step each rank counts on its own). Nothing of it is published; the previous checkpoint is intact."
        f"{then} Call commit() once per save on every rank, with the same step; after an error on one rank, fail "
        "the step on every rank rather than retrying commit() on that rank.", behind)


def skipped(label: str) -> ConfigError:
    """What the next commit of a rank behind raises, at once (``Coordinator.commit``)."""
    return ConfigError(
        f"checkpoint group {label} not committed on this rank: its previous commit of the group was refused because "
        "this rank committed a step committed before (a commit() made again on this rank alone), so this commit is "
        "of the save the other ranks committed in that attempt. It ends at once, with no attempt begun, so that "
        "this rank's next commit pairs with the other ranks' next one: save and commit the next step on every rank.")


def failed(err: BaseException) -> Future:
    """A commit's handle that failed before any work began: ``err``."""
    fut: Future = Future()
    fut.set_exception(err)
    return fut


def refuse_via_store(ch: S.Channel, entries: dict[int, dict], label: str) -> ConfigError | None:
    """Rank 0 with a store, every rank announced (``entries``, with its step and its previous one):
    when the steps differ, end the attempt on every rank and return the refusal; None when the
    steps agree, or another rank ended the attempt first (its outcome stands)."""
    err = steps_apart(label, entries)
    if err is None or not ch.end(f"{REFUSED}:{','.join(map(str, err.behind))}:{err}"):  # type: ignore[attr-defined]
        return None
    ch.tell(None)
    return err


def heard(rest: str) -> ConfigError:
    """Another rank with a store: the refusal in rank 0's outcome (its text after ``refused:``)."""
    behind, _, why = rest.partition(":")
    return refusal(why, [int(r) for r in behind.split(",") if r])


def refused_record(place: Place, token: str | None, markers: dict[int, dict], label: str,
                   replaced: str | None) -> ConfigError | None:
    """Rank 0 without a store, every marker in: when the steps differ, record the refusal in the
    outcome the other ranks read (``fallback.wait_for_manifest``), and return it; None when they agree."""
    err = steps_apart(label, markers)
    if err is not None:
        P.write_record(place, P.OUTCOME, attempt=token, outcome=REFUSED, why=str(err), replaced=replaced,
                       behind=err.behind)  # type: ignore[attr-defined]
    return err
