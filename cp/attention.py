"""Context-parallel attention by all-to-all ("Ulysses"): trade the sequence shard for a head shard and back.

Each rank holds a sequence shard with every head. One all-to-all gives each rank the whole sequence
for 1/n of the heads (head block i to group rank i); attention runs there unchanged, because heads
are independent of each other; a second all-to-all turns the output back into sequence shards.
Per tensor, a rank sends and receives (n - 1)/n of its shard, where gathering K and V would receive
(n - 1) whole shards of each.

The exchange is ``dist.all_to_all_single`` on every backend: gloo has implemented it (for CPU and,
through host copies, CUDA tensors) since long before torch 2.4, the oldest torch this package supports.
Its backward is the inverse exchange, so gradients reach every rank's q, k and v.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from cp import debug
from cp.comm import check_group
from cp.shard import check_tensor, normalize_dim

AttnFn = Callable[..., torch.Tensor]


def _exchange(parts: Sequence[torch.Tensor], scatter_dim: Sequence[int], gather_dim: Sequence[int],
              group: Any) -> list[torch.Tensor]:
    """One all-to-all for all of ``parts``: block j of part p along ``scatter_dim[p]`` goes to group rank j,
    and the block received from group rank i becomes block i along ``gather_dim[p]``.

    The parts share dtype and device; each is packed into its own columns of one [n, total] buffer, so
    tensors of different shapes still travel in a single collective.
    """
    n = group.size()
    blocks = []
    for x, s in zip(parts, scatter_dim, strict=True):
        shape = tuple(x.shape)
        # [..., n, L/n, ...] with the block index moved first: a view, copied once into the send buffer.
        blocks.append(x.reshape(shape[:s] + (n, shape[s] // n) + shape[s + 1:]).movedim(s, 0))
    sizes = [b[0].numel() for b in blocks]
    send = torch.empty(n, sum(sizes), dtype=parts[0].dtype, device=parts[0].device)
    offset = 0
    for b, size in zip(blocks, sizes, strict=True):
        send[:, offset:offset + size].view(b.shape).copy_(b)
        offset += size
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out, offset = [], 0
    for b, size, g in zip(blocks, sizes, gather_dim, strict=True):
        block = tuple(b.shape[1:])
        got = recv[:, offset:offset + size].view(b.shape).movedim(0, g)  # [..., n, block[g], ...]
        out.append(got.reshape(block[:g] + (n * block[g],) + block[g + 1:]))
        offset += size
    return out


class _AllToAll(torch.autograd.Function):
    """``_exchange`` with autograd: the gradient goes back through the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, scatter_dim: tuple[int, ...], gather_dim: tuple[int, ...], group: Any,
                *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return tuple(_exchange(parts, scatter_dim, gather_dim, group))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        # Missing gradients arrive as zeros (materialized), so every rank still joins the collective.
        return (None, None, None, *_exchange(grads, gather_dim, scatter_dim, ctx.group))


def _check_dims(what: str, x: Any, name: str, seq_dim: Any, head_dim: Any, n: int) -> tuple[int, int]:
    """Type- and range-check one tensor's dims; the normalized (seq_dim, head_dim)."""
    check_tensor(what, x, name)
    label = what if name == "x" else f"{what}, {name}"
    s = normalize_dim(label, x.shape, seq_dim, n, "seq_dim")
    h = normalize_dim(label, x.shape, head_dim, n, "head_dim")
    if s == h:
        raise ValueError(f"{what}: seq_dim={seq_dim} and head_dim={head_dim} both name dim {s} of {name}'s shape "
                         f"{tuple(x.shape)}; pass the sequence dimension and the head dimension, which must differ")
    return s, h


def _check_split(what: str, x: torch.Tensor, name: str, dim: int, arg: str, value: int, n: int, kind: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: {name} has shape {tuple(x.shape)}: its {kind} ({arg}={value}, size {x.shape[dim]}) cannot be "
            f"split into {n} equal blocks for a group of size {n}; use a {kind} size divisible by {n} or a "
            f"context-parallel group whose size divides {x.shape[dim]}"
        )


def _move(what: str, x: Any, seq_dim: Any, head_dim: Any, cp_group: Any, to_heads: bool) -> torch.Tensor:
    if cp_group is None:
        return x
    check_tensor(what, x)
    check_group(cp_group, what)
    n = cp_group.size()
    s, h = _check_dims(what, x, "x", seq_dim, head_dim, n)
    if to_heads:
        _check_split(what, x, "x", h, "head_dim", head_dim, n, "number of heads")
    else:
        _check_split(what, x, "x", s, "seq_dim", seq_dim, n, "sequence length")
    if n == 1:
        return x
    if debug.enabled():
        debug.check_same(what, x, cp_group)
    scatter, gather = (h, s) if to_heads else (s, h)
    return _AllToAll.apply((scatter,), (gather,), cp_group, x)[0]


