"""A Megatron-compatible parallel-state service: context- and pipeline-parallel process groups.

Mirrors ``megatron.core.parallel_state``: the same names, arguments, defaults and rank layout.
The pieces: ``plan`` (pure topology arithmetic), ``state`` (the one live state object and its
lifecycle), ``groups`` (members-only group creation), ``accessors`` (Megatron's getters),
``split`` (``find_split`` and ``cp_size_t``), ``bridge`` (megatron-core reads our groups).
The runtime: ``launch`` (launcher detection), ``manager`` (DistributedManager), ``resolve``
(rank / world size / collective device), ``runtime`` (dist_init), ``log`` (print helpers).
"""

from parallel_state.accessors import (  # noqa: F401  (re-exported API)
    get_all_ranks,
    get_context_parallel_global_ranks,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_cp_group,
    get_cp_rank,
    get_cp_world_size,
    get_data_parallel_group,
    get_data_parallel_group_gloo,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_dp_group,
    get_dp_group_gloo,
    get_dp_rank,
    get_dp_world_size,
    get_model_parallel_group,
    get_model_parallel_src_rank,
    get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
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
    is_initialized,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    is_unitialized,
    model_parallel_is_initialized,
    set_data_parallel_rank,
    set_pipeline_model_parallel_rank,
    set_pipeline_model_parallel_world_size,
    set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size,
    set_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size,
)
from parallel_state.bridge import bridge_megatron  # noqa: F401
from parallel_state.errors import ParallelStateError, ParallelStateTypeError, ParallelStateWarning  # noqa: F401
from parallel_state.initialize import destroy_model_parallel, initialize_model_parallel  # noqa: F401
from parallel_state.launch import LaunchInfo, detect_launch  # noqa: F401
from parallel_state.log import print_per_rank, print_rank_0  # noqa: F401
from parallel_state.manager import DistributedManager  # noqa: F401
from parallel_state.plan import DEFAULT_ORDER, TopologyPlan  # noqa: F401
from parallel_state.resolve import collective_device, resolve_global_rank, resolve_world_size  # noqa: F401
from parallel_state.runtime import (  # noqa: F401
    dist_init,
    is_last_rank,
    is_last_tp_cp_rank,
    register_dist_init_hook,
)
from parallel_state.split import find_split  # noqa: F401
from parallel_state.state import register_teardown_hook  # noqa: F401
