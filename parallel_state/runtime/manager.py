"""``DistributedManager``: one process-wide view of the launch (rank, world, device), PhysicsNeMo style."""

from __future__ import annotations

import datetime
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from parallel_state.errors import (
    ParallelStateAssertionError,
    ParallelStateError,
    ParallelStateTypeError,
    ParallelStateValueError,
    ParallelStateWarning,
)
from parallel_state.groups import state as _st
from parallel_state.groups.consistency import DEFAULT_TIMEOUT
from parallel_state.runtime.group_config import creation_order, orthogonal_name
from parallel_state.runtime.launch import LaunchInfo, detect_launch
from parallel_state.runtime.subgroups import blocks, transpose
from parallel_state.topology.arguments import non_negative_int, positive_int
from parallel_state.topology.str_enum import StrEnum, one_of

if TYPE_CHECKING:  # only for annotations: importing parallel_state must not import torch
    from torch.distributed.device_mesh import DeviceMesh


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_cuda_device(local_rank: int, what: str = "LOCAL_RANK") -> Any:
    """The CUDA device of ``local_rank``, or a ParallelStateError when this node has too few."""
    import torch

    count = _cuda_device_count()
    if count == 0:
        raise ParallelStateError(
            "the NCCL backend needs CUDA, but torch.cuda.is_available() is False on this machine; "
            "use the 'gloo' backend to run on the CPU"
        )
    if local_rank >= count:
        raise ParallelStateError(
            f"{what}={local_rank} but only {count} CUDA device(s) are visible on this node; start at "
            f"most {count} process(es) per node, or use the 'gloo' backend"
        )
    return torch.device("cuda", local_rank)


def check_backend_available(backend: str) -> None:
    """Fail at once, with what to do, when ``backend`` asks for NCCL on a machine without it."""
    import torch
    import torch.distributed as dist

    if "nccl" not in backend.lower():
        return
    if not torch.cuda.is_available():
        raise ParallelStateError(
            f"distributed_backend={backend!r} needs CUDA, but torch.cuda.is_available() is False on "
            f"this machine; use distributed_backend='gloo' to run on the CPU"
        )
    if not dist.is_nccl_available():
        raise ParallelStateError(
            f"distributed_backend={backend!r} needs NCCL, which this torch build lacks; "
            f"install a CUDA build of torch or use distributed_backend='gloo'"
        )


#: The environment variable PhysicsNeMo reads to force one way of starting (ENV, SLURM or OPENMPI).
METHOD_VARIABLE = "PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD"


class InitMethod(StrEnum):
    """How a launch is started: ``setup(method=...)``'s names (upper case in :data:`METHOD_VARIABLE`)."""

    ENV = "env"
    SLURM = "slurm"
    OPENMPI = "openmpi"

    @property
    def launcher(self) -> str:
        """The launcher (``parallel_state.runtime.launch.LAUNCHERS``) whose variables this method reads."""
        return _LAUNCHER_OF[self]


_LAUNCHER_OF = {InitMethod.ENV: "torchrun", InitMethod.SLURM: "slurm", InitMethod.OPENMPI: "openmpi"}


class _HandedMesh(NamedTuple):
    """A mesh ``initialize_mesh`` handed out: the groups made for it, the names of those it borrowed, and the
    model-parallel state whose groups it uses (None: none of them)."""

    mesh: Any
    created: list[Any]
    borrowed: set[str]
    owner: Any


