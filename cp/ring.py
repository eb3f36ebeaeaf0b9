"""Context-parallel attention by passing K/V around a ring ("ring attention").

Each rank keeps its own queries. Its K/V block travels the group's ring (group rank i sends to i + 1)
by point-to-point ``dist.batch_isend_irecv``; at step t a rank attends to the block of group rank
``rank - t``, and the transfer of the next block is started before this block's compute, so the two
overlap. Block results merge by their log-sum-exp (the online softmax), accumulated in float32
(float64 inputs stay float64); the output has the input dtype.

The backward recomputes every block's scores from q, the block's K/V and the saved log-sum-exp.
K/V travel the ring once more, and each block's dK/dV accumulator travels behind it, picking up
every rank's contribution until it is back at the block's owner. No rank ever holds more than one
block of another rank's K/V (two while a transfer is in flight), and nothing of the whole sequence.

Causal attention on the plain contiguous split (group rank i holds the i-th block of the sequence):
a block wholly in a rank's future is neither sent to it nor computed; the rank's own block uses the
causal mask. Rank i so computes i + 1 blocks. (The backward's dK/dV accumulators still go all the way
round, so that every rank takes part in every step's exchange.)

Uneven shards: rank i may hold ``blocks[i]`` tokens, any positive sizes; ``ring_attention(length=L)``
uses ``cp.shard_sizes(L, n)`` (torch.tensor_split's rule), usp passes the sizes of its ring blocks.

K/V may have fewer heads than q (GQA/MQA, query head h uses K/V head h // (Hq / Hkv), as SDPA's
``enable_gqa``): the K/V heads travel as they are, and each K/V head attends for its group of query
heads at once, so nothing is repeated, neither on the wire nor in memory.

A block is computed by torch's fused CPU attention kernel where it applies (CPU tensors, one feature
size for q, k and v; it returns the log-sum-exp the merge needs), else by plain matmuls that hold
the block's scores.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from cp import debug
from cp.blocks import _block_backward, _block_forward, _compute_dtype, _p2p, _wait
from cp.comm import check_group, global_ranks
from cp.layout import _check_dims, _check_length, _scale, sdpa_in_layout
from cp.shard import check_tensor, shard_sizes

#: Tags of the two kinds of message, so that gloo never pairs one kind's send with another's receive.
_TAG_KV, _TAG_DKV = 11, 12
#: Whether CPU blocks use torch's fused kernel (tests switch it off to check the plain one against it).
use_fused_cpu = True


class _Ring:
    """Who holds, computes and sends which block at which step, for one rank of an n-rank ring."""

    def __init__(self, group: Any, blocks: tuple[int, ...], causal: bool):
        self.group, self.blocks, self.causal = group, blocks, causal
        self.n, self.rank = group.size(), group.rank()
        ranks = global_ranks(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.n], ranks[(self.rank - 1) % self.n]

    def source(self, t: int) -> int:
        """The group rank whose K/V block this rank holds at step t."""
        return (self.rank - t) % self.n

    def computes(self, t: int) -> bool:
        """Whether this rank attends to the block it holds at step t (causal: only its past and itself)."""
        return not self.causal or t <= self.rank

    def sends(self, rank: int, t: int) -> bool:
        """Whether group rank ``rank`` passes the K/V block it holds at step t on to rank + 1."""
        if t >= self.n - 1:
            return False
        # Causal: rank + 1 needs the block (rank - t) only while it lies in its past, not wrapped around.
        return not self.causal or (rank < self.n - 1 and t <= rank)


def _kv_transfer(ring: _Ring, t: int, packed: torch.Tensor, sizes: Sequence[int]) -> tuple[list[Any], Any]:
    """Start step t's K/V transfer: send ``packed`` on, receive the block of step t + 1 (if any)."""
    ops, recv = [], None
    if ring.sends(ring.rank, t):
        ops.append(dist.P2POp(dist.isend, packed, ring.next, ring.group, _TAG_KV))
    if ring.sends((ring.rank - 1) % ring.n, t):
        recv = packed.new_empty(sizes[ring.source(t + 1)])
        ops.append(dist.P2POp(dist.irecv, recv, ring.prev, ring.group, _TAG_KV))
    return _p2p(ops), recv


