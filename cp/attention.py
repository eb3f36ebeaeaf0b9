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

from cp import debug
from cp.agree import gather
from cp.comm import check_group, global_ranks
from cp.layout import _check_dims, _check_length, _scale, sdpa_in_layout
from cp.shard import check_tensor, shard_sizes

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


def _check_split(what: str, x: torch.Tensor, name: str, dim: int, arg: str, value: int, n: int, kind: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: {name} has shape {tuple(x.shape)}: its {kind} ({arg}={value}, size {x.shape[dim]}) cannot be "
            f"split into {n} equal blocks for a group of size {n}; use a {kind} size divisible by {n} or a "
            f"context-parallel group whose size divides {x.shape[dim]}"
        )


def _move(what: str, x: Any, seq_dim: Any, head_dim: Any, cp_group: Any, to_heads: bool,
          length: Any = None) -> torch.Tensor:
    if cp_group is None:
        return x
    check_tensor(what, x)
    check_group(cp_group, what)
    n = cp_group.size()
    s, h = _check_dims(what, x, "x", seq_dim, head_dim, n)
    if length is not None:
        length = _check_length(what, length, n)
    if to_heads:
        _check_split(what, x, "x", h, "head_dim", head_dim, n, "number of heads")
    elif length is None:
        _check_split(what, x, "x", s, "seq_dim", seq_dim, n, "sequence length")
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
    One small all-gather first checks every rank's token counts and plan.
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
    if length is not None:
        length = _check_length(what, length, n)
    masked = mask is not None or plan is not None
    if attn_fn is None and not masked:
        if q.dim() < 3:
            raise ValueError(f"{what}: the default attention needs at least 3 dims (sequence, heads, features); q "
                             f"has shape {tuple(q.shape)}: add a feature dim or pass attn_fn")
        attn_fn = _default_attn(s, h)
    _check_split(what, q, "q", h, "head_dim", head_dim, n, "number of heads")
    repeats = [_kv_repeats(what, q, t, name, h, n) for name, t in (("k", k), ("v", v))]
    if masked:
        from cp.masked import MaskedArgs

        return _masked(what, q, k, v, cp_group, repeats, attn_fn,
                       MaskedArgs(mask, plan, False, length, s, h, attn_kwargs.get("scale")), attn_kwargs)
    assert attn_fn is not None
    if n == 1:
        if length is not None and q.shape[s] != length:
            raise ValueError(f"{what}: q has {q.shape[s]} tokens along seq_dim={seq_dim} but length={length}; "
                             f"in a group of one the shard is the whole sequence")
        return attn_fn(q, k, v, **attn_kwargs)
    if debug.enabled() and length is None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            debug.check_same(f"{what} {name}", t, cp_group)
    seqs = None
    if length is not None:
        seqs = _agreed_sizes(what, cp_group, length, [("q", q.shape[s]), ("k", k.shape[s]), ("v", v.shape[s])])

    def attn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        out = attn_fn(qh, kh, vh, **attn_kwargs)
        if not isinstance(out, torch.Tensor) or out.dim() != q.dim() or out.shape[s] != qh.shape[s]:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{what}: attn_fn returned {got} for q of shape {tuple(qh.shape)}; it must return a "
                             f"tensor in q's layout (seq_dim={seq_dim}, head_dim={head_dim})")
        return out

    return _across_heads(q, k, v, cp_group, s, h, repeats, seqs, attn)


