"""Which answer each of megatron-core's accessors returns: its rule, written once.

Every answer an accessor can give is precomputed (``answers.ANSWERS``, keyed ``Kind.key(Fact)``),
and for most accessors which one depends only on their flags. A :class:`Rule` is that dependence:
a function of the accessor's arguments (each a flag, checked to be a bool before it is called) that
returns the answer's key, with the accessor's docstring, its return annotation and what it returns
where the answer is absent. The accessors themselves are written from these rules and the release
table by ``python -m parallel_state.tools.generate`` (``generated_accessors.py``): a plain def with the
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
from parallel_state.topology.answer_keys import ALL_RANKS, INITIALIZED, VPP_RANK, VPP_SIZE, AnswerKey, Fact
from parallel_state.topology.arguments import flag
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
    POS_EMBD,
    PP,
    TP,
    TP_CP,
    TP_DP,
    TP_DP_CP,
    TP_PP,
    Kind,
)


class _Lookup:
    def __repr__(self) -> str:
        return "LOOKUP"


#: A rule's ``absent``: an absent answer is what ``answers.lookup`` says (megatron-core's fallback, or the
#: error saying what to call first), or None where the accessor is called with ``check_initialized=False``.
LOOKUP: Any = _Lookup()


@dataclass(frozen=True)
class Rule:
    """How one accessor answers: ``key`` maps its arguments to its answer's key."""

    key: Callable[..., AnswerKey]
    doc: str
    #: The accessor's return annotation.
    returns: str = "Any"
    #: What the accessor returns where the answer is absent (``LOOKUP``: ``answers.lookup``'s answer).
    absent: Any = LOOKUP
    #: The DeprecationWarning a deprecated name gives on every call, as megatron-core's does.
    deprecated: str | None = None


#: Every accessor with a rule, by name, in the order ``generated_accessors.py`` defines them.
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
          ) -> Callable[[Callable[..., AnswerKey]], Rule]:
    """Register the decorated function as the rule of the accessor of its name."""
    def register(key: Callable[..., AnswerKey]) -> Rule:
        RULES[key.__name__] = Rule(key, key.__doc__ or "", returns, absent, deprecated)
        return RULES[key.__name__]

    return register


def _value(name: str, key: AnswerKey, doc: str, returns: str = "int", absent: Any = LOOKUP) -> None:
    """An accessor without parameters, answering ``key``."""
    def rule() -> AnswerKey:
        return key

    RULES[name] = Rule(rule, doc, returns, absent)


def _group(name: str, key: AnswerKey, doc: str, returns: str = "Any") -> None:
    """An accessor ``(check_initialized=True)`` answering ``key`` (None where absent, unchecked)."""
    def rule(check_initialized: bool = True) -> AnswerKey:
        return key

    RULES[name] = Rule(rule, doc, returns)


# --- lifecycle -------------------------------------------------------------------------------

_value("is_initialized", DP.key(Fact.EXISTS), "Whether the model-parallel groups exist (megatron-core: the data-parallel "
       "group is set).", "bool", absent=False)
_value("model_parallel_is_initialized", INITIALIZED, "Whether the tensor-, pipeline- and data-parallel groups exist.",
       "bool", absent=False)

# --- groups ----------------------------------------------------------------------------------

_group("get_model_parallel_group", TP_PP.key(Fact.GROUP), "This rank's model-parallel (tp x pp) group.")
_group("get_tensor_model_parallel_group", TP.key(Fact.GROUP), "This rank's tensor-model-parallel group.")
_group("get_pipeline_model_parallel_group", PP.key(Fact.GROUP), "This rank's pipeline-model-parallel group.")
_group("get_context_parallel_group", CP.key(Fact.GROUP), "This rank's context-parallel group.")
_group("get_tensor_and_context_parallel_group", TP_CP.key(Fact.GROUP), "This rank's tensor x context-parallel group.")
_group("get_embedding_group", EMBD.key(Fact.GROUP), "This rank's embedding group (the stages holding word embeddings).")
_group("get_position_embedding_group", POS_EMBD.key(Fact.GROUP), "This rank's position-embedding group.")
_group("get_context_parallel_global_ranks", CP.key(Fact.RANKS), "Global ranks of this rank's context-parallel group.",
       "list[int]")
_group("get_hierarchical_context_parallel_groups", HCP.key(Fact.GROUPS),
       "This rank's hierarchical context-parallel groups, innermost level first.", "list[Any]")
