"""megatron-core's parallel-state accessors, as thin reads of the one live state object.

Most accessors repeat one of a few shapes (a group, a rank in it, its size, its global ranks)
for a group kind; they are made by the factories below, one line each. Ranks and sizes come
from the plan, so they cost no call into torch. As in megatron-core, the data- and
context-parallel ranks and sizes read 0 while torch.distributed is not initialized.
"""

from __future__ import annotations

from typing import Any, Callable

from parallel_state import state as _st
from parallel_state.arguments import flag, non_negative_int, positive_int
from parallel_state.errors import ParallelStateError


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _kind(kind: str, cp_kind: str | None, with_context_parallel: bool) -> str:
    return cp_kind if (flag("with_context_parallel", with_context_parallel) and cp_kind) else kind


def _no_partial(partial_data_parallel: bool) -> None:
    if flag("partial_data_parallel", partial_data_parallel):
        raise NotImplementedError("partial data parallel groups are not supported; pass partial_data_parallel=False")


def _group_getter(kind: str, label: str) -> Callable[..., Any]:
    def get(check_initialized: bool = True) -> Any:
        check = flag("check_initialized", check_initialized)
        state = _st.peek()
        if state is None:
            if check:
                _st.current(f"get the {label} group")
            return None
        return state.groups[kind]

    get.__doc__ = f"This rank's {label} group."
    return get


def _number_getter(kind: str, label: str, override: str | None, cp_kind: str | None, zero_without_dist: bool,
                   answer: Callable[[_st.ParallelState, str], int], noun: str) -> Callable[..., int]:
    def get(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
        _no_partial(partial_data_parallel)
        which = _kind(kind, cp_kind, with_context_parallel)
        if override and override in _st.overrides:
            return _st.overrides[override]
        if zero_without_dist and not _dist_ready():
            return 0
        return answer(_st.current(f"get the {label} {noun}"), which)

    return get


def _rank_getter(kind: str, label: str, override: str | None = None,
                 cp_kind: str | None = None, zero_without_dist: bool = False) -> Callable[..., int]:
    get = _number_getter(kind, label, override, cp_kind, zero_without_dist,
                         lambda state, which: state.group_rank(which), "rank")
    get.__doc__ = f"This rank's index in its {label} group."
    return get


def _size_getter(kind: str, label: str, override: str | None = None,
                 cp_kind: str | None = None, zero_without_dist: bool = False) -> Callable[..., int]:
    get = _number_getter(kind, label, override, cp_kind, zero_without_dist,
                         lambda state, which: state.plan.group_size(which), "world size")
    get.__doc__ = f"Number of ranks in this rank's {label} group."
    return get


def _ranks_getter(kind: str, label: str, cp_kind: str | None = None) -> Callable[..., list[int]]:
    def get(with_context_parallel: bool = False, check_initialized: bool = True) -> Any:
        which = _kind(kind, cp_kind, with_context_parallel)
        if _st.peek() is None and not flag("check_initialized", check_initialized):
            return None
        flag("check_initialized", check_initialized)
        state = _st.current(f"get the {label} ranks")
        return list(state.ranks(which))

    get.__doc__ = f"Global ranks of this rank's {label} group."
    return get


def _setter(key: str) -> Callable[[Any], None]:
    check = positive_int if key.endswith("world_size") else non_negative_int

    def set_(value: Any) -> None:
        if value is None:
            _st.overrides.pop(key, None)
        else:
            _st.overrides[key] = check(key, value)

    set_.__doc__ = f"Override the {key.replace('_', ' ')} (megatron-core's testing hook); None clears it."
    return set_


# --- lifecycle -------------------------------------------------------------------------------

def is_initialized() -> bool:
    """Whether the model-parallel groups exist (megatron-core: the data-parallel group is set)."""
    return _st.peek() is not None


def model_parallel_is_initialized() -> bool:
    """Whether the tensor-, pipeline- and data-parallel groups exist."""
    return _st.peek() is not None


def is_unitialized() -> bool:
    """Deprecated megatron-core spelling of ``not is_initialized()``."""
    import warnings

    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2)
    return not is_initialized()


