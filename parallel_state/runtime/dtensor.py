"""DTensor helpers for models sharded over ``parallel_state``'s device meshes (``mesh.fsdp_mesh``, ``mesh.device_mesh``).

WorldFoundry's ``collectives/device_mesh`` EMA and state-broadcast API (names and parameters read
from OpenEnvision/WorldFoundry ``worldfoundry/core/distributed/collectives/device_mesh.py``;
written here): the EMA update, copy, cache and restore work on each rank's local shard of every
DTensor parameter, so no parameter is ever gathered; plain tensors are used as they are.
Differences: models whose parameter lists differ in length or shape are an error (never a
silent partial update), and nothing here needs CUDA (gloo meshes broadcast CPU tensors directly).
"""

from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


def get_local_tensor_if_dtensor(tensor: Any) -> Any:
    """This rank's local shard of a DTensor (a view: writing to it writes the DTensor); any other value as it is."""
    # No DTensor can exist unless torch.distributed.tensor was imported: never import it here.
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(tensor, module.DTensor):
        return tensor.to_local()
    return tensor


get_local_tensor_if_DTensor = get_local_tensor_if_dtensor


def _local_pairs(what: str, src: Iterable[Any], tgt: Iterable[Any]) -> list[tuple[Any, Any]]:
    """(local target, local source) per parameter; an error unless both lists match in length and local shapes."""
    tgt_params, src_params = list(tgt), list(src)
    if len(tgt_params) != len(src_params):
        raise ValueError(f"{what}: the source model has {len(src_params)} parameters and the target "
                         f"{len(tgt_params)}; pass two models of the same architecture")
    pairs = []
    for i, (t, s) in enumerate(zip(tgt_params, src_params, strict=True)):
        lt, ls = get_local_tensor_if_dtensor(t), get_local_tensor_if_dtensor(s)
        if lt.shape != ls.shape:
            raise ValueError(f"{what}: parameter {i} has local shape {tuple(ls.shape)} in the source and "
                             f"{tuple(lt.shape)} in the target; shard both models the same way")
        pairs.append((lt, ls))
    return pairs


class DTensorFastEmaModelUpdater:
    """An exponential moving average of a model's weights, computed shard by shard with foreach kernels."""

    def __init__(self) -> None:
        """Nothing cached yet: ``cache`` must come before ``restore``."""
        self.is_cached = False
        self.collected_params: list[Any] = []

    def copy_to(self, src_model: torch.nn.Module, tgt_model: torch.nn.Module) -> None:
        """Copy every local shard of ``src_model``'s parameters into ``tgt_model``'s (no communication)."""
        import torch

        with torch.no_grad():
            for lt, ls in _local_pairs("copy_to", src_model.parameters(), tgt_model.parameters()):
                lt.copy_(ls)

    def update_average(self, src_model: torch.nn.Module, tgt_model: torch.nn.Module, beta: float = 0.9999) -> None:
        """In place on every local shard: ``tgt = beta * tgt + (1 - beta) * src``; the target must be float32.

        A lower-precision target would lose the ``1 - beta`` term to rounding, so it is refused.
        """
        import torch

        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"update_average: beta must be a number in [0, 1], got {beta!r}")
        with torch.no_grad():  # the local views are taken and written without autograd
            pairs = _local_pairs("update_average", src_model.parameters(), tgt_model.parameters())
            for i, (lt, _) in enumerate(pairs):
                if lt.dtype != torch.float32:
                    raise TypeError(f"update_average: the EMA model must be float32, but its parameter {i} is "
                                    f"{lt.dtype}; keep the EMA copy in float32 (tgt_model.float())")
            if not pairs:
                return
            targets = [lt for lt, _ in pairs]
            torch._foreach_mul_(targets, beta)
            torch._foreach_add_(targets, [ls.to(lt.dtype) for lt, ls in pairs], alpha=1.0 - beta)

    def cache(self, parameters: Any, is_cpu: bool = False) -> None:
        """Keep a copy of every local shard of ``parameters`` (on the CPU with ``is_cpu``, else where each lives).

        Caching twice without ``restore`` is an error, so a restore never brings back the wrong weights.
        """
        import torch

        if self.is_cached:
            raise RuntimeError("DTensorFastEmaModelUpdater.cache: a cache is already held; restore() it first")
        with torch.no_grad():
            local = [get_local_tensor_if_dtensor(p) for p in parameters]
            self.collected_params = [t.detach().to("cpu", copy=True) if is_cpu else t.detach().clone() for t in local]
        self.is_cached = True

    def restore(self, parameters: Any) -> None:
        """Write the cached shards back into ``parameters`` (the same parameters, in the same order) and drop the cache."""
        import torch

        if not self.is_cached:
            raise RuntimeError("DTensorFastEmaModelUpdater.restore: nothing is cached; call cache(parameters) first")
        with torch.no_grad():
            local = [get_local_tensor_if_dtensor(p) for p in parameters]
            if len(local) != len(self.collected_params) or any(
                    t.shape != c.shape for t, c in zip(local, self.collected_params, strict=False)):
                raise ValueError(
                    f"DTensorFastEmaModelUpdater.restore: got {len(local)} parameters, but the cache holds "
                    f"{len(self.collected_params)} of other shapes; restore the parameters that were cached"
                )
            for t, c in zip(local, self.collected_params, strict=True):
                t.copy_(c)
        self.collected_params = []
        self.is_cached = False


FastEmaModelUpdater = DTensorFastEmaModelUpdater


def broadcast_dtensor_model_states(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Copy the first replica's parameters and buffers (local shards) to every rank of ``mesh``'s "replicate" dimension.

    ``mesh`` is a mesh with a "replicate" dimension, such as ``parallel_state.fsdp_mesh(...)``;
    a replicate dimension of size 1 does nothing. Works on gloo with CPU tensors; on NCCL,
    CPU-resident tensors travel through the rank's current CUDA device.
    """
    import torch
    import torch.distributed as dist

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "replicate" not in names:
        raise ValueError(f"broadcast_dtensor_model_states: the mesh has dimensions {names}, not 'replicate'; pass a "
                         f"mesh with a replicate dimension, such as parallel_state.fsdp_mesh(shard_size)")
    group = mesh.get_group("replicate")
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    nccl_only = str(dist.get_backend(group)).lower() == "nccl"
    with torch.no_grad():
        for _, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            local = get_local_tensor_if_dtensor(tensor).detach()
            wire = local
            if nccl_only and local.device.type != "cuda":
                wire = local.to(torch.device("cuda", torch.cuda.current_device()))
            elif not local.is_contiguous():
                wire = local.contiguous()
            dist.broadcast(wire, src=ranks[0], group=group)
            if wire is not local:
                local.copy_(wire)
