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
from parallel_state.megatron.answers import ANSWERS as _A
from parallel_state.megatron.answers import lookup as _lookup
from parallel_state.megatron.compiled import compile_accessor
from parallel_state.topology.arguments import flag, non_negative_int

#: reference accessor -> its fast path (variant -> answer key), compiled at the end of the module.
_FAST: dict[Callable[..., Any], dict[str, str]] = {}


def _fast(fn: Callable[..., Any], **variants: str) -> Callable[..., Any]:
    """Record ``fn``'s fast path: ``default=KEY`` for its default arguments; ``cp``, ``cp_partial``,
    ``cp_all_gather``, ``partial``, ``tp_only``, ``cp_tp_only`` for those flags turned on (see ``compiled``)."""
    _FAST[fn] = variants
    return fn


def _value(key: str, doc: str) -> Callable[[], Any]:
    def get() -> Any:
        return _lookup(key)

    get.__doc__ = doc
    return _fast(get, default=key)


def _group(key: str, doc: str) -> Callable[..., Any]:
    def get(check_initialized: bool = True) -> Any:
        if check_initialized is True:
            return _lookup(key)
        return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)

    get.__doc__ = doc
    return _fast(get, default=key)


def _dp_key(what: str, with_context_parallel: Any, partial_data_parallel: Any, with_gtp_remat: Any = True) -> str:
    """The answer key of a data-parallel accessor; ``with_gtp_remat`` (0.19, default True) spans gtp_remat."""
    full = "gtp-" if flag("with_gtp_remat", with_gtp_remat) else ""
    if flag("with_context_parallel", with_context_parallel):
        partial = flag("partial_data_parallel", partial_data_parallel)
        return f"{full}dp-cp-intra.{what}" if partial else f"{full}dp-cp.{what}"
    if flag("partial_data_parallel", partial_data_parallel):
        raise ParallelStateAssertionError(
            "partial data parallelism (distributed-optimizer instances) includes context parallelism: "
            "pass with_context_parallel=True together with partial_data_parallel=True"
        )
    return f"{full}dp.{what}"


def _dp_number(what: str, doc: str) -> Callable[..., int]:
    def get(with_context_parallel: bool, with_gtp_remat: bool, partial_data_parallel: bool) -> int:
        return _lookup(_dp_key(what, with_context_parallel, partial_data_parallel, with_gtp_remat))

    get.__doc__ = doc
    return _fast(get, default=f"gtp-dp.{what}", cp=f"gtp-dp-cp.{what}", cp_partial=f"gtp-dp-cp-intra.{what}")


def _edp_key(what: str, with_gtp_remat: Any, partial_expert_data_parallel: Any) -> str:
    full = "egtp-" if flag("with_gtp_remat", with_gtp_remat) else ""
    partial = flag("partial_expert_data_parallel", partial_expert_data_parallel)
    return f"{full}edp-intra.{what}" if partial else f"{full}edp.{what}"


def _edp_number(what: str, doc: str) -> Callable[..., int]:
    def get(with_gtp_remat: bool, partial_expert_data_parallel: bool) -> int:
        return _lookup(_edp_key(what, with_gtp_remat, partial_expert_data_parallel))

    get.__doc__ = doc
    return _fast(get, default=f"egtp-edp.{what}", partial=f"egtp-edp-intra.{what}")


def _setter(key: str, param: str) -> Callable[[Any], None]:
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
    return _A.get("dp.exists", False)


def model_parallel_is_initialized() -> bool:
    """Whether the tensor-, pipeline- and data-parallel groups exist."""
    return "initialized" in _A


def is_unitialized() -> bool:
    """Deprecated megatron-core spelling of ``not is_initialized()``."""
    # Level 1, as megatron-core: a deeper level walks frames on every call of a hot deprecated name.
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, 1)
    return not _A.get("dp.exists", False)


# --- groups ----------------------------------------------------------------------------------

get_model_parallel_group = _group("tp-pp.group", "This rank's model-parallel (tp x pp) group.")
get_tensor_model_parallel_group = _group("tp.group", "This rank's tensor-model-parallel group.")
get_pipeline_model_parallel_group = _group("pp.group", "This rank's pipeline-model-parallel group.")
get_context_parallel_group = _group("cp.group", "This rank's context-parallel group.")
get_tensor_and_context_parallel_group = _group("tp-cp.group", "This rank's tensor x context-parallel group.")
get_embedding_group = _group("embd.group", "This rank's embedding group (the stages holding word embeddings).")
get_position_embedding_group = _group("pos-embd.group", "This rank's position-embedding group.")
get_context_parallel_global_ranks = _group("cp.ranks", "Global ranks of this rank's context-parallel group.")
get_hierarchical_context_parallel_groups = _group(
    "hcp.groups", "This rank's hierarchical context-parallel groups, innermost level first.")
