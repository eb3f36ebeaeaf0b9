"""``plan_dispatch``: which tokens of a masked sequence each context-parallel rank holds, so that the work is even.

A rank's attention work is the number of allowed (query, key) pairs of the queries it holds. Under a
causal or chunk-causal mask the later tokens see more keys, so the contiguous split (rank i holds the
i-th block) leaves the last rank with up to ``2 - 1 / cp`` times the mean. The balanced plan fixes that
while keeping what memory and the attention kernels need:

- Token counts: rank r holds exactly ``shard_sizes(length, cp_size)[r]`` tokens, the same counts as
  the contiguous split (memory balance; the gathers' uneven rule applies unchanged).
- Work: each rank's queries get as close to ``work / cp_size`` pairs as one token's key count allows.
- Runs: a few large contiguous runs per rank (two for causal kinds), for efficient kernels and a
  small K/V exchange.

How (a zigzag whose cut points are solved, not fixed): order the sequence by key count per query
(``AttentionMask.widths``), low to high. For causal and chunk-causal masks that order is the sequence
itself; otherwise pieces of it (segments, chunks, blocks of at least ``length / (4 cp)`` tokens) are
sorted by their mean key count, stably. Rank 0 then takes ``x`` tokens from the low end and
``n - x`` from the high end of that order, with ``x`` chosen so that its work is nearest to the mean
of what remains; rank 1 does the same with the rest, and so on; the last rank takes the middle. For
a non-decreasing order such an ``x`` always exists (the low end alone is at most the mean, the high
end alone at least), so every rank lands within about one token's key count of the mean: the fixed
zigzag (2 cp equal chunks, rank r taking r and 2cp-1-r) with its cut points moved to where the work
is even. The contiguous split is the other candidate; the plan with the smaller busiest rank wins
(ties: the contiguous split, one run per rank). Work per position comes from the key intervals, so
planning is O(length) tensor arithmetic plus O(cp_size) small searches; plans are cached.

The default, ``method="auto"``, counts communication too: it prices candidate layouts under each
transport (``TRANSPORTS``: how K/V reach the ranks that need them) with the cost model of
``dispatch_cost`` and keeps the fastest. The candidates: the contiguous split (always), the balanced
plan above, and for packed masks the clip plan: whole clips on one rank, packed by work (the
heaviest clip first onto the least loaded rank, a rank taking at most ``1.25x`` the even share of
tokens where it can), a clip too heavy for one rank split over as few ranks as it takes (by the
balanced plan of the clip alone: zigzag for chunk-causal clips), until the work is within 1.05 of
the mean or no clip can be split further. A clip on one rank needs no other rank's K/V, so the
clip plan balances the work at a fraction of the balanced plan's bytes; its token counts follow
the clips (``sizes``). The choice is the first candidate in the order (contiguous, clips, balanced;
each with p2p, allgather, ring) predicted within ``MARGIN`` of the fastest and no slower than the
fastest contiguous candidate: never predicted slower than the contiguous split, and a more complex
plan only for a clear gain (the model is a model).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from parallel_state.errors import ParallelStateTypeError, ParallelStateValueError
from parallel_state.topology.attention_mask import AttentionMask, MaskKind, as_int
from parallel_state.topology.dispatch_cost import AttentionShape, Candidate, CostRates, checked, predict
from parallel_state.topology.dispatch_layout import TRANSPORTS, Layout, Runs, Transport, merged
from parallel_state.topology.shards import shard_sizes
from parallel_state.topology.str_enum import one_of

if TYPE_CHECKING:
    import torch




#: The layouts ``plan_dispatch`` makes; it also takes "auto" (the cost model's choice among them: a request, not a
#: layout).
METHODS = (Layout.BALANCED, Layout.CONTIGUOUS, Layout.CLIPS)
#: The layouts a plan can hold.
LAYOUTS = tuple(Layout)
#: The order "auto" weighs them in, simplest traffic first (a clip kept whole sends nothing).
ORDER = (Layout.CONTIGUOUS, Layout.CLIPS, Layout.BALANCED)
#: A later (more complex) candidate is chosen only when the earlier ones are predicted this much slower than the
#: fastest: the model's error on measured CPU and GPU steps is of this order, and a wrong complex plan costs bytes.
MARGIN = 0.10
#: The clip plan keeps a rank within this many times the even share of tokens where the clips allow.
TOKEN_SKEW = 1.25


@dataclass(frozen=True)
class DispatchPlan:
    """Which global tokens each of ``cp_size`` ranks holds for a masked sequence; build it with ``plan_dispatch``.

    ``runs[r]``: rank r's tokens as ascending, non-adjacent ``(start, stop)`` runs; rank r holds them
    in that order (``positions[r]``). ``work[r]``: the allowed (query, key) pairs of rank r's queries.
    ``method``: the ``Layout``; ``transport``: how the attention moves K/V, a ``Transport`` (see
    ``dispatch_cost``); either may be given as its string ("balanced", "p2p") and is stored as the member.
    Equal by value (the layout and the transport), hashable, the same on every rank for the same arguments. ``predicted_ms``,
    ``candidates`` and ``why`` record how ``plan_dispatch`` priced and chose it (not compared).
    """

    mask: AttentionMask
    length: int
    cp_size: int
    method: Layout
    runs: tuple[Runs, ...]
    work: tuple[int, ...]
    transport: Transport = Transport.P2P
    #: The cost model's step time of this plan, in ms (None for a plan built by hand).
    predicted_ms: float | None = field(default=None, compare=False)
    #: Every (layout, transport) weighed, in order, with its predicted time; the chosen one among them.
    candidates: tuple[Candidate, ...] = field(default=(), compare=False)
    #: One sentence: what was weighed and why this plan won.
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Cheap consistency checks (O(runs)), so a hand-built plan cannot send tokens twice or lose some.
        what = "DispatchPlan"
        if not isinstance(self.mask, AttentionMask):
            raise ParallelStateTypeError(f"{what}: mask must be an AttentionMask, got {type(self.mask).__name__}")
        object.__setattr__(self, "method", one_of(what, "method", self.method, LAYOUTS))
        object.__setattr__(self, "transport", one_of(what, "transport", self.transport, TRANSPORTS))
        if not (len(self.runs) == len(self.work) == self.cp_size >= 1):
            raise ParallelStateValueError(f"{what}: cp_size={self.cp_size} needs that many runs and work entries, got "
                                          f"{len(self.runs)} and {len(self.work)}; build plans with plan_dispatch")
        every = []
        for rank, runs in enumerate(self.runs):
            if not runs or any(not 0 <= a < b <= self.length for a, b in runs) or any(
                    x[1] >= y[0] for x, y in zip(runs, runs[1:], strict=False)):
                raise ParallelStateValueError(f"{what}: rank {rank}'s runs {runs} must be non-empty, ascending, "
                                              f"separate (start, stop) pairs within [0, {self.length}); build plans "
                                              f"with plan_dispatch")
            every += runs
        every.sort()
        if every[0][0] != 0 or every[-1][1] != self.length or any(
                x[1] != y[0] for x, y in zip(every, every[1:], strict=False)):
            raise ParallelStateValueError(f"{what}: the ranks' runs must cover every token of [0, {self.length}) "
                                          f"exactly once; build plans with plan_dispatch")

    @functools.cached_property
    def positions(self) -> tuple[tuple[int, ...], ...]:
        """Rank r holds global tokens ``positions[r]``, ascending; together a permutation of ``range(length)``."""
        return tuple(tuple(p for start, stop in runs for p in range(start, stop)) for runs in self.runs)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each rank's token count (``shard_sizes(length, cp_size)`` for the contiguous and balanced layouts)."""
        return tuple(sum(stop - start for start, stop in runs) for runs in self.runs)

    @property
    def balance(self) -> float:
        """``max(work) / mean(work)``: 1.0 is perfectly even; the step waits for the busiest rank."""
        return max(self.work) * self.cp_size / sum(self.work)

    @property
    def is_contiguous(self) -> bool:
        """Whether rank r holds the r-th contiguous block (the tensor_split layout), so no reordering is needed."""
        return all(len(runs) == 1 for runs in self.runs)

    def index(self, rank: int, device: Any = None) -> torch.Tensor:
        """Rank ``rank``'s global positions as an int64 tensor (for ``index_select`` and positional inputs)."""
        import torch

        rank = self._rank(rank)
        return torch.cat([torch.arange(start, stop, dtype=torch.int64, device=device)
                          for start, stop in self.runs[rank]])

    def owner(self, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[length]`` tensors ``(rank, offset)``: global token p is ``offset[p]``-th on rank ``rank[p]``."""
        import torch

        rank = torch.empty(self.length, dtype=torch.int64, device=device)
        offset = torch.empty(self.length, dtype=torch.int64, device=device)
        for r, runs in enumerate(self.runs):
            at = 0
            for start, stop in runs:
                rank[start:stop] = r
                offset[start:stop] = torch.arange(at, at + stop - start, dtype=torch.int64, device=device)
                at += stop - start
        return rank, offset

    def pairs(self) -> tuple[tuple[int, ...], ...]:
        """``pairs()[r][s]``: allowed (query, key) pairs with the query on rank r and the key on rank s.

        Row sums are ``work``; a zero means rank r needs nothing of rank s's K/V. O(length x cp_size).
        """
        import torch

        rank, _ = self.owner()
        counts = torch.zeros(self.length + 1, self.cp_size, dtype=torch.int64)
        counts[1:].scatter_(1, rank[:, None], 1)
        counts = counts.cumsum(0)  # counts[x, s]: tokens of rank s before position x
        lo, hi = self.mask.key_range(torch.arange(self.length), self.length)
        per_query = counts[hi] - counts[lo]  # [length, cp]: keys of each rank each query may see
        out = torch.zeros(self.cp_size, self.cp_size, dtype=torch.int64)
        out.index_add_(0, rank, per_query)
        return tuple(tuple(row) for row in out.tolist())

    def fingerprint(self) -> int:
        """A 63-bit digest of the plan, the same in every process (``hash`` is salted per process): for checking
        that every rank of a group holds the same plan."""
        # The members' values, not their reprs: the digest of the same plan as when these were plain strings.
        text = repr((str(self.mask), self.length, self.cp_size, self.method.value, self.runs, self.transport.value))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1

    def describe(self) -> str:
        """One line: layout, transport, mask, balance, runs per rank and the predicted step time."""
        most = max(len(r) for r in self.runs)
        ms = "" if self.predicted_ms is None else f", predicted {self.predicted_ms:.3g} ms"
        return (f"{self.method} plan of {self.length} tokens ({self.mask.describe()}) over {self.cp_size} ranks, "
                f"{self.transport} transport: {min(self.sizes)}-{max(self.sizes)} tokens and at most {most} "
                f"run{'s' * (most != 1)} per rank, work max/mean {self.balance:.4f}{ms}")

    def _rank(self, rank: Any) -> int:
        rank = as_int("DispatchPlan", "rank", rank)
        if not 0 <= rank < self.cp_size:
            raise ParallelStateValueError(f"DispatchPlan: rank {rank} is out of range for a plan of cp_size "
                                          f"{self.cp_size} (0..{self.cp_size - 1})")
        return rank


def plan_dispatch(mask: AttentionMask, length: int, cp_size: int, *, method: Layout | str = "auto",
                  transport: Transport | str | None = None, rates: CostRates | None = None,
                  shape: AttentionShape | None = None, ulysses_size: int = 1) -> DispatchPlan:
    """Assign the ``length`` tokens of a sequence under ``mask`` to ``cp_size`` ranks, and choose the transport.

    ``method="auto"`` (default): the candidate layouts and transports priced by the cost model
    (``dispatch_cost``) with ``rates`` (default ``CostRates()``, a GPU node; ``cp.measure_rates(group)``
    measures the group's) for the attention ``shape`` (default ``AttentionShape()``) run by
    ``ulysses_size``-way Ulysses over ``cp_size // ulysses_size`` ring ranks (as ``usp_attention``; 1 for
    ``ring_attention``); the fastest wins, never predicted slower than the contiguous split (module doc).
    ``method="balanced"``: work as even as the mask allows with the contiguous split's token counts
    (module doc); ``"contiguous"``: rank r holds the r-th block of ``shard_sizes(length, cp_size)``,
    the layout of ``cp.split_inputs_cp(..., uneven=True)``; ``"clips"``: whole clips per rank (packed
    masks). A named method takes ``transport`` as given (default "p2p"); under "auto" a given transport
    limits the choice to it. ``plan.predicted_ms``, ``plan.candidates`` and ``plan.why`` say what was
    weighed. Deterministic and cached. TypeError / ValueError subclasses for a non-mask, a bad length
    (packed segments must sum to it), a cp size below one or above the length, an unknown method or
    transport, rates or shape of the wrong type, a Ulysses size not dividing the cp size, or clips
    asked of a mask that has none.
    """
    what = "plan_dispatch"
    if not isinstance(mask, AttentionMask):
        raise ParallelStateTypeError(f"{what}: mask must be an AttentionMask (cp.Mask), got "
                                     f"{type(mask).__name__}; build one with AttentionMask.causal(), ...")
    length = mask.check_length(length)
    cp_size = as_int(what, "cp_size", cp_size)
    if not 1 <= cp_size <= length:
        raise ParallelStateValueError(f"{what}: cp_size={cp_size} must be between 1 and the length {length} "
                                      f"(every rank holds at least one token)")
    method = one_of(what, "method", method, ("auto",) + METHODS)
    if transport is not None:
        transport = one_of(what, "transport", transport, TRANSPORTS, " (or None: the cost model's choice under "
                                                                     "method='auto', else 'p2p')")
    if method is Layout.CLIPS and (mask.kind is not MaskKind.PACKED or len(mask.lengths or ()) < 2):
        raise ParallelStateValueError(f"{what}: method='clips' keeps packed clips whole, but the mask {mask} has "
                                      f"no two clips; use method='auto', 'balanced' or 'contiguous'")
    rates, shape = checked(what, rates, shape)
    ulysses_size = as_int(what, "ulysses_size", ulysses_size)
    if ulysses_size < 1 or cp_size % ulysses_size:
        raise ParallelStateValueError(f"{what}: ulysses_size={ulysses_size} must be >= 1 and divide "
                                      f"cp_size={cp_size} (usp runs Ulysses over it, a ring over the rest)")
    return _plan(mask, length, cp_size, method, transport, rates, shape, ulysses_size)


@functools.lru_cache(maxsize=64)
def _plan(mask: AttentionMask, length: int, cp_size: int, method: Layout | str, transport: Transport | None,
          rates: CostRates, shape: AttentionShape, ulysses_size: int) -> DispatchPlan:
    auto = not isinstance(method, Layout)  # "auto": the one request that is no layout
    layouts = _layouts(mask, length, cp_size)
    names = [m for m in ORDER if m in layouts] if auto else [method]
    ways = TRANSPORTS if transport is None and auto else (transport or Transport.P2P,)
    seen: set[tuple[Runs, ...]] = set()
    priced = []
    for name in names:
        runs, work = layouts[name]
        if runs in seen:  # the same layout under another name (e.g. balanced = contiguous for full attention)
            continue
        seen.add(runs)
        priced += [predict(mask, length, runs, work, name, way, rates, shape, ulysses_size) for way in ways]
    chosen, why = _choose(priced, None if auto else method)
    runs, work = layouts[chosen.method]
    return DispatchPlan(mask=mask, length=length, cp_size=cp_size, method=chosen.method, runs=runs, work=work,
                        transport=chosen.transport, predicted_ms=chosen.predicted_ms, candidates=tuple(priced),
                        why=why)


def _choose(priced: list[Candidate], method: Layout | None) -> tuple[Candidate, str]:
    """The chosen candidate and why: the one asked for (``method``), or under "auto" (None) the first (in order)
    within MARGIN of the fastest and no slower than the fastest contiguous split."""
    if method is not None:
        only = priced[0]
        return only, f"method={method.value!r} with the {only.transport} transport, as asked: {only.row()}"
    fastest = min(c.predicted_ms for c in priced)
    contiguous = min(c.predicted_ms for c in priced if c.method is Layout.CONTIGUOUS)
    reach = min(fastest * (1 + MARGIN), contiguous)
    chosen = next(c for c in priced if c.predicted_ms <= reach)
    best = min(priced, key=lambda c: c.predicted_ms)
    base = min((c for c in priced if c.method is Layout.CONTIGUOUS), key=lambda c: c.predicted_ms)
    if chosen is best:
        reason = "the fastest"
    else:
        reason = (f"within {MARGIN:.0%} of the fastest ({best.method}/{best.transport} {best.predicted_ms:.3g} ms) "
                  f"and earlier in the order (simpler)")
    speed = base.predicted_ms / chosen.predicted_ms if chosen.predicted_ms > 0 else 1.0
    return chosen, (f"{chosen.method}/{chosen.transport} ({chosen.predicted_ms:.3g} ms) is {reason} of "
                    f"{len(priced)} candidates, {speed:.2f}x the contiguous split's best "
                    f"({base.transport}, {base.predicted_ms:.3g} ms)")


@functools.lru_cache(maxsize=64)
def _layouts(mask: AttentionMask, length: int, cp_size: int) -> dict[Layout, tuple[tuple[Runs, ...], tuple[int, ...]]]:
    """Every candidate layout's runs and work per rank, by layout (clips only for packed masks)."""

    sizes = shard_sizes(length, cp_size)
    prefix = _work_prefix(mask, length)

    def work(runs: tuple[Runs, ...]) -> tuple[int, ...]:
        return _work(prefix, runs)

    cut = [0]
    for n in sizes:
        cut.append(cut[-1] + n)
    contiguous = tuple(((cut[r], cut[r + 1]),) for r in range(cp_size))
    out = {Layout.CONTIGUOUS: (contiguous, work(contiguous))}
    balanced = out[Layout.CONTIGUOUS]
    if cp_size > 1:
        zigzag = _zigzag(mask, length, sizes, prefix)
        if max(work(zigzag)) < max(balanced[1]):  # the contiguous split wins ties: one run per rank
            balanced = (zigzag, work(zigzag))
    out[Layout.BALANCED] = balanced
    if mask.kind is MaskKind.PACKED and len(mask.lengths or ()) > 1 and cp_size > 1:
        clips = _clips(mask, length, cp_size, prefix)
        out[Layout.CLIPS] = (clips, work(clips))
    return out


def _work_prefix(mask: AttentionMask, length: int) -> torch.Tensor:
    """int64 ``[length + 1]``: allowed (query, key) pairs of the queries before each position."""
    import torch

    prefix = torch.zeros(length + 1, dtype=torch.int64)
    torch.cumsum(mask.widths(length), 0, out=prefix[1:])
    return prefix


def _work(prefix: torch.Tensor, runs: tuple[Runs, ...]) -> tuple[int, ...]:
    """Each rank's allowed pairs: the work of its runs, from ``_work_prefix``."""
    import torch

    ends = torch.tensor([p for rank in runs for run in rank for p in run], dtype=torch.int64)
    at = prefix[ends].view(-1, 2).diff(dim=1).flatten().tolist()  # one gather: a few runs per rank
    out, i = [], 0
    for rank in runs:
        out.append(sum(at[i:i + len(rank)]))
        i += len(rank)
    return tuple(out)


def plan_dual_chunk_swap(mask: AttentionMask, length: int, cp_size: int, *, cu_seqlens: Any = None,
                         transport: Transport | str = Transport.P2P, rates: CostRates | None = None,
                         shape: AttentionShape | None = None) -> DispatchPlan:
    """The layout megatron-core and Transformer Engine give context-parallel ranks ("DualChunkSwap"), as a plan.

    Each sequence is cut into ``2 * cp_size`` equal chunks and cp rank r holds chunk r, then chunk
    ``2 cp_size - 1 - r`` (megatron-core's ``get_batch_on_this_cp_rank``; under a causal mask one early
    and one late chunk each, so the work is even). One sequence of ``length`` tokens by default; with
    ``cu_seqlens`` (the cumulative boundaries ``[0, ..., length]`` of a packed THD batch, the padded
    ones) every sequence is cut so, and rank r holds its two chunks of each in sequence order.
    ``mask`` is the attention over all ``length`` tokens (for a THD batch a ``packed`` mask, whose
    segments may be finer than the sequences: padding as segments of its own). The tokens move as
    ``transport`` says; ``predicted_ms`` is the cost model's (``rates``, ``shape`` as in ``plan_dispatch``).
    Deterministic and cached. ValueError (a ParallelStateValueError) naming the sequence whose length
    ``2 * cp_size`` does not divide (pad it to a multiple), or bad ``cu_seqlens``.
    """
    what = "plan_dual_chunk_swap"
    if not isinstance(mask, AttentionMask):
        raise ParallelStateTypeError(f"{what}: mask must be an AttentionMask (cp.Mask), got {type(mask).__name__}")
    length = mask.check_length(length)
    cp_size = as_int(what, "cp_size", cp_size)
    if cp_size < 1:
        raise ParallelStateValueError(f"{what}: cp_size={cp_size} must be >= 1")
    transport = one_of(what, "transport", transport, TRANSPORTS)
    bounds = _boundaries(what, cu_seqlens, length)
    rates, shape = checked(what, rates, shape)
    return _dual_chunk_swap(mask, length, cp_size, bounds, transport, rates, shape)


def _boundaries(what: str, cu_seqlens: Any, length: int) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints (a tensor or a sequence; None: one sequence), checked against ``length``."""
    if cu_seqlens is None:
        return (0, length)
    values = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ParallelStateTypeError(f"{what}: cu_seqlens must be a 1-D sequence or tensor of ints, got "
                                     f"{type(cu_seqlens).__name__}")
    bounds = tuple(as_int(what, f"cu_seqlens[{i}]", b) for i, b in enumerate(values))
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length or any(
            a > b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ParallelStateValueError(f"{what}: cu_seqlens must rise from 0 to the total length {length} "
                                      f"(the padded sequences' cumulative lengths), got {list(bounds)}")
    return bounds


@functools.lru_cache(maxsize=64)
def _dual_chunk_swap(mask: AttentionMask, length: int, cp_size: int, bounds: tuple[int, ...], transport: Transport,
                     rates: CostRates, shape: AttentionShape) -> DispatchPlan:
    parts = 2 * cp_size
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if (b - a) % parts:
            which = "the sequence" if len(bounds) == 2 else f"sequence {i} (tokens {a} to {b})"
            raise ParallelStateValueError(
                f"plan_dual_chunk_swap: {which} has {b - a} tokens, not a multiple of 2 * cp_size = {parts}; pad "
                f"every sequence to a multiple of {parts} (megatron-core's and Transformer Engine's rule)")
    runs = []
    for r in range(cp_size):
        mine = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            chunk = (b - a) // parts
            mine += [(a + r * chunk, a + (r + 1) * chunk), (a + (parts - 1 - r) * chunk, a + (parts - r) * chunk)]
        runs.append(merged(mine))
    if any(not rank for rank in runs):
        raise ParallelStateValueError(f"plan_dual_chunk_swap: {length} tokens leave a rank of {cp_size} with none; "
                                      f"use a smaller cp_size")
    layout = tuple(runs)
    work = _work(_work_prefix(mask, length), layout)
    priced = predict(mask, length, layout, work, Layout.DUAL_CHUNK_SWAP, transport, rates, shape)
    return DispatchPlan(mask=mask, length=length, cp_size=cp_size, method=Layout.DUAL_CHUNK_SWAP, runs=layout, work=work,
                        transport=transport, predicted_ms=priced.predicted_ms, candidates=(priced,),
                        why=f"the DualChunkSwap layout with the {transport} transport, as asked: {priced.row()}")


def _clips(mask: AttentionMask, length: int, cp_size: int, prefix_tensor: torch.Tensor) -> tuple[Runs, ...]:
    """Whole clips packed onto ranks by work, a clip on the busiest rank split one rank further while that
    helps (module doc)."""
    bounds = mask.segment_bounds(length)
    prefix = prefix_tensor.tolist()
    clips = [(a, b, prefix[b] - prefix[a]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    inner = AttentionMask.full() if mask.chunk is None else AttentionMask.chunk_causal(mask.chunk)
    target = prefix[length] / cp_size
    cap = TOKEN_SKEW * length / cp_size

    def pieces(c: int, k: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """Clip c in k pieces: (work, tokens, runs) each, by the balanced plan of the clip alone."""
        a, b, w = clips[c]
        if k == 1:
            return [(w, b - a, [(a, b)])]
        runs, works = _layouts(inner, b - a, k)[Layout.BALANCED]
        return [(wk, sum(y - x for x, y in rk), [(a + x, a + y) for x, y in rk]) for rk, wk in zip(runs, works,
                                                                                                    strict=True)]

    def arrange(split: list[int]) -> tuple[float, list[list[tuple[int, int]]], list[set[int]]]:
        """Heaviest first onto the least loaded rank (ties: fewer tokens, lower rank), the pieces of a clip on
        different ranks, within the token cap where some rank has room: (max load / mean, runs, clips per rank)."""
        items = sorted(((w, t, runs, c) for c, k in enumerate(split) for w, t, runs in pieces(c, k)),
                       key=lambda it: (-it[0], -it[1], it[3]))
        load, held = [0] * cp_size, [0] * cp_size
        place: list[list[tuple[int, int]]] = [[] for _ in range(cp_size)]
        on: list[set[int]] = [set() for _ in range(cp_size)]
        for w, t, runs, c in items:
            free = [r for r in range(cp_size) if c not in on[r]]
            roomy = [r for r in free if held[r] + t <= cap] or free
            r = min(roomy, key=lambda r: (load[r] if place[r] else -1, held[r], r))  # empty ranks first
            load[r], held[r] = load[r] + w, held[r] + t
            place[r] += runs
            on[r].add(c)
        worst = max(load) / target if target and all(place) else math.inf
        return worst, place, on

    split = [1] * len(clips)
    while sum(split) < cp_size:  # at least one piece per rank: split the heaviest pieces first
        c = max((c for c in range(len(clips)) if split[c] < clips[c][1] - clips[c][0]),
                key=lambda c: (clips[c][2] / split[c], -c))
        split[c] += 1
    best = current = (arrange(split), split)
    for _ in range(cp_size + len(clips)):
        (worst, place, on), split = current
        if best[0][0] <= 1.05:
            break
        busiest = max(range(cp_size), key=lambda r: sum(prefix[y] - prefix[x] for x, y in place[r]))
        heaviest = max(range(len(clips)), key=lambda c: (clips[c][2] / split[c], -c))
        options = sorted(c for c in on[busiest] | {heaviest}
                         if split[c] < min(cp_size, clips[c][1] - clips[c][0]))
        if not options:
            break
        trials = []
        for c in options:
            more = split[:c] + [split[c] + 1] + split[c + 1:]
            trials.append((arrange(more), more))
        current = min(trials, key=lambda tr: (tr[0][0], sum(tr[1])))  # taken even if no better: a way out
        if current[0][0] < best[0][0]:
            best = current
    return tuple(merged(runs) for runs in best[0][1])


def _pieces(mask: AttentionMask, length: int, cp_size: int, prefix: torch.Tensor) -> list[tuple[int, int]]:
    """The sequence cut into pieces and sorted, stably, by mean keys per query: the order the zigzag walks.

    Pieces never cross a segment; inside one they are whole chunks (key counts are constant in a
    chunk), merged up to at least ``length / (4 cp)`` tokens so that a sort across segments cannot
    scatter a rank into many small runs.
    """
    least = max(1, -(-length // (4 * cp_size)))
    bounds = mask.segment_bounds(length)
    pieces = []
    for seg_start, seg_end in zip(bounds[:-1], bounds[1:], strict=True):
        if mask.kind in (MaskKind.FULL, MaskKind.PACKED) and mask.chunk is None:
            step = seg_end - seg_start  # one key count throughout the segment
        else:
            chunk = mask.chunk or 1
            step = chunk * max(1, -(-least // chunk))
        pieces += [(s, min(s + step, seg_end)) for s in range(seg_start, seg_end, step)]

    def mean(piece: tuple[int, int]) -> float:
        start, stop = piece
        return int(prefix[stop] - prefix[start]) / (stop - start)

    return sorted(pieces, key=mean)


def _zigzag(mask: AttentionMask, length: int, sizes: tuple[int, ...], prefix: torch.Tensor) -> tuple[Runs, ...]:
    """Rank by rank, ``x`` tokens from the low end of the sorted order and ``n - x`` from the high end (module doc)."""
    import torch

    pieces = _pieces(mask, length, len(sizes), prefix)
    widths = prefix[1:] - prefix[:-1]
    # Slices and one cat, no gather: indexing ops are the slow ones on a busy CPU.
    vprefix = torch.zeros(length + 1, dtype=torch.int64)
    torch.cumsum(torch.cat([widths[start:stop] for start, stop in pieces]), 0, out=vprefix[1:])
    vstarts = [0]
    for start, stop in pieces:
        vstarts.append(vstarts[-1] + stop - start)

    def real(vlo: int, vhi: int) -> list[tuple[int, int]]:
        """The sequence runs under the sorted order's range [vlo, vhi)."""
        out = []
        i = bisect.bisect_right(vstarts, vlo) - 1
        while vlo < vhi:
            start, stop = pieces[i]
            take = min(vhi, vstarts[i + 1]) - vlo
            first = start + vlo - vstarts[i]
            out.append((first, first + take))
            vlo += take
            i += 1
        return out

    lo, hi = 0, length
    ranges: list[list[tuple[int, int]]] = []
    for left, n in zip(range(len(sizes), 1, -1), sizes[:-1], strict=True):
        target = float(vprefix[hi] - vprefix[lo]) / left  # an even share of what is left
        # work[x]: x tokens from the low end and n - x from the high end.
        work = (vprefix[lo:lo + n + 1] - vprefix[lo]) + (vprefix[hi] - vprefix[hi - n:hi + 1])
        take = int(torch.argmin((work.double() - target).abs()))  # the first best: deterministic
        ranges.append(real(lo, lo + take) + real(hi - n + take, hi))
        lo, hi = lo + take, hi - n + take
    ranges.append(real(lo, hi))
    return tuple(merged(r) for r in ranges)



__all__ = ["LAYOUTS", "MARGIN", "METHODS", "ORDER", "AttentionShape", "CostRates", "DispatchPlan", "Layout", "Transport",
           "plan_dispatch", "plan_dual_chunk_swap"]
