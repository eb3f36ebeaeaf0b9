"""The parallel-state core on real gloo ranks: layout, every accessor, errors, teardown."""

from __future__ import annotations

import datetime
import inspect

import pytest

import parallel_state as ps
from parallel_state import ParallelStateError, TopologyPlan
from rankpool import RankFailure

TOPOLOGIES = {
    1: [dict(tp=1, cp=1, pp=1)],
    2: [dict(cp=2), dict(pp=2), dict(tp=2)],
    4: [dict(cp=2, pp=2), dict(tp=2, cp=2), dict(cp=4), dict(tp=2, pp=2, order="tp-pp-dp"),
        dict(cp=2, pp=2, order="tp-cp-pp-dp")],
    8: [dict(tp=2, cp=2, pp=2), dict(cp=4, pp=2), dict(cp=2, pp=2, order="pp-dp-tp-cp"),
        dict(tp=2, pp=2)],
}

GROUP_ACCESSORS = {  # accessor -> the group kind it must return
    "get_tensor_model_parallel_group": "tp", "get_context_parallel_group": "cp",
    "get_pipeline_model_parallel_group": "pp", "get_data_parallel_group": "dp",
    "get_model_parallel_group": "tp-pp", "get_tensor_and_context_parallel_group": "tp-cp",
    "get_tensor_and_data_parallel_group": "tp-dp",
    "get_tp_group": "tp", "get_cp_group": "cp", "get_pp_group": "pp", "get_dp_group": "dp",
    "get_data_parallel_group_gloo": "dp", "get_dp_group_gloo": "dp",
}


def _ranks_of(group):
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def _topology_kwargs(topo):
    return dict(tensor_model_parallel_size=topo.get("tp", 1), context_parallel_size=topo.get("cp", 1),
                pipeline_model_parallel_size=topo.get("pp", 1), order=topo.get("order", "tp-cp-ep-dp-pp"))


def case_accessors(topo):
    """Initialize ``topo`` and report everything the accessors say, checked against real collectives."""
    import torch
    import torch.distributed as dist

    ps.initialize_model_parallel(**_topology_kwargs(topo), timeout=datetime.timedelta(seconds=30))
    out = {"groups": {}, "dp_cp": _ranks_of(ps.get_data_parallel_group(with_context_parallel=True)),
           "dp_cp_gloo": _ranks_of(ps.get_data_parallel_group_gloo(with_context_parallel=True)),
           "tp_dp_cp": _ranks_of(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
           "tp_cp_via_tp": _ranks_of(ps.get_tp_group(with_context_parallel=True))}
    for name in GROUP_ACCESSORS:
        group = getattr(ps, name)()
        ranks = _ranks_of(group)
        # A real collective proves the group works and holds these members.
        t = torch.tensor([dist.get_rank()], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks), (name, ranks)
        out["groups"][name] = ranks
    for name in ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
                 "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
                 "get_context_parallel_rank", "get_context_parallel_world_size",
                 "get_data_parallel_rank", "get_data_parallel_world_size",
                 "get_tensor_and_context_parallel_rank", "get_tensor_and_context_parallel_world_size",
                 "get_tensor_model_parallel_src_rank", "get_model_parallel_src_rank",
                 "get_data_parallel_src_rank", "get_context_parallel_global_ranks",
                 "get_pipeline_model_parallel_first_rank", "get_pipeline_model_parallel_last_rank",
                 "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
                 "is_pipeline_first_stage", "is_pipeline_last_stage",
                 "get_tp_rank", "get_tp_world_size", "get_cp_rank", "get_cp_world_size",
                 "get_pp_rank", "get_pp_world_size", "get_dp_rank", "get_dp_world_size",
                 "get_tensor_model_parallel_ranks", "get_tensor_model_parallel_last_rank",
                 "model_parallel_is_initialized", "is_initialized", "get_all_ranks"):
        out[name] = getattr(ps, name)()
    out["dp_rank_cp"] = ps.get_data_parallel_rank(with_context_parallel=True)
    out["dp_size_cp"] = ps.get_data_parallel_world_size(with_context_parallel=True)
    out["dp_src_cp"] = ps.get_data_parallel_src_rank(with_context_parallel=True)
    out["tp_ranks_cp"] = ps.get_tensor_model_parallel_ranks(with_context_parallel=True)
    out["tp_last_cp"] = ps.get_tensor_model_parallel_last_rank(with_context_parallel=True)
    out["tp_rank_cp"] = ps.get_tp_rank(with_context_parallel=True)
    out["tp_size_cp"] = ps.get_tp_world_size(with_context_parallel=True)
    # The real group ranks agree with the plan-derived ranks.
    assert ps.get_context_parallel_rank() == dist.get_rank(ps.get_context_parallel_group())
    assert ps.get_pipeline_model_parallel_rank() == dist.get_rank(ps.get_pipeline_model_parallel_group())
    return out