get_expert_model_parallel_group = _group("ep.group", "This rank's expert-model-parallel group.")
get_expert_tensor_parallel_group = _group("etp.group", "This rank's expert-tensor-parallel group.")
get_expert_tensor_and_model_parallel_group = _group("etp-ep.group", "This rank's expert tp x ep group.")
get_gtp_weight_remat_group = _group(
    "gtp.group", "This rank's generalized tensor-parallel (gtp_remat) weight-sharding group (megatron-core 0.19).")
get_gtp_weight_remat_global_ranks = _group("gtp.ranks", "Global ranks of this rank's gtp_remat group.")
get_expert_gtp_weight_remat_group = _group(
    "egtp.group", "This rank's expert gtp_remat weight-sharding group (megatron-core 0.19).")
get_expert_gtp_weight_remat_global_ranks = _group("egtp.ranks", "Global ranks of this rank's expert gtp_remat group.")


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool, with_egtp_remat: bool) -> Any:
    """This rank's expert tp x ep x pp group (merged across expert gtp_remat peers with ``with_egtp_remat``)."""
    key = "etp-ep-egtp-pp.group" if flag("with_egtp_remat", with_egtp_remat) else "etp-ep-pp.group"
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


get_intra_distributed_optimizer_instance_group = _group(
    "dist-opt.group", "The group of every rank in this rank's distributed-optimizer instance.")
get_inter_distributed_optimizer_instance_group = _group(
    "edp-inter.group", "The group spanning the distributed-optimizer instances (one rank of each).")


def get_data_parallel_group(with_context_parallel: bool, with_gtp_remat: bool, partial_data_parallel: bool,
                            independent_all_gather: bool) -> Any:
    """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
    ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
    all-gather group, on request."""
    cp, partial = flag("with_context_parallel", with_context_parallel), flag("partial_data_parallel", partial_data_parallel)
    if flag("independent_all_gather", independent_all_gather) and cp and not partial:
        return _lookup("dp-cp-ag.group")
    return _lookup(_dp_key("group", cp, partial, with_gtp_remat))


def has_separate_all_gather_group() -> bool:
    """Whether initialize made a separate dp x cp group for all-gathers (create_all_gather_group=True)."""
    return _A.get("dp-cp-ag.group") is not None


_fast(has_separate_all_gather_group, default="dp-cp-ag.exists")


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> Any:
    """This rank's gloo data-parallel group (dp x cp with ``with_context_parallel``)."""
    if with_context_parallel is False and partial_data_parallel is False:
        return _lookup("dp.gloo")
    return _lookup(_dp_key("gloo", with_context_parallel, partial_data_parallel))


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False) -> Any:
    """This rank's tp x dp group (tp x dp x cp with ``with_context_parallel``)."""
    key = "tp-dp-cp.group" if flag("with_context_parallel", with_context_parallel) else "tp-dp.group"
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False) -> Any:
    """The FP8 amax-reduction group: tp x dp (x cp), or tp (x cp) with ``tp_only_amax_red``."""
    cp = flag("with_context_parallel", with_context_parallel)
    if flag("tp_only_amax_red", tp_only_amax_red):
        return _lookup("tp-cp.group" if cp else "tp.group")
    return _lookup("tp-dp-cp.group" if cp else "tp-dp.group")


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True, group_size: int | None = None) -> Any:
    """The hybrid context-parallel group of ``group_size`` ranks holding this rank (dp x cp itself at full size)."""
    check = flag("check_initialized", check_initialized)
    if not check and "initialized" not in _A:
        return None
    if group_size == get_data_parallel_world_size(with_context_parallel=True):
        return _lookup("dp-cp.group") if check else _A.get("dp-cp.group")
    groups = _lookup("hybrid.groups") if check else _A.get("hybrid.groups")
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
    key = _edp_key("group", with_gtp_remat, partial_expert_data_parallel)
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> Any:
    """Deprecated megatron-core name of get_expert_data_parallel_group."""
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, please use "
                  "get_expert_data_parallel_group instead.", DeprecationWarning, 1)
    return _lookup(_edp_key("group", False, partial_expert_data_parallel))


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> Any:
    """This rank's gloo expert data-parallel group."""
    return _lookup("edp-intra.gloo" if flag("partial_expert_data_parallel", partial_expert_data_parallel) else "edp.gloo")


