"""Split a tensor into this rank's sequence shard, and gather shards back into the whole sequence.

Shard i of a sequence is the i-th contiguous block along ``seq_dim`` and belongs to the rank whose
index in the group is i. ``cat_outputs_cp(split_inputs_cp(x, d, g), d, g)`` equals ``x`` bit for bit.

How the gather stays cheap: view the result as ``[pre, n, shard]`` (``pre`` = product of the dims
before ``seq_dim``). The n shards land in n contiguous slots; when ``pre == 1`` (``seq_dim`` is the
leading non-trivial dim) those slots are the result itself and only the transfer writes it, else
one strided copy puts them in place. With gloo and results of 128 KiB or more, each slot is filled
by its owner's broadcast straight into the slot (gloo's all-gather receives into a fresh flat buffer
and copies out of it), and this rank's own slot is copied while the others are in flight. Otherwise
(NCCL, or small tensors where n round trips cost more than copies) one all-gather fills one buffer.
On CPU the receive buffer is reused across calls; the result is always a new tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from cp import debug
from cp.comm import all_gather_into, as_bytes, backend_for, check_group, global_ranks
from cp.workspace import discard, workspace


def shard_sizes(length: int, n: int) -> tuple[int, ...]:
    """Each rank's shard length when ``length`` elements split into ``n`` contiguous shards.

    Follows ``torch.tensor_split``: the first ``length % n`` shards hold one element more than
    the rest, so the sizes sum to ``length`` and differ by at most one.
    """
    for name, value in (("length", length), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"shard_sizes: {name} must be an int, got {type(value).__name__} {value!r}")
    if n < 1:
        raise ValueError(f"shard_sizes: n={n} must be at least 1 (the number of ranks in the group)")
    if length < n:
        raise ValueError(
            f"shard_sizes: cannot split {length} elements into {n} shards of at least one element each; "
            f"use a group of at most {length} ranks or a longer sequence"
        )
    base, extra = divmod(length, n)
    return tuple(base + 1 if i < extra else base for i in range(n))


def check_tensor(what: str, x: Any, name: str = "x") -> None:
    """Raise TypeError unless ``x`` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")


def normalize_dim(what: str, shape: tuple[int, ...], seq_dim: Any, group_size: int,
                  name: str = "seq_dim") -> int:
    """``seq_dim`` as a non-negative dimension of ``shape``; ValueError/TypeError when it is not one.

    ``name`` is the argument's name in the messages.
    """
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"{what}: {name} must be an int, got {type(seq_dim).__name__} {seq_dim!r}")
    ndim = len(shape)
    if not -ndim <= seq_dim < ndim:
        kind = {"seq_dim": "sequence", "head_dim": "head"}.get(name, name)
        valid = f"{-ndim}..{ndim - 1}" if ndim else f"none: a 0-dim tensor has no {kind} dimension"
        raise ValueError(
            f"{what}: {name}={seq_dim} is out of range for shape {tuple(shape)} with a group of size "
            f"{group_size} (valid dims: {valid})"
        )
    return seq_dim % ndim


def check_divisible(what: str, shape: tuple[int, ...], seq_dim: int, dim: int, group_size: int) -> None:
    """ValueError unless ``shape[dim]`` splits into ``group_size`` equal shards."""
    if shape[dim] % group_size:
        raise ValueError(
            f"{what}: cannot split shape {tuple(shape)} along seq_dim={seq_dim} (size {shape[dim]}) into "
            f"{group_size} equal shards for a group of size {group_size}: pad dim {dim} to a multiple of "
            f"{group_size} or use a group whose size divides {shape[dim]}"
        )


