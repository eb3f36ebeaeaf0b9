"""Which answer each of megatron-core's accessors returns: its rule, written once.

Every answer an accessor can give is precomputed (``answers.ANSWERS``, keyed ``"<kind>.<what>"``),
and for most accessors which one depends only on their flags. A :class:`Rule` is that dependence:
a function of the accessor's arguments (each a flag, checked to be a bool before it is called) that
returns the answer's key, with the accessor's docstring, its return annotation and what it returns
where the answer is absent. The accessors themselves are written from these rules and the release
table by ``python -m parallel_state.tools.generate`` (``accessors.py``): a plain def with the
parameters of the release in use, which tests its flags, returns the variable holding the answer
for their values (one global read), and otherwise calls :func:`answer`, which checks the arguments
and looks the rule's key up, or explains why there is no answer.

An accessor whose parameters differ between releases (a ``release_table.SIGNATURES`` entry) has
every release's parameters here, with the table's defaults; a release that lacks one passes it at
its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from parallel_state.errors import ParallelStateAssertionError
from parallel_state.megatron.answers import ANSWERS, lookup
from parallel_state.topology.arguments import flag


class _Lookup:
    def __repr__(self) -> str:
        return "LOOKUP"


#: A rule's ``absent``: an absent answer is what ``answers.lookup`` says (megatron-core's fallback, or the
#: error saying what to call first), or None where the accessor is called with ``check_initialized=False``.
LOOKUP: Any = _Lookup()


@dataclass(frozen=True)
class Rule:
    """How one accessor answers: ``key`` maps its arguments to its answer's key."""

    key: Callable[..., str]
    doc: str
    #: The accessor's return annotation.
    returns: str = "Any"
    #: What the accessor returns where the answer is absent (``LOOKUP``: ``answers.lookup``'s answer).
    absent: Any = LOOKUP
    #: The DeprecationWarning a deprecated name gives on every call, as megatron-core's does.
    deprecated: str | None = None


#: Every accessor with a rule, by name, in the order ``accessors.py`` defines them.
RULES: dict[str, Rule] = {}


def answer(name: str, **arguments: Any) -> Any:
    """The answer of accessor ``name`` for ``arguments`` (its parameters, by keyword), off its fast path.

    Each flag is checked to be a bool (``check_initialized`` too; it decides only what an absent answer gives).
    """
    rule = RULES[name]
    check = flag("check_initialized", arguments.pop("check_initialized", True))
    key = rule.key(**{n: flag(n, value) for n, value in arguments.items()})
    if rule.absent is not LOOKUP:
        return ANSWERS.get(key, rule.absent)
    return lookup(key) if check else ANSWERS.get(key)


def _rule(returns: str = "Any", absent: Any = LOOKUP, deprecated: str | None = None
          ) -> Callable[[Callable[..., str]], Rule]:
    """Register the decorated function as the rule of the accessor of its name."""
    def register(key: Callable[..., str]) -> Rule:
        RULES[key.__name__] = Rule(key, key.__doc__ or "", returns, absent, deprecated)
        return RULES[key.__name__]

    return register


def _value(name: str, key: str, doc: str, returns: str = "int", absent: Any = LOOKUP) -> None:
    """An accessor without parameters, answering ``key``."""
    def rule() -> str:
        return key

    RULES[name] = Rule(rule, doc, returns, absent)


def _group(name: str, key: str, doc: str, returns: str = "Any") -> None:
    """An accessor ``(check_initialized=True)`` answering ``key`` (None where absent, unchecked)."""
    def rule(check_initialized: bool = True) -> str:
        return key

    RULES[name] = Rule(rule, doc, returns)


# --- lifecycle -------------------------------------------------------------------------------

_value("is_initialized", "dp.exists", "Whether the model-parallel groups exist (megatron-core: the data-parallel "
       "group is set).", "bool", absent=False)
_value("model_parallel_is_initialized", "initialized", "Whether the tensor-, pipeline- and data-parallel groups exist.",
       "bool", absent=False)

