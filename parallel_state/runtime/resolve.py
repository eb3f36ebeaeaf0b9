"""Rank, world size and collective device, from whichever source knows them.

Each resolver asks, in order: the ``DistributedManager`` (once initialized), a plain initialized
``torch.distributed``, the launcher's environment (torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``,
or SLURM's / Open MPI's equivalents), and finally answers for a single process.
"""

from __future__ import annotations

import sys
from typing import Any

from parallel_state.megatron import memory
from parallel_state.runtime.launch import named_launcher, read_launcher_int
from parallel_state.runtime.manager import DistributedManager, local_cuda_device


def dist_ready() -> bool:
    """Whether the default process group exists (never imports torch to find out)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _manager_value(key: str) -> Any:
    return DistributedManager._shared_state[key]


def resolve_world_size() -> int:
    """Number of processes in the job."""
    if DistributedManager.is_initialized():
        return _manager_value("_world_size")
    if dist_ready():
        return sys.modules["torch.distributed"].get_world_size()
    launcher = named_launcher()
    if launcher is not None:
        return read_launcher_int(launcher, "world_size")
    return 1


def resolve_global_rank(global_rank: int | None = None) -> int:
    """This process's global rank; an explicit ``global_rank`` (even 0) wins over every source."""
    if global_rank is not None:
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise TypeError(f"global_rank must be an int or None, got {global_rank!r}")
        if global_rank < 0:
            raise ValueError(f"global_rank must be >= 0, got {global_rank}")
        return global_rank
    if DistributedManager.is_initialized():
        return _manager_value("_rank")
    if dist_ready():
        return sys.modules["torch.distributed"].get_rank()
    launcher = named_launcher()
    if launcher is not None:
        return read_launcher_int(launcher, "rank")
    return 0


def collective_device(fallback: Any = "cpu") -> Any:
    """The device collectives run on: the CPU for gloo, the rank-local CUDA device for NCCL.

    Outside a distributed run it is the launcher's local CUDA device (or the current one) when
    CUDA is available, else ``fallback`` (nvalchemi's keyword; the CPU by default).
    """
    import torch

    if DistributedManager.is_initialized():
        return _manager_value("_collective_device")
    if dist_ready():
        import torch.distributed as dist

        if "nccl" not in str(dist.get_backend()).lower():
            return torch.device("cpu")
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
    if not torch.cuda.is_available():
        return torch.device(fallback)
    launcher = named_launcher()
    if launcher is not None:
        return local_cuda_device(read_launcher_int(launcher, "local_rank"))
    return torch.device("cuda", torch.cuda.current_device())


def _buffer_device() -> Any:
    """Where megatron-core's memory buffers go: the collective device in a distributed run, else the CPU."""
    import torch

    return collective_device() if dist_ready() else torch.device("cpu")


memory.set_device_resolver(_buffer_device)
