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

from cp import debug, engine, mask_schedule, transports
from cp.comm import check_group, global_ranks
from cp.layout import _check_dims, _check_length, _scale, sdpa_in_layout
from cp.shard import check_tensor, shard_sizes


def _contiguous_schedule(causal: bool, blocks: tuple[int, ...], rank: int, device: torch.device
                         ) -> mask_schedule.Schedule:
    """This rank's schedule of full or causal attention on the contiguous layout of ``blocks`` (cached)."""
    import parallel_state as ps

    mask = ps.AttentionMask.causal() if causal else ps.AttentionMask.full()

    def make() -> mask_schedule.Schedule:
        if device.type != "cpu":
            return _contiguous_schedule(causal, blocks, rank, torch.device("cpu")).to(device)
        starts = [sum(blocks[:i]) for i in range(len(blocks))]
        positions = [torch.arange(a, a + b) for a, b in zip(starts, blocks, strict=True)]
        return mask_schedule.build(mask, sum(blocks), positions, rank)

    return mask_schedule.cached((mask, blocks), ("contiguous", rank, str(device)), make)


def _check_qkv(what: str, q: Any, k: Any, v: Any, seq_dim: Any, head_dim: Any, n: int) -> tuple[int, int, int]:
    """Check q, k and v for attention in layout (seq_dim, head_dim); (seq dim, head dim, query heads per K/V head)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(what, t, name)
    dims = [_check_dims(what, t, name, seq_dim, head_dim, n) for name, t in (("q", q), ("k", k), ("v", v))]
    if len({t.dim() for t in (q, k, v)}) != 1 or len({(t.dtype, t.device) for t in (q, k, v)}) != 1:
        raise ValueError(
            f"{what}: q, k and v must have the same number of dims, dtype and device; got "
            + ", ".join(f"{nm} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"
                        for nm, t in (("q", q), ("k", k), ("v", v))) + "; convert them to one dtype and device")
    s, h = dims[0]
    if q.dim() < 3:
        raise ValueError(f"{what}: q has shape {tuple(q.shape)}; attention needs at least 3 dims (sequence, heads "
                         f"and the feature dim, which is the last dim left once seq_dim and head_dim are taken)")
    if not q.dtype.is_floating_point:
        raise TypeError(f"{what}: q, k and v have dtype {q.dtype}; attention needs a floating-point dtype")
    shapes = {nm: tuple(t.movedim((h, s), (-3, -2)).shape) for nm, t in (("q", q), ("k", k), ("v", v))}
    qs, ks, vs = shapes["q"], shapes["k"], shapes["v"]
    layout = f"(seq_dim={seq_dim}, head_dim={head_dim})"
    problems = []
    if not qs[:-3] == ks[:-3] == vs[:-3]:
        problems.append("their batch dims differ")
    if not qs[-2] == ks[-2] == vs[-2]:
        problems.append(f"their sequence lengths differ ({qs[-2]}, {ks[-2]}, {vs[-2]}): each rank's q, k and v "
                        f"must be the same tokens")
    if ks[-3] != vs[-3] or qs[-3] % ks[-3]:
        problems.append(f"k and v must have the same number of heads, and it must divide q's ({qs[-3]}); got k "
                        f"{ks[-3]}, v {vs[-3]}")
    if qs[-1] != ks[-1]:
        problems.append(f"q's and k's feature dims differ ({qs[-1]} and {ks[-1]})")
    if problems:
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} {layout}: "
                         + "; ".join(problems))
    return s, h, qs[-3] // ks[-3]


def _check_blocks(what: str, q: torch.Tensor, s: int, blocks: tuple[int, ...], rank: int, group: Any,
                  how: str) -> None:
    if q.shape[s] != blocks[rank]:
        who = f"group rank {rank} (global {global_ranks(group)[rank]})" if group is not None else "this process"
        raise ValueError(
            f"{what}: {who} holds {q.shape[s]} tokens (q {tuple(q.shape)}, seq_dim {s}) but {how} gives it "
            f"{blocks[rank]} (every rank's: {list(blocks)}); shard the sequence with "
            f"cp.split_inputs_cp(x, seq_dim, group{', uneven=True' if 'length' in how else ''})")


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, h: int, groups: int, causal: bool,
           scale: float) -> torch.Tensor:
    """Attention in one process (no ring): SDPA, with K/V heads repeated for GQA."""
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=h) for t in (k, v))
    return sdpa_in_layout(q, k, v, seq_dim=s, head_dim=h, is_causal=causal, scale=scale)


def ring_attention_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any, blocks: Sequence[int],
                          *, causal: bool = False, seq_dim: int = 1, head_dim: int = 2,
                          softmax_scale: float | None = None, what: str = "ring_attention",
                          how: str = "blocks") -> torch.Tensor:
    """ring_attention with explicit per-rank block sizes: group rank i holds ``blocks[i]`` tokens.

    The blocks are contiguous and in group-rank order (for ``causal``, their global positions follow
    from the sizes). usp uses this for ring blocks that are sums of Ulysses shards.
    """
    if cp_group is not None:
        check_group(cp_group, what)
    n = 1 if cp_group is None else cp_group.size()
    s, h, groups = _check_qkv(what, q, k, v, seq_dim, head_dim, n)
    if not isinstance(causal, bool):
        raise TypeError(f"{what}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    blocks = tuple(blocks)
    if len(blocks) != n or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
        raise ValueError(f"{what}: blocks={list(blocks)} must give a positive token count for each of the group's "
                         f"{n} ranks")
    scale = _scale(what, softmax_scale, _feature(q, s, h))
    rank = 0 if cp_group is None else cp_group.rank()
    if n > 1 and debug.enabled():  # first, so that a rank with a wrong shard fails on every rank, not alone
        _debug_check(what, q, s, blocks, cp_group)
    _check_blocks(what, q, s, blocks, rank, cp_group, how)
    if n == 1:
        return _plain(q, k, v, s, h, groups, causal, scale)
    sched = _contiguous_schedule(causal, blocks, rank, q.device)
    call = engine.AttentionCall(s, h, groups, scale, cp_group, sched, transports.Ring.on(None))
    return engine.attend(call, q, k, v)


def _feature(q: torch.Tensor, s: int, h: int) -> int:
    """The feature dim's size: the last dim once the sequence and head dims are taken."""
    return q.movedim((h, s), (-3, -2)).shape[-1]


