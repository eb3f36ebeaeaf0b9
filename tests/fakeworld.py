"""Run initialize/destroy as one rank of a simulated world and report what that rank did.

Usage: ``python fakeworld.py '<json list of cases>'``; prints one JSON line. Each case is
``{"world", "rank", "tp", "cp", "pp", "order"}``. torch's fake backend does every Python step
of group creation and no communication, so a single process can stand in for rank 9,999 of
16,384. The fake world is process-global, so each case re-creates it. Nothing here replaces
torch.distributed: new_group and the plan's methods are wrapped only to record their calls.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import parallel_state as ps
    from parallel_state.topology.plan import TopologyPlan

    dist.init_process_group("fake", store=FakeStore(), rank=case["rank"], world_size=case["world"])
    kwargs = dict(tensor_model_parallel_size=case["tp"], context_parallel_size=case["cp"],
                  pipeline_model_parallel_size=case["pp"], order=case["order"],
                  create_gloo_process_groups=False, check_consistency=False)
    ps.initialize_model_parallel(**kwargs)  # warm-up: lazy imports and first-call caches
    ps.destroy_model_parallel()

    ranks_asked: set[int] = set()
    whole_world_enumerations = [0]
    created: list[list[int]] = []
    originals = {name: getattr(TopologyPlan, name) for name in ("coords", "group_ranks", "group_rank", "group_index")}
    real_groups, real_new_group = TopologyPlan.groups, dist.new_group

    def recording(method: Any) -> Any:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any) -> Any:
            # every per-rank question takes the rank as its first int (group_rank may add the members after it)
            ranks_asked.add(next(a for a in args if isinstance(a, int)))
            return method(self, *args)
        return wrapper

    def counting_groups(self: Any, kind: str) -> Any:
        whole_world_enumerations[0] += 1
        return real_groups(self, kind)

    def recording_new_group(ranks: Any = None, *args: Any, **kw: Any) -> Any:
        created.append(sorted(ranks) if ranks is not None else list(range(case["world"])))
        return real_new_group(ranks, *args, **kw)

    for name, method in originals.items():
        setattr(TopologyPlan, name, recording(method))
    TopologyPlan.groups = counting_groups
    dist.new_group = recording_new_group
    before = set(c10d._world.pg_map)
    try:
        ps.initialize_model_parallel(**kwargs)
        joined = [sorted(dist.get_process_group_ranks(pg)) for pg in set(c10d._world.pg_map) - before]
        ps.destroy_model_parallel()
    finally:
        for name, method in originals.items():
            setattr(TopologyPlan, name, method)
        TopologyPlan.groups = real_groups
        dist.new_group = real_new_group
    left_alive = len(set(c10d._world.pg_map) - before)

    # Python-level work: count the Python functions called (torch's included) in one cycle.
    calls = [0]

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1

    gc.disable()
    sys.setprofile(profiler)
    try:
        ps.initialize_model_parallel(**kwargs)
        ps.destroy_model_parallel()
    finally:
        sys.setprofile(None)
        gc.enable()
    dist.destroy_process_group()
    return {"new_group_calls": created, "joined": joined, "ranks_asked": sorted(ranks_asked),
            "whole_world_enumerations": whole_world_enumerations[0], "left_alive": left_alive,
            "python_calls": calls[0]}


if __name__ == "__main__":
    print(json.dumps([run_case(case) for case in json.loads(sys.argv[1])]))
