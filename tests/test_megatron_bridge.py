"""The megatron-core bridge on real gloo ranks: megatron.core.parallel_state reads our very groups.

Worker cases import megatron-core inside the case (about 4 s per process, paid once per pool).
"""

from __future__ import annotations

import datetime
import inspect
import os
import subprocess
import sys

import pytest

import parallel_state as ps
from parallel_state import ParallelStateError, TopologyPlan
from parallel_state.topology import releases

TOPOLOGIES = {
    2: [dict(cp=2), dict(pp=2), dict(tp=2)],
    4: [dict(cp=2, pp=2), dict(tp=2, cp=2), dict(cp=4), dict(tp=2, pp=2, order="tp-pp-dp"),
        dict(cp=2, pp=2, vpp=2, order="tp-cp-pp-dp"), dict(tp=2, cp=2, gloo=False)],
}

# megatron-core accessor and keyword arguments -> the group kind it must return (ours, the same object)
GROUPS = [
    ("get_tensor_model_parallel_group", {}, "tp"),
    ("get_pipeline_model_parallel_group", {}, "pp"),
    ("get_context_parallel_group", {}, "cp"),
    ("get_model_parallel_group", {}, "tp-pp"),
    ("get_tensor_and_context_parallel_group", {}, "tp-cp"),
    ("get_data_parallel_group", {}, "dp"),
    ("get_data_parallel_group", {"with_context_parallel": True}, "dp-cp"),
    ("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}, "dp-cp"),
    ("get_tensor_and_data_parallel_group", {}, "tp-dp"),
    ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}, "tp-dp-cp"),
    ("get_amax_reduction_group", {"with_context_parallel": True}, "tp-dp-cp"),
]
GLOO_GROUPS = [
    ("get_data_parallel_group_gloo", {}, "dp"),
    ("get_data_parallel_group_gloo", {"with_context_parallel": True}, "dp-cp"),
]
# accessors whose answer must be the same through megatron-core and through parallel_state
SAME_ANSWER = [
    ("get_tensor_model_parallel_rank", {}), ("get_tensor_model_parallel_world_size", {}),
    ("get_pipeline_model_parallel_rank", {}), ("get_pipeline_model_parallel_world_size", {}),
    ("get_context_parallel_rank", {}), ("get_context_parallel_world_size", {}),
    ("get_data_parallel_rank", {}), ("get_data_parallel_world_size", {}),
    ("get_data_parallel_rank", {"with_context_parallel": True}),
    ("get_data_parallel_world_size", {"with_context_parallel": True}),
    ("get_tensor_and_context_parallel_rank", {}), ("get_tensor_and_context_parallel_world_size", {}),
    ("get_tensor_model_parallel_src_rank", {}), ("get_model_parallel_src_rank", {}),
    ("get_data_parallel_src_rank", {}), ("get_data_parallel_src_rank", {"with_context_parallel": True}),
    ("get_context_parallel_global_ranks", {}),
    ("get_pipeline_model_parallel_first_rank", {}), ("get_pipeline_model_parallel_last_rank", {}),
    ("get_pipeline_model_parallel_next_rank", {}), ("get_pipeline_model_parallel_prev_rank", {}),
    ("is_pipeline_first_stage", {}), ("is_pipeline_last_stage", {}),
    ("get_virtual_pipeline_model_parallel_world_size", {}), ("get_virtual_pipeline_model_parallel_rank", {}),
    ("get_all_ranks", {}), ("model_parallel_is_initialized", {}), ("is_initialized", {}),
]
# megatron-core accessors with no parallel_state counterpart, and their answer without expert parallelism
EXPERT = {"get_expert_model_parallel_world_size": 1, "get_expert_model_parallel_rank": 0}
# megatron-core's global-rank lists -> the kind whose members they must hold
GLOBAL_RANKS = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp", "_PIPELINE_GLOBAL_RANKS": "pp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "tp-pp", "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp-cp",
}
# every megatron-core global the bridge writes; all must read None once destroyed
BRIDGED_GLOBALS = [
    "_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
    "_CONTEXT_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_TENSOR_AND_DATA_PARALLEL_GROUP",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    *GLOBAL_RANKS, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
    "_global_process_group_list", "_GLOBAL_MEMORY_BUFFER",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_MODEL_PARALLEL_RANK",
]


