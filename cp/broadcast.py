"""Broadcasts that work whatever the receivers start with.

A header (kind, dtype, device type, shape) goes first, from the source, and every rank acts on
it, so receivers may hold None, a placeholder of another shape or dtype, or any non-tensor, and
all ranks still meet in the same collectives. What the source got wrong (no tensor where one is
needed, too many dims) is raised on every rank instead of leaving the others waiting.

Devices: the header travels on the group's metadata device (CPU for gloo, the current CUDA device
for NCCL; chosen from the group alone, so it is the same on every rank). The data travels on the
source tensor's device when the group's backend supports it (moved there otherwise), and receivers
get it on their own device of that type (the current CUDA device for CUDA).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from cp import debug, meta
from cp.comm import as_bytes, check_group, global_ranks, local_device, meta_device, transport_device
from cp.shard import check_divisible, check_uneven, normalize_dim, pad_rows, uneven_sizes


def _check_src(what: str, src: Any, ranks: list[int]) -> None:
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f"{what}: src must be an int global rank, got {type(src).__name__} {src!r}")
    if src not in ranks:
        raise ValueError(f"{what}: src={src} is not a member of the group (its global ranks are {ranks}); "
                         f"pass the global rank of a member")


def _share_header(what: str, item: Any, src: int, group: Any, *, objects: bool) -> tuple[meta.Meta, Any]:
    """Broadcast the source's header; return it and, on the source, the tensor as it will travel."""
    is_src = dist.get_rank() == src
    device = meta_device(group)
    moved = item
    if is_src:
        if isinstance(item, torch.Tensor):
            target = transport_device(group, item)
            if item.device != target:  # e.g. a CPU tensor on an NCCL group
                moved = item.to(target)
        header = meta.header_tensor(moved, device, objects=objects)
    else:
        header = torch.empty(meta.HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    m = meta.decode(header.tolist())
    _raise_for_source(what, m, src, item if is_src else None, is_src)
    return m, moved


def _raise_for_source(what: str, m: meta.Meta, src: int, item: Any, is_src: bool) -> None:
    """Raise, on every rank alike, what the source's header says went wrong there."""
    got = f" (it passed {type(item).__name__})" if is_src else ""
    if m.kind == meta.ERR_NOT_TENSOR:
        raise TypeError(f"{what}: the source, global rank {src}, passed no tensor{got}; pass a torch.Tensor "
                        f"on the source rank (the receiving ranks may pass None)")
    if m.kind == meta.ERR_NDIM:
        raise ValueError(f"{what}: the source, global rank {src}, passed a tensor with {m.ndim} dimensions; "
                         f"at most {meta.MAX_NDIM} are supported: reshape it first")
    if m.kind == meta.ERR_DTYPE:
        desc = f" ({item.dtype} on {item.device.type})" if is_src else ""
        raise TypeError(f"{what}: the source, global rank {src}, passed a tensor of a dtype or device "
                        f"that cannot be broadcast{desc}; convert it to a standard dtype on CPU or CUDA")


def _send_tensor(m: meta.Meta, tensor: Any, src: int, group: Any) -> torch.Tensor:
    """The data broadcast: the source's tensor (contiguous for the wire), a fresh one elsewhere."""
    if dist.get_rank() == src:
        if tensor.numel():
            dist.broadcast(as_bytes(tensor.contiguous()), src, group=group)
        return tensor
    out = torch.empty(m.shape, dtype=m.dtype, device=local_device(m.device_type))
    if out.numel():
        dist.broadcast(as_bytes(out), src, group=group)
    return out


def robust_broadcast(tensor: torch.Tensor | None, src: int, pg: Any, is_check_shape: bool = False) -> torch.Tensor:
    """Broadcast ``tensor`` from global rank ``src`` over group ``pg``; shape and dtype travel first.

    Receivers may start with a tensor of another shape or dtype, None, or any non-tensor; each gets a
    new tensor with the source's shape and dtype. The source gets its own tensor back (moved to a
    device the group can carry, if it was not on one). ``pg=None`` returns ``tensor`` itself. With
    ``is_check_shape`` a receiver's tensor must have the source's shape and dtype (None passes):
    otherwise every rank raises ValueError naming the ranks that differ, before any data moves.
    """
    group = pg  # WorldFoundry's parameter name
    if group is None:
        return tensor
    what = "robust_broadcast"
    check_group(group, what, "pg (the process group)")
    _check_src(what, src, global_ranks(group))
    if group.size() == 1:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: the source, global rank {src}, passed no tensor (it passed "
                            f"{type(tensor).__name__}); pass a torch.Tensor on the source rank")
        return tensor
    if is_check_shape:
        debug.check_matches_source(f"{what}(is_check_shape=True)", tensor, global_ranks(group).index(src), group)
    m, moved = _share_header(what, tensor, src, group, objects=False)
    if m.kind == meta.NONE:
        raise TypeError(f"{what}: the source, global rank {src}, passed None; pass a torch.Tensor on the "
                        f"source rank (use cp.broadcast to broadcast None or other objects)")
    return _send_tensor(m, moved, src, group)


def broadcast(item: Any, process_group: Any = None) -> Any:
    """Broadcast ``item`` from the group's lowest global rank; every rank returns the source's item.

    A tensor goes through the tensor path (as robust_broadcast); None comes back as None everywhere;
    any other object goes through torch's pickle-based object broadcast, which is slow: use it for
    small metadata (strings, dicts, lists), never for activations. ``process_group=None`` returns
    ``item`` itself.
    """
    if process_group is None:
        return item
    what = "broadcast"
    check_group(process_group, what, "process_group")
    if process_group.size() == 1:
        return item
    src = min(global_ranks(process_group))
    m, moved = _share_header(what, item, src, process_group, objects=True)
    if m.kind == meta.NONE:
        return None
    if m.kind == meta.OBJECT:
        box = [item if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src, group=process_group)
        return box[0]
    return _send_tensor(m, moved, src, process_group)


def broadcast_split_tensor(tensor: torch.Tensor | None, seq_dim: int, process_group: Any = None, *,
                           uneven: bool = False) -> torch.Tensor | None:
    """Broadcast ``tensor`` from the group's lowest global rank, then return this rank's shard of it.

    Equivalent to ``split_inputs_cp(broadcast(tensor, g), seq_dim, g, uneven=uneven)``, but each rank
    receives only its own shard (a scatter), so the wire carries 1/n of what a broadcast would. Receivers
    may pass None or a placeholder. When the source passes None every rank gets None. ``uneven``: shard
    i holds ``shard_sizes(length, n)[i]`` elements (the scatter pads the shorter shards by one row).
    ``process_group=None`` returns ``tensor`` itself. With PARALLEL_STATE_DEBUG=1 a rank whose tensor's
    shape or dtype differs from the source's raises on every rank first.
    """
    if process_group is None:
        return tensor
    what = "broadcast_split_tensor"
    check_group(process_group, what, "process_group")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"{what}: seq_dim must be an int, got {type(seq_dim).__name__} {seq_dim!r}")
    check_uneven(what, uneven)
    n = process_group.size()
    ranks = global_ranks(process_group)
    src = min(ranks)
    if n == 1:
        if tensor is None:
            return None
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: the source, global rank {src}, passed no tensor (it passed "
                            f"{type(tensor).__name__}); pass a torch.Tensor or None")
        _split_sizes(what, tuple(tensor.shape), seq_dim, n, uneven)
        return tensor
    if debug.enabled():
        debug.check_matches_source(what, tensor, ranks.index(src), process_group)
    m, moved = _share_header(what, tensor, src, process_group, objects=False)
    if m.kind == meta.NONE:
        return None
    # Every rank validates the source's shape, so a bad one raises everywhere and nothing waits.
    dim, sizes = _split_sizes(what, m.shape, seq_dim, n, uneven)
    rank = process_group.rank()
    out = torch.empty(m.shape[:dim] + (sizes[rank],) + m.shape[dim + 1:], dtype=m.dtype,
                      device=local_device(m.device_type))
    if out.numel() == 0:
        return out
    pieces = _scatter_pieces(moved, dim, sizes) if dist.get_rank() == src else None
    _scatter_into(out, dim, pieces, sizes, rank, src, process_group)
    return out


