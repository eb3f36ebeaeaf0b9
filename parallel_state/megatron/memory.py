"""megatron-core 0.16's global memory buffers, on the device collectives use.

``GlobalMemoryBuffer`` hands out views of one reused buffer per (name, dtype), as
megatron-core's does, but allocates on the collective device (the CPU under gloo, the
rank's CUDA device under NCCL) rather than always on CUDA, so code that takes its scratch
tensors from it (megatron-core's attention, its tensor-parallel gathers) also runs on a CPU
world. megatron-core 0.16's ``GlobalSymmetricMemoryBuffer`` (NVLS inference collectives) needs CUDA
and torch's symmetric memory, and says so when they are missing; 0.17+'s ``SymmetricMemoryManager``
keeps one ``SymmetricMemoryBuffer`` per key, which records why it has no memory instead.

The module-level buffers follow megatron-core's lifecycle: ``initialize_model_parallel``
sets the memory buffer, ``destroy_model_parallel`` drops them all (and the manager's buffers).
"""

from __future__ import annotations

import math
import numbers
import warnings
from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

from parallel_state.errors import ParallelStateAssertionError, ParallelStateError, ParallelStateTypeError
from parallel_state.topology.arguments import is_int

#: Where the buffers go by default. Only the runtime layer knows the collective device (it asks the
#: DistributedManager, torch.distributed and the launcher), and this layer must not import it, so
#: ``runtime.resolve`` installs its answer here when imported, which ``import parallel_state`` does.
_device_resolver: Callable[[], Any] | None = None


def set_device_resolver(resolver: Callable[[], Any]) -> None:
    """Make ``resolver()`` the device that buffers allocate on by default (``runtime.resolve`` calls this)."""
    global _device_resolver
    _device_resolver = resolver


def _default_device() -> Any:
    """The collective device in a distributed run, else the CPU."""
    if _device_resolver is not None:
        return _device_resolver()
    import torch

    return torch.device("cpu")


def _numel(tensor_shape: Any) -> int:
    """The number of elements of ``tensor_shape``, or an error saying what a shape is."""
    # The common case (a tuple, list or torch.Size of plain ints) costs one pass.
    if isinstance(tensor_shape, (tuple, list)) and all(type(s) is int and s >= 0 for s in tensor_shape):
        return math.prod(tensor_shape)
    if isinstance(tensor_shape, (str, bytes)) or not isinstance(tensor_shape, Sequence):
        raise ParallelStateTypeError(f"tensor_shape must be a sequence of ints such as (4, 1024), got {tensor_shape!r}")
    if not all(is_int(s) for s in tensor_shape):
        raise ParallelStateTypeError(f"tensor_shape must hold ints, got {tensor_shape!r}")
    if any(int(s) < 0 for s in tensor_shape):
        raise ParallelStateError(f"tensor_shape {tuple(tensor_shape)} has a negative size")
    return math.prod(int(s) for s in tensor_shape)


class GlobalMemoryBuffer:
    """Scratch tensors that reuse one buffer per (name, dtype); the caller must not use two of one name at once.

    ``device`` fixes where buffers live; by default each allocation goes to the collective
    device of the run (the CPU outside a distributed run).
    """

    def __init__(self, *, device: Any = None) -> None:
        self.buffer: dict[tuple[str, Any], Any] = {}
        self.device = device

    def get_tensor(self, tensor_shape: Sequence[int], dtype: Any, name: str,
                   mem_alloc_context: Optional[Callable[[], Any]] = None) -> Any:
        """A ``tensor_shape`` view of the (name, dtype) buffer, grown first if it is too small.

        Its contents are whatever the buffer last held. ``mem_alloc_context``, a function
        returning a context manager, wraps any allocation (e.g. a memory pool's).
        """
        required = _numel(tensor_shape)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required:
            buffer = self._allocate(required, dtype, name, mem_alloc_context)
        return buffer[0:required].view(tensor_shape)

    def _allocate(self, numel: int, dtype: Any, name: str, mem_alloc_context: Optional[Callable[[], Any]]) -> Any:
        import torch

        if not isinstance(dtype, torch.dtype):
            raise ParallelStateTypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
        if mem_alloc_context is not None and not callable(mem_alloc_context):
            raise ParallelStateTypeError(
                f"mem_alloc_context must be a function returning a context manager, or None, got {mem_alloc_context!r}"
            )
        device = self.device if self.device is not None else _default_device()
        with (mem_alloc_context or nullcontext)():
            # Drop the old buffer first so its memory can serve the new one.
            self.buffer.pop((name, dtype), None)
            buffer = torch.empty(numel, dtype=dtype, device=device, requires_grad=False)
        self.buffer[(name, dtype)] = buffer
        return buffer


