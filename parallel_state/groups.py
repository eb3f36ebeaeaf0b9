"""Creating and destroying process groups on the members only, with names that never repeat.

torch's members-only path (``new_group(..., use_local_synchronization=True)``) names a group
from its ranks and the number of live groups, so a group destroyed and rebuilt with the same
ranks gets the same name, finds its previous incarnation's rendezvous keys in the store and
hangs. The default path names groups from a process-wide counter that only grows, but every
rank must call it for every group in the world to keep the counter in step.

We take the default path on the members only and advance the counter arithmetically: a
batch of ``n`` world-wide groups owns the counter values ``[base, base + n)``; each member
creates its group under ``base + <index of the group in the batch>`` and every rank then moves
the counter to ``base + n``. Names stay unique per process and identical across a group's
members, and no rank does work for groups it is not in.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from parallel_state.errors import ParallelStateError


def live_groups() -> set[Any]:
    """The process groups torch currently knows about in this process."""
    return set(c10d._world.pg_map)


def _default_backend() -> str:
    return str(dist.get_backend())


def _eager_nccl() -> bool:
    """Whether new NCCL groups would be split from an eagerly initialised default group.

    ``ncclCommSplit`` is collective over the whole default group, so members-only creation
    would hang there; such runs take the all-ranks path.
    """
    default = c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None and "nccl" in _default_backend()


@dataclass
class GroupBatch:
    """Allocates counter-named groups for one ``initialize_model_parallel`` call."""

    timeout: datetime.timedelta
    created: list[Any] = field(default_factory=list)
    _base: int = field(default=-1)
    _next_slot: int = 0

    def __post_init__(self) -> None:
        self._base = c10d._world.group_count

    def create(
        self,
        ranks: tuple[int, ...],
        *,
        index: int,
        count: int,
        all_groups: Any = None,
        backend: str | None = None,
        pg_options: Any = None,
        desc: str,
    ) -> Any:
        """Create this rank's group: the ``index``-th of ``count`` same-kind groups in the world.

        ``all_groups`` (a callable giving every group of the kind) is used only on the
        eager-NCCL fallback, where every rank must take part in every creation.
        """
        slot = self._next_slot
        self._next_slot += count
        if _eager_nccl() and all_groups is not None:
            mine = None
            for i, group_ranks in enumerate(all_groups()):
                c10d._world.group_count = self._base + slot + i
                pg = dist.new_group(
                    list(group_ranks), timeout=self.timeout, backend=backend,
                    pg_options=pg_options, group_desc=desc,
                )
                if group_ranks == ranks:
                    mine = pg
            self.created.append(mine)
            return mine
        c10d._world.group_count = self._base + slot + index
        try:
            pg = dist.new_group(
                list(ranks), timeout=self.timeout, backend=backend,
                pg_options=pg_options, group_desc=desc,
            )
        finally:
            c10d._world.group_count = self._base + self._next_slot
        if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            raise ParallelStateError(f"rank {dist.get_rank()} was not made a member of {desc} {ranks}")
        self.created.append(pg)
        return pg

    def close(self) -> None:
        """Leave the counter past every name this batch could have used, on every rank alike."""
        c10d._world.group_count = max(c10d._world.group_count, self._base + self._next_slot)


def destroy_groups(groups: list[Any]) -> None:
    """Destroy each group once, skipping those torch has already forgotten."""
    seen: set[int] = set()
    for pg in groups:
        if pg is None or id(pg) in seen:
            continue
        seen.add(id(pg))
        if pg in c10d._world.pg_map:
            dist.destroy_process_group(pg)