def _init(topo):
    ps.initialize_model_parallel(
        tensor_model_parallel_size=topo.get("tp", 1), context_parallel_size=topo.get("cp", 1),
        pipeline_model_parallel_size=topo.get("pp", 1), order=topo.get("order", "tp-cp-ep-dp-pp"),
        virtual_pipeline_model_parallel_size=topo.get("vpp"), create_gloo_process_groups=topo.get("gloo", True),
        timeout=datetime.timedelta(seconds=30),
    )


def _kind_of(kind):
    # our accessor for a kind, to compare megatron-core's answer against
    return {"tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
            "cp": ps.get_context_parallel_group, "tp-pp": ps.get_model_parallel_group,
            "tp-cp": ps.get_tensor_and_context_parallel_group, "dp": ps.get_data_parallel_group,
            "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
            "tp-dp": ps.get_tensor_and_data_parallel_group,
            "tp-dp-cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True)}[kind]()


def _megatron_reads_parallel_state(mps, plan):
    """megatron-core functions that read parallel state internally, run through the bridge."""
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        scatter_to_tensor_model_parallel_region,
    )
    from megatron.core.utils import get_batch_on_this_cp_rank

    out = {}
    # the process-group collection megatron-core models are built from
    names = {"tp": "tp", "pp": "pp", "mp": "tp-pp", "cp": "cp", "tp_cp": "tp-cp", "dp": "dp", "dp_cp": "dp-cp",
             "intra_dp_cp": "dp-cp", "tp_dp_cp": "tp-dp-cp"}
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(names))
    for attr, kind in names.items():
        assert getattr(pgs, attr) is _kind_of(kind), attr
    # context-parallel sequence sharding: 2 * cp chunks, this rank keeps chunks r and 2cp-1-r
    seq = 4 * plan.cp
    batch = {"tokens": torch.arange(2 * seq).view(2, seq), "attention_mask": None}
    # 0.18 added a required is_hybrid_cp (python -m tests.oracles test runs every release), and stopped
    # reading parallel state there: a cp_group of None is the world's group, so it takes megatron-core's
    # (bridged) context-parallel group
    hybrid = ({"is_hybrid_cp": False, "cp_group": mps.get_context_parallel_group()}
              if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {})
    out["cp_batch"] = get_batch_on_this_cp_rank(batch, **hybrid)["tokens"].tolist()
    # tensor-parallel all-reduce and split along the last dimension
    out["tp_sum"] = reduce_from_tensor_model_parallel_region(torch.tensor([float(dist.get_rank())])).item()
    out["tp_slice"] = scatter_to_tensor_model_parallel_region(torch.arange(2.0 * plan.tp)).tolist()
    return out