def _expected(world, topo, rank):
    plan = TopologyPlan(world, tp=topo.get("tp", 1), cp=topo.get("cp", 1), pp=topo.get("pp", 1),
                        order=topo.get("order", "tp-cp-ep-dp-pp"))
    g = {k: list(plan.group_ranks(k, rank)) for k in ("tp", "cp", "pp", "dp", "dp-cp", "tp-pp", "tp-cp", "tp-dp",
                                                       "tp-dp-cp")}
    return plan, g


@pytest.mark.parametrize("world, topo", [(w, t) for w, ts in TOPOLOGIES.items() for t in ts],
                         ids=lambda v: str(v))
def test_every_accessor_matches_megatron_layout(pools, world, topo):
    from megatron.core.parallel_state import RankGenerator

    results = pools(world).run(case_accessors, topo)
    plan0 = _expected(world, topo, 0)[0]
    ref = RankGenerator(tp=plan0.tp, ep=1, dp=plan0.dp, pp=plan0.pp, cp=plan0.cp, order=topo.get("order", "tp-cp-ep-dp-pp"))
    for rank, out in enumerate(results):
        plan, g = _expected(world, topo, rank)
        for kind, ranks in g.items():  # the plan is Megatron's layout
            assert ranks in ref.get_ranks(kind)
        for name, kind in GROUP_ACCESSORS.items():
            assert out["groups"][name] == g[kind], (rank, name)
        assert out["dp_cp"] == g["dp-cp"] and out["dp_cp_gloo"] == g["dp-cp"]
        assert out["tp_dp_cp"] == g["tp-dp-cp"] and out["tp_cp_via_tp"] == g["tp-cp"]
        c = plan.coords(rank)
        pp = g["pp"]
        expected = {
            "get_tensor_model_parallel_rank": g["tp"].index(rank), "get_tensor_model_parallel_world_size": plan.tp,
            "get_pipeline_model_parallel_rank": c["pp"], "get_pipeline_model_parallel_world_size": plan.pp,
            "get_context_parallel_rank": c["cp"], "get_context_parallel_world_size": plan.cp,
            "get_data_parallel_rank": c["dp"], "get_data_parallel_world_size": plan.dp,
            "get_tensor_and_context_parallel_rank": g["tp-cp"].index(rank),
            "get_tensor_and_context_parallel_world_size": plan.tp * plan.cp,
            "get_tensor_model_parallel_src_rank": g["tp"][0], "get_model_parallel_src_rank": g["tp-pp"][0],
            "get_data_parallel_src_rank": g["dp"][0], "get_context_parallel_global_ranks": g["cp"],
            "get_pipeline_model_parallel_first_rank": pp[0], "get_pipeline_model_parallel_last_rank": pp[-1],
            "get_pipeline_model_parallel_next_rank": pp[(c["pp"] + 1) % plan.pp],
            "get_pipeline_model_parallel_prev_rank": pp[(c["pp"] - 1) % plan.pp],
            "is_pipeline_first_stage": c["pp"] == 0, "is_pipeline_last_stage": c["pp"] == plan.pp - 1,
            "get_tp_rank": g["tp"].index(rank), "get_tp_world_size": plan.tp,
            "get_cp_rank": c["cp"], "get_cp_world_size": plan.cp, "get_pp_rank": c["pp"],
            "get_pp_world_size": plan.pp, "get_dp_rank": c["dp"], "get_dp_world_size": plan.dp,
            "get_tensor_model_parallel_ranks": g["tp"], "get_tensor_model_parallel_last_rank": g["tp"][-1],
            "model_parallel_is_initialized": True, "is_initialized": True,
            "get_all_ranks": f"{g['tp'].index(rank)}_{c['dp']}_{c['cp']}_{c['pp']}_0",
            "dp_rank_cp": g["dp-cp"].index(rank), "dp_size_cp": plan.dp * plan.cp, "dp_src_cp": g["dp-cp"][0],
            "tp_ranks_cp": g["tp-cp"], "tp_last_cp": g["tp-cp"][-1], "tp_rank_cp": g["tp-cp"].index(rank),
            "tp_size_cp": plan.tp * plan.cp,
        }
        for name, value in expected.items():
            assert out[name] == value, (rank, name, out[name], value)


