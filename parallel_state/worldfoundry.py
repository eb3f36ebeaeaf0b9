"""WorldFoundry's ``worldfoundry.core.distributed`` namespace, backed by this project.

``from parallel_state import worldfoundry as distributed`` and WorldFoundry model code runs
unchanged: the public names are exactly WorldFoundry's ``__all__`` (55 names), each with its
parameter names, positions, defaults and return values. Most names are this project's own
functions; where WorldFoundry's signature differs, a thin adapter here maps it
(``initialize_model_parallel``'s positional ``tp_size, pp_size, cp_size`` and order
``"tp-cp-pp-dp"``, ``get_tp_group``'s ``check_initialized`` first, ``find_split``'s
``shape_tensor``, the generic rank/world/device names). Unlike WorldFoundry's, nothing needs
CUDA (``dist_init`` and ``PPScheduler`` run on gloo too) and a broadcast whose receivers hold
tensors of other shapes works instead of aborting the job.

Layering: this module is the one place inside ``parallel_state`` that imports ``cp`` and
``scheduler`` (which themselves build on ``parallel_state``): it is a namespace for WorldFoundry
users above everything else, and ``import parallel_state`` never imports it.

Where the names were read from (reference data, not copied):
``__all__``: OpenEnvision/WorldFoundry ``worldfoundry/core/distributed/__init__.py``
(commit b0a26e0); signatures: ``model_parallel/context.py``, ``collectives/device_mesh.py``,
``collectives/generic.py``, ``runtime/inference_runtime.py`` there, and weed33834/WorldFoundry
``worldfoundry/core/distributed/{model_parallel_groups,pipeline_parallel,rank_orchestration,logging}.py``
(commit 30a0c4d).
"""

from __future__ import annotations

from typing import Any, Optional

import cp as _cp
import scheduler as _scheduler
from parallel_state.megatron import accessors as _acc
from parallel_state.megatron import cp_size_t as _split
from parallel_state.megatron import generated_initialize as _init
from parallel_state.megatron.initialize import destroy_model_parallel
from parallel_state.runtime.dist_init import dist_init, is_last_rank, is_last_tp_cp_rank
from parallel_state.runtime.dtensor import (
    DTensorFastEmaModelUpdater,
    FastEmaModelUpdater,
    broadcast_dtensor_model_states,
    get_local_tensor_if_DTensor,
    get_local_tensor_if_dtensor,
)
from parallel_state.runtime.log import print_per_rank, print_rank_0
from parallel_state.runtime.orchestration import (
    DistributedOpSpec,
    PayloadBus,
    RankCoordinator,
    SignalBus,
    distributed_op,
    get_distributed_device,
)
from parallel_state.runtime.resolve import dist_ready as is_distributed_initialized
from parallel_state.runtime.resolve import resolve_global_rank as get_global_rank
from parallel_state.runtime.resolve import resolve_world_size as get_world_size
from parallel_state.topology.arguments import flag as _flag

# --- context-parallel data helpers: this project's cp package under WorldFoundry's names --------
broadcast = _cp.broadcast
broadcast_split_tensor = _cp.broadcast_split_tensor
cat_outputs_cp = _cp.cat_outputs_cp
cat_outputs_cp_object_list = _cp.cat_outputs_cp_object_list
cat_outputs_cp_with_grad = _cp.cat_outputs_cp_with_grad
robust_broadcast = _cp.robust_broadcast
split_inputs_cp = _cp.split_inputs_cp
split_inputs_cp_object_list = _cp.split_inputs_cp_object_list

# --- pipeline scheduler ----------------------------------------------------------------------
PPScheduler = _scheduler.PPScheduler
init_pp_scheduler = _scheduler.init_pp_scheduler
pp_scheduler = _scheduler.pp_scheduler