class PhysicsNeMoUninitializedDistributedManagerWarning(ParallelStateWarning):
    """Raised, as an error (as PhysicsNeMo raises it), by ``DistributedManager()`` before ``initialize()``."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (
            "DistributedManager() was constructed before DistributedManager.initialize(); call "
            "DistributedManager.initialize() (or DistributedManager.setup(...)) once per process first"))


class PhysicsNeMoUndefinedGroupError(ParallelStateError):
    """A named process group or mesh axis asked for before it was created."""

    def __init__(self, name: str, known: Any = ()) -> None:
        super().__init__(f"no process group or mesh axis named {name!r} has been created on this rank (known: "
                         f"{sorted(known)}); create it first (create_process_subgroup, "
                         f"create_orthogonal_process_group, create_groups_from_config or initialize_mesh)")


def _rank_local_device(local_rank: int, backend: str) -> Any:
    """Where this rank computes: ``cuda:local_rank`` wherever CUDA is (whatever the backend), else the CPU."""
    import torch

    if "nccl" in backend.lower():
        return local_cuda_device(local_rank)
    count = _cuda_device_count()
    if count == 0:
        return torch.device("cpu")
    if local_rank < count:
        return torch.device("cuda", local_rank)
    warnings.warn(f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible on this node, so this "
                  f"rank computes on the CPU; start at most {count} process(es) per node to give each its GPU",
                  ParallelStateWarning, stacklevel=4)
    return torch.device("cpu")


def _check_timeout(timeout: Any) -> None:
    if timeout is not None and (not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0):
        raise TypeError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")


def _group_key(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ParallelStateTypeError(f"a process group name must be a non-empty str, got {name!r}")
    return name


class DistributedManager:
    """The launch this process belongs to, shared by every instance (the Borg pattern), PhysicsNeMo's interface.

    Call ``DistributedManager.initialize()`` once per process; it detects torchrun/env, SLURM,
    Open MPI or a single process (in that order; ``PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD``
    forces one), initializes ``torch.distributed`` for a multi-process launch (or adopts an already
    initialized one) and binds the rank-local device. Every ``DistributedManager()`` then sees the
    same state; constructing one before ``initialize()`` raises
    PhysicsNeMoUninitializedDistributedManagerWarning. Meshes and named groups made through it are
    freed by ``cleanup()``.
    """

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __new__(cls) -> DistributedManager:
        obj = super().__new__(cls)
        # Every instance reads and writes the one class-level dict.
        obj.__dict__ = cls._shared_state
        return obj

    def __init__(self) -> None:
        if not self.is_initialized():
            raise PhysicsNeMoUninitializedDistributedManagerWarning()

    # --- starting and stopping -----------------------------------------------------------------

    @classmethod
    def is_initialized(cls) -> bool:
        """Whether ``initialize()`` (or ``setup``) has run, and ``cleanup()`` has not since."""
        return bool(cls._shared_state.get("_is_initialized", False))

    @staticmethod
    def get_available_backend() -> str:
        """"nccl" where CUDA and NCCL are available, else "gloo"."""
        import torch
        import torch.distributed as dist

        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"

    @classmethod
    def initialize(cls, backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
        """Detect the launcher and set up this process; a second call warns and changes nothing.

        ``backend`` (used only to start a multi-process launch) defaults to ``get_available_backend()``;
        ``timeout`` defaults to torch's. ``PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD`` (ENV, SLURM,
        OPENMPI) reads that launcher's variables only. Raises ParallelStateError for an incomplete launcher
        environment, NCCL without CUDA, or a launcher that disagrees with an initialized ``torch.distributed``.
        """
        if cls._already("initialize"):
            return
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise TypeError(f"backend must be a backend name such as 'nccl' or 'gloo', got {backend!r}")
        forced = os.environ.get(METHOD_VARIABLE)
        method = None
        if forced is not None:
            chosen = one_of("DistributedManager.initialize", METHOD_VARIABLE, forced,
                            tuple(m.upper() for m in InitMethod))
            method = InitMethod(chosen.lower())
        info = detect_launch(launcher=None if method is None else method.launcher)
        cls._start(info, backend, timeout, method)

    @classmethod
    def setup(cls, rank: int = 0, world_size: int = 1, local_rank: int | None = None, addr: str = "localhost",
              port: int | str = "12355", backend: str = "nccl", method: str = "env",
              timeout: datetime.timedelta | None = None) -> None:
        """Start ``torch.distributed`` with these values instead of the launcher's (PhysicsNeMo's ``setup``).

        Sets ``MASTER_ADDR`` / ``MASTER_PORT`` as PhysicsNeMo does; ``local_rank`` defaults to ``rank``
        modulo the CUDA devices (``rank`` without CUDA). ``method`` ("env", "slurm", "openmpi") says
        which launcher the values came from. A one-process world is started too.
        """
        if cls._already("setup"):
            return
        world_size = positive_int("world_size", world_size)
        rank = non_negative_int("rank", rank)
        if rank >= world_size:
            raise ParallelStateValueError(f"rank={rank} is outside the world of world_size={world_size} ranks")
        if local_rank is None:
            count = _cuda_device_count()
            local_rank = rank % count if count else rank
        local_rank = non_negative_int("local_rank", local_rank)
        if local_rank > rank:
            raise ParallelStateValueError(f"local_rank={local_rank} must be at most the global rank {rank}")
        if not isinstance(addr, str) or not addr:
            raise ParallelStateTypeError(f"addr must be the rendezvous host name or address, got {addr!r}")
        if not isinstance(backend, str) or not backend:
            raise TypeError(f"backend must be a backend name such as 'nccl' or 'gloo', got {backend!r}")
        _check_timeout(timeout)
        kind = InitMethod(one_of("DistributedManager.setup", "method", method, tuple(InitMethod)))
        env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port)}
        # The launch is read back through the launcher's own checks (a malformed port is named there).
        probe = {**_VALUES_OF[kind](rank, world_size, local_rank), **env}
        info = detect_launch(probe, launcher=kind.launcher)
        check_backend_available(backend)
        os.environ.update(env)
        cls._start(info, backend, timeout, kind)

    @classmethod
    def initialize_env(cls) -> None:
        """Start from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
        cls._start_from(InitMethod.ENV, {})

    @classmethod
    def initialize_slurm(cls, port: int | str) -> None:
        """Start from SLURM's variables, the rendezvous on SLURM_LAUNCH_NODE_IPADDR at ``port``."""
        cls._start_from(InitMethod.SLURM, {"MASTER_PORT": str(port)})

    @classmethod
    def initialize_open_mpi(cls, addr: str, port: int | str) -> None:
        """Start from Open MPI's OMPI_COMM_WORLD_* variables, the rendezvous at ``addr``:``port``."""
        if not isinstance(addr, str) or not addr:
            raise ParallelStateTypeError(f"addr must be the rendezvous host name or address, got {addr!r}")
        cls._start_from(InitMethod.OPENMPI, {"MASTER_ADDR": addr, "MASTER_PORT": str(port)})

    @classmethod
    def _start_from(cls, method: InitMethod, overrides: dict[str, str]) -> None:
        if cls._already(f"initialize via {method}"):
            return
        info = detect_launch({**os.environ, **overrides}, launcher=method.launcher)
        cls._start(info, None, None, method)

    @classmethod
    def _already(cls, what: str) -> bool:
        if cls.is_initialized():
            warnings.warn(f"DistributedManager is already initialized, so {what} changes nothing; call "
                          f"cleanup() first to start over", ParallelStateWarning, stacklevel=3)
        return cls.is_initialized()

    @classmethod
    def _start(cls, info: LaunchInfo, backend: str | None, timeout: datetime.timedelta | None,
               method: InitMethod | None) -> None:
        """Start (or adopt) ``torch.distributed`` for ``info`` and record the launch; nothing is kept on an error."""
        _check_timeout(timeout)
        import torch
        import torch.distributed as dist

        owns = False
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            if info.launcher != "single" and (info.rank, info.world_size) != (rank, world):
                raise ParallelStateError(
                    f"torch.distributed is initialized as rank {rank} of {world}, but the {info.launcher} "
                    f"environment says rank {info.rank} of {info.world_size}; make them agree"
                )
            # Without a launcher's word on it, the ranks are taken to share one host.
            local_rank = info.local_rank if info.launcher != "single" else rank
            backend = str(dist.get_backend())
            distributed = True
        elif info.launcher == "single":
            rank, world, local_rank, distributed, backend = 0, 1, 0, False, None
        else:
            rank, world, local_rank, distributed = info.rank, info.world_size, info.local_rank, True
            if backend is None:
                backend = cls.get_available_backend()
            check_backend_available(backend)

        if backend is None:  # no process group, so no backend: a single process computes where it can
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
            collective = device
        else:
            device = _rank_local_device(local_rank, backend)
            collective = device if "nccl" in backend.lower() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if distributed and not dist.is_initialized():
            kwargs: dict[str, Any] = {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            if collective.type == "cuda":
                kwargs["device_id"] = collective  # torch refuses a CPU device_id; gloo needs none
            dist.init_process_group(backend, init_method=info.init_method, rank=rank, world_size=world, **kwargs)
            owns = True
        cls._shared_state.update(
            _rank=rank, _world_size=world, _local_rank=local_rank, _device=device, _collective_device=collective,
            _cuda=torch.cuda.is_available(), _distributed=distributed, _backend=backend, _launch=info,
            _method=method or next((m for m in InitMethod if m.launcher == info.launcher), None),
            _owns_process_group=owns, _timeout=timeout or DEFAULT_TIMEOUT,
            _groups={}, _group_ranks={}, _group_names={}, _group_size={}, _group_rank={}, _named_created=[],
            _global_mesh=None, _mesh_dims={}, _meshes=[], _mesh_groups={}, _mesh_groups_created=[],
            _is_initialized=True,
        )

    @classmethod
    def cleanup(cls, barrier: bool = True) -> None:
        """Free the meshes and named groups made here and forget the launch; if ``initialize()`` started
        torch.distributed, tear it down too (after a barrier unless ``barrier`` is False).

        The model-parallel groups go too (they live on the default group); a process group
        that was already initialized when ``initialize()`` ran is left to its owner.
        """
        state = cls._shared_state
        try:
            if state.get("_is_initialized"):
                from parallel_state.groups.create import destroy_groups

                cls._free_meshes()
                state["_groups"].clear()
                state["_group_names"].clear()
                destroy_groups(state["_named_created"])
            if state.get("_owns_process_group"):
                import torch.distributed as dist

                if dist.is_initialized():
                    # The state's teardown (what destroy_model_parallel runs): the manager sits
                    # below initialize, which reaches it through the memory buffer's device.
                    from parallel_state.groups.state import teardown

                    teardown()
                    try:
                        device = state["_collective_device"]
                        if barrier:
                            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
                    finally:
                        dist.destroy_process_group()
        finally:
            state.clear()

    @classmethod
    def _free_meshes(cls, borrowing_from: Any = None) -> None:
        """Kill the meshes handed out here and free the groups made for them: all of them (and the groups made for
        ``get_mesh_group``), or only those that use the model-parallel groups of ``borrowing_from``."""
        state = cls._shared_state
        if not state.get("_meshes") and not state.get("_mesh_groups_created"):
            return
        from parallel_state.groups.create import destroy_groups
        from parallel_state.runtime.mesh import retire

        doomed = [m for m in state["_meshes"] if borrowing_from is None or m.owner is borrowing_from]
        state["_meshes"] = [m for m in state["_meshes"] if m not in doomed]
        groups = [pg for m in doomed for pg in m.created]
        for m in doomed:
            groups.extend(retire([m.mesh], m.borrowed))
        if any(m.mesh is state["_global_mesh"] for m in doomed):
            state.update(_global_mesh=None, _mesh_dims={})
        # A cached group may be a model-parallel one; groups made here stay listed until cleanup() frees them.
        state["_mesh_groups"] = {}
        if borrowing_from is None:
            groups.extend(state["_mesh_groups_created"])
            state["_mesh_groups_created"] = []
        destroy_groups(groups)

    # --- properties --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.__dict__.get("_rank", 0)

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.__dict__.get("_world_size", 1)

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.__dict__.get("_local_rank", 0)

    @property
    def device(self) -> Any:
        """Where this rank computes: ``cuda:local_rank`` where CUDA is available (whatever the backend), else the
        CPU. Collectives run on ``parallel_state.collective_device()``, the CPU under gloo."""
        device = self.__dict__.get("_device")
        if device is None:  # an instance kept across cleanup()
            import torch

            device = torch.device("cpu")
        return device

    @property
    def distributed(self) -> bool:
        """Whether this process is part of a torch.distributed job."""
        return self.__dict__.get("_distributed", False)

    @property
    def cuda(self) -> bool:
        """``torch.cuda.is_available()`` when the manager was initialized."""
        return self.__dict__.get("_cuda", False)

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend, or None for a single process."""
        return self.__dict__.get("_backend")

    @property
    def launch(self) -> LaunchInfo:
        """What the launcher's environment (or ``setup``'s arguments) said."""
        return self.__dict__.get("_launch") or LaunchInfo("single", 0, 1, 0)

    @property
    def broadcast_buffers(self) -> bool:
        """``broadcast_buffers`` for the DDP wrappers that read it (default False)."""
        return self.__dict__.get("_broadcast_buffers", False)

    @broadcast_buffers.setter
    def broadcast_buffers(self, broadcast: bool) -> None:
        self.__dict__["_broadcast_buffers"] = broadcast

    @property
    def find_unused_parameters(self) -> bool:
        """``find_unused_parameters`` for the DDP wrappers that read it (default False; setting True warns)."""
        return self.__dict__.get("_find_unused_parameters", False)

    @find_unused_parameters.setter
    def find_unused_parameters(self, find_params: bool) -> None:
        if find_params:
            warnings.warn("find_unused_parameters=True makes DDP walk the autograd graph every step; set it only "
                          "when some parameters get no gradient", ParallelStateWarning, stacklevel=2)
        self.__dict__["_find_unused_parameters"] = find_params

    def _require_distributed(self, what: str) -> None:
        if not self.distributed:
            raise ParallelStateAssertionError(
                f"DistributedManager.{what} needs a distributed run, but this process runs alone (no launcher "
                f"environment was found); start it under torchrun, srun or mpirun, or call "
                f"DistributedManager.setup(...)")

    # --- meshes ------------------------------------------------------------------------------

    def initialize_mesh(self, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> DeviceMesh:
        """The global DeviceMesh over every rank, row-major (``init_device_mesh``'s layout); one size may be -1.

        Collective over the world. A dimension whose ranks are those of a live model-parallel group (or
        of the whole world) uses that very group; the others get groups of their own, freed by ``cleanup()``.
        The mesh becomes ``global_mesh``; an earlier one stays usable until ``cleanup()``.
        """
        from parallel_state.runtime.mesh import world_mesh

        self._require_distributed("initialize_mesh")
        shape, names = _mesh_spec(mesh_shape, mesh_dim_names, self.world_size)
        mesh, created, borrowed = world_mesh(shape, names, self.device.type, self.__dict__["_timeout"])
        state = self.__dict__
        live = _st.peek()
        uses_live = live is not None and any(pg.group_name in borrowed for pg in live.groups.values() if pg is not None)
        state["_meshes"].append(_HandedMesh(mesh, created, borrowed, live if uses_live else None))
        state.update(_global_mesh=mesh, _mesh_dims=dict(zip(names, shape, strict=True)))
        return mesh

    @property
    def global_mesh(self) -> DeviceMesh:
        """The global mesh; a flat ("world",) mesh over every rank is made on first use if none was."""
        if self.__dict__.get("_global_mesh") is None:
            self.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("world",))
        return self.__dict__["_global_mesh"]

    @property
    def mesh_dims(self) -> dict[str, int]:
        """The global mesh's dimensions: name -> size (empty before ``initialize_mesh``)."""
        return self.__dict__.get("_mesh_dims", {})

    def mesh_names(self) -> Any:
        """The global mesh's dimension names."""
        return self.mesh_dims.keys()

    def mesh_sizes(self) -> Any:
        """The global mesh's dimension sizes."""
        return self.mesh_dims.values()

    def mesh(self, name: str | None = None) -> DeviceMesh:
        """The global mesh (``name`` None) or its 1-D sub-mesh ``name``; it does not make a mesh."""
        mesh = self.__dict__.get("_global_mesh")
        if mesh is None:
            raise ParallelStateAssertionError("DistributedManager.mesh: no mesh has been made; call "
                                              "initialize_mesh(mesh_shape, mesh_dim_names) first")
        if name is None:
            return mesh
        if name not in self.mesh_dims:
            raise PhysicsNeMoUndefinedGroupError(name, self.mesh_dims)
        return mesh[name]

    def get_mesh_group(self, mesh: DeviceMesh) -> Any:
        """One process group over every rank of ``mesh`` (cached): a 1-D mesh's own group, else a group over
        the flattened mesh, made by its members only (every member calls this) unless a live group holds them."""
        from parallel_state.runtime.mesh import flat_group

        key = hash(mesh)
        state = self.__dict__
        group = state["_mesh_groups"].get(key)
        if group is not None:
            return group
        if mesh.ndim == 1:
            group = mesh.get_group()
        else:
            ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
            if self.rank not in ranks:
                raise ParallelStateValueError(f"DistributedManager.get_mesh_group: rank {self.rank} is not in this "
                                              f"mesh (ranks {list(ranks)}); only its members may ask for its group")
            group, new = flat_group(ranks, state["_timeout"])
            if new:
                state["_mesh_groups_created"].append(group)
        state["_mesh_groups"][key] = group
        return group

    # --- named groups ------------------------------------------------------------------------

    @property
    def group_names(self) -> Any:
        """The names of the named groups this rank belongs to."""
        return self.__dict__.get("_groups", {}).keys()

    def group(self, name: str | None = None) -> Any:
        """The named group ``name`` this rank belongs to; None (the default group) for ``name`` None."""
        if name is None:
            return None
        groups = self.__dict__.get("_groups", {})
        if name not in groups:
            raise PhysicsNeMoUndefinedGroupError(name, groups)
        return groups[name]

    def group_size(self, name: str | None = None) -> int:
        """The size of the named group ``name`` (the world's for None)."""
        if name is None:
            return self.world_size
        self.group(name)
        return self.__dict__["_group_size"][name]

    def group_rank(self, name: str | None = None) -> int:
        """This rank's rank in the named group ``name`` (the global rank for None)."""
        if name is None:
            return self.rank
        self.group(name)
        return self.__dict__["_group_rank"][name]

    def group_name(self, group: Any = None) -> str | None:
        """The name of a group made here (None for None)."""
        if group is None:
            return None
        names = self.__dict__.get("_group_names", {})
        if group not in names:
            raise ParallelStateValueError(f"DistributedManager.group_name: {group!r} is not a named group of this "
                                          f"manager (its groups: {sorted(self.group_names)})")
        return names[group]

    @staticmethod
    def create_process_subgroup(name: str, size: int, group_name: str | None = None, verbose: bool = False) -> None:
        """Split each group of ``group_name`` (the world for None) into consecutive blocks of ``size`` ranks, all
        named ``name``; this rank keeps its own. Collective over the world."""
        manager = DistributedManager()
        manager._require_distributed("create_process_subgroup")
        _group_key(name)
        size = positive_int("size", size)
        if name in manager.group_names:
            raise ParallelStateAssertionError(f"a group named {name!r} already exists; pick another name, or "
                                              f"cleanup() to start over")
        if group_name is None:
            parents = [tuple(range(manager.world_size))]
        else:
            manager.group(group_name)
            parents = manager.__dict__["_group_ranks"][group_name]
        parent_size = len(parents[0])
        if parent_size % size:
            raise ParallelStateAssertionError(
                f"cannot divide group size {parent_size} ({group_name or 'the world'}) evenly into subgroups of "
                f"size {size}; pass one of {[d for d in range(1, parent_size + 1) if parent_size % d == 0]}")
        manager._make_named("create_process_subgroup", name, blocks(parents, size),
                            {"name": name, "size": size, "group_name": group_name}, verbose)

    @staticmethod
    def create_orthogonal_process_group(orthogonal_group_name: str, group_name: str, verbose: bool = False) -> None:
        """Name ``orthogonal_group_name`` the groups that join the ranks at each position of ``group_name``'s
        groups. Collective over the world."""
        manager = DistributedManager()
        manager._require_distributed("create_orthogonal_process_group")
        _group_key(orthogonal_group_name)
        if group_name not in manager.group_names:
            raise ParallelStateValueError(f"no group named {group_name!r} exists (known: {sorted(manager.group_names)});"
                                          f" create it with create_process_subgroup first")
        if orthogonal_group_name in manager.group_names:
            raise ParallelStateValueError(f"a group named {orthogonal_group_name!r} already exists; pick another "
                                          f"name, or cleanup() to start over")
        manager._make_named("create_orthogonal_process_group", orthogonal_group_name,
                            transpose(manager.__dict__["_group_ranks"][group_name]),
                            {"name": orthogonal_group_name, "group_name": group_name}, verbose)

    @staticmethod
    def create_group_from_node(node: Any, parent: str | None = None, verbose: bool = False) -> str:
        """Make ``node``'s group under ``parent`` and the group orthogonal to it; return the latter's name."""
        if node.size is None:
            raise ParallelStateAssertionError(
                f"process group {node.name!r} has no size; call config.set_leaf_group_sizes(...) (with "
                f"update_parent_sizes=True) before creating groups from it")
        DistributedManager.create_process_subgroup(node.name, node.size, group_name=parent, verbose=verbose)
        orthogonal = orthogonal_name(node.name)
        DistributedManager.create_orthogonal_process_group(orthogonal, node.name, verbose=verbose)
        return orthogonal

    @staticmethod
    def create_groups_from_config(config: Any, verbose: bool = False) -> None:
        """Make every group of a ``ProcessGroupConfig`` (this package's or PhysicsNeMo's): the root over the
        world, then breadth first, each child out of the groups orthogonal to its previous sibling."""
        for node, parent in creation_order(config):
            DistributedManager.create_group_from_node(node, parent=parent, verbose=verbose)

    def _make_named(self, what: str, name: str, groups: list[tuple[int, ...]], config: dict[str, Any],
                    verbose: bool) -> None:
        import torch.distributed as dist

        from parallel_state.runtime.subgroups import build_groups, partition_wanted

        made, created = build_groups(f"DistributedManager.{what}", config, {name: partition_wanted(groups, self.rank)},
                                     timeout=self.__dict__["_timeout"], reuse=lambda ranks, sort: None)
        group = made[name]
        state = self.__dict__
        state["_named_created"].extend(created)
        state["_groups"][name] = group
        state["_group_ranks"][name] = groups
        state["_group_names"][group] = name
        state["_group_size"][name] = dist.get_world_size(group)
        state["_group_rank"][name] = dist.get_rank(group)
        if verbose and self.rank == 0:
            print(f"Process group '{name}':\n" + "\n".join(f"     {list(g)}" for g in groups), flush=True)

    def __str__(self) -> str:
        method = self.__dict__.get("_method")
        return (f"Initialized process {self.rank} of {self.world_size} using method "
                f"'{method if method is not None else 'None'}'. Device set to {self.device}")

    def __repr__(self) -> str:
        return (f"DistributedManager(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"device={self.__dict__.get('_device')}, distributed={self.distributed}, "
                f"launcher={self.launch.launcher!r})")


#: method -> the launcher variables ``setup``'s values stand for (read back through ``detect_launch``'s checks).
_VALUES_OF = {
    InitMethod.ENV: lambda r, w, lr: {"RANK": str(r), "WORLD_SIZE": str(w), "LOCAL_RANK": str(lr)},
    InitMethod.SLURM: lambda r, w, lr: {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(w), "SLURM_LOCALID": str(lr)},
    InitMethod.OPENMPI: lambda r, w, lr: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(w),
                                          "OMPI_COMM_WORLD_LOCAL_RANK": str(lr)},
}


