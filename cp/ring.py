"""Context-parallel attention by passing K/V around a ring ("ring attention"), and its masked form.

Each rank keeps its own queries. Its K/V block travels the group's ring (group rank i sends to i + 1)
by point-to-point ``dist.batch_isend_irecv``; at step t a rank attends to the block of group rank
``rank - t``, and the transfer of the next block is started before this block's compute, so the two
overlap. This is ``cp.engine`` with the transport "ring" on the contiguous layout of the blocks, under
``Mask.full()`` or ``Mask.causal()``: block results merge by their log-sum-exp (the online softmax),
accumulated in float32 (float64 inputs stay float64); the output has the input dtype.

The backward recomputes every block's scores from q, the block's K/V and the saved log-sum-exp.
K/V travel the ring once more, and each block's dK/dV accumulator travels behind it, picking up
every rank's contribution until it is back at the block's owner. No rank ever holds more than one
block of another rank's K/V (two while a transfer is in flight), and nothing of the whole sequence.

Causal attention on the plain contiguous split (group rank i holds the i-th block of the sequence):
a block wholly in a rank's future is neither sent to it nor computed; the rank's own block is one
causal tile (the kernel's causal flag). Rank i so computes i + 1 blocks. (The backward's dK/dV
accumulators still go all the way round, so that every rank takes part in every step's exchange.)

Uneven shards: rank i may hold ``blocks[i]`` tokens, any positive sizes; ``ring_attention(length=L)``
uses ``cp.shard_sizes(L, n)`` (torch.tensor_split's rule), usp passes the sizes of its ring blocks.

K/V may have fewer heads than q (GQA/MQA, query head h uses K/V head h // (Hq / Hkv), as SDPA's
``enable_gqa``): the K/V heads travel as they are, and each K/V head attends for its group of query
heads at once, so nothing is repeated, neither on the wire nor in memory.

A block is computed by a fused kernel that returns its log-sum-exp wherever torch has one
(``cp.kernels``: CUDA's flash / efficient / cuDNN ops, the CPU's flash op), else by plain matmuls.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

import parallel_state as ps
from cp import call_check, debug, engine, inputs, mask_schedule, masked, transports
from cp.comm import global_ranks
from cp.layout import sdpa_gqa
from cp.shard import shard_sizes


def _contiguous_schedule(causal: bool, blocks: tuple[int, ...], rank: int, device: torch.device
                         ) -> mask_schedule.Schedule:
    """This rank's schedule of full or causal attention on the contiguous layout of ``blocks`` (cached)."""
    mask = ps.AttentionMask.causal() if causal else ps.AttentionMask.full()

    def build() -> mask_schedule.Schedule:
        starts = [sum(blocks[:i]) for i in range(len(blocks))]
        positions = [torch.arange(a, a + b) for a, b in zip(starts, blocks, strict=True)]
        return mask_schedule.build(mask, sum(blocks), positions, rank)

    return mask_schedule.cached_on((mask, blocks), ("contiguous", rank), device, build)


def _plain(call: inputs.Call) -> torch.Tensor:
    """Attention in one process (no ring): SDPA, GQA as ``cp.layout.sdpa_gqa``."""
    t = call.tensors
    return sdpa_gqa(t.q, t.k, t.v, seq_dim=t.s, head_dim=t.h, is_causal=call.causal, scale=call.scale)


def attend_blocks(call: inputs.Call, blocks: tuple[int, ...], how: str = "blocks") -> torch.Tensor:
    """The ring over a checked call whose group rank i holds the contiguous ``blocks[i]`` tokens (``how`` names
    where those sizes came from, for messages); plain or causal attention by ``call.causal``."""
    t, group, rank = call.tensors, call.group, call.rank
    q, s = t.q, t.s
    if call.n > 1 and debug.enabled():  # first, so that a rank with a wrong shard fails on every rank, not alone
        _debug_check(call, blocks)
    if q.shape[s] != blocks[rank]:
        who = f"group rank {rank} (global {global_ranks(group)[rank]})" if group is not None else "this process"
        raise ValueError(
            f"{call.what}: {who} holds {q.shape[s]} tokens (q {tuple(q.shape)}, seq_dim {s}) but {how} gives it "
            f"{blocks[rank]} (every rank's: {list(blocks)}); shard the sequence with "
            f"cp.split_inputs_cp(x, seq_dim, group{', uneven=True' if 'length' in how else ''})")
    if call.n == 1:
        return _plain(call)
    assert call.scale is not None
    sched = _contiguous_schedule(call.causal, blocks, rank, q.device)
    run = engine.AttentionCall(s, t.h, t.groups, call.scale, group, sched, transports.Ring)
    return engine.attend(run, q, t.k, t.v)