def case_bridge_cycles(topologies, rounds):
    """Initialize each topology (rounds times over), compare megatron-core's view with ours, destroy."""
    import megatron.core.parallel_state as mps
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)
    original_destroy = mps.destroy_model_parallel
    reports = []
    for _ in range(rounds):
        for topo in topologies:
            assert not mps.model_parallel_is_initialized()
            _init(topo)  # megatron-core is loaded: initialize bridges by itself
            state = ps.groups.state.peek()
            # no second set of groups: torch knows exactly the groups parallel_state owns
            assert set(c10d._world.pg_map) - before == {g for g in state.owned}
            for name, kw, kind in GROUPS:
                assert getattr(mps, name)(**kw) is _kind_of(kind), (name, kw)
            for name, kw, _kind in GLOO_GROUPS:
                if topo.get("gloo", True):
                    assert getattr(mps, name)(**kw) is ps.get_data_parallel_group_gloo(**kw), (name, kw)
                else:  # like megatron-core with create_gloo_process_groups=False
                    assert mps._DATA_PARALLEL_GROUP_GLOO is None and mps._DATA_PARALLEL_GROUP_WITH_CP_GLOO is None
            for name, kw in SAME_ANSWER:
                assert getattr(mps, name)(**kw) == getattr(ps, name)(**kw), (name, kw)
            assert {name: getattr(mps, name)() for name in EXPERT} == EXPERT
            assert mps._global_process_group_list[0] is None
            assert {id(g) for g in mps._global_process_group_list[1:]} == {id(g) for g in state.owned}
            plan = state.plan
            report = {
                "ranks": [dist.get_process_group_ranks(getattr(mps, name)(**kw)) for name, kw, _ in GROUPS],
                "global": {name: getattr(mps, name) for name in GLOBAL_RANKS},
                "sizes": [getattr(mps, name)(**kw) for name, kw in SAME_ANSWER],
                "initialized": mps.model_parallel_is_initialized(),
                **_megatron_reads_parallel_state(mps, plan),
            }
            ps.find_split((1, 16, 8, 64, 64), plan.cp)
            report["cp_size_t"] = mps.cp_size_t
            ps.destroy_model_parallel()
            assert not mps.model_parallel_is_initialized() and not mps.is_initialized()
            assert all(getattr(mps, name) is None for name in BRIDGED_GLOBALS), \
                [name for name in BRIDGED_GLOBALS if getattr(mps, name) is not None]
            assert not hasattr(mps, "cp_size_t") and not hasattr(ps, "cp_size_t")
            assert mps.destroy_model_parallel is original_destroy
            assert set(c10d._world.pg_map) == before, "groups left behind"
            reports.append(report)
    return reports


def _check_reports(world, topologies, rounds, results):
    # megatron-core 0.19's get_all_ranks puts the gtp_remat rank (0 here) second: the release table's row
    # for the installed release, checked against megatron-core's own function
    gtp = [0] if releases.behaves("all_ranks_with_gtp_remat", releases.installed()) else []
    for rank, reports in enumerate(results):
        assert len(reports) == rounds * len(topologies)
        for i, report in enumerate(reports):
            topo = topologies[i % len(topologies)]
            plan = TopologyPlan(world, tp=topo.get("tp", 1), cp=topo.get("cp", 1), pp=topo.get("pp", 1),
                                order=topo.get("order", "tp-cp-ep-dp-pp"))
            g = {kind: list(plan.group_ranks(kind, rank)) for _, _, kind in GROUPS}
            for (name, kw, kind), ranks in zip(GROUPS, report["ranks"], strict=True):
                assert ranks == g[kind], (rank, topo, name, kw)
            for name, kind in GLOBAL_RANKS.items():
                assert report["global"][name] == g[kind], (rank, topo, name)
            c = plan.coords(rank)
            pp = g["pp"]
            expected = [  # in SAME_ANSWER's order
                g["tp"].index(rank), plan.tp, c["pp"], plan.pp, c["cp"], plan.cp, c["dp"], plan.dp,
                g["dp-cp"].index(rank), plan.dp * plan.cp, g["tp-cp"].index(rank), plan.tp * plan.cp,
                g["tp"][0], g["tp-pp"][0], g["dp"][0], g["dp-cp"][0], g["cp"],
                pp[0], pp[-1], pp[(c["pp"] + 1) % plan.pp], pp[(c["pp"] - 1) % plan.pp],
                c["pp"] == 0, c["pp"] == plan.pp - 1,
                topo.get("vpp"), 0 if topo.get("vpp") else None,
                "_".join(map(str, [g["tp"].index(rank), *gtp, c["dp"], c["cp"], c["pp"], 0])), True, True,
            ]
            for (name, kw), got, want in zip(SAME_ANSWER, report["sizes"], expected, strict=True):
                assert got == want, (rank, topo, name, kw, got, want)
            assert report["initialized"] is True
            # get_batch_on_this_cp_rank: chunk r and chunk 2cp-1-r of 2cp chunks of length 2, per row
            seq, r = 4 * plan.cp, c["cp"]
            keep = [*range(2 * r, 2 * r + 2), *range(2 * (2 * plan.cp - 1 - r), 2 * (2 * plan.cp - 1 - r) + 2)]
            assert report["cp_batch"] == [[row * seq + j for j in keep] for row in range(2)], (rank, topo)
            assert report["tp_sum"] == sum(g["tp"])
            tp_rank = g["tp"].index(rank)
            assert report["tp_slice"] == [2.0 * tp_rank, 2.0 * tp_rank + 1]
            # find_split's temporal factor for T = 8 latent frames: gcd(8, cp)
            assert report["cp_size_t"] == {1: 1, 2: 2, 4: 4}[plan.cp]


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_reads_our_groups_across_cycles(pools, world):
    topologies = TOPOLOGIES[world]
    results = pools(world).run(case_bridge_cycles, topologies, 2, timeout=180)
    _check_reports(world, topologies, 2, results)


