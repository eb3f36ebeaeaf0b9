"""Which launcher started this process, read from the environment alone.

Launchers are tried in a fixed order: torchrun (or any ``env://`` launcher), SLURM's ``srun``,
Open MPI's ``mpirun``; with none of them named, the process is a single process. A launcher is
*named* by any of its marker variables; once named, every variable it needs must be present:
a half-set environment is an error listing what is missing, never a silent single process.
Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from parallel_state.errors import ParallelStateError

#: The port used by SLURM and Open MPI launches when ``MASTER_PORT`` is not set (PhysicsNeMo's).
DEFAULT_MASTER_PORT = 12355


@dataclass(frozen=True)
class _Launcher:
    name: str
    #: Any of these present names the launcher.
    markers: tuple[str, ...]
    #: field -> the variables that can supply it, first present wins.
    fields: dict[str, tuple[str, ...]]
    #: Whether MASTER_PORT must be set (torchrun always sets it) or may default.
    port_required: bool


LAUNCHERS: tuple[_Launcher, ...] = (
    _Launcher("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
              {"rank": ("RANK",), "world_size": ("WORLD_SIZE",), "local_rank": ("LOCAL_RANK",),
               "master_addr": ("MASTER_ADDR",), "master_port": ("MASTER_PORT",)}, True),
    _Launcher("slurm", ("SLURM_PROCID",),
              {"rank": ("SLURM_PROCID",), "world_size": ("SLURM_NTASKS", "SLURM_NPROCS"),
               "local_rank": ("SLURM_LOCALID",), "master_addr": ("SLURM_LAUNCH_NODE_IPADDR", "MASTER_ADDR"),
               "master_port": ("MASTER_PORT",)}, False),
    _Launcher("openmpi", ("OMPI_COMM_WORLD_RANK",),
              {"rank": ("OMPI_COMM_WORLD_RANK",), "world_size": ("OMPI_COMM_WORLD_SIZE",),
               "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",), "master_addr": ("MASTER_ADDR",),
               "master_port": ("MASTER_PORT",)}, False),
)


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process: its ranks and where the rendezvous is."""

    launcher: str  # "torchrun", "slurm", "openmpi" or "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def init_method(self) -> str | None:
        """The ``init_process_group`` URL: ``env://`` under torchrun, ``tcp://addr:port`` otherwise."""
        if self.launcher == "single":
            return None
        if self.launcher == "torchrun":
            # env:// lets torch join torchrun's agent store instead of opening its own.
            return "env://"
        host = f"[{self.master_addr}]" if ":" in str(self.master_addr) else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def named_launcher(environ: Mapping[str, str] | None = None) -> _Launcher | None:
    """The first launcher, in detection order, whose marker variables appear in the environment."""
    env = os.environ if environ is None else environ
    return next((launcher for launcher in LAUNCHERS if any(m in env for m in launcher.markers)), None)


def _int_var(env: Mapping[str, str], var: str) -> int:
    raw = env[var]
    try:
        return int(raw.strip())
    except ValueError:
        raise ParallelStateError(f"environment variable {var}={raw!r} is not an integer; fix or unset it") from None


def read_launcher_int(launcher: _Launcher, field: str, environ: Mapping[str, str] | None = None) -> int:
    """One integer field (``rank``, ``world_size``, ``local_rank``) of a named launcher."""
    env = os.environ if environ is None else environ
    names = launcher.fields[field]
    var = next((v for v in names if v in env), None)
    if var is None:
        present = [m for m in launcher.markers if m in env]
        raise ParallelStateError(
            f"the environment names a {launcher.name} launch ({', '.join(present)} set) but lacks "
            f"{' or '.join(names)}; set it, or unset {', '.join(present)} to run as a single process"
        )
    return _int_var(env, var)


def detect_launch(environ: Mapping[str, str] | None = None, launcher: str | None = None) -> LaunchInfo:
    """Detect the launcher from the environment (torchrun, SLURM, Open MPI, else single process).

    ``launcher`` (one of :data:`LAUNCHERS`' names) reads that launcher's variables only, whatever else is set.
    Raises ParallelStateError listing every missing variable when a launcher is named but its
    environment is incomplete, and when a value is malformed or out of range.
    """
    env = os.environ if environ is None else environ
    if launcher is None:
        chosen = named_launcher(env)
        if chosen is None:
            return LaunchInfo("single", 0, 1, 0)
    else:
        chosen = next((known for known in LAUNCHERS if known.name == launcher), None)
        if chosen is None:
            raise ParallelStateError(f"unknown launcher {launcher!r}; known: {[known.name for known in LAUNCHERS]}")
        if not any(m in env for m in chosen.markers):
            raise ParallelStateError(
                f"a {launcher} launch was asked for, but none of {', '.join(chosen.markers)} is set in the "
                f"environment; start the processes with {launcher}, or use DistributedManager.initialize() to "
                f"detect the launcher"
            )
    return _read_launch(env, chosen)


def _read_launch(env: Mapping[str, str], launcher: _Launcher) -> LaunchInfo:
    """The named ``launcher``'s ranks and rendezvous, every variable checked."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for field, names in launcher.fields.items():
        var = next((v for v in names if v in env), None)
        if var is not None:
            found[field] = var
        elif field == "master_port" and not launcher.port_required:
            continue
        elif field == "master_addr" and launcher.name == "openmpi" and _one_node_mpi(env):
            continue
        else:
            missing.append(" or ".join(names))
    if missing:
        present = [m for m in launcher.markers if m in env]
        raise ParallelStateError(
            f"the environment names a {launcher.name} launch ({', '.join(present)} set) but is "
            f"missing: {', '.join(missing)}; set them, or unset {', '.join(present)} to run as a "
            f"single process"
        )
    rank, world, local = (_int_var(env, found[f]) for f in ("rank", "world_size", "local_rank"))
    if world < 1:
        raise ParallelStateError(f"{found['world_size']}={world}: the world size must be >= 1")
    if not 0 <= rank < world:
        raise ParallelStateError(
            f"{found['rank']}={rank} is outside the world of {found['world_size']}={world} ranks"
        )
    if not 0 <= local <= rank:
        raise ParallelStateError(
            f"{found['local_rank']}={local} must be between 0 and the global rank {found['rank']}={rank}"
        )
    addr = env[found["master_addr"]].strip() if "master_addr" in found else "127.0.0.1"
    if not addr:
        raise ParallelStateError(f"{found['master_addr']} is empty; set it to the rendezvous host")
    port = _int_var(env, found["master_port"]) if "master_port" in found else DEFAULT_MASTER_PORT
    if not 0 < port < 65536:
        raise ParallelStateError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return LaunchInfo(launcher.name, rank, world, local, addr, port)


def _one_node_mpi(env: Mapping[str, str]) -> bool:
    """Whether every Open MPI rank runs on this node, so the rendezvous can be the loopback address."""
    size, local = env.get("OMPI_COMM_WORLD_SIZE"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    return size is not None and local is not None and size.strip() == local.strip()