# --- ranks and sizes -------------------------------------------------------------------------

get_tensor_model_parallel_world_size = _value("tp.size", "Number of ranks in this rank's tensor-parallel group.")
get_tensor_model_parallel_rank = _value("tp.rank", "This rank's index in its tensor-parallel group.")
get_pipeline_model_parallel_world_size = _value("pp.size", "Number of pipeline stages.")
get_pipeline_model_parallel_rank = _value("pp.rank", "This rank's pipeline stage.")
get_context_parallel_world_size = _value("cp.size", "Number of ranks in this rank's context-parallel group.")
get_context_parallel_rank = _value("cp.rank", "This rank's index in its context-parallel group.")
get_tensor_and_context_parallel_world_size = _value("tp-cp.size", "Number of ranks in this rank's tp x cp group.")
get_tensor_and_context_parallel_rank = _value("tp-cp.rank", "This rank's index in its tp x cp group.")
get_data_parallel_world_size = _dp_number("size", "Number of ranks in this rank's data-parallel group.")
get_data_parallel_rank = _dp_number("rank", "This rank's index in its data-parallel group.")
get_expert_model_parallel_world_size = _value("ep.size", "Number of ranks in this rank's expert-parallel group.")
get_expert_model_parallel_rank = _value("ep.rank", "This rank's index in its expert-parallel group.")
get_expert_tensor_parallel_world_size = _value("etp.size", "Number of ranks in this rank's expert-tensor group.")
get_expert_tensor_parallel_rank = _value("etp.rank", "This rank's index in its expert-tensor-parallel group.")
get_expert_tensor_and_model_parallel_world_size = _value("etp-ep.size", "Size of this rank's expert tp x ep group.")
get_expert_tensor_and_model_parallel_rank = _value("etp-ep.rank", "This rank's index in its expert tp x ep group.")
get_expert_data_parallel_world_size = _edp_number("size", "Number of ranks in this rank's expert data-parallel group.")
get_expert_data_parallel_rank = _edp_number("rank", "This rank's index in its expert data-parallel group.")
get_gtp_weight_remat_world_size = _value("gtp.size", "Number of ranks in this rank's gtp_remat group (0 without one).")
get_gtp_weight_remat_rank = _value("gtp.rank", "This rank's index in its gtp_remat group (0 without one).")
get_expert_gtp_weight_remat_world_size = _value(
    "egtp.size", "Number of ranks in this rank's expert gtp_remat group (0 without one).")
get_expert_gtp_weight_remat_rank = _value("egtp.rank", "This rank's index in its expert gtp_remat group (0 without one).")
get_virtual_pipeline_model_parallel_world_size = _value(
    "vpp.size", "The interleaved schedule's number of model chunks per stage, or None.")
get_virtual_pipeline_model_parallel_rank = _value("vpp.rank", "The interleaved schedule's current model chunk, or None.")

get_model_parallel_src_rank = _value("tp-pp.src", "Global rank of the first member of this rank's tp x pp group.")
get_expert_model_parallel_src_rank = _value("ep.src", "First global rank of this rank's expert-parallel group.")
get_pipeline_model_parallel_first_rank = _value("pp.first", "Global rank of the first stage of this rank's pipeline.")
get_pipeline_model_parallel_last_rank = _value("pp.last", "Global rank of the last stage of this rank's pipeline.")
get_pipeline_model_parallel_next_rank = _value(
    "pp.next", "Global rank of the next stage; the last stage's next is the first (a ring).")
get_pipeline_model_parallel_prev_rank = _value(
    "pp.prev", "Global rank of the previous stage; the first stage's previous is the last (a ring).")
get_all_ranks = _value("all_ranks", "This rank's tp, dp, cp, pp and ep ranks joined by '_' (megatron-core's format).")


def get_tensor_model_parallel_src_rank() -> int:
    """First global rank of this rank's tensor-parallel group."""
    return _lookup("tp.src")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's data-parallel group."""
    return _lookup("dp-cp.src" if flag("with_context_parallel", with_context_parallel) else "dp.src")


