"""megatron-core's private module globals, each read from the live answers (no second copy of the state).

Libraries and tests read ``megatron.core.parallel_state._TENSOR_MODEL_PARALLEL_GROUP`` and its
siblings directly. ``parallel_state.<that name>`` answers through the package's module
``__getattr__`` with the live value (None when nothing is initialized), and the bridge writes
the same values into megatron-core's module.
"""

from __future__ import annotations

from typing import Any, Callable

from parallel_state.groups import state as _st
from parallel_state.groups.kinds import ROWS
from parallel_state.megatron.answers import ANSWERS, OVERRIDES

#: megatron-core global -> the answer it holds: each kind's group (and gloo twin) from its row, then the rest.
FROM_ANSWERS: dict[str, str] = {
    **{r.megatron: f"{kind}.group" for kind, r in ROWS.items() if r.megatron},
    **{r.gloo: f"{kind}.gloo" for kind, r in ROWS.items() if r.gloo},
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": "hcp.groups",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": "vpp.rank",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "vpp.size",
    "_EMBEDDING_GLOBAL_RANKS": "embd.ranks",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos-embd.ranks",
    "_PIPELINE_GLOBAL_RANKS": "pp.ranks",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp.ranks",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp.ranks",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep.ranks",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "tp-pp.ranks",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp.ranks",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp-cp.ranks",
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "gtp.ranks",
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "egtp.ranks",
}

#: megatron-core's _MPU_* caches -> our set_* override keys; they win over the groups in both.
FROM_OVERRIDES: dict[str, str] = {
    f"_MPU_{key.upper()}": key for key in OVERRIDES if not key.startswith("virtual")
}

#: What megatron-core holds in a global while nothing is initialized (None unless listed): a
#: factory, since megatron-core fills that dict in place and a shared one would keep its groups.
EMPTY: dict[str, Callable[[], Any]] = {"_HYBRID_DP_CP_GROUPS": dict}


def _process_group_list() -> list[Any] | None:
    from parallel_state.groups import process_groups

    groups = process_groups.process_groups()
    return groups if len(groups) > 1 else None  # [None] alone: nothing was created


def _memory(name: str) -> Any:
    from parallel_state.megatron import memory

    return getattr(memory, name)


#: Globals computed by a function of their own.
COMPUTED = {
    "_HYBRID_DP_CP_GROUPS": lambda: ANSWERS.get("hybrid.groups", {}),
    "_global_process_group_list": _process_group_list,
    "_GLOBAL_MEMORY_BUFFER": lambda: _memory("_GLOBAL_MEMORY_BUFFER"),
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": lambda: _memory("_GLOBAL_SYMMETRIC_MEMORY_BUFFER"),
    "_MPU_DATA_PARALLEL_WORLD_SIZE": lambda: None,  # megatron-core has no setter for it
}

NAMES = frozenset(FROM_ANSWERS) | frozenset(FROM_OVERRIDES) | frozenset(COMPUTED)


def value(name: str) -> Any:
    """The live value of megatron-core's global ``name``."""
    if name in FROM_ANSWERS:
        return ANSWERS.get(FROM_ANSWERS[name])
    if name in FROM_OVERRIDES:
        return _st.overrides.get(FROM_OVERRIDES[name])
    return COMPUTED[name]()


def values() -> dict[str, Any]:
    """Every global's live value."""
    return {name: value(name) for name in NAMES}
