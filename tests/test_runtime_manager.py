"""DistributedManager's PhysicsNeMo surface, called as nvalchemi and PhysicsNeMo code call it: the uninitialized
error, meshes, named groups, setup and the launcher entry points, on 1, 2 and 4 real gloo ranks.

PhysicsNeMo's own manager cannot be the oracle here: nvidia-physicsnemo's package imports warp, h5py, onnx and
more at import, and its setup() passes device_id=cpu to init_process_group, which torch refuses on a CPU machine.
Its group layout is compared instead with what its create_groups_from_config built, recorded in
tests/data/physicsnemo_group_ranks.json.
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import contextmanager

import pytest
from test_runtime import LAUNCH_VARS, _free_port
from test_runtime import clean_env as clean_env  # the fixture

import parallel_state as ps
from parallel_state import DistributedManager, ParallelStateError
from parallel_state.runtime.manager import _mesh_spec

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "data", "physicsnemo_group_ranks.json")) as _f:
    PHYSICSNEMO_GROUPS = json.load(_f)

#: PhysicsNeMo 2.2.2's DistributedManager: every public member (properties, then methods).
PHYSICSNEMO_PROPERTIES = ("rank", "local_rank", "world_size", "device", "distributed", "cuda", "mesh_dims",
                          "group_names", "global_mesh", "broadcast_buffers", "find_unused_parameters")
PHYSICSNEMO_METHODS = ("mesh_names", "mesh_sizes", "group", "mesh", "group_size", "group_rank", "group_name",
                       "is_initialized", "get_available_backend", "initialize_env", "initialize_open_mpi",
                       "initialize_slurm", "initialize", "initialize_mesh", "get_mesh_group", "setup",
                       "create_process_subgroup", "create_orthogonal_process_group", "create_group_from_node",
                       "create_groups_from_config", "cleanup")


def _doc_config(sizes):
    """PhysicsNeMo's documented config: world -> (model_parallel -> (spatial, channel), data_parallel)."""
    config = ps.ProcessGroupConfig(ps.ProcessGroupNode("world"))
    config.add_node(ps.ProcessGroupNode("model_parallel"), parent="world")
    config.add_node(ps.ProcessGroupNode("data_parallel"), parent=config.get_node("world"))
    config.add_node(ps.ProcessGroupNode("spatial_parallel"), parent="model_parallel")
    config.add_node(ps.ProcessGroupNode("channel_parallel"), parent="model_parallel")
    config.set_leaf_group_sizes(sizes)
    return config


# --- in this process: no torch.distributed ------------------------------------------------------

def test_surface_is_physicsnemos():
    for name in PHYSICSNEMO_PROPERTIES:
        assert isinstance(getattr(DistributedManager, name), property), name
    for name in PHYSICSNEMO_METHODS:
        assert callable(getattr(DistributedManager, name)), name
    for name in ("broadcast_buffers", "find_unused_parameters"):
        assert getattr(DistributedManager, name).fset is not None, name
    assert issubclass(ps.PhysicsNeMoUninitializedDistributedManagerWarning, Warning)
    assert issubclass(ps.PhysicsNeMoUndefinedGroupError, ParallelStateError)


def test_uninitialized_manager_raises_the_warning_class(clean_env):
    import torch

    with pytest.raises(ps.PhysicsNeMoUninitializedDistributedManagerWarning, match="DistributedManager.initialize"):
        DistributedManager()
    assert not DistributedManager.is_initialized()
    DistributedManager.initialize()  # a single process: no launcher variables
    dm = DistributedManager()
    assert (dm.rank, dm.world_size, dm.distributed, dm.cuda) == (0, 1, False, torch.cuda.is_available())
    assert (dm.broadcast_buffers, dm.find_unused_parameters, dm.mesh_dims, list(dm.group_names)) == (
        False, False, {}, [])
    with pytest.warns(ps.ParallelStateWarning, match="only when some parameters"):
        dm.find_unused_parameters = True
    dm.broadcast_buffers = True
    assert DistributedManager().find_unused_parameters and DistributedManager().broadcast_buffers
    assert (dm.group(), dm.group_size(), dm.group_rank(), dm.group_name()) == (None, 1, 0, None)
    with pytest.raises(ps.PhysicsNeMoUndefinedGroupError, match="'undefined_group'"):
        dm.group_rank("undefined_group")
    for call in (lambda: dm.initialize_mesh((-1,), ("world",)), lambda: dm.global_mesh,
                 lambda: DistributedManager.create_process_subgroup("mp", 1)):
        with pytest.raises(AssertionError, match="needs a distributed run"):
            call()
    with pytest.raises(AssertionError, match="call initialize_mesh"):
        dm.mesh()
    DistributedManager.cleanup()
    assert not DistributedManager.is_initialized()


