"""megatron-core's parallel-state accessors: each answer precomputed, a call one global read.

The answers (``parallel_state.megatron.answers``) are computed when the groups are built and when an
override changes. An accessor runs per layer and per micro-batch, so most are written to cost what
megatron-core's own cost (``assert _GROUP is not None; return _GROUP``): a global of this module read.
Those are written by ``python -m parallel_state.tools.generate`` (the region below) from their
rules (``accessor_keys``: which answer each returns for its flags, with its docstring) and the
release table (the parameters of the release in use, exactly, in its order): each tests its flags,
one after another (a flag at False by truth, as megatron-core tests it; True with ``is``), and
returns the global holding that answer. ``_refresh`` sets those globals from the answers after every
change of the state and removes those with no answer (nothing initialized, a kind not built): the
read then raises NameError and, like any other argument values, the call goes to
``accessor_keys.answer``, which checks the arguments and answers or explains. ``check_initialized``
is never tested on the fast path: it decides only what happens without an answer.

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
from parallel_state.megatron.accessor_keys import answer
from parallel_state.megatron.answers import ANSWERS as _A
from parallel_state.megatron.answers import lookup as _lookup
from parallel_state.topology import answer_keys, kinds, releases
from parallel_state.topology.answer_keys import INITIALIZED, VPP_SIZE, AnswerKey, Fact
from parallel_state.topology.arguments import flag, non_negative_int
from parallel_state.topology.kinds import DP_CP, EMBD, HYBRID, PP

# <generated: accessors> by `python -m parallel_state.tools.generate` from accessor_keys.RULES and the release table
#: Each global an accessor reads on its fast path, and the key of the answer it holds (``_refresh``
#: sets them).
VARIABLES: dict[str, AnswerKey] = {
    "_DP_EXISTS": kinds.DP.key(Fact.EXISTS),
    "_INITIALIZED": answer_keys.INITIALIZED,
    "_TP_PP_GROUP": kinds.TP_PP.key(Fact.GROUP),
    "_TP_GROUP": kinds.TP.key(Fact.GROUP),
    "_PP_GROUP": kinds.PP.key(Fact.GROUP),
    "_CP_GROUP": kinds.CP.key(Fact.GROUP),
    "_TP_CP_GROUP": kinds.TP_CP.key(Fact.GROUP),
    "_EMBD_GROUP": kinds.EMBD.key(Fact.GROUP),
    "_POS_EMBD_GROUP": kinds.POS_EMBD.key(Fact.GROUP),
    "_CP_RANKS": kinds.CP.key(Fact.RANKS),
    "_HCP_GROUPS": kinds.HCP.key(Fact.GROUPS),
    "_EP_GROUP": kinds.EP.key(Fact.GROUP),
    "_ETP_GROUP": kinds.ETP.key(Fact.GROUP),
    "_ETP_EP_GROUP": kinds.ETP_EP.key(Fact.GROUP),
    "_GTP_GROUP": kinds.GTP.key(Fact.GROUP),
    "_GTP_RANKS": kinds.GTP.key(Fact.RANKS),
    "_EGTP_GROUP": kinds.EGTP.key(Fact.GROUP),
    "_EGTP_RANKS": kinds.EGTP.key(Fact.RANKS),
    "_ETP_EP_PP_GROUP": kinds.ETP_EP_PP.key(Fact.GROUP),
    "_ETP_EP_EGTP_PP_GROUP": kinds.ETP_EP_EGTP_PP.key(Fact.GROUP),
    "_DIST_OPT_GROUP": kinds.DIST_OPT.key(Fact.GROUP),
    "_EDP_INTER_GROUP": kinds.EDP_INTER.key(Fact.GROUP),
    "_GTP_DP_GROUP": kinds.GTP_DP.key(Fact.GROUP),
    "_GTP_DP_CP_GROUP": kinds.GTP_DP_CP.key(Fact.GROUP),
    "_DP_CP_AG_GROUP": kinds.DP_CP_AG.key(Fact.GROUP),
    "_GTP_DP_CP_INTRA_GROUP": kinds.GTP_DP_CP_INTRA.key(Fact.GROUP),
    "_DP_GROUP": kinds.DP.key(Fact.GROUP),
    "_DP_CP_GROUP": kinds.DP_CP.key(Fact.GROUP),
    "_DP_CP_INTRA_GROUP": kinds.DP_CP_INTRA.key(Fact.GROUP),
    "_DP_CP_AG_EXISTS": kinds.DP_CP_AG.key(Fact.EXISTS),
    "_DP_GLOO": kinds.DP.key(Fact.GLOO),
    "_DP_CP_GLOO": kinds.DP_CP.key(Fact.GLOO),
    "_DP_CP_INTRA_GLOO": kinds.DP_CP_INTRA.key(Fact.GLOO),
    "_TP_DP_GROUP": kinds.TP_DP.key(Fact.GROUP),
    "_TP_DP_CP_GROUP": kinds.TP_DP_CP.key(Fact.GROUP),
    "_EGTP_EDP_GROUP": kinds.EGTP_EDP.key(Fact.GROUP),
    "_EGTP_EDP_INTRA_GROUP": kinds.EGTP_EDP_INTRA.key(Fact.GROUP),
    "_EDP_GROUP": kinds.EDP.key(Fact.GROUP),
    "_EDP_INTRA_GROUP": kinds.EDP_INTRA.key(Fact.GROUP),
    "_EDP_GLOO": kinds.EDP.key(Fact.GLOO),
    "_EDP_INTRA_GLOO": kinds.EDP_INTRA.key(Fact.GLOO),
    "_TP_SIZE": kinds.TP.key(Fact.SIZE),
    "_TP_RANK": kinds.TP.key(Fact.RANK),
    "_PP_SIZE": kinds.PP.key(Fact.SIZE),
    "_PP_RANK": kinds.PP.key(Fact.RANK),
    "_CP_SIZE": kinds.CP.key(Fact.SIZE),
    "_CP_RANK": kinds.CP.key(Fact.RANK),
    "_TP_CP_SIZE": kinds.TP_CP.key(Fact.SIZE),
    "_TP_CP_RANK": kinds.TP_CP.key(Fact.RANK),
    "_GTP_DP_SIZE": kinds.GTP_DP.key(Fact.SIZE),
    "_GTP_DP_CP_SIZE": kinds.GTP_DP_CP.key(Fact.SIZE),
    "_GTP_DP_CP_INTRA_SIZE": kinds.GTP_DP_CP_INTRA.key(Fact.SIZE),
    "_DP_SIZE": kinds.DP.key(Fact.SIZE),
    "_DP_CP_SIZE": kinds.DP_CP.key(Fact.SIZE),
    "_DP_CP_INTRA_SIZE": kinds.DP_CP_INTRA.key(Fact.SIZE),
    "_GTP_DP_RANK": kinds.GTP_DP.key(Fact.RANK),
    "_GTP_DP_CP_RANK": kinds.GTP_DP_CP.key(Fact.RANK),
    "_GTP_DP_CP_INTRA_RANK": kinds.GTP_DP_CP_INTRA.key(Fact.RANK),
    "_DP_RANK": kinds.DP.key(Fact.RANK),
    "_DP_CP_RANK": kinds.DP_CP.key(Fact.RANK),
    "_DP_CP_INTRA_RANK": kinds.DP_CP_INTRA.key(Fact.RANK),
    "_EP_SIZE": kinds.EP.key(Fact.SIZE),
    "_EP_RANK": kinds.EP.key(Fact.RANK),
    "_ETP_SIZE": kinds.ETP.key(Fact.SIZE),
    "_ETP_RANK": kinds.ETP.key(Fact.RANK),
    "_ETP_EP_SIZE": kinds.ETP_EP.key(Fact.SIZE),
    "_ETP_EP_RANK": kinds.ETP_EP.key(Fact.RANK),
    "_EGTP_EDP_SIZE": kinds.EGTP_EDP.key(Fact.SIZE),
    "_EGTP_EDP_INTRA_SIZE": kinds.EGTP_EDP_INTRA.key(Fact.SIZE),
    "_EDP_SIZE": kinds.EDP.key(Fact.SIZE),
    "_EDP_INTRA_SIZE": kinds.EDP_INTRA.key(Fact.SIZE),
    "_EGTP_EDP_RANK": kinds.EGTP_EDP.key(Fact.RANK),
    "_EGTP_EDP_INTRA_RANK": kinds.EGTP_EDP_INTRA.key(Fact.RANK),
    "_EDP_RANK": kinds.EDP.key(Fact.RANK),
    "_EDP_INTRA_RANK": kinds.EDP_INTRA.key(Fact.RANK),
    "_GTP_SIZE": kinds.GTP.key(Fact.SIZE),
    "_GTP_RANK": kinds.GTP.key(Fact.RANK),
    "_EGTP_SIZE": kinds.EGTP.key(Fact.SIZE),
    "_EGTP_RANK": kinds.EGTP.key(Fact.RANK),
    "_VPP_SIZE": answer_keys.VPP_SIZE,
    "_VPP_RANK": answer_keys.VPP_RANK,
    "_TP_PP_SRC": kinds.TP_PP.key(Fact.SRC),
    "_EP_SRC": kinds.EP.key(Fact.SRC),
    "_PP_FIRST": kinds.PP.key(Fact.FIRST),
    "_PP_LAST": kinds.PP.key(Fact.LAST),
    "_PP_NEXT": kinds.PP.key(Fact.NEXT),
    "_PP_PREV": kinds.PP.key(Fact.PREV),
    "_ALL_RANKS": answer_keys.ALL_RANKS,
    "_TP_SRC": kinds.TP.key(Fact.SRC),
    "_DP_SRC": kinds.DP.key(Fact.SRC),
    "_DP_CP_SRC": kinds.DP_CP.key(Fact.SRC),
    "_POS_EMBD_IN": kinds.POS_EMBD.key(Fact.IN),
    "_TP_RANKS": kinds.TP.key(Fact.RANKS),
    "_TP_CP_RANKS": kinds.TP_CP.key(Fact.RANKS),
}


def is_initialized() -> bool:
    """Whether the model-parallel groups exist (megatron-core: the data-parallel group is set)."""
    try:
        return _DP_EXISTS
    except NameError:
        return answer("is_initialized")


def model_parallel_is_initialized() -> bool:
    """Whether the tensor-, pipeline- and data-parallel groups exist."""
    try:
        return _INITIALIZED
    except NameError:
        return answer("model_parallel_is_initialized")


def get_model_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's model-parallel (tp x pp) group."""
    try:
        return _TP_PP_GROUP
    except NameError:
        return answer("get_model_parallel_group", check_initialized=check_initialized)


