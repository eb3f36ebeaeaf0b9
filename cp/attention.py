"""Context-parallel attention by all-to-all ("Ulysses"): trade the sequence shard for a head shard and back.

Each rank holds a sequence shard with every head. One all-to-all gives each rank the whole sequence
for 1/n of the heads (head block i to group rank i); attention runs there unchanged, because heads
are independent of each other; a second all-to-all turns the output back into sequence shards.
Per tensor, a rank sends and receives (n - 1)/n of its shard, where gathering K and V would receive
(n - 1) whole shards of each.

The exchange is ``dist.all_to_all_single`` on every backend: gloo has implemented it (for CPU and,
through host copies, CUDA tensors) since long before torch 2.4, the oldest torch this package supports.
Its backward is the inverse exchange, so gradients reach every rank's q, k and v.

Uneven shards (``length=``): rank i holds ``shard_sizes(length, n)[i]`` tokens; the all-to-all then
sends blocks of different sizes (``all_to_all_single``'s split sizes), and one tiny all-gather of
every rank's shard sizes comes first so that a wrong shard is an error on every rank, not a hang.
Without ``length`` nothing extra runs. K and V with fewer heads than the group size (GQA / MQA) are
replicated head by head up to ``lcm(kv heads, n)``, the fewest heads that give every rank whole
blocks; replication's backward sums the copies' gradients, so gradients stay exact.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from cp import debug, inputs
from cp.agree import gather
from cp.comm import global_ranks
from cp.layout import sdpa_in_layout
from cp.shard import shard_sizes

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


def _exchange_sized(parts: Sequence[torch.Tensor], scatter_dim: Sequence[int], gather_dim: Sequence[int],
                    group: Any, scatter_sizes: Sequence[Sequence[int]], gather_sizes: Sequence[Sequence[int]]
                    ) -> list[torch.Tensor]:
    """``_exchange`` with blocks of given sizes: part p's block j along ``scatter_dim[p]`` has
    ``scatter_sizes[p][j]`` elements and goes to group rank j; the block from group rank i has
    ``gather_sizes[p][i]`` elements along ``gather_dim[p]`` (this rank's part has ``gather_sizes[p][rank]``).

    Every rank must pass the same sizes. The send buffer holds rank j's blocks of every part as one
    segment, so the parts still travel in a single all-to-all with per-rank split sizes.
    """
    n, rank = group.size(), group.rank()
    starts = [[sum(a[:j]) for j in range(n)] for a in scatter_sizes]
    send_counts, recv_counts = [0] * n, [0] * n
    for x, s, g, a, b in zip(parts, scatter_dim, gather_dim, scatter_sizes, gather_sizes, strict=True):
        per = x.numel() // x.shape[s] if x.shape[s] else 0  # elements per index along the scatter dim
        rest = per // x.shape[g] if x.shape[g] else 0        # ... per index along both dims
        for j in range(n):
            send_counts[j] += per * a[j]
            recv_counts[j] += rest * a[rank] * b[j]
    send = torch.empty(sum(send_counts), dtype=parts[0].dtype, device=parts[0].device)
    offset = 0
    for j in range(n):
        for x, s, a, st in zip(parts, scatter_dim, scatter_sizes, starts, strict=True):
            piece = x.narrow(s, st[j], a[j])
            send[offset:offset + piece.numel()].view(piece.shape).copy_(piece)
            offset += piece.numel()
    recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    blocks: list[list[torch.Tensor]] = [[] for _ in parts]
    offset = 0
    for i in range(n):
        for p, (x, s, g, a, b) in enumerate(zip(parts, scatter_dim, gather_dim, scatter_sizes, gather_sizes,
                                                strict=True)):
            shape = list(x.shape)
            shape[s], shape[g] = a[rank], b[i]
            size = math.prod(shape)
            blocks[p].append(recv[offset:offset + size].view(shape))
            offset += size
    return [torch.cat(bl, dim=g) for bl, g in zip(blocks, gather_dim, strict=True)]


class _AllToAll(torch.autograd.Function):
    """``_exchange`` with autograd: the gradient goes back through the inverse exchange.

    ``sizes`` is None (equal blocks) or (scatter_sizes, gather_sizes) as ``_exchange_sized`` takes them.
    """

    @staticmethod
    def forward(ctx: Any, scatter_dim: tuple[int, ...], gather_dim: tuple[int, ...], group: Any, sizes: Any,
                *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dims, ctx.group, ctx.sizes = (scatter_dim, gather_dim), group, sizes
        if sizes is None:
            return tuple(_exchange(parts, scatter_dim, gather_dim, group))
        return tuple(_exchange_sized(parts, scatter_dim, gather_dim, group, *sizes))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        # Missing gradients arrive as zeros (materialized), so every rank still joins the collective.
        if ctx.sizes is None:
            return (None, None, None, None, *_exchange(grads, gather_dim, scatter_dim, ctx.group))
        scatter_sizes, gather_sizes = ctx.sizes
        # The inverse exchange: the gather sizes become the scatter sizes and back.
        return (None, None, None, None,
                *_exchange_sized(grads, gather_dim, scatter_dim, ctx.group, gather_sizes, scatter_sizes))


def _agreed_sizes(what: str, group: Any, length: int, named: Sequence[tuple[str, int]],
                  whole: bool = False) -> list[tuple[int, ...]]:
    """Every tensor's shard sizes over the group, checked on every rank alike (one small all-gather).

    ``named`` holds (name, this rank's length of it along the sequence). The first tensor must hold
    ``shard_sizes(length, n)[rank]`` tokens (``length`` itself when ``whole``); the others the
    ``shard_sizes`` of their own total (K and V may be longer or shorter than Q). Every rank raises the
    same ValueError, naming ranks and sizes, when a size is wrong or the ranks passed different lengths.
    """
    n = group.size()
    table = gather([length] + [size for _, size in named], group)
    ranks = global_ranks(group)
    lengths = [row[0] for row in table]
    if len(set(lengths)) > 1:
        who = "; ".join(f"group rank {i} (global {ranks[i]}): {v}" for i, v in enumerate(lengths))
        raise ValueError(f"{what}: the ranks passed different length= values ({who}); pass the full sequence "
                         f"length, the same on every rank")
    out = []
    for col, (name, _) in enumerate(named, start=1):
        got = tuple(row[col] for row in table)
        if whole:
            want = (length,) * n
            rule = f"the whole sequence, length={length}"
        else:
            total = length if col == 1 else sum(got)
            if total < n:
                raise ValueError(f"{what}: {name} has {total} tokens over the group of size {n}, fewer than one "
                                 f"per rank; use a smaller group or a longer sequence")
            want = shard_sizes(total, n)
            rule = f"shard_sizes({total}, {n}) = {want}"
        if got != want:
            bad = "; ".join(f"group rank {i} (global {ranks[i]}) has {g}, expected {w}"
                            for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
            fix = ("pass every rank the whole sequence (what seq_to_heads returned)" if whole else
                   "give rank i the shard split_inputs_cp(x, seq_dim, group, uneven=True) gives it")
            raise ValueError(f"{what}: {name}'s sequence lengths over the group are {got}, not {rule}: {bad}; {fix}")
        out.append(want)
    return out


def _move(what: str, x: Any, seq_dim: Any, head_dim: Any, cp_group: Any, to_heads: bool,
          length: Any = None) -> torch.Tensor:
    if cp_group is None:
        return x
    n, _ = inputs.group_size(what, cp_group)
    s, h = inputs.dims(what, x, "x", seq_dim, head_dim, n)
    length = inputs.check_length(what, length, n)
    if to_heads:
        inputs.split(what, x, "x", h, "head_dim", head_dim, n, "number of heads")
    elif length is None:
        inputs.split(what, x, "x", s, "seq_dim", seq_dim, n, "sequence length")
    if n == 1:
        if length is not None and x.shape[s] != length:
            raise ValueError(f"{what}: x has {x.shape[s]} tokens along seq_dim={seq_dim} but length={length}; "
                             f"in a group of one the shard is the whole sequence")
        return x
    if debug.enabled() and length is None:
        debug.check_same(what, x, cp_group)
    scatter, gather = (h, s) if to_heads else (s, h)
    if length is None:
        return _AllToAll.apply((scatter,), (gather,), cp_group, None, x)[0]
    # Uneven: every rank checks every rank's sequence size first (a wrong one would break the all-to-all).
    _agreed_sizes(what, cp_group, length, [("x", x.shape[s])], whole=not to_heads)
    seq = shard_sizes(length, n)
    heads = (x.shape[h] // n,) * n if to_heads else (x.shape[h],) * n
    sizes = ((heads,), (seq,)) if to_heads else ((seq,), (heads,))
    return _AllToAll.apply((scatter,), (gather,), cp_group, sizes, x)[0]


def seq_to_heads(x: torch.Tensor, seq_dim: int, head_dim: int, cp_group: Any = None, *,
                 length: int | None = None) -> torch.Tensor:
    """This rank's sequence shard with all heads -> the whole sequence with this rank's heads only.

    The sequence is the shards in group-rank order; group rank i keeps head block i. Differentiable:
    the gradient goes back through heads_to_seq. ``cp_group=None`` returns ``x`` itself, a group of
    one ``x`` after the checks. With PARALLEL_STATE_DEBUG=1 every rank first checks the shards agree.
    ``length``: the whole sequence's length, for uneven shards (rank i holds
    ``shard_sizes(length, n)[i]`` tokens; checked on every rank with one small all-gather first).
    """
    return _move("seq_to_heads", x, seq_dim, head_dim, cp_group, to_heads=True, length=length)


def heads_to_seq(x: torch.Tensor, seq_dim: int, head_dim: int, cp_group: Any = None, *,
                 length: int | None = None) -> torch.Tensor:
    """The inverse of seq_to_heads: the whole sequence with this rank's heads -> this rank's sequence shard
    with all heads (head blocks in group-rank order). ``length`` (uneven shards) as for seq_to_heads:
    ``x`` then holds all ``length`` tokens and rank i gets back ``shard_sizes(length, n)[i]`` of them.
    """
    return _move("heads_to_seq", x, seq_dim, head_dim, cp_group, to_heads=False, length=length)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any = None, *,
                      attn_fn: AttnFn | None = None, seq_dim: int = 1, head_dim: int = 2, length: int | None = None,
                      mask: Any = None, plan: Any = None, **attn_kwargs: Any) -> torch.Tensor:
    """Attention over the whole sequence for sequence-sharded q, k and v (default layout [B, S, H, D]).

    q, k and v move to head shards in one all-to-all; ``attn_fn(q, k, v, **attn_kwargs)`` (default:
    scaled_dot_product_attention in this layout) sees the whole sequence with this rank's heads, in the
    same layout, and must return q's layout; one more all-to-all returns this rank's sequence shard of
    the output, with all heads. ``cp_group=None`` or a group of one is plain attention. Differentiable
    in q, k and v. q's number of heads must be divisible by the group size n. K and V may have fewer
    heads (GQA/MQA, pass ``enable_gqa=True`` to the default attention): a head count not divisible by n
    must divide q's, and is then replicated to ``lcm(heads, n)`` heads before the exchange.

    ``length``: the whole sequence's length, for uneven shards: rank i holds ``shard_sizes(length, n)[i]``
    tokens of q (K and V: the ``shard_sizes`` of their own total). One small all-gather checks every
    rank's sizes first, so a wrong shard raises on every rank. ``None``: equal shards, no extra collective.

    ``mask`` (a ``cp.Mask``) and/or ``plan`` (a ``cp.DispatchPlan`` for this group): masked attention.
    With a plan, this rank holds the tokens ``plan.positions[rank]`` (what ``cp.dispatch`` gives it),
    so after the exchange a rank holds every token in the plan's order; the built-in masked
    attention (no ``attn_fn``; of the keyword arguments only ``scale``) then attends each tile of
    queries, taken in global order, to its key interval only. With a mask alone, the contiguous split.
    The ranks check every distinct call's token counts and plan across the group first (``cp.call_check``).
    """
    what = "ulysses_attention"
    n, rank = inputs.group_size(what, cp_group)
    if mask is not None or plan is not None:
        _masked_arguments(what, attn_fn, attn_kwargs)
        call = inputs.masked_call(what, q, k, v, cp_group, causal=False, mask=mask, plan=plan, length=length,
                                  seq_dim=seq_dim, head_dim=head_dim, softmax_scale=attn_kwargs.get("scale"), n=n,
                                  rank=rank)
        return masked_ulysses(call)
    t = inputs.tensors(what, q, k, v, seq_dim, head_dim, n, computed=False)
    total = inputs.check_length(what, length, n)
    if attn_fn is None:
        if q.dim() < 3:
            raise ValueError(f"{what}: the default attention needs at least 3 dims (sequence, heads, features); q "
                             f"has shape {tuple(q.shape)}: add a feature dim or pass attn_fn")
        attn_fn = _default_attn(t.s, t.h)
    return ulysses(inputs.Call(what, t, cp_group, n, rank, None, total), attn_fn, attn_kwargs)


def ulysses(call: inputs.Call, attn_fn: AttnFn, attn_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """Ulysses around ``attn_fn(q, k, v, **attn_kwargs)`` for a checked call (``call.length``: uneven shards)."""
    what, t, group, n, total = call.what, call.tensors, call.group, call.n, call.length
    q, k, v, s, h = t.q, t.k, t.v, t.s, t.h
    kwargs = attn_kwargs or {}
    inputs.split(what, q, "q", h, "head_dim", t.head_dim, n, "number of heads")
    repeats = t.kv_repeats(what, n)
    if n == 1:
        if total is not None and q.shape[s] != total:
            raise ValueError(f"{what}: q has {q.shape[s]} tokens along seq_dim={t.seq_dim} but length={total}; "
                             f"in a group of one the shard is the whole sequence")
        return attn_fn(q, k, v, **kwargs)
    if debug.enabled() and total is None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            debug.check_same(f"{what} {name}", x, group)
    seqs = None
    if total is not None:
        seqs = _agreed_sizes(what, group, total, t.tokens())

    def attn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        out = attn_fn(qh, kh, vh, **kwargs)
        if not isinstance(out, torch.Tensor) or out.dim() != q.dim() or out.shape[s] != qh.shape[s]:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{what}: attn_fn returned {got} for q of shape {tuple(qh.shape)}; it must return a "
                             f"tensor in q's layout (seq_dim={t.seq_dim}, head_dim={t.head_dim})")
        return out

    return across_heads(t, group, repeats, seqs, attn)


def across_heads(t: inputs.Tensors, group: Any, repeats: Sequence[int], seqs: Sequence[Sequence[int]] | None,
                 attn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Ulysses' exchange around ``attn``: K/V heads replicated ``repeats`` times (GQA), q, k, v to head shards in
    one all-to-all (``seqs``: each tensor's per-rank sequence sizes, None for equal ones), ``attn(qh, kh, vh)`` on
    the whole sequence, and the output back to this rank's sequence shard with all heads."""
    n, s, h = group.size(), t.s, t.h
    # GQA/MQA: head e of the replicated K/V is head e // r of the original, so q head i still meets
    # K/V head i // (q heads / kv heads); repeat_interleave's backward sums the copies' gradients.
    k, v = (x.repeat_interleave(r, dim=h) if r > 1 else x for x, r in zip((t.k, t.v), repeats, strict=True))
    q = t.q
    if seqs is None:
        qh, kh, vh = _AllToAll.apply((h, h, h), (s, s, s), group, None, q, k, v)
    else:
        heads = [(x.shape[h] // n,) * n for x in (q, k, v)]
        qh, kh, vh = _AllToAll.apply((h, h, h), (s, s, s), group, (heads, seqs), q, k, v)
    out = attn(qh, kh, vh)
    if seqs is None:
        return _AllToAll.apply((s,), (h,), group, None, out)[0]
    return _AllToAll.apply((s,), (h,), group, ((seqs[0],), ((out.shape[h],) * n,)), out)[0]


#: Of SDPA's keyword arguments, those the masked path takes (GQA needs no flag there).
_MASKED_KWARGS = ("scale", "enable_gqa")


def _masked_arguments(what: str, attn_fn: Any, attn_kwargs: dict[str, Any]) -> None:
    """What ulysses_attention takes besides ``mask`` / ``plan``: no attn_fn, of SDPA's keywords only scale."""
    if attn_fn is not None:
        raise ValueError(f"{what}: attn_fn cannot be combined with mask= or plan= (the masked attention is built in); "
                         f"leave attn_fn out, or apply your mask inside attn_fn without mask=/plan=")
    extra = sorted(set(attn_kwargs) - set(_MASKED_KWARGS))
    if extra:
        hint = "; for a causal mask pass mask=cp.Mask.causal()" if "is_causal" in extra else ""
        raise ValueError(f"{what}: with mask= or plan= only {list(_MASKED_KWARGS)} of SDPA's keyword arguments "
                         f"apply, got {extra}{hint}")


def masked_ulysses(call: inputs.Call) -> torch.Tensor:
    """ulysses_attention with ``mask`` / ``plan`` (``call.masking``): the exchange around the engine's masked
    attention on the whole sequence."""
    from cp import call_check, masked

    what, t, group, n = call.what, call.tensors, call.group, call.n
    m = call.masking
    assert m is not None and call.scale is not None
    try:  # a rank alone in a head count the group cannot split still takes part in the call's check
        inputs.split(what, t.q, "q", t.h, "head_dim", t.head_dim, n, "number of heads")
        repeats = t.kv_repeats(what, n)
    except ValueError as exc:
        call_check.refuse_call(call, exc)
    plan, scale = m.plan, call.scale
    whole = masked.schedule(plan, "whole", lambda: (tuple(p for mine in plan.positions for p in mine),), 0,
                            t.q.device)

    def attn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        return masked.attend(inputs.Tensors(qh, kh, vh, t.s, t.h, t.seq_dim, t.head_dim), whole, None, scale)

    if n == 1:
        if t.local != plan.length:
            raise ValueError(f"{what}: q holds {t.local} tokens but the mask's sequence has {plan.length}; in a "
                             f"group of one the shard is the whole sequence")
        return attn(t.q, t.k, t.v)
    call_check.check(call, call_check.Method.ULYSSES)
    seqs = None if len(set(plan.sizes)) == 1 else [plan.sizes] * 3
    return across_heads(t, group, repeats, seqs, attn)


def _default_attn(seq_dim: int, head_dim: int) -> AttnFn:
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return sdpa_in_layout(q, k, v, seq_dim=seq_dim, head_dim=head_dim, **kwargs)

    return attn


__all__ = ["heads_to_seq", "sdpa_in_layout", "seq_to_heads", "ulysses_attention"]