def seq_to_heads(x: torch.Tensor, seq_dim: int, head_dim: int, cp_group: Any = None) -> torch.Tensor:
    """This rank's sequence shard with all heads -> the whole sequence with this rank's heads only.

    The sequence is the shards in group-rank order; group rank i keeps head block i. Differentiable:
    the gradient goes back through heads_to_seq. ``cp_group=None`` returns ``x`` itself, a group of
    one ``x`` after the checks. With PARALLEL_STATE_DEBUG=1 every rank first checks the shards agree.
    """
    return _move("seq_to_heads", x, seq_dim, head_dim, cp_group, to_heads=True)


def heads_to_seq(x: torch.Tensor, seq_dim: int, head_dim: int, cp_group: Any = None) -> torch.Tensor:
    """The inverse of seq_to_heads: the whole sequence with this rank's heads -> this rank's sequence shard
    with all heads (head blocks in group-rank order).
    """
    return _move("heads_to_seq", x, seq_dim, head_dim, cp_group, to_heads=False)


def sdpa_in_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_dim: int = 1, head_dim: int = 2,
                   **attn_kwargs: Any) -> torch.Tensor:
    """torch's scaled_dot_product_attention on tensors laid out with the given sequence and head dims.

    SDPA wants [..., H, S, D]: the two dims move there (the remaining last dim is the feature dim, the
    others are batch), attention runs, and the output moves back to q's layout.
    """
    dims = (head_dim % q.dim(), seq_dim % q.dim())
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.movedim(dims, (-3, -2)) for t in (q, k, v)), **attn_kwargs)
    return out.movedim((-3, -2), dims)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any = None, *,
                      attn_fn: AttnFn | None = None, seq_dim: int = 1, head_dim: int = 2,
                      **attn_kwargs: Any) -> torch.Tensor:
    """Attention over the whole sequence for sequence-sharded q, k and v (default layout [B, S, H, D]).

    q, k and v move to head shards in one all-to-all; ``attn_fn(q, k, v, **attn_kwargs)`` (default:
    scaled_dot_product_attention in this layout) sees the whole sequence with this rank's heads, in the
    same layout, and must return q's layout; one more all-to-all returns this rank's sequence shard of
    the output, with all heads. ``cp_group=None`` or a group of one is plain attention. Differentiable
    in q, k and v. The number of heads of each must be divisible by the group size.
    """
    what = "ulysses_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(what, t, name)
    if cp_group is not None:
        check_group(cp_group, what)
    n = 1 if cp_group is None else cp_group.size()
    dims = [_check_dims(what, t, name, seq_dim, head_dim, n) for name, t in (("q", q), ("k", k), ("v", v))]
    if len({t.dim() for t in (q, k, v)}) != 1 or len({(t.dtype, t.device) for t in (q, k, v)}) != 1:
        raise ValueError(
            f"{what}: q, k and v must have the same number of dims, dtype and device (they travel in one buffer); "
            f"got " + ", ".join(f"{nm} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"
                                 for nm, t in (("q", q), ("k", k), ("v", v))) + "; convert them to one dtype and device")
    s, h = dims[0]
    if attn_fn is None:
        if q.dim() < 3:
            raise ValueError(f"{what}: the default attention needs at least 3 dims (sequence, heads, features); q "
                             f"has shape {tuple(q.shape)}: add a feature dim or pass attn_fn")
        attn_fn = _default_attn(s, h)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_split(what, t, name, h, "head_dim", head_dim, n, "number of heads")
    if n == 1:
        return attn_fn(q, k, v, **attn_kwargs)
    if debug.enabled():
        for name, t in (("q", q), ("k", k), ("v", v)):
            debug.check_same(f"{what} {name}", t, cp_group)
    qh, kh, vh = _AllToAll.apply((h, h, h), (s, s, s), cp_group, q, k, v)
    out = attn_fn(qh, kh, vh, **attn_kwargs)
    if not isinstance(out, torch.Tensor) or out.dim() != q.dim() or out.shape[s] != qh.shape[s]:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{what}: attn_fn returned {got} for q of shape {tuple(qh.shape)}; it must return a "
                         f"tensor in q's layout (seq_dim={seq_dim}, head_dim={head_dim})")
    return _AllToAll.apply((s,), (h,), cp_group, out)[0]


def _default_attn(seq_dim: int, head_dim: int) -> AttnFn:
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return sdpa_in_layout(q, k, v, seq_dim=seq_dim, head_dim=head_dim, **kwargs)

    return attn


__all__ = ["heads_to_seq", "sdpa_in_layout", "seq_to_heads", "ulysses_attention"]