def _across_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, s: int, h: int,
                  repeats: Sequence[int], seqs: Sequence[Sequence[int]] | None, attn: Callable[..., torch.Tensor]
                  ) -> torch.Tensor:
    """Ulysses' exchange around ``attn``: K/V heads replicated ``repeats`` times (GQA), q, k, v to head shards in
    one all-to-all (``seqs``: each tensor's per-rank sequence sizes, None for equal ones), ``attn(qh, kh, vh)`` on
    the whole sequence, and the output back to this rank's sequence shard with all heads."""
    n = group.size()
    # GQA/MQA: head e of the replicated K/V is head e // r of the original, so q head i still meets
    # K/V head i // (q heads / kv heads); repeat_interleave's backward sums the copies' gradients.
    k, v = (t.repeat_interleave(r, dim=h) if r > 1 else t for t, r in zip((k, v), repeats, strict=True))
    if seqs is None:
        qh, kh, vh = _AllToAll.apply((h, h, h), (s, s, s), group, None, q, k, v)
    else:
        heads = [(t.shape[h] // n,) * n for t in (q, k, v)]
        qh, kh, vh = _AllToAll.apply((h, h, h), (s, s, s), group, (heads, seqs), q, k, v)
    out = attn(qh, kh, vh)
    if seqs is None:
        return _AllToAll.apply((s,), (h,), group, None, out)[0]
    return _AllToAll.apply((s,), (h,), group, ((seqs[0],), ((out.shape[h],) * n,)), out)[0]


#: Of SDPA's keyword arguments, those the masked path takes (GQA needs no flag there).
_MASKED_KWARGS = ("scale", "enable_gqa")


def _masked(what: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, repeats: Sequence[int],
            attn_fn: Any, args: Any, attn_kwargs: dict[str, Any]) -> torch.Tensor:
    """ulysses_attention with ``mask`` / ``plan`` (``args``, a cp.masked.MaskedArgs with the normalized dims): the
    exchange around the engine's masked attention on the whole sequence."""
    from cp import masked

    n, s, h = 1 if group is None else group.size(), args.seq_dim, args.head_dim
    if attn_fn is not None:
        raise ValueError(f"{what}: attn_fn cannot be combined with mask= or plan= (the masked attention is built in); "
                         f"leave attn_fn out, or apply your mask inside attn_fn without mask=/plan=")
    extra = sorted(set(attn_kwargs) - set(_MASKED_KWARGS))
    if extra:
        hint = "; for a causal mask pass mask=cp.Mask.causal()" if "is_causal" in extra else ""
        raise ValueError(f"{what}: with mask= or plan= only {list(_MASKED_KWARGS)} of SDPA's keyword arguments "
                         f"apply, got {extra}{hint}")
    if q.dim() < 3:
        raise ValueError(f"{what}: masked attention needs at least 3 dims (sequence, heads, features); q has shape "
                         f"{tuple(q.shape)}")
    scale = _scale(what, args.scale, q.movedim((h, s), (-3, -2)).shape[-1])
    given = args.plan
    plan = masked.resolve(what, args, n, q.shape[s])
    whole = masked.schedule(plan, "whole", lambda: (tuple(p for mine in plan.positions for p in mine),), 0,
                            q.device)

    def attn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        return masked.attend(qh, kh, vh, whole, None, s, h, scale)

    if n == 1:
        if q.shape[s] != plan.length:
            raise ValueError(f"{what}: q holds {q.shape[s]} tokens but the mask's sequence has {plan.length}; in a "
                             f"group of one the shard is the whole sequence")
        return attn(q, k, v)
    named = [("q", q.shape[s]), ("k", k.shape[s]), ("v", v.shape[s])]
    masked.agree(what, group, plan, named, *masked.layout_words(given, plan, n),
                 even=given is None and args.length is None)
    seqs = None if len(set(plan.sizes)) == 1 else [plan.sizes] * 3
    return _across_heads(q, k, v, group, s, h, repeats, seqs, attn)


def _kv_repeats(what: str, q: torch.Tensor, t: torch.Tensor, name: str, h: int, n: int) -> int:
    """How many times each head of K or V is repeated so that the group's n ranks get whole head blocks."""
    heads, q_heads = t.shape[h], q.shape[h]
    if heads % n == 0:
        return 1
    if heads and q_heads % heads == 0:
        # lcm(heads, n) divides q's heads (both heads and n do): the fewest copies giving n whole blocks.
        return n // math.gcd(heads, n)
    raise ValueError(
        f"{what}: {name} has shape {tuple(t.shape)}: its number of heads ({heads}) cannot be split into {n} equal "
        f"blocks for a group of size {n}, nor does it divide q's {q_heads} heads (grouped-query "
        f"attention); use such a head count or a group size that divides {heads}")


def _default_attn(seq_dim: int, head_dim: int) -> AttnFn:
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return sdpa_in_layout(q, k, v, seq_dim=seq_dim, head_dim=head_dim, **kwargs)

    return attn


__all__ = ["heads_to_seq", "sdpa_in_layout", "seq_to_heads", "ulysses_attention"]
