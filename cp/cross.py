"""Cross attention under context parallelism: every local query attends to all keys of its own sample.

A cross attention's keys are another sequence than its queries (a video's tokens attending to its prompt's
text), and under context parallelism each rank holds its share of both. The keys are short, so they are
gathered: one all-gather of K and V together over the cp group (for ``a2a+p2p`` over its two groups, the cp
rank order ``p2p rank * a2a size + a2a rank``), and in backward their gradients are reduced back to the
ranks that own them (one all-to-all and a sum: a reduce-scatter every backend runs, gloo included). Without a
mask the order of the keys does not matter; packed (thd) samples are told apart by the sample each query and
key belongs to, from their ``cu_seqlens`` and the layout that put them on this rank.

``resolve`` makes a ``CrossCall`` once per distinct call, on this rank alone; ``CrossCall.run`` checks it
across the ranks (``cp.call_check``, Method.CROSS: every rank raises before K/V moves) and attends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

import cp
from cp import call_check, counting, inputs
from cp.layout import sdpa_gqa
from cp.shard import gather_cat


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, h: int, scale: float, *,
           causal: bool = False, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q to k / v in one process, in any layout (``s``, ``h``: the sequence and head dims; GQA as
    ``cp.layout.sdpa_gqa``); ``allowed``: a bool ``[q tokens, k tokens]`` mask, True where a query sees a key."""
    return sdpa_gqa(q, k, v, seq_dim=s, head_dim=h, is_causal=causal, attn_mask=allowed, scale=scale)


class _Gather(torch.autograd.Function):
    """``x`` gathered along ``dim`` over ``groups`` (inner group first); backward: the gradient's shards summed
    over the same groups back to the rank that owns each (a reduce-scatter, outer group first)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, groups: tuple[Any, ...]) -> torch.Tensor:
        ctx.dim, ctx.groups = dim, groups
        for g in groups:
            x = gather_cat(x, dim, g, g.size())
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        for g in reversed(ctx.groups):
            grad = _reduce_scatter(grad, ctx.dim, g)
        return grad, None, None


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Rank r's block of ``x`` along ``dim`` (n equal blocks), summed over the group's ranks: one all-to-all."""
    n = group.size()
    blocks = x.movedim(dim, 0)
    blocks = blocks.reshape(n, blocks.shape[0] // n, *blocks.shape[1:]).contiguous()
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks, group=group)
    return received.sum(0).movedim(0, dim).contiguous()


@dataclass(frozen=True)
class Packed:
    """A thd batch as ``cu_seqlens`` and their padded form give it: each sample's real length and its padded
    start, the padded total."""

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    total: int

    def ids(self, dead: int) -> torch.Tensor:
        """Each position's sample, ``dead`` at padding: int64 ``[total]``."""
        out = torch.full((self.total,), dead, dtype=torch.int64)
        for i, (start, n) in enumerate(zip(self.starts, self.lengths, strict=True)):
            out[start:start + n] = i
        return out


def packed(what: str, side: str, cu: Sequence[int], pad: Sequence[int], tokens: int, n: int) -> Packed:
    """The samples of one side (``"q"`` or ``"kv"``) of a thd call, checked: both boundary lists rise from 0, one
    entry per boundary, each sample within its padded room, and this rank's ``tokens`` hold its share of the
    padded total over ``n`` ranks."""
    lengths = [y - x for x, y in zip(cu[:-1], cu[1:], strict=True)]
    rooms = [y - x for x, y in zip(pad[:-1], pad[1:], strict=True)]
    if len(cu) != len(pad) or len(cu) < 2 or cu[0] != 0 or pad[0] != 0 or any(
            m < 0 or m > room for m, room in zip(lengths, rooms, strict=False)):
        raise ValueError(f"{what}: cu_seqlens_{side} {list(cu)} and cu_seqlens_{side}_padded {list(pad)} must both "
                         f"rise from 0, one entry per sequence boundary, each sequence no longer than its padded room")
    total = pad[-1]
    name = side[0]
    if total == 0 or total % n or tokens < total // n:
        raise ValueError(f"{what}: {name} holds {tokens} tokens but the padded sequences hold {total} over {n} "
                         f"rank(s), {total / n:g} each; pass this rank's tokens of every sequence (TE's "
                         f"thd_get_partitioned_indices)")
    return Packed(tuple(lengths), tuple(pad[:-1]), total)


@dataclass(frozen=True)
class Placement:
    """Where a cross call's tensors are: the sequence and head dims, and for thd the samples of q and of k/v."""

    s: int
    h: int
    q: Packed | None = None
    kv: Packed | None = None