set_tensor_model_parallel_world_size = _setter("tensor_model_parallel_world_size", "world_size")
set_tensor_model_parallel_rank = _setter("tensor_model_parallel_rank", "rank")
set_pipeline_model_parallel_world_size = _setter("pipeline_model_parallel_world_size", "world_size")
set_pipeline_model_parallel_rank = _setter("pipeline_model_parallel_rank", "rank")
set_data_parallel_rank = _setter("data_parallel_rank", "rank")
set_virtual_pipeline_model_parallel_world_size = _setter("virtual_pipeline_model_parallel_world_size", "world_size")
set_virtual_pipeline_model_parallel_rank = _setter("virtual_pipeline_model_parallel_rank", "rank")
set_expert_model_parallel_world_size = _setter("expert_model_parallel_world_size", "world_size")
set_expert_model_parallel_rank = _setter("expert_model_parallel_rank", "rank")
set_expert_tensor_parallel_world_size = _setter("expert_tensor_parallel_world_size", "world_size")
set_expert_tensor_parallel_rank = _setter("expert_tensor_parallel_rank", "rank")


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
        vpp = _lookup("vpp.size")
        if vpp is not None and _vp_stage(vp_stage, vpp) != 0:
            return False
    return _lookup("pp.is_first")


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the last pipeline stage (and, unless ignore_virtual, the last chunk)."""
    if ignore_virtual is not True and not flag("ignore_virtual", ignore_virtual):
        vpp = _lookup("vpp.size")
        if vpp is not None and _vp_stage(vp_stage, vpp) != vpp - 1:
            return False
    return _lookup("pp.is_last")


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank holds word embeddings (unless ignore_virtual: in the model chunk that does)."""
    if _A.get("embd.in") is not True:
        return False
    if ignore_virtual is True or flag("ignore_virtual", ignore_virtual):
        return True
    import torch.distributed as dist

    ranks, rank = _lookup("embd.ranks"), dist.get_rank()
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """Whether this rank holds position embeddings."""
    return _A.get("pos-embd.in") is True


# --- the short names MAGI-1 and WorldFoundry call ---------------------------------------------

def get_tp_group(with_context_parallel: bool = False) -> Any:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return _lookup("tp-cp.group" if flag("with_context_parallel", with_context_parallel) else "tp.group")


def get_tp_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return _lookup("tp-cp.rank" if flag("with_context_parallel", with_context_parallel) else "tp.rank")


def get_tp_world_size(with_context_parallel: bool = False) -> int:
    """Number of ranks in this rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return _lookup("tp-cp.size" if flag("with_context_parallel", with_context_parallel) else "tp.size")


def get_tensor_model_parallel_ranks(with_context_parallel: bool = False, check_initialized: bool = True) -> Any:
    """Global ranks of this rank's tp (or tp x cp) group."""
    key = "tp-cp.ranks" if flag("with_context_parallel", with_context_parallel) else "tp.ranks"
    return _lookup(key) if flag("check_initialized", check_initialized) else _A.get(key)


def get_tensor_model_parallel_last_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the last member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[-1]


for _fn, _variants in {
    is_initialized: dict(default="dp.exists"), model_parallel_is_initialized: dict(default="initialized"),
    get_data_parallel_group: dict(default="gtp-dp.group", cp="gtp-dp-cp.group", cp_partial="gtp-dp-cp-intra.group"),
    get_data_parallel_group_gloo: dict(default="dp.gloo", cp="dp-cp.gloo", cp_partial="dp-cp-intra.gloo"),
    get_tensor_and_data_parallel_group: dict(default="tp-dp.group", cp="tp-dp-cp.group"),
    get_amax_reduction_group: dict(default="tp-dp.group", cp="tp-dp-cp.group", tp_only="tp.group",
                                   cp_tp_only="tp-cp.group"),
    get_expert_data_parallel_group: dict(default="egtp-edp.group", partial="egtp-edp-intra.group"),
    get_expert_tensor_model_pipeline_parallel_group: dict(default="etp-ep-pp.group", egtp="etp-ep-egtp-pp.group"),
    get_expert_data_parallel_group_gloo: dict(default="edp.gloo", partial="edp-intra.gloo"),
    get_data_parallel_src_rank: dict(default="dp.src", cp="dp-cp.src"),
    get_tensor_model_parallel_src_rank: dict(default="tp.src"),
    is_pipeline_first_stage: dict(default="pp.is_first"), is_pipeline_last_stage: dict(default="pp.is_last"),
    is_rank_in_embedding_group: dict(default="embd.in"), is_rank_in_position_embedding_group: dict(default="pos-embd.in"),
    get_tp_group: dict(default="tp.group", cp="tp-cp.group"), get_tp_rank: dict(default="tp.rank", cp="tp-cp.rank"),
    get_tp_world_size: dict(default="tp.size", cp="tp-cp.size"),
    get_tensor_model_parallel_ranks: dict(default="tp.ranks", cp="tp-cp.ranks"),
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
