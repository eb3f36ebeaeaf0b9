"""Every accessor's answer, computed once per change of the state, the overrides or the written globals.

An accessor runs per layer and per micro-batch, so it must cost a lookup: the answers live in
one dict, ``ANSWERS``, keyed by a kind's fact (``TP.key(Fact.RANK)``, ``DP_CP.key(Fact.GROUP)``,
``PP.key(Fact.NEXT)``: ``topology.answer_keys``; plain strings such as ``"tp.rank"``, made once, at
import, by the code that reads them). It is filled when the groups are built, refilled when a
``set_*`` override changes or one of megatron-core's private globals is written
(``parallel_state._CONTEXT_PARALLEL_GROUP = g``: ``state.written``), and emptied on destroy.
It is a plain dict (a subclass would cost every lookup): an accessor catches the KeyError of an
absent key and asks :func:`missing`, which gives megatron-core's answer for that situation (0 for
some ranks and sizes outside a distributed run, None for the virtual pipeline) or the error
saying what to do.
"""

from __future__ import annotations

from typing import Any, Callable

from parallel_state.errors import ParallelStateAssertionError
from parallel_state.groups import state as _st
from parallel_state.groups.state import Override
from parallel_state.topology import releases
from parallel_state.topology.answer_keys import (
    ALL_RANKS,
    INITIALIZED,
    VIRTUAL_PIPELINE,
    VPP_RANK,
    VPP_SIZE,
    AnswerKey,
    Fact,
)
from parallel_state.topology.answer_keys import parts as _parts
from parallel_state.topology.kinds import (
    BY_NAME,
    CP,
    DP,
    DP_CP,
    DP_CP_AG,
    DP_CP_INTRA,
    EP,
    ETP,
    GTP,
    GTP_DP,
    GTP_DP_CP,
    GTP_DP_CP_INTRA,
    PP,
    ROWS,
    TP,
    Family,
    Zero,
)

#: The rows holding numbered kinds (hierarchical cp levels, hybrid blocks), whose groups one answer collects.
FAMILIES = tuple(r for r in ROWS if isinstance(r, Family))

#: The data-parallel kinds, whose rank (and size) megatron-core's data-parallel override replaces.
_DATA_PARALLEL = (DP, DP_CP, DP_CP_INTRA, GTP_DP, GTP_DP_CP, GTP_DP_CP_INTRA)

#: Megatron's set_* values (override keys of state.overrides) -> the answers they replace.
OVERRIDES: dict[Override, tuple[AnswerKey, ...]] = {
    Override.TENSOR_MODEL_PARALLEL_WORLD_SIZE: (TP.key(Fact.SIZE),),
    Override.TENSOR_MODEL_PARALLEL_RANK: (TP.key(Fact.RANK),),
    Override.PIPELINE_MODEL_PARALLEL_WORLD_SIZE: (PP.key(Fact.SIZE),),
    Override.PIPELINE_MODEL_PARALLEL_RANK: (PP.key(Fact.RANK),),
    Override.DATA_PARALLEL_RANK: tuple(k.key(Fact.RANK) for k in _DATA_PARALLEL),
    Override.DATA_PARALLEL_WORLD_SIZE: tuple(k.key(Fact.SIZE) for k in _DATA_PARALLEL),
    Override.VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: (VPP_SIZE,),
    Override.VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: (VPP_RANK,),
    Override.EXPERT_MODEL_PARALLEL_WORLD_SIZE: (EP.key(Fact.SIZE),),
    Override.EXPERT_MODEL_PARALLEL_RANK: (EP.key(Fact.RANK),),
    Override.EXPERT_TENSOR_PARALLEL_WORLD_SIZE: (ETP.key(Fact.SIZE),),
    Override.EXPERT_TENSOR_PARALLEL_RANK: (ETP.key(Fact.RANK),),
}
#: Without groups, megatron-core answers the expert tensor-parallel rank and size from the tensor-parallel overrides.
ETP_FALLBACK: dict[AnswerKey, Override] = {ETP.key(Fact.RANK): Override.TENSOR_MODEL_PARALLEL_RANK,
                                           ETP.key(Fact.SIZE): Override.TENSOR_MODEL_PARALLEL_WORLD_SIZE}

