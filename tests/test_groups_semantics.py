"""Process groups as megatron-core builds them: one communicator per kind, never WORLD, each kind's own settings.

Checked on real gloo ranks against megatron-core itself where it has an answer: the getters that
return one group object here must return one object there too, collectives of two kinds issued in
opposite orders on different ranks each get their own kind's sums, a kind's timeout turns a missing
rank into an error, and destroy frees exactly what initialize made.
"""

from __future__ import annotations

import datetime
import inspect

import parallel_state as ps
from rankpool import scaled

TOPOLOGIES = {
    "all-ones": {},
    "tp2": dict(tensor_model_parallel_size=2),
    "cp-world": dict(context_parallel_size=4),
    "pp2-tp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    "tp2-cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
}

#: Flag variants megatron-core's callers pass to the group getters.
_FLAGS = ("with_context_parallel", "partial_data_parallel", "partial_expert_data_parallel", "independent_all_gather")


def _group_getters(module):
    """(label, callable) for every group getter of ``module`` and each of its flag variants."""
    import megatron.core.parallel_state as mps

    out = []
    for name in sorted(vars(mps)):
        if not (name.startswith("get_") and "group" in name) or name.endswith("groups"):
            continue
        fn = getattr(module, name)
        params = inspect.signature(getattr(mps, name)).parameters
        if any(p.default is inspect.Parameter.empty for p in params.values()):
            continue
        variants = [{}] + [{f: True} for f in _FLAGS if f in params]
        if "partial_data_parallel" in params:
            variants.append({"with_context_parallel": True, "partial_data_parallel": True})
        for kwargs in variants:
            label = name + "".join(f",{k}" for k in kwargs)
            out.append((label, lambda fn=fn, kwargs=kwargs: fn(**kwargs)))
    return out


def _same_object_pairs(module):
    """Pairs of getter labels that return one group object, and the labels that return WORLD."""
    import torch.distributed as dist

    seen, world = {}, []
    for label, call in _group_getters(module):
        try:
            group = call()
        except Exception:  # not a member (embedding stages), or not built for this topology
            continue
        if not isinstance(group, dist.ProcessGroup):
            continue
        if group is dist.group.WORLD:
            world.append(label)
        seen.setdefault(id(group), []).append(label)
    pairs = {(a, b) for labels in seen.values() for a in labels for b in labels if a < b}
    return pairs, world


def case_sharing(topologies):
    import megatron.core.parallel_state as mps
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out = {}
    for label, topology in topologies.items():
        before = set(c10d._world.pg_map)
        mps.initialize_model_parallel(**topology)
        theirs, their_world = _same_object_pairs(mps)
        dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
        mps.destroy_model_parallel()
        mps._HYBRID_DP_CP_GROUPS = {}
        for pg in set(c10d._world.pg_map) - before:  # megatron-core leaks all but its gloo groups
            dist.destroy_process_group(pg)
        ps.initialize_model_parallel(**topology, timeout=datetime.timedelta(seconds=60))
        ours, our_world = _same_object_pairs(ps)
        ps.destroy_model_parallel()
        out[label] = dict(theirs=sorted(theirs), ours=sorted(ours), their_world=their_world, our_world=our_world)
    return out


def test_getters_share_a_group_only_where_megatron_does_and_never_return_world(pools):
    for rank, results in enumerate(pools(4, megatron=True).run(case_sharing, TOPOLOGIES, timeout=240)):
        for label, r in results.items():
            extra = set(map(tuple, r["ours"])) - set(map(tuple, r["theirs"]))
            assert not extra, (rank, label, sorted(extra))
            assert r["our_world"] == [] and r["their_world"] == [], (rank, label)
        # megatron-core's own sharing (one optimizer instance: the partial dp group is the dp x cp one) is kept.
        assert ("get_data_parallel_group,with_context_parallel",
                "get_data_parallel_group,with_context_parallel,partial_data_parallel") in map(
                    tuple, results["tp2"]["ours"])


