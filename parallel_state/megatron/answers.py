"""Every accessor's answer, computed once per change of the state or the overrides.

An accessor runs per layer and per micro-batch, so it must cost a lookup: the answers live in
one dict, ``ANSWERS``, keyed ``"<kind>.<what>"`` (``"tp.rank"``, ``"dp-cp.group"``,
``"pp.next"``). It is filled when the groups are built, refilled when a ``set_*`` override
changes, and emptied on destroy. It is a plain dict (a subclass would cost every lookup): an
accessor catches the KeyError of an absent key and asks :func:`missing`, which gives
megatron-core's answer for that situation (0 for some ranks and sizes outside a distributed
run, None for the virtual pipeline) or the error saying what to do.
"""

from __future__ import annotations

from typing import Any, Callable

from parallel_state.errors import ParallelStateAssertionError
from parallel_state.groups import state as _st
from parallel_state.topology import releases

#: Megatron's set_* values (override keys of state.overrides) -> the answers they replace.
OVERRIDES: dict[str, tuple[str, ...]] = {
    "tensor_model_parallel_world_size": ("tp.size",),
    "tensor_model_parallel_rank": ("tp.rank",),
    "pipeline_model_parallel_world_size": ("pp.size",),
    "pipeline_model_parallel_rank": ("pp.rank",),
    "data_parallel_rank": ("dp.rank", "dp-cp.rank", "dp-cp-intra.rank", "gtp-dp.rank", "gtp-dp-cp.rank",
                           "gtp-dp-cp-intra.rank"),
    "virtual_pipeline_model_parallel_world_size": ("vpp.size",),
    "virtual_pipeline_model_parallel_rank": ("vpp.rank",),
    "expert_model_parallel_world_size": ("ep.size",),
    "expert_model_parallel_rank": ("ep.rank",),
    "expert_tensor_parallel_world_size": ("etp.size",),
    "expert_tensor_parallel_rank": ("etp.rank",),
}

#: Kinds whose members are picked per pipeline: a rank may be in none of their groups.
PICKED = ("embd", "pos-embd")
#: Kinds whose global ranks an accessor or a megatron-core global returns (the rest can hold
#: thousands of ranks that nobody reads).
WITH_RANKS = frozenset({"tp", "pp", "cp", "dp", "dp-cp", "tp-pp", "tp-cp", "ep", "embd", "pos-embd", "gtp", "egtp"})

#: Ranks and sizes megatron-core reports as 0 while torch.distributed is not initialized.
ZERO_WITHOUT_DIST = frozenset(f"{kind}.{what}" for kind in (
    "dp", "dp-cp", "dp-cp-intra", "gtp-dp", "gtp-dp-cp", "gtp-dp-cp-intra", "cp", "tp-cp", "ep", "etp-ep", "edp",
    "edp-intra", "egtp-edp", "egtp-edp-intra") for what in ("rank", "size"))
#: Ranks and sizes megatron-core 0.19 reports as 0 whenever its group is not built (initialized or not).
ZERO_WITHOUT_GROUPS = frozenset(f"{kind}.{what}" for kind in ("gtp", "egtp") for what in ("rank", "size"))


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
    "tp.src": lambda a: a("tp.ranks")[0],
    "tp-cp.src": lambda a: a("tp-cp.ranks")[0],
    "tp-pp.src": lambda a: a("tp-pp.ranks")[0],
    "dp.src": lambda a: a("dp.ranks")[0],
    "dp-cp.src": lambda a: a("dp-cp.ranks")[0],
    "ep.src": lambda a: a("ep.ranks")[0],
    "all_ranks": _all_ranks,
}

#: What to do when a kind was not built although the groups exist.
_NOT_BUILT = {
    "dp-cp-ag": "call parallel_state.create_all_gather_groups() (megatron-core 0.18+) or initialize with "
                "create_all_gather_group=True (0.16, 0.17) to have the separate all-gather group",
    "edp-ag": "call parallel_state.create_all_gather_groups(for_expert_parallelism=True) with "
              "expert_model_parallel_size > 1 to have the expert all-gather group",
    "edp-inter": "initialize with num_distributed_optimizer_instances > 1 to have the inter-instance group",
    "hcp": "initialize with hierarchical_context_parallel_sizes=[...] to have hierarchical context-parallel groups",
    "embd": "this rank holds no embedding (its pipeline stage is not one get_embedding_ranks picked)",
    "pos-embd": "this rank holds no position embedding (its stage is not one get_position_embedding_ranks picked)",
}


