"""megatron-core's parallel-state accessors, each a lookup in the precomputed answers.

The answers (``parallel_state.megatron.answers``) are computed when the groups are built and when an
override changes, so a call costs one dict lookup; arguments are validated only off the
default path. Most accessors repeat one of a few shapes and are made by the factories below,
one line each, with megatron-core's parameter names and defaults. Where the parameters differ
between megatron-core releases, the reference below takes every release's, without defaults: the
accessor's signature (exactly the release in use's parameters, in its order, with their defaults)
is the release table's (``release_table.SIGNATURES``), and its fast twin (``compiled``) passes
every argument to the reference by keyword, the other releases' at their defaults.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from parallel_state.errors import ParallelStateAssertionError
from parallel_state.groups import state as _st
from parallel_state.groups.state import Override
from parallel_state.megatron.answers import ANSWERS as _A
from parallel_state.megatron.answers import lookup as _lookup
from parallel_state.megatron.compiled import compile_accessor
from parallel_state.topology.answer_keys import ALL_RANKS, INITIALIZED, VPP_RANK, VPP_SIZE, AnswerKey, Fact
from parallel_state.topology.arguments import flag, non_negative_int
from parallel_state.topology.kinds import (
    CP,
    DIST_OPT,
    DP,
    DP_CP,
    DP_CP_AG,
    DP_CP_INTRA,
    EDP,
    EDP_INTER,
    EDP_INTRA,
    EGTP,
    EGTP_EDP,
    EGTP_EDP_INTRA,
    EMBD,
    EP,
    ETP,
    ETP_EP,
    ETP_EP_EGTP_PP,
    ETP_EP_PP,
    GTP,
    GTP_DP,
    GTP_DP_CP,
    GTP_DP_CP_INTRA,
    HCP,
    HYBRID,
    POS_EMBD,
    PP,
    TP,
    TP_CP,
    TP_DP,
    TP_DP_CP,
    TP_PP,
    Kind,
)

#: reference accessor -> its fast path (variant -> answer key), compiled at the end of the module.
_FAST: dict[Callable[..., Any], dict[str, AnswerKey]] = {}


def _fast(fn: Callable[..., Any], **variants: AnswerKey) -> Callable[..., Any]:
    """Record ``fn``'s fast path: ``default=KEY`` for its default arguments; ``cp``, ``cp_partial``,
    ``cp_all_gather``, ``partial``, ``tp_only``, ``cp_tp_only`` for those flags turned on (see ``compiled``)."""
    _FAST[fn] = variants
    return fn


def _value(key: AnswerKey, doc: str) -> Callable[[], Any]:
    def get() -> Any:
        return _lookup(key)

    get.__doc__ = doc
    return _fast(get, default=key)


def _group(key: AnswerKey, doc: str) -> Callable[..., Any]:
    def get(check_initialized: bool = True) -> Any:
        if check_initialized is True:
            return _lookup(key)
        return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)

    get.__doc__ = doc
    return _fast(get, default=key)


#: (spans gtp_remat, with context parallel, partial) -> the data-parallel kind; the expert ones without cp.
_DP_KINDS: dict[tuple[bool, bool, bool], Kind] = {
    (True, False, False): GTP_DP, (False, False, False): DP, (True, True, False): GTP_DP_CP,
    (False, True, False): DP_CP, (True, True, True): GTP_DP_CP_INTRA, (False, True, True): DP_CP_INTRA}
_EDP_KINDS: dict[tuple[bool, bool], Kind] = {
    (True, False): EGTP_EDP, (False, False): EDP, (True, True): EGTP_EDP_INTRA, (False, True): EDP_INTRA}


def _keys(kinds: dict[Any, Kind], fact: Fact) -> dict[Any, AnswerKey]:
    """``fact``'s key of each kind of ``kinds``, made once (making a key costs more than reading its answer)."""
    return {flags: kind.key(fact) for flags, kind in kinds.items()}


