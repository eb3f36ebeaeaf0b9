"""megatron-core 0.16's ``create_group``, ``update_pg_timeout`` and ``is_torch_min_version``; ``group_timeout``.

``create_group`` is megatron-core's all-ranks path: every rank calls it for every group, and
it records the caller's groups in a process-group list that ``update_pg_timeout`` walks. A
non-member skips ``torch.distributed.new_group`` where that is safe (see ``_may_skip``) and
only moves torch's group counter, which names the next group, exactly as the call would.
The core registers the groups it builds itself with ``register_process_groups`` and empties
the list on destroy with ``clear_process_groups``.

Nothing here imports torch until a function is called.
"""

from __future__ import annotations

import datetime
import operator
import os
from typing import Any, Iterable, Sequence

from parallel_state.errors import ParallelStateError, ParallelStateTypeError, ParallelStateValueError
from parallel_state.topology.arguments import flag, is_int, optional_str, positive_timedelta

#: The groups ``update_pg_timeout`` updates when given no group; None stands for the default
#: group (megatron-core's ``_global_process_group_list``, which also starts with None).
_PROCESS_GROUPS: list[Any] = [None]


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ParallelStateError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group (or "
            "parallel_state.dist_init) first"
        )
    return dist


def _optional_timeout(timeout: object) -> datetime.timedelta | None:
    return None if timeout is None else positive_timedelta("timeout", timeout)


def group_members(ranks: object, world_size: int) -> list[int]:
    """``ranks`` as distinct global ranks of a world of ``world_size``, or the error naming what is wrong."""
    if isinstance(ranks, (str, bytes)) or not (isinstance(ranks, Sequence) or hasattr(ranks, "tolist")):
        raise ParallelStateTypeError(f"ranks must be a list of global ranks or None (the whole world), got {ranks!r}")
    values = ranks.tolist() if hasattr(ranks, "tolist") else list(ranks)
    for r in values:
        if not is_int(r):
            raise ParallelStateTypeError(f"ranks must hold ints (global ranks), got {r!r} in {values!r}")
    members = [operator.index(r) for r in values]
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise ParallelStateValueError(f"ranks {bad} are outside the world of {world_size} ranks (ranks {members})")
    if len(set(members)) != len(members):
        raise ParallelStateValueError(f"ranks {members} repeat a rank; name each rank once")
    return members


def _may_skip(dist: Any, use_local_synchronization: bool) -> bool:
    """Whether a non-member may skip ``new_group`` and only advance the group counter.

    For a non-member, ``new_group`` validates its arguments (done here too), takes the next
    counter value as the group's name and returns NON_GROUP_MEMBER; it does more only when
    (a) TORCH_DIST_INIT_BARRIER=1: a store barrier over the whole world, which non-members
    join; (b) the default group is bound to a device (eager NCCL): the new communicator is
    split from the default one, collectively over all ranks; (c) the default group is a
    custom one that creates subgroups itself. With local synchronization torch already
    returns early, without counting.
    """
    if use_local_synchronization or os.environ.get("TORCH_DIST_INIT_BARRIER", "0").strip() == "1":
        return False
    default = dist.group.WORLD
    return getattr(default, "bound_device_id", None) is None and not callable(getattr(default, "new_group", None))


def create_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> Any:
    """Create a process group of ``ranks`` (None: the whole world); every rank calls it for every group.

    A member gets the group and has it recorded for :func:`update_pg_timeout`; a non-member
    gets ``torch.distributed.GroupMember.NON_GROUP_MEMBER`` (None with
    ``use_local_synchronization=True``), as from ``torch.distributed.new_group``.
    """
    dist = _dist()
    me = dist.get_rank()
    members = None if ranks is None else group_members(ranks, dist.get_world_size())
    timeout = _optional_timeout(timeout)
    backend = optional_str("backend", backend, "gloo")
    local = flag("use_local_synchronization", use_local_synchronization)
    group_desc = optional_str("group_desc", group_desc, "TENSOR_MODEL_PARALLEL_GROUP")
    member = members is None or me in members
    if not member and _may_skip(dist, local):
        # What new_group would do here: take the next name, so every rank names later groups alike.
        dist.distributed_c10d._world.group_count += 1
        return dist.GroupMember.NON_GROUP_MEMBER
    # torch >= 2.4 (this package's floor) takes group_desc and timeout=None, so no version switch.
    group = dist.new_group(ranks=members, timeout=timeout, backend=backend, pg_options=pg_options,
                           use_local_synchronization=local, group_desc=group_desc)
    if member:
        _PROCESS_GROUPS.append(group)
    return group


