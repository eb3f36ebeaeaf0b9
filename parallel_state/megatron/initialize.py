"""``initialize_model_parallel`` and ``destroy_model_parallel`` with megatron-core's signature."""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, List, Optional

from parallel_state.errors import ParallelStateAssertionError, ParallelStateError, ParallelStateTypeError
from parallel_state.groups import state as _st
from parallel_state.groups.kinds import row
from parallel_state.topology.plan import TopologyPlan


def _alias(name: str, megatron_value: Any, default: Any, alias_name: str, alias_value: Any) -> Any:
    if alias_value is None:
        return megatron_value
    if megatron_value != default:
        raise TypeError(
            f"initialize_model_parallel() got both {name}={megatron_value!r} and its alias "
            f"{alias_name}={alias_value!r}; pass only one of them"
        )
    return alias_value


def _nccl_options(config_path: Any, high_priority: list[str] | None) -> tuple[Callable[[str], Any], Callable[[str], Any]]:
    """Each kind's NCCL options (None where nothing is configured), as megatron-core builds them, and
    a comparable key of those settings."""
    from parallel_state.groups.nccl import get_nccl_options, load_nccl_comm_cfgs

    cfgs = load_nccl_comm_cfgs(config_path, high_priority)
    if not cfgs:
        return (lambda kind: None), (lambda kind: None)
    # The settings themselves key a cached group: equal settings, same communicator.
    return (lambda kind: get_nccl_options(row(kind).nccl, cfgs)), (lambda kind: repr(cfgs.get(row(kind).nccl)))


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    create_all_gather_group: Optional[bool] = False,
    *,
    tp_size: Optional[int] = None,
    cp_size: Optional[int] = None,
    pp_size: Optional[int] = None,
    timeout: Optional[datetime.timedelta] = None,
    check_consistency: bool = True,
    ranks: Optional[List[int]] = None,
) -> None:
    """Build this rank's model-parallel groups, laid out exactly as megatron-core lays them out.

    Takes megatron-core's arguments in its order; ``tp_size``/``cp_size``/``pp_size`` are the
    MAGI-1 / WorldFoundry spellings, ``timeout`` sets the groups' timeout more finely than
    ``distributed_timeout_minutes``. ``check_consistency`` compares every rank's arguments
    before any group is built and confirms every rank built its groups afterwards (a round
    through the default store each, bounded by the timeout), so that all ranks keep the
    groups or none does. Each rank creates only the groups it is in; on any error nothing is
    left behind. ``ranks`` (global ranks holding this one) builds the topology over that subset
    of the world alone: sizes, layout and accessors refer to it, and only its ranks take part,
    so disjoint subsets initialize, run and destroy side by side.
    """
    import torch.distributed as dist

    from parallel_state.topology import arguments as a

    tp = _alias("tensor_model_parallel_size", tensor_model_parallel_size, 1, "tp_size", tp_size)
    cp = _alias("context_parallel_size", context_parallel_size, 1, "cp_size", cp_size)
    pp = _alias("pipeline_model_parallel_size", pipeline_model_parallel_size, 1, "pp_size", pp_size)
    check_consistency = a.flag("check_consistency", check_consistency)
    timeout = a.timeout_of(timeout, distributed_timeout_minutes)
    members = _members(ranks)

    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelStateAssertionError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
            "(or parallel_state.dist_init) before initialize_model_parallel"
        )
    if _st.peek() is not None:
        raise ParallelStateAssertionError(
            "model-parallel groups are already initialized; call "
            "parallel_state.destroy_model_parallel() before initializing again"
        )
    from parallel_state.megatron.bridge import megatron_clash

    # Checked before any group exists; it joins the consistency check so no rank is left waiting.
    clash = megatron_clash()
    from parallel_state.groups import group_cache

    config = {
        "tensor_model_parallel_size": tp, "context_parallel_size": cp, "pipeline_model_parallel_size": pp,
        "order": _comparable_order(order, tp, cp, pp),
        "virtual_pipeline_model_parallel_size": virtual_pipeline_model_parallel_size,
        "pipeline_model_parallel_comm_backend": pipeline_model_parallel_comm_backend,
        "create_gloo_process_groups": create_gloo_process_groups,
        "expert_model_parallel_size": expert_model_parallel_size,
        "expert_tensor_parallel_size": expert_tensor_parallel_size,
        "hierarchical_context_parallel_sizes": hierarchical_context_parallel_sizes,
        "hybrid_context_parallel": hybrid_context_parallel,
        "num_distributed_optimizer_instances": num_distributed_optimizer_instances,
        "create_all_gather_group": create_all_gather_group,
        "use_sharp": use_sharp, "sharp_enabled_group": sharp_enabled_group,
        "get_embedding_ranks": _callable_name(get_embedding_ranks),
        "get_position_embedding_ranks": _callable_name(get_position_embedding_ranks),
        "megatron_holds_own_groups": clash is not None,
        "group_cache": group_cache.enabled(),
    }
    cache_key = (_cache_key(config, timeout, members, nccl_communicator_config_path, high_priority_stream_groups)
                 if group_cache.enabled() else None)  # only the cache needs the topology's name
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
        plan, vpp, backend, (nccl_options, nccl_key) = _validated(
            dist.get_world_size() if members is None else len(members), tp, cp, pp, members=members,
            spelled={"tp": tp_size, "cp": cp_size, "pp": pp_size}, order=order,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend, use_sharp=use_sharp,
            hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
            hybrid_context_parallel=hybrid_context_parallel, expert_model_parallel_size=expert_model_parallel_size,
            num_distributed_optimizer_instances=num_distributed_optimizer_instances,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            nccl_communicator_config_path=nccl_communicator_config_path, get_embedding_ranks=get_embedding_ranks,
            get_position_embedding_ranks=get_position_embedding_ranks,
            create_gloo_process_groups=create_gloo_process_groups,
            high_priority_stream_groups=high_priority_stream_groups, sharp_enabled_group=sharp_enabled_group,
            create_all_gather_group=create_all_gather_group,
        )
        state = _st.build(plan, timeout=timeout, create_gloo_process_groups=create_gloo_process_groups,
                          pipeline_backend=backend, nccl_options=nccl_options, nccl_key=nccl_key,
                          virtual_pipeline_size=vpp, sharp_kind=_sharp_kind(use_sharp, sharp_enabled_group),
                          cache_key=cache_key, caches_agree=caches_agree)
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