_group("get_expert_model_parallel_group", EP.key(Fact.GROUP), "This rank's expert-model-parallel group.")
_group("get_expert_tensor_parallel_group", ETP.key(Fact.GROUP), "This rank's expert-tensor-parallel group.")
_group("get_expert_tensor_and_model_parallel_group", ETP_EP.key(Fact.GROUP), "This rank's expert tp x ep group.")
_group("get_gtp_weight_remat_group", GTP.key(Fact.GROUP),
       "This rank's generalized tensor-parallel (gtp_remat) weight-sharding group (megatron-core 0.19).")
_group("get_gtp_weight_remat_global_ranks", GTP.key(Fact.RANKS), "Global ranks of this rank's gtp_remat group.", "list[int]")
_group("get_expert_gtp_weight_remat_group", EGTP.key(Fact.GROUP),
       "This rank's expert gtp_remat weight-sharding group (megatron-core 0.19).")
_group("get_expert_gtp_weight_remat_global_ranks", EGTP.key(Fact.RANKS),
       "Global ranks of this rank's expert gtp_remat group.", "list[int]")


@_rule()
def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True,
                                                    with_egtp_remat: bool = False) -> AnswerKey:
    """This rank's expert tp x ep x pp group (merged across expert gtp_remat peers with ``with_egtp_remat``)."""
    return ETP_EP_EGTP_PP.key(Fact.GROUP) if with_egtp_remat else ETP_EP_PP.key(Fact.GROUP)


_group("get_intra_distributed_optimizer_instance_group", DIST_OPT.key(Fact.GROUP),
       "The group of every rank in this rank's distributed-optimizer instance.")
_group("get_inter_distributed_optimizer_instance_group", EDP_INTER.key(Fact.GROUP),
       "The group spanning the distributed-optimizer instances (one rank of each).")


#: (spans gtp_remat, with context parallel, partial) -> the data-parallel kind.
_DATA_PARALLEL: dict[tuple[bool, bool, bool], Kind] = {
    (True, False, False): GTP_DP, (False, False, False): DP, (True, True, False): GTP_DP_CP,
    (False, True, False): DP_CP, (True, True, True): GTP_DP_CP_INTRA, (False, True, True): DP_CP_INTRA}


def _data_parallel(fact: Fact, with_context_parallel: bool, with_gtp_remat: bool,
                   partial_data_parallel: bool) -> AnswerKey:
    """The key of a data-parallel answer; ``with_gtp_remat`` (0.19, default True) spans gtp_remat."""
    if partial_data_parallel and not with_context_parallel:
        raise ParallelStateAssertionError(
            "partial data parallelism (distributed-optimizer instances) includes context parallelism: "
            "pass with_context_parallel=True together with partial_data_parallel=True"
        )
    return _DATA_PARALLEL[(with_gtp_remat, with_context_parallel, partial_data_parallel)].key(fact)


@_rule()
def get_data_parallel_group(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                            partial_data_parallel: bool = False, independent_all_gather: bool = False) -> AnswerKey:
    """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
    ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
    all-gather group, on request."""
    if independent_all_gather and with_context_parallel and not partial_data_parallel:
        return DP_CP_AG.key(Fact.GROUP)
    return _data_parallel(Fact.GROUP, with_context_parallel, with_gtp_remat, partial_data_parallel)


_value("has_separate_all_gather_group", DP_CP_AG.key(Fact.EXISTS),
       "Whether initialize made a separate dp x cp group for all-gathers (create_all_gather_group=True).", "bool",
       absent=False)


@_rule()
def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> AnswerKey:
    """This rank's gloo data-parallel group (dp x cp with ``with_context_parallel``)."""
    # The gloo twins are the replicate groups' (megatron-core 0.19 builds none under gtp_remat).
    return _data_parallel(Fact.GLOO, with_context_parallel, False, partial_data_parallel)


@_rule()
def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False) -> AnswerKey:
    """This rank's tp x dp group (tp x dp x cp with ``with_context_parallel``)."""
    return TP_DP_CP.key(Fact.GROUP) if with_context_parallel else TP_DP.key(Fact.GROUP)