# --- groups ----------------------------------------------------------------------------------

get_model_parallel_group = _group_getter("tp-pp", "model-parallel (tp-pp)")
get_tensor_model_parallel_group = _group_getter("tp", "tensor-model-parallel")
get_pipeline_model_parallel_group = _group_getter("pp", "pipeline-model-parallel")
get_context_parallel_group = _group_getter("cp", "context-parallel")
get_tensor_and_context_parallel_group = _group_getter("tp-cp", "tensor-and-context-parallel")


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False,
                            independent_all_gather: bool = False) -> Any:
    """This rank's data-parallel group (dp x cp with ``with_context_parallel``)."""
    _no_partial(partial_data_parallel)
    if flag("independent_all_gather", independent_all_gather):
        raise NotImplementedError("separate all-gather groups are not supported; pass independent_all_gather=False")
    return _st.current("get the data-parallel group").groups[_kind("dp", "dp-cp", with_context_parallel)]


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> Any:
    """This rank's gloo data-parallel group (dp x cp with ``with_context_parallel``)."""
    _no_partial(partial_data_parallel)
    kind = _kind("dp", "dp-cp", with_context_parallel)
    state = _st.current("get the gloo data-parallel group")
    if not state.gloo_groups:
        raise ParallelStateError(
            "the gloo data-parallel group was not created: initialize_model_parallel was called "
            "with create_gloo_process_groups=False; initialize with create_gloo_process_groups=True to have it"
        )
    return state.gloo_groups[kind]


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False) -> Any:
    """This rank's tp x dp group (tp x dp x cp with ``with_context_parallel``)."""
    kind = _kind("tp-dp", "tp-dp-cp", with_context_parallel)
    check = flag("check_initialized", check_initialized)
    state = _st.peek()
    if state is None:
        if check:
            _st.current("get the tensor-and-data-parallel group")
        return None
    return state.groups[kind]


_cp_global_ranks = _ranks_getter("cp", "context-parallel")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> Any:
    """Global ranks of this rank's context-parallel group."""
    return _cp_global_ranks(check_initialized=check_initialized)


# --- ranks and sizes -------------------------------------------------------------------------

get_tensor_model_parallel_world_size = _size_getter("tp", "tensor-model-parallel", "tensor_model_parallel_world_size")
get_tensor_model_parallel_rank = _rank_getter("tp", "tensor-model-parallel", "tensor_model_parallel_rank")
get_pipeline_model_parallel_world_size = _size_getter("pp", "pipeline-model-parallel", "pipeline_model_parallel_world_size")
get_pipeline_model_parallel_rank = _rank_getter("pp", "pipeline-model-parallel", "pipeline_model_parallel_rank")
get_data_parallel_world_size = _size_getter("dp", "data-parallel", "data_parallel_world_size", "dp-cp", True)
get_data_parallel_rank = _rank_getter("dp", "data-parallel", "data_parallel_rank", "dp-cp", True)
get_context_parallel_world_size = _size_getter("cp", "context-parallel", zero_without_dist=True)
get_context_parallel_rank = _rank_getter("cp", "context-parallel", zero_without_dist=True)
get_tensor_and_context_parallel_world_size = _size_getter("tp-cp", "tensor-and-context-parallel", zero_without_dist=True)
get_tensor_and_context_parallel_rank = _rank_getter("tp-cp", "tensor-and-context-parallel", zero_without_dist=True)

set_tensor_model_parallel_world_size = _setter("tensor_model_parallel_world_size")
set_tensor_model_parallel_rank = _setter("tensor_model_parallel_rank")
set_pipeline_model_parallel_world_size = _setter("pipeline_model_parallel_world_size")
set_pipeline_model_parallel_rank = _setter("pipeline_model_parallel_rank")
set_data_parallel_rank = _setter("data_parallel_rank")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's tensor-model-parallel group."""
    return _st.current("get_tensor_model_parallel_src_rank").ranks("tp")[0]


