"""The pure planning layer against megatron-core's RankGenerator, over many topologies."""

from __future__ import annotations

import itertools

import pytest

from parallel_state import ParallelStateError, TopologyPlan
from parallel_state.plan import KINDS

ORDERS = ["tp-cp-ep-dp-pp", "tp-pp-dp", "tp-cp-pp-dp", "pp-dp-tp-cp", "dp-cp-tp-pp", "cp-tp-dp-pp",
          "tp-dp-pp", "TP-CP-EP-DP-PP", "ep-pp-cp-dp-tp", "tp-cp-dp-pp"]


def _topologies():
    for ws in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        for tp, cp, pp in itertools.product((1, 2, 3, 4), (1, 2, 4, 8), (1, 2, 3, 4)):
            if ws % (tp * cp * pp) == 0:
                yield ws, tp, cp, pp


def test_every_group_matches_megatron_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    checked = 0
    for (ws, tp, cp, pp), order in itertools.product(list(_topologies()), ORDERS):
        try:
            ref = RankGenerator(tp=tp, ep=1, dp=ws // (tp * cp * pp), pp=pp, cp=cp, order=order)
        except RuntimeError:
            with pytest.raises(ParallelStateError, match="does not name"):
                TopologyPlan(ws, tp=tp, cp=cp, pp=pp, order=order)
            continue
        plan = TopologyPlan(ws, tp=tp, cp=cp, pp=pp, order=order)
        for kind in KINDS:
            expected = ref.get_ranks(kind)
            assert [list(g) for g in plan.groups(kind)] == expected, (ws, tp, cp, pp, order, kind)
            for rank in range(ws):
                mine = plan.group_ranks(kind, rank)
                assert list(mine) == expected[plan.group_index(kind, rank)]
                assert mine[plan.group_rank(kind, rank)] == rank
            checked += 1
    assert checked > 5000


def test_coords_rebuild_the_rank():
    plan = TopologyPlan(48, tp=2, cp=4, pp=3, order="tp-cp-pp-dp")
    for rank in range(48):
        c = plan.coords(rank)
        assert c["tp"] + 2 * c["cp"] + 8 * c["pp"] + 24 * c["dp"] == rank


def test_missing_tokens_are_appended_in_megatron_order():
    assert TopologyPlan(4, tp=2, pp=2, order="tp-pp").order == "tp-pp-dp-ep-cp"


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=8, tp=3), "not divisible by tp\\*cp\\*pp\\*ep = 3\\*1\\*1\\*1 = 3"),
    (dict(world_size=8, cp=0), "cp size must be >= 1, got 0"),
    (dict(world_size=8, pp=-2), "pp size must be >= 1"),
    (dict(world_size=0), "world_size must be >= 1"),
    (dict(world_size=8, tp=2.0), "tp size must be a positive int"),
    (dict(world_size=8, tp=True), "tp size must be a positive int"),
    (dict(world_size=8, order="tp-xp-dp"), "unknown token\\(s\\) \\['xp'\\]"),
    (dict(world_size=8, order="tp-tp-dp"), "repeats token\\(s\\) \\['tp'\\]"),
    (dict(world_size=8, cp=2, order="tp-dp-pp"), "cp size is 2 but order 'tp-dp-pp' does not name 'cp'"),
    (dict(world_size=8, order=3), "order must be a string"),
])
def test_invalid_topologies_are_explained(kwargs, match):
    with pytest.raises(ParallelStateError, match=match):
        TopologyPlan(**kwargs)


def test_same_group_follows_sizes():
    plan = TopologyPlan(8, tp=1, cp=2, pp=2)
    assert plan.same_group("tp-cp", "cp") and plan.same_group("tp-pp", "pp")
    assert not plan.same_group("cp", "pp")


def test_plan_questions_cost_no_world_enumeration():
    # 2**20 ranks: answering for one rank must not walk the world.
    plan = TopologyPlan(1 << 20, tp=8, cp=4, pp=8)
    assert len(plan.group_ranks("tp-dp-cp", 123457)) == (1 << 20) // 8
    assert plan.group_ranks("cp", 123457) == tuple(123457 - 123457 % 32 + 123457 % 8 + 8 * i for i in range(4))