def get_tensor_model_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's tensor-model-parallel group."""
    try:
        return _TP_GROUP
    except NameError:
        return answer("get_tensor_model_parallel_group", check_initialized=check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's pipeline-model-parallel group."""
    try:
        return _PP_GROUP
    except NameError:
        return answer("get_pipeline_model_parallel_group", check_initialized=check_initialized)


def get_context_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's context-parallel group."""
    try:
        return _CP_GROUP
    except NameError:
        return answer("get_context_parallel_group", check_initialized=check_initialized)


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's tensor x context-parallel group."""
    try:
        return _TP_CP_GROUP
    except NameError:
        return answer("get_tensor_and_context_parallel_group", check_initialized=check_initialized)


def get_embedding_group(check_initialized: bool = True) -> Any:
    """This rank's embedding group (the stages holding word embeddings)."""
    try:
        return _EMBD_GROUP
    except NameError:
        return answer("get_embedding_group", check_initialized=check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> Any:
    """This rank's position-embedding group."""
    try:
        return _POS_EMBD_GROUP
    except NameError:
        return answer("get_position_embedding_group", check_initialized=check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int]:
    """Global ranks of this rank's context-parallel group."""
    try:
        return _CP_RANKS
    except NameError:
        return answer("get_context_parallel_global_ranks", check_initialized=check_initialized)


def get_hierarchical_context_parallel_groups(check_initialized: bool = True) -> list[Any]:
    """This rank's hierarchical context-parallel groups, innermost level first."""
    try:
        return _HCP_GROUPS
    except NameError:
        return answer("get_hierarchical_context_parallel_groups", check_initialized=check_initialized)


def get_expert_model_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's expert-model-parallel group."""
    try:
        return _EP_GROUP
    except NameError:
        return answer("get_expert_model_parallel_group", check_initialized=check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's expert-tensor-parallel group."""
    try:
        return _ETP_GROUP
    except NameError:
        return answer("get_expert_tensor_parallel_group", check_initialized=check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> Any:
    """This rank's expert tp x ep group."""
    try:
        return _ETP_EP_GROUP
    except NameError:
        return answer("get_expert_tensor_and_model_parallel_group", check_initialized=check_initialized)


def get_gtp_weight_remat_group(check_initialized: bool = True) -> Any:
    """This rank's generalized tensor-parallel (gtp_remat) weight-sharding group (megatron-core 0.19)."""
    try:
        return _GTP_GROUP
    except NameError:
        return answer("get_gtp_weight_remat_group", check_initialized=check_initialized)


def get_gtp_weight_remat_global_ranks(check_initialized: bool = True) -> list[int]:
    """Global ranks of this rank's gtp_remat group."""
    try:
        return _GTP_RANKS
    except NameError:
        return answer("get_gtp_weight_remat_global_ranks", check_initialized=check_initialized)


def get_expert_gtp_weight_remat_group(check_initialized: bool = True) -> Any:
    """This rank's expert gtp_remat weight-sharding group (megatron-core 0.19)."""
    try:
        return _EGTP_GROUP
    except NameError:
        return answer("get_expert_gtp_weight_remat_group", check_initialized=check_initialized)


def get_expert_gtp_weight_remat_global_ranks(check_initialized: bool = True) -> list[int]:
    """Global ranks of this rank's expert gtp_remat group."""
    try:
        return _EGTP_RANKS
    except NameError:
        return answer("get_expert_gtp_weight_remat_global_ranks", check_initialized=check_initialized)


if releases.in_use() in ("0.16", "0.17", "0.18"):
    def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True) -> Any:
        """This rank's expert tp x ep x pp group (merged across expert gtp_remat peers with ``with_egtp_remat``)."""
        try:
            return _ETP_EP_PP_GROUP
        except NameError:
            return answer("get_expert_tensor_model_pipeline_parallel_group", check_initialized=check_initialized)
elif releases.in_use() == "0.19":
    def get_expert_tensor_model_pipeline_parallel_group(
        check_initialized: bool = True, with_egtp_remat: bool = False,
    ) -> Any:
        """This rank's expert tp x ep x pp group (merged across expert gtp_remat peers with ``with_egtp_remat``)."""
        try:
            if not with_egtp_remat:
                return _ETP_EP_PP_GROUP
            elif with_egtp_remat is True:
                return _ETP_EP_EGTP_PP_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_tensor_model_pipeline_parallel_group", check_initialized=check_initialized,
            with_egtp_remat=with_egtp_remat,
        )
else:  # any release parallel_state does not know
    def get_expert_tensor_model_pipeline_parallel_group(
        check_initialized: bool = True, *beyond, with_egtp_remat: bool = False,
    ) -> Any:
        """This rank's expert tp x ep x pp group (merged across expert gtp_remat peers with ``with_egtp_remat``)."""
        if beyond:
            releases.refuse("get_expert_tensor_model_pipeline_parallel_group()", 1, len(beyond))
        try:
            if not with_egtp_remat:
                return _ETP_EP_PP_GROUP
            elif with_egtp_remat is True:
                return _ETP_EP_EGTP_PP_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_tensor_model_pipeline_parallel_group", check_initialized=check_initialized,
            with_egtp_remat=with_egtp_remat,
        )


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True) -> Any:
    """The group of every rank in this rank's distributed-optimizer instance."""
    try:
        return _DIST_OPT_GROUP
    except NameError:
        return answer("get_intra_distributed_optimizer_instance_group", check_initialized=check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True) -> Any:
    """The group spanning the distributed-optimizer instances (one rank of each)."""
    try:
        return _EDP_INTER_GROUP
    except NameError:
        return answer("get_inter_distributed_optimizer_instance_group", check_initialized=check_initialized)