def case_bridge_before_initialize_and_late_import():
    """bridge_megatron() before initialize waits for it; megatron-core imported late is bridged explicitly."""
    import sys

    import megatron.core.parallel_state as mps
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)
    seen = {"early": ps.bridge_megatron(), "early_init": mps.model_parallel_is_initialized()}
    ps.initialize_model_parallel(context_parallel_size=2)
    seen["after_init"] = mps.get_context_parallel_group() is ps.get_context_parallel_group()
    seen["again"] = ps.bridge_megatron()  # idempotent
    seen["same"] = mps.get_data_parallel_group() is ps.get_data_parallel_group()
    ps.destroy_model_parallel()
    # As if megatron-core were imported only after initialize: initialize does not see it.
    hidden = sys.modules.pop("megatron.core.parallel_state")
    try:
        ps.find_split((1, 16, 2, 64, 64), 2)
        ps.initialize_model_parallel(context_parallel_size=2)
    finally:
        sys.modules["megatron.core.parallel_state"] = hidden
    seen["late_before"] = mps.model_parallel_is_initialized()
    seen["late_bridge"] = ps.bridge_megatron()
    seen["late_same"] = mps.get_context_parallel_group() is ps.get_context_parallel_group()
    seen["late_cp_size_t"] = mps.cp_size_t  # find_split's value, mirrored by the bridge
    ps.destroy_model_parallel()
    seen["late_after"] = mps.model_parallel_is_initialized() or hasattr(mps, "cp_size_t")
    seen["restored"] = set(c10d._world.pg_map) == before
    return seen


def test_bridge_before_initialize_and_after_a_late_import(pools):
    expected = {"early": False, "early_init": False, "after_init": True, "again": True, "same": True,
                "late_before": False, "late_bridge": True, "late_same": True, "late_cp_size_t": 2,
                "late_after": False, "restored": True}
    assert pools(2).run(case_bridge_before_initialize_and_late_import) == [expected] * 2


def case_megatron_destroy_and_megatron_own_groups():
    """megatron-core's destroy while bridged tears down once; its own groups are never overwritten."""
    import megatron.core.parallel_state as mps
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)
    seen = {}
    ps.initialize_model_parallel(context_parallel_size=2)
    gloo = ps.get_data_parallel_group_gloo()
    mps.destroy_model_parallel()  # megatron-core's own call, routed to ours
    seen["ours_gone"] = not ps.model_parallel_is_initialized()
    seen["theirs_gone"] = not mps.model_parallel_is_initialized() and mps._DATA_PARALLEL_GROUP_GLOO is None
    seen["gloo_destroyed"] = gloo not in c10d._world.pg_map
    seen["restored"] = set(c10d._world.pg_map) == before
    ps.destroy_model_parallel()  # and ours again is harmless
    mps.destroy_model_parallel()  # megatron-core's own again, now unrouted
    seen["unrouted"] = mps.destroy_model_parallel.__module__ == "megatron.core.parallel_state"

    # megatron-core builds its own groups: parallel_state refuses to overwrite them.
    mps.initialize_model_parallel(context_parallel_size=2)
    try:
        try:
            ps.initialize_model_parallel(context_parallel_size=2)
        except ParallelStateError as exc:
            seen["refused"] = str(exc)
        seen["nothing_built"] = ps.groups.state.peek() is None
        seen["megatron_kept"] = mps.get_context_parallel_world_size() == 2
        t = torch.ones(1)
        dist.all_reduce(t, group=mps.get_context_parallel_group())
        seen["megatron_works"] = t.item()
    finally:
        dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
        mps.destroy_model_parallel()
        # megatron-core leaves its non-gloo groups to the process; free them so the pool stays clean
        for pg in set(c10d._world.pg_map) - before:
            dist.destroy_process_group(pg)
    seen["restored_end"] = set(c10d._world.pg_map) == before
    return seen


