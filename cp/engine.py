"""The one blockwise attention engine of cp: forward and backward over a schedule, the transport a choice.

Every context-parallel attention of cp runs here: ``ring_attention`` (plain, causal, masked),
the masked ring of ``usp_attention`` and, after their all-to-all, the masked attention of
``ulysses_attention`` / ``usp_attention`` on the whole sequence (a group of one). Group rank i holds
the global tokens of its layout; the schedule (``cp.mask_schedule``: built once per mask, layout
and rank, cached) says which block of K/V this rank computes at step t (group rank ``rank - t``'s
tokens that its queries see) and tiles it (full, causal and masked tiles; ``cp.kernels`` computes
each with a fused kernel that returns its log-sum-exp). Tiles merge by the online softmax,
accumulated in float32 (float64 inputs in float64); the output has the input dtype. The backward
recomputes every tile from the saved log-sum-exp.

How K/V reach the ranks that need them is the call's transport (``AttentionCall.transport``, a class of
``cp.transports``: ring, p2p or allgather, chosen once per call); the loops below name none. Each pass
makes one transport object (the backward also its ``Gradients``), posts what it receives first, starts
step t + 1's transfer before step t's compute so that the two overlap, and waits for it after.

The cross-rank check of a call's inputs (``AttentionCall.check``, ``cp.call_check``) is started on entry
and judged after the rank's own block and before any K/V is sent. Where the transport posts its receives
first (p2p on gloo), every pass posts them, then starts one round (the forward's check; in the backward, or
without a check, an empty row) whose table needs every rank's row, each sent after that rank's receives:
so every sender finds its receiver ready. A gloo message that arrives before its receive costs the two
sides' loop threads about 1.3 ms of CPU per 512 KiB on loopback; one whose receive is waiting about 0.3 ms
in all (measured with 2 processes). A failed check completes those receives with empty messages
(``Exchange.drain``) before it raises, so no receive stays posted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from cp import agree, counting, kernels, online_softmax
from cp.mask_schedule import Schedule, Tile
from cp.transports import Exchange

#: A started cross-rank check (``cp.call_check``): waits for every rank's row and raises the same ValueError on
#: every rank on a mismatch, calling its argument first with every rank's posted bytes.
Confirm = Callable[[Callable[[list[list[int]]], None]], None]
#: Starts the check, given the bytes this rank has posted receives for from each group rank.
StartCheck = Callable[[Sequence[int]], Confirm]


@dataclass(frozen=True)
class AttentionCall:
    """The facts of one attention call that its internals need.

    q, k, v are laid out with the sequence at dim ``seq_dim`` and the heads at ``head_dim`` (the
    last remaining dim is the feature dim); ``groups`` query heads share one K/V head (GQA);
    ``scale`` multiplies the scores. ``group``: the ranks attending together (None: one process);
    ``schedule``: this rank's part; ``transport``: the class moving the K/V (``cp.transports.choose``).
    ``check``: starts the cross-rank check of the call's inputs; the forward starts it on entry and judges
    it once the rank's own block is computed and before any K/V is sent, so its round trip overlaps that
    compute and a mismatch raises on every rank before anything is sent.
    """

    seq_dim: int
    head_dim: int
    groups: int
    scale: float
    group: Any
    schedule: Schedule
    transport: type[Exchange]
    check: StartCheck | None = None


def _rows(x: torch.Tensor, rows: Any, dim: int = -2) -> torch.Tensor:
    """The query rows ``rows`` (a slice or an index) of x along ``dim``."""
    if isinstance(rows, slice):
        return x.narrow(dim, rows.start, rows.stop - rows.start)
    return x.index_select(dim, rows)


def _merge(acc: torch.Tensor, lse: torch.Tensor, rows: Any, out: torch.Tensor, blse: torch.Tensor) -> None:
    """Merge a tile's normalized output and log-sum-exp into rows ``rows`` of the running ones (online softmax)."""
    a, lo = _rows(acc, rows), _rows(lse, rows, -1)  # views for a slice, copies for an index
    online_softmax.merge(a, lo, out, blse)
    if not isinstance(rows, slice):
        acc.index_copy_(-2, rows, a)
        lse.index_copy_(-1, rows, lo)


def _add_rows(total: torch.Tensor, rows: Any, part: torch.Tensor) -> None:
    if isinstance(rows, slice):
        total[..., rows, :] += part
    else:
        total.index_add_(-2, rows, part)


