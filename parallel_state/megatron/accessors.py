"""megatron-core's parallel-state accessors: each answer precomputed, a call one global read.

The answers (``parallel_state.megatron.answers``) are computed when the groups are built and when an
override changes. An accessor runs per layer and per micro-batch, so most are written to cost what
megatron-core's own cost (``assert _GROUP is not None; return _GROUP``): a module global read. Those
are written by ``python -m parallel_state.tools.generate`` into ``generated_accessors`` (a module it
writes whole; this one re-exports it) from their rules (``accessor_keys``: which answer each returns
for its flags, with its docstring) and the release table (the parameters of the release in use,
exactly, in its order): each tests its flags, one after another (a flag at False by truth, as
megatron-core tests it; True with ``is``), and returns the global of ``generated_accessors`` holding
that answer. ``_refresh`` (below) sets those globals from the answers after every change of the
state and removes those with no answer (nothing initialized, a kind not built): the read then raises
NameError and, like any other argument values, the call goes to ``accessor_keys.answer``, which
checks the arguments and answers or explains. ``check_initialized`` is never tested on the fast
path: it decides only what happens without an answer.

Why globals and plain parameters: a global read is what megatron-core's accessors cost, while a
closure pays to copy its cells into every call's frame (3 to 6 ns more per call on this project's
2-CPU machine, ``python -m benchmarks.bench_accessors``); and CPython specializes a call only to a
function without ``*args``, ``**kwargs`` or keyword-only parameters, so an accessor takes none of
another release's parameters (about 30 ns more per call otherwise, ``--direct``). Only for a release
parallel_state does not know does one keep them (every known release's keywords, keyword-only,
after the shared positions).

The accessors whose answer depends on more than their flags (pipeline stages with ``vp_stage``, the
hybrid groups, the deprecated names that warn) and the ``set_*`` overrides are written by hand below.
"""

from __future__ import annotations

import warnings
from typing import Any

from parallel_state.errors import ParallelStateAssertionError
from parallel_state.groups import state as _st
from parallel_state.groups.state import Override
from parallel_state.megatron import generated_accessors as _generated
from parallel_state.megatron.answers import ANSWERS as _A
from parallel_state.megatron.answers import lookup as _lookup

# Every accessor with a rule (generated_accessors.__all__, which the generator writes): parallel_state's API
# re-exports them from here, with the ones written below.
from parallel_state.megatron.generated_accessors import *  # noqa: F403
from parallel_state.topology.answer_keys import INITIALIZED, VPP_SIZE, Fact
from parallel_state.topology.arguments import flag, non_negative_int
from parallel_state.topology.kinds import DP_CP, EMBD, HYBRID, PP


def _refresh() -> None:
    """Set every fast-path global (in ``generated_accessors``, whose defs read them) from the answers; remove
    those with no answer."""
    namespace = vars(_generated)
    for variable, key in _generated.VARIABLES.items():
        try:
            namespace[variable] = _A[key]
        except KeyError:
            namespace.pop(variable, None)


_refresh()
_st.on_change(_refresh)  # registered after answers.refresh (imported above), so it reads fresh answers


# --- the accessors written by hand -----------------------------------------------------------

# The keys they read, made once (making a key costs more than reading its answer).
_KEY_DP_CP_GROUP, _KEY_HYBRID_GROUPS = DP_CP.key(Fact.GROUP), HYBRID.key(Fact.GROUPS)
_KEY_PP_IS_FIRST, _KEY_PP_IS_LAST = PP.key(Fact.IS_FIRST), PP.key(Fact.IS_LAST)
_KEY_EMBD_IN, _KEY_EMBD_RANKS = EMBD.key(Fact.IN), EMBD.key(Fact.RANKS)


def is_unitialized() -> bool:
    """Deprecated megatron-core spelling of ``not is_initialized()``."""
    # stacklevel 1, as megatron-core: a deeper level walks frames on every call of a hot deprecated name.
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, 1)
    return not _generated.is_initialized()


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True, group_size: int | None = None) -> Any:
    """The hybrid context-parallel group of ``group_size`` ranks holding this rank (dp x cp itself at full size)."""
    check = flag("check_initialized", check_initialized)
    if not check and INITIALIZED not in _A:
        return None
    if group_size == _generated.get_data_parallel_world_size(with_context_parallel=True):
        return _lookup(_KEY_DP_CP_GROUP) if check else _A.get(_KEY_DP_CP_GROUP)
    groups = _lookup(_KEY_HYBRID_GROUPS) if check else _A.get(_KEY_HYBRID_GROUPS)
    if groups is None:
        return None
    if group_size not in groups:
        raise ParallelStateAssertionError(
            f"no hybrid context-parallel group of {group_size!r} ranks: "
            + (f"the sizes built are {sorted(groups)} and "
               f"{_generated.get_data_parallel_world_size(with_context_parallel=True)}"
               if groups else "initialize with hybrid_context_parallel=True to have them")
        )
    return groups[group_size]


