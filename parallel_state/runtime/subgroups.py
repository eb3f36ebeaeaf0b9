"""This rank's group of each of several partitions of the world: reused or created on its members, all ranks or none.

``fsdp_mesh`` and the ``DistributedManager``'s meshes and named groups all need, per sort of group, the one
group this rank belongs to among the world's groups of that sort. Each sort's groups are created members-only
through ``parallel_state.groups.create.GroupBatch`` (a counter span the same on every rank, whichever groups are
reused), after a check that every rank asked for the same thing, and a failure on any rank undoes every rank's
part. torch is imported only when groups are built.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from parallel_state.errors import ParallelStateError


class Wanted(NamedTuple):
    """One sort of group, as this rank sees it."""

    #: This rank's group (its global ranks, in group order).
    ranks: tuple[int, ...]
    #: Its index among the world's groups of the sort (the same on every member).
    index: int
    #: How many groups of the sort the world has (the same on every rank).
    count: int
    #: Every group of the sort in index order; read only where every rank must create every group (eager NCCL).
    all_groups: Callable[[], Iterable[tuple[int, ...]]]


def partition_wanted(groups: Sequence[tuple[int, ...]], rank: int) -> Wanted:
    """``rank``'s place in ``groups``, a partition of the world listed in one order on every rank."""
    for index, ranks in enumerate(groups):
        if rank in ranks:
            return Wanted(tuple(ranks), index, len(groups), lambda: iter(groups))
    raise ParallelStateError(f"rank {rank} is in none of the groups {[list(g) for g in groups]}; they must cover "
                             f"the world")


def build_groups(what: str, config: Mapping[str, Any], wanted: Mapping[str, Wanted], *,
                 timeout: datetime.timedelta, reuse: Callable[[tuple[int, ...], str], Any]) -> tuple[dict[str, Any], list]:
    """This rank's group of each sort in ``wanted``, and the list of those created here (the caller frees them).

    Collective over the world: every rank calls it with an equal ``config`` (checked first, so that a rank
    called with other values is named on every rank instead of leaving its peers waiting). ``reuse(ranks, sort)``
    gives an existing group holding exactly ``ranks`` in that order, or None to create one. After an error on
    any rank, every rank has destroyed what it created and raises.
    """
    from parallel_state.groups.consistency import check_same_everywhere, confirm_everywhere
    from parallel_state.groups.create import GroupBatch, destroy_groups

    check_same_everywhere(what, dict(config), timeout=timeout)
    # The outer batch reserves every sort's span; each sort gets its own batch inside it, so the
    # counter moves by the same amount on every rank whichever groups are reused here.
    outer = GroupBatch(timeout=timeout, reserve=sum(w.count for w in wanted.values()))
    batches: list[Any] = []
    made: dict[str, Any] = {}

    def undo() -> None:
        made.clear()
        created = [pg for batch in batches for pg in batch.created]
        for batch in batches:
            batch.created = []
        try:
            destroy_groups(created)
        except Exception:  # the error that brought us here is the one to report
            pass

    error: Exception | None = None
    try:
        for sort, want in wanted.items():
            batch = GroupBatch(timeout=timeout, reserve=want.count)
            batches.append(batch)
            existing = reuse(want.ranks, sort)
            made[sort] = existing if existing is not None else batch.create(
                want.ranks, index=want.index, count=want.count, desc=f"{what} {sort}", all_groups=want.all_groups)
            batch.close()
        for batch in batches:
            batch.wait_for_members()
    except Exception as exc:  # tell the other ranks before raising, so that they undo theirs
        error = exc
    except BaseException:  # an interrupt: undo here, and no collective on the way out
        outer.close()
        undo()
        raise
    outer.close()
    try:
        confirm_everywhere(f"{what} (group creation)", error, timeout=timeout)
    except BaseException:
        undo()
        raise
    if error is not None:
        undo()
        raise error
    created: list[Any] = []
    for batch in batches:
        created.extend(batch.created)
        batch.created = []
    return made, created


def blocks(groups: Sequence[tuple[int, ...]], size: int) -> list[tuple[int, ...]]:
    """Every group of ``groups`` cut into consecutive blocks of ``size`` ranks, group after group."""
    return [tuple(group[start:start + size]) for group in groups for start in range(0, len(group), size)]


def transpose(groups: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The groups orthogonal to ``groups`` (equal sizes): the ranks at each position of every group."""
    return [tuple(column) for column in zip(*groups, strict=True)]
