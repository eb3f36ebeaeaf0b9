"""Context-parallel tensor helpers: split inputs into sequence shards, gather outputs, broadcast, attention.

Every helper takes its process group explicitly and never reads the global parallel state; a group
of None means context parallelism is off and the input itself comes back, so the same model code
runs in one process and in many.
"""

from cp.attention import heads_to_seq, sdpa_in_layout, seq_to_heads, ulysses_attention
from cp.broadcast import broadcast, broadcast_split_tensor, robust_broadcast
from cp.counting import AttentionCount, count_attention
from cp.dispatch import dispatch, undispatch
from cp.objects import cat_outputs_cp_object_list, split_inputs_cp_object_list
from cp.samples import SampleGroup, plan_samples, run_samples, sample_groups
from cp.shard import cat_outputs_cp, cat_outputs_cp_with_grad, shard_sizes, split_inputs_cp
from cp.workspace import release_gather_workspace
from parallel_state import AttentionMask as Mask  # noqa: F401  (one class: cp.Mask is parallel_state.AttentionMask)
from parallel_state import (  # noqa: F401
    AttentionShape,
    CostRates,
    DispatchPlan,
    Layout,
    Placement,
    SamplePlan,
    Transport,
    plan_dispatch,
    plan_dual_chunk_swap,
)

#: Imported on first use: most programs pick one attention method, and import time is per process.
_LAZY = {"ring_attention": "cp.ring", "usp_attention": "cp.usp", "measure_rates": "cp.rates", "clear_rates": "cp.rates",
         "KVCache": "cp.kv_cache"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


__all__ = [
    "AttentionCount",
    "AttentionShape",
    "CostRates",
    "DispatchPlan",
    "KVCache",
    "Layout",
    "Mask",
    "Placement",
    "SampleGroup",
    "SamplePlan",
    "Transport",
    "broadcast",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_object_list",
    "cat_outputs_cp_with_grad",
    "clear_rates",
    "count_attention",
    "dispatch",
    "heads_to_seq",
    "measure_rates",
    "plan_dispatch",
    "plan_dual_chunk_swap",
    "plan_samples",
    "release_gather_workspace",
    "ring_attention",
    "robust_broadcast",
    "run_samples",
    "sample_groups",
    "sdpa_in_layout",
    "seq_to_heads",
    "shard_sizes",
    "split_inputs_cp",
    "split_inputs_cp_object_list",
    "ulysses_attention",
    "undispatch",
    "usp_attention",
]
