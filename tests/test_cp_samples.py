"""Per-sample context parallelism on 4 real gloo ranks (dp 2 x cp 2, hybrid groups of 2): a variable-length batch
with per-sample masks, run by its plan (sizes 4, 2 and 1) and by a hand-built two-step plan, gives the loss and
gradients of one process computing each sample alone (float64); the plan is the same on every rank and for the
group or its size; each sample runs on the state's group holding exactly its ranks; and the mistakes that would
leave ranks waiting (another plan, another world, groups not built) raise on every rank before any sample runs."""

from __future__ import annotations

import datetime

import pytest
import torch

import cp
import parallel_state as ps
from benchmarks.bench_samples import block_loss, block_out, make_block, step_data
from cpgroups import raises

SECONDS = datetime.timedelta(seconds=30)
M = cp.Mask
LENGTHS = [48, 40, 30, 21, 12, 9, 5, 3]
MASKS = [M.full(), M.chunk_causal(8), M.causal(), M.full(), M.sliding_window(4, 2), M.full(), M.full(), M.causal()]
#: Compute-bound rates (messages nearly free): the planner spreads the long samples over 4 and 2 ranks.
RATES = cp.CostRates(flops_per_ms=1e5, bytes_per_ms=1e9, latency_ms=1e-6)
SHAPE = cp.AttentionShape(heads=2, head_dim=8, dtype="float64")
DIM = 16


def _two_steps():
    """A hand-built plan: two steps, larger groups first in each, every kind of group."""
    P = ps.Placement
    steps = ((P(0, (0, 1, 2, 3)), P(2, (0, 1)), P(1, (2, 3)), P(3, (2,))),
             (P(4, (0, 1, 2, 3)), P(5, (0,)), P(6, (1,)), P(7, (3,))))
    return ps.SamplePlan(lengths=tuple(LENGTHS), world=4, masks=tuple(MASKS), steps=steps, rates=RATES, shape=SHAPE)


def _reference(block, data):
    """One process, each sample alone (attention under the dense mask): the loss and the gradients."""
    block.zero_grad()
    total = sum(((block_out(block, x, lambda q, k, v, m=m, n=x.shape[1]: cp.sdpa_in_layout(
        q, k, v, attn_mask=m.dense(n))) - t) ** 2).sum() for (x, t), m in zip(data, MASKS, strict=True))
    (total / sum(LENGTHS)).backward()
    return (total / sum(LENGTHS)).item(), [p.grad.clone() for p in block.parameters()]


def case_plan_runs_exactly():
    import torch.distributed as dist

    ps.initialize_model_parallel(context_parallel_size=2, hybrid_context_parallel=True, timeout=SECONDS)
    try:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        planned = cp.plan_samples(LENGTHS, dp_cp, mask=MASKS, rates=RATES, shape=SHAPE)
        same = planned == cp.plan_samples(LENGTHS, 4, mask=MASKS, rates=RATES, shape=SHAPE)
        block = make_block(DIM, SHAPE.heads, torch.float64)
        data = step_data(LENGTHS, DIM, torch.float64)
        want_loss, want_grads = _reference(block, data)
        out = {"same": same, "fingerprint": planned.fingerprint(), "sizes": planned.sizes, "runs": {}}
        for name, plan in (("planned", planned), ("two steps", _two_steps())):
            ran, seen = [], []

            def loss_fn(i, group, dispatch, plan=plan, ran=ran, seen=seen):
                ran.append(i)
                members = [] if group is None else dist.get_process_group_ranks(group)
                seen.append((i, members, dispatch == plan.dispatch_plan(i)))
                return block_loss(block, *data[i], group, dispatch)

            block.zero_grad()
            loss = cp.run_samples(plan, loss_fn, block.parameters())
            grads = [p.grad for p in block.parameters()]
            err = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(grads, want_grads, strict=True))
            steps = cp.sample_groups(plan)
            out["runs"][name] = {"loss": (loss.item(), want_loss), "grad_err": err, "ran": ran, "seen": seen,
                                 "steps": [[(s.index, s.group is None) for s in step] for step in steps],
                                 "mine": plan.samples_for(ps.get_data_parallel_rank(with_context_parallel=True))}
        return out
    finally:
        ps.destroy_model_parallel()


def test_a_plan_runs_exactly_as_one_process_computing_each_sample_alone(pools):
    results = pools(4).run(case_plan_runs_exactly, timeout=180)
    assert len({r["fingerprint"] for r in results}) == 1 and all(r["same"] for r in results)
    assert set(results[0]["sizes"]) == {1, 2, 4}  # the planned run takes every kind of group
    plan = cp.plan_samples(LENGTHS, 4, mask=MASKS, rates=RATES, shape=SHAPE)
    for rank, r in enumerate(results):
        for name, run in r["runs"].items():
            loss, want = run["loss"]
            assert loss == pytest.approx(want, rel=1e-12) and run["grad_err"] < 1e-10, (rank, name)
            chosen = plan if name == "planned" else _two_steps()
            assert tuple(run["ran"]) == chosen.samples_for(rank) == tuple(run["mine"])
            for i, members, same_dispatch in run["seen"]:  # its group holds exactly the placement's ranks
                ranks = chosen.placement(i).ranks
                assert members == ([] if len(ranks) == 1 else list(ranks)) and same_dispatch, (rank, name, i)
            assert len(run["steps"]) == len(chosen.steps)


def case_mistakes_raise_on_every_rank():
    checks = 0
    ps.initialize_model_parallel(context_parallel_size=2, hybrid_context_parallel=True, timeout=SECONDS)
    try:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        me = dp_cp.rank()
        raises(ValueError, ["the plan is for 2 dp x cp ranks but this dp x cp group has 4"], cp.sample_groups,
               cp.plan_samples([5, 6, 7], 2))
        mine = cp.plan_samples([5, 6, 7 + (me == 0)], 4)  # rank 0 planned another batch
        raises(ValueError, ["the dp x cp ranks hold different plans"], cp.sample_groups, mine)
        raises(TypeError, ["plan must be a SamplePlan"], cp.sample_groups, [5, 6])
        raises(TypeError, ["world must be a torch.distributed ProcessGroup"], cp.plan_samples, [5, 6], "world")
        plan = _two_steps()
        block = make_block(DIM, SHAPE.heads, torch.float64)
        raises(TypeError, ["loss_fn must return the loss summed over this rank's tokens"], cp.run_samples, plan,
               lambda i, g, d: 0.5, block.parameters())
        checks += 5
    finally:
        ps.destroy_model_parallel()
    raises(ps.ParallelStateError, ["call parallel_state.initialize_model_parallel"], cp.sample_groups, _two_steps())
    ps.initialize_model_parallel(context_parallel_size=2, timeout=SECONDS)  # no hybrid groups
    try:
        raises(ValueError, ["hybrid_context_parallel=True"], cp.sample_groups, _two_steps())
        # A plan on one rank and all ranks only needs no hybrid group.
        flat = ps.SamplePlan(lengths=(5, 6), world=4, masks=(M.full(),) * 2,
                             steps=((ps.Placement(0, (0, 1, 2, 3)), ps.Placement(1, (3,))),))
        assert [len(step) for step in cp.sample_groups(flat)] == [2 if me == 3 else 1]
        checks += 3
    finally:
        ps.destroy_model_parallel()
    return checks


def test_mistakes_raise_the_same_error_on_every_rank(pools):
    assert pools(4).run(case_mistakes_raise_on_every_rank, timeout=120) == [8] * 4
