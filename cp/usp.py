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

from cp import call_check, inputs, masked
from cp.attention import across_heads, masked_ulysses, ulysses
from cp.comm import global_ranks
from cp.ring import attend_blocks, ring_attention
from cp.shard import shard_sizes


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
    u, i = inputs.group_size(what, ulysses_group, "ulysses_group")
    r, j = inputs.group_size(what, ring_group, "ring_group")
    ring = None if r == 1 else ring_group
    masked_call = mask is not None or plan is not None
    if u == 1:  # the ring alone (masked or not), or plain attention
        return ring_attention(q, k, v, ring, causal=causal, mask=mask, plan=plan, length=length, seq_dim=seq_dim,
                              head_dim=head_dim, softmax_scale=softmax_scale)
    n, cp_rank = u * r, j * u + i
    cp_group = f"the cp group ({u} x {r} = {n} ranks)"
    if masked_call:
        return masked_usp(inputs.masked_call(what, q, k, v, ulysses_group, causal=causal, mask=mask, plan=plan,
                                             length=length, seq_dim=seq_dim, head_dim=head_dim,
                                             softmax_scale=softmax_scale, n=n, rank=cp_rank, ring_group=ring,
                                             length_group=cp_group))
    t = inputs.tensors(what, q, k, v, seq_dim, head_dim, n)
    causal = inputs.check_causal(what, causal)
    total = inputs.check_length(what, length, n, cp_group)
    scale = inputs.check_scale(what, softmax_scale, t.feature)
    blocks, ulysses_length = _ring_blocks(what, t.local, tuple(q.shape), total, u, r, i, j, ulysses_group)

    def ring_fn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        # The whole ring block of this ring rank, for this rank's 1/u of the heads.
        exchanged = inputs.Tensors(qh, kh, vh, t.s, t.h, seq_dim, head_dim)
        return attend_blocks(inputs.Call(what, exchanged, ring, r, j, scale, causal=causal), blocks)

    return ulysses(inputs.Call(what, t, ulysses_group, u, i, scale, ulysses_length), ring_fn)


def _ring_blocks(what: str, local: int, q_shape: tuple[int, ...], total: int | None, u: int, r: int, i: int, j: int,
                 ulysses_group: Any) -> tuple[tuple[int, ...], int | None]:
    """Every ring rank's block length and the Ulysses exchange's ``length`` (None: even shards), checking that this
    rank (ulysses rank ``i``, ring rank ``j``, ``local`` tokens) holds its shard of ``total`` (None: even)."""
    if total is None:
        return (u * local,) * r, None
    n, cp_rank = u * r, j * u + i
    sizes = shard_sizes(total, n)
    # Ring rank j's block is the u consecutive shards of cp ranks j*u .. j*u+u-1; tensor_split's sizes
    # of a sum of consecutive shards split the same way again, so the Ulysses shards are shard_sizes(block, u).
    blocks = tuple(sum(sizes[jj * u:(jj + 1) * u]) for jj in range(r))
    if local != sizes[cp_rank]:
        who = f"cp rank {cp_rank} (ring rank {j}, ulysses rank {i}, global {global_ranks(ulysses_group)[i]})"
        raise ValueError(f"{what}: {who} holds {local} tokens (q {q_shape}) but length={total} "
                         f"over {n} ranks gives it {sizes[cp_rank]} (every cp rank's: {list(sizes)}); "
                         f"shard the sequence with cp.split_inputs_cp(x, seq_dim, cp_group, uneven=True)")
    # Even after all: no length, which spares Ulysses its size check (one small all-gather).
    return blocks, None if len(set(sizes)) == 1 else blocks[j]


def masked_usp(call: inputs.Call) -> torch.Tensor:
    """usp_attention with ``mask`` / ``plan`` (``call.masking``) on u x r ranks (``call.group``: the Ulysses group of
    u > 1, ``call.ring_group``: the ring of r, None for one): Ulysses' exchange around the masked ring over the
    ring ranks."""
    if call.ring_group is None:
        return masked_ulysses(call)
    t, m, what = call.tensors, call.masking, call.what
    assert m is not None and call.scale is not None
    u, r, j = call.group.size(), call.ring_group.size(), call.ring_group.rank()
    try:  # a rank alone in a head count the group cannot split still takes part in the call's check
        inputs.split(what, t.q, "q", t.h, "head_dim", t.head_dim, u, "number of heads")
        repeats = t.kv_repeats(what, u)
    except ValueError as exc:
        call_check.refuse_call(call, exc)
    plan, scale, ring_group = m.plan, call.scale, call.ring_group

    def ring_positions() -> tuple[tuple[int, ...], ...]:
        # Ring rank jj holds its u cp ranks' tokens one after another (Ulysses gathers in group-rank order).
        return tuple(tuple(p for i in range(jj * u, jj * u + u) for p in plan.positions[i]) for jj in range(r))

    sched = masked.schedule(plan, ("usp", u, r), ring_positions, j, t.q.device)
    call_check.check(call, call_check.Method.USP)
    block = plan.sizes[j * u:(j + 1) * u]
    seqs = None if len(set(block)) == 1 else [block] * 3

    def ring_fn(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        exchanged = inputs.Tensors(qh, kh, vh, t.s, t.h, t.seq_dim, t.head_dim)
        return masked.attend(exchanged, sched, ring_group, scale, plan.transport)

    return across_heads(t, call.group, repeats, seqs, ring_fn)


__all__ = ["usp_attention"]