def _check_size(size_in_mb: Any) -> None:
    if isinstance(size_in_mb, bool) or not isinstance(size_in_mb, numbers.Real) or not size_in_mb > 0:
        raise ParallelStateTypeError(f"size_in_mb must be a positive number such as 256, got {size_in_mb!r}")


def _check_group(process_group: Any) -> None:
    import torch.distributed as dist

    if not isinstance(process_group, dist.ProcessGroup):
        raise ParallelStateTypeError(f"process_group must be a process group, got {process_group!r}")


class SymmetricMemoryBuffer:
    """One CUDA symmetric-memory buffer over ``process_group`` (megatron-core 0.17+'s NVLS inference collectives).

    As in megatron-core 0.17+, a missing piece is not an error: without CUDA, torch's symmetric
    memory or triton, or when the group cannot share memory (not within one NVLink domain), the
    buffer is None, ``init_failure_reason`` says why, and the ``maybe_get_*`` methods answer None,
    so callers fall back to ordinary collectives.
    """

    def __init__(self, size_in_mb: float, process_group: Any) -> None:
        _check_size(size_in_mb)
        _check_group(process_group)
        self.symm_buffer: Any = None
        self.symm_mem_hdl: Any = None
        self.init_failure_reason: Optional[str] = self._rendezvous(size_in_mb, process_group)

    def _rendezvous(self, size_in_mb: float, process_group: Any) -> Optional[str]:
        """Map the buffer on every member of the group; None when that worked, else why not."""
        import torch

        if not torch.cuda.is_available():
            return "CUDA is not available (symmetric memory lives on GPUs sharing NVLink)"
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError:
            return "torch.distributed._symmetric_memory not importable"
        try:
            import triton  # noqa: F401  (megatron-core's NVLS kernels are triton kernels)
        except ImportError:
            return "triton not installed"
        numel = int(size_in_mb * 1024 * 1024)  # bytes
        try:
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # deprecated in newer torch, where rendezvous enables the group itself
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
                    enable(process_group.group_name)
            self.symm_buffer = symm_mem.empty(numel, dtype=torch.uint8, device="cuda")
            self.symm_mem_hdl = symm_mem.rendezvous(self.symm_buffer, process_group)
        except RuntimeError as exc:
            # The group's GPUs cannot map each other's memory: callers fall back to ordinary collectives.
            self.symm_buffer = self.symm_mem_hdl = None
            return f"{type(exc).__name__}: {exc}"
        return None

    def _can_allocate(self, numel: int, dtype: Any) -> bool:
        """Whether ``numel`` elements of ``dtype`` fit in the buffer."""
        if self.symm_mem_hdl is None:
            return False
        return numel * dtype.itemsize <= self.symm_buffer.numel()

    def _allocate(self, numel: int, dtype: Any) -> Any:
        """The first ``numel`` elements of ``dtype`` of the buffer."""
        return self.symm_buffer[0:numel * dtype.itemsize].view(dtype).view(numel)

    def maybe_get_tensor(self, tensor_shape: Sequence[int], dtype: Any) -> dict[str, Any]:
        """``{"tensor": a tensor_shape view, "handle": the symmetric-memory handle}``, or both None when it does not fit."""
        numel = _numel(tensor_shape)
        if self.symm_mem_hdl is None or not self._can_allocate(numel, dtype):
            return {"tensor": None, "handle": None}
        return {"tensor": self._allocate(numel, dtype).view(*tensor_shape), "handle": self.symm_mem_hdl}

    def maybe_get_tensors(self, tensor_specs: Sequence[tuple[int, Any]], alignment: int = 16) -> dict[str, Any]:
        """Tensors packed one after another, each starting at a multiple of ``alignment`` bytes.

        ``tensor_specs`` is a list of ``(numel, dtype)``. The answer is ``{"handle": the handle,
        "tensors": [(a uint8 view of the tensor's bytes, its byte offset), ...]}``, or both None when
        there is no buffer or they do not fit.
        """
        if not is_int(alignment) or alignment < 1:
            raise ParallelStateTypeError(f"alignment must be a positive number of bytes such as 16, got {alignment!r}")
        slices, offset = [], 0
        for numel, dtype in tensor_specs:
            nbytes = int(numel) * dtype.itemsize
            slices.append((offset, nbytes))
            offset += -(-nbytes // alignment) * alignment
        if self.symm_mem_hdl is None or offset > self.symm_buffer.numel():
            return {"handle": None, "tensors": None}
        return {"handle": self.symm_mem_hdl,
                "tensors": [(self.symm_buffer[start:start + nbytes], start) for start, nbytes in slices]}


class GlobalSymmetricMemoryBuffer(SymmetricMemoryBuffer):
    """megatron-core 0.16's symmetric-memory buffer: as :class:`SymmetricMemoryBuffer`, but it raises
    when CUDA or torch's symmetric memory is missing (triton missing, or a group that cannot share
    memory, still leave the buffer None)."""

    def __init__(self, size_in_mb: float, process_group: Any) -> None:
        _check_size(size_in_mb)
        import torch

        if not torch.cuda.is_available():
            raise ParallelStateError(
                "GlobalSymmetricMemoryBuffer needs CUDA (symmetric memory lives on GPUs sharing NVLink) and this "
                "process has none; it only serves megatron-core's NVLS inference collectives, which a CPU run "
                "cannot use"
            )
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as exc:
            raise ParallelStateError(
                f"GlobalSymmetricMemoryBuffer needs torch's symmetric memory (torch.distributed._symmetric_memory), "
                f"which torch {torch.__version__} lacks; use torch >= 2.5 built with CUDA"
            ) from exc
        super().__init__(size_in_mb, process_group)


class SymmetricMemoryManager:
    """megatron-core 0.17+'s registry of symmetric-memory buffers, one per key (``"tp"``, ``"ep"``), each
    made on first access; ``destroy_model_parallel`` drops them all.

    ``SymmetricMemoryManager.get_buffer("tp", process_group=tp_group).maybe_get_tensor(shape, dtype)``
    """

    _buffers: dict[str, SymmetricMemoryBuffer] = {}
    #: The size of a buffer made without ``size_mb``; None: the release in use's default (256 MiB in
    #: megatron-core 0.17, 512 from 0.18: a ``release_table.BEHAVIOURS`` row).
    _default_size_mb: Optional[int] = None

    @classmethod
    def get_buffer(cls, key: str, process_group: Any = None, size_mb: Optional[int] = None) -> SymmetricMemoryBuffer:
        """The buffer for ``key``, made over ``process_group`` (needed on the key's first call) the first time."""
        if key not in cls._buffers:
            if process_group is None:
                raise ParallelStateAssertionError(
                    f"SymmetricMemoryManager: the first get_buffer({key!r}) needs process_group=, the group "
                    "the buffer is shared over (megatron-core passes the tensor-parallel group for 'tp')"
                )
            cls._buffers[key] = SymmetricMemoryBuffer(size_in_mb=size_mb or cls._size_mb(), process_group=process_group)
        return cls._buffers[key]

    @classmethod
    def _size_mb(cls) -> int:
        """The size of a buffer made without ``size_mb``."""
        from parallel_state.topology import releases

        return cls._default_size_mb or (512 if releases.behaves("symmetric_memory_512_mb") else 256)

    @classmethod
    def destroy(cls, key: Optional[str] = None) -> None:
        """Drop the buffer of ``key``, or every buffer when ``key`` is None."""
        if key is None:
            cls._buffers.clear()
        else:
            cls._buffers.pop(key, None)

    @classmethod
    def is_initialized(cls, key: str) -> bool:
        """Whether a buffer was made for ``key``."""
        return key in cls._buffers


_GLOBAL_MEMORY_BUFFER: Optional[GlobalMemoryBuffer] = None
_GLOBAL_SYMMETRIC_MEMORY_BUFFER: Optional[GlobalSymmetricMemoryBuffer] = None


def set_global_memory_buffer() -> None:
    """Create the global memory buffer (``initialize_model_parallel`` calls it; megatron-core's private
    ``_set_global_memory_buffer``, which code that initializes by hand calls)."""
    if _GLOBAL_MEMORY_BUFFER is not None:
        raise ParallelStateAssertionError(
            "the global memory buffer is already initialized; call destroy_model_parallel() (or "
            "destroy_global_memory_buffer()) before initializing again"
        )
    replace_buffer("_GLOBAL_MEMORY_BUFFER", GlobalMemoryBuffer())


def replace_buffer(name: str, buffer: Any) -> None:
    """Make ``buffer`` (None: none) the global buffer ``name`` (``_GLOBAL_MEMORY_BUFFER`` or
    ``_GLOBAL_SYMMETRIC_MEMORY_BUFFER``), which ``destroy_model_parallel()`` drops."""
    global _GLOBAL_MEMORY_BUFFER, _GLOBAL_SYMMETRIC_MEMORY_BUFFER
    if name == "_GLOBAL_MEMORY_BUFFER":
        _GLOBAL_MEMORY_BUFFER = buffer
    else:
        _GLOBAL_SYMMETRIC_MEMORY_BUFFER = buffer
    if buffer is not None:
        from parallel_state.groups import state as _st

        _st.register_teardown_hook(_drop_buffers)


def _drop_buffers() -> None:
    """Teardown hook: destroy_model_parallel() drops every buffer, as megatron-core's does."""
    destroy_global_memory_buffer()
    destroy_global_symmetric_memory_buffer()
    SymmetricMemoryManager.destroy()


def set_global_symmetric_memory_buffer(process_group: Any, size_in_mb: float = 256) -> None:
    """Create the global symmetric memory buffer over ``process_group`` (megatron-core uses the tensor-parallel group)."""
    if _GLOBAL_SYMMETRIC_MEMORY_BUFFER is not None:
        raise ParallelStateAssertionError(
            "the global symmetric memory buffer is already initialized; call "
            "destroy_global_symmetric_memory_buffer() first"
        )
    replace_buffer("_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
                   GlobalSymmetricMemoryBuffer(size_in_mb=size_in_mb, process_group=process_group))


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The global memory buffer."""
    if _GLOBAL_MEMORY_BUFFER is None:
        raise ParallelStateAssertionError(
            "the global memory buffer is not initialized; call initialize_model_parallel() first"
        )
    return _GLOBAL_MEMORY_BUFFER


def get_global_symmetric_memory_buffer() -> GlobalSymmetricMemoryBuffer:
    """The global symmetric memory buffer."""
    if _GLOBAL_SYMMETRIC_MEMORY_BUFFER is None:
        raise ParallelStateAssertionError(
            "the global symmetric memory buffer is not initialized; it is created for inference on CUDA "
            "(megatron-core's dynamic inference context creates it), not by initialize_model_parallel"
        )
    return _GLOBAL_SYMMETRIC_MEMORY_BUFFER


def destroy_global_memory_buffer() -> None:
    """Drop the global memory buffer (harmless when there is none)."""
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


def destroy_global_symmetric_memory_buffer() -> None:
    """Drop the global symmetric memory buffer (harmless when there is none)."""
    global _GLOBAL_SYMMETRIC_MEMORY_BUFFER
    _GLOBAL_SYMMETRIC_MEMORY_BUFFER = None