#: Ranks and sizes megatron-core reports as 0 while torch.distributed is not initialized, and (0.19)
#: whenever their group is not built: the rows' ``zero_without``.
ZERO_WITHOUT_DIST = frozenset(r.key(fact) for r in ROWS if r.zero_without is Zero.WITHOUT_DIST
                              for fact in (Fact.RANK, Fact.SIZE))
ZERO_WITHOUT_GROUPS = frozenset(r.key(fact) for r in ROWS if r.zero_without is Zero.WITHOUT_GROUPS
                                for fact in (Fact.RANK, Fact.SIZE))

#: megatron-core's module globals holding a kind's answer -> that answer: each row's group (a family's:
#: its members' groups), gloo twin and global ranks. A write of one (``state.written``) replaces it.
GLOBALS: dict[str, AnswerKey] = {
    **{r.megatron: r.answer for r in ROWS if r.megatron},
    **{r.gloo_global: r.key(Fact.GLOO) for r in ROWS if r.gloo_global},
    **{r.ranks_global: r.key(Fact.RANKS) for r in ROWS if r.ranks_global},
}

_PP_RANK, _PP_SIZE, _PP_RANKS = PP.key(Fact.RANK), PP.key(Fact.SIZE), PP.key(Fact.RANKS)
#: The kinds whose groups megatron-core's is_initialized and model_parallel_is_initialized test.
_INITIALIZED_BY = tuple(k.answer for k in (TP, PP, DP))
_DP_CP_AG_EXISTS, _DP_EXISTS = DP_CP_AG.key(Fact.EXISTS), DP.key(Fact.EXISTS)


def _pp_at(a: Callable[[AnswerKey], Any], step: int) -> int:
    return a(_PP_RANKS)[(a(_PP_RANK) + step) % a(_PP_SIZE)]


def _all_ranks(a: Callable[[AnswerKey], Any]) -> str:
    # megatron-core 0.19 puts the gtp_remat rank second; the release in use decides the format.
    gtp = (GTP,) if releases.behaves("all_ranks_with_gtp_remat") else ()
    return "_".join(str(a(k.key(Fact.RANK)) or 0) for k in (TP, *gtp, GTP_DP, CP, PP, EP))


#: Answers computed from other answers: precomputed when possible, else computed on access
#: (so that overrides set before initialize answer as in megatron-core).
DERIVED: dict[AnswerKey, Callable[[Any], Any]] = {
    PP.key(Fact.IS_FIRST): lambda a: a(_PP_RANK) == 0,
    PP.key(Fact.IS_LAST): lambda a: a(_PP_RANK) == a(_PP_SIZE) - 1,
    PP.key(Fact.FIRST): lambda a: a(_PP_RANKS)[0],
    PP.key(Fact.LAST): lambda a: a(_PP_RANKS)[a(_PP_SIZE) - 1],
    PP.key(Fact.NEXT): lambda a: _pp_at(a, 1),
    PP.key(Fact.PREV): lambda a: _pp_at(a, -1),
    ALL_RANKS: _all_ranks,
    # A kind's source rank (megatron-core's get_*_src_rank) is the first of its global ranks.
    **{r.key(Fact.SRC): (lambda a, ranks=r.key(Fact.RANKS): a(ranks)[0]) for r in ROWS if r.with_ranks},
}

#: How messages name the answers that are no kind's (every kind's ``title`` names it).
OTHER_TITLES = {VIRTUAL_PIPELINE: "virtual pipeline"}


