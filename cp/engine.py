"""The one blockwise attention engine of cp: forward and backward over a schedule, the transport a choice.

Every context-parallel attention of cp runs here: ``ring_attention`` (plain, causal, masked),
the masked ring of ``usp_attention`` and, after their all-to-all, the masked attention of
``ulysses_attention`` / ``usp_attention`` on the whole sequence (a group of one). Group rank i holds
the global tokens of its layout; the schedule (``cp.mask_schedule``: built once per mask, layout
and rank, cached) says which block of K/V this rank computes at step t (group rank ``rank - t``'s
tokens that its queries see) and tiles it (full, causal and masked tiles; ``cp.kernels`` computes
each with a fused kernel that returns its log-sum-exp). The backward recomputes every tile from the saved
log-sum-exp. Each tile is one fused call over strided 4-d views of q, k and v ([B, H, S, D], heads before the
sequence: no copies), and its results go where they are needed with as little as it takes (``Cover``):

- rows (or keys) that meet one tile only are written: one tile's result is the pass's as the kernel returned it,
  consecutive runs are concatenated once into the inputs' layout, rows in any other order written at their rows;
- rows that several tiles of several ring steps (blocks) meet merge in float32 (float64 inputs in float64): the
  output by the online softmax, dq and the dK/dV that travel by sums; keys that several tiles of a rank's only
  block meet (one process: chunk-causal's runs all read the first chunk) sum in the kernels' dtype, as autograd
  would over one fused call per run.

The output has the input dtype.

How K/V reach the ranks that need them is the call's transport (``AttentionCall.transport``, a class of
``cp.transports``: ring, p2p or allgather, chosen once per call); the loop below names none. Both passes run
one loop over the steps (``_run_steps``): each pass makes one transport object (the backward also its
``Gradients``), posts what it receives first, starts step t + 1's transfer before step t's compute so that the
two overlap, and waits for it after.

The cross-rank check of a call's inputs (``AttentionCall.check``, ``cp.call_check``) is started on entry
and judged after the rank's own block and before any K/V is sent: a gate (``_Gate``) before the first send,
not a branch of the loop. Where the transport posts its receives
first (p2p on gloo), every pass posts them, then starts one round (the forward's check; in the backward, or
without a check, an empty row) whose table needs every rank's row, each sent after that rank's receives:
so every sender finds its receiver ready. A gloo message that arrives before its receive costs the two
sides' loop threads about 1.3 ms of CPU per 512 KiB on loopback; one whose receive is waiting about 0.3 ms
in all (measured with 2 processes). A failed check completes those receives with empty messages
(``Exchange.drain``) before it raises, so no receive stays posted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from cp import agree, counting, kernels, online_softmax
from cp.mask_schedule import Block, Cover, Schedule, Tile
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


@dataclass(frozen=True)
class _Part:
    """One per-row result of a pass: its whole shape, the dim its rows run along, its dtype, the value of a row
    that no tile computes and the tensor whose memory layout it takes (None: contiguous)."""

    shape: tuple[int, ...]
    dim: int
    dtype: torch.dtype
    fill: float = 0.0
    layout: torch.Tensor | None = None

    def empty(self, device: torch.device) -> torch.Tensor:
        """Uninitialized, laid out as ``layout`` (the input's: so the caller's tensor and its gradient are as SDPA's
        are, and autograd copies none of them into the input's strides)."""
        like = self.layout
        if like is None:
            return torch.empty(self.shape, dtype=self.dtype, device=device)
        if tuple(like.shape) == self.shape:
            return torch.empty_like(like, dtype=self.dtype)
        order = sorted(range(like.dim()), key=lambda d: -like.stride(d))
        made = torch.empty([self.shape[d] for d in order], dtype=self.dtype, device=device)
        return made.permute([order.index(d) for d in range(like.dim())])


class _Written:
    """A pass's per-row results where no row is in two tiles (``Cover`` other than merged): one tile's are the
    pass's as the kernel returned them, consecutive runs are concatenated once, anything else is written at its
    rows (rows no tile computes keep their fill)."""

    def __init__(self, cover: Cover, device: torch.device, *parts: _Part):
        self.cover, self.device, self.parts = cover, device, parts
        self.runs: list[tuple[int, tuple[torch.Tensor, ...]]] = []  # (first row, the tile's results)
        self.written: list[torch.Tensor] | None = None

    def put(self, rows: Any, *results: torch.Tensor) -> None:
        if self.cover is not Cover.ONCE:
            self.runs.append((rows.start, results))
            return
        if self.written is None:
            self.written = [self.blank(p) for p in self.parts]
        for target, p, result in zip(self.written, self.parts, results, strict=True):
            if isinstance(rows, slice):
                target.narrow(p.dim, rows.start, rows.stop - rows.start).copy_(result)
            else:
                target.index_copy_(p.dim, rows, result.to(target.dtype))

    def blank(self, p: _Part) -> torch.Tensor:
        return torch.full(p.shape, p.fill, dtype=p.dtype, device=self.device)

    def results(self) -> list[torch.Tensor]:
        if self.cover is Cover.ONCE:
            return self.written if self.written is not None else [self.blank(p) for p in self.parts]
        runs, self.runs = [r for _, r in sorted(self.runs, key=lambda run: run[0])], []  # the tiles' parts go
        if len(runs) == 1:
            return list(runs[0])
        return [torch.cat([r[i] for r in runs], p.dim, out=p.empty(self.device)) for i, p in enumerate(self.parts)]

    def by_first_row(self, i: int) -> dict[int, torch.Tensor] | None:
        """Result i of each tile by its first row (None unless the tiles are runs)."""
        return {row: r[i] for row, r in self.runs} if self.cover is not Cover.ONCE else None


class _Merged:
    """The forward's output and log-sum-exp where rows meet several tiles: float32 (float64) accumulators merged
    by the online softmax; a first tile that holds every row is copied, not merged."""

    def __init__(self, q: torch.Tensor, dv: int, cd: torch.dtype):
        self.acc = q.new_zeros(*q.shape[:-1], dv, dtype=cd)
        self.lse = q.new_full(q.shape[:-1], float("-inf"), dtype=cd)
        self.fresh = True

    def put(self, rows: Any, out: torch.Tensor, blse: torch.Tensor) -> None:
        if self.fresh and isinstance(rows, slice) and rows.stop - rows.start == self.acc.shape[-2]:
            self.acc.copy_(out)
            self.lse.copy_(blse)
        else:
            a, lo = _rows(self.acc, rows), _rows(self.lse, rows, -1)  # views for a slice, copies for an index
            online_softmax.merge(a, lo, out.to(self.acc.dtype), blse)
            if not isinstance(rows, slice):
                self.acc.index_copy_(-2, rows, a)
                self.lse.index_copy_(-1, rows, lo)
        self.fresh = False

    def results(self) -> list[torch.Tensor]:
        return [self.acc, self.lse]

    def by_first_row(self, i: int) -> None:
        return None


class _Summed:
    """A gradient over rows (or keys) that several tiles touch, summed in its part's dtype: a first part that holds
    every row is taken as the sum so far (the backward computes the widest tiles first)."""

    def __init__(self, part: _Part, device: torch.device):
        self.part, self.device = part, device
        self.total: torch.Tensor | None = None

    def put(self, rows: Any, part: torch.Tensor) -> None:
        if self.total is None:
            if isinstance(rows, slice) and rows.start == 0 and rows.stop == self.part.shape[-2]:
                self.total = part.to(self.part.dtype)
                return
            self.total = self.part.empty(self.device).zero_()
        if isinstance(rows, slice):
            self.total.narrow(-2, rows.start, rows.stop - rows.start).add_(part)
        else:
            self.total.index_add_(-2, rows, part.to(self.part.dtype))

    def results(self) -> list[torch.Tensor]:
        if self.total is None:
            return [torch.zeros(self.part.shape, dtype=self.part.dtype, device=self.device)]
        return [self.total]


def _gradient(cover: Cover, like: torch.Tensor, rows: int, dtype: torch.dtype) -> _Written | _Summed:
    """Where a gradient's tiles go (dq over a rank's rows, dK or dV over a block's keys: ``rows`` of them, in the
    layout of ``like``), in ``dtype``: written where each row is in one tile, summed where rows meet several."""
    part = _Part((*like.shape[:-2], rows, like.shape[-1]), -2, dtype, layout=like)
    return _Summed(part, like.device) if cover is Cover.MERGED else _Written(cover, like.device, part)


def _backward_order(block: Block) -> Sequence[tuple[int, Tile]]:
    """A block's tiles (with their index) in the order the backward computes them: where keys meet several tiles,
    those that see the most keys first (the first one's dK/dV start the sums; the rest add into them)."""
    tiles = list(enumerate(block.tiles))
    if block.column_cover is not Cover.MERGED:
        return tiles
    return sorted(tiles, key=lambda it: it[1].c0 - it[1].c1)


def _tile_kv(kb: torch.Tensor, vb: torch.Tensor, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    if tile.c0 == 0 and tile.c1 == kb.shape[-2]:
        return kb, vb
    return kb[..., tile.c0:tile.c1, :], vb[..., tile.c0:tile.c1, :]


def _mask(choice: kernels.KernelChoice, tile: Tile, device: torch.device) -> torch.Tensor | None:
    """The tile's bool mask, only where the kernel needs one (the reference, or a bias)."""
    return tile.masked_out(device) if choice.needs_mask else None


def _nothing() -> None:
    pass


class _Gate:
    """When a pass's first sends start. With nothing to judge, at once: step 1's transfer overlaps step 0's
    compute. Else after the rank's own block, once the round started on entry (the call's check, or every rank's
    receives posted) is judged: a mismatch raises on every rank before any K/V moves."""

    def __init__(self, kv: Exchange, confirm: Confirm | None, fits: bool = True):
        self.kv, self.confirm, self.fits = kv, confirm, fits

    def before_own_block(self) -> None:
        if self.confirm is None:
            self.kv.start(0)
        elif not self.fits:
            self.confirm(self.kv.drain)  # this rank's own block does not fit its tokens: the check's table says so

    def after_own_block(self) -> None:
        if self.confirm is not None:
            self.confirm(self.kv.drain)
            self.kv.start(0)


def _gate(kv: Exchange, check: StartCheck | None, gradients: Exchange.Gradients | None = None,
          fits: bool = True) -> _Gate:
    """Post the pass's receives (where the transport posts them first: the K/V, and the dK/dV of ``gradients``),
    then start the round after which every rank has posted its own: the call's ``check`` (its row carries the
    bytes posted) or, without one, an empty row. No round where nothing is to be waited for (no check, and
    receives posted step by step)."""
    posted = kv.post_receives()
    if gradients is not None:
        gradients.post_receives()
    if check is not None:
        return _Gate(kv, check(posted), fits)
    if not kv.posts_first:
        return _Gate(kv, None)
    pending = agree.start([0], kv.group)

    def everyone_posted(drain: Callable[[list[list[int]]], None]) -> None:
        pending.table()  # an empty row: nothing to judge, nothing to drain

    return _Gate(kv, everyone_posted)


def _run_steps(kv: Exchange, gate: _Gate, compute: Callable[[int, Block], None],
               settle: Callable[[int, Block | None], None]) -> None:
    """The one loop of both passes over the schedule's steps: step t starts the transfer that overlaps it,
    computes block t (``compute``), hands over what the step made (``settle``) and waits for its transfer. The
    gate opens the first sends after the rank's own block."""
    gate.before_own_block()
    _step(kv, 0, compute, settle, gate.after_own_block)
    for t in range(1, kv.sched.n):
        kv.start(t)
        _step(kv, t, compute, settle)


def _step(kv: Exchange, t: int, compute: Callable[[int, Block], None], settle: Callable[[int, Block | None], None],
          computed: Callable[[], None] = _nothing) -> None:
    block = kv.sched.blocks[t]
    if block is not None:
        compute(t, block)
    computed()
    settle(t, block)
    kv.finish(t)


def _settled(t: int, block: Block | None) -> None:
    """The forward hands nothing over after a step."""


class _Engine(torch.autograd.Function):
    """Attention on [B, Hq, S, D] queries and [B, Hkv, S, D] keys and values of this rank (any strides)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        counts = list(counting.active())
        sched = call.schedule
        cd = kernels.compute_dtype(q.dtype)
        per_row = q.shape[0] * q.shape[1]  # batch x query heads
        kv = call.transport(sched, call.group, k, v, counts)
        cover = sched.row_cover
        sink: _Written | _Merged = (
            _Merged(q, v.shape[-1], cd) if cover is Cover.MERGED else
            _Written(cover, q.device, _Part((*q.shape[:-1], v.shape[-1]), -2, q.dtype, layout=q),
                     _Part(tuple(q.shape[:-1]), -1, cd, float("-inf"))))

        views: dict[int, tuple[torch.Tensor, ...]] = {}  # the own block's tiles' q, k, v: views the backward reads

        def compute(t: int, block: Block) -> None:
            kb, vb = kv.kv(t, block)
            for i, tile in enumerate(block.tiles):
                qt = _rows(q, tile.rows)
                kt, vt = _tile_kv(kb, vb, tile)
                if t == 0 and block.index is None and isinstance(tile.rows, slice):
                    views[i] = (qt, kt, vt)
                choice = kernels.choose_for(qt, kt, vt, tile.kind)
                sink.put(tile.rows, *kernels.forward(choice, qt, kt, vt, call.scale, _mask(choice, tile, q.device)))
                for c in counts:
                    c.pairs += per_row * tile.allowed
                    c.scores += per_row * tile.num_rows * (tile.c1 - tile.c0)

        _run_steps(kv, _gate(kv, call.check, fits=q.shape[-2] == sched.local), compute, _settled)
        for c in counts:
            c.calls += 1
        ctx.tile_lse = sink.by_first_row(1)  # runs: each tile's log-sum-exp, as its backward reads it
        out, lse = sink.results()
        result = out.to(q.dtype)
        ctx.call, ctx.counts, ctx.views = call, counts, views
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        call, counts, tile_lse, views = ctx.call, ctx.counts, ctx.tile_lse, ctx.views
        ctx.tile_lse, ctx.views = None, {}  # not held past this backward (a retained graph's next one slices again)
        sched = call.schedule
        q, k, v, out, lse = ctx.saved_tensors
        cd = kernels.compute_dtype(q.dtype)
        per_row = q.shape[0] * q.shape[1]
        kv = call.transport(sched, call.group, k, v, counts)
        grads = kv.gradients(cd)
        # Gradients that several ring steps (blocks) add up are summed in cd (float32; float64 for float64), the dK/dV
        # that travel too; with one rank the tiles of its one block add up in the kernels' dtype, as autograd over
        # one fused call per tile would.
        wire = cd if sched.n > 1 else None
        dq_sink = _gradient(sched.row_cover, q, q.shape[-2], wire or q.dtype)
        delta: list[torch.Tensor] = []  # rowsum(do * out), made when a tile's kernel reads it (the reference)
        made: dict[int, tuple[_Written | _Summed, _Written | _Summed]] = {}

        def compute(t: int, block: Block) -> None:
            kb, vb = kv.kv(t, block)
            made[t] = sinks = tuple(_gradient(block.column_cover, x, block.size, wire or x.dtype)
                                    for x in (kb, vb))  # type: ignore[assignment]
            for i, tile in _backward_order(block):
                rows = tile.rows
                seen = views.get(i) if t == 0 else None
                qt, kt, vt = seen if seen is not None else (_rows(q, rows), *_tile_kv(kb, vb, tile))
                choice = kernels.choose_for(qt, kt, vt, tile.kind)
                if choice.name is kernels.Kernel.MATH and not delta:
                    delta.append((grad.to(cd) * out.to(cd)).sum(-1))
                bq, bk, bv = kernels.backward(
                    choice, _rows(grad, rows), qt, kt, vt, _rows(out, rows),
                    tile_lse[rows.start] if tile_lse is not None else _rows(lse, rows, -1),
                    _rows(delta[0], rows, -1) if delta else None, call.scale, _mask(choice, tile, q.device))
                dq_sink.put(rows, bq)
                keys = slice(tile.c0, tile.c1)
                sinks[0].put(keys, bk if wire is None else bk.to(wire))
                sinks[1].put(keys, bv if wire is None else bv.to(wire))
                del bq, bk, bv  # before the next tile's kernel allocates its own
                for c in counts:
                    c.backward_pairs += per_row * tile.allowed

        def settle(t: int, block: Block | None) -> None:
            if block is None:
                grads.add(t, None, None, None)
                return
            dk_sink, dv_sink = made.pop(t)
            grads.add(t, block, dk_sink.results()[0], dv_sink.results()[0])

        _run_steps(kv, _gate(kv, None, grads), compute, settle)
        dk, dv = grads.result()
        (dq,) = dq_sink.results()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def attend(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention for q, k, v in the call's layout, K/V heads dividing q's (GQA); this rank's output in q's layout.
    Every rank of ``call.group`` (None: one process) must call it with the same schedule's plan and transport.
    The engine reads strided views of the inputs (heads before the sequence), as the fused kernels take them."""
    s, h = call.seq_dim, call.head_dim
    moved = [t.movedim((h, s), (-3, -2)) for t in (q, k, v)]
    lead = moved[0].shape[:-3]
    out = _Engine.apply(*map(kernels.as_input, moved), call)
    if len(lead) != 1:  # the kernels' one batch dim back to the caller's
        out = out.reshape(*lead, *out.shape[-3:])
    return out.movedim((-3, -2), (h, s))


__all__ = ["AttentionCall", "attend"]