def get_model_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's model-parallel (tp-pp) group."""
    return _st.current("get_model_parallel_src_rank").ranks("tp-pp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's data-parallel group."""
    return _st.current("get_data_parallel_src_rank").ranks(_kind("dp", "dp-cp", with_context_parallel))[0]


# --- pipeline --------------------------------------------------------------------------------

def _pipeline_neighbour(step: int, what: str) -> int:
    state = _st.current(what)
    ranks = state.ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + step) % len(ranks)]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this rank's pipeline."""
    return _st.current("get_pipeline_model_parallel_first_rank").ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    return _st.current("get_pipeline_model_parallel_last_rank").ranks("pp")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage; the last stage's next is the first (a ring)."""
    return _pipeline_neighbour(1, "get_pipeline_model_parallel_next_rank")


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage; the first stage's previous is the last (a ring)."""
    return _pipeline_neighbour(-1, "get_pipeline_model_parallel_prev_rank")


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """The interleaved schedule's number of model chunks per stage, or None."""
    state = _st.peek()
    return _st.overrides.get("virtual_pipeline_model_parallel_world_size",
                             state.virtual_pipeline_size if state else None)


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The current model chunk of the interleaved schedule, or None."""
    state = _st.peek()
    return _st.overrides.get("virtual_pipeline_model_parallel_rank",
                             state.virtual_pipeline_rank if state else None)


set_virtual_pipeline_model_parallel_world_size = _setter("virtual_pipeline_model_parallel_world_size")
set_virtual_pipeline_model_parallel_rank = _setter("virtual_pipeline_model_parallel_rank")


def _vp_stage(vp_stage: int | None, vpp: int) -> int:
    if vp_stage is None:
        raise ParallelStateError("vp_stage must be passed when the virtual pipeline is enabled")
    stage = non_negative_int("vp_stage", vp_stage)
    if stage >= vpp:
        raise ParallelStateError(f"vp_stage={stage} is not a model chunk: the virtual pipeline has chunks 0..{vpp - 1}")
    return stage


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the first pipeline stage (and, unless ignore_virtual, the first chunk)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not flag("ignore_virtual", ignore_virtual) and vpp is not None:
        if _vp_stage(vp_stage, vpp) != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the last pipeline stage (and, unless ignore_virtual, the last chunk)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not flag("ignore_virtual", ignore_virtual) and vpp is not None:
        if _vp_stage(vp_stage, vpp) != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_all_ranks() -> str:
    """This rank's tp, dp, cp, pp and ep ranks joined by '_' (megatron-core's format)."""
    return "_".join(str(r) for r in (get_tensor_model_parallel_rank(), get_data_parallel_rank(),
                                      get_context_parallel_rank(), get_pipeline_model_parallel_rank(), 0))


# --- the short names MAGI-1 and WorldFoundry call ---------------------------------------------

def get_tp_group(with_context_parallel: bool = False) -> Any:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return _st.current("get_tp_group").groups[_kind("tp", "tp-cp", with_context_parallel)]


get_tp_rank = _rank_getter("tp", "tensor-model-parallel", "tensor_model_parallel_rank", "tp-cp")
get_tp_world_size = _size_getter("tp", "tensor-model-parallel", "tensor_model_parallel_world_size", "tp-cp")
get_cp_group = get_context_parallel_group
get_cp_rank = get_context_parallel_rank
get_cp_world_size = get_context_parallel_world_size
get_pp_group = get_pipeline_model_parallel_group
get_pp_rank = get_pipeline_model_parallel_rank
get_pp_world_size = get_pipeline_model_parallel_world_size
get_dp_group = get_data_parallel_group
get_dp_rank = get_data_parallel_rank
get_dp_world_size = get_data_parallel_world_size
get_dp_group_gloo = get_data_parallel_group_gloo
get_tensor_model_parallel_ranks = _ranks_getter("tp", "tensor-model-parallel", "tp-cp")


def get_tensor_model_parallel_last_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the last member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[-1]