def _validated(world: int, tp: Any, cp: Any, pp: Any, *, spelled: dict[str, Any], members: Any = None,
               **kw: Any) -> tuple[Any, ...]:
    """Check every argument's type and value; the plan, vpp, pipeline backend and NCCL options."""
    from parallel_state.topology import arguments as a

    # Each size is named as the caller spelled it.
    tp = a.positive_int("tp_size" if spelled["tp"] is not None else "tensor_model_parallel_size", tp)
    cp = a.positive_int("cp_size" if spelled["cp"] is not None else "context_parallel_size", cp)
    pp = a.positive_int("pp_size" if spelled["pp"] is not None else "pipeline_model_parallel_size", pp)
    ep = a.positive_int("expert_model_parallel_size", kw["expert_model_parallel_size"])
    instances = a.positive_int("num_distributed_optimizer_instances", kw["num_distributed_optimizer_instances"])
    etp = a.optional_positive_int("expert_tensor_parallel_size", kw["expert_tensor_parallel_size"])
    vpp = a.optional_positive_int("virtual_pipeline_model_parallel_size", kw["virtual_pipeline_model_parallel_size"])
    for name in ("use_sharp", "hybrid_context_parallel", "create_gloo_process_groups"):
        a.flag(name, kw[name])
    if kw["create_all_gather_group"] is not None:  # Megatron's type is Optional[bool]
        a.flag("create_all_gather_group", kw["create_all_gather_group"])
    backend = a.optional_str("pipeline_model_parallel_comm_backend", kw["pipeline_model_parallel_comm_backend"], "gloo")
    a.optional_str("sharp_enabled_group", kw["sharp_enabled_group"], "dp")
    for name in ("get_embedding_ranks", "get_position_embedding_ranks"):
        a.optional_callable(name, kw[name])
    priority = a.optional_str_list("high_priority_stream_groups", kw["high_priority_stream_groups"], "cp")
    config_path = kw["nccl_communicator_config_path"]
    if config_path is not None and not isinstance(config_path, (str, os.PathLike)):
        raise ParallelStateTypeError(
            f"nccl_communicator_config_path must be the path of a YAML file or None, got {config_path!r}"
        )
    if kw["sharp_enabled_group"] is not None:
        if not kw["use_sharp"]:
            raise ParallelStateAssertionError(
                f"sharp_enabled_group={kw['sharp_enabled_group']!r} is only valid with use_sharp=True; pass "
                f"use_sharp=True or leave sharp_enabled_group None"
            )
        if kw["sharp_enabled_group"] not in ("dp", "dp_replica"):
            raise ParallelStateAssertionError(
                f"sharp_enabled_group={kw['sharp_enabled_group']!r} is not a SHARP group; use 'dp' or 'dp_replica'"
            )
        if kw["sharp_enabled_group"] == "dp_replica" and instances == 1:
            raise ParallelStateAssertionError(
                "sharp_enabled_group='dp_replica' needs num_distributed_optimizer_instances > 1 (the replica "
                "group spans the instances)"
            )
    if backend not in (None, "nccl", "gloo", "ucc"):
        raise ParallelStateError(
            f"pipeline_model_parallel_comm_backend={backend!r} is not a backend; use None (the default "
            f"group's), 'nccl', 'gloo' or 'ucc'"
        )
    import torch.distributed as dist

    if backend is not None and not dist.is_backend_available(backend):
        raise ParallelStateError(
            f"pipeline_model_parallel_comm_backend={backend!r} is not available in this torch build; "
            f"use None (the default group's backend) or one this build has"
        )
    plan = TopologyPlan(
        world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=kw["order"],
        hierarchical_cp=kw["hierarchical_context_parallel_sizes"], dist_opt_instances=instances,
        hybrid_cp=kw["hybrid_context_parallel"], all_gather=bool(kw["create_all_gather_group"]),
        embedding_ranks=kw["get_embedding_ranks"], position_embedding_ranks=kw["get_position_embedding_ranks"],
        ranks=members,
    )
    # The callables are the caller's code: run them on this rank's pipeline now, so a bad
    # return value is an error here, before any group exists.
    for kind in ("embd", "pos-embd"):
        plan.group_ranks(kind, dist.get_rank())
    if vpp is not None and plan.pp <= 1:
        raise ParallelStateError(
            "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1 "
            "(the interleaved schedule has nothing to interleave otherwise)"
        )
    return plan, vpp, backend, _nccl_options(config_path, priority)