def test_collective_device_fallback(clean_env):
    import torch

    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
        torch.device("meta")
    assert ps.collective_device(fallback="meta") == expected
    assert ps.collective_device() == (expected if torch.cuda.is_available() else torch.device("cpu"))


def test_forced_method_and_bad_setup_arguments(clean_env):
    clean_env.setenv("PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD", "SLURM")
    with pytest.raises(ParallelStateError, match="none of SLURM_PROCID is set"):
        DistributedManager.initialize()
    clean_env.setenv("PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD", "MPI")
    with pytest.raises(ValueError, match="'MPI' is not one of"):
        DistributedManager.initialize()
    rows = [(dict(rank=2, world_size=2), "rank=2 is outside the world of world_size=2"),
            (dict(rank=1, world_size=2, local_rank=2), "local_rank=2 must be at most the global rank 1"),
            (dict(rank=-1, world_size=2), "rank must be >= 0"),
            (dict(world_size="2"), "world_size must be a positive int"),
            (dict(world_size=2, port="http"), "MASTER_PORT='http' is not an integer"),
            (dict(world_size=2, method="pbs"), "method='pbs' is not one of"),
            (dict(world_size=2, addr=""), "addr must be"),
            (dict(world_size=2, timeout=5), "timeout must be a positive datetime.timedelta")]
    for kwargs, message in rows:
        with pytest.raises((ParallelStateError, TypeError), match=message):
            DistributedManager.setup(backend="gloo", **kwargs)
    assert not DistributedManager.is_initialized() and "MASTER_PORT" not in os.environ


MESH_SPECS = [
    (((4,), ("domain",)), ((4,), ("domain",))),
    (((2, -1), ("pipeline", "domain")), ((2, 2), ("pipeline", "domain"))),
    (((-1, 1, 2), ("dp", "x", "tp")), ((2, 1, 2), ("dp", "x", "tp"))),
    (((), ()), "at least one mesh dimension"),
    (((2, 2), ("a",)), "same length, but found 2 and 1"),
    (((2, 2), ("a", "a")), "unique"),
    (((-1, -1), ("a", "b")), "at most one -1"),
    (((3, -1), ("a", "b")), "does not divide the world size 4"),
    (((2, 3), ("a", "b")), "multiply to 6 but the world has 4"),
    (((0, 4), ("a", "b")), "int >= 1"),
]


@pytest.mark.parametrize("spec, expected", MESH_SPECS, ids=[str(i) for i in range(len(MESH_SPECS))])
def test_mesh_spec(spec, expected):
    if isinstance(expected, str):
        with pytest.raises(ParallelStateError, match=expected):
            _mesh_spec(*spec, 4)
    else:
        assert _mesh_spec(*spec, 4) == expected


def test_process_group_config_shapes():
    config = _doc_config({"channel_parallel": 3, "spatial_parallel": 2, "data_parallel": 4})
    assert config.leaf_groups() == ["data_parallel", "spatial_parallel", "channel_parallel"]
    assert (config.get_node("model_parallel").size, config.get_node("world").size) == (6, 24)
    assert [c.identifier for c in config.tree.children("world")] == ["model_parallel", "data_parallel"]
    with pytest.raises(AssertionError, match="is not a leaf"):
        config.set_leaf_group_sizes({"model_parallel": 2})
    with pytest.raises(AssertionError, match="'nope' is not in this config"):
        config.set_leaf_group_sizes({"nope": 2})
    with pytest.raises(ValueError, match="already has a process group named 'world'"):
        config.add_node(ps.ProcessGroupNode("world"), parent="data_parallel")
    with pytest.raises(ValueError, match="parent 'nope'"):
        config.add_node(ps.ProcessGroupNode("x"), parent="nope")
    with pytest.raises(AssertionError, match="has no size"):
        DistributedManager.create_group_from_node(ps.ProcessGroupNode("unsized"))


# --- on real gloo ranks, started by each launcher's variables ---------------------------------