def _tile_kv(kb: torch.Tensor, vb: torch.Tensor, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    if tile.c0 == 0 and tile.c1 == kb.shape[-2]:
        return kb, vb
    return kb[..., tile.c0:tile.c1, :], vb[..., tile.c0:tile.c1, :]


def _mask(choice: kernels.KernelChoice, tile: Tile, device: torch.device) -> torch.Tensor | None:
    """The tile's bool mask, only where the kernel needs one (the reference, or a bias)."""
    return tile.masked_out(device) if choice.needs_mask else None


def _receives_first(kv: Exchange, check: StartCheck | None, gradients: Exchange.Gradients | None = None
                    ) -> Confirm | None:
    """Post the pass's receives (where the transport posts them first: the K/V, and the dK/dV of ``gradients``),
    then start the round after which every rank has posted its own: the call's ``check`` (its row carries the
    bytes posted) or, without one, an empty row. The pass judges it after its own block, then sends. None where
    nothing is to be waited for (no check, and receives posted step by step)."""
    posted = kv.post_receives()
    if gradients is not None:
        gradients.post_receives()
    if check is not None:
        return check(posted)
    if not kv.posts_first:
        return None
    pending = agree.start([0], kv.group)

    def everyone_posted(drain: Callable[[list[list[int]]], None]) -> None:
        pending.table()  # an empty row: nothing to judge, nothing to drain

    return everyone_posted


class _Engine(torch.autograd.Function):
    """Attention on [..., Hkv, G, S, D] queries and [..., Hkv, S, D] keys and values of this rank."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        counts = list(counting.active())
        sched = call.schedule
        cd = kernels.compute_dtype(q.dtype)
        per_row = math.prod(q.shape[:-2])  # batch x query heads
        kv = call.transport(sched, call.group, k, v, counts)
        acc = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=cd)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=cd)
        fresh = True  # nothing merged yet: a first tile of every row is the result so far
        confirm = _receives_first(kv, call.check)
        if confirm is not None and call.check is not None and q.shape[-2] != sched.local:
            confirm(kv.drain)  # this rank's own block does not fit its tokens: the check's table says so
        for t in range(sched.n):
            if t or confirm is None:
                kv.start(t)  # overlaps this step's compute
            block = sched.blocks[t]
            if block is not None:
                kb, vb = kv.kv(t, block)
                for tile in block.tiles:
                    qt = _rows(q, tile.rows)
                    kt, vt = _tile_kv(kb, vb, tile)
                    choice = kernels.choose_for(qt, kt, vt, tile.kind)
                    out, blse = kernels.forward(choice, qt, kt, vt, call.scale, _mask(choice, tile, q.device))
                    if fresh and tile.num_rows == q.shape[-2] and isinstance(tile.rows, slice):
                        acc.copy_(out)
                        lse.copy_(blse)
                    else:
                        _merge(acc, lse, tile.rows, out.to(cd), blse)
                    fresh = False
                    for c in counts:
                        c.pairs += per_row * tile.allowed
                        c.scores += per_row * tile.num_rows * (tile.c1 - tile.c0)
            if t == 0 and confirm is not None:
                confirm(kv.drain)  # every rank's inputs agree: now the K/V may move
                kv.start(0)
            kv.finish(t)
        for c in counts:
            c.calls += 1
        result = acc.to(q.dtype)
        ctx.call, ctx.counts = call, counts
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        call, counts = ctx.call, ctx.counts
        sched = call.schedule
        q, k, v, out, lse = ctx.saved_tensors
        cd = kernels.compute_dtype(q.dtype)
        per_row = math.prod(q.shape[:-2])
        kv = call.transport(sched, call.group, k, v, counts)
        grads = kv.gradients(cd)
        do = grad.contiguous()
        delta = (do.to(cd) * out.to(cd)).sum(-1)
        dq = q.new_zeros(q.shape, dtype=cd)
        ready = _receives_first(kv, None, grads)
        for t in range(sched.n):
            if t or ready is None:
                kv.start(t)
            block = sched.blocks[t]
            dkb = dvb = None
            if block is not None:
                kb, vb = kv.kv(t, block)
                for tile in block.tiles:
                    rows = tile.rows
                    kt, vt = _tile_kv(kb, vb, tile)
                    qt = _rows(q, rows)
                    choice = kernels.choose_for(qt, kt, vt, tile.kind)
                    bq, bk, bv = kernels.backward(choice, _rows(do, rows), qt, kt, vt, _rows(out, rows),
                                                  _rows(lse, rows, -1), _rows(delta, rows, -1), call.scale,
                                                  _mask(choice, tile, q.device))
                    _add_rows(dq, rows, bq.to(cd))
                    if dkb is None and tile.c0 == 0 and tile.c1 == block.size:
                        dkb, dvb = bk.to(cd), bv.to(cd)
                    else:
                        if dkb is None or dvb is None:
                            dkb = kb.new_zeros(kb.shape, dtype=cd)
                            dvb = vb.new_zeros(vb.shape, dtype=cd)
                        dkb[..., tile.c0:tile.c1, :] += bk
                        dvb[..., tile.c0:tile.c1, :] += bv
                    for c in counts:
                        c.backward_pairs += per_row * tile.allowed
                if dkb is None or dvb is None:  # a block without tiles (no query sees it) adds nothing
                    dkb, dvb = kb.new_zeros(kb.shape, dtype=cd), vb.new_zeros(vb.shape, dtype=cd)
            if t == 0 and ready is not None:
                ready(kv.drain)  # every rank has posted its receives
                kv.start(0)
            grads.add(t, block, dkb, dvb)
            kv.finish(t)
        dk, dv = grads.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def attend(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention for q, k, v in the call's layout, K/V heads dividing q's (GQA); this rank's output in q's layout.
    Every rank of ``call.group`` (None: one process) must call it with the same schedule's plan and transport."""
    s, h = call.seq_dim, call.head_dim
    qc, kc, vc = (t.movedim((h, s), (-3, -2)) for t in (q, k, v))
    hkv, length = kc.shape[-3], qc.shape[-2]
    qg = qc.reshape(*qc.shape[:-3], hkv, call.groups, length, qc.shape[-1])
    out = _Engine.apply(qg, kc.contiguous(), vc.contiguous(), call)
    out = out.reshape(*qc.shape[:-3], hkv * call.groups, length, vc.shape[-1])
    return out.movedim((-3, -2), (h, s))


__all__ = ["AttentionCall", "attend"]