def _unpack(packed: torch.Tensor, k_shape: Sequence[int], v_shape: Sequence[int], length: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of a packed block of ``length`` tokens, in the compute dtype."""
    k_shape = (*k_shape[:-2], length, k_shape[-1])
    v_shape = (*v_shape[:-2], length, v_shape[-1])
    nk = math.prod(k_shape)
    return packed[:nk].view(k_shape).to(dtype), packed[nk:].view(v_shape).to(dtype)


def _packed_sizes(blocks: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> list[int]:
    per_k, per_v = k.numel() // k.shape[-2], v.numel() // v.shape[-2]
    return [b * (per_k + per_v) for b in blocks]


def _diag_mask(q_len: int, groups: int, device: torch.device) -> torch.Tensor:
    """True where a query of the rank's own block must not see a key (it lies in the query's future).

    Rows are the query rows of one K/V head: ``groups`` query heads of ``q_len`` tokens each.
    """
    mask = torch.ones(q_len, q_len, dtype=torch.bool, device=device).triu_(1)
    return mask.repeat(groups, 1)


class _RingAttention(torch.autograd.Function):
    """Ring attention on [..., Hkv, G * S, D] queries and [..., Hkv, S, D] keys and values."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, groups: int,
                scale: float) -> torch.Tensor:
        cd = _compute_dtype(q.dtype)
        sizes = _packed_sizes(ring.blocks, k, v)
        qc = q.to(cd)
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])
        mask = _diag_mask(k.shape[-2], groups, q.device) if ring.causal else None
        acc = lse = None
        for t in range(ring.n):
            works, recv = _kv_transfer(ring, t, packed, sizes)  # overlaps this step's compute
            if ring.computes(t):
                kb, vb = _unpack(packed, k.shape, v.shape, ring.blocks[ring.source(t)], cd)
                bo, bl = _block_forward(qc, kb, vb, scale, mask if t == 0 else None, groups, use_fused_cpu)
                if acc is None:
                    acc, lse = bo, bl
                else:  # the online softmax: weigh both by their share of the merged log-sum-exp
                    new = torch.logaddexp(lse, bl)
                    acc = acc.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(bo.mul_(torch.exp(bl - new).unsqueeze(-1)))
                    lse = new
            _wait(works)
            if recv is not None:
                packed = recv
        out = acc
        ctx.ring, ctx.groups, ctx.scale = ring, groups, scale
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ring, groups, scale = ctx.ring, ctx.groups, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        cd = _compute_dtype(q.dtype)
        sizes = _packed_sizes(ring.blocks, k, v)
        qc, do = q.to(cd), grad.to(cd)
        outc = out.to(cd)
        delta = (do * outc).sum(-1)
        dq = torch.zeros_like(qc)
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])
        mask = _diag_mask(k.shape[-2], groups, q.device) if ring.causal else None
        # The dK/dV accumulators go all the way round (every rank passes one on at every step, also past
        # ranks that add nothing in causal attention): the same exchange everywhere, so no rank waits
        # for a message that a rank ahead of it in the ring is still holding back.
        incoming: torch.Tensor | None = None  # the accumulator of the block held now, from the previous rank
        sending: torch.Tensor | None = None
        dkv_works: list[Any] = []
        for t in range(ring.n):
            works, recv = _kv_transfer(ring, t, packed, sizes)  # overlaps this step's compute
            dkv = None
            if ring.computes(t):
                kb, vb = _unpack(packed, k.shape, v.shape, ring.blocks[ring.source(t)], cd)
                bq, bk, bv = _block_backward(do, qc, kb, vb, outc, lse, delta, scale, mask if t == 0 else None,
                                             groups, use_fused_cpu)
                dq.add_(bq)
                dkv = torch.cat([bk.reshape(-1), bv.reshape(-1)])
            _wait(dkv_works)  # sent by the previous rank after its step t - 1
            if incoming is not None:
                dkv = incoming if dkv is None else dkv.add_(incoming)
            assert dkv is not None  # step 0 always computes the rank's own block
            # Pass it on (after the last step that is to the block's owner); receive the next block's, or
            # after the last step this rank's own, complete.
            sending, incoming = dkv, dkv.new_empty(sizes[ring.source(t + 1)])
            dkv_works = _p2p([dist.P2POp(dist.isend, sending, ring.next, ring.group, _TAG_DKV),
                              dist.P2POp(dist.irecv, incoming, ring.prev, ring.group, _TAG_DKV)])
            _wait(works)
            if recv is not None:
                packed = recv
        _wait(dkv_works)
        del sending
        assert incoming is not None
        nk = k.numel()
        dk_out = incoming[:nk].view(k.shape).to(k.dtype)
        dv_out = incoming[nk:].view(v.shape).to(v.dtype)
        return dq.to(q.dtype), dk_out, dv_out, None, None, None


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
    ring = _Ring(cp_group, blocks, causal)
    # [..., H, S, D] with the K/V head's G query heads side by side: [..., Hkv, G * S, D].
    qc, kc, vc = (t.movedim((h, s), (-3, -2)) for t in (q, k, v))
    hkv, length = kc.shape[-3], qc.shape[-2]
    qg = qc.reshape(*qc.shape[:-3], hkv, groups * length, qc.shape[-1])
    out = _RingAttention.apply(qg, kc.contiguous(), vc.contiguous(), ring, groups, scale)
    out = out.reshape(*qc.shape[:-3], hkv * groups, length, vc.shape[-1])
    return out.movedim((-3, -2), (h, s))


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
    small all-gather first checks every rank's token count and plan, so a mistake raises on every
    rank. ``causal=True`` is the plain path; with a mask, pass ``cp.Mask.causal()`` instead.
    """
    what = "ring_attention"
    if cp_group is not None:
        check_group(cp_group, what)
    n = 1 if cp_group is None else cp_group.size()
    if mask is not None or plan is not None:
        return _masked_ring(what, q, k, v, cp_group, n, causal, mask, plan, length, seq_dim, head_dim, softmax_scale)
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


def _masked_ring(what: str, q: Any, k: Any, v: Any, group: Any, n: int, causal: Any, mask: Any, plan: Any,
                 length: Any, seq_dim: Any, head_dim: Any, softmax_scale: Any) -> torch.Tensor:
    """ring_attention with ``mask`` / ``plan``: checks, the cached schedule, the engine of cp.masked."""
    from cp import masked

    s, h, _ = _check_qkv(what, q, k, v, seq_dim, head_dim, n)
    if not isinstance(causal, bool):
        raise TypeError(f"{what}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    if length is not None:
        _check_length(what, length, n)
    scale = _scale(what, softmax_scale, _feature(q, s, h))
    given = plan
    plan = masked.resolve(what, mask, plan, causal, n, q.shape[s], length)
    rank = 0 if group is None else group.rank()
    sched = masked.schedule(plan, "plan", lambda: plan.positions, rank, q.device)
    layout, fix = masked.layout_words(given, plan, n)
    if n > 1:
        masked.agree(what, group, plan, [("q", q.shape[s])], layout, fix,
                     even=given is None and length is None)
    elif q.shape[s] != plan.length:
        raise ValueError(f"{what}: q holds {q.shape[s]} tokens (seq_dim {seq_dim}) but the {layout} is for "
                         f"{plan.length}; without a group, pass the whole sequence")
    return masked.attend(q, k, v, sched, group if n > 1 else None, s, h, scale)


__all__ = ["ring_attention", "ring_attention_blocks"]
