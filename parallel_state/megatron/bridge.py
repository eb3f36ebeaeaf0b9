"""Make ``megatron.core.parallel_state`` answer with this project's process groups.

megatron-core's accessors read module globals; the bridge points those globals at the groups
``initialize_model_parallel`` built (the very objects, no second set of groups) and at whatever
was written to ``parallel_state``'s private globals, follows every later change of them, and the
teardown hook points them back to None. While bridged, megatron-core's own
``destroy_model_parallel`` is routed to ours, so the groups are destroyed once, by their owner:
megatron's version would call ``destroy_process_group`` on the gloo data-parallel groups, which
are ours (and, on a gloo world, the data-parallel groups themselves).

A write to megatron-core's own module while bridged is megatron-core's: its getters read it, as
they always do, and parallel_state's do not (intercepting it needs a module type of its own, which
would slow every ``mpu.get_*()`` call megatron-core's code makes); the bridge writes that global
again only when parallel_state's value of it changes, and destroy clears it.
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

#: Whether megatron-core currently reads parallel_state's globals, what we wrote into it, and
#: megatron-core's own destroy.
_bridged = False
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
    ours = {id(value) for value in _written.values()}
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
    returns, so megatron-core's accessors and the code that reads its globals see our groups,
    and holds it again after every change (an override, a write of a private global). Before
    ``initialize_model_parallel`` (or a write of one of megatron-core's globals) it only loads
    megatron-core and returns False: initialize (or the write) then bridges by itself. Idempotent.
    ``destroy_model_parallel()`` (ours, or megatron-core's while bridged) resets megatron-core's view.

    Raises ImportError (saying ``pip install parallel-state[megatron]``) without megatron-core,
    and ParallelStateError when megatron-core already holds groups it built itself.
    """
    global _bridged, _megatron_destroy
    mps = import_megatron()
    if _st.peek() is None and not _st.written:
        return False
    clash = megatron_clash()
    if clash is not None:
        raise ParallelStateError(clash)
    values = _values(mps)
    # Everything that can fail has run; from here on only assignments.
    for name, value in values.items():
        setattr(mps, name, value)
    _written.clear()
    _written.update(values)
    if mps.destroy_model_parallel is not _routed_megatron_destroy:
        _megatron_destroy = mps.destroy_model_parallel
        mps.destroy_model_parallel = _routed_megatron_destroy
    _bridged = True
    _st.register_teardown_hook(_unbridge)
    from parallel_state.megatron.cp_size_t import mirror_cp_size_t

    mirror_cp_size_t()
    return True


def _has(mps: Any, name: str) -> bool:
    """Whether the loaded megatron-core ``mps`` has the global ``name``: the release table's answer for its release."""
    known = releases.has_global(name, releases.installed() or releases.DEFAULT)
    return hasattr(mps, name) if known is None else known


def _values(mps: Any) -> dict[str, Any]:
    """parallel_state's value of each global the loaded megatron-core ``mps`` has."""
    from parallel_state.megatron import megatron_globals

    # Only the globals the loaded release has (the release table's GLOBALS: 0.19 adds the gtp_remat
    # ones, 0.18 drops the all-gather one); for a release the table does not know, those its module has.
    return {name: value for name, value in megatron_globals.values().items() if _has(mps, name)}


def _follow() -> None:
    """Change hook: while bridged, each global whose value changed (a set_* override, a write of a
    private global) reaches megatron-core's module too; the others stay as they are."""
    mps = sys.modules.get(_MEGATRON)
    if not _bridged or mps is None:
        return
    for name, value in _values(mps).items():
        # Equal is unchanged: a refresh makes new lists of the same global ranks.
        if name not in _written or not (_written[name] is value or _written[name] == value):
            setattr(mps, name, value)
            _written[name] = value


_st.on_change(_follow)


def follow_write() -> None:
    """After a write of one of megatron-core's globals on parallel_state: where megatron-core is loaded,
    bridge it (unless it holds groups it built itself, then it keeps them), or bring it up to date."""
    mps = sys.modules.get(_MEGATRON)
    if mps is None:
        return
    if _bridged:
        _follow()
    elif megatron_clash() is None:
        bridge_megatron()


def _unbridge() -> None:
    """Teardown hook: point megatron-core's globals back to None and give it back its destroy function."""
    global _bridged
    mps = sys.modules.get(_MEGATRON)
    if mps is not None:
        from parallel_state.megatron.megatron_globals import EMPTY

        # Every global bridged, also one written on megatron-core's module meanwhile: destroy clears it
        # there too, as megatron-core's own destroy would.
        for name in _written:
            setattr(mps, name, EMPTY[name]() if name in EMPTY else None)
        if _megatron_destroy is not None and mps.destroy_model_parallel is _routed_megatron_destroy:
            mps.destroy_model_parallel = _megatron_destroy
    _written.clear()
    _bridged = False


def _routed_megatron_destroy() -> None:
    """megatron-core's destroy_model_parallel while bridged: tear down once, through parallel_state."""
    # The state's own teardown (what destroy_model_parallel runs), so the bridge needs nothing of
    # initialize, which imports the bridge.
    _st.teardown()
    if _megatron_destroy is not None:
        _megatron_destroy()  # resets megatron-core's other globals; the gloo ones are None by now