@_rule()
def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False) -> AnswerKey:
    """The FP8 amax-reduction group: tp x dp (x cp), or tp (x cp) with ``tp_only_amax_red``."""
    if tp_only_amax_red:
        return TP_CP.key(Fact.GROUP) if with_context_parallel else TP.key(Fact.GROUP)
    return TP_DP_CP.key(Fact.GROUP) if with_context_parallel else TP_DP.key(Fact.GROUP)


#: (spans expert gtp_remat, partial) -> the expert data-parallel kind.
_EXPERT_DATA_PARALLEL: dict[tuple[bool, bool], Kind] = {
    (True, False): EGTP_EDP, (False, False): EDP, (True, True): EGTP_EDP_INTRA, (False, True): EDP_INTRA}


def _expert_data_parallel(fact: Fact, with_gtp_remat: bool, partial_expert_data_parallel: bool) -> AnswerKey:
    """The key of an expert data-parallel answer; ``with_gtp_remat`` (0.19, default True) spans expert gtp_remat."""
    return _EXPERT_DATA_PARALLEL[(with_gtp_remat, partial_expert_data_parallel)].key(fact)


@_rule()
def get_expert_data_parallel_group(check_initialized: bool = True, with_gtp_remat: bool = True,
                                   partial_expert_data_parallel: bool = False) -> AnswerKey:
    """This rank's expert data-parallel group: spanning expert gtp_remat unless ``with_gtp_remat=False``
    (0.19: the replicate group); its instance's part with ``partial_expert_data_parallel``."""
    return _expert_data_parallel(Fact.GROUP, with_gtp_remat, partial_expert_data_parallel)


@_rule(deprecated="get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group "
                  "instead.")
def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> str:
    """Deprecated megatron-core name of get_expert_data_parallel_group (the group without expert gtp_remat)."""
    return _expert_data_parallel(Fact.GROUP, False, partial_expert_data_parallel)


@_rule()
def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> AnswerKey:
    """This rank's gloo expert data-parallel group."""
    return _expert_data_parallel(Fact.GLOO, False, partial_expert_data_parallel)


# --- ranks and sizes -------------------------------------------------------------------------

_value("get_tensor_model_parallel_world_size", TP.key(Fact.SIZE), "Number of ranks in this rank's tensor-parallel group.")
_value("get_tensor_model_parallel_rank", TP.key(Fact.RANK), "This rank's index in its tensor-parallel group.")
_value("get_pipeline_model_parallel_world_size", PP.key(Fact.SIZE), "Number of pipeline stages.")
_value("get_pipeline_model_parallel_rank", PP.key(Fact.RANK), "This rank's pipeline stage.")
_value("get_context_parallel_world_size", CP.key(Fact.SIZE), "Number of ranks in this rank's context-parallel group.")
_value("get_context_parallel_rank", CP.key(Fact.RANK), "This rank's index in its context-parallel group.")
_value("get_tensor_and_context_parallel_world_size", TP_CP.key(Fact.SIZE), "Number of ranks in this rank's tp x cp group.")
_value("get_tensor_and_context_parallel_rank", TP_CP.key(Fact.RANK), "This rank's index in its tp x cp group.")


@_rule("int")
def get_data_parallel_world_size(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                                 partial_data_parallel: bool = False) -> AnswerKey:
    """Number of ranks in this rank's data-parallel group."""
    return _data_parallel(Fact.SIZE, with_context_parallel, with_gtp_remat, partial_data_parallel)


@_rule("int")
def get_data_parallel_rank(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                           partial_data_parallel: bool = False) -> AnswerKey:
    """This rank's index in its data-parallel group."""
    return _data_parallel(Fact.RANK, with_context_parallel, with_gtp_remat, partial_data_parallel)


_value("get_expert_model_parallel_world_size", EP.key(Fact.SIZE), "Number of ranks in this rank's expert-parallel group.")
_value("get_expert_model_parallel_rank", EP.key(Fact.RANK), "This rank's index in its expert-parallel group.")
_value("get_expert_tensor_parallel_world_size", ETP.key(Fact.SIZE), "Number of ranks in this rank's expert-tensor group.")
_value("get_expert_tensor_parallel_rank", ETP.key(Fact.RANK), "This rank's index in its expert-tensor-parallel group.")
_value("get_expert_tensor_and_model_parallel_world_size", ETP_EP.key(Fact.SIZE), "Size of this rank's expert tp x ep group.")
_value("get_expert_tensor_and_model_parallel_rank", ETP_EP.key(Fact.RANK), "This rank's index in its expert tp x ep group.")