def _dp_key(keys: dict[tuple[bool, bool, bool], AnswerKey], with_context_parallel: Any, partial_data_parallel: Any,
            with_gtp_remat: Any = True) -> AnswerKey:
    """A data-parallel accessor's key among ``keys`` (a fact's, by ``_keys``); ``with_gtp_remat`` (0.19, default
    True) spans gtp_remat."""
    cp, partial = flag("with_context_parallel", with_context_parallel), flag("partial_data_parallel", partial_data_parallel)
    if partial and not cp:
        raise ParallelStateAssertionError(
            "partial data parallelism (distributed-optimizer instances) includes context parallelism: "
            "pass with_context_parallel=True together with partial_data_parallel=True"
        )
    return keys[(flag("with_gtp_remat", with_gtp_remat), cp, partial)]


def _dp_number(what: Fact, doc: str) -> Callable[..., int]:
    keys = _keys(_DP_KINDS, what)

    def get(with_context_parallel: bool, with_gtp_remat: bool, partial_data_parallel: bool) -> int:
        return _lookup(_dp_key(keys, with_context_parallel, partial_data_parallel, with_gtp_remat))

    get.__doc__ = doc
    return _fast(get, default=GTP_DP.key(what), cp=GTP_DP_CP.key(what), cp_partial=GTP_DP_CP_INTRA.key(what))


def _edp_key(keys: dict[tuple[bool, bool], AnswerKey], with_gtp_remat: Any, partial_expert_data_parallel: Any
             ) -> AnswerKey:
    return keys[(flag("with_gtp_remat", with_gtp_remat),
                 flag("partial_expert_data_parallel", partial_expert_data_parallel))]


def _edp_number(what: Fact, doc: str) -> Callable[..., int]:
    keys = _keys(_EDP_KINDS, what)

    def get(with_gtp_remat: bool, partial_expert_data_parallel: bool) -> int:
        return _lookup(_edp_key(keys, with_gtp_remat, partial_expert_data_parallel))

    get.__doc__ = doc
    return _fast(get, default=EGTP_EDP.key(what), partial=EGTP_EDP_INTRA.key(what))


# The keys the accessors below read at call time, made here once.
_DP_GROUP, _DP_GLOO = _keys(_DP_KINDS, Fact.GROUP), _keys(_DP_KINDS, Fact.GLOO)
_EDP_GROUP = _keys(_EDP_KINDS, Fact.GROUP)
_TP_GROUP, _TP_RANK, _TP_SIZE, _TP_RANKS, _TP_SRC = (TP.key(f) for f in (Fact.GROUP, Fact.RANK, Fact.SIZE, Fact.RANKS,
                                                                          Fact.SRC))
_TP_CP_GROUP, _TP_CP_RANK, _TP_CP_SIZE, _TP_CP_RANKS = (TP_CP.key(f) for f in (Fact.GROUP, Fact.RANK, Fact.SIZE,
                                                                                 Fact.RANKS))
_TP_DP_GROUP, _TP_DP_CP_GROUP = TP_DP.key(Fact.GROUP), TP_DP_CP.key(Fact.GROUP)
_DP_CP_GROUP, _DP_CP_AG_GROUP, _HYBRID_GROUPS = DP_CP.key(Fact.GROUP), DP_CP_AG.key(Fact.GROUP), HYBRID.key(Fact.GROUPS)
_ETP_EP_PP_GROUP, _ETP_EP_EGTP_PP_GROUP = ETP_EP_PP.key(Fact.GROUP), ETP_EP_EGTP_PP.key(Fact.GROUP)
_EDP_GLOO, _EDP_INTRA_GLOO = EDP.key(Fact.GLOO), EDP_INTRA.key(Fact.GLOO)
_DP_SRC, _DP_CP_SRC = DP.key(Fact.SRC), DP_CP.key(Fact.SRC)
_PP_IS_FIRST, _PP_IS_LAST = PP.key(Fact.IS_FIRST), PP.key(Fact.IS_LAST)
_EMBD_IN, _EMBD_RANKS, _POS_EMBD_IN = EMBD.key(Fact.IN), EMBD.key(Fact.RANKS), POS_EMBD.key(Fact.IN)
_DP_EXISTS = DP.key(Fact.EXISTS)