def process_groups() -> list[Any]:
    """The groups :func:`update_pg_timeout` updates by default (a copy); None stands for the default group."""
    return list(_PROCESS_GROUPS)


def register_process_groups(groups: Iterable[Any]) -> None:
    """Add groups built elsewhere (by the core) to the list; non-member placeholders and repeats are skipped."""
    import torch.distributed as dist

    known = {id(g) for g in _PROCESS_GROUPS}
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or id(group) in known:
            continue
        if not isinstance(group, dist.ProcessGroup):
            raise ParallelStateTypeError(f"register_process_groups takes process groups, got {group!r}")
        known.add(id(group))
        _PROCESS_GROUPS.append(group)


def clear_process_groups() -> None:
    """Forget every recorded group (on destroy); the default group stays."""
    _PROCESS_GROUPS[:] = [None]


def update_pg_timeout(timeout: datetime.timedelta, pg: Any = None, *, include_world: bool = False) -> None:
    """Set the timeout of ``pg`` alone, or (``pg=None``) of every recorded group, after a barrier.

    The default (WORLD) group changes only when it is ``pg`` or ``include_world=True``: unlike
    megatron-core, a call meant for the model-parallel groups leaves the job's own group alone.
    Every member of ``pg`` (every rank, when ``pg`` is None) must call it: it first waits at a
    barrier on ``pg``, and synchronizes CUDA when this process uses it, so no operation in
    flight runs under a changed timeout.
    """
    positive_timedelta("timeout", timeout)
    include_world = flag("include_world", include_world)
    dist = _dist()
    c10d = dist.distributed_c10d
    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        raise ParallelStateError(
            "this torch build cannot change a process group's timeout (no "
            "torch.distributed.distributed_c10d._set_pg_timeout); create the groups with the timeout you need"
        )
    if pg is not None:
        if not isinstance(pg, dist.ProcessGroup):
            raise ParallelStateTypeError(f"pg must be a process group or None (every recorded group), got {pg!r}")
        if pg not in c10d._world.pg_map:
            raise ParallelStateError(f"pg {pg!r} was destroyed or is not a group of this process; pass a live group")
    dist.barrier(group=pg)
    import torch

    # Only a process that has touched CUDA can have work in flight; initializing CUDA here would not help.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    # A group destroyed since it was recorded has no timeout left to change.
    targets = [pg] if pg is not None else [g for g in _PROCESS_GROUPS
                                           if (g is None and include_world) or g in c10d._world.pg_map]
    for group in targets:
        try:
            set_timeout(timeout, group)
        except Exception as exc:
            name = "the default group" if group is None else f"group {c10d._world.pg_names.get(group, group)!r}"
            raise ParallelStateError(f"could not set the timeout of {name} to {timeout}: {exc}") from exc


def group_timeout(pg: Any = None) -> datetime.timedelta:
    """The timeout ``pg``'s collectives run under (the default group's when None); 30 minutes, megatron-core's
    default, where its backend keeps none."""
    import torch

    dist = _dist()
    group = dist.group.WORLD if pg is None else pg
    # torch has no public getter: the backend's options hold it (groups.create lists this internal).
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):  # no backend for that device, or one without options
            continue
    from parallel_state.groups.consistency import DEFAULT_TIMEOUT

    return DEFAULT_TIMEOUT


_TORCH_VERSION: Any = None


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether the installed torch is at least ``version`` (strictly newer when ``check_equality`` is False)."""
    global _TORCH_VERSION
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError as exc:
        raise ImportError("is_torch_min_version needs the 'packaging' package: pip install packaging") from exc
    if not isinstance(version, str):
        raise ParallelStateTypeError(f"version must be a str such as '2.4.0', got {version!r}")
    try:
        wanted = Version(version)
    except InvalidVersion as exc:
        raise ParallelStateValueError(f"version {version!r} is not a version number such as '2.4.0'") from exc
    if _TORCH_VERSION is None:
        import torch

        _TORCH_VERSION = Version(torch.__version__)
    return _TORCH_VERSION >= wanted if flag("check_equality", check_equality) else _TORCH_VERSION > wanted
