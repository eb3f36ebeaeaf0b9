"""``plan_samples``: each sample of a variable-length batch on its own group of the dp x cp ranks, sized by cost.

Video batches mix 1 s clips (6,240 tokens at 480 x 832) with 20 s ones (124,800 tokens: 400x the
attention). One cp size for all splits the short clips over every rank too, where they pay more in
messages than they save in compute. Here each sample gets its own group, one of those megatron-core's
hybrid context parallelism builds over the ``n`` dp x cp ranks (positions ``0 .. n-1`` in the dp x cp
group's rank order): one rank (no group), an aligned block of a hybrid size (``hybrid_sizes(n)``: 2,
4, ... below ``2**floor(log2 n)``; block ``k`` of size ``s`` is positions ``k*s .. k*s+s-1``), or all
``n``. Those groups nest (two are disjoint or one holds the other), which the order rule below uses.

The cost model: a sample of ``L`` tokens under its mask on ``c`` ranks costs
``plan_dispatch(mask, L, c, rates=rates, shape=shape).predicted_ms`` (its default plan: the one it runs
with); a step lasts as long as its busiest rank's sum; a plan is the sum of its steps. A rank runs its
placements of a step in the order listed, and an earlier placement that shares a rank with a later one
holds all of the later one's ranks (larger groups first), so every rank of a group has run the same
placements before it: the order never makes a rank wait for another, whatever the real times are.
Since the groups nest, any placements fit one step in that order, and a second step would only add its
busiest rank's time: the planner makes one step (``steps`` stays a list for plans that want more).

How the planner chooses (``sample_packing``; deterministic, no randomness): for a sweep of target times,
each sample takes its smallest allowed size that meets the target, the samples are packed heaviest first
onto the least loaded block of their size and improved by moves and swaps off the busiest rank, and a
local search on the sizes starts from the best packings. Costs are computed lazily and cached (per mask,
length, size, rates and shape, across calls), so short samples are priced at one or two sizes only and a
training run whose lengths are whole latent frames prices each length once.

What the model leaves out: the per-token work outside attention (the linear layers, norms and MLP:
``L / c`` tokens per rank, the same rank-time on any ``c``, so it never changes which size is cheapest
but weighs on the balance of ranks holding many short samples), the gradient all-reduce (once per
batch, the same for every plan), the time to load a sample, and the memory a rank needs beyond
``max_tokens_per_rank``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from parallel_state.errors import ParallelStateTypeError, ParallelStateValueError
from parallel_state.topology import sample_packing
from parallel_state.topology.attention_mask import AttentionMask, as_int
from parallel_state.topology.dispatch_cost import AttentionShape, CostRates, checked
from parallel_state.topology.dispatch_plan import DispatchPlan, plan_dispatch
from parallel_state.topology.kinds import hybrid_sizes


class Placement(NamedTuple):
    """One sample on a group: the sample's index in the batch and the group's positions in the dp x cp ranks."""

    sample: int
    ranks: tuple[int, ...]


def group_sizes(world: int) -> tuple[int, ...]:
    """The group sizes a sample may take over ``world`` dp x cp ranks: 1, megatron-core's hybrid sizes and ``world``."""
    return tuple(sorted({1, *hybrid_sizes(world), world}))


def is_group(ranks: Sequence[int], world: int) -> bool:
    """Whether ``ranks`` (positions) is a group the state hands out: one rank, an aligned block of a hybrid size,
    or all ``world`` ranks."""
    c = len(ranks)
    if c not in group_sizes(world) or not ranks or not 0 <= ranks[0] or ranks[0] % c:
        return False
    return tuple(ranks) == tuple(range(ranks[0], ranks[0] + c)) and ranks[-1] < world


@functools.lru_cache(maxsize=8192)
def placement_ms(mask: AttentionMask, length: int, cp_size: int, rates: CostRates, shape: AttentionShape) -> float:
    """A sample's cost on ``cp_size`` ranks: its default dispatch plan's predicted time, in ms."""
    return plan_dispatch(mask, length, cp_size, rates=rates, shape=shape).predicted_ms