def _setter(key: Override, param: str) -> Callable[[Any], None]:
    # megatron-core's parameter names (rank / world_size), so keyword calls keep working.
    def set_rank(rank: int | None) -> None:
        _st.set_override(key, rank)

    def set_world_size(world_size: int | None) -> None:
        _st.set_override(key, world_size)

    set_ = set_rank if param == "rank" else set_world_size
    set_.__doc__ = f"Override the {key.replace('_', ' ')} (megatron-core's testing hook); None clears it."
    return set_


# --- lifecycle -------------------------------------------------------------------------------

def is_initialized() -> bool:
    """Whether the model-parallel groups exist (megatron-core: the data-parallel group is set)."""
    return _A.get(_DP_EXISTS, False)


def model_parallel_is_initialized() -> bool:
    """Whether the tensor-, pipeline- and data-parallel groups exist."""
    return INITIALIZED in _A


def is_unitialized() -> bool:
    """Deprecated megatron-core spelling of ``not is_initialized()``."""
    # Level 1, as megatron-core: a deeper level walks frames on every call of a hot deprecated name.
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, 1)
    return not _A.get(_DP_EXISTS, False)


# --- groups ----------------------------------------------------------------------------------

get_model_parallel_group = _group(TP_PP.key(Fact.GROUP), "This rank's model-parallel (tp x pp) group.")
get_tensor_model_parallel_group = _group(TP.key(Fact.GROUP), "This rank's tensor-model-parallel group.")
get_pipeline_model_parallel_group = _group(PP.key(Fact.GROUP), "This rank's pipeline-model-parallel group.")
get_context_parallel_group = _group(CP.key(Fact.GROUP), "This rank's context-parallel group.")
get_tensor_and_context_parallel_group = _group(TP_CP.key(Fact.GROUP), "This rank's tensor x context-parallel group.")
get_embedding_group = _group(EMBD.key(Fact.GROUP), "This rank's embedding group (the stages holding word embeddings).")
get_position_embedding_group = _group(POS_EMBD.key(Fact.GROUP), "This rank's position-embedding group.")
get_context_parallel_global_ranks = _group(CP.key(Fact.RANKS), "Global ranks of this rank's context-parallel group.")
get_hierarchical_context_parallel_groups = _group(
    HCP.key(Fact.GROUPS), "This rank's hierarchical context-parallel groups, innermost level first.")
get_expert_model_parallel_group = _group(EP.key(Fact.GROUP), "This rank's expert-model-parallel group.")
get_expert_tensor_parallel_group = _group(ETP.key(Fact.GROUP), "This rank's expert-tensor-parallel group.")
get_expert_tensor_and_model_parallel_group = _group(ETP_EP.key(Fact.GROUP), "This rank's expert tp x ep group.")
get_gtp_weight_remat_group = _group(
    GTP.key(Fact.GROUP), "This rank's generalized tensor-parallel (gtp_remat) weight-sharding group (megatron-core 0.19).")
get_gtp_weight_remat_global_ranks = _group(GTP.key(Fact.RANKS), "Global ranks of this rank's gtp_remat group.")
get_expert_gtp_weight_remat_group = _group(
    EGTP.key(Fact.GROUP), "This rank's expert gtp_remat weight-sharding group (megatron-core 0.19).")
