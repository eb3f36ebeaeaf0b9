"""The topologies the release data describes: each runs on every release that accepts its arguments.

A case is ``initialize_model_parallel(**kwargs)`` on ``world_size`` real gloo ranks, then each ``then`` call in
order. It belongs to a release when the release's ``initialize_model_parallel`` takes every keyword and the
module defines every ``then`` function, so a case written for 0.19's ``gtp_remat_size`` runs on 0.19 and later,
and one with 0.16's ``create_all_gather_group`` on the releases that still have it. A new topology is one row.
"""

from __future__ import annotations

from typing import Any

#: Short spellings of initialize_model_parallel's keywords, for the rows below.
KEYWORDS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "gtp": "gtp_remat_size",
    "egtp": "expert_gtp_remat_size",
    "instances": "num_distributed_optimizer_instances",
    "hcp": "hierarchical_context_parallel_sizes",
}


def _case(name: str, world_size: int, kwargs: dict[str, Any],
          then: list[tuple[str, dict[str, Any]]] = ()) -> dict[str, Any]:
    return {"name": name, "world_size": world_size, "kwargs": {KEYWORDS.get(k, k): v for k, v in kwargs.items()},
            "then": [{"call": call, "kwargs": kw} for call, kw in then]}


AG = "create_all_gather_groups"
CASES = [
    _case("tp2-pp2-vpp2", 8, dict(tp=2, pp=2, vpp=2)),
    _case("cp2-pp2-ep2-etp1-two-instances", 8, dict(cp=2, pp=2, ep=2, etp=1, instances=2)),
    _case("tp2-pp2-order-tp-pp-dp-all-gather-group", 8, dict(tp=2, pp=2, order="tp-pp-dp", create_all_gather_group=True)),
    _case("cp4-hierarchical-2x2-hybrid", 8, dict(cp=4, hcp=[2, 2], hybrid_context_parallel=True)),
    _case("ep2-tp2-all-gather-group", 8, dict(tp=2, ep=2, create_all_gather_group=True)),
    _case("cp2-order-without-tp", 8, dict(cp=2, order="cp-ep-dp-pp")),
    _case("offset4-local4-cp2", 8, dict(rank_offset=4, local_world_size=4, cp=2)),
    _case("offset0-local4-tp2", 8, dict(local_world_size=4, tp=2)),
    _case("offset4-without-local-world-size", 8, dict(rank_offset=4)),
    _case("tp2-pp2-order-tp-pp-dp", 8, dict(tp=2, pp=2, order="tp-pp-dp"), then=[(AG, {"for_expert_parallelism": True})]),
    _case("ep2-tp2", 8, dict(tp=2, ep=2), then=[(AG, {"for_expert_parallelism": True})]),
    _case("gtp2", 8, dict(gtp=2), then=[(AG, {"for_expert_parallelism": False})]),
    _case("tp2-gtp2-pp2", 8, dict(tp=2, gtp=2, pp=2)),
    _case("ep2-egtp2", 8, dict(ep=2, egtp=2), then=[(AG, {"for_expert_parallelism": True})]),
    _case("gtp2-pp2-order-tp-cp-ep-pp-dp", 8, dict(gtp=2, pp=2, order="tp-cp-ep-pp-dp")),
    _case("tp2-gtp2-upper-case-order", 8, dict(tp=2, gtp=2, order="TP-CP-EP-DP-PP")),
    _case("tp2-gtp2-ep2-order-tp-ep-dp-pp", 8, dict(tp=2, gtp=2, ep=2, etp=1, order="tp-ep-dp-pp")),
    _case("offset4-local4-gtp2", 8, dict(rank_offset=4, local_world_size=4, gtp=2)),
    _case("gtp2-two-instances", 8, dict(gtp=2, instances=2)),
    _case("ep2-egtp2-gloo-of-dense", 8, dict(ep=2, egtp=2, cp=2)),
    _case("tp2-gtp2-cp2-pp2", 16, dict(tp=2, gtp=2, cp=2, pp=2)),
    _case("tp2-gtp2-ep2-egtp2-etp1-pp2", 16, dict(tp=2, gtp=2, ep=2, egtp=2, etp=1, pp=2)),
    _case("tp2-gtp2-egtp2-pp2-order-tp-cp-ep-pp-dp", 16, dict(tp=2, gtp=2, egtp=2, pp=2, order="tp-cp-ep-pp-dp")),
    _case("cp2-ep2-gtp2-egtp2-create-gloo", 16, dict(cp=2, ep=2, gtp=2, egtp=2)),
]


def for_release(parameters: set[str], functions: set[str]) -> list[dict[str, Any]]:
    """The cases whose keywords are all in ``parameters`` (the release's ``initialize_model_parallel``) and whose
    follow-up calls are all in ``functions`` (its public functions), in table order."""
    return [c for c in CASES if set(c["kwargs"]) <= parameters and {t["call"] for t in c["then"]} <= functions]
