"""``initialize_model_parallel`` and ``destroy_model_parallel`` with megatron-core's signature."""

from __future__ import annotations

import datetime
from typing import Any

from parallel_state.errors import ParallelStateAssertionError, ParallelStateError, ParallelStateTypeError
from parallel_state.groups import state as _st
from parallel_state.groups.nccl import NcclSettings
from parallel_state.groups.options import BuildOptions
from parallel_state.topology.init_arguments import LOCAL, InitArguments
from parallel_state.topology.kinds import DP_CP_AG, EDP_AG, EMBD, POS_EMBD
from parallel_state.topology.plan import TopologyPlan

#: ``initialize_model_parallel``'s docstring, whichever release's def is the one in use. Its defs, one per
#: distinct parameter list of the releases (the release in use's, then every other release's, the MAGI-1 /
#: WorldFoundry aliases and parallel_state's own, keyword-only: ``InitArguments``' fields), are generated:
#: ``generated_initialize``; each hands its arguments to :func:`initialize`.
DOC = """Build this rank's model-parallel groups, laid out exactly as megatron-core lays them out.

    Takes the keywords of every megatron-core release from 0.16 to 0.19, and its positional
    arguments in the order of the release in use (``parallel_state.megatron_release()``: the
    installed megatron-core's, 0.16's when none is installed); the signature shows that release's.
    ``tp_size``/``cp_size``/``pp_size`` are the MAGI-1 / WorldFoundry spellings, ``timeout`` sets
    the groups' timeout more finely than ``distributed_timeout_minutes``. ``check_consistency``
    compares every rank's arguments before any group is built and confirms every rank built its
    groups afterwards (a round through the default store each, bounded by the timeout), so that all
    ranks keep the groups or none does. Each rank creates only the groups it is in; on any error
    nothing is left behind. ``ranks`` (global ranks holding this one) builds the topology over that
    subset of the world alone: sizes, layout and accessors refer to it, and only its ranks take
    part, so disjoint subsets initialize, run and destroy side by side. megatron-core 0.17's
    ``rank_offset`` / ``local_world_size`` spell the subset ``range(rank_offset, rank_offset +
    local_world_size)``; as in megatron-core, every rank may call it, and on a rank outside that
    range it builds nothing.
"""

def initialize(args: InitArguments) -> None:
    """Build the groups ``args`` describe: what every generated ``initialize_model_parallel`` def calls."""
    import torch.distributed as dist

    from parallel_state.topology import arguments as a

    check_consistency = a.flag("check_consistency", args.check_consistency)
    timeout = args.groups_timeout()
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelStateAssertionError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
            "(or parallel_state.dist_init) before initialize_model_parallel"
        )
    members = _members(args)
    if members == ():
        # rank_offset / local_world_size leave this rank out: megatron-core builds it no group, and
        # sets its global memory buffer all the same.
        _set_memory_buffer()
        return
    if _st.peek() is not None:
        raise ParallelStateAssertionError(
            "model-parallel groups are already initialized; call "
            "parallel_state.destroy_model_parallel() before initializing again"
        )
    from parallel_state.megatron.bridge import megatron_clash

    # Checked before any group exists; it joins the consistency check so no rank is left waiting.
    clash = megatron_clash()
    from parallel_state.groups import group_cache

    config = {**args.comparable(), "megatron_holds_own_groups": clash is not None, "group_cache": group_cache.enabled()}
    cache_key = _cache_key(config, members) if group_cache.enabled() else None  # only the cache needs it
    config = {k: v for k, v in config.items() if k not in LOCAL}
    caches_agree = None  # unknown: the build compares the caches itself
    if check_consistency:
        from parallel_state.groups.consistency import check_same_everywhere

        # Compared before any local validation, so a rank with a bad argument is named on every
        # rank instead of failing alone and leaving the others waiting. The cached topologies
        # ride along (one round for both); where only they differ, the caches are emptied.
        extra = {"cached_topologies": group_cache.fingerprint()} if group_cache.enabled() else {}
        caches_agree = check_same_everywhere("initialize_model_parallel", {**config, **extra}, timeout=timeout,
                                             members=members, tolerate=tuple(extra))
    if clash is not None:
        raise ParallelStateError(clash)

    try:
        args = args.validated()
        plan = _planned(args, members)
        priority = args.high_priority_stream_groups
        options = BuildOptions(
            timeout=timeout, gloo=args.create_gloo_process_groups,
            pipeline_backend=args.pipeline_model_parallel_comm_backend,
            nccl=NcclSettings.load(args.nccl_communicator_config_path, None if priority is None else list(priority)),
            virtual_pipeline_size=args.virtual_pipeline_model_parallel_size, sharp_kind=args.sharp_kind(),
            cache_key=cache_key, caches_agree=caches_agree)
        state = _st.build(plan, options)
    except Exception as exc:
        # Ranks that agreed on the arguments fail alike here, unless their environments
        # differ (a missing file, a backend one node lacks): either way, tell the others, so
        # that none waits for a rank that has given up.
        if check_consistency:
            _confirm(exc, timeout, members)
        raise
    try:
        if check_consistency and not state.from_cache:
            # Every rank returns only once every rank has built its groups: all or none keep
            # them, and no rank can destroy a group a peer is still connecting to. (A topology
            # taken whole from the cache was taken on every rank alike: nothing can have failed.)
            _confirm(None, timeout, members)
        _set_companions()
        _bridge_if_megatron_loaded()
    except BaseException:
        _st.teardown()  # nothing half-built
        raise