get_expert_gtp_weight_remat_global_ranks = _group(
    EGTP.key(Fact.RANKS), "Global ranks of this rank's expert gtp_remat group.")


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool, with_egtp_remat: bool) -> Any:
    """This rank's expert tp x ep x pp group (merged across expert gtp_remat peers with ``with_egtp_remat``)."""
    key = _ETP_EP_EGTP_PP_GROUP if flag("with_egtp_remat", with_egtp_remat) else _ETP_EP_PP_GROUP
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


get_intra_distributed_optimizer_instance_group = _group(
    DIST_OPT.key(Fact.GROUP), "The group of every rank in this rank's distributed-optimizer instance.")
get_inter_distributed_optimizer_instance_group = _group(
    EDP_INTER.key(Fact.GROUP), "The group spanning the distributed-optimizer instances (one rank of each).")


def get_data_parallel_group(with_context_parallel: bool, with_gtp_remat: bool, partial_data_parallel: bool,
                            independent_all_gather: bool) -> Any:
    """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
    ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
    all-gather group, on request."""
    cp, partial = flag("with_context_parallel", with_context_parallel), flag("partial_data_parallel", partial_data_parallel)
    if flag("independent_all_gather", independent_all_gather) and cp and not partial:
        return _lookup(_DP_CP_AG_GROUP)
    return _lookup(_dp_key(_DP_GROUP, cp, partial, with_gtp_remat))


def has_separate_all_gather_group() -> bool:
    """Whether initialize made a separate dp x cp group for all-gathers (create_all_gather_group=True)."""
    return _A.get(_DP_CP_AG_GROUP) is not None


_fast(has_separate_all_gather_group, default=DP_CP_AG.key(Fact.EXISTS))


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> Any:
    """This rank's gloo data-parallel group (dp x cp with ``with_context_parallel``)."""
    if with_context_parallel is False and partial_data_parallel is False:
        return _lookup(_DP_GLOO[(False, False, False)])
    return _lookup(_dp_key(_DP_GLOO, with_context_parallel, partial_data_parallel, False))


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False) -> Any:
    """This rank's tp x dp group (tp x dp x cp with ``with_context_parallel``)."""
    key = _TP_DP_CP_GROUP if flag("with_context_parallel", with_context_parallel) else _TP_DP_GROUP
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False) -> Any:
    """The FP8 amax-reduction group: tp x dp (x cp), or tp (x cp) with ``tp_only_amax_red``."""
    cp = flag("with_context_parallel", with_context_parallel)
    if flag("tp_only_amax_red", tp_only_amax_red):
        return _lookup(_TP_CP_GROUP if cp else _TP_GROUP)
    return _lookup(_TP_DP_CP_GROUP if cp else _TP_DP_GROUP)


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True, group_size: int | None = None) -> Any:
    """The hybrid context-parallel group of ``group_size`` ranks holding this rank (dp x cp itself at full size)."""
    check = flag("check_initialized", check_initialized)
    if not check and INITIALIZED not in _A:
        return None
    if group_size == get_data_parallel_world_size(with_context_parallel=True):
        return _lookup(_DP_CP_GROUP) if check else _A.get(_DP_CP_GROUP)
    groups = _lookup(_HYBRID_GROUPS) if check else _A.get(_HYBRID_GROUPS)
    if groups is None:
        return None
    if group_size not in groups:
        raise ParallelStateAssertionError(
            f"no hybrid context-parallel group of {group_size!r} ranks: "
            + (f"the sizes built are {sorted(groups)} and {get_data_parallel_world_size(with_context_parallel=True)}"
               if groups else "initialize with hybrid_context_parallel=True to have them")
        )
    return groups[group_size]


