"""What a dispatch plan is made of: which tokens each rank holds (``Layout``, its ``Runs``) and how K/V
travel between the ranks (``Transport``).

The cost model (``dispatch_cost``) prices a layout under a transport and the planner (``dispatch_plan``)
makes the layouts; both read these names from here, so neither imports the other's vocabulary.
"""

from __future__ import annotations

from typing import Iterable

from parallel_state.topology.str_enum import StrEnum


class Layout(StrEnum):
    """Which tokens each rank holds: ``plan_dispatch``'s layouts (``dispatch_plan``'s module doc) and the fixed one of
    megatron-core and Transformer Engine (``plan_dual_chunk_swap``). A member equals its string: ``method="balanced"``
    names ``Layout.BALANCED``."""

    BALANCED = "balanced"
    CONTIGUOUS = "contiguous"
    CLIPS = "clips"
    DUAL_CHUNK_SWAP = "dual_chunk_swap"


class Transport(StrEnum):
    """How K/V reach the ranks that need them (``dispatch_cost``'s module doc), in the order ties are broken."""

    P2P = "p2p"
    ALLGATHER = "allgather"
    RING = "ring"


#: Every transport, in the order ties are broken (``in`` takes their strings too).
TRANSPORTS = tuple(Transport)

#: One rank's tokens (or one block's, or the keys some queries see): half-open ``(start, stop)`` runs.
Runs = tuple[tuple[int, int], ...]


def merged(runs: Iterable[tuple[int, int]]) -> Runs:
    """``runs`` sorted, the empty ones left out and those that overlap or touch joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in runs if r[1] > r[0]):
        if out and out[-1][1] >= start:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return tuple(out)


__all__ = ["TRANSPORTS", "Layout", "Runs", "Transport", "merged"]