if releases.in_use() in ("0.16", "0.17"):
    def get_data_parallel_group(
        with_context_parallel: bool = False, partial_data_parallel: bool = False, independent_all_gather: bool = False,
    ) -> Any:
        """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
        ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
        all-gather group, on request.
        """
        try:
            if not with_context_parallel:
                if not partial_data_parallel:
                    if not independent_all_gather:
                        return _GTP_DP_GROUP
                    elif independent_all_gather is True:
                        return _GTP_DP_GROUP
            elif with_context_parallel is True:
                if not partial_data_parallel:
                    if not independent_all_gather:
                        return _GTP_DP_CP_GROUP
                    elif independent_all_gather is True:
                        return _DP_CP_AG_GROUP
                elif partial_data_parallel is True:
                    if not independent_all_gather:
                        return _GTP_DP_CP_INTRA_GROUP
                    elif independent_all_gather is True:
                        return _GTP_DP_CP_INTRA_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_group", with_context_parallel=with_context_parallel,
            partial_data_parallel=partial_data_parallel, independent_all_gather=independent_all_gather,
        )
elif releases.in_use() == "0.18":
    def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> Any:
        """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
        ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
        all-gather group, on request.
        """
        try:
            if not with_context_parallel:
                if not partial_data_parallel:
                    return _GTP_DP_GROUP
            elif with_context_parallel is True:
                if not partial_data_parallel:
                    return _GTP_DP_CP_GROUP
                elif partial_data_parallel is True:
                    return _GTP_DP_CP_INTRA_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_group", with_context_parallel=with_context_parallel,
            partial_data_parallel=partial_data_parallel,
        )