def get_expert_data_parallel_group(check_initialized: bool, with_gtp_remat: bool,
                                   partial_expert_data_parallel: bool) -> Any:
    """This rank's expert data-parallel group: spanning expert gtp_remat unless ``with_gtp_remat=False``
    (0.19: the replicate group); its instance's part with ``partial_expert_data_parallel``."""
    key = _edp_key(_EDP_GROUP, with_gtp_remat, partial_expert_data_parallel)
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> Any:
    """Deprecated megatron-core name of get_expert_data_parallel_group."""
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, please use "
                  "get_expert_data_parallel_group instead.", DeprecationWarning, 1)
    return _lookup(_edp_key(_EDP_GROUP, False, partial_expert_data_parallel))


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> Any:
    """This rank's gloo expert data-parallel group."""
    partial = flag("partial_expert_data_parallel", partial_expert_data_parallel)
    return _lookup(_EDP_INTRA_GLOO if partial else _EDP_GLOO)


# --- ranks and sizes -------------------------------------------------------------------------

get_tensor_model_parallel_world_size = _value(TP.key(Fact.SIZE), "Number of ranks in this rank's tensor-parallel group.")
get_tensor_model_parallel_rank = _value(TP.key(Fact.RANK), "This rank's index in its tensor-parallel group.")
get_pipeline_model_parallel_world_size = _value(PP.key(Fact.SIZE), "Number of pipeline stages.")
get_pipeline_model_parallel_rank = _value(PP.key(Fact.RANK), "This rank's pipeline stage.")
get_context_parallel_world_size = _value(CP.key(Fact.SIZE), "Number of ranks in this rank's context-parallel group.")
get_context_parallel_rank = _value(CP.key(Fact.RANK), "This rank's index in its context-parallel group.")
get_tensor_and_context_parallel_world_size = _value(TP_CP.key(Fact.SIZE), "Number of ranks in this rank's tp x cp group.")
get_tensor_and_context_parallel_rank = _value(TP_CP.key(Fact.RANK), "This rank's index in its tp x cp group.")
get_data_parallel_world_size = _dp_number(Fact.SIZE, "Number of ranks in this rank's data-parallel group.")
get_data_parallel_rank = _dp_number(Fact.RANK, "This rank's index in its data-parallel group.")
get_expert_model_parallel_world_size = _value(EP.key(Fact.SIZE), "Number of ranks in this rank's expert-parallel group.")
get_expert_model_parallel_rank = _value(EP.key(Fact.RANK), "This rank's index in its expert-parallel group.")
get_expert_tensor_parallel_world_size = _value(ETP.key(Fact.SIZE), "Number of ranks in this rank's expert-tensor group.")
get_expert_tensor_parallel_rank = _value(ETP.key(Fact.RANK), "This rank's index in its expert-tensor-parallel group.")
get_expert_tensor_and_model_parallel_world_size = _value(ETP_EP.key(Fact.SIZE), "Size of this rank's expert tp x ep group.")
get_expert_tensor_and_model_parallel_rank = _value(ETP_EP.key(Fact.RANK), "This rank's index in its expert tp x ep group.")
get_expert_data_parallel_world_size = _edp_number(
    Fact.SIZE, "Number of ranks in this rank's expert data-parallel group.")
get_expert_data_parallel_rank = _edp_number(Fact.RANK, "This rank's index in its expert data-parallel group.")
get_gtp_weight_remat_world_size = _value(
    GTP.key(Fact.SIZE), "Number of ranks in this rank's gtp_remat group (0 without one).")
get_gtp_weight_remat_rank = _value(GTP.key(Fact.RANK), "This rank's index in its gtp_remat group (0 without one).")
get_expert_gtp_weight_remat_world_size = _value(
    EGTP.key(Fact.SIZE), "Number of ranks in this rank's expert gtp_remat group (0 without one).")
get_expert_gtp_weight_remat_rank = _value(
    EGTP.key(Fact.RANK), "This rank's index in its expert gtp_remat group (0 without one).")
get_virtual_pipeline_model_parallel_world_size = _value(
    VPP_SIZE, "The interleaved schedule's number of model chunks per stage, or None.")
get_virtual_pipeline_model_parallel_rank = _value(VPP_RANK, "The interleaved schedule's current model chunk, or None.")

