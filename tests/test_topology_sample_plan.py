"""plan_samples / SamplePlan (no processes): every sample placed once on a group the state hands out (one rank, an
aligned hybrid block, the whole dp x cp group), larger groups first so no rank waits, the stated cost recomputed
from plan_dispatch, deterministic; per-sample masks and max_tokens_per_rank; priced by the same model never slower
than every sample on all ranks nor than megatron-core's own BalancedCPScheduler at its best cap; and the errors."""

from __future__ import annotations

import math

import pytest

import parallel_state as ps
from benchmarks import bench_samples
from parallel_state import AttentionMask as Mask
from parallel_state import plan_dispatch
from parallel_state.topology.sample_plan import group_sizes, is_group, placement_ms

#: Tokens per latent frame of a small video (a 1,560-token frame prices the same way, only slower to plan).
FRAME = 96
SHAPE = ps.AttentionShape()


def recomputed(plan):
    """The plan's step time from plan_dispatch alone: per step the busiest rank's sum, summed over steps."""
    total = 0.0
    for step in plan.steps:
        load = [0.0] * plan.world
        for p in step:
            ms = plan_dispatch(plan.masks[p.sample], plan.lengths[p.sample], len(p.ranks), rates=plan.rates,
                               shape=plan.shape).predicted_ms
            for r in p.ranks:
                load[r] += ms
        total += max(load)
    return total


def check(plan, lengths, world):
    """Everything a plan promises, checked from its steps."""
    placed = [p.sample for step in plan.steps for p in step]
    assert sorted(placed) == list(range(len(lengths))) and plan.lengths == tuple(lengths) and plan.world == world
    for step in plan.steps:
        for k, p in enumerate(step):
            assert is_group(p.ranks, world) and len(p.ranks) <= lengths[p.sample]
            for q in step[:k]:  # an earlier placement sharing a rank holds every rank of the later one
                assert not set(p.ranks) & set(q.ranks) or set(p.ranks) <= set(q.ranks)
    assert plan.predicted_ms == pytest.approx(recomputed(plan), rel=1e-12)
    assert plan.sizes == tuple(len(plan.placement(i).ranks) for i in range(len(lengths)))
    for i in range(len(lengths)):
        dispatch = plan.dispatch_plan(i)
        assert dispatch.cp_size == plan.sizes[i] and plan.costs[i] == dispatch.predicted_ms
    for r in range(world):  # a rank loads exactly the samples whose groups hold it, in run order
        assert plan.samples_for(r) == tuple(p.sample for step in plan.steps for p in step if r in p.ranks)
    assert max(plan.rank_ms()[0]) == pytest.approx(plan.predicted_ms, rel=1e-12)


def test_groups_are_one_rank_aligned_hybrid_blocks_or_all():
    assert group_sizes(8) == (1, 2, 4, 8) and group_sizes(12) == (1, 2, 4, 12) and group_sizes(3) == (1, 3)
    assert group_sizes(1) == (1,) and group_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert is_group((4, 5, 6, 7), 8) and is_group((8, 9, 10, 11), 12) and is_group(tuple(range(12)), 12)
    assert not is_group((2, 3, 4, 5), 8) and not is_group((8,) * 1 + (9, 10, 11), 10)  # misaligned; past the end
    assert not is_group((0, 2), 8) and not is_group(tuple(range(8)), 12) and not is_group((), 4)


def test_plans_keep_their_promises_and_are_deterministic():
    masks = [Mask.full(), Mask.chunk_causal(3 * FRAME), Mask.causal(), Mask.full(), Mask.full(), Mask.full(),
             Mask.sliding_window(FRAME, 2), Mask.full(), Mask.packed([3 * FRAME, 2 * FRAME])]
    lengths = [20 * FRAME, 12 * FRAME, 4 * FRAME, FRAME, FRAME, 7 * FRAME, 9 * FRAME, 2, 5 * FRAME]
    for world in (1, 2, 3, 6, 8, 12):
        plan = ps.plan_samples(lengths, world, mask=masks)
        check(plan, lengths, world)
        placement_ms.cache_clear()
        again = ps.plan_samples(lengths, world, mask=masks)
        assert again == plan and again.fingerprint() == plan.fingerprint() and again.steps == plan.steps
        assert len(plan.steps) == 1 and "predicted" in plan.why and f"over {world} dp x cp ranks" in plan.describe()
    assert plan.sizes[7] == 1  # 2 tokens fit groups of at most 2; this plan keeps them on one rank
    # One mask for all is the same as the list of it; another mask is another plan.
    assert ps.plan_samples(lengths[:4], 8) == ps.plan_samples(lengths[:4], 8, mask=[Mask.full()] * 4)


def test_max_tokens_per_rank_holds_and_a_sample_no_group_holds_is_named():
    lengths = [40 * FRAME, 3 * FRAME, FRAME, 16 * FRAME]
    plan = ps.plan_samples(lengths, 16, max_tokens_per_rank=4 * FRAME)
    check(plan, lengths, 16)
    assert all(math.ceil(L / c) <= 4 * FRAME for L, c in zip(lengths, plan.sizes, strict=True))
    assert plan.sizes[0] >= 16 and plan.sizes[3] >= 4 and plan.max_tokens_per_rank == 4 * FRAME
    with pytest.raises(ps.ParallelStateValueError, match=r"sample 0 \(3840 tokens\) fits no group: at most 96 "
                                                         r"tokens per rank needs 40 ranks"):
        ps.plan_samples(lengths, 16, max_tokens_per_rank=FRAME)