# --- groups ----------------------------------------------------------------------------------

_group("get_model_parallel_group", "tp-pp.group", "This rank's model-parallel (tp x pp) group.")
_group("get_tensor_model_parallel_group", "tp.group", "This rank's tensor-model-parallel group.")
_group("get_pipeline_model_parallel_group", "pp.group", "This rank's pipeline-model-parallel group.")
_group("get_context_parallel_group", "cp.group", "This rank's context-parallel group.")
_group("get_tensor_and_context_parallel_group", "tp-cp.group", "This rank's tensor x context-parallel group.")
_group("get_embedding_group", "embd.group", "This rank's embedding group (the stages holding word embeddings).")
_group("get_position_embedding_group", "pos-embd.group", "This rank's position-embedding group.")
_group("get_context_parallel_global_ranks", "cp.ranks", "Global ranks of this rank's context-parallel group.",
       "list[int]")
_group("get_hierarchical_context_parallel_groups", "hcp.groups",
       "This rank's hierarchical context-parallel groups, innermost level first.", "list[Any]")
_group("get_expert_model_parallel_group", "ep.group", "This rank's expert-model-parallel group.")
_group("get_expert_tensor_parallel_group", "etp.group", "This rank's expert-tensor-parallel group.")
_group("get_expert_tensor_and_model_parallel_group", "etp-ep.group", "This rank's expert tp x ep group.")
_group("get_gtp_weight_remat_group", "gtp.group",
       "This rank's generalized tensor-parallel (gtp_remat) weight-sharding group (megatron-core 0.19).")
_group("get_gtp_weight_remat_global_ranks", "gtp.ranks", "Global ranks of this rank's gtp_remat group.", "list[int]")
_group("get_expert_gtp_weight_remat_group", "egtp.group",
       "This rank's expert gtp_remat weight-sharding group (megatron-core 0.19).")
_group("get_expert_gtp_weight_remat_global_ranks", "egtp.ranks", "Global ranks of this rank's expert gtp_remat group.",
       "list[int]")


@_rule()
def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True,
                                                    with_egtp_remat: bool = False) -> str:
    """This rank's expert tp x ep x pp group (merged across expert gtp_remat peers with ``with_egtp_remat``)."""
    return "etp-ep-egtp-pp.group" if with_egtp_remat else "etp-ep-pp.group"


_group("get_intra_distributed_optimizer_instance_group", "dist-opt.group",
       "The group of every rank in this rank's distributed-optimizer instance.")
_group("get_inter_distributed_optimizer_instance_group", "edp-inter.group",
       "The group spanning the distributed-optimizer instances (one rank of each).")


def _data_parallel(what: str, with_context_parallel: bool, with_gtp_remat: bool, partial_data_parallel: bool) -> str:
    """The key of a data-parallel answer; ``with_gtp_remat`` (0.19, default True) spans gtp_remat."""
    full = "gtp-" if with_gtp_remat else ""
    if with_context_parallel:
        return f"{full}dp-cp-intra.{what}" if partial_data_parallel else f"{full}dp-cp.{what}"
    if partial_data_parallel:
        raise ParallelStateAssertionError(
            "partial data parallelism (distributed-optimizer instances) includes context parallelism: "
            "pass with_context_parallel=True together with partial_data_parallel=True"
        )
    return f"{full}dp.{what}"


@_rule()
def get_data_parallel_group(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                            partial_data_parallel: bool = False, independent_all_gather: bool = False) -> str:
    """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
    ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
    all-gather group, on request."""
    if independent_all_gather and with_context_parallel and not partial_data_parallel:
        return "dp-cp-ag.group"
    return _data_parallel("group", with_context_parallel, with_gtp_remat, partial_data_parallel)


_value("has_separate_all_gather_group", "dp-cp-ag.exists",
       "Whether initialize made a separate dp x cp group for all-gathers (create_all_gather_group=True).", "bool",
       absent=False)