elif releases.in_use() == "0.19":
    def get_data_parallel_group(
        with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False,
    ) -> Any:
        """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
        ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
        all-gather group, on request.
        """
        try:
            if not with_context_parallel:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_GROUP
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_GROUP
            elif with_context_parallel is True:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_CP_GROUP
                    elif partial_data_parallel is True:
                        return _GTP_DP_CP_INTRA_GROUP
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_CP_GROUP
                    elif partial_data_parallel is True:
                        return _DP_CP_INTRA_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_group", with_context_parallel=with_context_parallel, with_gtp_remat=with_gtp_remat,
            partial_data_parallel=partial_data_parallel,
        )
else:  # any release parallel_state does not know
    def get_data_parallel_group(
        with_context_parallel: bool = False, *beyond, with_gtp_remat: bool = True, partial_data_parallel: bool = False,
        independent_all_gather: bool = False,
    ) -> Any:
        """This rank's data-parallel group: dp x cp with ``with_context_parallel``; spanning gtp_remat unless
        ``with_gtp_remat=False`` (0.19: the replicate group); its instance's part, or 0.16/0.17's separate
        all-gather group, on request.
        """
        if beyond:
            releases.refuse("get_data_parallel_group()", 1, len(beyond))
        try:
            if not with_context_parallel:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        if not independent_all_gather:
                            return _GTP_DP_GROUP
                        elif independent_all_gather is True:
                            return _GTP_DP_GROUP
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        if not independent_all_gather:
                            return _DP_GROUP
                        elif independent_all_gather is True:
                            return _DP_GROUP
            elif with_context_parallel is True:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        if not independent_all_gather:
                            return _GTP_DP_CP_GROUP
                        elif independent_all_gather is True:
                            return _DP_CP_AG_GROUP
                    elif partial_data_parallel is True:
                        if not independent_all_gather:
                            return _GTP_DP_CP_INTRA_GROUP
                        elif independent_all_gather is True:
                            return _GTP_DP_CP_INTRA_GROUP
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        if not independent_all_gather:
                            return _DP_CP_GROUP
                        elif independent_all_gather is True:
                            return _DP_CP_AG_GROUP
                    elif partial_data_parallel is True:
                        if not independent_all_gather:
                            return _DP_CP_INTRA_GROUP
                        elif independent_all_gather is True:
                            return _DP_CP_INTRA_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_group", with_context_parallel=with_context_parallel, with_gtp_remat=with_gtp_remat,
            partial_data_parallel=partial_data_parallel, independent_all_gather=independent_all_gather,
        )