def test_per_sample_masks_price_each_sample_by_its_own():
    clip, image = 8 * FRAME, FRAME
    causal = ps.plan_samples([clip, image], 8, mask=[Mask.chunk_causal(3 * FRAME), Mask.full()])
    full = ps.plan_samples([clip, image], 8)
    assert causal.costs[0] == placement_ms(Mask.chunk_causal(3 * FRAME), clip, causal.sizes[0], ps.CostRates(), SHAPE)
    assert causal.costs[0] < placement_ms(Mask.full(), clip, causal.sizes[0], ps.CostRates(), SHAPE)
    assert causal != full and causal.masks[1] == Mask.full()


def test_never_slower_than_fixed_cp_nor_megatron_cores_best_plan():
    """Priced by one model, on seeded video batches at 16 ranks (the benchmark's; bench_samples runs 8 and 64 too)."""
    for kind in ("clips", "short clips"):
        lengths, masks = bench_samples.batch(kind, 16, budget=4 * 1560, frame_tokens=390)  # 240 x 416 video
        plan = ps.plan_samples(lengths, 16, mask=masks)
        check(plan, lengths, 16)
        fixed = bench_samples.fixed_ms(lengths, masks, 16)
        megatron, cap, _ = bench_samples.megatron_best(lengths, masks, 16)
        capped = ps.plan_samples(lengths, 16, mask=masks, max_tokens_per_rank=cap)
        assert plan.predicted_ms <= fixed and plan.predicted_ms <= megatron and capped.predicted_ms <= megatron
        assert plan.predicted_ms >= bench_samples.bound_ms(lengths, masks, 16) * (1 - 1e-12)
    assert fixed / plan.predicted_ms >= 1.2  # short clips: each on few ranks instead of paying 16 ranks' messages


def test_a_hand_built_plan_is_checked():
    full = (Mask.full(),) * 3

    def plan(steps, lengths=(8, 8, 8), world=4):
        return ps.SamplePlan(lengths=lengths, world=world, masks=full[:len(lengths)], steps=steps)

    two_steps = plan(((ps.Placement(0, (0, 1, 2, 3)), ps.Placement(1, (2, 3))), (ps.Placement(2, (1,)),)))
    assert two_steps.placements_for(1) == ((ps.Placement(0, (0, 1, 2, 3)),), (ps.Placement(2, (1,)),))
    assert two_steps.predicted_ms == pytest.approx(recomputed(two_steps), rel=1e-12)  # priced on construction
    assert two_steps.costs[1] == plan_dispatch(Mask.full(), 8, 2).predicted_ms
    assert two_steps.samples_for(3) == (0, 1) and two_steps.step_of(2) == 1 and two_steps.total_tokens == 24
    cases = [
        (((ps.Placement(0, (0, 1)), ps.Placement(0, (2, 3)), ps.Placement(1, (0,)), ps.Placement(2, (1,))),),
         "sample 0 is placed twice"),
        (((ps.Placement(0, (0, 1)),),), "samples [1, 2] are not placed"),
        (((ps.Placement(0, (1, 2)), ps.Placement(1, (0,)), ps.Placement(2, (3,))),), "which is no group of 4"),
        (((ps.Placement(1, (0,)), ps.Placement(0, (0, 1)), ps.Placement(2, (3,))),), "so ranks [1] would wait"),
        (((ps.Placement(5, (0,)),),), "places sample 5, but the batch has 3"),
    ]
    for steps, words in cases:
        with pytest.raises(ps.ParallelStateValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            plan(steps)
    with pytest.raises(ps.ParallelStateValueError, match="fewer than its 4 ranks"):
        plan(((ps.Placement(0, (0, 1, 2, 3)),),), lengths=(3,))
    with pytest.raises(ps.ParallelStateValueError, match="rank 4 is out of range"):
        two_steps.samples_for(4)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(lengths=[], world=4), ValueError, "the batch is empty"),
    (dict(lengths="abc", world=4), TypeError, "lengths must be a sequence"),
    (dict(lengths=[5, 0], world=4), ValueError, "samples [1] have lengths [0]"),
    (dict(lengths=[5, 2.5], world=4), TypeError, "lengths[1] must be an int"),
    (dict(lengths=[5], world=0), ValueError, "world=0 must be >= 1"),
    (dict(lengths=[5, 6], world=2, mask=[Mask.full()]), ValueError, "1 masks for 2 samples"),
    (dict(lengths=[5], world=2, mask="causal"), TypeError, "mask must be a cp.Mask"),
    (dict(lengths=[5, 6], world=2, mask=[Mask.full(), None]), TypeError, "mask of sample 1 must be a cp.Mask"),
    (dict(lengths=[5, 6], world=2, mask=[Mask.full(), Mask.packed([2, 3])]), ValueError, "sample 1 (6 tokens)"),
    (dict(lengths=[5], world=2, rates={}), TypeError, "rates must be a CostRates"),
    (dict(lengths=[5], world=2, shape=(8, 64)), TypeError, "shape must be an AttentionShape"),
    (dict(lengths=[5], world=2, max_tokens_per_rank=0), ValueError, "max_tokens_per_rank=0 must be >= 1"),
])
def test_errors_say_what_was_wrong(kwargs, error, words):
    with pytest.raises(error) as exc:
        ps.plan_samples(**kwargs)
    assert words in str(exc.value) and isinstance(exc.value, ps.ParallelStateError)
