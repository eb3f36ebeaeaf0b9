"""One row per group kind: what megatron-core calls it, how NCCL options and flight-recorder dumps name it,
whether it has a gloo twin, and which kind's group it may share.

The plan (``plan.py``) says which ranks each kind holds; this table says everything else a kind's
group carries. Group building (``state``), NCCL options (``initialize``), the megatron-core globals
(``megatron_globals``) and the error messages read it from here, so a kind is described once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindRow:
    """What one kind's group carries beside its ranks."""

    #: megatron-core's module global that holds this rank's group ("" where it is an element of a
    #: container global: the hierarchical cp list, the hybrid dict).
    megatron: str
    #: The section of megatron-core's NCCL communicator config (and high_priority_stream_groups) for it.
    nccl: str
    #: The group's description (``group_desc``): how NCCL's flight recorder and torch's logs name it.
    label: str
    #: megatron-core's global for the gloo twin, where megatron-core builds one with create_gloo_process_groups.
    gloo: str | None = None
    #: The kinds whose group object this kind reuses, the first the plan gives the same ranks, as
    #: megatron-core does: the intra-instance data-parallel groups with one optimizer instance, and
    #: megatron-core 0.19's full data-parallel groups (spanning gtp_remat) where gtp_remat is 1.
    shares: tuple[str, ...] = ()


#: Every fixed kind, in the plan's creation order; ``row`` adds the numbered ones.
ROWS: dict[str, KindRow] = {
    "gtp": KindRow("_GTP_WEIGHT_REMAT_GROUP", "gtp_remat", "GTP_WEIGHT_REMAT_GROUP"),
    "dp-cp": KindRow("_DATA_PARALLEL_GROUP_WITH_CP", "dp_cp", "DATA_PARALLEL_GROUP_WITH_CP",
                     gloo="_DATA_PARALLEL_GROUP_WITH_CP_GLOO"),
    "dp": KindRow("_DATA_PARALLEL_GROUP", "dp", "DATA_PARALLEL_GROUP", gloo="_DATA_PARALLEL_GROUP_GLOO"),
    "gtp-dp": KindRow("_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "gtp_remat_dp", "DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
                      shares=("dp",)),
    "gtp-dp-cp": KindRow("_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "gtp_remat_dp_cp",
                         "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", shares=("dp-cp",)),
    "cp": KindRow("_CONTEXT_PARALLEL_GROUP", "cp", "CONTEXT_PARALLEL_GROUP"),
    "tp-pp": KindRow("_MODEL_PARALLEL_GROUP", "mp", "MODEL_PARALLEL_GROUP"),
    "tp": KindRow("_TENSOR_MODEL_PARALLEL_GROUP", "tp", "TENSOR_MODEL_PARALLEL_GROUP"),
    "pp": KindRow("_PIPELINE_MODEL_PARALLEL_GROUP", "pp", "PIPELINE_MODEL_PARALLEL_GROUP"),
    "tp-dp-cp": KindRow("_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "tp_dp_cp",
                        "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP"),
    "tp-dp": KindRow("_TENSOR_AND_DATA_PARALLEL_GROUP", "tp_dp", "TENSOR_AND_DATA_PARALLEL_GROUP"),
    "tp-cp": KindRow("_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "tp_cp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP"),
    "dp-cp-intra": KindRow("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "intra_dp_cp",
                           "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                           gloo="_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", shares=("dp-cp",)),
    "gtp-dp-cp-intra": KindRow("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "gtp_remat_dp_cp",
                               "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", shares=("dp-cp-intra", "gtp-dp-cp")),
    "dp-cp-ag": KindRow("_DATA_PARALLEL_GROUP_WITH_CP_AG", "dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_AG"),
    "embd": KindRow("_EMBEDDING_GROUP", "embd", "EMBEDDING_GROUP"),
    "pos-embd": KindRow("_POSITION_EMBEDDING_GROUP", "pos_embd", "POSITION_EMBEDDING_GROUP"),
    "egtp": KindRow("_EXPERT_GTP_WEIGHT_REMAT_GROUP", "expt_gtp_remat", "EXPERT_GTP_WEIGHT_REMAT_GROUP"),
    "ep": KindRow("_EXPERT_MODEL_PARALLEL_GROUP", "ep", "EXPERT_MODEL_PARALLEL_GROUP"),
    "etp": KindRow("_EXPERT_TENSOR_PARALLEL_GROUP", "ep_tp", "EXPERT_TENSOR_PARALLEL_GROUP"),
    "etp-ep": KindRow("_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "tp_ep_mp", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP"),
    "etp-ep-pp": KindRow("_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "tp_ep_pp",
                         "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP"),
    "etp-ep-egtp-pp": KindRow("_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", "tp_ep_gtp_remat_pp",
                              "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP"),
    "edp": KindRow("_EXPERT_DATA_PARALLEL_GROUP", "ep_dp", "EXPERT_DATA_PARALLEL_GROUP",
                   gloo="_EXPERT_DATA_PARALLEL_GROUP_GLOO"),
    "edp-intra": KindRow("_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "intra_ep_dp",
                         "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0",
                         gloo="_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO", shares=("edp",)),
    "egtp-edp": KindRow("_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "ep_gtp_remat_dp",
                        "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", shares=("edp",)),
    "egtp-edp-intra": KindRow("_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "ep_gtp_remat_dp",
                              "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", shares=("edp-intra", "egtp-edp")),
    "edp-ag": KindRow("", "ep_dp", "EXPERT_DATA_PARALLEL_GROUP_AG"),
    "edp-inter": KindRow("_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "inter_ep_dp",
                         "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1"),
    "dist-opt": KindRow("_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", "intra_dist_opt_instance",
                        "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"),
}


def row(kind: str) -> KindRow:
    """The row of a plan kind, the numbered ones included (``cp-l<level>``, ``dp-cp-hybrid<size>``)."""
    fixed = ROWS.get(kind)
    if fixed is not None:
        return fixed
    if kind.startswith("cp-l"):
        return KindRow("", "hcp", f"HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{kind[4:]}")
    if kind.startswith("dp-cp-hybrid"):
        return KindRow("", "dp_cp", f"HYBRID_DP_CP_GROUP_{kind[12:]}")
    raise KeyError(f"{kind!r} is not a group kind; the kinds are {list(ROWS)}, cp-l<level> and dp-cp-hybrid<size>")


def gloo_kinds() -> tuple[str, ...]:
    """The kinds megatron-core gives a gloo twin, in creation order."""
    return tuple(kind for kind, r in ROWS.items() if r.gloo)
