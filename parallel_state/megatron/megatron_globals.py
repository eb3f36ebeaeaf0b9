"""megatron-core's private module globals, each read from the live answers (no second copy of the state).

Libraries and tests read ``megatron.core.parallel_state._TENSOR_MODEL_PARALLEL_GROUP`` and its
siblings directly. ``parallel_state.<that name>`` answers through the package's module
``__getattr__`` with the live value (None when nothing is initialized), and the bridge writes
the same values into megatron-core's module. Writing them is ``megatron.writes``.
"""

from __future__ import annotations

from typing import Any, Callable

from parallel_state.groups import state as _st
from parallel_state.groups.state import Override
from parallel_state.megatron.answers import ANSWERS, GLOBALS, OVERRIDES
from parallel_state.topology.answer_keys import VPP_RANK, VPP_SIZE, AnswerKey
from parallel_state.topology.kinds import ROWS

#: What megatron-core holds in a global while nothing is initialized (None unless listed): a
#: factory, since megatron-core fills that dict in place and a shared one would keep its groups.
EMPTY: dict[str, Callable[[], Any]] = {r.megatron: r.empty for r in ROWS if r.empty is not None}

#: The globals megatron-core's set_* functions write -> our set_* override key: its _MPU_* caches (which
#: win over the groups) and the virtual pipeline's two.
SETTERS: dict[str, Override] = {(f"_{key.upper()}" if key.startswith("virtual") else f"_MPU_{key.upper()}"): key
                                for key in OVERRIDES}

#: megatron-core global -> the answer it holds (the kinds' rows, ``answers.GLOBALS``, and the virtual
#: pipeline's, which is no kind); those with an empty value are computed below.
FROM_ANSWERS: dict[str, AnswerKey] = {
    **{name: key for name, key in GLOBALS.items() if name not in EMPTY},
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": VPP_RANK,
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": VPP_SIZE,
}

#: megatron-core's _MPU_* caches -> our set_* override keys; they win over the groups in both.
FROM_OVERRIDES: dict[str, Override] = {name: key for name, key in SETTERS.items() if name.startswith("_MPU_")}

#: The memory buffers: globals of ``megatron.memory``, which their getters read.
BUFFERS = ("_GLOBAL_MEMORY_BUFFER", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER")


def _process_group_list() -> list[Any] | None:
    from parallel_state.groups import process_groups

    groups = process_groups.process_groups()
    return groups if len(groups) > 1 else None  # [None] alone: nothing was created


def _memory(name: str) -> Any:
    from parallel_state.megatron import memory

    return getattr(memory, name)


#: Globals computed by a function of their own.
COMPUTED: dict[str, Callable[[], Any]] = {
    **{name: (lambda key=GLOBALS[name], empty=empty: ANSWERS.get(key, empty())) for name, empty in EMPTY.items()},
    "_global_process_group_list": _process_group_list,
    **{name: (lambda name=name: _memory(name)) for name in BUFFERS},
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