def _title(kind: str) -> str:
    """How messages name the kind (or other answer) ``kind``."""
    state = _st.peek()
    row = BY_NAME.get(kind) or (state.plan.kinds.get(kind) if state is not None else None)
    return row.title if row is not None else OTHER_TITLES.get(kind, kind)


def lookup(key: AnswerKey) -> Any:
    """The answer for ``key``: the precomputed one, else what :func:`missing` says."""
    try:
        return ANSWERS[key]
    except KeyError:
        return missing(key)


def _split(key: AnswerKey) -> tuple[str, Fact]:
    """``key``'s kind and fact (a key is made from them, never parsed)."""
    made = _parts(key)
    if made is None:
        raise KeyError(f"{key!r} is no answer key: make keys with Kind.key(Fact....) (topology.answer_keys)")
    return made


def missing(key: AnswerKey) -> Any:
    """The answer for a key with no precomputed answer, or the error that explains why there is none."""
    derive = DERIVED.get(key)
    if derive is not None:
        return derive(lookup)
    kind, what = _split(key)
    state = _st.peek()
    if state is None:
        answered, value = _groupless(key)
        if answered:
            return value
        row = BY_NAME.get(kind)
        if _st.written and row is not None and row.megatron:
            raise ParallelStateAssertionError(
                f"{_describe(kind, what)} is not initialized: initialize_model_parallel was not called and "
                f"parallel_state.{row.megatron} was not written")
        _st.current(_describe(kind, what))  # raises, saying what to call first
    if what is Fact.GLOO and kind in state.plan.kinds and not state.plan.gloo_allowed(kind):
        raise ParallelStateAssertionError(
            f"the gloo {_title(kind)} group was not created: as megatron-core 0.19, parallel_state builds "
            f"no gloo groups under generalized tensor parallelism (gtp_remat_size {state.plan.gtp}, "
            f"expert_gtp_remat_size {state.plan.egtp}); use the NCCL group, or gtp sizes of 1"
        )
    if what is Fact.GLOO and not state.gloo_groups:
        raise ParallelStateAssertionError(
            f"the gloo {_title(kind)} group was not created: initialize_model_parallel was called with "
            f"create_gloo_process_groups=False; initialize with create_gloo_process_groups=True to have it"
        )
    row = BY_NAME.get(kind) or state.plan.kinds.get(kind)
    hint = row.hint if row is not None else ""
    raise ParallelStateAssertionError(
        f"there is no {_describe(kind, what)} on this rank" + (f": {hint}" if hint else "")
    )


def _groupless(key: AnswerKey) -> tuple[bool, Any]:
    """megatron-core's answer for ``key`` while its kind has no group: ``(True, answer)``, or ``(False, None)``
    where megatron-core asserts."""
    if key in ZERO_WITHOUT_GROUPS or key in ZERO_WITHOUT_DIST and not _dist_ready():
        return True, 0
    if _split(key)[0] == VIRTUAL_PIPELINE:
        return True, None
    if key in ETP_FALLBACK:
        # megatron-core falls back to the tensor-parallel override (None when unset).
        return True, _st.overrides.get(ETP_FALLBACK[key])
    return False, None


#: How messages name a fact (the others by their value).
NOUNS = {Fact.SIZE: "world size", Fact.RANKS: "global ranks", Fact.GLOO: "gloo group", Fact.SRC: "source rank"}


def _describe(kind: str, what: Fact) -> str:
    return f"the {_title(kind)} {NOUNS.get(what, what.value)}"


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


ANSWERS: dict[AnswerKey, Any] = {}


