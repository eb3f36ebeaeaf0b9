"""A Megatron-compatible parallel-state service: context- and pipeline-parallel process groups.

Mirrors ``megatron.core.parallel_state`` 0.16 to 0.19: every public name of each release, its
arguments, defaults, answers and rank layout (positional orders as the release in use has them,
``megatron_release()``), and megatron-core's ``ProcessGroupCollection``. The names are re-exported
here from five layers, each importing only those below it (``lint-imports`` checks it; see
docs/architecture.md): ``topology`` (pure arithmetic: the plan of every group kind,
``RankGenerator``, the latent split, the context-parallel planner, attention masks and the balanced
dispatch plan), ``groups`` (creating, checking, caching and destroying torch process groups; the
table of kinds; the live state), ``megatron`` (``initialize_model_parallel``, precomputed answers
and megatron-core's accessors, its private globals, the bridge, memory buffers, ``find_split`` /
``cp_size_t``), ``runtime`` (``dist_init``, launchers, ``DistributedManager``, the resolvers,
DeviceMesh views, logging) and ``tools`` (``python -m parallel_state``), with the exceptions in
``errors``.
"""

import importlib as _importlib
import sys as _sys
import types as _types

#: megatron-core re-exports it from its module; code reaches it there.
from datetime import timedelta  # noqa: F401

from parallel_state.errors import (  # noqa: F401
    ParallelStateAssertionError,
    ParallelStateError,
    ParallelStateTypeError,
    ParallelStateValueError,
    ParallelStateWarning,
)
from parallel_state.groups.group_cache import clear_group_cache, enable_group_cache, group_cache_info  # noqa: F401
from parallel_state.groups.hierarchical import create_hierarchical_groups, create_hybrid_dp_cp_groups  # noqa: F401
from parallel_state.groups.nccl import get_nccl_options, overwrite_nccl_comm_cfgs  # noqa: F401
from parallel_state.groups.process_groups import create_group, is_torch_min_version, update_pg_timeout  # noqa: F401
from parallel_state.groups.state import register_teardown_hook  # noqa: F401
from parallel_state.megatron.accessors import (  # noqa: F401  (re-exported API)
    get_all_ranks,
    get_amax_reduction_group,
    get_context_parallel_global_ranks,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_cp_group,
    get_cp_rank,
    get_cp_world_size,
    get_data_modulo_expert_parallel_group,
    get_data_parallel_group,
    get_data_parallel_group_gloo,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_dp_group,
    get_dp_group_gloo,
    get_dp_rank,
    get_dp_world_size,
    get_embedding_group,
    get_expert_data_parallel_group,
    get_expert_data_parallel_group_gloo,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_gtp_weight_remat_global_ranks,
    get_expert_gtp_weight_remat_group,
    get_expert_gtp_weight_remat_rank,
    get_expert_gtp_weight_remat_world_size,
    get_expert_model_parallel_group,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_src_rank,
    get_expert_model_parallel_world_size,
    get_expert_tensor_and_model_parallel_group,
    get_expert_tensor_and_model_parallel_rank,
    get_expert_tensor_and_model_parallel_world_size,
    get_expert_tensor_model_pipeline_parallel_group,
    get_expert_tensor_parallel_group,
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_gtp_weight_remat_global_ranks,
    get_gtp_weight_remat_group,
    get_gtp_weight_remat_rank,
    get_gtp_weight_remat_world_size,
    get_hierarchical_context_parallel_groups,
    get_hybrid_data_context_parallel_groups,
    get_inter_distributed_optimizer_instance_group,
    get_intra_distributed_optimizer_instance_group,
    get_model_parallel_group,
    get_model_parallel_src_rank,
    get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_position_embedding_group,
    get_pp_group,
    get_pp_rank,
    get_pp_world_size,
    get_tensor_and_context_parallel_group,
    get_tensor_and_context_parallel_rank,
    get_tensor_and_context_parallel_world_size,
    get_tensor_and_data_parallel_group,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_last_rank,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_ranks,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_tp_rank,
    get_tp_world_size,
    get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size,
    has_separate_all_gather_group,
    is_initialized,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    is_rank_in_embedding_group,
    is_rank_in_position_embedding_group,
    is_unitialized,
    model_parallel_is_initialized,
    set_data_parallel_rank,
    set_expert_model_parallel_rank,
    set_expert_model_parallel_world_size,
    set_expert_tensor_parallel_rank,
    set_expert_tensor_parallel_world_size,
    set_pipeline_model_parallel_rank,
    set_pipeline_model_parallel_world_size,
    set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size,
    set_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size,
)
from parallel_state.megatron.bridge import bridge_megatron  # noqa: F401
from parallel_state.megatron.cp_size_t import find_split  # noqa: F401
from parallel_state.megatron.generated_initialize import initialize_model_parallel  # noqa: F401
from parallel_state.megatron.initialize import create_all_gather_groups, destroy_model_parallel  # noqa: F401
from parallel_state.megatron.memory import (  # noqa: F401
    GlobalMemoryBuffer,
    GlobalSymmetricMemoryBuffer,
    SymmetricMemoryManager,
    destroy_global_memory_buffer,
    destroy_global_symmetric_memory_buffer,
    get_global_memory_buffer,
    get_global_symmetric_memory_buffer,
)
from parallel_state.megatron.pg_collection import ProcessGroupCollection, process_group_collection  # noqa: F401
from parallel_state.runtime.dist_init import (  # noqa: F401
    dist_init,
    is_last_rank,
    is_last_tp_cp_rank,
    register_dist_init_hook,
)
from parallel_state.runtime.group_config import ProcessGroupConfig, ProcessGroupNode  # noqa: F401
from parallel_state.runtime.launch import LaunchInfo, detect_launch  # noqa: F401
from parallel_state.runtime.log import print_per_rank, print_rank_0  # noqa: F401
from parallel_state.runtime.manager import (  # noqa: F401
    DistributedManager,
    PhysicsNeMoUndefinedGroupError,
    PhysicsNeMoUninitializedDistributedManagerWarning,
)
from parallel_state.runtime.mesh import device_mesh, fsdp_mesh  # noqa: F401
from parallel_state.runtime.resolve import collective_device, resolve_global_rank, resolve_world_size  # noqa: F401
from parallel_state.topology.attention_mask import AttentionMask  # noqa: F401
from parallel_state.topology.cp_plan import ContextParallelPlan, plan_context_parallel, shard_sizes  # noqa: F401
from parallel_state.topology.dispatch_cost import AttentionShape, CostRates  # noqa: F401
from parallel_state.topology.dispatch_layout import Layout, Transport  # noqa: F401
from parallel_state.topology.dispatch_plan import DispatchPlan, plan_dispatch, plan_dual_chunk_swap  # noqa: F401
from parallel_state.topology.init_arguments import InitArguments  # noqa: F401
from parallel_state.topology.kinds import default_embedding_ranks, default_position_embedding_ranks  # noqa: F401
from parallel_state.topology.plan import DEFAULT_ORDER, TopologyPlan  # noqa: F401
from parallel_state.topology.rank_generator import RankGenerator, generate_masked_orthogonal_rank_groups  # noqa: F401
from parallel_state.topology.releases import in_use as megatron_release  # noqa: F401
from parallel_state.topology.sample_plan import Placement, SamplePlan, plan_samples  # noqa: F401

