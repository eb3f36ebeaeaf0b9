"""DeviceMesh views of the live topology, for DTensor and FSDP2 code.

``device_mesh()`` is a 4-D ``torch.distributed.device_mesh.DeviceMesh`` named
("pp", "dp", "cp", "tp") over the very process groups ``initialize_model_parallel`` made: it is
assembled with ``DeviceMesh.from_group`` from those groups and a mesh tensor that places every
rank of the world at its plan coordinates, so it costs no communicator and no ``new_group``.
Every order megatron-core accepts lays the ranks out as a product grid (a rank is the sum of its
coordinates times their strides), so that tensor is a reshape and permute of ``arange(world)``
for every order; a mesh line that disagrees with the plan or with a group is still checked for.

``fsdp_mesh(shard_size)`` is the 2-D ("replicate", "shard") mesh FSDP2 wants for hybrid
sharding over this rank's data-parallel-with-context-parallel ranks. Its groups are existing
ones where the ranks match (the dp-cp group itself, the cp or dp group, ...); any other is
created members-only through ``parallel_state.groups.create.GroupBatch``, under a counter span that is
a function of the plan and ``shard_size`` only, and is freed by ``destroy_model_parallel()``.

Both are built on first call and cached until ``destroy_model_parallel()``, whose teardown hook
drops the caches, frees the groups that were made here (and any that DeviceMesh itself created
for a mesh handed out here, e.g. by ``_flatten``), empties each mesh's group registry so the
freed groups are not kept alive, and turns every mesh handed out into a dead one whose use
raises ParallelStateError. torch is imported only when a mesh is asked for.

Teardown uses torch's public API where it has one (``destroy_process_group`` through
``groups.create.destroy_groups``, ``ProcessGroup.group_name``). torch has none to let a mesh go, so
it touches these DeviceMesh internals, each named once below (:data:`_REGISTRY`, :data:`_FLATTENED`,
:data:`_IDENTITY`):

- ``_pg_registry`` (the root mesh's): every group the mesh was given and every group DeviceMesh
  created for it itself (``_flatten``, ``_unflatten``). No public call lists the latter, which
  nobody else would ever free; and a mesh a caller kept would keep every freed group alive
  through it. Read to free the groups DeviceMesh made, then emptied.
- ``_flatten_mapping`` (the root mesh's): the flattened sub-meshes, which reach the same groups.
  Emptied for the same reason.
- the class of every mesh handed out, swapped for :func:`_dead_mesh_class`'s: there is no public
  way to invalidate a mesh, and a mesh over freed groups would otherwise fail deep in torch (or
  reach a later topology's group of the same name). The dead class still serves what
  ``DeviceMesh.__hash__`` and ``__eq__`` read (``_hash``, ``_hash_key``, ``_flatten_rank_map``,
  ``_layout``, ``_device_type``, ``_mesh_dim_names``, ``_thread_id``): a mesh can sit as a key in
  torch's own caches (DTensor's sharding propagation), which must still compare it with live ones.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Iterator

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.groups import state as _st
from parallel_state.topology.kinds import CP, DP, DP_CP, PP, TP, Kind

if TYPE_CHECKING:  # only for annotations: importing parallel_state must not import torch
    from torch.distributed.device_mesh import DeviceMesh

#: The DeviceMesh internals teardown touches (the module's docstring says why): the root mesh's group
#: registry, its flattened sub-meshes, and what DeviceMesh's __hash__ and __eq__ read.
_REGISTRY = "_pg_registry"
_FLATTENED = "_flatten_mapping"
_IDENTITY = frozenset({"_hash", "_hash_key", "_flatten_rank_map", "_layout", "_device_type", "_mesh_dim_names",
                       "_thread_id"})

#: The kinds whose groups are the dimensions of ``device_mesh()``, outermost first: megatron-core's
#: default order read from its slowest dimension (pp) to its fastest (tp), so with that order the mesh
#: is arange(world) reshaped.
_MESH_KINDS: tuple[Kind, ...] = (PP, DP, CP, TP)
#: The dimensions of ``device_mesh()``: its kinds' names.
MESH_DIMS: tuple[str, ...] = tuple(kind.name for kind in _MESH_KINDS)
#: The dimensions of ``fsdp_mesh()``, in the order FSDP2 reads a 2-D mesh (replicate, shard).
FSDP_DIMS: tuple[str, str] = ("replicate", "shard")

#: device type -> the cached ``device_mesh()``.
_meshes: dict[str, Any] = {}
#: (shard_size, device type) -> the cached ``fsdp_mesh()``.
_fsdp_meshes: dict[tuple[int, str], Any] = {}
#: shard_size -> (replicate group, shard group), shared by the device types.
_fsdp_groups: dict[int, tuple[Any, Any]] = {}
#: Every group this module created; freed on teardown.
_created: list[Any] = []
#: Names of the groups handed to DeviceMesh that belong to someone else (the core, or
#: ``_created``): any other group in a mesh's registry was created by DeviceMesh for it.
_borrowed_names: set[str] = set()
#: The ParallelState the caches belong to.
_owner: Any = None
_dead_class: Any = None


def _live_state(what: str) -> Any:
    """The live state, with the caches reset if they belong to an earlier one."""
    state = _st.peek()
    if state is None:
        raise ParallelStateError(
            f"{what} needs the model-parallel groups, which are not initialized: call "
            f"parallel_state.initialize_model_parallel(...) (after torch.distributed.init_process_group) first"
        )
    if _owner is not None and _owner is not state:
        _drop()  # teardown always runs the hook; this guards against a state swapped in by other means
    return state


def _resolve_device_type(device_type: str | None) -> str:
    """``device_type``, or the default group's: "cuda" for NCCL, "cpu" for gloo (and any other backend)."""
    if device_type is None or device_type == "":
        import torch.distributed as dist

        return "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    if not isinstance(device_type, str):
        raise ParallelStateTypeError(
            f"device_type must be a str such as 'cuda' or 'cpu' (or None for the backend's), got {device_type!r}"
        )
    if ":" in device_type:
        raise ParallelStateError(
            f"device_type={device_type!r} names one device; pass the type alone ({device_type.split(':')[0]!r}): "
            f"each rank uses its current device"
        )
    return device_type