@contextmanager
def _env(values):
    """Only ``values`` of the launchers' variables set, for the block's duration."""
    with pytest.MonkeyPatch.context() as patch:
        for k in LAUNCH_VARS:
            patch.delenv(k, raising=False)
        for k, v in values.items():
            patch.setenv(k, v)
        yield


def _sum(group):
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t, group=group)
    return t.item()


def _nvalchemi_calls(dm):
    """What nvalchemi's examples and domain-parallel code call, with the facts the test checks."""
    import torch
    import torch.distributed as dist

    world, rank = dm.world_size, dm.rank
    before = set(dist.distributed_c10d._world.pg_map)
    mesh = dm.initialize_mesh(mesh_shape=(world,), mesh_dim_names=("domain",))
    out = {"device": str(dm.device), "cuda": dm.cuda, "collective": str(ps.collective_device(fallback="meta")),
           "domain_is_world": mesh.get_group("domain") is dist.group.WORLD,
           "mesh_group": dm.get_mesh_group(mesh) is mesh.get_group() is dm.get_mesh_group(mesh),
           "dims": (dm.mesh_dims, list(dm.mesh_names()), list(dm.mesh_sizes())), "global": dm.global_mesh is mesh,
           "mesh_domain": dm.mesh("domain").mesh.tolist(), "device_type": mesh.device_type,
           "undefined": type(_error(lambda: dm.mesh("pipeline"))).__name__}
    if world >= 2:  # examples/distributed/07_fire_nvt_dd.py's 2-D (pipeline, domain) mesh
        mesh2 = dm.initialize_mesh(mesh_shape=(2, -1), mesh_dim_names=("pipeline", "domain"))
        out["pipeline_index"] = int(mesh2["pipeline"].get_local_rank())
        out["domain_lead"] = int(mesh2["domain"].get_local_rank()) == 0
        out["sums2"] = {d: _sum(mesh2.get_group(d)) for d in ("pipeline", "domain")}
        out["dims2"] = dm.mesh_dims
        out["old_mesh_alive"] = _sum(mesh.get_group()) == sum(range(1, world + 1))
        # shard_tensor.py's flattened group of a 2-D (sub-)mesh: here a group of its members only.
        mesh3 = dm.initialize_mesh(mesh_shape=(2, 1, -1), mesh_dim_names=("a", "b", "c"))
        sub = mesh3["b", "c"]
        flat = dm.get_mesh_group(sub)
        out["flat"] = (dist.get_process_group_ranks(flat), _sum(flat), dm.get_mesh_group(sub) is flat)
    # PhysicsNeMo's named groups: model parallel, its orthogonal data parallel, and DDP reading the manager.
    DistributedManager.create_process_subgroup("model_parallel", max(1, world // 2))
    DistributedManager.create_orthogonal_process_group("data_parallel", "model_parallel")
    out["named"] = {n: (dm.group_size(n), dm.group_rank(n), dist.get_process_group_ranks(dm.group(n)),
                        _sum(dm.group(n)), dm.group_name(dm.group(n))) for n in ("model_parallel", "data_parallel")}
    model = torch.nn.Linear(2, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=dm.broadcast_buffers,
                                                    find_unused_parameters=dm.find_unused_parameters,
                                                    process_group=dm.group("data_parallel"))
    ddp(torch.full((1, 2), float(rank))).sum().backward()
    out["ddp_grad"] = model.weight.grad.tolist()
    out["dup"] = str(_error(lambda: DistributedManager.create_process_subgroup("model_parallel", 1)))
    # Refused on every rank alike before any collective, saying what to do.
    out["refused"] = [f"{type(e).__name__}: {e}" for e in (
        _error(lambda: DistributedManager.create_process_subgroup("thirds", 3)),
        _error(lambda: DistributedManager.create_orthogonal_process_group("x", "nope")),
        _error(lambda: DistributedManager.create_orthogonal_process_group("data_parallel", "model_parallel")),
        _error(lambda: dm.group_name(dist.group.WORLD)))]
    out["made"] = len(set(dist.distributed_c10d._world.pg_map) - before)
    out["kept"] = (mesh, list(dm.group_names))
    return out


def _error(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    return None


ENTRIES = ("initialize:torchrun", "initialize:slurm", "initialize:openmpi", "setup", "initialize_env",
           "initialize_slurm", "initialize_open_mpi")


def _launcher_env(entry, rank, world, port):
    local = str(rank)
    if entry.endswith("torchrun") or entry == "initialize_env" or entry == "setup":
        return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": local, "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}
    if "slurm" in entry:
        return {"SLURM_PROCID": str(rank), "SLURM_NPROCS": str(world), "SLURM_LOCALID": local,
                "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": local, "OMPI_COMM_WORLD_LOCAL_SIZE": str(world), "MASTER_PORT": str(port)}


def case_launchers(ports, rejoin):
    """Leave the pool's world; for each entry point start a world from a launcher's variables, make nvalchemi's
    calls, clean up; then rejoin a world of the pool's shape (``rejoin``: a fresh FileStore path)."""
    import datetime

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    out = {}
    try:
        for entry, port in zip(ENTRIES, ports, strict=True):
            with _env(_launcher_env(entry, rank, world, port)):
                if entry.startswith("initialize:"):
                    DistributedManager.initialize(timeout=datetime.timedelta(seconds=60))
                elif entry == "setup":  # examples/intermediate/06_ddp_mlp_training.py
                    DistributedManager.setup(rank=int(os.environ.get("RANK", "0")),
                                             world_size=int(os.environ.get("WORLD_SIZE", "1")),
                                             local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                                             addr=os.environ.get("MASTER_ADDR", "localhost"),
                                             port=os.environ.get("MASTER_PORT", "12355"), backend="gloo")
                elif entry == "initialize_env":
                    DistributedManager.initialize_env()
                elif entry == "initialize_slurm":
                    DistributedManager.initialize_slurm(port)
                else:
                    DistributedManager.initialize_open_mpi("127.0.0.1", port)
                dm = DistributedManager()
                r = {"who": (dm.rank, dm.world_size, dm.local_rank, dm.launch.launcher, dist.get_world_size()),
                     "str": str(dm)}
                r.update(_nvalchemi_calls(dm))
                mesh, names = r.pop("kept")
                DistributedManager.cleanup()
                r["after"] = (dist.is_initialized(), DistributedManager.is_initialized(), names,
                              type(_error(lambda mesh=mesh: mesh.get_group())).__name__)
                out[entry] = r
    finally:
        if DistributedManager.is_initialized():
            DistributedManager.cleanup()
        dist.init_process_group("gloo", init_method=f"file://{rejoin}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_launchers_and_nvalchemi_calls(pools, world, tmp_path_factory):
    ports = [_free_port() for _ in ENTRIES]
    # The pool's ranks keep using the rejoined world's store after this test: it lives as long as the session.
    rejoin = tmp_path_factory.mktemp("rejoin") / "store"
    results = pools(world).run(case_launchers, ports, str(rejoin), timeout=120)
    launcher = {"initialize:torchrun": "torchrun", "initialize:slurm": "slurm", "initialize:openmpi": "openmpi",
                "setup": "torchrun", "initialize_env": "torchrun", "initialize_slurm": "slurm",
                "initialize_open_mpi": "openmpi"}
    half = max(1, world // 2)
    for rank, out in enumerate(results):
        for entry in ENTRIES:
            r = out[entry]
            assert r["who"] == (rank, world, rank, launcher[entry], world), (entry, r["who"])
            method = {"torchrun": "env", "slurm": "slurm", "openmpi": "openmpi"}[launcher[entry]]
            assert r["str"] == f"Initialized process {rank} of {world} using method '{method}'. Device set to cpu"
            # The pool hides every GPU: the rank-local device and the collectives' are both the CPU.
            assert (r["device"], r["cuda"], r["collective"], r["device_type"]) == ("cpu", False, "cpu", "cpu")
            assert r["domain_is_world"] and r["mesh_group"] and r["global"], entry
            assert r["dims"] == ({"domain": world}, ["domain"], [world]) and r["mesh_domain"] == list(range(world))
            assert r["undefined"] == "PhysicsNeMoUndefinedGroupError"
            mp = tuple(range(rank - rank % half, rank - rank % half + half))
            dp = tuple(range(rank % half, world, half))
            assert r["named"] == {
                "model_parallel": (half, rank % half, list(mp), sum(x + 1 for x in mp), "model_parallel"),
                "data_parallel": (len(dp), rank // half, list(dp), sum(x + 1 for x in dp), "data_parallel")}
            # One DDP step over the data-parallel group: the mean of its ranks' gradients.
            assert r["ddp_grad"] == [[sum(dp) / len(dp)] * 2], r["ddp_grad"]
            assert "already exists" in r["dup"]
            thirds, missing, exists, unnamed = r["refused"]
            assert thirds.startswith("ParallelStateAssertionError: cannot divide group size") and \
                f"subgroups of size 3; pass one of {[d for d in range(1, world + 1) if world % d == 0]}" in thirds
            assert missing.startswith("ParallelStateValueError: no group named 'nope' exists")
            assert exists.startswith("ParallelStateValueError: a group named 'data_parallel' already exists")
            assert unnamed.startswith("ParallelStateValueError: DistributedManager.group_name:")
            assert r["after"] == (False, False, ["model_parallel", "data_parallel"], "ParallelStateError")
            if world >= 2:
                domain = world // 2
                assert (r["pipeline_index"], r["domain_lead"]) == (rank // domain, rank % domain == 0)
                line = [b for b in range(world) if b // domain == rank // domain]
                assert r["sums2"] == {"pipeline": sum(x + 1 for x in range(rank % domain, world, domain)),
                                      "domain": sum(x + 1 for x in line)}
                assert r["dims2"] == {"pipeline": 2, "domain": domain} and r["old_mesh_alive"]
                assert r["flat"] == (line, sum(x + 1 for x in line), True)
            # Groups made: the 2-D and 3-D meshes' own, the flat one, the two named ones (the world is reused).
            assert r["made"] == {1: 2, 2: 1 + 2 + 1 + 2, 4: 2 + 3 + 1 + 2}[world], (entry, r["made"])


def case_named_groups_from_config(sizes):
    import torch.distributed as dist

    DistributedManager.initialize()
    try:
        dm = DistributedManager()
        DistributedManager.create_groups_from_config(_doc_config(sizes))
        return {name: (dist.get_process_group_ranks(dm.group(name)), dm.group_rank(name), dm.group_size(name))
                for name in dm.group_names}
    finally:
        DistributedManager.cleanup()


@pytest.mark.parametrize("world, sizes", [(4, {"spatial_parallel": 2, "channel_parallel": 1, "data_parallel": 2}),
                                          (8, {"spatial_parallel": 2, "channel_parallel": 2, "data_parallel": 2})])
def test_groups_from_config_match_physicsnemo(pools, world, sizes):
    expected = PHYSICSNEMO_GROUPS["groups"][str(world)]
    for rank, out in enumerate(pools(world).run(case_named_groups_from_config, sizes)):
        assert sorted(out) == sorted(expected)
        for name, groups in expected.items():
            (mine,) = [g for g in groups if rank in g]
            assert out[name] == (sorted(mine), sorted(mine).index(rank), len(mine)), (name, out[name], mine)


def case_mesh_over_model_parallel_groups():
    """A manager mesh whose dimensions are model-parallel groups uses those very groups, and dies with them."""
    import torch.distributed as dist

    ps.initialize_model_parallel(context_parallel_size=2)
    DistributedManager.initialize()  # adopts the pool's world
    dm = DistributedManager()
    try:
        domain = dm.initialize_mesh((4,), ("domain",))
        before = set(dist.distributed_c10d._world.pg_map)
        mesh = dm.initialize_mesh((2, 2), ("dp", "cp"))
        out = {"same": (mesh.get_group("cp") is ps.get_context_parallel_group(),
                        mesh.get_group("dp") is ps.get_data_parallel_group()),
               "no_new_group": set(dist.distributed_c10d._world.pg_map) == before}
        # A rank called with other sizes is named on every rank; nothing is made.
        odd = dist.get_rank() == 3
        out["mismatch"] = str(_error(lambda: DistributedManager.create_process_subgroup("mp", 1 if odd else 2)))
        out["names_after_mismatch"] = list(dm.group_names)
        ps.destroy_model_parallel()
        out["dead"] = (type(_error(lambda: mesh.get_group("cp"))).__name__, dm.mesh_dims)
        out["other_mesh_lives"] = _sum(domain.get_group()) == 10
    finally:
        DistributedManager.cleanup()
    out["world_kept"] = dist.is_initialized()
    return out


def test_mesh_reuses_model_parallel_groups(pools):
    for out in pools(4).run(case_mesh_over_model_parallel_groups):
        assert out["same"] == (True, True) and out["no_new_group"]
        assert "rank 3" in out["mismatch"] and "size" in out["mismatch"], out["mismatch"]
        assert out["names_after_mismatch"] == []
        assert out["dead"] == ("ParallelStateError", {}) and out["other_mesh_lives"] and out["world_kept"]


def test_no_warning_once_initialized(clean_env):
    DistributedManager.initialize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedManager()
