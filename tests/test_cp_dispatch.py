"""cp.dispatch / cp.undispatch on real gloo ranks: round trips and gradients for every mask kind, every plan method,
even and uneven lengths, at cp 4 (the world), 3 (a subgroup) and 2 (members 0, 2 and 1, 3: group rank != global
rank), checked against indexing the whole sequence in one process; and the errors, raised on every rank. And
cp.measure_rates on 2-rank groups: measured once, cached, the same on both ranks."""

from __future__ import annotations

import os

import pytest
import torch

import cp
from cpgroups import data as _data
from cpgroups import raises

# ---------------------------------------------------------------- helpers run on every rank


def _groups():
    """(group or None for a non-member, label): the world of 4, ranks 0-2, and cp 2 groups (0, 2) / (1, 3)."""
    import torch.distributed as dist

    from cpgroups import cp_groups

    world, pairs = cp_groups()
    three = dist.new_group([0, 1, 2])
    return [(world, "cp4"), (None if dist.get_rank() == 3 else three, "cp3"), (pairs, "cp2")], three


def _cases(n):
    """(length, mask, method, shape, seq_dim): every kind, both methods, even (24) and uneven (23, 13) lengths,
    the sequence leading, behind a batch or last, and one tensor big enough for gloo's broadcast gather."""
    combos = [(24, cp.Mask.causal(), "balanced"), (23, cp.Mask.chunk_causal(5), "balanced"),
              (23, cp.Mask.sliding_window(3, 2), "balanced"), (24, cp.Mask.packed([15, 9], 3), "balanced"),
              (13, cp.Mask.packed([4, 9]), "balanced"), (23, cp.Mask.full(), "balanced"),
              (23, cp.Mask.causal(), "contiguous"), (24, cp.Mask.packed([3, 11, 4, 6]), "clips")]
    out = []
    for i, (length, mask, method) in enumerate(combos):
        shape, d = [((length, 3), 0), ((2, length, 3), 1), ((2, 3, length), -1)][(i + n) % 3]
        out.append((length, mask, method, shape, d))
    return out + [(23, cp.Mask.causal(), "balanced", (23, 2048), 0)]


def case_round_trips_and_gradients():
    """Per group and case: dispatch = index the whole sequence by plan.positions[rank]; undispatch brings it
    back exactly; gradients through each and both."""
    import torch.distributed as dist

    groups, three = _groups()
    checks = 0
    try:
        for g, label in groups:
            if g is None:
                continue
            n, r = g.size(), g.rank()
            for length, mask, method, shape, d in _cases(n):
                plan = cp.plan_dispatch(mask, length, n, method=method)
                index = torch.tensor(plan.positions[r])
                x = _data(shape, seed=length)
                local = cp.dispatch(x, plan, d, g)
                assert torch.equal(local, x.index_select(d, index)), (label, mask, shape)
                assert torch.equal(cp.undispatch(local, plan, d, g), x), (label, mask, method, shape)
                # gradients: dispatch alone, undispatch alone, and the round trip summed over the group
                c = _data(shape, seed=99)
                leaf = x.clone().requires_grad_(True)
                w = _data(local.shape, seed=7 + r)
                (cp.dispatch(leaf, plan, d, g) * w).sum().backward()
                assert torch.equal(leaf.grad, torch.zeros_like(x).index_copy_(d % x.dim(), index, w)), (label, mask)
                mine = local.detach().clone().requires_grad_(True)
                (cp.undispatch(mine, plan, d, g) * c).sum().backward()
                assert torch.equal(mine.grad, c.index_select(d, index)), (label, mask, shape)
                leaf.grad = None
                (cp.undispatch(cp.dispatch(leaf, plan, d, g) * 2, plan, d, g) * c).sum().backward()
                total = leaf.grad.clone()
                dist.all_reduce(total, group=g)
                assert torch.equal(total, 2 * c), (label, mask, shape)
                checks += 1
    finally:
        if dist.get_rank() != 3:
            dist.destroy_process_group(three)
    return checks