def case_rebuild_cycles(topologies, cycles):
    """Initialize/destroy many topologies; torch's registry must come back to what it was each time."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)
    sizes = []
    for i in range(cycles):
        topo = topologies[i % len(topologies)]
        ps.initialize_model_parallel(**_topology_kwargs(topo), timeout=datetime.timedelta(seconds=30))
        sizes.append(len(c10d._world.pg_map) - len(before))
        t = torch.ones(1)
        dist.all_reduce(t, group=ps.get_context_parallel_group())
        assert t.item() == ps.get_context_parallel_world_size()
        dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        ps.destroy_model_parallel()
        assert set(c10d._world.pg_map) == before, f"cycle {i}: groups left behind"
        assert not ps.model_parallel_is_initialized()
    ps.destroy_model_parallel()  # idempotent
    return sizes


def test_rebuilds_leave_no_group_behind(pools):
    topologies = TOPOLOGIES[4]  # each built twice: the second build follows a destroy of the same topology
    created = pools(4).run(case_rebuild_cycles, topologies, 2 * len(topologies), timeout=120)
    assert all(n > 0 for n in created[0])


def case_errors():
    import torch.distributed as dist

    found = {}

    def expect(key, exc_type, fn, *a, **kw):
        try:
            fn(*a, **kw)
        except exc_type as exc:
            found[key] = str(exc)
        else:
            raise AssertionError(f"{key}: no {exc_type.__name__}")

    expect("accessor", ParallelStateError, ps.get_context_parallel_group)
    expect("rank", ParallelStateError, ps.get_pipeline_model_parallel_rank)
    expect("divide", ParallelStateError, ps.initialize_model_parallel, context_parallel_size=3)
    expect("order", ParallelStateError, ps.initialize_model_parallel, order="tp-xx")
    expect("ep", ParallelStateError, ps.initialize_model_parallel, expert_model_parallel_size=3)
    expect("alias", TypeError, ps.initialize_model_parallel, context_parallel_size=2, cp_size=2)
    expect("timeout", ParallelStateError, ps.initialize_model_parallel, timeout=5)
    assert ps.get_context_parallel_group(check_initialized=False) is None
    ps.initialize_model_parallel(cp_size=2, pp_size=dist.get_world_size() // 2, create_gloo_process_groups=False)
    expect("twice", ParallelStateError, ps.initialize_model_parallel)
    expect("gloo", ParallelStateError, ps.get_data_parallel_group_gloo)
    assert ps.get_context_parallel_world_size() == 2
    ps.destroy_model_parallel()
    ps.destroy_model_parallel()
    return found


def test_bad_use_is_explained(pools):
    found = pools(4).run(case_errors)[0]
    assert "initialize_model_parallel" in found["accessor"] and "context-parallel" in found["accessor"]
    assert "pipeline-model-parallel rank" in found["rank"]
    assert "world size 4 is not divisible" in found["divide"] and "1*3*1" in found["divide"]
    assert "unknown token" in found["order"]
    assert "expert" in found["ep"]
    assert "context_parallel_size=2" in found["alias"] and "cp_size=2" in found["alias"]
    assert "timedelta" in found["timeout"]
    assert "destroy_model_parallel" in found["twice"]
    assert "create_gloo_process_groups=False" in found["gloo"]


def test_without_torch_distributed():
    with pytest.raises(ParallelStateError, match="init_process_group"):
        ps.initialize_model_parallel()
    # megatron-core's convention: these read 0 outside a distributed run.
    assert ps.get_context_parallel_world_size() == 0 and ps.get_data_parallel_rank() == 0
    ps.destroy_model_parallel()


def test_signature_is_megatrons():
    from megatron.core import parallel_state as mpu

    ours = inspect.signature(ps.initialize_model_parallel).parameters
    theirs = inspect.signature(mpu.initialize_model_parallel).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == list(theirs)
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
    for alias in ("tp_size", "cp_size", "pp_size", "timeout"):
        assert ours[alias].kind is inspect.Parameter.KEYWORD_ONLY
    for name in ("get_data_parallel_group", "is_pipeline_first_stage", "is_pipeline_last_stage",
                 "get_tensor_and_data_parallel_group", "get_data_parallel_group_gloo"):
        theirs_f = inspect.signature(getattr(mpu, name)).parameters
        ours_f = inspect.signature(getattr(ps, name)).parameters
        # Exactly megatron-core's parameters, in its order (no later release's with_gtp_remat under 0.16).
        assert list(ours_f) == list(theirs_f), name


def case_overrides():
    ps.initialize_model_parallel(pp_size=2)
    ps.set_pipeline_model_parallel_rank(1)
    assert ps.is_pipeline_last_stage()
    ps.set_pipeline_model_parallel_rank(None)
    return ps.get_pipeline_model_parallel_rank()


def test_megatron_setters_override(pools):
    assert pools(2).run(case_overrides) == [0, 1]


def case_raise_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError("boom")
    return dist.get_rank()


def test_pool_reports_which_rank_failed(pools):
    with pytest.raises(RankFailure, match="rank 1: ValueError: boom"):
        pools(2).run(case_raise_on_rank, 1)
    assert pools(2).run(case_raise_on_rank, 5) == [0, 1]
