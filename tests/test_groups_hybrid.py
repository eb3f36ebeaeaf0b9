"""Hybrid context-parallel groups on real gloo ranks: each rank creates only its own blocks (megatron-core creates
every size on every rank), the group cache hands the same groups back on a rebuild, and destroy_model_parallel
frees them and leaves no stale answer (megatron-core's destroy left its _HYBRID_DP_CP_GROUPS set, PR 7139)."""

from __future__ import annotations

import datetime

import parallel_state as ps

SECONDS = datetime.timedelta(seconds=30)
TOPOLOGY = dict(context_parallel_size=2, hybrid_context_parallel=True, timeout=SECONDS)  # dp 2 x cp 2: blocks of 2


def case_members_only_cached_destroyed():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    me = dist.get_rank()
    before = set(c10d._world.pg_map)
    calls, real = {}, dist.new_group

    for hybrid in (False, True):  # the new_group calls of the topology without and with the hybrid groups
        made = calls[hybrid] = []

        def recording(ranks=None, *args, made=made, **kwargs):  # records, then torch's own new_group runs
            made.append(sorted(ranks) if ranks is not None else None)
            return real(ranks, *args, **kwargs)

        dist.new_group = recording
        try:
            ps.initialize_model_parallel(**{**TOPOLOGY, "hybrid_context_parallel": hybrid})
        finally:
            dist.new_group = real
        if not hybrid:
            ps.destroy_model_parallel()
    pair = ps.get_hybrid_data_context_parallel_groups(group_size=2)
    out = {"calls": calls, "pair": dist.get_process_group_ranks(pair),
           "whole_is_dp_cp": ps.get_hybrid_data_context_parallel_groups(group_size=4)
           is ps.get_data_parallel_group(with_context_parallel=True),
           "global": {k: dist.get_process_group_ranks(g) for k, g in ps._HYBRID_DP_CP_GROUPS.items()}}
    ps.destroy_model_parallel()
    out["left_after_destroy"] = len(set(c10d._world.pg_map) - before)
    out["after_destroy"] = (ps.get_hybrid_data_context_parallel_groups(check_initialized=False, group_size=2),
                            ps._HYBRID_DP_CP_GROUPS)
    ps.enable_group_cache()
    try:
        ps.initialize_model_parallel(**TOPOLOGY)
        first = ps.get_hybrid_data_context_parallel_groups(group_size=2)
        ps.destroy_model_parallel()
        live = len(c10d._world.pg_map)
        ps.initialize_model_parallel(**TOPOLOGY)
        out["cached"] = (ps.get_hybrid_data_context_parallel_groups(group_size=2) is first,
                         len(c10d._world.pg_map) - live)
        ps.destroy_model_parallel()
    finally:
        ps.clear_group_cache()
    out["left_after_clear"] = len(set(c10d._world.pg_map) - before)
    out["me"] = me
    return out


def test_hybrid_groups_are_members_only_cached_and_destroyed(pools):
    for r in pools(4).run(case_members_only_cached_destroyed, timeout=120):
        block = [0, 1] if r["me"] < 2 else [2, 3]
        plain, hybrid = r["calls"][False], r["calls"][True]
        # Every group this rank created holds it; the hybrid groups add one: its own block (never the other).
        assert all(r["me"] in ranks for ranks in hybrid), hybrid
        extra = list(hybrid)
        for ranks in plain:
            extra.remove(ranks)
        assert extra == [block], (plain, hybrid)
        assert r["pair"] == block and r["whole_is_dp_cp"] and r["global"] == {2: block}
        assert r["left_after_destroy"] == 0 and r["after_destroy"] == (None, {})
        assert r["cached"] == (True, 0)  # the same group object back from the cache, no group created
        assert r["left_after_clear"] == 0