def get_tensor_model_parallel_last_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the last member of this rank's tp (or tp x cp) group."""
    return _generated.get_tensor_model_parallel_ranks(with_context_parallel)[-1]


# --- megatron-core's testing hooks: each overrides one answer (checked by state.set_override) ----------

def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor model parallel world size (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.TENSOR_MODEL_PARALLEL_WORLD_SIZE, world_size)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor model parallel rank (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.TENSOR_MODEL_PARALLEL_RANK, rank)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline model parallel world size (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.PIPELINE_MODEL_PARALLEL_WORLD_SIZE, world_size)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline model parallel rank (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.PIPELINE_MODEL_PARALLEL_RANK, rank)


def set_data_parallel_rank(rank: int | None) -> None:
    """Override the data parallel rank (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.DATA_PARALLEL_RANK, rank)


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the virtual pipeline model parallel world size (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE, world_size)


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the virtual pipeline model parallel rank (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, rank)


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    """Override the expert model parallel world size (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.EXPERT_MODEL_PARALLEL_WORLD_SIZE, world_size)


def set_expert_model_parallel_rank(rank: int | None) -> None:
    """Override the expert model parallel rank (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.EXPERT_MODEL_PARALLEL_RANK, rank)


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    """Override the expert tensor parallel world size (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.EXPERT_TENSOR_PARALLEL_WORLD_SIZE, world_size)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    """Override the expert tensor parallel rank (megatron-core's testing hook); None clears it."""
    _st.set_override(Override.EXPERT_TENSOR_PARALLEL_RANK, rank)


# --- pipeline stages -------------------------------------------------------------------------

def _vp_stage(vp_stage: int | None, vpp: int) -> int:
    if vp_stage is None:
        raise ParallelStateAssertionError("vp_stage must be passed when the virtual pipeline is enabled")
    stage = non_negative_int("vp_stage", vp_stage)
    if stage >= vpp:
        raise ParallelStateAssertionError(
            f"vp_stage={stage} is not a model chunk: the virtual pipeline has chunks 0..{vpp - 1}")
    return stage


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the first pipeline stage (and, unless ignore_virtual, the first chunk)."""
    if ignore_virtual is not True and not flag("ignore_virtual", ignore_virtual):
        vpp = _lookup(VPP_SIZE)
        if vpp is not None and _vp_stage(vp_stage, vpp) != 0:
            return False
    return _A[_KEY_PP_IS_FIRST] if _KEY_PP_IS_FIRST in _A else _lookup(_KEY_PP_IS_FIRST)  # no call where it is there


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the last pipeline stage (and, unless ignore_virtual, the last chunk)."""
    if ignore_virtual is not True and not flag("ignore_virtual", ignore_virtual):
        vpp = _lookup(VPP_SIZE)
        if vpp is not None and _vp_stage(vp_stage, vpp) != vpp - 1:
            return False
    return _A[_KEY_PP_IS_LAST] if _KEY_PP_IS_LAST in _A else _lookup(_KEY_PP_IS_LAST)  # no call where it is there


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank holds word embeddings (unless ignore_virtual: in the model chunk that does)."""
    if _KEY_EMBD_IN not in _A or _A[_KEY_EMBD_IN] is not True:
        return False
    if ignore_virtual is True or flag("ignore_virtual", ignore_virtual):
        return True
    import torch.distributed as dist

    ranks, rank = _lookup(_KEY_EMBD_RANKS), dist.get_rank()
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


# --- the short names MAGI-1 and WorldFoundry call ----------------------------------------------
get_cp_group = _generated.get_context_parallel_group
get_cp_rank = _generated.get_context_parallel_rank
get_cp_world_size = _generated.get_context_parallel_world_size
get_pp_group = _generated.get_pipeline_model_parallel_group
get_pp_rank = _generated.get_pipeline_model_parallel_rank
get_pp_world_size = _generated.get_pipeline_model_parallel_world_size
get_dp_group = _generated.get_data_parallel_group
get_dp_rank = _generated.get_data_parallel_rank
get_dp_world_size = _generated.get_data_parallel_world_size
get_dp_group_gloo = _generated.get_data_parallel_group_gloo
