"""Writes of megatron-core's private globals, and its private functions that code calls from outside.

Code that initializes megatron-core by hand writes its module globals and calls
``_set_global_memory_buffer()`` (TeleTron's ``initialize_model_parallel_base``, Megatron-Bridge's
decentralized process groups and MIMO models, megatron-core's checkpoint converters). On
``parallel_state`` such a write (``parallel_state._CONTEXT_PARALLEL_GROUP = group``: the package's
module type sends it here) takes effect in every getter as in megatron-core, through the one
path every answer takes (``state.written`` -> ``state.on_change`` -> the answers), or raises
naming the public way. Where megatron-core is loaded, the bridge then mirrors it into
megatron-core's module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.groups import state as _st
from parallel_state.megatron import bridge, memory
from parallel_state.megatron.answers import GLOBALS
from parallel_state.megatron.megatron_globals import BUFFERS, SETTERS
from parallel_state.topology.answer_keys import Fact, parts
from parallel_state.topology.arguments import is_int

#: Globals a write cannot take effect in, and the public way to do what it meant.
READ_ONLY: dict[str, str] = {
    "_global_process_group_list": (
        "it lists the groups update_pg_timeout(pg=None) updates, which initialize_model_parallel and "
        "parallel_state.create_group(...) record; create the group with create_group, or pass it to "
        "update_pg_timeout(timeout, pg=group)"),
}


#: Per global, what each write in force replaced (oldest first), for ``del`` to put back; emptied on destroy.
_replaced: dict[str, list[Any]] = {}
_ABSENT = object()  # a global nothing was written to
_st.register_teardown_hook(_replaced.clear)


def write(name: str, value: Any) -> None:
    """``parallel_state.<name> = value`` for megatron-core's global ``name``, as megatron-core takes it.

    A group, gloo group, global-ranks or family global replaces that answer (and the rank and
    size read from a group) until ``destroy_model_parallel()``; a global a set_* function writes
    (``_MPU_*``, the virtual pipeline's) is that call; a memory buffer is the buffer its getter
    returns. Raises where the write cannot take effect, naming the public way, and on a value
    megatron-core's getters could not use; then nothing changed.
    """
    if name in READ_ONLY:
        raise ParallelStateError(f"parallel_state.{name} cannot be written: {READ_ONLY[name]}")
    made = parts(GLOBALS[name]) if name in GLOBALS else None
    what = made[1] if made is not None else None
    if value is not None and what in (Fact.GROUP, Fact.GLOO):
        _check_group(name, value)
    elif value is not None and what is Fact.RANKS:
        _check_ranks(name, value)
    previous, replaced = _current(name), _replaced.setdefault(name, [])
    _put(name, value)
    if replaced and value is replaced[-1]:
        replaced.pop()  # back to what the last write replaced (saved, swapped, restored): that write is undone
    elif value is not previous:
        replaced.append(previous)


def forget(name: str) -> None:
    """``del parallel_state.<name>``: put back what the last write of it replaced (as
    ``unittest.mock.patch.object`` restores a global it patched); with no write to undo, nothing."""
    if name in READ_ONLY:
        raise ParallelStateError(f"parallel_state.{name} cannot be deleted: {READ_ONLY[name]}")
    if _replaced.get(name):
        _put(name, _replaced[name].pop())


def _current(name: str) -> Any:
    """What a write of ``name`` replaces: the override, the buffer, or the write (``_ABSENT``: none)."""
    if name in SETTERS:
        return _st.overrides.get(SETTERS[name])
    if name in BUFFERS:
        return getattr(memory, name)
    return _st.written.get(name, _ABSENT)


def _put(name: str, value: Any) -> None:
    if name in SETTERS:
        _st.set_override(SETTERS[name], value, name=f"parallel_state.{name}")
    elif name in BUFFERS:
        memory.replace_buffer(name, value)
    elif value is _ABSENT:
        _st.forget_global(name)
    else:
        _st.write_global(name, value)
    bridge.follow_write()


def _set_global_memory_buffer() -> None:
    """megatron-core's private function: create the global memory buffer (an AssertionError if there is one)."""
    memory.set_global_memory_buffer()
    bridge.follow_write()


def _set_global_symmetric_memory_buffer() -> None:
    """megatron-core 0.16's private function, called by its dynamic inference context: the global symmetric
    memory buffer over the tensor-parallel group (needs CUDA)."""
    from parallel_state.megatron.accessors import get_tensor_model_parallel_group

    memory.set_global_symmetric_memory_buffer(get_tensor_model_parallel_group())
    bridge.follow_write()


#: megatron-core's private functions that its own code and its known clients call from outside its
#: parallel_state (megatron-core 0.16 to 0.19, Megatron-Bridge, NeMo, TeleTron): served by the package.
FUNCTIONS = {f.__name__: f for f in (_set_global_memory_buffer, _set_global_symmetric_memory_buffer)}


def _check_group(name: str, group: Any) -> None:
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise ParallelStateTypeError(
            f"parallel_state.{name} holds a process group: write a torch.distributed.ProcessGroup this rank "
            f"is a member of (an object with rank() and size()), or None; got {group!r}")


def _check_ranks(name: str, ranks: Any) -> None:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not all(is_int(r) for r in ranks):
        raise ParallelStateTypeError(
            f"parallel_state.{name} holds a group's global ranks: write a list (or range) of ints such as "
            f"[0, 2], or None; got {ranks!r}")
