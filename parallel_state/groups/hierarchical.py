"""megatron-core 0.16's ``create_hierarchical_groups`` and ``create_hybrid_dp_cp_groups``.

Which ranks form each group is pure arithmetic (``topology.rank_generator``'s
``hierarchical_rank_groups`` and ``hybrid_rank_groups``); here every rank creates every group, as
in megatron-core, and keeps its own.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.groups.process_groups import create_group
from parallel_state.topology.arguments import flag, is_int
from parallel_state.topology.rank_generator import hierarchical_rank_groups, hybrid_rank_groups


def _this_rank(rank: object) -> int:
    if not is_int(rank):
        raise ParallelStateTypeError(f"rank must be this process's global rank (an int), got {rank!r}")
    return operator.index(rank)  # type: ignore[arg-type]


def create_hierarchical_groups(
    rank: int,
    ranks: Sequence[int],
    hierarchical_group_sizes: Sequence[int],
    create_gloo_process_groups: bool = False,
    pg_options: Any = None,
    timeout: Any = None,
    group_desc: str | None = None,
) -> tuple[list[Any], list[Any]]:
    """Create the groups of :func:`hierarchical_rank_groups`; every rank of the world calls it.

    Returns this rank's group at each level (empty when ``rank`` is not in ``ranks``) and the
    matching gloo groups (None entries unless ``create_gloo_process_groups``). ``pg_options``
    is one options object for every level, or a list with one per level.
    """
    rank = _this_rank(rank)
    create_gloo = flag("create_gloo_process_groups", create_gloo_process_groups)
    levels = hierarchical_rank_groups(ranks, hierarchical_group_sizes)
    # Only a list is per-level, as in megatron-core; anything else applies to every level.
    if isinstance(pg_options, list):
        if len(pg_options) != len(levels):
            raise ParallelStateError(
                f"pg_options has {len(pg_options)} entries for {len(levels)} levels; give one per level, "
                f"or a single options object for all"
            )
        options = pg_options
    else:
        options = [pg_options] * len(levels)
    groups: list[Any] = []
    gloo_groups: list[Any] = []
    for level, level_groups in enumerate(levels):
        for sub_ranks in level_groups:
            group = create_group(sub_ranks, timeout=timeout, pg_options=options[level],
                                 group_desc=f"HIERARCHICAL_{group_desc}_L{level}")
            gloo = None
            if create_gloo:
                gloo = create_group(sub_ranks, timeout=timeout, backend="gloo", pg_options=options[level],
                                    group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}")
            if rank in sub_ranks:
                groups.append(group)
                gloo_groups.append(gloo)
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(rank: int, ranks: Sequence[int], pg_options: Any) -> dict[int, Any]:
    """Create the groups of :func:`hybrid_rank_groups`; every rank of the world calls it.

    Returns this rank's group of each size, keyed by size (empty when ``rank`` is not in ``ranks``).
    """
    rank = _this_rank(rank)
    mine: dict[int, Any] = {}
    for size, size_groups in hybrid_rank_groups(ranks).items():
        for sub_ranks in size_groups:
            group = create_group(sub_ranks, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}")
            if rank in sub_ranks:
                mine[size] = group
    return mine