get_model_parallel_src_rank = _value(TP_PP.key(Fact.SRC), "Global rank of the first member of this rank's tp x pp group.")
get_expert_model_parallel_src_rank = _value(EP.key(Fact.SRC), "First global rank of this rank's expert-parallel group.")
get_pipeline_model_parallel_first_rank = _value(
    PP.key(Fact.FIRST), "Global rank of the first stage of this rank's pipeline.")
get_pipeline_model_parallel_last_rank = _value(PP.key(Fact.LAST), "Global rank of the last stage of this rank's pipeline.")
get_pipeline_model_parallel_next_rank = _value(
    PP.key(Fact.NEXT), "Global rank of the next stage; the last stage's next is the first (a ring).")
get_pipeline_model_parallel_prev_rank = _value(
    PP.key(Fact.PREV), "Global rank of the previous stage; the first stage's previous is the last (a ring).")
get_all_ranks = _value(ALL_RANKS, "This rank's tp, dp, cp, pp and ep ranks joined by '_' (megatron-core's format).")


def get_tensor_model_parallel_src_rank() -> int:
    """First global rank of this rank's tensor-parallel group."""
    return _lookup(_TP_SRC)


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's data-parallel group."""
    return _lookup(_DP_CP_SRC if flag("with_context_parallel", with_context_parallel) else _DP_SRC)


set_tensor_model_parallel_world_size = _setter(Override.TENSOR_MODEL_PARALLEL_WORLD_SIZE, "world_size")
set_tensor_model_parallel_rank = _setter(Override.TENSOR_MODEL_PARALLEL_RANK, "rank")
set_pipeline_model_parallel_world_size = _setter(Override.PIPELINE_MODEL_PARALLEL_WORLD_SIZE, "world_size")
set_pipeline_model_parallel_rank = _setter(Override.PIPELINE_MODEL_PARALLEL_RANK, "rank")
set_data_parallel_rank = _setter(Override.DATA_PARALLEL_RANK, "rank")
set_virtual_pipeline_model_parallel_world_size = _setter(Override.VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE, "world_size")
set_virtual_pipeline_model_parallel_rank = _setter(Override.VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, "rank")
set_expert_model_parallel_world_size = _setter(Override.EXPERT_MODEL_PARALLEL_WORLD_SIZE, "world_size")
set_expert_model_parallel_rank = _setter(Override.EXPERT_MODEL_PARALLEL_RANK, "rank")
set_expert_tensor_parallel_world_size = _setter(Override.EXPERT_TENSOR_PARALLEL_WORLD_SIZE, "world_size")
set_expert_tensor_parallel_rank = _setter(Override.EXPERT_TENSOR_PARALLEL_RANK, "rank")


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
    return _lookup(_PP_IS_FIRST)


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the last pipeline stage (and, unless ignore_virtual, the last chunk)."""
    if ignore_virtual is not True and not flag("ignore_virtual", ignore_virtual):
        vpp = _lookup(VPP_SIZE)
        if vpp is not None and _vp_stage(vp_stage, vpp) != vpp - 1:
            return False
    return _lookup(_PP_IS_LAST)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank holds word embeddings (unless ignore_virtual: in the model chunk that does)."""
    if _A.get(_EMBD_IN) is not True:
        return False
    if ignore_virtual is True or flag("ignore_virtual", ignore_virtual):
        return True
    import torch.distributed as dist

    ranks, rank = _lookup(_EMBD_RANKS), dist.get_rank()
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """Whether this rank holds position embeddings."""
    return _A.get(_POS_EMBD_IN) is True


# --- the short names MAGI-1 and WorldFoundry call ---------------------------------------------

def get_tp_group(with_context_parallel: bool = False) -> Any:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return _lookup(_TP_CP_GROUP if flag("with_context_parallel", with_context_parallel) else _TP_GROUP)