def _split_sizes(what: str, shape: tuple[int, ...], seq_dim: int, n: int, uneven: bool) -> tuple[int, tuple[int, ...]]:
    """``seq_dim`` normalized for ``shape`` and the n shard sizes along it; the split's errors when it has none."""
    dim = normalize_dim(what, shape, seq_dim, n)
    if uneven:
        return dim, uneven_sizes(what, shape, seq_dim, dim, n)
    check_divisible(what, shape, seq_dim, dim, n)
    return dim, (shape[dim] // n,) * n


def _scatter_pieces(tensor: torch.Tensor, dim: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The source's n shards of ``tensor`` along ``dim`` as the scatter sends them: as bytes, each padded to the
    longest shard (one unread row per leading index) when the sizes differ."""
    big = max(sizes)
    pre, row = math.prod(tensor.shape[:dim]), math.prod(tensor.shape[dim + 1:])
    pieces, start = [], 0
    for size in sizes:
        piece = tensor.narrow(dim, start, size)
        start += size
        # Views when the shards are contiguous already (seq_dim leading), else one copy in all.
        pieces.append(as_bytes(piece.contiguous() if size == big else pad_rows(piece.reshape(pre, size, row), big)))
    return pieces


def _scatter_into(out: torch.Tensor, dim: int, pieces: list[torch.Tensor] | None, sizes: tuple[int, ...],
                  rank: int, src: int, group: Any) -> None:
    """The scatter: this rank's shard into ``out``, received padded to the longest shard where it is shorter."""
    big = max(sizes)
    if sizes[rank] == big:
        dist.scatter(as_bytes(out), pieces, src=src, group=group)
        return
    pre, row = math.prod(out.shape[:dim]), math.prod(out.shape[dim + 1:])
    recv = torch.empty(pre, big, row, dtype=out.dtype, device=out.device)
    dist.scatter(as_bytes(recv), pieces, src=src, group=group)
    out.view(pre, sizes[rank], row).copy_(recv[:, :sizes[rank]])