# --- accessors: this project's, WorldFoundry's short names ------------------------------------------
get_cp_group = _acc.get_cp_group
get_cp_rank = _acc.get_cp_rank
get_cp_world_size = _acc.get_cp_world_size
get_dp_group = _acc.get_dp_group
get_dp_group_gloo = _acc.get_dp_group_gloo
get_dp_rank = _acc.get_dp_rank
get_dp_world_size = _acc.get_dp_world_size
get_model_parallel_group = _acc.get_model_parallel_group
get_pipeline_model_parallel_first_rank = _acc.get_pipeline_model_parallel_first_rank
get_pipeline_model_parallel_last_rank = _acc.get_pipeline_model_parallel_last_rank
get_pipeline_model_parallel_next_rank = _acc.get_pipeline_model_parallel_next_rank
get_pipeline_model_parallel_prev_rank = _acc.get_pipeline_model_parallel_prev_rank
get_pp_group = _acc.get_pp_group
get_pp_rank = _acc.get_pp_rank
get_pp_world_size = _acc.get_pp_world_size
get_tensor_model_parallel_last_rank = _acc.get_tensor_model_parallel_last_rank
get_tensor_model_parallel_ranks = _acc.get_tensor_model_parallel_ranks
get_tp_rank = _acc.get_tp_rank
get_tp_world_size = _acc.get_tp_world_size
model_parallel_is_initialized = _acc.model_parallel_is_initialized


def get_tp_group(check_initialized: bool = True, with_context_parallel: bool = False) -> Any:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel``); None if absent and not checked.

    WorldFoundry puts ``check_initialized`` first; the answers are megatron-core's two group getters'.
    """
    if with_context_parallel is False:  # the common call: no flag check beyond this
        return _acc.get_tensor_model_parallel_group(check_initialized)
    if _flag("with_context_parallel", with_context_parallel):
        return _acc.get_tensor_and_context_parallel_group(check_initialized)
    return _acc.get_tensor_model_parallel_group(check_initialized)


def get_tensor_model_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """First global rank of this rank's tensor-parallel group (tp x cp with ``with_context_parallel``).

    WorldFoundry's extension of megatron-core's accessor (which takes no argument), positional as there.
    """
    if with_context_parallel is False:  # the common call: no flag check beyond this
        return _acc.get_tensor_model_parallel_src_rank()
    if _flag("with_context_parallel", with_context_parallel):
        return _acc.get_tensor_model_parallel_ranks(with_context_parallel=True)[0]
    return _acc.get_tensor_model_parallel_src_rank()


def initialize_model_parallel(
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-pp-dp",
) -> None:
    """WorldFoundry's initialize_model_parallel: sizes positionally as (tp, pp, cp), rank order ``tp-cp-pp-dp``.

    Builds this project's groups (``parallel_state.initialize_model_parallel``) with these
    sizes, order, timeout and NCCL config; the data-parallel size is what the world leaves.
    """
    _init.initialize_model_parallel(
        nccl_communicator_config_path=nccl_communicator_config_path,
        distributed_timeout_minutes=distributed_timeout_minutes, order=order,
        tp_size=tp_size, pp_size=pp_size, cp_size=cp_size,
    )


def find_split(
    shape_tensor: Any,
    cp_size: int,
    patch_values: tuple[int, int, int] = (1, 2, 2),
    view_factor: int = 1,
) -> Any:
    """``parallel_state.find_split`` under WorldFoundry's parameter name: the per-rank ``torch.Size([T', H', W])``.

    Also records ``parallel_state.cp_size_t`` (the temporal split factor).
    """
    return _split.find_split(shape_tensor, cp_size, patch_values, view_factor)


__all__ = [
    "DistributedOpSpec",
    "DTensorFastEmaModelUpdater",
    "FastEmaModelUpdater",
    "PPScheduler",
    "PayloadBus",
    "RankCoordinator",
    "SignalBus",
    "broadcast",
    "broadcast_dtensor_model_states",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_object_list",
    "cat_outputs_cp_with_grad",
    "destroy_model_parallel",
    "dist_init",
    "distributed_op",
    "find_split",
    "get_cp_group",
    "get_cp_rank",
    "get_cp_world_size",
    "get_distributed_device",
    "get_dp_group",
    "get_dp_group_gloo",
    "get_dp_rank",
    "get_dp_world_size",
    "get_global_rank",
    "get_local_tensor_if_dtensor",
    "get_local_tensor_if_DTensor",
    "get_model_parallel_group",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pp_group",
    "get_pp_rank",
    "get_pp_world_size",
    "get_tensor_model_parallel_last_rank",
    "get_tensor_model_parallel_ranks",
    "get_tensor_model_parallel_src_rank",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
    "get_world_size",
    "init_pp_scheduler",
    "initialize_model_parallel",
    "is_distributed_initialized",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "model_parallel_is_initialized",
    "pp_scheduler",
    "print_per_rank",
    "print_rank_0",
    "robust_broadcast",
    "split_inputs_cp",
    "split_inputs_cp_object_list",
]