def _mesh_tensor(plan: Any) -> Any:
    """Every rank of the world at index [pp][dp][cp][tp] of its plan coordinates."""
    import torch

    sizes = {"pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "tp": plan.tp}
    if sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"] != plan.world_size:
        raise ParallelStateError(
            f"pp*dp*cp*tp = {plan.pp}*{plan.dp}*{plan.cp}*{plan.tp} does not cover the world of {plan.world_size} "
            f"ranks (order {plan.order!r}), so the model-parallel layout is not one (pp, dp, cp, tp) grid; "
            f"build the mesh you need with DeviceMesh.from_group"
        )
    # rank = sum(coord[d] * stride[d]) with the first dimension of the order fastest, so
    # arange(world) viewed with the order reversed is indexed by coordinates; permute to ours.
    # Any other token of the order (ep) has size 1 in this layout: expert parallelism, where the
    # core has it, lays out a grid of its own.
    layout = [d for d in reversed(plan.dims) if d in sizes]
    # Plan positions, then their global ranks (a topology over a subset of the world).
    grid = torch.tensor(plan.all_ranks, dtype=torch.int).reshape([sizes[d] for d in layout])
    return grid.permute([layout.index(d) for d in MESH_DIMS]).contiguous()


def _check_lines(what: str, mesh: Any, rank: int, coords: tuple[int, ...], dims: tuple[str, ...],
                 groups: dict[str, Any], expected: dict[str, tuple[int, ...]], order: str) -> None:
    """Each mesh line through this rank must be the plan's group and hold the group's ranks, in order.

    ``from_group`` takes the mesh and the groups on trust; a line that differed would make
    DTensor address the wrong ranks silently, so it is checked here, on this rank's lines only.
    """
    import torch.distributed as dist

    if mesh[coords].item() != rank:
        raise ParallelStateError(
            f"{what}: rank {rank} is not at its plan coordinates {dict(zip(dims, coords, strict=True))} of the mesh "
            f"(order {order!r}); the plan's layout is not a product grid over {dims}: report this with the sizes"
        )
    for i, dim in enumerate(dims):
        index = list(coords)
        index[i] = slice(None)
        line = mesh[tuple(index)].tolist()
        group_ranks = dist.get_process_group_ranks(groups[dim])
        if line != list(expected[dim]) or line != list(group_ranks):
            raise ParallelStateError(
                f"{what}: along {dim!r} the mesh through rank {rank} holds ranks {line}, the plan's {dim} group "
                f"is {list(expected[dim])} and its process group holds {list(group_ranks)}; with order {order!r} "
                f"these cannot form one DeviceMesh over {dims}. Report this with the sizes and order, and "
                f"build the mesh with DeviceMesh.from_group from the groups you need meanwhile"
            )


def device_mesh(device_type: str | None = None) -> DeviceMesh:
    """The ("pp", "dp", "cp", "tp") DeviceMesh over the live model-parallel groups (built once, cached).

    ``mesh.get_group("cp")`` is ``get_context_parallel_group()``, and likewise for every
    dimension; sub-meshes come by indexing (``mesh["dp", "cp"]``). ``device_type`` defaults to
    "cuda" on NCCL and "cpu" on gloo. Local: no communication, no new process group. Dead
    after ``destroy_model_parallel()``: using it then raises ParallelStateError.
    """
    global _owner
    state = _live_state("parallel_state.device_mesh()")
    kind = _resolve_device_type(device_type)
    mesh = _meshes.get(kind)
    if mesh is not None:
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    plan, rank = state.plan, state.rank
    groups = {d: state.groups[d] for d in MESH_DIMS}
    tensor = _mesh_tensor(plan)
    coords = plan.coords(rank)
    _check_lines("parallel_state.device_mesh()", tensor, rank, tuple(coords[d] for d in MESH_DIMS), MESH_DIMS,
                 groups, {d: plan.group_ranks(d, rank) for d in MESH_DIMS}, plan.order)
    mesh = DeviceMesh.from_group([groups[d] for d in MESH_DIMS], kind, mesh=tensor, mesh_dim_names=MESH_DIMS)
    _borrowed_names.update(g.group_name for g in groups.values())
    _meshes[kind] = mesh
    _owner = state
    return mesh


#: Kinds whose group may equal a needed FSDP group.
_REUSABLE: tuple[Kind, ...] = (DP_CP, DP, CP, TP, PP)


def _existing_group(state: Any, ranks: tuple[int, ...]) -> Any:
    """The live group holding exactly ``ranks`` in that order, or None."""
    for kind in _REUSABLE:
        if state.ranks(kind.name) == ranks:
            return state.groups[kind.name]
    return None


def _shard_size(shard_size: int | None, n: int, plan: Any) -> int:
    if shard_size is None:
        return n
    if isinstance(shard_size, bool) or not _is_int(shard_size):
        raise ParallelStateTypeError(
            f"shard_size must be an int dividing the {n} data-parallel x context-parallel ranks, or None for "
            f"all of them; got {shard_size!r} ({type(shard_size).__name__})"
        )
    size = operator.index(shard_size)
    if size < 1 or n % size:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ParallelStateError(
            f"shard_size={size} does not divide the {n} data-parallel x context-parallel ranks "
            f"(dp {plan.dp} x cp {plan.cp}); pass one of {divisors}, or None to shard over all {n}"
        )
    return size


def _is_int(value: object) -> bool:
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def fsdp_mesh(shard_size: int | None = None, *, device_type: str | None = None) -> DeviceMesh:
    """The 2-D ("replicate", "shard") DeviceMesh for FSDP2 over this rank's data-parallel x context-parallel ranks.

    Shard groups are contiguous blocks of ``shard_size`` ranks of the dp-cp group, in its order
    (default: all of it, so the replicate dimension has size 1); replicate groups join the
    ranks at the same place of each block. Collective over the world: every rank calls it with
    the same ``shard_size``. Existing groups are reused; others are created on their members
    only and freed by ``destroy_model_parallel()``. Cached per ``shard_size`` and device type;
    after an error nothing is left behind on any rank.
    """
    global _owner
    state = _live_state("parallel_state.fsdp_mesh()")
    plan, rank = state.plan, state.rank
    if plan.ranks is not None:
        raise ParallelStateError(
            "parallel_state.fsdp_mesh() builds its groups over the whole world; this topology was initialized "
            f"over ranks {list(plan.ranks)}: use device_mesh()['dp', 'cp'] there, or initialize without ranks="
        )
    dpcp = plan.group_ranks(DP_CP.name, rank)
    n = len(dpcp)
    size = _shard_size(shard_size, n, plan)
    kind = _resolve_device_type(device_type)
    mesh = _fsdp_meshes.get((size, kind))
    if mesh is not None:
        return mesh
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    pair = _fsdp_groups.get(size)
    if pair is None:
        pair = _build_fsdp_groups(state, size)
    tensor = torch.tensor(dpcp, dtype=torch.int).reshape(n // size, size)
    wanted = _fsdp_wanted(plan, rank, size)
    _check_lines("parallel_state.fsdp_mesh()", tensor, rank, divmod(dpcp.index(rank), size), FSDP_DIMS,
                 dict(zip(FSDP_DIMS, pair, strict=True)), {d: wanted[d][0] for d in FSDP_DIMS}, plan.order)
    mesh = DeviceMesh.from_group(list(pair), kind, mesh=tensor, mesh_dim_names=FSDP_DIMS)
    _fsdp_meshes[(size, kind)] = mesh
    _owner = state
    return mesh


def _fsdp_wanted(plan: Any, rank: int, size: int) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """sort -> (this rank's group, its index among the world's groups of that sort, how many the world has).

    The index is the same on every member (same dp-cp group, same block or column), which is
    what gives the members one counter name; the count depends on the plan and ``size`` only.
    """
    dpcp = plan.group_ranks(DP_CP.name, rank)
    n = len(dpcp)
    block, column = divmod(dpcp.index(rank), size)
    index = plan.group_index(DP_CP.name, rank)
    return {
        "shard": (dpcp[block * size:(block + 1) * size], index * (n // size) + block, plan.world_size // size),
        "replicate": (dpcp[column::size], index * size + column, plan.world_size // n * size),
    }


def _world_fsdp_groups(plan: Any, size: int, sort: str) -> Iterator[tuple[int, ...]]:
    """Every group of ``sort`` in the world, in index order (for the eager-NCCL path, where all ranks create all)."""
    for dpcp in plan.groups(DP_CP.name):
        if sort == "shard":
            yield from (dpcp[b * size:(b + 1) * size] for b in range(len(dpcp) // size))
        else:
            yield from (dpcp[c::size] for c in range(size))


def _build_fsdp_groups(state: Any, size: int) -> tuple[Any, Any]:
    """This rank's (replicate, shard) groups for ``size``: reused, or created members-only; all ranks or none."""
    global _owner
    from parallel_state.runtime.subgroups import Wanted, build_groups

    plan = state.plan
    wanted = {sort: Wanted(*_fsdp_wanted(plan, state.rank, size)[sort],
                           lambda sort=sort: _world_fsdp_groups(plan, size, sort))
              for sort in ("shard", "replicate")}
    made, created = build_groups("parallel_state.fsdp_mesh", {"shard_size": size}, wanted, timeout=state.timeout,
                                 reuse=lambda ranks, sort: _existing_group(state, ranks))
    _created.extend(created)
    pair = (made["replicate"], made["shard"])
    _borrowed_names.update(pg.group_name for pg in pair)
    _fsdp_groups[size] = pair
    _owner = state
    return pair


def _dead_mesh_class() -> Any:
    """A DeviceMesh subclass whose every use raises: what a mesh becomes on teardown."""
    global _dead_class
    if _dead_class is not None:
        return _dead_class
    from torch.distributed.device_mesh import DeviceMesh

    # What hash() and == read (the module's docstring says why a dead mesh still answers them).
    allowed = _IDENTITY | {"__class__", "__dict__"}

    class DeadDeviceMesh(DeviceMesh):
        """A mesh whose process groups destroy_model_parallel() freed."""

        def __getattribute__(self, name: str) -> Any:
            if name in allowed:
                return object.__getattribute__(self, name)
            raise ParallelStateError(
                f"this DeviceMesh (used for {name!r}) was built by parallel_state over process groups that "
                f"destroy_model_parallel() or DistributedManager.cleanup() has freed; build the mesh again "
                f"(device_mesh(), fsdp_mesh() after initialize_model_parallel(...), or "
                f"DistributedManager().initialize_mesh(...)), and rebuild what holds the old mesh (DTensors, "
                f"fully_shard modules)"
            )

        def __repr__(self) -> str:
            names = object.__getattribute__(self, "_mesh_dim_names")
            return f"DeadDeviceMesh({names}, its groups freed)"

    _dead_class = DeadDeviceMesh
    return _dead_class


def reusable_group(ranks: tuple[int, ...], name: str | None = None) -> Any:
    """A live group holding exactly ``ranks`` in that order, or None: the model-parallel group of kind ``name``
    where it holds them, else the default group for the whole world (it outlives every other), else the first
    kind's group that holds them (``_REUSABLE`` order)."""
    import torch.distributed as dist

    state = _st.peek()
    live = state is not None and state.plan.ranks is None
    if live and name in state.groups and state.groups[name] is not None and state.ranks(name) == ranks:
        return state.groups[name]
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    return _existing_group(state, ranks) if live else None


def world_mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str,
               timeout: Any) -> tuple[DeviceMesh, list[Any], set[str]]:
    """The DeviceMesh over the whole world laid out row-major, as ``init_device_mesh`` lays it out.

    Collective over the world. Each dimension's group is the live one holding its ranks where there is one
    (:func:`reusable_group`), else created members-only. Returns the mesh, the groups created for it (the
    caller frees them) and the names of those it borrowed.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from parallel_state.groups.create import destroy_groups
    from parallel_state.runtime.subgroups import build_groups, partition_wanted

    what = "DistributedManager.initialize_mesh"
    rank = dist.get_rank()
    tensor = torch.arange(dist.get_world_size(), dtype=torch.int).reshape(shape)
    wanted = {name: partition_wanted([tuple(line) for line in tensor.movedim(i, -1).reshape(-1, shape[i]).tolist()],
                                     rank)
              for i, name in enumerate(names)}
    made, created = build_groups(what, {"mesh_shape": list(shape), "mesh_dim_names": list(names)}, wanted,
                                 timeout=timeout, reuse=reusable_group)
    try:
        coords = tuple(int(c) for c in (tensor == rank).nonzero()[0])
        _check_lines(what, tensor, rank, coords, names, made, {n: wanted[n].ranks for n in names}, "row-major")
        mesh = DeviceMesh.from_group([made[n] for n in names], device_type, mesh=tensor, mesh_dim_names=names)
    except BaseException:
        made.clear()
        destroy_groups(created)
        raise
    mine = {id(pg) for pg in created}
    return mesh, created, {pg.group_name for pg in made.values() if id(pg) not in mine}


def flat_group(ranks: tuple[int, ...], timeout: Any) -> tuple[Any, bool]:
    """One group over ``ranks`` (sorted global ranks), made by its members only; returns it and whether it is new.

    A live group holding them (:func:`reusable_group`) is reused. Only the members call this, so the group's
    name comes from a range they agree on through the default store (``subset_base``).
    """
    from parallel_state.groups.create import GroupBatch, destroy_groups, subset_base

    existing = reusable_group(ranks)
    if existing is not None:
        return existing, False
    batch = GroupBatch(timeout=timeout, base=subset_base(ranks, 1, timeout))
    try:
        group = batch.create(ranks, index=0, count=1, desc="DistributedManager.get_mesh_group")
        batch.wait_for_members()
    except BaseException:
        destroy_groups(batch.created)
        raise
    finally:
        batch.close()
    return group, True


def retire(meshes: list[Any], borrowed: set[str]) -> list[Any]:
    """Turn every mesh in ``meshes`` into a dead one; return the groups DeviceMesh created for them itself.

    ``borrowed``: names of the groups the meshes were given, which belong to someone else. The caller
    destroys what is returned (nobody else would ever free it).
    """
    import torch.distributed as dist

    default = dist.group.WORLD
    default_name = default.group_name if default is not None else None
    dead = _dead_mesh_class()
    doomed: list[Any] = []
    for mesh in meshes:
        registry = mesh.__dict__.get(_REGISTRY, {})
        # Groups DeviceMesh created itself for this mesh (_flatten, _unflatten) sit in the root's
        # registry beside the borrowed ones.
        doomed.extend(pg for name, pg in registry.items()
                      if name not in borrowed and name != default_name and pg not in doomed)
        registry.clear()  # the freed groups must not stay reachable from a mesh someone kept
        mesh.__dict__.get(_FLATTENED, {}).clear()
        mesh.__class__ = dead
    return doomed


def _drop() -> None:
    """Teardown hook: kill every mesh handed out and free every group made for them."""
    global _owner
    _owner = None
    if not (_meshes or _fsdp_meshes or _created):
        return
    from parallel_state.groups.create import destroy_groups

    meshes = [*_meshes.values(), *_fsdp_meshes.values()]
    _meshes.clear()
    _fsdp_meshes.clear()
    _fsdp_groups.clear()
    doomed, _created[:] = list(_created), []
    doomed.extend(retire(meshes, _borrowed_names))
    meshes.clear()
    _borrowed_names.clear()
    destroy_groups(doomed)


_st.register_teardown_hook(_drop)