def case_rates_measured_once_and_agreed():
    """cp.measure_rates on the 2-rank groups (0, 2) and (1, 3): valid rates, the same on both ranks of a group, a
    second call a lookup without communication, a plan from them the same on both ranks; its errors."""
    import torch.distributed as dist

    from cpgroups import cp_groups, spying

    _, pair = cp_groups()
    rates = cp.measure_rates(pair, heads=2, head_dim=16)
    assert isinstance(rates, cp.CostRates) and rates.flops_per_ms > 0 and rates.bytes_per_ms > 0
    assert rates.latency_ms >= 0 and 0 <= rates.overlap <= 1 and 1 <= rates.parallel <= 2
    calls = []
    with spying(lambda name, args, kwargs: calls.append(name)):
        assert cp.measure_rates(pair, heads=2, head_dim=16) is rates
    assert calls == []  # cached: no communication
    mine = torch.tensor([rates.flops_per_ms, rates.bytes_per_ms, rates.latency_ms, rates.overlap, rates.parallel],
                        dtype=torch.float64)
    both = torch.empty(2 * mine.numel(), dtype=torch.float64)
    dist.all_gather_into_tensor(both, mine, group=pair)
    assert torch.equal(both[:5], both[5:])  # bit for bit: every rank plans the same
    plan = cp.plan_dispatch(cp.Mask.packed([40, 20, 36]), 96, 2, rates=rates,
                            shape=cp.AttentionShape(heads=2, head_dim=16, dtype="float32"))
    prints = torch.empty(2, dtype=torch.int64)
    dist.all_gather_into_tensor(prints, torch.tensor([plan.fingerprint()]), group=pair)
    assert prints[0] == prints[1] and plan.predicted_ms <= min(
        c.predicted_ms for c in plan.candidates if c.method == "contiguous")
    raises(TypeError, ["measure_rates: group must be a torch.distributed ProcessGroup"], cp.measure_rates, "world")
    raises(ValueError, ["head_dim must be an int >= 1, got 0"], cp.measure_rates, pair, head_dim=0)
    return True


def case_no_group():
    x = _data((2, 9, 3), seed=1)
    plan = cp.plan_dispatch(cp.Mask.causal(), 9, 1)
    assert cp.dispatch(x, plan, 1) is x and cp.undispatch(x, plan, 1, None) is x
    raises(ValueError, ["plan is for cp_size=2 but got cp_group=None (context parallelism off)",
                        "cp.plan_dispatch(mask, length, 1)"], cp.dispatch, x, cp.plan_dispatch(cp.Mask.causal(), 9, 2), 1)
    raises(ValueError, ["y has 8 tokens along seq_dim=1 but the plan is for 9"], cp.undispatch, x[:, :8], plan, 1)
    return True