def has_separate_all_gather_group() -> bool:
    """Whether initialize made a separate dp x cp group for all-gathers (create_all_gather_group=True)."""
    try:
        return _DP_CP_AG_EXISTS
    except NameError:
        return answer("has_separate_all_gather_group")


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> Any:
    """This rank's gloo data-parallel group (dp x cp with ``with_context_parallel``)."""
    try:
        if not with_context_parallel:
            if not partial_data_parallel:
                return _DP_GLOO
        elif with_context_parallel is True:
            if not partial_data_parallel:
                return _DP_CP_GLOO
            elif partial_data_parallel is True:
                return _DP_CP_INTRA_GLOO
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer(
        "get_data_parallel_group_gloo", with_context_parallel=with_context_parallel,
        partial_data_parallel=partial_data_parallel,
    )


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False) -> Any:
    """This rank's tp x dp group (tp x dp x cp with ``with_context_parallel``)."""
    try:
        if not with_context_parallel:
            return _TP_DP_GROUP
        elif with_context_parallel is True:
            return _TP_DP_CP_GROUP
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer(
        "get_tensor_and_data_parallel_group", check_initialized=check_initialized,
        with_context_parallel=with_context_parallel,
    )


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False) -> Any:
    """The FP8 amax-reduction group: tp x dp (x cp), or tp (x cp) with ``tp_only_amax_red``."""
    try:
        if not with_context_parallel:
            if not tp_only_amax_red:
                return _TP_DP_GROUP
            elif tp_only_amax_red is True:
                return _TP_GROUP
        elif with_context_parallel is True:
            if not tp_only_amax_red:
                return _TP_DP_CP_GROUP
            elif tp_only_amax_red is True:
                return _TP_CP_GROUP
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer(
        "get_amax_reduction_group", with_context_parallel=with_context_parallel, tp_only_amax_red=tp_only_amax_red,
    )


if releases.in_use() in ("0.16", "0.17", "0.18"):
    def get_expert_data_parallel_group(
        check_initialized: bool = True, partial_expert_data_parallel: bool = False,
    ) -> Any:
        """This rank's expert data-parallel group: spanning expert gtp_remat unless ``with_gtp_remat=False``
        (0.19: the replicate group); its instance's part with ``partial_expert_data_parallel``.
        """
        try:
            if not partial_expert_data_parallel:
                return _EGTP_EDP_GROUP
            elif partial_expert_data_parallel is True:
                return _EGTP_EDP_INTRA_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_data_parallel_group", check_initialized=check_initialized,
            partial_expert_data_parallel=partial_expert_data_parallel,
        )
elif releases.in_use() == "0.19":
    def get_expert_data_parallel_group(
        check_initialized: bool = True, with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False,
    ) -> Any:
        """This rank's expert data-parallel group: spanning expert gtp_remat unless ``with_gtp_remat=False``
        (0.19: the replicate group); its instance's part with ``partial_expert_data_parallel``.
        """
        try:
            if with_gtp_remat is True:
                if not partial_expert_data_parallel:
                    return _EGTP_EDP_GROUP
                elif partial_expert_data_parallel is True:
                    return _EGTP_EDP_INTRA_GROUP
            elif not with_gtp_remat:
                if not partial_expert_data_parallel:
                    return _EDP_GROUP
                elif partial_expert_data_parallel is True:
                    return _EDP_INTRA_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_data_parallel_group", check_initialized=check_initialized, with_gtp_remat=with_gtp_remat,
            partial_expert_data_parallel=partial_expert_data_parallel,
        )
else:  # any release parallel_state does not know
    def get_expert_data_parallel_group(
        check_initialized: bool = True, *beyond, with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False,
    ) -> Any:
        """This rank's expert data-parallel group: spanning expert gtp_remat unless ``with_gtp_remat=False``
        (0.19: the replicate group); its instance's part with ``partial_expert_data_parallel``.
        """
        if beyond:
            releases.refuse("get_expert_data_parallel_group()", 1, len(beyond))
        try:
            if with_gtp_remat is True:
                if not partial_expert_data_parallel:
                    return _EGTP_EDP_GROUP
                elif partial_expert_data_parallel is True:
                    return _EGTP_EDP_INTRA_GROUP
            elif not with_gtp_remat:
                if not partial_expert_data_parallel:
                    return _EDP_GROUP
                elif partial_expert_data_parallel is True:
                    return _EDP_INTRA_GROUP
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_data_parallel_group", check_initialized=check_initialized, with_gtp_remat=with_gtp_remat,
            partial_expert_data_parallel=partial_expert_data_parallel,
        )


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> Any:
    """Deprecated megatron-core name of get_expert_data_parallel_group (the group without expert gtp_remat)."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group instead.",
        DeprecationWarning, 1,
    )
    try:
        if not partial_expert_data_parallel:
            return _EDP_GROUP
        elif partial_expert_data_parallel is True:
            return _EDP_INTRA_GROUP
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer("get_data_modulo_expert_parallel_group", partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> Any:
    """This rank's gloo expert data-parallel group."""
    try:
        if not partial_expert_data_parallel:
            return _EDP_GLOO
        elif partial_expert_data_parallel is True:
            return _EDP_INTRA_GLOO
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer("get_expert_data_parallel_group_gloo", partial_expert_data_parallel=partial_expert_data_parallel)


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in this rank's tensor-parallel group."""
    try:
        return _TP_SIZE
    except NameError:
        return answer("get_tensor_model_parallel_world_size")


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group."""
    try:
        return _TP_RANK
    except NameError:
        return answer("get_tensor_model_parallel_rank")


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    try:
        return _PP_SIZE
    except NameError:
        return answer("get_pipeline_model_parallel_world_size")


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    try:
        return _PP_RANK
    except NameError:
        return answer("get_pipeline_model_parallel_rank")


def get_context_parallel_world_size() -> int:
    """Number of ranks in this rank's context-parallel group."""
    try:
        return _CP_SIZE
    except NameError:
        return answer("get_context_parallel_world_size")


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group."""
    try:
        return _CP_RANK
    except NameError:
        return answer("get_context_parallel_rank")


def get_tensor_and_context_parallel_world_size() -> int:
    """Number of ranks in this rank's tp x cp group."""
    try:
        return _TP_CP_SIZE
    except NameError:
        return answer("get_tensor_and_context_parallel_world_size")