def compute(state: _st.ParallelState | None, overrides: dict[Override, Any], written: dict[str, Any]
            ) -> dict[AnswerKey, Any]:
    """Every answer for ``state`` (None: only the writes' and overrides'), with the writes of megatron-core's
    globals (``written``) and then ``overrides`` applied, as megatron-core's getters read them."""
    out: dict[AnswerKey, Any] = {}
    if state is not None:
        plan = state.plan
        members: dict[str, dict[int, Any]] = {}  # family -> number -> this rank's group
        for name, kind in plan.kinds.items():
            if not kind.everyone:
                member = out[kind.key(Fact.IN)] = bool(state.ranks(name))
                if not member:
                    continue  # not a member (embedding stages): the group accessors assert, or read None
            out[kind.key(Fact.GROUP)] = state.groups[name]
            out[kind.key(Fact.SIZE)] = plan.group_size(name, state.rank)
            out[kind.key(Fact.RANK)] = state.group_rank(name)
            if kind.with_ranks:
                out[kind.key(Fact.RANKS)] = list(state.ranks(name))
            if kind.family:
                members.setdefault(kind.family, {})[kind.number] = state.groups[name]
        for name, group in state.gloo_groups.items():
            out[plan.kinds[name].key(Fact.GLOO)] = group
        for family in FAMILIES:
            value = family.collect(members.get(family.name, {}))
            if value is not None:
                out[family.answer] = value
        out[VPP_SIZE] = state.virtual_pipeline_size
        out[VPP_RANK] = state.virtual_pipeline_rank
    if written:
        _apply_writes(out, written)
    if state is not None or written:
        # What megatron-core's is_initialized, model_parallel_is_initialized and has_separate_all_gather_group test.
        out[_DP_CP_AG_EXISTS] = out.get(DP_CP_AG.answer) is not None
        out[_DP_EXISTS] = out.get(DP.answer) is not None
        if all(out.get(key) is not None for key in _INITIALIZED_BY):
            out[INITIALIZED] = True
    for key, value in overrides.items():
        for answer in OVERRIDES[key]:
            out[answer] = value
    return out


def _apply_writes(out: dict[AnswerKey, Any], written: dict[str, Any]) -> None:
    """Replace the answers of the globals in ``written`` (megatron-core's global -> the value written) in ``out``.

    A group's rank and size are read from it here, as megatron-core's getters read them; a
    picked kind's membership from its global ranks. A kind whose own global the release in use
    lacks (0.19's ``*_WITH_GTP_REMAT`` groups before 0.19) follows the kind it shares: before 0.19,
    ``get_data_parallel_group()`` reads ``_DATA_PARALLEL_GROUP``.
    """
    release = releases.in_use()
    followers: dict[str, list[str]] = {}
    for row in ROWS:
        if row.megatron and releases.has_global(row.megatron, release) is False:
            leader = next((k for k in row.shares if releases.has_global(BY_NAME[k].megatron, release) is not False), None)
            if leader is not None:
                followers.setdefault(leader, []).append(row.name)
    for name, value in written.items():
        kind, what = _split(GLOBALS[name])
        for each in (BY_NAME[k] for k in ((kind, *followers.get(kind, ())) if what is Fact.GROUP else (kind,))):
            key = each.key(what)
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
            if what is Fact.GROUP:
                for number in (Fact.RANK, Fact.SIZE):
                    answered, groupless = _groupless(each.key(number))
                    if value is not None:
                        out[each.key(number)] = value.rank() if number is Fact.RANK else value.size()
                    elif answered:
                        out[each.key(number)] = groupless
                    else:
                        out.pop(each.key(number), None)
            elif what is Fact.RANKS and not each.everyone and _dist_ready():
                import torch.distributed as dist

                out[each.key(Fact.IN)] = value is not None and dist.get_rank() in value


def refresh() -> None:
    """Recompute every answer from the live state, the writes of megatron-core's globals and the overrides."""
    fresh = compute(_st.peek(), _st.overrides, _st.written)
    # One dict object for the life of the process: the accessors hold it directly.
    ANSWERS.clear()
    ANSWERS.update(fresh)
    for key, derive in DERIVED.items():
        try:
            ANSWERS[key] = derive(lookup)
        except Exception:  # not answerable now (no groups yet): missing() explains on access
            pass


_st.on_change(refresh)