def test_megatron_destroy_is_routed_and_megatron_own_groups_are_kept(pools):
    results = pools(2).run(case_megatron_destroy_and_megatron_own_groups)
    for seen in results:
        refused = seen.pop("refused")
        assert "megatron.core.parallel_state already holds" in refused
        assert "destroy_model_parallel()" in refused
        assert seen == {"ours_gone": True, "theirs_gone": True, "gloo_destroyed": True, "restored": True,
                        "unrouted": True, "nothing_built": True, "megatron_kept": True, "megatron_works": 2.0,
                        "restored_end": True}


def test_explicit_bridge_without_megatron_is_a_clear_import_error(monkeypatch):
    # None in sys.modules makes the import fail exactly as an absent package does
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", None)
    with pytest.raises(ImportError, match=r"pip install parallel-state\[megatron\]"):
        ps.bridge_megatron()


WITHOUT_MEGATRON = r"""
import datetime, os, sys, tempfile
sys.modules["megatron"] = None  # as if megatron-core were not installed
import parallel_state as ps
assert "torch" not in sys.modules and not hasattr(ps, "cp_size_t"), "import parallel_state must stay light"
assert tuple(ps.find_split((1, 16, 4, 64, 64), 8)) == (1, 32, 64) and ps.cp_size_t == 4
import torch.distributed as dist
store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
ps.initialize_model_parallel(timeout=datetime.timedelta(seconds=30))
assert ps.model_parallel_is_initialized()
ps.destroy_model_parallel()
assert not hasattr(ps, "cp_size_t")
try:
    ps.bridge_megatron()
except ImportError as exc:
    assert "pip install parallel-state[megatron]" in str(exc), exc
else:
    raise AssertionError("no ImportError")
dist.destroy_process_group()
print("ok")
"""


def test_nothing_changes_without_megatron():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_MEGATRON], capture_output=True, text=True,
                          timeout=120, env=env, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def case_overrides_follow_the_bridge():
    """A set_* override made after bridging reaches megatron-core's accessors, and destroy clears it there."""
    import megatron.core.parallel_state as mps

    ps.initialize_model_parallel(context_parallel_size=2, timeout=datetime.timedelta(seconds=30))
    before = mps.get_tensor_model_parallel_world_size()
    ps.set_tensor_model_parallel_world_size(3)
    ps.set_expert_model_parallel_rank(5)
    ps.set_virtual_pipeline_model_parallel_world_size(4)
    after = (mps.get_tensor_model_parallel_world_size(), mps.get_expert_model_parallel_rank(),
             mps.get_virtual_pipeline_model_parallel_world_size())
    ps.set_tensor_model_parallel_world_size(None)
    cleared = mps.get_tensor_model_parallel_world_size()
    ps.destroy_model_parallel()
    return before, after, cleared, mps._MPU_EXPERT_MODEL_PARALLEL_RANK, mps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def test_overrides_made_after_bridging_reach_megatron(pools):
    assert pools(2).run(case_overrides_follow_the_bridge) == [(1, (3, 5, 4), 1, None, None)] * 2