@_rule()
def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> str:
    """This rank's gloo data-parallel group (dp x cp with ``with_context_parallel``)."""
    # The gloo twins are the replicate groups' (megatron-core 0.19 builds none under gtp_remat).
    return _data_parallel("gloo", with_context_parallel, False, partial_data_parallel)


@_rule()
def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False) -> str:
    """This rank's tp x dp group (tp x dp x cp with ``with_context_parallel``)."""
    return "tp-dp-cp.group" if with_context_parallel else "tp-dp.group"


@_rule()
def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False) -> str:
    """The FP8 amax-reduction group: tp x dp (x cp), or tp (x cp) with ``tp_only_amax_red``."""
    if tp_only_amax_red:
        return "tp-cp.group" if with_context_parallel else "tp.group"
    return "tp-dp-cp.group" if with_context_parallel else "tp-dp.group"


def _expert_data_parallel(what: str, with_gtp_remat: bool, partial_expert_data_parallel: bool) -> str:
    """The key of an expert data-parallel answer; ``with_gtp_remat`` (0.19, default True) spans expert gtp_remat."""
    full = "egtp-" if with_gtp_remat else ""
    return f"{full}edp-intra.{what}" if partial_expert_data_parallel else f"{full}edp.{what}"


@_rule()
def get_expert_data_parallel_group(check_initialized: bool = True, with_gtp_remat: bool = True,
                                   partial_expert_data_parallel: bool = False) -> str:
    """This rank's expert data-parallel group: spanning expert gtp_remat unless ``with_gtp_remat=False``
    (0.19: the replicate group); its instance's part with ``partial_expert_data_parallel``."""
    return _expert_data_parallel("group", with_gtp_remat, partial_expert_data_parallel)


@_rule(deprecated="get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group "
                  "instead.")
def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> str:
    """Deprecated megatron-core name of get_expert_data_parallel_group (the group without expert gtp_remat)."""
    return _expert_data_parallel("group", False, partial_expert_data_parallel)


@_rule()
def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> str:
    """This rank's gloo expert data-parallel group."""
    return _expert_data_parallel("gloo", False, partial_expert_data_parallel)


# --- ranks and sizes -------------------------------------------------------------------------

_value("get_tensor_model_parallel_world_size", "tp.size", "Number of ranks in this rank's tensor-parallel group.")
_value("get_tensor_model_parallel_rank", "tp.rank", "This rank's index in its tensor-parallel group.")
_value("get_pipeline_model_parallel_world_size", "pp.size", "Number of pipeline stages.")
_value("get_pipeline_model_parallel_rank", "pp.rank", "This rank's pipeline stage.")
_value("get_context_parallel_world_size", "cp.size", "Number of ranks in this rank's context-parallel group.")
_value("get_context_parallel_rank", "cp.rank", "This rank's index in its context-parallel group.")
_value("get_tensor_and_context_parallel_world_size", "tp-cp.size", "Number of ranks in this rank's tp x cp group.")
_value("get_tensor_and_context_parallel_rank", "tp-cp.rank", "This rank's index in its tp x cp group.")


@_rule("int")
def get_data_parallel_world_size(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                                 partial_data_parallel: bool = False) -> str:
    """Number of ranks in this rank's data-parallel group."""
    return _data_parallel("size", with_context_parallel, with_gtp_remat, partial_data_parallel)


@_rule("int")
def get_data_parallel_rank(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                           partial_data_parallel: bool = False) -> str:
    """This rank's index in its data-parallel group."""
    return _data_parallel("rank", with_context_parallel, with_gtp_remat, partial_data_parallel)


_value("get_expert_model_parallel_world_size", "ep.size", "Number of ranks in this rank's expert-parallel group.")
_value("get_expert_model_parallel_rank", "ep.rank", "This rank's index in its expert-parallel group.")
_value("get_expert_tensor_parallel_world_size", "etp.size", "Number of ranks in this rank's expert-tensor group.")
_value("get_expert_tensor_parallel_rank", "etp.rank", "This rank's index in its expert-tensor-parallel group.")
_value("get_expert_tensor_and_model_parallel_world_size", "etp-ep.size", "Size of this rank's expert tp x ep group.")
_value("get_expert_tensor_and_model_parallel_rank", "etp-ep.rank", "This rank's index in its expert tp x ep group.")