def get_tensor_and_context_parallel_rank() -> int:
    """This rank's index in its tp x cp group."""
    try:
        return _TP_CP_RANK
    except NameError:
        return answer("get_tensor_and_context_parallel_rank")


if releases.in_use() in ("0.16", "0.17", "0.18"):
    def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
        """Number of ranks in this rank's data-parallel group."""
        try:
            if not with_context_parallel:
                if not partial_data_parallel:
                    return _GTP_DP_SIZE
            elif with_context_parallel is True:
                if not partial_data_parallel:
                    return _GTP_DP_CP_SIZE
                elif partial_data_parallel is True:
                    return _GTP_DP_CP_INTRA_SIZE
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_world_size", with_context_parallel=with_context_parallel,
            partial_data_parallel=partial_data_parallel,
        )
elif releases.in_use() == "0.19":
    def get_data_parallel_world_size(
        with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False,
    ) -> int:
        """Number of ranks in this rank's data-parallel group."""
        try:
            if not with_context_parallel:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_SIZE
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_SIZE
            elif with_context_parallel is True:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_CP_SIZE
                    elif partial_data_parallel is True:
                        return _GTP_DP_CP_INTRA_SIZE
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_CP_SIZE
                    elif partial_data_parallel is True:
                        return _DP_CP_INTRA_SIZE
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_world_size", with_context_parallel=with_context_parallel, with_gtp_remat=with_gtp_remat,
            partial_data_parallel=partial_data_parallel,
        )
else:  # any release parallel_state does not know
    def get_data_parallel_world_size(
        with_context_parallel: bool = False, *beyond, with_gtp_remat: bool = True, partial_data_parallel: bool = False,
    ) -> int:
        """Number of ranks in this rank's data-parallel group."""
        if beyond:
            releases.refuse("get_data_parallel_world_size()", 1, len(beyond))
        try:
            if not with_context_parallel:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_SIZE
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_SIZE
            elif with_context_parallel is True:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_CP_SIZE
                    elif partial_data_parallel is True:
                        return _GTP_DP_CP_INTRA_SIZE
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_CP_SIZE
                    elif partial_data_parallel is True:
                        return _DP_CP_INTRA_SIZE
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_world_size", with_context_parallel=with_context_parallel, with_gtp_remat=with_gtp_remat,
            partial_data_parallel=partial_data_parallel,
        )


if releases.in_use() in ("0.16", "0.17", "0.18"):
    def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
        """This rank's index in its data-parallel group."""
        try:
            if not with_context_parallel:
                if not partial_data_parallel:
                    return _GTP_DP_RANK
            elif with_context_parallel is True:
                if not partial_data_parallel:
                    return _GTP_DP_CP_RANK
                elif partial_data_parallel is True:
                    return _GTP_DP_CP_INTRA_RANK
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_rank", with_context_parallel=with_context_parallel,
            partial_data_parallel=partial_data_parallel,
        )
elif releases.in_use() == "0.19":
    def get_data_parallel_rank(
        with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False,
    ) -> int:
        """This rank's index in its data-parallel group."""
        try:
            if not with_context_parallel:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_RANK
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_RANK
            elif with_context_parallel is True:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_CP_RANK
                    elif partial_data_parallel is True:
                        return _GTP_DP_CP_INTRA_RANK
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_CP_RANK
                    elif partial_data_parallel is True:
                        return _DP_CP_INTRA_RANK
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_rank", with_context_parallel=with_context_parallel, with_gtp_remat=with_gtp_remat,
            partial_data_parallel=partial_data_parallel,
        )
else:  # any release parallel_state does not know
    def get_data_parallel_rank(
        with_context_parallel: bool = False, *beyond, with_gtp_remat: bool = True, partial_data_parallel: bool = False,
    ) -> int:
        """This rank's index in its data-parallel group."""
        if beyond:
            releases.refuse("get_data_parallel_rank()", 1, len(beyond))
        try:
            if not with_context_parallel:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_RANK
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_RANK
            elif with_context_parallel is True:
                if with_gtp_remat is True:
                    if not partial_data_parallel:
                        return _GTP_DP_CP_RANK
                    elif partial_data_parallel is True:
                        return _GTP_DP_CP_INTRA_RANK
                elif not with_gtp_remat:
                    if not partial_data_parallel:
                        return _DP_CP_RANK
                    elif partial_data_parallel is True:
                        return _DP_CP_INTRA_RANK
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_data_parallel_rank", with_context_parallel=with_context_parallel, with_gtp_remat=with_gtp_remat,
            partial_data_parallel=partial_data_parallel,
        )


def get_expert_model_parallel_world_size() -> int:
    """Number of ranks in this rank's expert-parallel group."""
    try:
        return _EP_SIZE
    except NameError:
        return answer("get_expert_model_parallel_world_size")


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-parallel group."""
    try:
        return _EP_RANK
    except NameError:
        return answer("get_expert_model_parallel_rank")


def get_expert_tensor_parallel_world_size() -> int:
    """Number of ranks in this rank's expert-tensor group."""
    try:
        return _ETP_SIZE
    except NameError:
        return answer("get_expert_tensor_parallel_world_size")


