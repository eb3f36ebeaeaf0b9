"""Counting what cp's attention engine does on this rank: the pairs it computes and the K/V it sends.

``with cp.count_attention() as count:`` records, for every call of the engine (``cp.engine``: every
``ring_attention``, and ``ulysses_attention`` / ``usp_attention`` with ``mask=`` or ``plan=``) made
in this thread inside the block, forward and backward alike and for every transport, what this
rank actually computed and sent; a face's cross-attention call (``cp.cross``) adds its forward pairs and
one call (its gather's bytes are not counted).
It exists so that a test or a benchmark can check the plan's figures against the work done: for
the ring, ``count.pairs == batch * query heads * plan.work[rank]``. Outside such a block the cost
is one list lookup per call.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class AttentionCount:
    """What this rank's attention engine computed and sent while the count was open.

    Pairs are counted per batch element and query head: a tile of R queries and W keys computed
    for B batch elements and H query heads adds B * H * (allowed pairs of the tile) to ``pairs``
    and B * H * R * W to ``scores``. Bytes are payload bytes handed to ``torch.distributed``,
    keyed by the peer's global rank.
    """

    pairs: int = 0                   #: allowed (query, key) pairs computed in forward passes
    scores: int = 0                  #: score entries computed in forward passes (allowed or masked in a computed tile)
    backward_pairs: int = 0          #: allowed pairs recomputed in backward passes
    kv_sent: dict[int, int] = field(default_factory=dict)       #: K/V bytes sent, by peer (forward and backward)
    kv_received: dict[int, int] = field(default_factory=dict)   #: K/V bytes received, by peer
    grad_sent: dict[int, int] = field(default_factory=dict)     #: dK/dV bytes sent back to the K/V's owner, by peer
    grad_received: dict[int, int] = field(default_factory=dict)  #: dK/dV bytes received from peers
    calls: int = 0                   #: engine forward calls

    def add(self, table: dict[int, int], peer: int, nbytes: int) -> None:
        table[peer] = table.get(peer, 0) + nbytes


_local = threading.local()


def active() -> list[AttentionCount]:
    """The counts open in this thread (innermost last); empty when none is."""
    counts = getattr(_local, "counts", None)
    if counts is None:
        counts = _local.counts = []
    return counts


@contextlib.contextmanager
def count_attention() -> Iterator[AttentionCount]:
    """Count the pairs and bytes of this thread's engine calls (forward and backward) inside the block."""
    count = AttentionCount()
    counts = active()
    counts.append(count)
    try:
        yield count
    finally:
        counts.remove(count)


__all__ = ["AttentionCount", "count_attention"]