def case_errors():
    """Every mistake raises on every rank (each rank returns how many it saw; a hang would time the case out)."""
    import torch.distributed as dist

    g, rank = dist.group.WORLD, dist.get_rank()
    mask = cp.Mask.chunk_causal(3)
    plan = cp.plan_dispatch(mask, 14, 4)  # sizes 4, 4, 3, 3
    x = _data((2, 14), seed=3)
    seen = 0
    seen += bool(raises(ValueError, ["chunk must be >= 1, got 0"], cp.Mask.chunk_causal, 0))
    seen += bool(raises(ValueError, ["window must be >= 1, got 0"], cp.Mask.sliding_window, 3, 0))
    seen += bool(raises(ValueError, ["segments add up to 10 tokens but the sequence has 14"],
                        cp.plan_dispatch, cp.Mask.packed([4, 6]), 14, 4))
    seen += bool(raises(ValueError, ["the plan is for cp_size=3 but got a group of 4 ranks", "plan_dispatch(mask, "
                                     "length, 4)"], cp.dispatch, x, cp.plan_dispatch(mask, 14, 3), 1, g))
    seen += bool(raises(ValueError, ["the plan is for cp_size=2"], cp.undispatch, x, cp.plan_dispatch(mask, 14, 2), 1, g))
    seen += bool(raises(TypeError, ["plan must be a DispatchPlan"], cp.dispatch, x, mask, 1, g))
    seen += bool(raises(TypeError, ["x must be a torch.Tensor"], cp.dispatch, x.tolist(), plan, 1, g))
    seen += bool(raises(TypeError, ["cp_group must be a torch.distributed ProcessGroup"], cp.dispatch, x, plan, 1, 4))
    seen += bool(raises(ValueError, ["x has shape (2, 13), 13 tokens along seq_dim=1, but the plan is for 14"],
                        cp.dispatch, x[:, :13], plan, 1, g))
    seen += bool(raises(ValueError, ["seq_dim=2 is out of range"], cp.dispatch, x, plan, 2, g))
    # a rank holding a token too many: the same error on every rank, before any data moves
    local = cp.dispatch(x, plan, 1, g)
    wrong = torch.cat([local, local[:, :1]], 1) if rank == 1 else local
    seen += bool(raises(ValueError, ["group rank 1 (global 1) holds 5, expected 4",
                                     "give rank r the tokens cp.dispatch(x, plan, seq_dim, group) gives it"],
                        cp.undispatch, wrong, plan, 1, g))
    seen += bool(raises(ValueError, ["the shards must differ only in their size"], cp.undispatch,
                        local.float() if rank == 2 else local, plan, 1, g))
    # ranks holding different plans: found in debug mode, on every rank
    other = cp.plan_dispatch(mask, 14, 4, method="contiguous" if rank == 0 else "balanced")
    os.environ["PARALLEL_STATE_DEBUG"] = "1"
    try:
        for fn, t in ((cp.dispatch, x), (cp.undispatch, cp.dispatch(x, plan, 1, g))):
            seen += bool(raises(ValueError, ["the ranks hold different plans", "group ranks 0 (global 0): plan",
                                             "group ranks 1 (global 1), 2 (global 2), 3 (global 3): plan"],
                                fn, t, other, 1, g))
    finally:
        del os.environ["PARALLEL_STATE_DEBUG"]
    return seen


# ---------------------------------------------------------------- tests


def test_dispatch_round_trips_and_gradients(pools):
    per_group = 9  # rank 3 is not in the cp 3 group
    assert pools(4).run(case_round_trips_and_gradients, timeout=120) == [3 * per_group] * 3 + [2 * per_group]


def test_rates_measured_once_and_agreed(pools):
    assert pools(4).run(case_rates_measured_once_and_agreed) == [True] * 4


def test_ranks_computing_at_once_are_counted():
    """measure_rates' sharing count from each rank's (host, device, cores over threads): GPUs by distinct device per
    host, CPU ranks by the cores their threads can use (4 one-thread ranks on 2 cores: 2 at once)."""
    from cp.rates import ranks_at_once

    assert ranks_at_once([[1, 0, 2.0]] * 4, cuda=False) == 2.0
    assert ranks_at_once([[1, 0, 8.0]] * 4 + [[2, 0, 1.0]] * 3, cuda=False) == 5.0  # 4 of host 1, 1 of host 2
    assert ranks_at_once([[1, d, 1.0] for d in range(8)] + [[2, 0, 1.0]] * 2, cuda=True) == 9.0  # two share host 2's GPU


def test_dispatch_without_group():
    assert case_no_group()


def test_dispatch_errors_on_every_rank(pools):
    assert pools(4).run(case_errors) == [14] * 4


def test_one_class_and_public_names():
    import parallel_state as ps

    assert cp.Mask is ps.AttentionMask and cp.DispatchPlan is ps.DispatchPlan and cp.plan_dispatch is ps.plan_dispatch
    assert {"Mask", "DispatchPlan", "plan_dispatch", "dispatch", "undispatch", "CostRates", "AttentionShape",
            "measure_rates"} <= set(cp.__all__)
    assert cp.CostRates is ps.CostRates and cp.AttentionShape is ps.AttentionShape


@pytest.mark.parametrize("seq_dim", [0, -1])
def test_group_of_one_is_the_identity(seq_dim):
    x = _data((5, 5), seed=2)
    plan = cp.plan_dispatch(cp.Mask.causal(), 5, 1)
    assert cp.dispatch(x, plan, seq_dim) is x and cp.undispatch(x, plan, seq_dim) is x