def get_expert_tensor_parallel_rank() -> int:
    """This rank's index in its expert-tensor-parallel group."""
    try:
        return _ETP_RANK
    except NameError:
        return answer("get_expert_tensor_parallel_rank")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of this rank's expert tp x ep group."""
    try:
        return _ETP_EP_SIZE
    except NameError:
        return answer("get_expert_tensor_and_model_parallel_world_size")


def get_expert_tensor_and_model_parallel_rank() -> int:
    """This rank's index in its expert tp x ep group."""
    try:
        return _ETP_EP_RANK
    except NameError:
        return answer("get_expert_tensor_and_model_parallel_rank")


if releases.in_use() in ("0.16", "0.17", "0.18"):
    def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
        """Number of ranks in this rank's expert data-parallel group."""
        try:
            if not partial_expert_data_parallel:
                return _EGTP_EDP_SIZE
            elif partial_expert_data_parallel is True:
                return _EGTP_EDP_INTRA_SIZE
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer("get_expert_data_parallel_world_size", partial_expert_data_parallel=partial_expert_data_parallel)
elif releases.in_use() == "0.19":
    def get_expert_data_parallel_world_size(
        with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False,
    ) -> int:
        """Number of ranks in this rank's expert data-parallel group."""
        try:
            if with_gtp_remat is True:
                if not partial_expert_data_parallel:
                    return _EGTP_EDP_SIZE
                elif partial_expert_data_parallel is True:
                    return _EGTP_EDP_INTRA_SIZE
            elif not with_gtp_remat:
                if not partial_expert_data_parallel:
                    return _EDP_SIZE
                elif partial_expert_data_parallel is True:
                    return _EDP_INTRA_SIZE
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_data_parallel_world_size", with_gtp_remat=with_gtp_remat,
            partial_expert_data_parallel=partial_expert_data_parallel,
        )
else:  # any release parallel_state does not know
    def get_expert_data_parallel_world_size(
        *beyond, with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False,
    ) -> int:
        """Number of ranks in this rank's expert data-parallel group."""
        if beyond:
            releases.refuse("get_expert_data_parallel_world_size()", 0, len(beyond))
        try:
            if with_gtp_remat is True:
                if not partial_expert_data_parallel:
                    return _EGTP_EDP_SIZE
                elif partial_expert_data_parallel is True:
                    return _EGTP_EDP_INTRA_SIZE
            elif not with_gtp_remat:
                if not partial_expert_data_parallel:
                    return _EDP_SIZE
                elif partial_expert_data_parallel is True:
                    return _EDP_INTRA_SIZE
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_data_parallel_world_size", with_gtp_remat=with_gtp_remat,
            partial_expert_data_parallel=partial_expert_data_parallel,
        )


if releases.in_use() in ("0.16", "0.17", "0.18"):
    def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
        """This rank's index in its expert data-parallel group."""
        try:
            if not partial_expert_data_parallel:
                return _EGTP_EDP_RANK
            elif partial_expert_data_parallel is True:
                return _EGTP_EDP_INTRA_RANK
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer("get_expert_data_parallel_rank", partial_expert_data_parallel=partial_expert_data_parallel)
elif releases.in_use() == "0.19":
    def get_expert_data_parallel_rank(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
        """This rank's index in its expert data-parallel group."""
        try:
            if with_gtp_remat is True:
                if not partial_expert_data_parallel:
                    return _EGTP_EDP_RANK
                elif partial_expert_data_parallel is True:
                    return _EGTP_EDP_INTRA_RANK
            elif not with_gtp_remat:
                if not partial_expert_data_parallel:
                    return _EDP_RANK
                elif partial_expert_data_parallel is True:
                    return _EDP_INTRA_RANK
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_data_parallel_rank", with_gtp_remat=with_gtp_remat,
            partial_expert_data_parallel=partial_expert_data_parallel,
        )
else:  # any release parallel_state does not know
    def get_expert_data_parallel_rank(
        *beyond, with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False,
    ) -> int:
        """This rank's index in its expert data-parallel group."""
        if beyond:
            releases.refuse("get_expert_data_parallel_rank()", 0, len(beyond))
        try:
            if with_gtp_remat is True:
                if not partial_expert_data_parallel:
                    return _EGTP_EDP_RANK
                elif partial_expert_data_parallel is True:
                    return _EGTP_EDP_INTRA_RANK
            elif not with_gtp_remat:
                if not partial_expert_data_parallel:
                    return _EDP_RANK
                elif partial_expert_data_parallel is True:
                    return _EDP_INTRA_RANK
        except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
            pass
        return answer(
            "get_expert_data_parallel_rank", with_gtp_remat=with_gtp_remat,
            partial_expert_data_parallel=partial_expert_data_parallel,
        )


def get_gtp_weight_remat_world_size() -> int:
    """Number of ranks in this rank's gtp_remat group (0 without one)."""
    try:
        return _GTP_SIZE
    except NameError:
        return answer("get_gtp_weight_remat_world_size")


def get_gtp_weight_remat_rank() -> int:
    """This rank's index in its gtp_remat group (0 without one)."""
    try:
        return _GTP_RANK
    except NameError:
        return answer("get_gtp_weight_remat_rank")