def case_opposite_order():
    """Even ranks all-reduce on the model-parallel group first, odd ranks on the tensor-parallel group first."""
    import torch
    import torch.distributed as dist

    ps.initialize_model_parallel(tensor_model_parallel_size=2, timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    mp = torch.tensor([float(rank + 1)])
    tp = torch.tensor([float(rank + 1) * 100])
    calls = [(mp, ps.get_model_parallel_group()), (tp, ps.get_tensor_model_parallel_group())]
    if rank % 2:
        calls.reverse()
    works = [dist.all_reduce(t, group=g, async_op=True) for t, g in calls]
    for w in works:
        w.wait()
    return mp.item(), tp.item()


def test_two_kinds_with_equal_ranks_keep_their_own_collectives(pools):
    # megatron-core's answer: each kind's own sums (ranks 0-1: 1+2 and 100+200). One shared
    # communicator would pair the first op of one rank with the first op of the other: 201 and 102.
    assert pools(4).run(case_opposite_order) == [(3.0, 300.0)] * 2 + [(7.0, 700.0)] * 2


def _try_all_reduces(groups, absent, timeout):
    """All-reduce on each of ``groups`` at once (one timeout window for all) unless this rank is ``absent``;
    one outcome per group ("raised": gloo's own timeout fired, at ``timeout``, the group's). Every rank then
    meets the others in a barrier on WORLD (its own communicator, whose 60 s timeout stays out of the way),
    so no rank tears its groups down while a peer still waits for its own timeout to fire, and none waits
    longer than the slowest timeout takes."""
    import torch
    import torch.distributed as dist

    configured = f"timed out waiting {round(timeout.total_seconds() * 1000)}ms"
    if dist.get_rank() == absent:
        outcomes = ["absent"] * len(groups)
    else:
        works = [dist.all_reduce(torch.ones(1), group=g, async_op=True) for g in groups]
        outcomes = []
        for work in works:
            try:
                work.wait()
                outcomes.append("done")
            except Exception as exc:
                text = str(exc).lower()
                # A member whose own timeout fires first may close its connections: a peer still waiting
                # then sees them closed before its own timeout, which is the same failure, seen second-hand.
                outcomes.append("raised" if configured in text else
                                f"timed out otherwise: {exc}" if "timed out" in text or "timeout" in text else
                                "peer gave up" if "closed by peer" in text or "connection reset" in text else
                                f"other: {exc}")
    dist.barrier()
    return outcomes


def case_timeouts(seconds):
    # The default group's timeout is the pool's 60 s and the pool waits 30 s (both times the load
    # factor): an answer at all proves the kinds' own timeout of a second or so fired, and gloo's
    # message names the configured value (rank 3 is alive, a stalled peer, not a dead one). With tp2 x cp2,
    # rank 3 absent: tp {2, 3} and cp {1, 3} lose one member, the tp x cp group (the whole world) three
    # waiting members; tp {0, 1} and cp {0, 2} complete in the same window.
    timeout = datetime.timedelta(seconds=seconds)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2, timeout=timeout)
    return _try_all_reduces([ps.get_tensor_and_context_parallel_group(), ps.get_tensor_model_parallel_group(),
                             ps.get_context_parallel_group()], 3, timeout)


def test_a_kinds_timeout_turns_a_missing_rank_into_an_error(pools):
    results = pools(4).run(case_timeouts, round(scaled(1.0).total_seconds(), 3), timeout=30)
    world = [r[0] for r in results]  # tp x cp = the whole world: every member fails, at least one by its own timeout
    assert set(world[:3]) <= {"raised", "peer gave up"} and "raised" in world[:3] and world[3] == "absent", world
    assert [r[1] for r in results] == ["done", "done", "raised", "absent"]  # tp groups {0, 1}, {2, 3}
    assert [r[2] for r in results] == ["done", "raised", "done", "absent"]  # cp groups {0, 2}, {1, 3}


def _timeout_of(group):
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def case_settings():
    import torch.distributed as dist

    from parallel_state.topology.kinds import row

    ps.initialize_model_parallel(context_parallel_size=2, pipeline_model_parallel_size=2,
                                 timeout=datetime.timedelta(seconds=41))
    state = ps.groups.state.current()
    groups = {kind: g for kind, g in state.groups.items() if g is not None}  # None: not an embedding stage
    read = {kind: (g.group_desc, dist.get_backend(g), _timeout_of(g)) for kind, g in groups.items()}
    gloo = {kind: (g.group_desc, dist.get_backend(g)) for kind, g in state.gloo_groups.items()}
    # A kind that shares megatron-core's way carries the group (and so the description) it shares.
    def owner(kind):
        shared = next((k for k in row(kind).shares if state.groups[k] is state.groups[kind]), None)
        return kind if shared is None else owner(shared)

    expected = {kind: (row(owner(kind)).label, "gloo", 41.0) for kind in groups}
    world_before = _timeout_of(dist.group.WORLD)
    ps.update_pg_timeout(datetime.timedelta(seconds=17), pg=ps.get_context_parallel_group())
    after = {kind: _timeout_of(g) for kind, g in groups.items()}
    world_after = _timeout_of(dist.group.WORLD)
    separate_gloo = all(state.gloo_groups[k] is not state.groups[k] for k in state.gloo_groups)
    wrong = {k: (v, expected[k]) for k, v in read.items() if v != expected[k]}
    return wrong, gloo, after, world_before == world_after, separate_gloo


def test_each_group_carries_its_kinds_description_timeout_and_backend(pools):
    for wrong, gloo, after, world_kept, separate_gloo in pools(4).run(case_settings):
        assert not wrong and world_kept and separate_gloo, wrong
        assert gloo["dp"] == ("DATA_PARALLEL_GROUP_GLOO", "gloo")
        assert after.pop("cp") == 17.0 and set(after.values()) == {41.0}


def case_cycles(n):
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    topologies = [dict(context_parallel_size=4), dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                  dict(context_parallel_size=2, expert_model_parallel_size=2), {}]
    live = []
    for i in range(n):
        ps.initialize_model_parallel(**topologies[i % len(topologies)], timeout=datetime.timedelta(seconds=30))
        t = torch.ones(1)
        dist.all_reduce(t, group=ps.get_context_parallel_group())
        ps.destroy_model_parallel()
        world = torch.ones(1)
        dist.all_reduce(world)  # WORLD still works after every destroy
        assert world.item() == dist.get_world_size()
        live.append(len(c10d._world.pg_map))
    probe = dist.new_group([0, 1, 2, 3])  # and new groups can still be made
    # gloo connects inside new_group pair by pair: a rank that destroyed the probe at once could
    # close a pair its peer is still connecting ("Connection closed by peer"); the barrier also uses it.
    dist.barrier(group=probe)
    dist.destroy_process_group(probe)
    return live


def test_destroy_frees_what_initialize_made_and_leaves_world_working(pools):
    # Each of the four topologies twice: a second build after a destroy frees what the first one made.
    for live in pools(4).run(case_cycles, 8, timeout=120):
        assert live == [1] * 8  # only the default group is left after each destroy