def get_tp_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return _lookup(_TP_CP_RANK if flag("with_context_parallel", with_context_parallel) else _TP_RANK)


def get_tp_world_size(with_context_parallel: bool = False) -> int:
    """Number of ranks in this rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return _lookup(_TP_CP_SIZE if flag("with_context_parallel", with_context_parallel) else _TP_SIZE)


def get_tensor_model_parallel_ranks(with_context_parallel: bool = False, check_initialized: bool = True) -> Any:
    """Global ranks of this rank's tp (or tp x cp) group."""
    key = _TP_CP_RANKS if flag("with_context_parallel", with_context_parallel) else _TP_RANKS
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


def get_tensor_model_parallel_last_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the last member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[-1]


for _fn, _variants in {
    is_initialized: dict(default=_DP_EXISTS), model_parallel_is_initialized: dict(default=INITIALIZED),
    get_data_parallel_group: dict(default=GTP_DP.key(Fact.GROUP), cp=GTP_DP_CP.key(Fact.GROUP),
                                  cp_partial=GTP_DP_CP_INTRA.key(Fact.GROUP)),
    get_data_parallel_group_gloo: dict(default=DP.key(Fact.GLOO), cp=DP_CP.key(Fact.GLOO),
                                       cp_partial=DP_CP_INTRA.key(Fact.GLOO)),
    get_tensor_and_data_parallel_group: dict(default=TP_DP.key(Fact.GROUP), cp=TP_DP_CP.key(Fact.GROUP)),
    get_amax_reduction_group: dict(default=TP_DP.key(Fact.GROUP), cp=TP_DP_CP.key(Fact.GROUP),
                                   tp_only=TP.key(Fact.GROUP), cp_tp_only=TP_CP.key(Fact.GROUP)),
    get_expert_data_parallel_group: dict(default=EGTP_EDP.key(Fact.GROUP), partial=EGTP_EDP_INTRA.key(Fact.GROUP)),
    get_expert_tensor_model_pipeline_parallel_group: dict(default=ETP_EP_PP.key(Fact.GROUP),
                                                          egtp=ETP_EP_EGTP_PP.key(Fact.GROUP)),
    get_expert_data_parallel_group_gloo: dict(default=EDP.key(Fact.GLOO), partial=EDP_INTRA.key(Fact.GLOO)),
    get_data_parallel_src_rank: dict(default=DP.key(Fact.SRC), cp=DP_CP.key(Fact.SRC)),
    get_tensor_model_parallel_src_rank: dict(default=TP.key(Fact.SRC)),
    is_pipeline_first_stage: dict(default=PP.key(Fact.IS_FIRST)),
    is_pipeline_last_stage: dict(default=PP.key(Fact.IS_LAST)),
    is_rank_in_embedding_group: dict(default=EMBD.key(Fact.IN)),
    is_rank_in_position_embedding_group: dict(default=POS_EMBD.key(Fact.IN)),
    get_tp_group: dict(default=TP.key(Fact.GROUP), cp=TP_CP.key(Fact.GROUP)),
    get_tp_rank: dict(default=TP.key(Fact.RANK), cp=TP_CP.key(Fact.RANK)),
    get_tp_world_size: dict(default=TP.key(Fact.SIZE), cp=TP_CP.key(Fact.SIZE)),
    get_tensor_model_parallel_ranks: dict(default=TP.key(Fact.RANKS), cp=TP_CP.key(Fact.RANKS)),
}.items():
    _fast(_fn, **_variants)

# Every accessor with a fast path is replaced by its compiled twin (same name, answers; the parameters of
# the release in use where the release table has the accessor's rows).
for _name, _fn in list(globals().items()):
    if callable(_fn) and _fn in _FAST:
        globals()[_name] = compile_accessor(_fn, _FAST[_fn], name=_name)
del _name, _fn, _variants

# The short names MAGI-1 and WorldFoundry call, for the compiled accessors.
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