def _planned(args: InitArguments, members: tuple[int, ...] | None) -> TopologyPlan:
    """The plan of validated ``args``, after the checks that need this process."""
    import torch.distributed as dist

    backend = args.pipeline_model_parallel_comm_backend
    if backend is not None and not dist.is_backend_available(backend):
        raise ParallelStateError(
            f"pipeline_model_parallel_comm_backend={backend!r} is not available in this torch build; "
            f"use None (the default group's backend) or one this build has"
        )
    plan = args.plan(dist.get_world_size() if members is None else len(members), members)
    # The callables are the caller's code: run them on this rank's pipeline now, so a bad
    # return value is an error here, before any group exists.
    for kind in (EMBD, POS_EMBD):
        plan.group_ranks(kind.name, dist.get_rank())
    if args.virtual_pipeline_model_parallel_size is not None and plan.pp <= 1:
        raise ParallelStateError(
            "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1 "
            "(the interleaved schedule has nothing to interleave otherwise)"
        )
    return plan


def create_all_gather_groups(for_expert_parallelism: bool = False, timeout: datetime.timedelta | None = None,
                             nccl_comm_cfgs: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """megatron-core 0.18's separate all-gather communicators (for all-gather / reduce-scatter overlap).

    Returns ``(dp_cp_ag, expt_dp_ag)``: a second group with this rank's dp x cp ranks and, with
    ``for_expert_parallelism`` and expert parallelism, a second group with its expert dp ranks
    (else None). Every rank of the topology calls it alike; called again, or after
    ``initialize_model_parallel(create_all_gather_group=True)``, it returns the groups it has.
    ``destroy_model_parallel()`` frees them with the rest (megatron-core leaves them to the
    caller). ``timeout`` None means the topology's timeout; ``nccl_comm_cfgs`` is megatron-core's
    dict of NCCL settings per section (``dp_cp``, ``ep_dp``).
    """
    import dataclasses

    from parallel_state.topology import arguments as a

    state = _st.peek()
    if state is None:
        raise ParallelStateError(
            "create_all_gather_groups() requires parallel state to be initialized: call "
            "parallel_state.initialize_model_parallel() first"
        )
    from parallel_state.groups.consistency import check_same_everywhere

    expert = a.flag("for_expert_parallelism", for_expert_parallelism)
    timeout = state.timeout if timeout is None else a.positive_timedelta("timeout", timeout)
    if nccl_comm_cfgs is not None and not isinstance(nccl_comm_cfgs, dict):
        raise ParallelStateTypeError(f"nccl_comm_cfgs must be a dict of section -> NCCL settings or None, got "
                                     f"{nccl_comm_cfgs!r}")
    settings = NcclSettings(nccl_comm_cfgs or {})
    # Every rank of the topology must ask for the same groups, or their group names would not line up.
    check_same_everywhere("create_all_gather_groups", {"for_expert_parallelism": expert, "timeout":
                          timeout.total_seconds(), "nccl_comm_cfgs": repr(settings.cfgs)}, timeout=timeout,
                          members=state.plan.ranks)
    plan = dataclasses.replace(state.plan, all_gather=True, expert_all_gather=expert or state.plan.expert_all_gather)
    added = _st.extend(plan, dataclasses.replace(state.options, timeout=timeout, nccl=settings))
    if added:
        _bridge_if_megatron_loaded()
    state = _st.current("create_all_gather_groups")
    return state.groups[DP_CP_AG.name], state.groups.get(EDP_AG.name) if expert else None


def _confirm(error: BaseException | None, timeout: datetime.timedelta, members: Any = None) -> None:
    from parallel_state.groups.consistency import confirm_everywhere

    # A peer that fails spends up to one timeout on the group it cannot build: wait for it.
    confirm_everywhere("initialize_model_parallel group creation", error, timeout=2 * timeout, members=members)


def _members(args: InitArguments) -> tuple[int, ...] | None:
    """The global ranks to build over, ascending (None: the whole world; () : not this rank's topology).

    ``ranks`` must hold the caller; ``rank_offset`` / ``local_world_size`` (megatron-core 0.17) are
    called by every rank, and a rank outside their range takes no part.
    """
    import torch.distributed as dist

    from parallel_state.groups.process_groups import group_members
    from parallel_state.topology import arguments as a

    world, me = dist.get_world_size(), dist.get_rank()
    if args.ranks is None:
        a.non_negative_int("rank_offset", args.rank_offset)
        a.optional_positive_int("local_world_size", args.local_world_size)
        subset = args.subset(world)
        return subset if subset is None or me in subset else ()
    members = tuple(sorted(group_members(args.ranks, world)))
    if not members:
        raise ParallelStateError("ranks=[] holds no rank; pass the global ranks to build over, or None for all")
    if me not in members:
        raise ParallelStateError(
            f"rank {me} called initialize_model_parallel(ranks={list(members)}), which does not hold "
            f"it; pass the subset this rank belongs to (each rank passes its own subset's ranks)"
        )
    return members


def _cache_key(config: dict[str, Any], members: Any) -> str:
    """The topology's name in the group cache: everything the groups depend on, equal on every rank."""
    import hashlib
    import json

    what = json.dumps([config, members], sort_keys=True, default=repr)
    return hashlib.sha1(what.encode()).hexdigest()[:16]


def _set_companions() -> None:
    """What megatron-core's initialize sets up beside the groups: the memory buffer and the group list."""
    from parallel_state.groups import process_groups

    _set_memory_buffer()
    process_groups.register_process_groups(_st.current("initialize_model_parallel").owned)


def _set_memory_buffer() -> None:
    from parallel_state.megatron import memory

    memory.destroy_global_memory_buffer()  # one set by hand before initialize is replaced, not an error
    memory.set_global_memory_buffer()
    _st.register_teardown_hook(_free_companions)


def _free_companions() -> None:
    from parallel_state.groups import process_groups

    process_groups.clear_process_groups()  # the memory buffers drop themselves (memory's teardown hook)


def _bridge_if_megatron_loaded() -> None:
    import sys

    if sys.modules.get("megatron.core.parallel_state") is not None:
        from parallel_state.megatron.bridge import bridge_megatron

        bridge_megatron()


def destroy_model_parallel() -> None:
    """Destroy every process group initialize_model_parallel created and reset all state.

    Idempotent, and harmless when nothing was initialized.
    """
    _st.teardown()
