"""Make ``megatron.core.parallel_state`` answer with this project's process groups.

megatron-core's accessors read module globals; the bridge points those globals at the groups
``initialize_model_parallel`` built (the very objects, no second set of groups), and the teardown
hook points them back to None. While bridged, megatron-core's own ``destroy_model_parallel`` is
routed to ours, so the groups are destroyed once, by their owner: megatron's version would call
``destroy_process_group`` on the gloo data-parallel groups, which are ours (and, on a gloo world,
the data-parallel groups themselves).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from parallel_state.errors import ParallelStateError
from parallel_state.groups import state as _st
from parallel_state.topology import releases

_MEGATRON = "megatron.core.parallel_state"

#: Globals whose being set means megatron-core holds live groups.
_LIVE = ("_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
         "_CONTEXT_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP")

#: The state megatron-core currently reads, what we wrote into it, and megatron-core's own destroy.
_bridged: _st.ParallelState | None = None
_written: dict[str, Any] = {}
_megatron_destroy: Callable[[], None] | None = None


def import_megatron() -> Any:
    """``megatron.core.parallel_state``, or an ImportError saying how to install megatron-core."""
    try:
        import megatron.core.parallel_state as mps
    except ImportError as exc:
        raise ImportError(
            "parallel_state.bridge_megatron() needs megatron-core, which is not importable "
            f"({exc}); install it with: pip install parallel-state[megatron]"
        ) from exc
    return mps


def megatron_clash() -> str | None:
    """Why megatron-core cannot be bridged now (it holds groups it built itself), or None.

    Reads ``sys.modules`` only: never imports megatron-core.
    """
    mps = sys.modules.get(_MEGATRON)
    if mps is None:
        return None
    ours = {id(g) for g in _bridged.groups.values()} if _bridged is not None else set()
    foreign = [name for name in _LIVE if getattr(mps, name, None) is not None and id(getattr(mps, name)) not in ours]
    if not foreign:
        return None
    return (
        f"megatron.core.parallel_state already holds process groups it created itself ({', '.join(foreign)}): "
        f"megatron.core.parallel_state.initialize_model_parallel was called. Use one of the two: call "
        f"megatron.core.parallel_state.destroy_model_parallel() before parallel_state.initialize_model_parallel"
    )


def bridge_megatron() -> bool:
    """Point ``megatron.core.parallel_state`` at this project's live groups; return whether it now reads them.

    After it, every megatron-core global that its own ``initialize_model_parallel`` sets (the
    groups of every kind, expert, embedding and distributed-optimizer ones included, their
    global ranks, the gloo groups, the memory buffer) holds the very object ``parallel_state``
    returns, so megatron-core's accessors and the code that reads its globals see our groups.
    Before ``initialize_model_parallel`` it only loads megatron-core and returns False:
    initialize then bridges by itself. Idempotent.
    ``destroy_model_parallel()`` (ours, or megatron-core's while bridged) resets megatron-core's view.

    Raises ImportError (saying ``pip install parallel-state[megatron]``) without megatron-core,
    and ParallelStateError when megatron-core already holds groups it built itself.
    """
    global _bridged, _megatron_destroy
    mps = import_megatron()
    state = _st.peek()
    if state is None:
        return False
    clash = megatron_clash()
    if clash is not None:
        raise ParallelStateError(clash)
    from parallel_state.megatron import megatron_globals

    # Only the globals the loaded release has (the release table's GLOBALS: 0.19 adds the gtp_remat
    # ones, 0.18 drops the all-gather one); for a release the table does not know, those its module has.
    values = {name: value for name, value in megatron_globals.values().items() if _has(mps, name)}
    # Everything that can fail has run; from here on only assignments.
    for name, value in values.items():
        setattr(mps, name, value)
    _written.clear()
    _written.update(values)
    if mps.destroy_model_parallel is not _routed_megatron_destroy:
        _megatron_destroy = mps.destroy_model_parallel
        mps.destroy_model_parallel = _routed_megatron_destroy
    _bridged = state
    _st.register_teardown_hook(_unbridge)
    from parallel_state.megatron.cp_size_t import mirror_cp_size_t

    mirror_cp_size_t()
    return True


def _has(mps: Any, name: str) -> bool:
    """Whether the loaded megatron-core ``mps`` has the global ``name``: the release table's answer for its release."""
    known = releases.has_global(name, releases.installed() or releases.DEFAULT)
    return hasattr(mps, name) if known is None else known


def _follow_overrides() -> None:
    """Change hook: a set_* override made while bridged reaches megatron-core's _MPU_* globals too."""
    mps = sys.modules.get(_MEGATRON)
    if _bridged is None or mps is None or _st.peek() is not _bridged:
        return
    from parallel_state.megatron import megatron_globals

    for name in megatron_globals.FROM_OVERRIDES:
        if not _has(mps, name):
            continue
        value = megatron_globals.value(name)
        setattr(mps, name, value)
        _written[name] = value
    for name in ("_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"):
        _written[name] = megatron_globals.value(name)
        setattr(mps, name, _written[name])


_st.on_change(_follow_overrides)


def is_bridged() -> bool:
    """Whether megatron-core currently reads this project's groups."""
    return _bridged is not None


def _unbridge() -> None:
    """Teardown hook: point megatron-core's globals back to None and give it back its destroy function."""
    global _bridged
    mps = sys.modules.get(_MEGATRON)
    if mps is not None:
        from parallel_state.megatron.megatron_globals import EMPTY

        for name, value in _written.items():
            # Only what still holds our value: megatron-core may have been reset meanwhile.
            if value is not None and getattr(mps, name, None) is value:
                setattr(mps, name, EMPTY[name]() if name in EMPTY else None)
        if _megatron_destroy is not None and mps.destroy_model_parallel is _routed_megatron_destroy:
            mps.destroy_model_parallel = _megatron_destroy
    _written.clear()
    _bridged = None


def _routed_megatron_destroy() -> None:
    """megatron-core's destroy_model_parallel while bridged: tear down once, through parallel_state."""
    # The state's own teardown (what destroy_model_parallel runs), so the bridge needs nothing of
    # initialize, which imports the bridge.
    _st.teardown()
    if _megatron_destroy is not None:
        _megatron_destroy()  # resets megatron-core's other globals; the gloo ones are None by now
