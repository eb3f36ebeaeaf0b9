"""``initialize_model_parallel`` and ``destroy_model_parallel`` with megatron-core's signature."""

from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional

from parallel_state import state as _st
from parallel_state.errors import ParallelStateError
from parallel_state.plan import TopologyPlan

# Megatron's names for the NCCL communicator config sections, by group kind.
_NCCL_CFG_NAME = {
    "dp-cp": "dp_cp", "dp": "dp", "cp": "cp", "tp-pp": "mp", "tp": "tp", "pp": "pp",
    "tp-dp-cp": "tp_dp_cp", "tp-dp": "tp_dp", "tp-cp": "tp_cp",
}


def _alias(name: str, megatron_value: Any, default: Any, alias_name: str, alias_value: Any) -> Any:
    if alias_value is None:
        return megatron_value
    if megatron_value != default:
        raise TypeError(
            f"initialize_model_parallel() got both {name}={megatron_value!r} and its alias "
            f"{alias_name}={alias_value!r}; pass only one of them"
        )
    return alias_value


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not supported by parallel_state; use megatron-core for it")


def _nccl_options_factory(config_path: str | None, high_priority: list[str] | None) -> Callable[[str], Any]:
    cfgs: dict[str, dict[str, Any]] = {}
    if config_path is not None:
        try:
            import yaml
        except ImportError as exc:
            raise ParallelStateError(
                "nccl_communicator_config_path needs the 'yaml' package: pip install pyyaml"
            ) from exc
        with open(config_path) as stream:
            cfgs = yaml.safe_load(stream) or {}
    for name in high_priority or []:
        cfgs.setdefault(name, {})["is_high_priority_stream"] = True
    if not cfgs:
        return lambda kind: None

    def options(kind: str) -> Any:
        cfg = cfgs.get(_NCCL_CFG_NAME.get(kind, kind))
        if cfg is None:
            return None
        import torch.distributed as dist

        if not hasattr(dist, "ProcessGroupNCCL"):
            raise ParallelStateError(
                "NCCL communicator options were given but this torch build has no NCCL; "
                "drop nccl_communicator_config_path / high_priority_stream_groups on CPU"
            )
        opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=cfg.get("is_high_priority_stream", False))
        for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
            if key in cfg:
                setattr(opts.config, key, cfg[key])
        return opts

    return options


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
) -> None:
    """Build this rank's model-parallel groups, laid out exactly as megatron-core lays them out.

    Takes megatron-core's arguments in its order; ``tp_size``/``cp_size``/``pp_size`` are the
    MAGI-1 / WorldFoundry spellings, ``timeout`` sets the groups' timeout more finely than
    ``distributed_timeout_minutes``, and ``check_consistency`` compares every rank's arguments
    in one collective before any group is built. Each rank creates only the groups it is in.
    """
    import torch.distributed as dist

    tp = _alias("tensor_model_parallel_size", tensor_model_parallel_size, 1, "tp_size", tp_size)
    cp = _alias("context_parallel_size", context_parallel_size, 1, "cp_size", cp_size)
    pp = _alias("pipeline_model_parallel_size", pipeline_model_parallel_size, 1, "pp_size", pp_size)

    if expert_model_parallel_size != 1:
        raise _unsupported(f"expert_model_parallel_size={expert_model_parallel_size} (expert parallelism)")
    if expert_tensor_parallel_size not in (None, tp):
        raise _unsupported(f"expert_tensor_parallel_size={expert_tensor_parallel_size} different from tp={tp}")
    if use_sharp or sharp_enabled_group is not None:
        raise _unsupported("use_sharp / sharp_enabled_group")
    if hierarchical_context_parallel_sizes or hybrid_context_parallel:
        raise _unsupported("hierarchical or hybrid context parallelism")
    if num_distributed_optimizer_instances != 1:
        raise _unsupported("num_distributed_optimizer_instances > 1")
    if get_embedding_ranks is not None or get_position_embedding_ranks is not None or create_all_gather_group:
        raise _unsupported("embedding groups and the separate all-gather group")
    if pipeline_model_parallel_comm_backend not in (None, "nccl", "gloo", "ucc"):
        raise ParallelStateError(
            f"pipeline_model_parallel_comm_backend={pipeline_model_parallel_comm_backend!r} is not a "
            f"backend; use None (the default group's), 'nccl', 'gloo' or 'ucc'"
        )
    if timeout is None:
        if isinstance(distributed_timeout_minutes, bool) or not isinstance(distributed_timeout_minutes, (int, float)) \
                or distributed_timeout_minutes <= 0:
            raise ParallelStateError(
                f"distributed_timeout_minutes must be a positive number, got {distributed_timeout_minutes!r}"
            )
        timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
    elif not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ParallelStateError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")

    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelStateError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
            "(or parallel_state.dist_init) before initialize_model_parallel"
        )
    if _st.peek() is not None:
        raise ParallelStateError(
            "model-parallel groups are already initialized; call "
            "parallel_state.destroy_model_parallel() before initializing again"
        )
    from parallel_state.bridge import megatron_clash

    # Checked before any group exists; it joins the consistency check so no rank is left waiting.
    clash = megatron_clash()
    plan = TopologyPlan(dist.get_world_size(), tp=tp, cp=cp, pp=pp, order=order)
    if virtual_pipeline_model_parallel_size is not None and pp <= 1:
        raise ParallelStateError(
            "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1 "
            "(the interleaved schedule has nothing to interleave otherwise)"
        )
    if check_consistency:
        from parallel_state.consistency import check_same_everywhere

        check_same_everywhere(
            "initialize_model_parallel",
            {"tp": tp, "cp": cp, "pp": pp, "order": plan.order,
             "virtual_pp": virtual_pipeline_model_parallel_size,
             "gloo_groups": bool(create_gloo_process_groups), "megatron_holds_own_groups": clash is not None},
            timeout=timeout,
        )
    if clash is not None:
        raise ParallelStateError(clash)
    _st.build(
        plan,
        timeout=timeout,
        create_gloo_process_groups=bool(create_gloo_process_groups),
        pipeline_backend=pipeline_model_parallel_comm_backend,
        nccl_options=_nccl_options_factory(nccl_communicator_config_path, high_priority_stream_groups),
        virtual_pipeline_size=virtual_pipeline_model_parallel_size,
    )
    _bridge_if_megatron_loaded()


def _bridge_if_megatron_loaded() -> None:
    import sys

    if sys.modules.get("megatron.core.parallel_state") is not None:
        from parallel_state.bridge import bridge_megatron

        bridge_megatron()


def destroy_model_parallel() -> None:
    """Destroy every process group initialize_model_parallel created and reset all state.

    Idempotent, and harmless when nothing was initialized.
    """
    _st.teardown()