@dataclass(frozen=True)
class SamplePlan:
    """Which group of the dp x cp ranks runs each sample of a batch, and in what order; build it with ``plan_samples``.

    ``steps``: micro-steps, each a tuple of ``Placement(sample, ranks)`` in the order the ranks run them
    (larger groups first); every sample is placed exactly once. ``lengths``, ``masks``: each sample's
    tokens and mask; ``world``: the dp x cp ranks. Equal by value (the batch, the placements, the rates
    and shape they were priced with); ``predicted_ms``, ``costs`` and ``why`` record the pricing (a plan
    built by hand, without ``costs``, is priced on construction).
    """

    lengths: tuple[int, ...]
    world: int
    masks: tuple[AttentionMask, ...]
    steps: tuple[tuple[Placement, ...], ...]
    rates: CostRates = field(default_factory=CostRates)
    shape: AttentionShape = field(default_factory=AttentionShape)
    max_tokens_per_rank: int | None = None
    #: Each sample's cost on its group (``placement_ms``), in ms; priced on construction when left out.
    costs: tuple[float, ...] = field(default=(), compare=False)
    #: The sum over steps of each step's busiest rank's sum of costs, in ms (computed with ``costs``).
    predicted_ms: float = field(default=0.0, compare=False)
    #: One sentence: what the plan is and what it was weighed against.
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Cheap structural checks, so that a hand-built plan cannot lose a sample or make ranks wait.
        what = "SamplePlan"
        n = self.world
        if len(self.masks) != len(self.lengths):
            raise ParallelStateValueError(f"{what}: {len(self.lengths)} lengths but {len(self.masks)} masks")
        seen: dict[int, int] = {}
        for s, step in enumerate(self.steps):
            # The groups nest, so "an earlier placement sharing a rank holds all of this one's ranks" is "no
            # earlier placement on any of its ranks is smaller": per rank, the smallest placement so far.
            smallest: dict[int, Placement] = {}
            for p in step:
                if not 0 <= p.sample < len(self.lengths):
                    raise ParallelStateValueError(f"{what}: step {s} places sample {p.sample}, but the batch has "
                                                  f"{len(self.lengths)} samples")
                if p.sample in seen:
                    raise ParallelStateValueError(f"{what}: sample {p.sample} is placed twice (steps {seen[p.sample]} "
                                                  f"and {s}); place every sample exactly once")
                seen[p.sample] = s
                if not is_group(p.ranks, n):
                    raise ParallelStateValueError(
                        f"{what}: sample {p.sample} is on ranks {p.ranks}, which is no group of {n} dp x cp ranks: "
                        f"use one rank, an aligned block of {list(hybrid_sizes(n))} ranks or all {n}")
                if len(p.ranks) > self.lengths[p.sample]:
                    raise ParallelStateValueError(f"{what}: sample {p.sample} has {self.lengths[p.sample]} tokens, "
                                                  f"fewer than its {len(p.ranks)} ranks")
                q = min((smallest[r] for r in p.ranks if r in smallest), key=lambda q: len(q.ranks), default=None)
                if q is not None and len(q.ranks) < len(p.ranks):
                    raise ParallelStateValueError(
                        f"{what}: in step {s}, sample {q.sample} on ranks {q.ranks} runs before sample {p.sample} "
                        f"on ranks {p.ranks}, so ranks {sorted(set(p.ranks) - set(q.ranks))} would wait for it; "
                        f"list larger groups first")
                for r in p.ranks:
                    if r not in smallest or len(smallest[r].ranks) > len(p.ranks):
                        smallest[r] = p
        missing = [i for i in range(len(self.lengths)) if i not in seen]
        if missing:
            raise ParallelStateValueError(f"{what}: samples {missing} are not placed; place every sample exactly once")
        if not self.costs:  # a plan built by hand is priced here, by the same model
            where = self._where
            object.__setattr__(self, "costs", tuple(
                placement_ms(m, length, len(where[i][1].ranks), self.rates, self.shape)
                for i, (m, length) in enumerate(zip(self.masks, self.lengths, strict=True))))
            object.__setattr__(self, "predicted_ms", sum(max(load) for load in self.rank_ms()))
        elif len(self.costs) != len(self.lengths):
            raise ParallelStateValueError(f"{what}: {len(self.costs)} costs for {len(self.lengths)} samples; leave "
                                          f"costs out to have them priced")

    @functools.cached_property
    def _where(self) -> dict[int, tuple[int, Placement]]:
        return {p.sample: (s, p) for s, step in enumerate(self.steps) for p in step}

    def placement(self, sample: int) -> Placement:
        """Sample ``sample``'s placement."""
        return self._where[self._sample(sample)][1]

    def step_of(self, sample: int) -> int:
        """The step sample ``sample`` runs in."""
        return self._where[self._sample(sample)][0]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each sample's group size (its cp size)."""
        return tuple(len(self._where[i][1].ranks) for i in range(len(self.lengths)))

    @property
    def total_tokens(self) -> int:
        """Tokens in the batch: the loss's denominator (sum over every token / total tokens)."""
        return sum(self.lengths)

    def dispatch_plan(self, sample: int) -> DispatchPlan:
        """The dispatch plan sample ``sample`` runs with on its group (the one its cost is)."""
        i = self._sample(sample)
        return plan_dispatch(self.masks[i], self.lengths[i], len(self.placement(i).ranks), rates=self.rates,
                             shape=self.shape)

    def placements_for(self, rank: int) -> tuple[tuple[Placement, ...], ...]:
        """Per step, the placements rank ``rank`` (a position in the dp x cp ranks) runs, in order."""
        rank = self._rank(rank)
        return tuple(tuple(p for p in step if rank in p.ranks) for step in self.steps)

    def samples_for(self, rank: int) -> tuple[int, ...]:
        """The samples rank ``rank`` loads (every rank of a sample's group loads it whole, by index), in run order."""
        return tuple(p.sample for step in self.placements_for(rank) for p in step)

    def rank_ms(self) -> tuple[tuple[float, ...], ...]:
        """Per step, each rank's sum of its placements' costs, in ms."""
        out = []
        for step in self.steps:
            load = [0.0] * self.world
            for p in step:
                for r in p.ranks:
                    load[r] += self.costs[p.sample]
            out.append(tuple(load))
        return tuple(out)

    def fingerprint(self) -> int:
        """A 63-bit digest, the same in every process, for checking that every rank holds the same plan."""
        text = repr((self.lengths, self.world, tuple(map(str, self.masks)), self.steps, self.rates, str(self.shape),
                     self.max_tokens_per_rank))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1

    def describe(self) -> str:
        """One line: samples, group sizes used, steps and the predicted time."""
        count: dict[int, int] = {}
        for c in self.sizes:
            count[c] = count.get(c, 0) + 1
        used = ", ".join(f"{k} on {c} rank{'s' * (c != 1)}" for c, k in sorted(count.items(), reverse=True))
        return (f"{len(self.lengths)} samples ({self.total_tokens} tokens) over {self.world} dp x cp ranks in "
                f"{len(self.steps)} step{'s' * (len(self.steps) != 1)}: {used}; predicted {self.predicted_ms:.4g} ms")

    def _sample(self, sample: Any) -> int:
        return self._index("sample", sample, len(self.lengths), f"a batch of {len(self.lengths)} samples")

    def _rank(self, rank: Any) -> int:
        return self._index("rank", rank, self.world, f"{self.world} dp x cp ranks")

    @staticmethod
    def _index(name: str, value: Any, count: int, of: str) -> int:
        i = as_int("SamplePlan", name, value)
        if not 0 <= i < count:
            raise ParallelStateValueError(f"SamplePlan: {name} {i} is out of range for {of} (0..{count - 1})")
        return i


