"""``plan_context_parallel``: which context-parallel layout a video latent and a head count get, before any process starts.

Pure integer arithmetic (no torch.distributed, no recorded state): the Ulysses x ring factorisation
of the cp size, the tokens each rank holds, whether ``find_split`` splits the grid evenly, and the
attention traffic per rank. ``shard_sizes``, the uneven-shard rule every cp helper uses
(``cp.shard_sizes`` is this function), lives in ``shards`` and is re-exported here.

With an attention mask (``mask=``, an ``AttentionMask`` over one view's tokens) the plan also holds
the ``DispatchPlan`` that ``plan_dispatch``'s cost model chooses for this attention (its heads, the
Ulysses x ring factorisation, ``head_dim``, ``dtype`` and ``rates``), the balanced plan and the
contiguous split of those tokens, so each rank's attention work, the K/V bytes it must receive and
the predicted step time can be compared before any process starts.

How the heads decide the factorisation: Ulysses over ``u`` ranks needs q's heads divisible by ``u``,
so ``ulysses_size`` is the largest divisor of the cp size that divides the heads, and the ring takes
the rest (``ring_size = cp_size // ulysses_size``). K/V heads do not narrow it: ``cp.ulysses_attention``
replicates K/V heads that ``u`` does not divide to ``lcm(kv heads, u)`` (they must divide q's heads),
so GQA/MQA only adds traffic, which ``bytes_per_rank`` counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from parallel_state.topology.attention_mask import AttentionMask
from parallel_state.topology.dispatch_cost import AttentionShape, CostRates, received
from parallel_state.topology.dispatch_cost import itemsize as _itemsize
from parallel_state.topology.dispatch_layout import TRANSPORTS, Layout, Transport
from parallel_state.topology.dispatch_plan import DispatchPlan, plan_dispatch
from parallel_state.topology.shards import shard_sizes
from parallel_state.topology.split import Latent, _int, check_latent, grid_split
from parallel_state.topology.str_enum import one_of


@dataclass(frozen=True)
class ContextParallelPlan:
    """How ``cp_size`` ranks share one view's attention over a video latent (see plan_context_parallel)."""

    shape: tuple[int, ...]
    cp_size: int
    num_heads: int
    num_kv_heads: int
    patch_values: tuple[int, int, int]
    view_factor: int
    #: Patched token grid of one view: (T // view_factor // pT, H // pH, W // pW); tokens = its product.
    token_grid: tuple[int, int, int]
    tokens: int
    #: Ulysses ranks (all-to-all over heads) x ring ranks (K/V blocks passed around) = cp_size.
    ulysses_size: int
    ring_size: int
    #: Each cp rank's token count, in cp-rank order: shard_sizes(tokens, cp_size).
    tokens_per_rank: tuple[int, ...]
    #: find_split's per-rank [T', H', W] and its temporal factor when the grid splits evenly, else None.
    find_split: tuple[int, int, int] | None
    cp_size_t: int | None
    #: The attention mask over one view's tokens (None: no mask given), and the plans of those tokens:
    #: ``chosen`` (plan_dispatch's cost-model choice, method="auto"), ``balanced`` (even work) and
    #: ``contiguous`` (the tensor_split layout).
    mask: AttentionMask | None = None
    balanced: DispatchPlan | None = None
    contiguous: DispatchPlan | None = None
    chosen: DispatchPlan | None = None

    @property
    def hierarchical_context_parallel_sizes(self) -> list[int]:
        """``[ulysses_size, ring_size]``: pass to initialize_model_parallel(hierarchical_context_parallel_sizes=...)."""
        return [self.ulysses_size, self.ring_size]

    @property
    def uneven(self) -> bool:
        """Whether the ranks hold different token counts (then pass ``length=tokens`` / ``uneven=True``)."""
        return len(set(self.tokens_per_rank)) > 1

    @property
    def kv_heads_sent(self) -> int:
        """K/V heads after the replication Ulysses needs: ``lcm(num_kv_heads, ulysses_size)`` when the Ulysses
        size does not divide them, else ``num_kv_heads``."""
        if self.num_kv_heads % self.ulysses_size == 0:
            return self.num_kv_heads
        return math.lcm(self.num_kv_heads, self.ulysses_size)

    def bytes_per_rank(self, dtype: Any, head_dim: int, batch: int = 1) -> int:
        """Bytes one rank sends per attention call (forward, no causal skipping), for the largest shard.

        With ``s = max(tokens_per_rank)``, ``H`` q heads, ``K = kv_heads_sent``, ``u`` / ``r`` the Ulysses /
        ring sizes and ``e`` the element size: Ulysses sends ``(u - 1) / u`` of q, k, v and the output,
        ``s * (2H + 2K) * head_dim * (u - 1) / u`` elements; the ring then passes its K and V block
        (``s * u`` tokens, ``K / u`` heads) on ``r - 1`` times, ``2 * (r - 1) * s * K * head_dim``.
        Times ``batch * e``. ``dtype``: a torch.dtype, its name ("bfloat16") or the element size in bytes.
        """
        size = _itemsize("bytes_per_rank", dtype)
        head_dim, batch = _int("head_dim", head_dim, "bytes_per_rank"), _int("batch", batch, "bytes_per_rank")
        if size < 1 or head_dim < 1 or batch < 1:
            raise ValueError(f"bytes_per_rank: element size, head_dim and batch must be >= 1, got {size}, "
                             f"{head_dim}, {batch}")
        s, u, r, heads, kv = max(self.tokens_per_rank), self.ulysses_size, self.ring_size, self.num_heads, \
            self.kv_heads_sent
        ulysses = s * (2 * heads + 2 * kv) * head_dim * (u - 1) // u
        ring = 2 * (r - 1) * s * kv * head_dim
        return (ulysses + ring) * batch * size

    def dispatch_plan(self, method: Layout | str = Layout.BALANCED) -> DispatchPlan:
        """The ``auto`` (the cost model's choice), ``balanced`` or ``contiguous`` DispatchPlan of one view's tokens
        under ``mask``; ValueError without a mask."""
        plans = {"auto": self.chosen, Layout.BALANCED: self.balanced, Layout.CONTIGUOUS: self.contiguous}
        plan = plans.get(method, False)
        if plan is False:
            raise ValueError(f"dispatch_plan: method={method!r} is not 'auto', 'balanced' or 'contiguous'")
        if plan is None:
            raise ValueError("this plan has no attention mask: call plan_context_parallel(..., mask=AttentionMask...) "
                             "to plan the work and bytes of a masked attention")
        return plan

    def masked_bytes_per_rank(self, dtype: Any, head_dim: int, batch: int = 1, *,
                              method: Layout | str = Layout.BALANCED,
                              transport: Transport | str | None = None) -> tuple[int, ...]:
        """Bytes each cp rank receives per masked attention call (forward) under the ``method`` plan, in rank order.

        Its Ulysses all-to-all share, ``s_c * (2H + 2K) * head_dim * (u - 1) / u`` for its own ``s_c``
        tokens, plus the K and V (``K / u`` heads each) its ring block receives under ``transport``
        (default: the plan's; see ``dispatch_cost``): with "p2p" the tokens of other ring blocks that a
        query of its block may see, with "ring" the whole blocks passed on to it, with "allgather"
        every other token. Ring block j is cp ranks ``j*u .. j*u+u-1`` (cp rank = ring rank * u +
        Ulysses rank). Times ``batch * e``; ``dtype`` as in bytes_per_rank. ValueError when the plan has
        no mask; ValueError for a transport not among ``Transport``'s.
        """
        plan = self.dispatch_plan(method)
        way = plan.transport if transport is None else one_of("masked_bytes_per_rank", "transport", transport,
                                                                 TRANSPORTS)
        size = _itemsize("masked_bytes_per_rank", dtype)
        head_dim = _int("head_dim", head_dim, "masked_bytes_per_rank")
        batch = _int("batch", batch, "masked_bytes_per_rank")
        if size < 1 or head_dim < 1 or batch < 1:
            raise ValueError(f"masked_bytes_per_rank: element size, head_dim and batch must be >= 1, got {size}, "
                             f"{head_dim}, {batch}")
        u, r, heads, kv = self.ulysses_size, self.ring_size, self.num_heads, self.kv_heads_sent
        blocks = [[run for c in range(j * u, (j + 1) * u) for run in plan.runs[c]] for j in range(r)]
        recv, _ = received(plan.mask, plan.length, blocks, way)
        return tuple((s * (2 * heads + 2 * kv) * head_dim * (u - 1) // u + 2 * recv[c // u] * (kv // u) * head_dim)
                     * batch * size for c, s in enumerate(plan.sizes))

    def describe(self) -> str:
        """One paragraph: the layout, the factorisation, the tokens per rank and how to set it up."""
        t, h, w = self.token_grid
        lo, hi = min(self.tokens_per_rank), max(self.tokens_per_rank)
        n_hi = sum(1 for x in self.tokens_per_rank if x == hi)
        counts = f"{hi} tokens per rank" if lo == hi else (
            f"{hi} tokens on the first {n_hi} rank{'s' * (n_hi != 1)} and {lo} on the other {self.cp_size - n_hi}")
        kv = "" if self.num_kv_heads == self.num_heads else f" and {self.num_kv_heads} K/V heads"
        if self.kv_heads_sent != self.num_kv_heads:
            kv += f" (replicated to {self.kv_heads_sent} for {self.ulysses_size}-way Ulysses)"
        if self.cp_size == 1:
            method = "no context parallelism: plain attention in one rank"
        elif self.ulysses_size == self.cp_size:
            method = f"Ulysses alone over all {self.cp_size} ranks (cp.ulysses_attention)"
        elif self.ulysses_size == 1:
            method = f"ring attention alone over all {self.cp_size} ranks ({self.num_heads} heads do not split further)"
        else:
            method = (f"Ulysses over {self.ulysses_size} ranks x ring over {self.ring_size} (usp; "
                      f"{self.num_heads} heads allow at most {self.ulysses_size}-way Ulysses within cp {self.cp_size})")
        if self.find_split is not None:
            layout = (f"find_split splits the grid evenly: per-rank [T', H', W] = {list(self.find_split)}, "
                      f"cp_size_t = {self.cp_size_t}")
        else:
            layout = ("the grid does not split evenly by frames and rows, so the flattened token sequence is split "
                      "with cp.split_inputs_cp(x, seq_dim, group, uneven=True)")
        if self.uneven:
            layout += f" (pass length={self.tokens} to the attention and the gather)"
        masked = ""
        if self.balanced is not None and self.contiguous is not None and self.chosen is not None and \
                self.mask is not None:
            b, c, a = self.balanced, self.contiguous, self.chosen
            runs = max(len(x) for x in b.runs)
            masked = (f" Mask {self.mask} ({self.mask.describe()}): the balanced plan (cp.plan_dispatch) gives the "
                      f"busiest rank {b.balance:.4f}x the mean attention work, in at most {runs} "
                      f"run{'s' * (runs != 1)} of tokens per rank, where the contiguous split gives {c.balance:.4f}x. "
                      f"Chosen by the cost model: the {a.method} layout with the {a.transport} transport, predicted "
                      f"{a.predicted_ms:.3g} ms a step: {a.why}; move tokens with cp.dispatch and pass plan= to the "
                      f"attention.")
        return (f"Latent {list(self.shape)} with patch {list(self.patch_values)} and view factor {self.view_factor} "
                f"is a {t} x {h} x {w} grid of {self.tokens} tokens; {self.num_heads} heads{kv} at cp {self.cp_size}: "
                f"{method}, hierarchical_context_parallel_sizes={self.hierarchical_context_parallel_sizes}; "
                f"{counts}; {layout}.{masked}")


def plan_context_parallel(shape: Sequence[int], cp_size: int, num_heads: int, *,
                          patch_values: Sequence[int] = (1, 2, 2), num_kv_heads: int | None = None,
                          view_factor: int = 1, mask: AttentionMask | None = None, head_dim: int = 128,
                          dtype: Any = "bfloat16", rates: CostRates | None = None) -> ContextParallelPlan:
    """Plan context parallelism for a [B, C, T, H, W] latent and an attention with ``num_heads`` heads.

    Works for every ``cp_size >= 1`` and every latent with at least ``cp_size`` tokens per view (T, H
    and W must divide by their patch sizes, T by ``view_factor``). ``ulysses_size`` is the largest
    divisor of ``cp_size`` that divides ``num_heads``; ``num_kv_heads`` (default ``num_heads``) must
    divide ``num_heads`` and does not narrow it (see the module doc). ``find_split`` is the grid answer
    when the grid splits evenly, computed without recording ``cp_size_t``. ``mask``: an
    ``AttentionMask`` over one view's ``tokens`` (a packed mask's segments must sum to them; a frame is
    ``H // pH * W // pW`` tokens); the plan then holds the balanced and contiguous ``DispatchPlan``s
    (``work`` and ``balance`` per rank), ``masked_bytes_per_rank`` and ``chosen``: ``plan_dispatch``'s
    cost-model choice for this attention (``AttentionShape(num_heads, head_dim, num_kv_heads, dtype)``
    run as ``ulysses_size`` x ``ring_size``, priced with ``rates``, default ``CostRates()``).
    ``head_dim``, ``dtype`` and ``rates`` matter only with a mask. ValueError / TypeError for bad
    input, naming it.
    """
    what = "plan_context_parallel"
    latent, cp_size = check_latent(shape, cp_size, patch_values, view_factor, what=what)
    num_heads = _int("num_heads", num_heads, what)
    if num_heads < 1:
        raise ValueError(f"{what}: num_heads must be >= 1, got {num_heads}")
    kv = num_heads if num_kv_heads is None else _int("num_kv_heads", num_kv_heads, what)
    if kv < 1 or num_heads % kv:
        raise ValueError(f"{what}: num_kv_heads={kv} must be >= 1 and divide num_heads={num_heads} (grouped-query "
                         f"attention shares each K/V head among num_heads // num_kv_heads q heads)")
    grid = _token_grid(what, latent)
    tokens = math.prod(grid)
    if tokens < cp_size:
        raise ValueError(f"{what}: the latent has {tokens} tokens per view ({grid[0]} x {grid[1]} x {grid[2]}), "
                         f"fewer than cp_size={cp_size}: every rank needs at least one; use cp_size <= {tokens}")
    balanced = contiguous = chosen = None
    ulysses = max(d for d in range(1, cp_size + 1) if cp_size % d == 0 and num_heads % d == 0)
    if mask is not None:
        if not isinstance(mask, AttentionMask):
            raise TypeError(f"{what}: mask must be an AttentionMask (cp.Mask) or None, got {type(mask).__name__}")
        try:
            mask.check_length(tokens)
        except ValueError as exc:
            raise type(exc)(f"{what}: one view has {tokens} tokens ({grid[0]} frames of {grid[1] * grid[2]}): "
                            f"{exc}") from None
        attention = AttentionShape(heads=num_heads, head_dim=_int("head_dim", head_dim, what), kv_heads=kv,
                                   dtype=dtype)
        priced = {"rates": rates, "shape": attention, "ulysses_size": ulysses}
        balanced = plan_dispatch(mask, tokens, cp_size, method=Layout.BALANCED, **priced)
        contiguous = plan_dispatch(mask, tokens, cp_size, method=Layout.CONTIGUOUS, **priced)
        chosen = plan_dispatch(mask, tokens, cp_size, **priced)
    factors = grid_split(latent, cp_size)
    split = None
    if factors is not None:
        split = (latent.t_view // factors[0], latent.shape[3] // factors[1], latent.shape[4])
    return ContextParallelPlan(
        shape=latent.shape, cp_size=cp_size, num_heads=num_heads, num_kv_heads=kv, patch_values=latent.patch,
        view_factor=latent.view_factor, token_grid=grid, tokens=tokens, ulysses_size=ulysses,
        ring_size=cp_size // ulysses, tokens_per_rank=shard_sizes(tokens, cp_size), find_split=split,
        cp_size_t=None if factors is None else factors[0], mask=mask, balanced=balanced, contiguous=contiguous,
        chosen=chosen)


def _token_grid(what: str, latent: Latent) -> tuple[int, int, int]:
    w, p_w = latent.shape[4], latent.patch[2]
    if w % p_w:
        raise ValueError(f"{what}: the latent does not patch evenly: W={w} by pW={p_w}; pad the latent or change "
                         f"patch_values")
    return latent.t_patched, latent.h_patched, w // p_w


__all__ = ["ContextParallelPlan", "plan_context_parallel", "shard_sizes"]