@dataclass(frozen=True)
class CrossCall:
    """One distinct cross-attention call, resolved on this rank: its groups (inner first; none: one process),
    the thd cuts, which local query sees which gathered key, the query rows that see none (output 0), and
    the call its ranks check together (None: one process)."""

    layout: Placement
    scale: float
    groups: tuple[Any, ...]
    q_used: int | None
    kv_used: int | None
    allowed: torch.Tensor | None
    dead: torch.Tensor | None
    check: inputs.Call | None

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of this rank's q to every key of its sample, in q's layout."""
        length, s, h = q.shape[self.layout.s], self.layout.s, self.layout.h
        if self.q_used is not None:
            q, k, v = q[:self.q_used], k[:self.kv_used], v[:self.kv_used]
        if self.check is not None:
            call_check.check(self.check.on(q, k, v), call_check.Method.CROSS)
            # K and V in one gather (their head sizes may differ: joined along the feature dim)
            kv = _Gather.apply(torch.cat([k, v], dim=-1), s, self.groups)
            k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        out = attend(q, k, v, s, h, self.scale, allowed=self.allowed)
        _count(q, k, s, h, self.allowed)
        if self.dead is not None:
            out = out.masked_fill(self.dead, 0)
        if self.q_used is not None and self.q_used < length:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, length - self.q_used))
        return out


def _count(q: torch.Tensor, k: torch.Tensor, s: int, h: int, allowed: torch.Tensor | None) -> None:
    """Record the pairs this rank computed in the open ``cp.count_attention`` blocks."""
    counts = counting.active()
    if not counts:
        return
    batch = q.numel() // (q.shape[s] * q.shape[h] * q.shape[-1])
    pairs = q.shape[s] * k.shape[s] if allowed is None else int(allowed.sum())
    for count in counts:
        count.pairs += batch * q.shape[h] * pairs
        count.calls += 1


def _positions(plan: Any, ranks: Sequence[int]) -> torch.Tensor:
    return torch.cat([plan.index(r) for r in ranks])


def resolve(what: str, layout: Placement, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
            groups: tuple[Any, ...] = (), n: int = 1, rank: int = 0, facts: inputs.Facts | None = None
            ) -> CrossCall:
    """The cross call of q to k / v laid out as ``layout`` says, over ``groups`` (inner first; ``n`` ranks, this one
    cp rank ``rank``), whose ranks check it together with ``facts`` (a face's arguments). thd: each side split
    by TE's DualChunkSwap over its own padded ``cu_seqlens``; sbhd / bshd: any split (no key's place matters)."""
    q_used = kv_used = allowed = dead = None
    if layout.q is not None and layout.kv is not None:
        q_used, kv_used = layout.q.total // n, layout.kv.total // n
        q_ids, kv_ids = layout.q.ids(-1), layout.kv.ids(-2)
        if n > 1:
            try:
                plans = [cp.plan_dual_chunk_swap(cp.Mask.full(), side.total, n, cu_seqlens=side.starts + (side.total,),
                                                 transport=cp.Transport.ALLGATHER) for side in (layout.q, layout.kv)]
            except ValueError as exc:
                raise ValueError(f"{what}: {exc}") from None
            q_ids, kv_ids = q_ids[plans[0].index(rank)], kv_ids[_positions(plans[1], range(n))]
        seen = q_ids[:, None] == kv_ids[None, :]
        blind = ~seen.any(1)
        if bool(blind.any()):  # padding (or a sample without keys): attends anything, then 0
            seen[blind] = True
            dead = blind.view(-1, 1, 1).to(q.device)
        allowed = seen.to(q.device)
    check = None
    if n > 1:
        local = q.shape[layout.s] if q_used is None else q_used
        plan = cp.plan_dispatch(cp.Mask.full(), n * local, n, method=cp.Layout.CONTIGUOUS,
                                transport=cp.Transport.ALLGATHER)
        tensors = inputs.Tensors(q.narrow(layout.s, 0, local), k, v, layout.s, layout.h, layout.s, layout.h)
        check = inputs.Call(what, tensors, groups[0], n, rank, scale, masking=inputs.Masking(plan, True, False),
                            ring_group=groups[1] if len(groups) > 1 else None, facts=facts)
    return CrossCall(layout, scale, groups, q_used, kv_used, allowed, dead, check)


__all__ = ["CrossCall", "Placement", "Packed", "attend", "packed", "resolve"]
