"""The pure planning layer against megatron-core's RankGenerator, over many topologies."""

from __future__ import annotations

import itertools

import pytest

from parallel_state import ParallelStateAssertionError, ParallelStateError, TopologyPlan
from parallel_state.topology.kinds import GridLayout as Layout
from parallel_state.topology.plan import GridKind

ORDERS = ["tp-cp-ep-dp-pp", "tp-pp-dp", "tp-cp-pp-dp", "pp-dp-tp-cp", "dp-cp-tp-pp", "cp-tp-dp-pp",
          "tp-dp-pp", "TP-CP-EP-DP-PP", "ep-pp-cp-dp-tp", "tp-cp-dp-pp"]


def _megatron_token(spec):
    """A grid kind's dimensions as megatron-core 0.16 names them: gtp_remat (0.19, here of size 1) adds nothing."""
    return "-".join(t for t in spec.dims if t != "gtp_remat")


def _topologies():
    for ws in (1, 2, 4, 6, 8, 12, 16, 48):
        for tp, cp, pp, ep in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3), (1, 2)):
            if ws % (tp * cp * pp) == 0 and ws % (tp * ep * pp) == 0:
                yield ws, tp, cp, pp, ep


def _megatron_generators(ws, tp, cp, pp, ep, etp, order):
    from megatron.core.parallel_state import RankGenerator

    decoder = RankGenerator(tp=tp, ep=1, dp=ws // (tp * cp * pp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=ws // (etp * ep * pp), pp=pp, cp=1, order=order)
    # megatron-core's two assertions on these generators, in its order (it tests the order as written).
    if not (order.endswith("pp") or pp == 1 or expert.dp == decoder.dp):
        raise AssertionError("does not end with 'pp'")
    if decoder.get_ranks("pp") != expert.get_ranks("pp"):
        raise AssertionError("must have the decoder")
    return decoder, expert


def test_every_grid_kind_matches_megatron_rank_generators():
    checked = 0
    for (ws, tp, cp, pp, ep), order in itertools.product(list(_topologies()), ORDERS):
        etp = 1 if tp > 1 and ep > 1 else tp  # an etp different from tp, where it fits
        try:
            decoder, expert = _megatron_generators(ws, tp, cp, pp, ep, etp, order)
        except AssertionError as refused:
            if ep == 1 and etp == tp:
                # megatron-core refuses pp before dp with cp; with no experts we lay them over the decoder.
                plan = TopologyPlan(ws, tp=tp, cp=cp, pp=pp, order=order)
                assert [plan.group_ranks(k, 1 % ws) for k in ("etp", "etp-ep-pp", "edp")] == \
                    [plan.group_ranks(k, 1 % ws) for k in ("tp", "tp-pp", "dp-cp")]
                continue
            with pytest.raises(ParallelStateAssertionError, match=str(refused)):
                TopologyPlan(ws, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
            continue
        except RuntimeError as exc:
            with pytest.raises(ParallelStateError, match="does not name|must have the decoder") as info:
                TopologyPlan(ws, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
            # Where megatron-core asserts, ours is an AssertionError too.
            assert isinstance(info.value, AssertionError) == isinstance(exc, AssertionError)
            continue
        plan = TopologyPlan(ws, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
        for kind, spec in plan.kinds.items():
            if not isinstance(spec, GridKind) or kind == "dp-cp-ag":
                continue
            token = _megatron_token(spec)
            generator = decoder if spec.layout is Layout.DECODER else expert
            ref = generator.get_ranks(token) if token else [[r] for r in range(ws)]
            assert [list(g) for g in plan.groups(kind)] == ref, (ws, tp, cp, pp, ep, order, kind)
            for rank in sorted({0, 1 % ws, ws // 2, ws - 1}):
                mine = plan.group_ranks(kind, rank)
                assert list(mine) == ref[plan.group_index(kind, rank)]
                assert mine[plan.group_rank(kind, rank)] == rank
            checked += 1
    assert checked > 1500


def _partition(plan, kind):
    """Every rank's group of ``kind``, as a set; checks that the groups partition their members."""
    groups = {plan.group_ranks(kind, r) for r in range(plan.world_size)} - {()}
    assert sum(len(g) for g in groups) == len({r for g in groups for r in g}), kind
    assert len(list(plan.groups(kind))) == plan.num_groups(kind) == len(groups), kind
    assert {plan.group_index(kind, g[0]) for g in groups} == set(range(len(groups))), kind
    for g in groups:
        assert {plan.group_index(kind, r) for r in g} == {plan.group_index(kind, g[0])}
        assert sorted(plan.group_rank(kind, r) for r in g) == list(range(len(g)))
    return groups


def test_derived_kinds_split_their_base_groups_as_megatron_does():
    plan = TopologyPlan(16, tp=2, cp=4, pp=1, ep=2, etp=1, dist_opt_instances=2, hierarchical_cp=[2, 2],
                        hybrid_cp=True, all_gather=True)
    dp_cp = _partition(plan, "dp-cp")  # dp 2 x cp 4 = 8 ranks per group
    # One distributed-optimizer instance holds a contiguous half of each dp x cp group.
    assert _partition(plan, "dp-cp-intra") == {g[i:i + 4] for g in dp_cp for i in (0, 4)}
    # Hierarchical cp [2, 2]: level 0 pairs neighbours in the cp group, level 1 pairs across.
    cp = _partition(plan, "cp")
    assert _partition(plan, "cp-l0") == {g[i:i + 2] for g in cp for i in (0, 2)}
    assert _partition(plan, "cp-l1") == {g[i::2] for g in cp for i in (0, 1)}
    # Hybrid cp: contiguous blocks of 2 and 4 of each dp x cp group of 8.
    assert _partition(plan, "dp-cp-hybrid2") == {g[i:i + 2] for g in dp_cp for i in range(0, 8, 2)}
    assert _partition(plan, "dp-cp-hybrid4") == {g[i:i + 4] for g in dp_cp for i in (0, 4)}
    assert "dp-cp-hybrid8" not in plan.kinds
    assert _partition(plan, "dp-cp-ag") == dp_cp and not plan.same_group("dp-cp-ag", "dp-cp")
    # Expert dp (16 / (1 * 2 * 1) = 8 ranks) in 2 instances: intra blocks of 4, inter strided.
    edp = _partition(plan, "edp")
    assert _partition(plan, "edp-intra") == {g[i:i + 4] for g in edp for i in (0, 4)}
    assert _partition(plan, "edp-inter") == {g[i::4] for g in edp for i in range(4)}
    # An instance: the union of 4 consecutive expert tp x ep x pp groups (of 2 ranks each).
    runs = [plan.group_ranks("etp-ep-pp", r) for r in range(16)]
    ordered = list(dict.fromkeys(runs))
    assert _partition(plan, "dist-opt") == {tuple(sorted(sum(ordered[i:i + 4], ()))) for i in (0, 4)}
    # Embeddings: first and last stage; position embeddings: first (pp 1: the rank itself).
    assert _partition(plan, "embd") == _partition(plan, "pos-embd") == {(r,) for r in range(16)}


def test_embedding_kinds_follow_the_callables():
    plan = TopologyPlan(8, pp=4, embedding_ranks=lambda ranks: [ranks[0], ranks[2]])
    # pp groups are [0, 2, 4, 6] and [1, 3, 5, 7]; stages 0 and 2 hold the embedding.
    assert [plan.group_ranks("embd", r) for r in range(8)] == [(0, 4), (1, 5), (), (), (0, 4), (1, 5), (), ()]
    assert [plan.group_ranks("pos-embd", r) for r in range(8)] == [(0,), (1,)] + [()] * 6
    assert plan.num_groups("embd") == 2 and plan.group_index("embd", 5) == 1
    for fn, match in [(lambda r: [99], "ranks \\[99\\] are not in that pipeline"), (lambda r: [], "no rank"),
                      (lambda r: [r[0], r[0]], "a rank twice"), (lambda r: None, "must return a list"),
                      (lambda r: 1 / 0, "raised ZeroDivisionError")]:
        with pytest.raises(ParallelStateError, match=match):
            TopologyPlan(8, pp=4, embedding_ranks=fn).group_ranks("embd", 0)


def test_one_instance_and_default_etp_share_groups():
    plan = TopologyPlan(8, tp=2, cp=2, ep=2)
    assert plan.same_group("dp-cp-intra", "dp-cp") and plan.same_group("edp-intra", "edp")
    assert plan.same_group("etp", "tp") and "edp-inter" not in plan.kinds
    assert plan.signature("dist-opt") == ((1, 8),)  # one instance: the whole world


def test_coords_rebuild_the_rank():
    plan = TopologyPlan(48, tp=2, cp=4, pp=3, order="tp-cp-pp-dp")
    for rank in range(48):
        c = plan.coords(rank)
        assert c["tp"] + 2 * c["cp"] + 8 * c["pp"] + 24 * c["dp"] == rank


def test_missing_tokens_are_appended_in_megatron_order():
    assert TopologyPlan(4, tp=2, pp=2, order="tp-pp").order == "tp-pp-dp-ep-cp"


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=8, tp=3), "not divisible by tp\\*cp\\*pp = 3\\*1\\*1 = 3"),
    (dict(world_size=8, ep=3), "not divisible by expert tp\\*ep\\*pp = 1\\*3\\*1 = 3"),
    (dict(world_size=8, cp=2, hierarchical_cp=[2, 2]), "multiply to 4, not context_parallel_size=2"),
    (dict(world_size=8, cp=2, hierarchical_cp=[2, 0]), "hierarchical context-parallel size must be >= 1"),
    (dict(world_size=8, dist_opt_instances=3), "must divide the data-parallel sizes"),
    (dict(world_size=3, cp=3, hybrid_cp=True), "hybrid_context_parallel needs an even number"),
    (dict(world_size=8, cp=2, ep=2, pp=2, order="tp-cp-pp-ep-dp"), "must have the decoder's data-parallel size"),
    # megatron-core's first assertion, before its pipelines are compared (issue 30's case: dp 4, expert dp 2).
    (dict(world_size=8, tp=2, ep=2, pp=2, order="tp-cp-ep-pp-dp"), "does not end with 'pp' and pp is 2"),
    (dict(world_size=8, pp=2, ep=2, order="tp-pp-ep-dp"), "dp is 4 and expert dp is 2: end the order with 'pp'"),
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