@_rule("int")
def get_expert_data_parallel_world_size(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> str:
    """Number of ranks in this rank's expert data-parallel group."""
    return _expert_data_parallel("size", with_gtp_remat, partial_expert_data_parallel)


@_rule("int")
def get_expert_data_parallel_rank(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> str:
    """This rank's index in its expert data-parallel group."""
    return _expert_data_parallel("rank", with_gtp_remat, partial_expert_data_parallel)


_value("get_gtp_weight_remat_world_size", "gtp.size", "Number of ranks in this rank's gtp_remat group (0 without one).")
_value("get_gtp_weight_remat_rank", "gtp.rank", "This rank's index in its gtp_remat group (0 without one).")
_value("get_expert_gtp_weight_remat_world_size", "egtp.size",
       "Number of ranks in this rank's expert gtp_remat group (0 without one).")
_value("get_expert_gtp_weight_remat_rank", "egtp.rank", "This rank's index in its expert gtp_remat group (0 without one).")
_value("get_virtual_pipeline_model_parallel_world_size", "vpp.size",
       "The interleaved schedule's number of model chunks per stage, or None.", "int | None")
_value("get_virtual_pipeline_model_parallel_rank", "vpp.rank", "The interleaved schedule's current model chunk, or None.",
       "int | None")

_value("get_model_parallel_src_rank", "tp-pp.src", "Global rank of the first member of this rank's tp x pp group.")
_value("get_expert_model_parallel_src_rank", "ep.src", "First global rank of this rank's expert-parallel group.")
_value("get_pipeline_model_parallel_first_rank", "pp.first", "Global rank of the first stage of this rank's pipeline.")
_value("get_pipeline_model_parallel_last_rank", "pp.last", "Global rank of the last stage of this rank's pipeline.")
_value("get_pipeline_model_parallel_next_rank", "pp.next",
       "Global rank of the next stage; the last stage's next is the first (a ring).")
_value("get_pipeline_model_parallel_prev_rank", "pp.prev",
       "Global rank of the previous stage; the first stage's previous is the last (a ring).")
_value("get_all_ranks", "all_ranks", "This rank's tp, dp, cp, pp and ep ranks joined by '_' (megatron-core's format).",
       "str")
_value("get_tensor_model_parallel_src_rank", "tp.src", "First global rank of this rank's tensor-parallel group.")


@_rule("int")
def get_data_parallel_src_rank(with_context_parallel: bool = False) -> str:
    """Global rank of the first member of this rank's data-parallel group."""
    return "dp-cp.src" if with_context_parallel else "dp.src"


_value("is_rank_in_position_embedding_group", "pos-embd.in", "Whether this rank holds position embeddings.", "bool",
       absent=False)

# --- the short names MAGI-1 and WorldFoundry call ---------------------------------------------


@_rule()
def get_tp_group(with_context_parallel: bool = False) -> str:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return "tp-cp.group" if with_context_parallel else "tp.group"


@_rule("int")
def get_tp_rank(with_context_parallel: bool = False) -> str:
    """This rank's index in its tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return "tp-cp.rank" if with_context_parallel else "tp.rank"


@_rule("int")
def get_tp_world_size(with_context_parallel: bool = False) -> str:
    """Number of ranks in this rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return "tp-cp.size" if with_context_parallel else "tp.size"


@_rule("list[int]")
def get_tensor_model_parallel_ranks(with_context_parallel: bool = False, check_initialized: bool = True) -> str:
    """Global ranks of this rank's tp (or tp x cp) group."""
    return "tp-cp.ranks" if with_context_parallel else "tp.ranks"
