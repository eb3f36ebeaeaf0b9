"""MAGI-1's logging helpers, through loguru (imported on first use), with the global rank on every line."""

from __future__ import annotations

from parallel_state.runtime.resolve import dist_ready, resolve_global_rank


def _log(message: object) -> None:
    from loguru import logger

    # depth=2 attributes the line to whoever called print_rank_0 / print_per_rank.
    logger.opt(depth=2).info("[rank {}] {}", resolve_global_rank(), message)


def print_rank_0(message: object) -> None:
    """Log ``message`` once per job: from global rank 0, or always outside a distributed run."""
    if dist_ready():
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
    _log(message)


def print_per_rank(message: object) -> None:
    """Log ``message`` from every rank, each line naming its rank."""
    _log(message)
