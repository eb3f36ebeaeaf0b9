"""Attention under a mask (``cp.Mask``) on a dispatched token layout (``cp.DispatchPlan``).

The engine behind ``mask=`` / ``plan=`` of ``ring_attention``, ``ulysses_attention`` and
``usp_attention``. Group rank i holds the global tokens ``positions[i]`` (in that order); the
schedule (``cp.mask_schedule``, built once per mask and layout and cached) says which of its K/V
each other rank needs. K/V then travel point to point, straight from their owner to each rank that
needs them and to no other: at step t a rank sends the tokens rank + t needs to rank + t and
receives those it needs from rank - t, and the transfer of step t + 1 starts before the block of
step t is computed, so the two overlap. A block is computed tile by tile (a fully allowed tile
without a mask, the others with a mask built from the key intervals of their rows), results merge
by log-sum-exp as in the ring, sums in float32 (float64 inputs in float64).

Backward recomputes every tile from the saved log-sum-exp; the K/V come again the same way, and the
dK/dV of a received block goes straight back to its owner (one message per block), which adds it to
its own. No rank holds more than two other ranks' K/V at once (one computed, one in flight).

With one rank (``group=None``) this is plain masked attention over the whole sequence, the tokens
in any order: Ulysses uses it on the whole sequence it holds after its all-to-all.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from cp import counting, mask_schedule
from cp.blocks import _block_backward, _block_forward, _compute_dtype, _p2p, _wait
from cp.comm import all_gather_into, global_ranks, meta_device
from cp.mask_schedule import Block, Schedule, Tile

#: Message tags of K/V and of their gradients (the ring's are 11 and 12).
_TAG_KV, _TAG_DKV = 13, 14
#: Whether CPU tiles use torch's fused kernel (tests switch it off to check the plain one against it).
use_fused_cpu = True


# ----------------------------------------------------------------------------- arguments


def _ps() -> Any:
    import parallel_state

    return parallel_state


def resolve(what: str, mask: Any, plan: Any, causal: Any, n: int, local: int, length: int | None) -> Any:
    """The plan to attend by, from ``mask`` / ``plan`` / ``causal``: the plan itself, or with a mask alone the
    contiguous split of ``length`` (default: ``n * local``) tokens. Errors name what is wrong and what to pass."""
    ps = _ps()
    if causal:
        raise ValueError(f"{what}: causal=True cannot be combined with mask= or plan=; pass mask=cp.Mask.causal() "
                         f"(and a plan made for it) instead")
    if mask is not None and not isinstance(mask, ps.AttentionMask):
        raise TypeError(f"{what}: mask must be a cp.Mask (parallel_state.AttentionMask) or None, got "
                        f"{type(mask).__name__}; build one with cp.Mask.causal(), cp.Mask.chunk_causal(chunk), ...")
    if plan is not None:
        if not isinstance(plan, ps.DispatchPlan):
            raise TypeError(f"{what}: plan must be a cp.DispatchPlan (from cp.plan_dispatch) or None, got "
                            f"{type(plan).__name__}")
        if mask is not None and mask != plan.mask:
            raise ValueError(f"{what}: mask={mask!r} differs from the plan's mask {plan.mask!r}; pass the plan alone "
                             f"(its mask is used), or make the plan for this mask with cp.plan_dispatch")
        if plan.cp_size != n:
            raise ValueError(f"{what}: the plan is for {plan.cp_size} rank(s) but the group has {n}; make the plan "
                             f"for this group with cp.plan_dispatch(mask, {plan.length}, {n})")
        if length is not None and length != plan.length:
            raise ValueError(f"{what}: length={length} but the plan is for {plan.length} tokens; leave length out "
                             f"(the plan knows it) or make the plan for {length} tokens")
        return plan
    total = n * local if length is None else length
    try:  # the plain contiguous split (plans are cached by plan_dispatch)
        return ps.plan_dispatch(mask, total, n, method="contiguous")
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


def layout_words(given: Any, plan: Any, n: int) -> tuple[str, str]:
    """How errors name the layout and how to fix a wrong token count: a plan given, or the contiguous split."""
    if given is not None:
        return "plan", "give each rank the tokens cp.dispatch(x, plan, seq_dim, group) gives it"
    return (f"contiguous split of {plan.length} tokens (cp.shard_sizes({plan.length}, {n}))",
            "shard the sequence with cp.split_inputs_cp(x, seq_dim, group, uneven=True) and pass length=")


def schedule(plan: Any, positions_key: Any, positions: Any, rank: int, device: torch.device) -> Schedule:
    """The cached schedule of group rank ``rank`` for ``plan``'s mask on the layout ``positions`` (a function
    of the plan and ``positions_key``, called only when the schedule is built), its indices on ``device``."""
    def make() -> Schedule:
        if device.type == "cpu":
            return mask_schedule.build(plan.mask, plan.length, positions(), rank)
        return schedule(plan, positions_key, positions, rank, torch.device("cpu")).to(device)

    return mask_schedule.cached(plan, (positions_key, rank, str(device)), make)


def agree(what: str, group: Any, plan: Any, named: Sequence[tuple[str, int]], layout: str, fix: str,
          even: bool = False) -> None:
    """One small all-gather: raise the same ValueError on every rank unless every rank passed the same ``plan``
    and group rank i holds ``plan.sizes[i]`` tokens in each of ``named`` (name, this rank's count).

    ``even``: no plan and no length were given, so every rank must hold the same number of tokens.
    """
    n, want = group.size(), plan.sizes
    mine = torch.tensor([plan.fingerprint()] + [size for _, size in named], dtype=torch.int64,
                        device=meta_device(group))
    rows = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
    all_gather_into(rows, mine, group)
    table = rows.view(n, mine.numel()).tolist()
    ranks = global_ranks(group)
    counts = [row[1] for row in table]
    if even and len(set(counts)) > 1:
        raise ValueError(f"{what}: the ranks hold different numbers of tokens ({counts} by group rank); for uneven "
                         f"shards pass length= (the whole sequence's) or a plan")
    if len({row[0] for row in table}) > 1:
        raise ValueError(f"{what}: the ranks passed different masks or plans (checksums by group rank: "
                         f"{[row[0] for row in table]}); pass the same mask and plan on every rank")
    bad = [f"group rank {i} (global {ranks[i]}) holds {row[c]} tokens of {name}, the {layout} gives it {want[i]}"
           for i, row in enumerate(table) for c, (name, _) in enumerate(named, start=1) if row[c] != want[i]]
    if bad:
        raise ValueError(f"{what}: {'; '.join(bad)} (every rank's: {list(want)}); {fix}")


def agree_usp(what: str, ulysses_group: Any, ring_group: Any, plan: Any, named: Sequence[tuple[str, int]], fix: str,
              even: bool = False) -> None:
    """``agree`` over the cp group that the Ulysses and ring groups span (cp rank = ring rank * u + ulysses rank),
    with one small all-gather in each: the same ValueError on every rank for a wrong token count or plan."""
    u, j, fingerprint = ulysses_group.size(), ring_group.rank(), plan.fingerprint()
    device = meta_device(ulysses_group)
    mine = torch.tensor([fingerprint] + [size for _, size in named], dtype=torch.int64, device=device)
    rows = torch.empty(u * mine.numel(), dtype=torch.int64, device=device)
    all_gather_into(rows, mine, ulysses_group)
    table = rows.view(u, mine.numel()).tolist()
    # This Ulysses group's summary: [checksum, checksums differ, wrong counts, first wrong (cp rank, tensor, count),
    # fewest and most tokens of q].
    wrong = [(j * u + a, c, row[c]) for a, row in enumerate(table) for c in range(1, len(row))
             if row[c] != plan.sizes[j * u + a]]
    first = wrong[0] if wrong else (-1, 0, 0)
    counts = [row[1] for row in table]
    summary = torch.tensor([fingerprint, len({row[0] for row in table}) > 1, len(wrong), *first, min(counts),
                            max(counts)], dtype=torch.int64, device=device)
    r = ring_group.size()
    rows = torch.empty(r * summary.numel(), dtype=torch.int64, device=device)
    all_gather_into(rows, summary, ring_group)
    groups = rows.view(r, summary.numel()).tolist()
    if even and min(g[6] for g in groups) != max(g[7] for g in groups):
        raise ValueError(f"{what}: the cp ranks hold different numbers of tokens (from {min(g[6] for g in groups)} to "
                         f"{max(g[7] for g in groups)}); for uneven shards pass length= (the whole sequence's) or a plan")
    if any(g[1] for g in groups) or len({g[0] for g in groups}) > 1:
        raise ValueError(f"{what}: the ranks passed different masks or plans; pass the same mask and plan on every "
                         f"rank")
    bad = [f"cp rank {g[3]} holds {g[5]} tokens of {named[g[4] - 1][0]}, the plan gives it {plan.sizes[g[3]]}"
           + (f" ({g[2] - 1} more wrong in its Ulysses group)" if g[2] > 1 else "") for g in groups if g[2]]
    if bad:
        raise ValueError(f"{what}: {'; '.join(bad)} (every cp rank's: {list(plan.sizes)}); {fix}")


# ----------------------------------------------------------------------------- the computation


def _rows(x: torch.Tensor, rows: Any) -> torch.Tensor:
    """The query rows ``rows`` (a slice or an index) of [..., S, D] (``x[..., rows, :]``)."""
    return x[..., rows, :] if isinstance(rows, slice) else x.index_select(-2, rows)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[..., Hkv, G, R, D] as [..., Hkv, G * R, D]: the rows of one K/V head, as the block kernels take them."""
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def _mask_rows(tile: Tile, groups: int, device: torch.device) -> torch.Tensor | None:
    masked = tile.masked_out(device)
    return masked if masked is None or groups == 1 else masked.repeat(groups, 1)


def _merge(acc: torch.Tensor, lse: torch.Tensor, rows: Any, out: torch.Tensor, blse: torch.Tensor) -> None:
    """Merge a tile's normalized output and log-sum-exp into rows ``rows`` of the running ones (online softmax)."""
    if isinstance(rows, slice):
        a, lo = acc[..., rows, :], lse[..., rows]
    else:
        a, lo = acc.index_select(-2, rows), lse.index_select(-1, rows)
    new = torch.logaddexp(lo, blse)
    a = a.mul_(torch.exp(lo - new).unsqueeze(-1)).add_(out.mul_(torch.exp(blse - new).unsqueeze(-1)))
    if isinstance(rows, slice):
        lo.copy_(new)
    else:
        acc.index_copy_(-2, rows, a)
        lse.index_copy_(-1, rows, new)


def _add_rows(total: torch.Tensor, rows: Any, part: torch.Tensor) -> None:
    if isinstance(rows, slice):
        total[..., rows, :] += part
    else:
        total.index_add_(-2, rows, part)


class _Comm:
    """This rank's side of the exchange: who is who, what goes into a message, and the counts to tell."""

    def __init__(self, sched: Schedule, group: Any, k: torch.Tensor, v: torch.Tensor, counts: list[Any]):
        self.sched, self.group, self.k, self.v, self.counts = sched, group, k, v, counts
        self.ranks = global_ranks(group) if group is not None else [0]
        self.per_k, self.per_v = k[..., :1, :].numel(), v[..., :1, :].numel()  # elements per token
        self._whole: torch.Tensor | None = None

    def pack(self, index: torch.Tensor | None) -> torch.Tensor:
        """This rank's K and V of the tokens ``index`` (None: all), in one flat buffer."""
        if index is None:
            if self._whole is None:
                self._whole = torch.cat([self.k.reshape(-1), self.v.reshape(-1)])
            return self._whole
        return torch.cat([self.k.index_select(-2, index).reshape(-1), self.v.index_select(-2, index).reshape(-1)])

    def unpack(self, packed: torch.Tensor, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k_shape, v_shape = (*self.k.shape[:-2], size, self.k.shape[-1]), (*self.v.shape[:-2], size, self.v.shape[-1])
        nk = math.prod(k_shape)
        return packed[:nk].view(k_shape).to(dtype), packed[nk:].view(v_shape).to(dtype)

    def own(self, block: Block, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of this rank's own block (its tokens that its queries see, in position order)."""
        if block.index is None:
            return self.k.to(dtype), self.v.to(dtype)
        return self.k.index_select(-2, block.index).to(dtype), self.v.index_select(-2, block.index).to(dtype)

    def post_kv(self, t: int) -> tuple[list[Any], torch.Tensor | None]:
        """Start step t's K/V transfer (send to rank + t, receive from rank - t); (works, receive buffer)."""
        sched = self.sched
        if t == 0 or t >= sched.n:
            return [], None
        ops, recv = [], None
        send, block = sched.sends[t], sched.blocks[t]
        if send is not None:
            packed = self.pack(send.index)
            ops.append(dist.P2POp(dist.isend, packed, self.ranks[send.dest], self.group, _TAG_KV))
            self.tell("kv_sent", send.dest, packed)
        if block is not None:
            recv = self.k.new_empty(block.size * (self.per_k + self.per_v))
            ops.append(dist.P2POp(dist.irecv, recv, self.ranks[block.source], self.group, _TAG_KV))
            self.tell("kv_received", block.source, recv)
        return _p2p(ops), recv

    def tell(self, table: str, peer: int, tensor: torch.Tensor) -> None:
        for c in self.counts:
            c.add(getattr(c, table), self.ranks[peer], tensor.numel() * tensor.element_size())


class _MaskedAttention(torch.autograd.Function):
    """Masked attention on [..., Hkv, G, S, D] queries and [..., Hkv, S, D] keys and values of this rank."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sched: Schedule, group: Any,
                scale: float) -> torch.Tensor:
        counts = list(counting.active())
        cd = _compute_dtype(q.dtype)
        groups, per_row = q.shape[-3], math.prod(q.shape[:-2])  # query heads per K/V head; batch x query heads
        comm = _Comm(sched, group, k, v, counts)
        qc = q.to(cd)
        acc = qc.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = qc.new_full(q.shape[:-1], float("-inf"))
        works, recv = [], None
        for t in range(sched.n):
            current = recv
            works, recv = comm.post_kv(t + 1)  # overlaps this step's compute
            block = sched.blocks[t]
            if block is not None:
                kb, vb = comm.own(block, cd) if t == 0 else comm.unpack(current, block.size, cd)
                for tile in block.tiles:
                    qt = _flat(_rows(qc, tile.rows))
                    out, blse = _block_forward(qt, kb[..., tile.c0:tile.c1, :], vb[..., tile.c0:tile.c1, :], scale,
                                               _mask_rows(tile, groups, q.device), groups, use_fused_cpu, diag=False)
                    rows = tile.num_rows
                    _merge(acc, lse, tile.rows, out.reshape(*q.shape[:-2], rows, v.shape[-1]),
                           blse.reshape(*q.shape[:-2], rows))
                    for c in counts:
                        c.pairs += per_row * tile.allowed
                        c.scores += per_row * rows * (tile.c1 - tile.c0)
            _wait(works)
        for c in counts:
            c.calls += 1
        result = acc.to(q.dtype)
        ctx.sched, ctx.group, ctx.scale, ctx.counts = sched, group, scale, counts
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        sched, group, scale, counts = ctx.sched, ctx.group, ctx.scale, ctx.counts
        q, k, v, out, lse = ctx.saved_tensors
        cd = _compute_dtype(q.dtype)
        groups, per_row = q.shape[-3], math.prod(q.shape[:-2])
        comm = _Comm(sched, group, k, v, counts)
        qc, do, outc = q.to(cd), grad.to(cd), out.to(cd)
        delta = (do * outc).sum(-1)
        dq = torch.zeros_like(qc)
        dk, dv = k.new_zeros(k.shape, dtype=cd), v.new_zeros(v.shape, dtype=cd)
        nk = k[..., :1, :].numel()
        works, recv = [], None
        grad_works: list[Any] = []
        pending: tuple[torch.Tensor, Any] | None = None  # (received dK/dV, the tokens they belong to)
        for t in range(sched.n):
            current = recv
            works, recv = comm.post_kv(t + 1)
            block = sched.blocks[t]
            ops = []
            if block is not None:
                kb, vb = comm.own(block, cd) if t == 0 else comm.unpack(current, block.size, cd)
                dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
                for tile in block.tiles:
                    rows, c0, c1 = tile.rows, tile.c0, tile.c1
                    n_rows = tile.num_rows
                    bq, bk, bv = _block_backward(_flat(_rows(do, rows)), _flat(_rows(qc, rows)), kb[..., c0:c1, :],
                                                 vb[..., c0:c1, :], _flat(_rows(outc, rows)),
                                                 _rows(lse.unsqueeze(-1), rows).squeeze(-1).flatten(-2),
                                                 _rows(delta.unsqueeze(-1), rows).squeeze(-1).flatten(-2), scale,
                                                 _mask_rows(tile, groups, q.device), groups, use_fused_cpu, diag=False)
                    _add_rows(dq, rows, bq.reshape(*q.shape[:-2], n_rows, q.shape[-1]))
                    dkb[..., c0:c1, :] += bk
                    dvb[..., c0:c1, :] += bv
                    for c in counts:
                        c.backward_pairs += per_row * tile.allowed
                if t == 0:
                    _add_tokens(dk, dv, block.index, dkb, dvb)
                else:  # straight back to the owner
                    packed = torch.cat([dkb.reshape(-1), dvb.reshape(-1)])
                    ops.append(dist.P2POp(dist.isend, packed, comm.ranks[block.source], group, _TAG_DKV))
                    comm.tell("grad_sent", block.source, packed)
            send = sched.sends[t] if t else None
            incoming = None
            if send is not None:  # the dK/dV of the tokens this rank sent rank + t at this step
                incoming = dq.new_empty(send.size * (comm.per_k + comm.per_v))
                ops.append(dist.P2POp(dist.irecv, incoming, comm.ranks[send.dest], group, _TAG_DKV))
                comm.tell("grad_received", send.dest, incoming)
            _wait(grad_works)  # the previous step's gradients, received while this step computed
            if pending is not None:
                _add_packed(dk, dv, pending, nk)
            grad_works = _p2p(ops)
            pending = None if send is None else (incoming, send)
            _wait(works)
        _wait(grad_works)
        if pending is not None:
            _add_packed(dk, dv, pending, nk)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _add_tokens(dk: torch.Tensor, dv: torch.Tensor, index: torch.Tensor | None, gk: torch.Tensor,
                gv: torch.Tensor) -> None:
    """Add the gradients of this rank's tokens ``index`` (None: all, in order) into its dK and dV."""
    if index is None:
        dk += gk
        dv += gv
    else:
        dk.index_add_(-2, index, gk)
        dv.index_add_(-2, index, gv)


def _add_packed(dk: torch.Tensor, dv: torch.Tensor, pending: tuple[torch.Tensor, Any], per_k: int) -> None:
    packed, send = pending
    nk = per_k * send.size
    gk = packed[:nk].view(*dk.shape[:-2], send.size, dk.shape[-1])
    gv = packed[nk:].view(*dv.shape[:-2], send.size, dv.shape[-1])
    _add_tokens(dk, dv, send.index, gk, gv)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sched: Schedule, group: Any, s: int, h: int,
           scale: float) -> torch.Tensor:
    """Masked attention for q, k, v in layout (seq dim ``s``, head dim ``h``), K/V heads dividing q's (GQA);
    this rank's output in q's layout. Every rank of ``group`` (None: one process) must call it."""
    qc, kc, vc = (t.movedim((h, s), (-3, -2)) for t in (q, k, v))
    hkv, length = kc.shape[-3], qc.shape[-2]
    groups = qc.shape[-3] // hkv
    qg = qc.reshape(*qc.shape[:-3], hkv, groups, length, qc.shape[-1])
    out = _MaskedAttention.apply(qg, kc.contiguous(), vc.contiguous(), sched, group, scale)
    out = out.reshape(*qc.shape[:-3], hkv * groups, length, vc.shape[-1])
    return out.movedim((-3, -2), (h, s))