def _masks(what: str, mask: Any, lengths: tuple[int, ...]) -> tuple[AttentionMask, ...]:
    if mask is None:
        return (AttentionMask.full(),) * len(lengths)
    if isinstance(mask, AttentionMask):
        masks = (mask,) * len(lengths)
    elif isinstance(mask, (list, tuple)):
        if len(mask) != len(lengths):
            raise ParallelStateValueError(f"{what}: {len(mask)} masks for {len(lengths)} samples; pass one mask for "
                                          f"all, or one per sample")
        masks = tuple(mask)
    else:
        raise ParallelStateTypeError(f"{what}: mask must be a cp.Mask (AttentionMask), a list of one per sample, or "
                                     f"None (full attention), got {type(mask).__name__}")
    for i, (m, length) in enumerate(zip(masks, lengths, strict=True)):
        if not isinstance(m, AttentionMask):
            raise ParallelStateTypeError(f"{what}: mask of sample {i} must be a cp.Mask (AttentionMask), got "
                                         f"{type(m).__name__}")
        try:
            m.check_length(length)
        except ParallelStateValueError as exc:
            raise ParallelStateValueError(f"{what}: sample {i} ({length} tokens): {exc}") from None
    return masks


def plan_samples(lengths: Sequence[int], world: int, *, mask: Any = None, shape: AttentionShape | None = None,
                 rates: CostRates | None = None, max_tokens_per_rank: int | None = None) -> SamplePlan:
    """Place each sample of a batch (``lengths``: tokens per sample, the same list on every rank) on a group of the
    ``world`` dp x cp ranks and order them, minimising the predicted step (module doc).

    ``mask``: every sample's ``AttentionMask`` (default full), or a list of one per sample. ``shape`` /
    ``rates``: what ``plan_dispatch`` prices with (defaults: ``AttentionShape()``, ``CostRates()``).
    ``max_tokens_per_rank``: a sample on ``c`` ranks holds ``ceil(L / c)`` tokens per rank at most this.
    Pure and deterministic. TypeError / ValueError subclasses for an empty batch, a length below one, a
    world below one, masks of the wrong type or number (or a packed mask whose segments do not sum to its
    sample), rates or shape of the wrong type, and a sample no group can hold under ``max_tokens_per_rank``.
    """
    what = "plan_samples"
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise ParallelStateTypeError(f"{what}: lengths must be a sequence of token counts, got {type(lengths).__name__}")
    lengths = tuple(as_int(what, f"lengths[{i}]", x) for i, x in enumerate(lengths))
    if not lengths:
        raise ParallelStateValueError(f"{what}: the batch is empty; pass at least one sample's length")
    bad = [i for i, x in enumerate(lengths) if x < 1]
    if bad:
        raise ParallelStateValueError(f"{what}: samples {bad} have lengths {[lengths[i] for i in bad]}; every sample "
                                      f"needs at least one token")
    world = as_int(what, "world", world)
    if world < 1:
        raise ParallelStateValueError(f"{what}: world={world} must be >= 1 (the dp x cp ranks)")
    masks = _masks(what, mask, lengths)
    rates, shape = checked(what, rates, shape)
    cap = None if max_tokens_per_rank is None else as_int(what, "max_tokens_per_rank", max_tokens_per_rank)
    if cap is not None and cap < 1:
        raise ParallelStateValueError(f"{what}: max_tokens_per_rank={cap} must be >= 1 (or None: no limit)")
    sizes = group_sizes(world)
    allowed = []
    for i, length in enumerate(lengths):
        ok = [c for c in sizes if c <= length and (cap is None or -(-length // c) <= cap)]
        if not ok:
            need = -(-length // cap) if cap else length
            raise ParallelStateValueError(
                f"{what}: sample {i} ({length} tokens) fits no group: at most {cap} tokens per rank needs "
                f"{need} ranks, and the largest group of {world} dp x cp ranks holds {-(-length // world)} per rank; "
                f"raise max_tokens_per_rank, use more ranks, or cut the sample")
        allowed.append(tuple(ok))
    return _plan(lengths, world, masks, rates, shape, cap, tuple(allowed))


def _plan(lengths: tuple[int, ...], world: int, masks: tuple[AttentionMask, ...], rates: CostRates,
          shape: AttentionShape, cap: int | None, allowed: tuple[tuple[int, ...], ...]) -> SamplePlan:
    ids: dict[tuple[AttentionMask, int], int] = {}
    kinds = [ids.setdefault(key, len(ids)) for key in zip(masks, lengths, strict=True)]  # equal samples, one id
    memo: dict[tuple[int, int], float] = {}  # per kind and size: a lookup of two ints

    def cost(i: int, c: int) -> float:
        key = (kinds[i], c)
        if key not in memo:
            memo[key] = placement_ms(masks[i], lengths[i], c, rates, shape)
        return memo[key]

    longest: dict[AttentionMask, int] = {}  # per mask, its longest sample: their best times bound the step
    for i, length in enumerate(lengths):
        if length > lengths[longest.setdefault(masks[i], i)]:
            longest[masks[i]] = i
    best, tried, bottom, high = sample_packing.search(world, allowed, cost, kinds, list(longest.values()))
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-best.allot[i], best.start[i], -best.ms[i], i))
    count: dict[int, int] = {}
    for c in best.allot:
        count[c] = count.get(c, 0) + 1
    used = ", ".join(f"{k} on {c}" for c, k in sorted(count.items(), reverse=True))
    why = (f"one step, samples on groups of size (samples): {used}; the best of {tried} packings tried (target "
           f"times {bottom:.3g} to {high:.3g} ms, then a local search on the sizes), predicted {best.top:.4g} ms")
    steps = (tuple(Placement(i, tuple(range(best.start[i], best.start[i] + best.allot[i]))) for i in order),)
    return SamplePlan(lengths=lengths, world=world, masks=masks, steps=steps, rates=rates, shape=shape,
                      max_tokens_per_rank=cap, costs=tuple(best.ms), predicted_ms=best.top, why=why)


__all__ = ["Placement", "SamplePlan", "group_sizes", "is_group", "placement_ms", "plan_samples"]