def _debug_check(what: str, q: torch.Tensor, s: int, blocks: tuple[int, ...], group: Any) -> None:
    """PARALLEL_STATE_DEBUG: every rank checks every rank's q against the block sizes, so all raise together."""
    metas = debug.gather_meta(q, group)
    ranks = global_ranks(group)
    mine = tuple(q.shape[:s]) + tuple(q.shape[s + 1:])
    bad = [f"group rank {i} (global {ranks[i]}): {m.describe()}, {blocks[i]} tokens expected" for i, m in enumerate(metas)
           if m.shape is None or len(m.shape) != q.dim() or m.shape[s] != blocks[i]
           or tuple(m.shape[:s]) + tuple(m.shape[s + 1:]) != mine or m.dtype != metas[0].dtype]
    if bad:
        raise ValueError(f"{what} ({debug.ENV}): q differs across the group from what the block sizes "
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
    point from their owner to exactly the ranks whose queries see them (see ``cp.masked``); one
    small gather checks every rank's token count and plan before any K/V moves, so a mistake raises
    on every rank. ``causal=True`` is the plain path; with a mask, pass ``cp.Mask.causal()`` instead.
    """
    what = "ring_attention"
    if cp_group is not None:
        check_group(cp_group, what)
    n = 1 if cp_group is None else cp_group.size()
    if mask is not None or plan is not None:
        from cp.masked import MaskedArgs

        return _masked_ring(what, q, k, v, cp_group,
                            MaskedArgs(mask, plan, causal, length, seq_dim, head_dim, softmax_scale))
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(what, t, name)
    s = _check_dims(what, q, "q", seq_dim, head_dim, n)[0]
    if length is None:
        blocks, how = (q.shape[s],) * n, "blocks"
    else:
        _check_length(what, length, n)
        blocks, how = shard_sizes(length, n), f"length={length} (cp.shard_sizes({length}, {n}))"
    return ring_attention_blocks(q, k, v, cp_group, blocks, causal=causal, seq_dim=seq_dim, head_dim=head_dim,
                                 softmax_scale=softmax_scale, what=what, how=how)


def _masked_ring(what: str, q: Any, k: Any, v: Any, group: Any, args: Any) -> torch.Tensor:
    """ring_attention with ``mask`` / ``plan`` (``args``, a cp.masked.MaskedArgs): checks, the cached schedule,
    the engine."""
    from cp import masked

    n = 1 if group is None else group.size()
    s, h, _ = _check_qkv(what, q, k, v, args.seq_dim, args.head_dim, n)
    if not isinstance(args.causal, bool):
        raise TypeError(f"{what}: causal must be a bool, got {type(args.causal).__name__} {args.causal!r}")
    if args.length is not None:
        _check_length(what, args.length, n)
    scale = _scale(what, args.scale, _feature(q, s, h))
    given = args.plan
    plan = masked.resolve(what, args, n, q.shape[s])
    rank = 0 if group is None else group.rank()
    sched = masked.schedule(plan, "plan", lambda: plan.positions, rank, q.device)
    layout, fix = masked.layout_words(given, plan, n)
    check = None
    if n > 1:  # started by the engine, judged once this rank's own block is computed, before any K/V moves
        def check(posted: Sequence[int]) -> engine.Confirm:
            return masked.start_agree(what, group, plan, [("q", q.shape[s])], layout, fix,
                                      even=given is None and args.length is None, posted=posted)
    elif q.shape[s] != plan.length:
        raise ValueError(f"{what}: q holds {q.shape[s]} tokens (seq_dim {args.seq_dim}) but the {layout} is for "
                         f"{plan.length}; without a group, pass the whole sequence")
    return masked.attend(q, k, v, sched, group if n > 1 else None, s, h, scale, plan.transport, check)


__all__ = ["ring_attention", "ring_attention_blocks"]