def split_inputs_cp(x: torch.Tensor, seq_dim: int, cp_group: Any = None) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along ``seq_dim`` (shard i for the group's rank i).

    ``cp_group=None`` (or a group of one) returns ``x`` itself. The shard is copied at most once: when
    it is already contiguous in memory (``seq_dim`` leading, or all dims before it of size 1) it is a
    view that shares ``x``'s memory, as ``x`` itself does when CP is off; clone it before writing to it
    in place if ``x`` must stay untouched.
    """
    if cp_group is None:
        return x
    what = "split_inputs_cp"
    check_tensor(what, x)
    check_group(cp_group, what)
    n = cp_group.size()
    dim = normalize_dim(what, x.shape, seq_dim, n)
    check_divisible(what, x.shape, seq_dim, dim, n)
    if n == 1:
        return x
    length = x.shape[dim] // n
    return x.narrow(dim, cp_group.rank() * length, length).contiguous()


def _gather_dim(what: str, x: torch.Tensor, seq_dim: int, cp_group: Any) -> int | None:
    """Check a gather's arguments; the normalized dim, or None when there is nothing to gather."""
    if cp_group is None:
        return None
    check_tensor(what, x)
    check_group(cp_group, what)
    n = cp_group.size()
    dim = normalize_dim(what, x.shape, seq_dim, n)
    if n == 1:
        return None
    if debug.enabled():
        debug.check_same(what, x, cp_group)
    return dim


def cat_outputs_cp(x: torch.Tensor, seq_dim: int, cp_group: Any = None) -> torch.Tensor:
    """Gather every rank's equal-shaped ``x`` and concatenate them in group-rank order along ``seq_dim``.

    ``cp_group=None`` (or a group of one) returns ``x`` itself. Otherwise the result is a new tensor the
    caller owns, outside the autograd graph (see cat_outputs_cp_with_grad). With PARALLEL_STATE_DEBUG=1
    every rank first checks that all shards have the same shape, dtype and device.
    """
    dim = _gather_dim("cat_outputs_cp", x, seq_dim, cp_group)
    if dim is None:
        return x
    with torch.no_grad():
        return _gather_cat(x, dim, cp_group, cp_group.size())


class _GatherKeepLocalGrad(torch.autograd.Function):
    """The gather, with the local shard's slice of the result wired back to ``x`` for autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, n: int) -> torch.Tensor:
        ctx.dim, ctx.length, ctx.start = dim, x.shape[dim], group.rank() * x.shape[dim]
        return _gather_cat(x, dim, group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Only the local slice's gradient comes back: the other slices belong to other ranks' graphs.
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None


def cat_outputs_cp_with_grad(x: torch.Tensor, seq_dim: int, cp_group: Any = None) -> torch.Tensor:
    """cat_outputs_cp whose local slice stays ``x`` in the autograd graph.

    The gradient of the result's slice that came from this rank flows back into ``x``; the slices
    gathered from other ranks are constants here (their gradients are not sent back to their owners).
    """
    dim = _gather_dim("cat_outputs_cp_with_grad", x, seq_dim, cp_group)
    if dim is None:
        return x
    return _GatherKeepLocalGrad.apply(x, dim, cp_group, cp_group.size())


#: Below this many bytes of result, gloo gathers with one all-gather: n broadcasts cost n round trips,
#: which small tensors feel more than gloo's extra copies (measured crossover on 2 ranks: 64-256 KiB).
GLOO_BROADCAST_MIN_BYTES = 128 * 1024
STRATEGIES = ("broadcasts", "all_gather")


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Scratch bytes for receiving: the reused workspace on CPU, a fresh (cached-allocator) block elsewhere."""
    if device.type == "cpu":
        return workspace(nbytes, device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _gather_cat(x: torch.Tensor, dim: int, group: Any, n: int, strategy: str | None = None) -> torch.Tensor:
    """The gather itself; call without autograd recording.

    ``strategy`` (one of STRATEGIES) overrides the choice by backend and size, for tests.
    """
    shape = tuple(x.shape)
    out = torch.empty(shape[:dim] + (n * shape[dim],) + shape[dim + 1:], dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x = x.contiguous()
    pre = math.prod(shape[:dim])
    shard = x.numel() // pre
    out_slots = out.view(pre, n, shard)  # [:, i] is rank i's shard in place
    if strategy is None:
        big = out.numel() * out.element_size() >= GLOO_BROADCAST_MIN_BYTES
        strategy = "broadcasts" if big and backend_for(group, x.device.type) == "gloo" else "all_gather"
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown gather strategy {strategy!r}; expected one of {STRATEGIES}")
    try:
        if strategy == "broadcasts":
            _gather_by_broadcasts(x, out_slots, pre, shard, group, n, group.rank())
            return out
        # One all-gather into n contiguous slots: the result itself when pre == 1, else a scratch buffer.
        slots = out_slots[0] if pre == 1 else _buffer(out.numel() * out.element_size(), x.device).view(
            x.dtype).view(n, pre * shard)
        all_gather_into(as_bytes(slots), as_bytes(x), group)
    except BaseException:
        # A failed or interrupted collective may still write into the buffer later: never reuse it.
        discard(x.device)
        raise
    if pre != 1:
        out_slots.copy_(slots.view(n, pre, shard).transpose(0, 1))
    return out


def _gather_by_broadcasts(x: torch.Tensor, out_slots: torch.Tensor, pre: int, shard: int, group: Any, n: int,
                          rank: int) -> None:
    """Fill ``out_slots`` ([pre, n, shard]) with one async broadcast per rank, each into its own slot."""
    if pre == 1:
        recv = {i: out_slots[0, i] for i in range(n) if i != rank}  # contiguous: receive in place
    else:
        slots = _buffer((n - 1) * x.numel() * x.element_size(), x.device).view(x.dtype).view(n - 1, pre * shard)
        recv = {i: slots[i - (i > rank)] for i in range(n) if i != rank}
    ranks = global_ranks(group)
    # Same order on every rank, so the k-th broadcast of each rank is the same collective.
    works = [dist.broadcast(as_bytes(x if i == rank else recv[i]), ranks[i], group=group, async_op=True)
             for i in range(n)]
    out_slots[:, rank].copy_(x.view(pre, shard))  # overlaps with the transfers in flight
    for i, work in enumerate(works):
        work.wait()
        if pre != 1 and i != rank:
            out_slots[:, i].copy_(recv[i].view(pre, shard))
