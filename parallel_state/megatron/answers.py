"""Every accessor's answer, computed once per change of the state, the overrides or the written globals.

An accessor runs per layer and per micro-batch, so it must cost a lookup: the answers live in
one dict, ``ANSWERS``, keyed ``"<kind>.<what>"`` (``"tp.rank"``, ``"dp-cp.group"``,
``"pp.next"``). It is filled when the groups are built, refilled when a ``set_*`` override
changes or one of megatron-core's private globals is written
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
from parallel_state.topology import releases
from parallel_state.topology.kinds import BY_NAME, ROWS, Family

#: The rows holding numbered kinds (hierarchical cp levels, hybrid blocks), whose groups one answer collects.
FAMILIES = tuple(r for r in ROWS if isinstance(r, Family))

#: Megatron's set_* values (override keys of state.overrides) -> the answers they replace.
OVERRIDES: dict[str, tuple[str, ...]] = {
    "tensor_model_parallel_world_size": ("tp.size",),
    "tensor_model_parallel_rank": ("tp.rank",),
    "pipeline_model_parallel_world_size": ("pp.size",),
    "pipeline_model_parallel_rank": ("pp.rank",),
    "data_parallel_rank": ("dp.rank", "dp-cp.rank", "dp-cp-intra.rank", "gtp-dp.rank", "gtp-dp-cp.rank",
                           "gtp-dp-cp-intra.rank"),
    # No set_* function: megatron-core's _MPU_DATA_PARALLEL_WORLD_SIZE, which code writes directly.
    "data_parallel_world_size": ("dp.size", "dp-cp.size", "dp-cp-intra.size", "gtp-dp.size", "gtp-dp-cp.size",
                                 "gtp-dp-cp-intra.size"),
    "virtual_pipeline_model_parallel_world_size": ("vpp.size",),
    "virtual_pipeline_model_parallel_rank": ("vpp.rank",),
    "expert_model_parallel_world_size": ("ep.size",),
    "expert_model_parallel_rank": ("ep.rank",),
    "expert_tensor_parallel_world_size": ("etp.size",),
    "expert_tensor_parallel_rank": ("etp.rank",),
}

#: Ranks and sizes megatron-core reports as 0 while torch.distributed is not initialized, and (0.19)
#: whenever their group is not built: the rows' ``zero_without``.
ZERO_WITHOUT_DIST = frozenset(f"{r.name}.{what}" for r in ROWS if r.zero_without == "dist" for what in ("rank", "size"))
ZERO_WITHOUT_GROUPS = frozenset(f"{r.name}.{what}" for r in ROWS if r.zero_without == "groups"
                                for what in ("rank", "size"))

#: megatron-core's module globals holding a kind's answer -> that answer: each row's group (a family's:
#: its members' groups), gloo twin and global ranks. A write of one (``state.written``) replaces it.
GLOBALS: dict[str, str] = {
    **{r.megatron: r.answer for r in ROWS if r.megatron},
    **{r.gloo: f"{r.name}.gloo" for r in ROWS if r.gloo},
    **{r.ranks_global: f"{r.name}.ranks" for r in ROWS if r.ranks_global},
}


def _pp_at(a: Callable[[str], Any], step: int) -> int:
    return a("pp.ranks")[(a("pp.rank") + step) % a("pp.size")]


def _all_ranks(a: Callable[[str], Any]) -> str:
    # megatron-core 0.19 puts the gtp_remat rank second; the release in use decides the format.
    gtp = ("gtp.rank",) if releases.behaves("all_ranks_with_gtp_remat") else ()
    return "_".join(str(a(k) or 0) for k in ("tp.rank", *gtp, "gtp-dp.rank", "cp.rank", "pp.rank", "ep.rank"))


#: Answers computed from other answers: precomputed when possible, else computed on access
#: (so that overrides set before initialize answer as in megatron-core).
DERIVED: dict[str, Callable[[Any], Any]] = {
    "pp.is_first": lambda a: a("pp.rank") == 0,
    "pp.is_last": lambda a: a("pp.rank") == a("pp.size") - 1,
    "pp.first": lambda a: a("pp.ranks")[0],
    "pp.last": lambda a: a("pp.ranks")[a("pp.size") - 1],
    "pp.next": lambda a: _pp_at(a, 1),
    "pp.prev": lambda a: _pp_at(a, -1),
    "all_ranks": _all_ranks,
    # A kind's source rank (megatron-core's get_*_src_rank) is the first of its global ranks.
    **{f"{r.name}.src": (lambda a, ranks=f"{r.name}.ranks": a(ranks)[0]) for r in ROWS if r.with_ranks},
}

#: How messages name the answers that are no kind's (every kind's ``title`` names it).
OTHER_TITLES = {"vpp": "virtual pipeline"}


def _title(kind: str) -> str:
    """How messages name the kind (or other answer) ``kind``."""
    state = _st.peek()
    row = BY_NAME.get(kind) or (state.plan.kinds.get(kind) if state is not None else None)
    return row.title if row is not None else OTHER_TITLES.get(kind, kind)


def lookup(key: str) -> Any:
    """The answer for ``key``: the precomputed one, else what :func:`missing` says."""
    try:
        return ANSWERS[key]
    except KeyError:
        return missing(key)


def missing(key: str) -> Any:
    """The answer for a key with no precomputed answer, or the error that explains why there is none."""
    derive = DERIVED.get(key)
    if derive is not None:
        return derive(lookup)
    kind, _, what = key.rpartition(".")
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
    if what == "gloo" and kind in state.plan.kinds and not state.plan.gloo_allowed(kind):
        raise ParallelStateAssertionError(
            f"the gloo {_title(kind)} group was not created: as megatron-core 0.19, parallel_state builds "
            f"no gloo groups under generalized tensor parallelism (gtp_remat_size {state.plan.gtp}, "
            f"expert_gtp_remat_size {state.plan.egtp}); use the NCCL group, or gtp sizes of 1"
        )
    if what == "gloo" and not state.gloo_groups:
        raise ParallelStateAssertionError(
            f"the gloo {_title(kind)} group was not created: initialize_model_parallel was called with "
            f"create_gloo_process_groups=False; initialize with create_gloo_process_groups=True to have it"
        )
    row = BY_NAME.get(kind) or state.plan.kinds.get(kind)
    hint = row.hint if row is not None else ""
    raise ParallelStateAssertionError(
        f"there is no {_describe(kind, what)} on this rank" + (f": {hint}" if hint else "")
    )


def _groupless(key: str) -> tuple[bool, Any]:
    """megatron-core's answer for ``key`` while its kind has no group: ``(True, answer)``, or ``(False, None)``
    where megatron-core asserts."""
    kind, _, what = key.rpartition(".")
    if key in ZERO_WITHOUT_GROUPS or key in ZERO_WITHOUT_DIST and not _dist_ready():
        return True, 0
    if kind == "vpp":
        return True, None
    if kind == "etp" and what in ("rank", "size"):
        # megatron-core falls back to the tensor-parallel override (None when unset).
        return True, _st.overrides.get(f"tensor_model_parallel_{'rank' if what == 'rank' else 'world_size'}")
    return False, None


def _describe(kind: str, what: str) -> str:
    noun = {"group": "group", "rank": "rank", "size": "world size", "ranks": "global ranks", "gloo": "gloo group",
            "src": "source rank", "groups": "groups"}.get(what, what)
    return f"the {_title(kind)} {noun}"


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


ANSWERS: dict[str, Any] = {}


def compute(state: _st.ParallelState | None, overrides: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    """Every answer for ``state`` (None: only the writes' and overrides'), with the writes of megatron-core's
    globals (``written``) and then ``overrides`` applied, as megatron-core's getters read them."""
    out: dict[str, Any] = {}
    if state is not None:
        plan = state.plan
        members: dict[str, dict[int, Any]] = {}  # family -> number -> this rank's group
        for name, kind in plan.kinds.items():
            if not kind.everyone:
                out[f"{name}.in"] = bool(state.ranks(name))
                if not out[f"{name}.in"]:
                    continue  # not a member (embedding stages): the group accessors assert, or read None
            out[f"{name}.group"] = state.groups[name]
            out[f"{name}.size"] = plan.group_size(name, state.rank)
            out[f"{name}.rank"] = state.group_rank(name)
            if kind.with_ranks:
                out[f"{name}.ranks"] = list(state.ranks(name))
            if kind.family:
                members.setdefault(kind.family, {})[kind.number] = state.groups[name]
        for kind, group in state.gloo_groups.items():
            out[f"{kind}.gloo"] = group
        for family in FAMILIES:
            value = family.collect(members.get(family.name, {}))
            if value is not None:
                out[family.answer] = value
        out["vpp.size"] = state.virtual_pipeline_size
        out["vpp.rank"] = state.virtual_pipeline_rank
    if written:
        _apply_writes(out, written)
    if state is not None or written:
        # What megatron-core's is_initialized, model_parallel_is_initialized and has_separate_all_gather_group test.
        out["dp-cp-ag.exists"] = out.get("dp-cp-ag.group") is not None
        out["dp.exists"] = out.get("dp.group") is not None
        if all(out.get(f"{kind}.group") is not None for kind in ("tp", "pp", "dp")):
            out["initialized"] = True
    for key, value in overrides.items():
        for answer in OVERRIDES[key]:
            out[answer] = value
    return out


def _apply_writes(out: dict[str, Any], written: dict[str, Any]) -> None:
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
        kind, _, what = GLOBALS[name].rpartition(".")
        for each in (kind, *followers.get(kind, ())) if what == "group" else (kind,):
            key = f"{each}.{what}"
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
            if what == "group":
                for number in ("rank", "size"):
                    answered, groupless = _groupless(f"{each}.{number}")
                    if value is not None:
                        out[f"{each}.{number}"] = value.rank() if number == "rank" else value.size()
                    elif answered:
                        out[f"{each}.{number}"] = groupless
                    else:
                        out.pop(f"{each}.{number}", None)
            elif what == "ranks" and not BY_NAME[kind].everyone and _dist_ready():
                import torch.distributed as dist

                out[f"{kind}.in"] = value is not None and dist.get_rank() in value


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