def get_expert_gtp_weight_remat_world_size() -> int:
    """Number of ranks in this rank's expert gtp_remat group (0 without one)."""
    try:
        return _EGTP_SIZE
    except NameError:
        return answer("get_expert_gtp_weight_remat_world_size")


def get_expert_gtp_weight_remat_rank() -> int:
    """This rank's index in its expert gtp_remat group (0 without one)."""
    try:
        return _EGTP_RANK
    except NameError:
        return answer("get_expert_gtp_weight_remat_rank")


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """The interleaved schedule's number of model chunks per stage, or None."""
    try:
        return _VPP_SIZE
    except NameError:
        return answer("get_virtual_pipeline_model_parallel_world_size")


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The interleaved schedule's current model chunk, or None."""
    try:
        return _VPP_RANK
    except NameError:
        return answer("get_virtual_pipeline_model_parallel_rank")


def get_model_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's tp x pp group."""
    try:
        return _TP_PP_SRC
    except NameError:
        return answer("get_model_parallel_src_rank")


def get_expert_model_parallel_src_rank() -> int:
    """First global rank of this rank's expert-parallel group."""
    try:
        return _EP_SRC
    except NameError:
        return answer("get_expert_model_parallel_src_rank")


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this rank's pipeline."""
    try:
        return _PP_FIRST
    except NameError:
        return answer("get_pipeline_model_parallel_first_rank")


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    try:
        return _PP_LAST
    except NameError:
        return answer("get_pipeline_model_parallel_last_rank")


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage; the last stage's next is the first (a ring)."""
    try:
        return _PP_NEXT
    except NameError:
        return answer("get_pipeline_model_parallel_next_rank")


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage; the first stage's previous is the last (a ring)."""
    try:
        return _PP_PREV
    except NameError:
        return answer("get_pipeline_model_parallel_prev_rank")


def get_all_ranks() -> str:
    """This rank's tp, dp, cp, pp and ep ranks joined by '_' (megatron-core's format)."""
    try:
        return _ALL_RANKS
    except NameError:
        return answer("get_all_ranks")


def get_tensor_model_parallel_src_rank() -> int:
    """First global rank of this rank's tensor-parallel group."""
    try:
        return _TP_SRC
    except NameError:
        return answer("get_tensor_model_parallel_src_rank")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's data-parallel group."""
    try:
        if not with_context_parallel:
            return _DP_SRC
        elif with_context_parallel is True:
            return _DP_CP_SRC
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer("get_data_parallel_src_rank", with_context_parallel=with_context_parallel)


def is_rank_in_position_embedding_group() -> bool:
    """Whether this rank holds position embeddings."""
    try:
        return _POS_EMBD_IN
    except NameError:
        return answer("is_rank_in_position_embedding_group")


def get_tp_group(with_context_parallel: bool = False) -> Any:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    try:
        if not with_context_parallel:
            return _TP_GROUP
        elif with_context_parallel is True:
            return _TP_CP_GROUP
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer("get_tp_group", with_context_parallel=with_context_parallel)


def get_tp_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    try:
        if not with_context_parallel:
            return _TP_RANK
        elif with_context_parallel is True:
            return _TP_CP_RANK
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer("get_tp_rank", with_context_parallel=with_context_parallel)


def get_tp_world_size(with_context_parallel: bool = False) -> int:
    """Number of ranks in this rank's tensor-parallel group (tp x cp with ``with_context_parallel``)."""
    try:
        if not with_context_parallel:
            return _TP_SIZE
        elif with_context_parallel is True:
            return _TP_CP_SIZE
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer("get_tp_world_size", with_context_parallel=with_context_parallel)


def get_tensor_model_parallel_ranks(
    with_context_parallel: bool = False, check_initialized: bool = True,
) -> list[int]:
    """Global ranks of this rank's tp (or tp x cp) group."""
    try:
        if not with_context_parallel:
            return _TP_RANKS
        elif with_context_parallel is True:
            return _TP_CP_RANKS
    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why
        pass
    return answer(
        "get_tensor_model_parallel_ranks", with_context_parallel=with_context_parallel,
        check_initialized=check_initialized,
    )
# </generated: accessors>


def _refresh() -> None:
    """Set every fast-path global from the answers; remove those with no answer."""
    namespace = globals()
    for variable, key in VARIABLES.items():
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
    try:
        return not _DP_EXISTS  # is_initialized's answer, one global read
    except NameError:
        return not answer("is_initialized")


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True, group_size: int | None = None) -> Any:
    """The hybrid context-parallel group of ``group_size`` ranks holding this rank (dp x cp itself at full size)."""
    check = flag("check_initialized", check_initialized)
    if not check and INITIALIZED not in _A:
        return None
    if group_size == get_data_parallel_world_size(with_context_parallel=True):
        return _lookup(_KEY_DP_CP_GROUP) if check else _A.get(_KEY_DP_CP_GROUP)
    groups = _lookup(_KEY_HYBRID_GROUPS) if check else _A.get(_KEY_HYBRID_GROUPS)
    if groups is None:
        return None
    if group_size not in groups:
        raise ParallelStateAssertionError(
            f"no hybrid context-parallel group of {group_size!r} ranks: "
            + (f"the sizes built are {sorted(groups)} and {get_data_parallel_world_size(with_context_parallel=True)}"
               if groups else "initialize with hybrid_context_parallel=True to have them")
        )
    return groups[group_size]


def get_tensor_model_parallel_last_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the last member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[-1]


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