@_rule("int")
def get_expert_data_parallel_world_size(with_gtp_remat: bool = True,
                                        partial_expert_data_parallel: bool = False) -> AnswerKey:
    """Number of ranks in this rank's expert data-parallel group."""
    return _expert_data_parallel(Fact.SIZE, with_gtp_remat, partial_expert_data_parallel)


@_rule("int")
def get_expert_data_parallel_rank(with_gtp_remat: bool = True,
                                  partial_expert_data_parallel: bool = False) -> AnswerKey:
    """This rank's index in its expert data-parallel group."""
    return _expert_data_parallel(Fact.RANK, with_gtp_remat, partial_expert_data_parallel)


_value("get_gtp_weight_remat_world_size", GTP.key(Fact.SIZE),
       "Number of ranks in this rank's gtp_remat group (0 without one).")
_value("get_gtp_weight_remat_rank", GTP.key(Fact.RANK), "This rank's index in its gtp_remat group (0 without one).")
_value("get_expert_gtp_weight_remat_world_size", EGTP.key(Fact.SIZE),
       "Number of ranks in this rank's expert gtp_remat group (0 without one).")
_value("get_expert_gtp_weight_remat_rank", EGTP.key(Fact.RANK),
       "This rank's index in its expert gtp_remat group (0 without one).")
_value("get_virtual_pipeline_model_parallel_world_size", VPP_SIZE,
       "The interleaved schedule's number of model chunks per stage, or None.", "int | None")
_value("get_virtual_pipeline_model_parallel_rank", VPP_RANK, "The interleaved schedule's current model chunk, or None.",
       "int | None")

_value("get_model_parallel_src_rank", TP_PP.key(Fact.SRC), "Global rank of the first member of this rank's tp x pp group.")
_value("get_expert_model_parallel_src_rank", EP.key(Fact.SRC), "First global rank of this rank's expert-parallel group.")
_value("get_pipeline_model_parallel_first_rank", PP.key(Fact.FIRST),
       "Global rank of the first stage of this rank's pipeline.")
_value("get_pipeline_model_parallel_last_rank", PP.key(Fact.LAST), "Global rank of the last stage of this rank's pipeline.")
_value("get_pipeline_model_parallel_next_rank", PP.key(Fact.NEXT),
       "Global rank of the next stage; the last stage's next is the first (a ring).")
_value("get_pipeline_model_parallel_prev_rank", PP.key(Fact.PREV),
       "Global rank of the previous stage; the first stage's previous is the last (a ring).")
_value("get_all_ranks", ALL_RANKS, "This rank's tp, dp, cp, pp and ep ranks joined by '_' (megatron-core's format).",
       "str")
_value("get_tensor_model_parallel_src_rank", TP.key(Fact.SRC), "First global rank of this rank's tensor-parallel group.")


@_rule("int")
def get_data_parallel_src_rank(with_context_parallel: bool = False) -> AnswerKey:
    """Global rank of the first member of this rank's data-parallel group."""
    return DP_CP.key(Fact.SRC) if with_context_parallel else DP.key(Fact.SRC)


_value("is_rank_in_position_embedding_group", POS_EMBD.key(Fact.IN), "Whether this rank holds position embeddings.", "bool",
       absent=False)

# --- the short names MAGI-1 and WorldFoundry call ---------------------------------------------


@_rule()
def get_tp_group(with_context_parallel: bool = False) -> AnswerKey:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return TP_CP.key(Fact.GROUP) if with_context_parallel else TP.key(Fact.GROUP)


@_rule("int")
def get_tp_rank(with_context_parallel: bool = False) -> AnswerKey:
    """This rank's index in its tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return TP_CP.key(Fact.RANK) if with_context_parallel else TP.key(Fact.RANK)


@_rule("int")
def get_tp_world_size(with_context_parallel: bool = False) -> AnswerKey:
    """Number of ranks in this rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    return TP_CP.key(Fact.SIZE) if with_context_parallel else TP.key(Fact.SIZE)


@_rule("list[int]")
def get_tensor_model_parallel_ranks(with_context_parallel: bool = False, check_initialized: bool = True) -> AnswerKey:
    """Global ranks of this rank's tp (or tp x cp) group."""
    return TP_CP.key(Fact.RANKS) if with_context_parallel else TP.key(Fact.RANKS)
