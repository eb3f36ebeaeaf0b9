"""Unified sequence parallelism: Ulysses over one group, ring attention over another, nested.

The context-parallel group of c = u * r ranks is cut as megatron's hierarchical context parallelism
cuts it (``initialize_model_parallel(context_parallel_size=c, hierarchical_context_parallel_sizes=[u, r])``
and ``get_hierarchical_context_parallel_groups()``): the Ulysses groups are u consecutive cp ranks,
the ring groups take one rank of each, and cp rank = ring rank * u + ulysses rank. The all-to-all of
Ulysses over the u ranks gives each of them the whole ring block of its ring rank (the u shards,
which are consecutive in the sequence) for 1/u of the heads; ring attention over the r ring blocks
then sees the whole sequence, in order, so causal masking by global position holds as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from cp.attention import _across_heads, _check_dims, _check_split, _kv_repeats, ulysses_attention
from cp.comm import check_group, global_ranks
from cp.layout import _check_length, _scale
from cp.ring import _check_qkv, ring_attention, ring_attention_blocks
from cp.shard import check_tensor, shard_sizes


def _size(group: Any, name: str) -> int:
    if group is None:
        return 1
    check_group(group, "usp_attention", name)
    return group.size()


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ulysses_group: Any, ring_group: Any,
                  causal: bool = False, mask: Any = None, plan: Any = None, length: int | None = None,
                  seq_dim: int = 1, head_dim: int = 2, softmax_scale: float | None = None) -> torch.Tensor:
    """Attention over the whole sequence by Ulysses over ``ulysses_group`` and a ring over ``ring_group``.

    This rank holds the shard of cp rank ``ring rank * u + ulysses rank`` (u = the Ulysses group's
    size): with ``length`` (the whole sequence's length) ``cp.shard_sizes(length, u * r)[cp rank]``
    tokens, else every rank the same number. Returns this rank's shard of the output, in q's layout.
    q's and k's heads must divide by u (Ulysses splits them); the ring takes K/V with fewer heads
    than q (GQA). A group of None or of size one drops that method: ring or Ulysses alone, or plain
    attention when both are. ``causal`` masks by global position. Differentiable in q, k and v.

    ``mask`` / ``plan`` (a ``cp.DispatchPlan`` for the u * r cp ranks): masked attention. With a plan,
    cp rank i holds ``plan.positions[i]``; the Ulysses exchange gives each rank its ring rank's u
    shards for 1/u of the heads, and the masked ring (``ring_attention(mask=...)``'s engine) runs over
    the ring ranks' blocks in that order. With a mask alone, the contiguous split.
    """
    what = "usp_attention"
    u, r = _size(ulysses_group, "ulysses_group"), _size(ring_group, "ring_group")
    if mask is not None or plan is not None:
        from cp.masked import MaskedArgs

        return _masked_usp(q, k, v, ulysses_group, ring_group,
                           MaskedArgs(mask, plan, causal, length, seq_dim, head_dim, softmax_scale))
    if u == 1:
        return ring_attention(q, k, v, None if r == 1 else ring_group, causal=causal, length=length,
                              seq_dim=seq_dim, head_dim=head_dim, softmax_scale=softmax_scale)
    check_tensor(what, q, "q")
    s = _check_dims(what, q, "q", seq_dim, head_dim, u * r)[0]
    if length is None:
        blocks = (u * q.shape[s],) * r
        ulysses_length = None
    else:
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"{what}: length must be an int (the whole sequence's length) or None, got "
                            f"{type(length).__name__} {length!r}")
        if length < u * r:
            raise ValueError(f"{what}: length={length} is shorter than the cp group ({u} x {r} = {u * r} ranks): "
                             f"every rank needs at least one token; use fewer ranks or a longer sequence")
        sizes = shard_sizes(length, u * r)
        # Ring rank j's block is the u consecutive shards of cp ranks j*u .. j*u+u-1; tensor_split's sizes
        # of a sum of consecutive shards split the same way again, so the Ulysses shards are shard_sizes(block, u).
        blocks = tuple(sum(sizes[j * u:(j + 1) * u]) for j in range(r))
        j = 0 if r == 1 else ring_group.rank()
        cp_rank = j * u + ulysses_group.rank()
        if q.shape[s] != sizes[cp_rank]:
            who = f"cp rank {cp_rank} (ring rank {j}, ulysses rank {ulysses_group.rank()}, global " \
                  f"{global_ranks(ulysses_group)[ulysses_group.rank()]})"
            raise ValueError(f"{what}: {who} holds {q.shape[s]} tokens (q {tuple(q.shape)}) but length={length} "
                             f"over {u * r} ranks gives it {sizes[cp_rank]} (every cp rank's: {list(sizes)}); "
                             f"shard the sequence with cp.split_inputs_cp(x, seq_dim, cp_group, uneven=True)")
        # Even after all: no length, which spares ulysses_attention its size check (one small all-gather).
        ulysses_length = None if len(set(sizes)) == 1 else blocks[j]
    ring = None if r == 1 else ring_group

    def ring_fn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        # The whole ring block of this ring rank, for this rank's 1/u of the heads.
        return ring_attention_blocks(qh, kh, vh, ring, blocks, causal=causal, seq_dim=seq_dim, head_dim=head_dim,
                                     softmax_scale=softmax_scale, what=what)

    return ulysses_attention(q, k, v, ulysses_group, attn_fn=ring_fn, seq_dim=seq_dim, head_dim=head_dim,
                             length=ulysses_length)


def _masked_usp(q: Any, k: Any, v: Any, ulysses_group: Any, ring_group: Any, args: Any) -> torch.Tensor:
    """usp_attention with ``mask`` / ``plan`` (``args``, a cp.masked.MaskedArgs): Ulysses' exchange around the
    masked ring over the ring ranks."""
    from cp import masked

    what = "usp_attention"
    u, r = _size(ulysses_group, "ulysses_group"), _size(ring_group, "ring_group")
    a = args
    if u == 1:  # the masked ring alone, or plain masked attention
        return ring_attention(q, k, v, None if r == 1 else ring_group, causal=a.causal, mask=a.mask, plan=a.plan,
                              length=a.length, seq_dim=a.seq_dim, head_dim=a.head_dim, softmax_scale=a.scale)
    if r == 1:
        if a.causal:
            masked.resolve(what, a, u, 0)  # raises: causal=True with a mask
        kwargs = {} if a.scale is None else {"scale": a.scale}
        return ulysses_attention(q, k, v, ulysses_group, mask=a.mask, plan=a.plan, length=a.length,
                                 seq_dim=a.seq_dim, head_dim=a.head_dim, **kwargs)
    s, h, _ = _check_qkv(what, q, k, v, a.seq_dim, a.head_dim, u * r)
    if not isinstance(a.causal, bool):
        raise TypeError(f"{what}: causal must be a bool, got {type(a.causal).__name__} {a.causal!r}")
    if a.length is not None:
        _check_length(what, a.length, u * r)
    scale = _scale(what, a.scale, q.movedim((h, s), (-3, -2)).shape[-1])
    _check_split(what, q, "q", h, "head_dim", a.head_dim, u, "number of heads")
    repeats = [_kv_repeats(what, q, t, name, h, u) for name, t in (("k", k), ("v", v))]
    given = a.plan
    plan = masked.resolve(what, a, u * r, q.shape[s])
    j = ring_group.rank()

    def ring_positions() -> tuple[tuple[int, ...], ...]:
        # Ring rank jj holds its u cp ranks' tokens one after another (Ulysses gathers in group-rank order).
        return tuple(tuple(p for i in range(jj * u, jj * u + u) for p in plan.positions[i]) for jj in range(r))

    sched = masked.schedule(plan, ("usp", u, r), ring_positions, j, q.device)
    named = [("q", q.shape[s]), ("k", k.shape[s]), ("v", v.shape[s])]
    masked.agree(what, ulysses_group, plan, named, *masked.layout_words(given, plan, u * r),
                 even=given is None and a.length is None, ring_group=ring_group)
    block = plan.sizes[j * u:(j + 1) * u]
    seqs = None if len(set(block)) == 1 else [block] * 3

    def ring_fn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        return masked.attend(qh, kh, vh, sched, ring_group, s, h, scale, plan.transport)

    return _across_heads(q, k, v, ulysses_group, s, h, repeats, seqs, ring_fn)


__all__ = ["usp_attention"]