def _mesh_spec(mesh_shape: Any, mesh_dim_names: Any, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh's sizes (a -1 resolved) and names, checked as PhysicsNeMo checks them."""
    shape, names = tuple(mesh_shape), tuple(mesh_dim_names)
    if not shape:
        raise ParallelStateError("initialize_mesh needs at least one mesh dimension in mesh_shape, e.g. (-1,)")
    if len(shape) != len(names):
        raise ParallelStateError(f"mesh_shape and mesh_dim_names must have the same length, but found "
                                 f"{len(shape)} and {len(names)} respectively; name every dimension once")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ParallelStateError(f"mesh dimension names must be unique non-empty strs, got {names!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1) for s in shape) \
            or shape.count(-1) > 1:
        raise ParallelStateError(f"mesh_shape={shape!r}: each size must be an int >= 1, and at most one -1 "
                                 f"(the size that makes the product the world size {world})")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if world % known:
            raise ParallelStateError(f"mesh_shape={shape!r}: the other sizes multiply to {known}, which does not "
                                     f"divide the world size {world}, so no size fits the -1")
        shape = tuple(world // known if s == -1 else s for s in shape)
    if math.prod(shape) != world:
        raise ParallelStateError(f"the device mesh's sizes {shape!r} multiply to {math.prod(shape)} but the world "
                                 f"has {world} ranks; make their product {world}, or put -1 for one size")
    return shape, names


def _model_parallel_torn_down() -> None:
    """Teardown hook: a manager mesh that uses the model-parallel groups dies with them."""
    owners = {id(m.owner): m.owner for m in DistributedManager._shared_state.get("_meshes", ()) if m.owner is not None}
    for owner in owners.values():
        DistributedManager._free_meshes(borrowing_from=owner)


_st.register_teardown_hook(_model_parallel_torn_down)