#: How messages name each kind.
LABELS = {
    "tp": "tensor-model-parallel", "pp": "pipeline-model-parallel", "cp": "context-parallel", "dp": "data-parallel",
    "dp-cp": "data-parallel (with context parallel)", "tp-pp": "model-parallel (tp-pp)",
    "tp-cp": "tensor-and-context-parallel", "tp-dp": "tensor-and-data-parallel",
    "tp-dp-cp": "tensor-and-data-parallel (with context parallel)",
    "dp-cp-intra": "partial (one optimizer instance) data-parallel", "dp-cp-ag": "separate all-gather data-parallel",
    "embd": "embedding", "pos-embd": "position-embedding", "ep": "expert-model-parallel",
    "etp": "expert-tensor-parallel", "etp-ep": "expert tensor-and-model-parallel",
    "etp-ep-pp": "expert tensor-model-pipeline-parallel", "edp": "expert data-parallel",
    "edp-intra": "partial expert data-parallel", "edp-inter": "inter distributed-optimizer-instance",
    "dist-opt": "intra distributed-optimizer-instance", "hcp": "hierarchical context-parallel",
    "hybrid": "hybrid data-and-context-parallel", "vpp": "virtual pipeline",
    "gtp": "generalized tensor-parallel (gtp_remat)", "egtp": "expert generalized tensor-parallel (gtp_remat)",
    "gtp-dp": "data-parallel (with gtp_remat)", "gtp-dp-cp": "data-parallel (with context parallel and gtp_remat)",
    "gtp-dp-cp-intra": "partial data-parallel (with gtp_remat)", "etp-ep-egtp-pp":
    "expert tensor-model-pipeline-parallel (with expert gtp_remat)", "egtp-edp": "expert data-parallel (with gtp_remat)",
    "egtp-edp-intra": "partial expert data-parallel (with gtp_remat)", "edp-ag": "expert all-gather data-parallel",
}


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
        if key in ZERO_WITHOUT_GROUPS or key in ZERO_WITHOUT_DIST and not _dist_ready():
            return 0
        if kind == "vpp":
            return None
        if kind == "etp" and what in ("rank", "size"):
            # megatron-core falls back to the tensor-parallel override (None when unset).
            return _st.overrides.get(f"tensor_model_parallel_{'rank' if what == 'rank' else 'world_size'}")
        _st.current(_describe(kind, what))  # raises, saying what to call first
    if what == "gloo" and kind in state.plan.kinds and not state.plan.gloo_allowed(kind):
        raise ParallelStateAssertionError(
            f"the gloo {LABELS.get(kind, kind)} group was not created: as megatron-core 0.19, parallel_state builds "
            f"no gloo groups under generalized tensor parallelism (gtp_remat_size {state.plan.gtp}, "
            f"expert_gtp_remat_size {state.plan.egtp}); use the NCCL group, or gtp sizes of 1"
        )
    if what == "gloo" and not state.gloo_groups:
        raise ParallelStateAssertionError(
            f"the gloo {LABELS.get(kind, kind)} group was not created: initialize_model_parallel was called with "
            f"create_gloo_process_groups=False; initialize with create_gloo_process_groups=True to have it"
        )
    hint = _NOT_BUILT.get(kind.split("-l")[0] if kind.startswith("cp-l") else kind)
    raise ParallelStateAssertionError(
        f"there is no {_describe(kind, what)} on this rank" + (f": {hint}" if hint else "")
    )


def _describe(kind: str, what: str) -> str:
    noun = {"group": "group", "rank": "rank", "size": "world size", "ranks": "global ranks", "gloo": "gloo group",
            "src": "source rank", "groups": "groups"}.get(what, what)
    return f"the {LABELS.get(kind, kind)} {noun}"


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


ANSWERS: dict[str, Any] = {}


def compute(state: _st.ParallelState | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """Every answer for ``state`` (None: only the overrides') with ``overrides`` applied."""
    out: dict[str, Any] = {}
    if state is not None:
        plan = state.plan
        for kind in plan.kinds:
            if kind in PICKED and not state.ranks(kind):
                continue  # not a member (embedding stages): the group accessors assert, or read None
            out[f"{kind}.group"] = state.groups[kind]
            out[f"{kind}.size"] = plan.group_size(kind, state.rank)
            out[f"{kind}.rank"] = state.group_rank(kind)
            if kind in WITH_RANKS:
                out[f"{kind}.ranks"] = list(state.ranks(kind))
        for kind, group in state.gloo_groups.items():
            out[f"{kind}.gloo"] = group
        out["dp-cp-ag.exists"] = "dp-cp-ag.group" in out
        out["embd.in"] = "embd.ranks" in out
        out["pos-embd.in"] = "pos-embd.ranks" in out
        levels = [k for k in plan.kinds if k.startswith("cp-l")]
        if levels:
            out["hcp.groups"] = [state.groups[k] for k in levels]
        out["hybrid.groups"] = {plan.kinds[k].size: state.groups[k] for k in plan.kinds
                                if k.startswith("dp-cp-hybrid")}
        out["vpp.size"] = state.virtual_pipeline_size
        out["vpp.rank"] = state.virtual_pipeline_rank
        out["initialized"] = True
    for key, value in overrides.items():
        for answer in OVERRIDES[key]:
            out[answer] = value
    return out


def refresh() -> None:
    """Recompute every answer from the live state and the overrides."""
    fresh = compute(_st.peek(), _st.overrides)
    # One dict object for the life of the process: the accessors hold it directly.
    ANSWERS.clear()
    ANSWERS.update(fresh)
    for key, derive in DERIVED.items():
        try:
            ANSWERS[key] = derive(lookup)
        except Exception:  # not answerable now (no groups yet): missing() explains on access
            pass


_st.on_change(refresh)