# The base of every closed set of names, parallel_state's and cp's (a member is its str value).
from parallel_state.topology.str_enum import StrEnum  # noqa: F401


def __getattr__(name: str) -> object:
    """megatron-core's private globals (``_TENSOR_MODEL_PARALLEL_GROUP``, ...), read live from the state, and
    its private functions that code calls from outside (``_set_global_memory_buffer``)."""
    if name[:1] == "_" and name[:2] != "__":
        if name in _megatron_globals().NAMES:
            return _megatron_globals().value(name)
        function = _writes().FUNCTIONS.get(name)
        if function is not None:
            return function
    raise AttributeError(f"module 'parallel_state' has no attribute {name!r}")


def _megatron_globals() -> _types.ModuleType:
    # Imported on first use, not by ``import parallel_state``; and not with ``from parallel_state import``,
    # which looks the submodule up here first and recurses.
    return _importlib.import_module("parallel_state.megatron.megatron_globals")


def _writes() -> _types.ModuleType:
    return _importlib.import_module("parallel_state.megatron.writes")


class _Module(_types.ModuleType):
    """The type of the ``parallel_state`` module: ``parallel_state._CONTEXT_PARALLEL_GROUP = group`` (any of
    megatron-core's private globals) takes effect in every getter, as in megatron-core, through the
    answers (``megatron.writes``), or raises naming the public way; ``del`` drops the write."""

    def __setattr__(self, name: str, value: object) -> None:
        if name[:1] == "_" and name[:2] != "__" and name in _megatron_globals().NAMES:
            _writes().write(name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name[:1] == "_" and name[:2] != "__" and name in _megatron_globals().NAMES:
            _writes().forget(name)
        else:
            super().__delattr__(name)


# A module's type is the supported hook for its attribute writes. Attribute reads cost what they did:
# CPython does not specialize them on a module with a ``__getattr__`` (above) either.
_sys.modules[__name__].__class__ = _Module