def ring_attention_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any, blocks: Sequence[int],
                          *, causal: bool = False, seq_dim: int = 1, head_dim: int = 2,
                          softmax_scale: float | None = None, what: str = "ring_attention",
                          how: str = "blocks") -> torch.Tensor:
    """ring_attention with explicit per-rank block sizes: group rank i holds ``blocks[i]`` tokens.

    The blocks are contiguous and in group-rank order (for ``causal``, their global positions follow
    from the sizes). ``what`` and ``how`` name the call and the sizes' origin in messages.
    """
    n, rank = inputs.group_size(what, cp_group)
    t = inputs.tensors(what, q, k, v, seq_dim, head_dim, n)
    causal = inputs.check_causal(what, causal)
    blocks = tuple(blocks)
    if len(blocks) != n or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
        raise ValueError(f"{what}: blocks={list(blocks)} must give a positive token count for each of the group's "
                         f"{n} ranks")
    scale = inputs.check_scale(what, softmax_scale, t.feature)
    return attend_blocks(inputs.Call(what, t, cp_group, n, rank, scale, causal=causal), blocks, how)


def _debug_check(call: inputs.Call, blocks: tuple[int, ...]) -> None:
    """PARALLEL_STATE_DEBUG: every rank checks every rank's q against the block sizes, so all raise together."""
    q, s, group = call.tensors.q, call.tensors.s, call.group
    metas = debug.gather_meta(q, group)
    ranks = global_ranks(group)
    mine = tuple(q.shape[:s]) + tuple(q.shape[s + 1:])
    bad = [f"group rank {i} (global {ranks[i]}): {m.describe()}, {blocks[i]} tokens expected" for i, m in enumerate(metas)
           if m.shape is None or len(m.shape) != q.dim() or m.shape[s] != blocks[i]
           or tuple(m.shape[:s]) + tuple(m.shape[s + 1:]) != mine or m.dtype != metas[0].dtype]
    if bad:
        raise ValueError(f"{call.what} ({debug.ENV}): q differs across the group from what the block sizes "
                         f"{list(blocks)} (seq_dim {s}) say: {'; '.join(bad)}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any = None, *, causal: bool = False,
                   mask: Any = None, plan: Any = None, length: int | None = None, seq_dim: int = 1, head_dim: int = 2,
                   softmax_scale: float | None = None) -> torch.Tensor:
    """Attention over the whole sequence for sequence-sharded q, k and v (default layout [B, S, H, D]), by
    passing K/V blocks around the group's ring; returns this rank's shard of the output, in q's layout and dtype.

    Group rank i holds the i-th contiguous block of the sequence: all blocks of one size, or with
    ``length`` (the whole sequence's) ``cp.shard_sizes(length, n)[i]`` tokens, as
    ``cp.split_inputs_cp(..., uneven=True)`` cuts them. ``causal`` masks by global position; blocks
    wholly in a rank's future are skipped. K/V may have fewer heads than q (a divisor of q's: GQA).
    ``softmax_scale`` defaults to 1/sqrt(feature dim). ``cp_group=None`` or a group of one is plain
    attention. Differentiable in q, k and v; no rank holds more than one other rank's K/V block at once.

    ``mask`` (a ``cp.Mask``) and/or ``plan`` (a ``cp.DispatchPlan`` for this group): masked attention.
    With a plan, this rank holds the tokens ``plan.positions[rank]`` (what ``cp.dispatch`` gives it)
    and the mask is the plan's; with a mask alone, the contiguous split above. K/V then go point to
    point from their owner to exactly the ranks whose queries see them (see ``cp.masked``); the ranks
    check every distinct call's token counts and plan across the group before any K/V moves
    (``cp.call_check``), so a mistake raises on every rank. ``causal=True`` is the plain path; with a mask,
    pass ``cp.Mask.causal()`` instead.
    """
    what = "ring_attention"
    n, rank = inputs.group_size(what, cp_group)
    if mask is not None or plan is not None:
        return masked_ring(inputs.masked_call(what, q, k, v, cp_group, causal=causal, mask=mask, plan=plan,
                                              length=length, seq_dim=seq_dim, head_dim=head_dim,
                                              softmax_scale=softmax_scale, n=n, rank=rank))
    t = inputs.tensors(what, q, k, v, seq_dim, head_dim, n)
    causal = inputs.check_causal(what, causal)
    total = inputs.check_length(what, length, n)
    scale = inputs.check_scale(what, softmax_scale, t.feature)
    if total is None:
        blocks, how = (t.local,) * n, "blocks"
    else:
        blocks, how = shard_sizes(total, n), f"length={total} (cp.shard_sizes({total}, {n}))"
    return attend_blocks(inputs.Call(what, t, cp_group, n, rank, scale, total, causal), blocks, how)


def masked_ring(call: inputs.Call) -> torch.Tensor:
    """The masked ring of a checked call (``call.masking``): the cached schedule, the cross-rank check, the engine."""
    t, m = call.tensors, call.masking
    assert m is not None and call.scale is not None
    plan = m.plan
    sched = masked.schedule(plan, "plan", lambda: plan.positions, call.rank, t.q.device)
    check = None
    if call.n > 1:  # started by the engine, judged once this rank's own block is computed, before any K/V moves
        def check(posted: Sequence[int]) -> engine.Confirm:
            return call_check.start(call, call_check.Method.RING, posted)
    elif t.local != plan.length:
        raise ValueError(f"{call.what}: q holds {t.local} tokens (seq_dim {t.seq_dim}) but the "
                         f"{m.layout(call.n)[0]} is for {plan.length}; without a group, pass the whole sequence")
    return masked.attend(t, sched, call.group if call.n > 1 else None, call.scale, plan.transport, check)


__all__ = ["ring_attention", "ring_attention_blocks"]
