"""Long-lived workers: the group cache (switch topology without new communicators) and rank subsets
(topologies side by side on disjoint ranks), on real gloo ranks."""

from __future__ import annotations

import datetime

import parallel_state as ps

SECONDS = datetime.timedelta(seconds=30)
CYCLE = [dict(context_parallel_size=4), dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
         dict(context_parallel_size=2, expert_model_parallel_size=2), dict(tensor_model_parallel_size=2)]


def _answers():
    """What a user observes of a topology: ranks, sizes, group members, and a cp all-reduce."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=ps.get_context_parallel_group())
    getters = {
        "tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
        "cp": ps.get_context_parallel_group, "dp": ps.get_data_parallel_group,
        "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True), "ep": ps.get_expert_model_parallel_group,
        "edp": ps.get_expert_data_parallel_group, "mp": ps.get_model_parallel_group,
    }
    return {
        "members": {k: dist.get_process_group_ranks(g()) for k, g in getters.items()},
        "sizes": (ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                  ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size()),
        "ranks": (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
                  ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()),
        "cp_sum": t.item(),
    }


def case_switch(rounds):
    from torch.distributed import distributed_c10d as c10d

    fresh = []
    for topology in CYCLE:  # the reference: cold inits with the cache off
        ps.initialize_model_parallel(**topology, timeout=SECONDS)
        fresh.append(_answers())
        ps.destroy_model_parallel()
    ps.enable_group_cache()
    try:
        seen, created_after_first, answers_differ, same_objects = {}, [], [], []
        for r in range(rounds):
            for i, topology in enumerate(CYCLE):
                before = len(c10d._world.pg_map)
                ps.initialize_model_parallel(**topology, timeout=SECONDS)
                state = ps.groups.state.current()
                objects = [id(g) for g in state.owned]
                if r:
                    created_after_first.append(len(c10d._world.pg_map) - before)
                    same_objects.append(objects == seen[i])
                seen[i] = objects
                if _answers() != fresh[i]:
                    answers_differ.append((r, i))
                ps.destroy_model_parallel()
        info = ps.group_cache_info()
        live_while_cached = len(c10d._world.pg_map)
    finally:
        ps.clear_group_cache()
    return dict(created=created_after_first, same=same_objects, differ=answers_differ, info=info,
                live_while_cached=live_while_cached, live_after_clear=len(c10d._world.pg_map),
                answers_after=_cold_answers())


def _cold_answers():
    ps.initialize_model_parallel(context_parallel_size=2, timeout=SECONDS)
    return _answers()["sizes"]


def test_switching_topologies_with_the_cache_creates_no_group_after_the_first_round(pools):
    for r in pools(4).run(case_switch, 3, timeout=180):
        assert r["created"] == [0] * 8 and all(r["same"]), r
        assert r["differ"] == []  # every switch answers exactly like a fresh init
        assert r["info"]["topologies"] == 4 and r["info"]["groups"] == r["live_while_cached"] - 1
        assert r["info"]["hits"] > 0 and r["info"]["misses"] > 0 and r["info"]["evicted"] == 0
        # clear_group_cache leaves nothing alive but the default group, and a later init works.
        assert r["live_after_clear"] == 1 and r["answers_after"] == (1, 2, 1, 2)


def case_eviction():
    from torch.distributed import distributed_c10d as c10d

    ps.initialize_model_parallel(**CYCLE[0], timeout=SECONDS)
    slots = len(ps.groups.state.current().group_keys)
    ps.destroy_model_parallel()
    ps.enable_group_cache(max_groups=slots)  # room for one topology
    try:
        for topology in CYCLE[:3]:
            ps.initialize_model_parallel(**topology, timeout=SECONDS)
            ps.destroy_model_parallel()
        info = ps.group_cache_info()
        live = len(c10d._world.pg_map) - 1
        ps.initialize_model_parallel(**CYCLE[2], timeout=SECONDS)  # the one kept comes back whole
        kept = _answers()["sizes"]
        ps.destroy_model_parallel()
    finally:
        ps.clear_group_cache()
    return info, live, kept, len(c10d._world.pg_map)


def test_max_groups_evicts_least_recently_used_topologies(pools):
    for info, live, kept, left in pools(4).run(case_eviction, timeout=120):
        assert info["topologies"] == 1 and info["evicted"] == 2 and info["groups"] == live
        assert kept == (1, 2, 1, 2) and left == 1


def case_subsets():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank < 4:
        ps.initialize_model_parallel(context_parallel_size=4, ranks=[0, 1, 2, 3], timeout=SECONDS)
    else:
        ps.initialize_model_parallel(context_parallel_size=2, ranks=[4, 5, 6, 7], timeout=SECONDS)
    t = torch.ones(1)
    dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=True))
    out = dict(cp=dist.get_process_group_ranks(ps.get_context_parallel_group()),
               dp=dist.get_process_group_ranks(ps.get_data_parallel_group()),
               sizes=(ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size()),
               cp_rank=ps.get_context_parallel_rank(), dpcp_sum=t.item())
    if rank >= 4:  # the DeviceMesh over a subset holds the subset's global ranks
        out["mesh"] = ps.device_mesh().mesh.tolist()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=4, timeout=SECONDS)
    out["world_cp"] = dist.get_process_group_ranks(ps.get_context_parallel_group())
    return out


def test_disjoint_subsets_run_side_by_side_then_the_whole_world(pools):
    results = pools(8).run(case_subsets, timeout=120)
    for rank, r in enumerate(results):
        if rank < 4:
            assert r["cp"] == [0, 1, 2, 3] and r["dp"] == [rank] and r["sizes"] == (4, 1) and r["cp_rank"] == rank
        else:
            assert r["cp"] == ([4, 5] if rank < 6 else [6, 7]) and r["sizes"] == (2, 2)
            assert r["dp"] == ([4, 6] if rank % 2 == 0 else [5, 7]) and r["cp_rank"] == rank % 2
            assert r["mesh"] == [[[[4], [5]], [[6], [7]]]]  # [pp][dp][cp][tp]
        assert r["dpcp_sum"] == 4.0
        assert r["world_cp"] == ([0, 2, 4, 6] if rank % 2 == 0 else [1, 3, 5, 7])


def case_bad_subsets():
    import torch.distributed as dist

    rank = dist.get_rank()
    short = datetime.timedelta(seconds=2)
    # Ranks 0-2 say 0-3 but rank 3 says 3-6 (overlap); rank 5 passes a subset without itself.
    ranks = {3: [3, 4, 5, 6], 5: [0, 1, 2, 3]}.get(rank, [0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7])
    try:
        ps.initialize_model_parallel(context_parallel_size=2, ranks=ranks, timeout=short)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        ps.destroy_model_parallel()
    return "ok", ""


def test_a_wrong_or_overlapping_subset_is_an_error_on_every_rank_involved(pools):
    results = pools(8).run(case_bad_subsets, timeout=60)
    assert [r[0] for r in results] == ["ParallelStateError"] * 8
    assert "does not hold it" in results[5][1]
    for rank in (0, 1, 2):
        assert "rank(s) 3 of 4 did not arrive" in results[rank][1], results[rank]
    assert "did not arrive" in results[3][1]
    for rank in (4, 6, 7):
        assert "rank(s) 5 of 4 did not arrive" in results[rank][1], results[rank]


def case_stuck_subset():
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._world.pg_map[dist.group.WORLD][1]
    rank = dist.get_rank()
    if rank < 4:
        ps.initialize_model_parallel(context_parallel_size=4, ranks=[0, 1, 2, 3], timeout=datetime.timedelta(seconds=2))
        if rank == 3:
            # Stay away until the other subset has finished its work: if it waited for this
            # subset, it would never finish and this wait would fail.
            store.wait(["test/other-subset-done"], datetime.timedelta(seconds=60))
            return "waited"
        try:
            dist.all_reduce(torch.ones(1), group=ps.get_context_parallel_group())
        except Exception:
            return "timed out"
        return "done"
    for topology in (dict(context_parallel_size=2), dict(context_parallel_size=4), {}):
        ps.initialize_model_parallel(**topology, ranks=[4, 5, 6, 7], timeout=SECONDS)
        t = torch.ones(1)
        dist.all_reduce(t, group=ps.get_context_parallel_group())
        ps.destroy_model_parallel()
    if store.add("test/other-subset-count", 1) == 4:
        store.set("test/other-subset-done", "1")
    return "other subset done"


def test_a_stuck_rank_in_one_subset_does_not_stall_the_other(pools):
    results = pools(8).run(case_stuck_subset, timeout=90)
    assert results == ["timed out"] * 3 + ["waited"] + ["other subset done"] * 4


def case_serving_example():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "serving_pool.py")
    spec = importlib.util.spec_from_file_location("serving_pool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.serve()


def test_the_serving_example_builds_groups_only_for_the_first_request_at_each_cp_size(pools):
    for log in pools(4).run(case_serving_example, timeout=120):
        *requests, cache = log
        assert [r["cp"] for r in requests] == [2, 4, 2, 4, 2]
        new = [r["new_groups"] for r in requests]
        assert new[0] > 0 and new[1] > 0 and new[2:] == [0, 0, 0], new
        assert cache["cache"]["topologies"] == 2


def case_diverged_caches():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    rank = dist.get_rank()
    ps.enable_group_cache()
    try:
        ps.initialize_model_parallel(context_parallel_size=4, timeout=SECONDS)
        ps.destroy_model_parallel()
        # The two halves now cache different subset topologies.
        half = [0, 1] if rank < 2 else [2, 3]
        ps.initialize_model_parallel(**({"context_parallel_size": 2} if rank < 2 else {"tensor_model_parallel_size": 2}),
                                     ranks=half, timeout=SECONDS)
        ps.destroy_model_parallel()
        before = ps.group_cache_info()["topologies"]
        # The whole world again: the caches differ, so every rank empties its own and builds afresh.
        ps.initialize_model_parallel(context_parallel_size=4, timeout=SECONDS)
        sizes = _answers()["sizes"]
        during = ps.group_cache_info()["topologies"]
        ps.destroy_model_parallel()
        after = ps.group_cache_info()["topologies"]
    finally:
        ps.clear_group_cache()
    return before, sizes, during, after, len(c10d._world.pg_map)


def test_ranks_whose_caches_differ_empty_them_and_build_afresh(pools):
    for before, sizes, during, after, left in pools(4).run(case_diverged_caches, timeout=120):
        assert before == 2 and sizes == (1, 4, 1, 1) and during == 0 and after == 1 and left == 1