def _callable_name(fn: Any) -> Any:
    """A callable as ranks can compare it: its qualified name (None stays None)."""
    if fn is None or not callable(fn):
        return fn if fn is None else repr(type(fn))
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _sharp_kind(use_sharp: bool, sharp_enabled_group: str | None) -> str | None:
    """The kind whose NCCL communicator SHARP is enabled for (megatron-core: dp x cp, or the replica group)."""
    if not use_sharp:
        return None
    return "edp-inter" if sharp_enabled_group == "dp_replica" else "dp-cp"


def _confirm(error: BaseException | None, timeout: datetime.timedelta, members: Any = None) -> None:
    from parallel_state.groups.consistency import confirm_everywhere

    # A peer that fails spends up to one timeout on the group it cannot build: wait for it.
    confirm_everywhere("initialize_model_parallel group creation", error, timeout=2 * timeout, members=members)


def _members(ranks: Any) -> tuple[int, ...] | None:
    """``ranks`` checked (distinct global ranks of the world, holding this rank), ascending; None for all."""
    if ranks is None:
        return None
    import torch.distributed as dist

    from parallel_state.groups.process_groups import _group_members

    if not (dist.is_available() and dist.is_initialized()):
        return None  # the caller's "not initialized" error says what to do
    members = tuple(sorted(_group_members(ranks, dist.get_world_size())))
    if not members:
        raise ParallelStateError("ranks=[] holds no rank; pass the global ranks to build over, or None for all")
    if dist.get_rank() not in members:
        raise ParallelStateError(
            f"rank {dist.get_rank()} called initialize_model_parallel(ranks={list(members)}), which does not hold "
            f"it; pass the subset this rank belongs to (each rank passes its own subset's ranks)"
        )
    return members


def _cache_key(config: dict[str, Any], timeout: datetime.timedelta, members: Any, nccl_path: Any,
               priority: Any) -> str:
    """The topology's name in the group cache: everything the groups depend on, equal on every rank."""
    import hashlib
    import json

    what = json.dumps([config, timeout.total_seconds(), members, str(nccl_path), priority], sort_keys=True,
                      default=repr)
    return hashlib.sha1(what.encode()).hexdigest()[:16]


def _comparable_order(order: Any, tp: Any, cp: Any, pp: Any) -> Any:
    """``order`` as the layout it means (tokens completed, lower case) when valid, else as given."""
    try:
        return TopologyPlan(tp * cp * pp, tp=tp, cp=cp, pp=pp, order=order).order
    except Exception:
        return order


def _set_companions() -> None:
    """What megatron-core's initialize sets up beside the groups: the memory buffer and the group list."""
    from parallel_state.groups import process_groups
    from parallel_state.megatron import memory

    memory.destroy_global_memory_buffer()  # one set by hand before initialize is replaced, not an error
    memory.set_global_memory_buffer()
    process_groups.register_process_groups(_st.current("initialize_model_parallel").owned)
    _st.register_teardown_hook(_free_companions)


def _free_companions() -> None:
    from parallel_state.groups import process_groups
    from parallel_state.megatron import memory

    memory.destroy_global_memory_buffer()
    memory.destroy_global_symmetric_memory_buffer()
    process_groups.clear_process_groups()


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
