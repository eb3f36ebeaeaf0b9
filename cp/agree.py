"""The one cross-rank agreement check of cp: every rank's small row of ints, gathered the same way everywhere.

A rank alone in a mistake (another shard size, plan, length or dtype) would leave the others
waiting in the next collective until the group's timeout, or worse, compute garbage. So the checks
of cp (shards, Ulysses' sizes, masked plans, dispatch, the debug mode) each describe this rank's
inputs as a short row of ints, gather every rank's row with ``gather``, and judge the whole table:
every rank sees the same table, so every rank raises the same ValueError, or none does.
``start`` begins the gather without waiting, so that a caller can compute meanwhile and judge the
table before it sends anything (``cp.call_check``: attention's check, cached per distinct call).
A value too wide for a row travels as its ``digest``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from cp.comm import meta_device


class Pending:
    """A gather started by ``start``: ``table()`` waits for it and returns every rank's row; ``rows()`` the same as
    a tensor on the gather's device, without the host reading it (on NCCL: without waiting for the GPU)."""

    def __init__(self, work: Any, width: int, finish: Callable[[], torch.Tensor]):
        self._work, self._width, self._finish = work, width, finish

    def rows(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish().view(-1, self._width)

    def table(self) -> list[list[int]]:
        return self.rows().tolist()


def _everyone(mine: torch.Tensor, group: Any, async_op: bool) -> tuple[torch.Tensor, Any]:
    """Every rank's ``mine`` in group-rank order, by one all-to-all (each rank sends its row to every rank at
    once: one round of messages, where gloo's all-gather passes rows round a ring in n - 1)."""
    rows = torch.empty(group.size() * mine.numel(), dtype=mine.dtype, device=mine.device)
    work = dist.all_to_all_single(rows, mine.repeat(group.size()), group=group, async_op=async_op)
    return rows, work


def start(row: Sequence[int] | torch.Tensor, group: Any, ring_group: Any = None) -> Pending:
    """Start gathering every rank's ``row`` (ints, as many on every rank; or an int64 tensor of them already on
    ``meta_device(group)``) over ``group``, without waiting.

    With ``ring_group``: ``group`` is a Ulysses group and the rows are those of the cp group the two
    span, in cp-rank order (cp rank = ring rank * u + ulysses rank): a second gather, over the ring,
    when the first one is done.
    """
    mine = row if isinstance(row, torch.Tensor) else torch.tensor(list(row), dtype=torch.int64,
                                                                   device=meta_device(group))
    rows, work = _everyone(mine, group, async_op=True)

    def finish() -> torch.Tensor:
        # This Ulysses group's rows, gathered over the ring: the whole cp group's.
        return rows if ring_group is None else _everyone(rows, ring_group, async_op=False)[0]

    return Pending(work, mine.numel(), finish)


def digest(value: Any) -> int:
    """A 63-bit digest of ``repr(value)``, the same in every process (Python's ``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big") >> 1


def gather(row: Sequence[int], group: Any, ring_group: Any = None) -> list[list[int]]:
    """Every rank's ``row`` (ints, as many on every rank), in group-rank order (``start``, waited for)."""
    return start(row, group, ring_group).table()


__all__ = ["Pending", "digest", "gather", "start"]
