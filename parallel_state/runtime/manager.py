"""``DistributedManager``: one process-wide view of the launch (rank, world, device), PhysicsNeMo style."""

from __future__ import annotations

import datetime
import warnings
from typing import Any, ClassVar

from parallel_state.errors import ParallelStateError, ParallelStateWarning
from parallel_state.runtime.launch import LaunchInfo, detect_launch


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_cuda_device(local_rank: int, what: str = "LOCAL_RANK") -> Any:
    """The CUDA device of ``local_rank``, or a ParallelStateError when this node has too few."""
    import torch

    count = _cuda_device_count()
    if count == 0:
        raise ParallelStateError(
            "the NCCL backend needs CUDA, but torch.cuda.is_available() is False on this machine; "
            "use the 'gloo' backend to run on the CPU"
        )
    if local_rank >= count:
        raise ParallelStateError(
            f"{what}={local_rank} but only {count} CUDA device(s) are visible on this node; start at "
            f"most {count} process(es) per node, or use the 'gloo' backend"
        )
    return torch.device("cuda", local_rank)


def check_backend_available(backend: str) -> None:
    """Fail at once, with what to do, when ``backend`` asks for NCCL on a machine without it."""
    import torch
    import torch.distributed as dist

    if "nccl" not in backend.lower():
        return
    if not torch.cuda.is_available():
        raise ParallelStateError(
            f"distributed_backend={backend!r} needs CUDA, but torch.cuda.is_available() is False on "
            f"this machine; use distributed_backend='gloo' to run on the CPU"
        )
    if not dist.is_nccl_available():
        raise ParallelStateError(
            f"distributed_backend={backend!r} needs NCCL, which this torch build lacks; "
            f"install a CUDA build of torch or use distributed_backend='gloo'"
        )


class DistributedManager:
    """The launch this process belongs to, shared by every instance (the Borg pattern).

    Call ``DistributedManager.initialize()`` once per process; it detects torchrun/env, SLURM,
    Open MPI or a single process (in that order), initializes ``torch.distributed`` for a
    multi-process launch (or adopts an already initialized one) and binds the device: the
    rank-local CUDA device for NCCL, the CPU for gloo. Every ``DistributedManager()`` then sees
    the same state; constructing one before ``initialize()`` warns with ParallelStateWarning.
    """

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __new__(cls) -> DistributedManager:
        obj = super().__new__(cls)
        # Every instance reads and writes the one class-level dict.
        obj.__dict__ = cls._shared_state
        return obj

    def __init__(self) -> None:
        if not self.is_initialized():
            warnings.warn(
                "DistributedManager() was constructed before DistributedManager.initialize(); it reports "
                "a single process on rank 0 until initialize() is called",
                ParallelStateWarning, stacklevel=2,
            )

    # --- state -----------------------------------------------------------------------------

    @classmethod
    def is_initialized(cls) -> bool:
        """Whether ``initialize()`` has run (and ``cleanup()`` has not since)."""
        return bool(cls._shared_state.get("_is_initialized", False))

    @classmethod
    def initialize(cls, backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
        """Detect the launcher and set up this process; a second call warns and changes nothing.

        ``backend`` (used only to start a multi-process launch) defaults to NCCL when CUDA and
        NCCL are available, else gloo; ``timeout`` defaults to torch's. Raises ParallelStateError
        for an incomplete launcher environment, NCCL without CUDA, or a launcher that disagrees
        with an initialized ``torch.distributed``.
        """
        if cls.is_initialized():
            warnings.warn("DistributedManager is already initialized; call cleanup() first to start over",
                          ParallelStateWarning, stacklevel=2)
            return
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise TypeError(f"backend must be a backend name such as 'nccl' or 'gloo', got {backend!r}")
        if timeout is not None and (not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0):
            raise TypeError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        import torch
        import torch.distributed as dist

        info = detect_launch()
        owns = False
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            if info.launcher != "single" and (info.rank, info.world_size) != (rank, world):
                raise ParallelStateError(
                    f"torch.distributed is initialized as rank {rank} of {world}, but the {info.launcher} "
                    f"environment says rank {info.rank} of {info.world_size}; make them agree"
                )
            # Without a launcher's word on it, the ranks are taken to share one host.
            local_rank = info.local_rank if info.launcher != "single" else rank
            backend = str(dist.get_backend())
            distributed = True
        elif info.launcher == "single":
            # No process group, so no backend: the device is wherever this process computes.
            rank, world, local_rank, distributed, backend = 0, 1, 0, False, None
        else:
            rank, world, local_rank, distributed = info.rank, info.world_size, info.local_rank, True
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
            check_backend_available(backend)

        if backend is not None and "nccl" in backend.lower():
            device = local_cuda_device(local_rank)
        elif backend is not None:
            device = torch.device("cpu")
        else:  # a single process computes where it can
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")

        if distributed and not dist.is_initialized():
            kwargs: dict[str, Any] = {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            if device.type == "cuda":
                torch.cuda.set_device(device)
                kwargs["device_id"] = device  # gloo takes no device_id
            dist.init_process_group(backend, init_method=info.init_method, rank=rank, world_size=world, **kwargs)
            owns = True
        cls._shared_state.update(
            _rank=rank, _world_size=world, _local_rank=local_rank, _device=device,
            _distributed=distributed, _backend=backend, _launch=info, _owns_process_group=owns,
            _is_initialized=True,
        )

    @classmethod
    def cleanup(cls) -> None:
        """Forget the launch; if ``initialize()`` started torch.distributed, tear it down first.

        The model-parallel groups go too (they live on the default group); a process group
        that was already initialized when ``initialize()`` ran is left to its owner.
        """
        state = cls._shared_state
        try:
            if state.get("_owns_process_group"):
                import torch.distributed as dist

                if dist.is_initialized():
                    # The state's teardown (what destroy_model_parallel runs): the manager sits
                    # below initialize, which reaches it through the memory buffer's device.
                    from parallel_state.groups.state import teardown

                    teardown()
                    try:
                        if state["_device"].type == "cuda":
                            dist.barrier(device_ids=[state["_device"].index])
                        else:
                            dist.barrier()
                    finally:
                        dist.destroy_process_group()
        finally:
            state.clear()

    # --- properties --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.__dict__.get("_rank", 0)

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.__dict__.get("_world_size", 1)

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.__dict__.get("_local_rank", 0)

    @property
    def device(self) -> Any:
        """The device collectives use: the rank-local CUDA device for NCCL, the CPU for gloo."""
        device = self.__dict__.get("_device")
        if device is None:
            import torch

            device = torch.device("cpu")
        return device

    @property
    def distributed(self) -> bool:
        """Whether this process is part of a torch.distributed job."""
        return self.__dict__.get("_distributed", False)

    @property
    def cuda(self) -> bool:
        """Whether ``device`` is a CUDA device."""
        return self.device.type == "cuda"

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend, or None for a single process."""
        return self.__dict__.get("_backend")

    @property
    def launch(self) -> LaunchInfo:
        """What the launcher's environment said."""
        return self.__dict__.get("_launch") or LaunchInfo("single", 0, 1, 0)

    def __repr__(self) -> str:
        return (f"DistributedManager(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"device={self.device}, distributed={self.distributed}, launcher={self.launch.launcher!r})")
