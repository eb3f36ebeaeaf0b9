"""The one cross-rank agreement check of cp: every rank's small row of ints, gathered the same way everywhere.

A rank alone in a mistake (another shard size, plan, length or dtype) would leave the others
waiting in the next collective until the group's timeout, or worse, compute garbage. So the checks
of cp (shards, Ulysses' sizes, masked plans, dispatch, the debug mode) each describe this rank's
inputs as a short row of ints, gather every rank's row with ``gather``, and judge the whole table:
every rank sees the same table, so every rank raises the same ValueError (``check``), or none does.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from cp.comm import all_gather_into, meta_device


def gather(row: Sequence[int], group: Any, ring_group: Any = None) -> list[list[int]]:
    """Every rank's ``row`` (ints, as many on every rank), in group-rank order: one all-gather over ``group``.

    With ``ring_group``: ``group`` is a Ulysses group and the rows are those of the cp group the two
    span, in cp-rank order (cp rank = ring rank * u + ulysses rank): one all-gather in each group.
    """
    device = meta_device(group)
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    rows = torch.empty(group.size() * mine.numel(), dtype=torch.int64, device=device)
    all_gather_into(rows, mine, group)
    if ring_group is not None:  # this Ulysses group's rows, gathered over the ring: the whole cp group's
        every = torch.empty(ring_group.size() * rows.numel(), dtype=torch.int64, device=device)
        all_gather_into(every, rows, ring_group)
        rows = every
    return rows.view(-1, mine.numel()).tolist()


def check(what: str, row: Sequence[int], group: Any, judge: Callable[[list[list[int]]], str | None],
          ring_group: Any = None) -> list[list[int]]:
    """``gather`` the rows, then raise ``ValueError(f"{what}: {problem}")`` on every rank alike when
    ``judge(table)`` names a problem; the table otherwise."""
    table = gather(row, group, ring_group)
    problem = judge(table)
    if problem:
        raise ValueError(f"{what}: {problem}")
    return table


__all__ = ["check", "gather"]
