"""One collective that checks every rank asked for the same thing."""

from __future__ import annotations

import datetime
from typing import Any

from parallel_state.errors import ParallelStateError


def check_same_everywhere(what: str, config: dict[str, Any], *, timeout: datetime.timedelta) -> None:
    """Raise on every rank, naming the ranks that disagree, unless all ranks passed ``config``."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, config)
    if all(g == config for g in gathered):
        return
    by_value: dict[str, list[int]] = {}
    for r, g in enumerate(gathered):
        by_value.setdefault(repr(g), []).append(r)
    detail = "; ".join(f"ranks {ranks}: {value}" for value, ranks in by_value.items())
    raise ParallelStateError(
        f"{what} was called with different arguments on different ranks ({detail}); "
        f"every rank must pass the same sizes and order"
    )
