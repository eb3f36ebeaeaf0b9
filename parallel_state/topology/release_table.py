"""Every fact that differs between the megatron-core releases parallel_state mirrors: one row each.

A megatron-core release changes three kinds of things parallel_state follows: the parameters of a
function (``SIGNATURES``: one row per parameter, in the releases' merged positional order, with
the releases that have it), the module globals its ``parallel_state`` holds (``GLOBALS``), and a
few behaviours (``BEHAVIOURS``: a format, a layout rule). Everything that differs by release is
derived from these rows: ``InitArguments``' fields and ``initialize_model_parallel``'s signature,
each accessor's signature and positional order, ``RankGenerator``'s signature (source written from
the rows by ``python -m parallel_state.tools.generate`` and checked in), the globals the bridge
writes, ``get_all_ranks``' format. Adding a release is its name in ``KNOWN`` and its rows here (plus
any new group kinds, the generator run, and the regenerated test data).

A row's slot in a release's positional order is its place among the rows of its function that
the release has: 0.19 inserted ``with_gtp_remat`` before ``partial_data_parallel``, so its row
sits there, and the releases before 0.19, which lack it, bind ``partial_data_parallel`` second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The releases whose API parallel_state knows, oldest first.
KNOWN: tuple[str, ...] = ("0.16", "0.17", "0.18", "0.19")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a parameter that has none.
REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Param:
    """One parameter of a megatron-core function, present from ``since`` through ``until`` (None: still there)."""

    name: str
    default: Any = REQUIRED
    annotation: str = "Any"
    since: str = KNOWN[0]
    until: str | None = None


@dataclass(frozen=True)
class Fact:
    """A global or a behaviour of megatron-core's ``parallel_state``, present from ``since`` through ``until``."""

    name: str
    since: str = KNOWN[0]
    until: str | None = None


def _flag(name: str, default: bool, **releases: str) -> Param:
    return Param(name, default, "bool", **releases)


_DP = (_flag("with_context_parallel", False), _flag("with_gtp_remat", True, since="0.19"),
       _flag("partial_data_parallel", False))
_EDP = (_flag("with_gtp_remat", True, since="0.19"), _flag("partial_expert_data_parallel", False))

#: function (``Class.method`` for a method, without ``self``) -> its parameters in the releases' merged order.
SIGNATURES: dict[str, tuple[Param, ...]] = {
    "initialize_model_parallel": (
        Param("tensor_model_parallel_size", 1, "int"),
        Param("pipeline_model_parallel_size", 1, "int"),
        Param("virtual_pipeline_model_parallel_size", None, "int | None"),
        Param("pipeline_model_parallel_comm_backend", None, "str | None"),
        _flag("use_sharp", False),
        Param("context_parallel_size", 1, "int"),
        Param("hierarchical_context_parallel_sizes", None, "Sequence[int] | None"),
        _flag("hybrid_context_parallel", False),
        Param("expert_model_parallel_size", 1, "int"),
        Param("gtp_remat_size", 1, "int", since="0.19"),
        Param("expert_gtp_remat_size", 1, "int", since="0.19"),
        Param("num_distributed_optimizer_instances", 1, "int"),
        Param("expert_tensor_parallel_size", None, "int | None"),
        Param("nccl_communicator_config_path", None, "str | None"),
        Param("distributed_timeout_minutes", 30, "int"),
        Param("order", "tp-cp-ep-dp-pp", "str"),
        Param("get_embedding_ranks", None, "Callable[[list[int], int | None], list[int]] | None"),
        Param("get_position_embedding_ranks", None, "Callable[[list[int], int | None], list[int]] | None"),
        _flag("create_gloo_process_groups", True),
        Param("high_priority_stream_groups", None, "Sequence[str] | None"),
        Param("sharp_enabled_group", None, "str | None"),
        Param("create_all_gather_group", False, "bool | None", until="0.17"),
        Param("rank_offset", 0, "int", since="0.17"),
        Param("local_world_size", None, "int | None", since="0.17"),
    ),
    "get_data_parallel_group": (*_DP, _flag("independent_all_gather", False, until="0.17")),
    "get_data_parallel_rank": _DP,
    "get_data_parallel_world_size": _DP,
    "get_expert_data_parallel_group": (_flag("check_initialized", True), *_EDP),
    "get_expert_data_parallel_rank": _EDP,
    "get_expert_data_parallel_world_size": _EDP,
    "get_expert_tensor_model_pipeline_parallel_group": (
        _flag("check_initialized", True), _flag("with_egtp_remat", False, since="0.19")),
    "RankGenerator.__init__": (
        Param("tp", annotation="int"), Param("ep", annotation="int"), Param("dp", annotation="int"),
        Param("pp", annotation="int"), Param("cp", annotation="int"), Param("order", annotation="str"),
        Param("rank_offset", 0, "int"), Param("gtp_remat", 1, "int", since="0.19")),
}

#: megatron-core module globals that not every release has (every other global is in all of them).
GLOBALS: tuple[Fact, ...] = (
    Fact("_GLOBAL_SYMMETRIC_MEMORY_BUFFER", until="0.16"),
    Fact("_DATA_PARALLEL_GROUP_WITH_CP_AG", until="0.17"),
    *(Fact(name, since="0.19") for name in (
        "_GTP_WEIGHT_REMAT_GROUP", "_GTP_WEIGHT_REMAT_GLOBAL_RANKS", "_EXPERT_GTP_WEIGHT_REMAT_GROUP",
        "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS", "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
        "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
        "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP")),
)

#: Behaviours that changed in a release.
BEHAVIOURS: tuple[Fact, ...] = (
    #: ``get_all_ranks()`` puts the gtp_remat rank second: ``"tp_gtp_dp_cp_pp_ep"``.
    Fact("all_ranks_with_gtp_remat", since="0.19"),
    #: ``RankGenerator`` appends the ``gtp_remat`` token to an order that does not name it.
    Fact("rank_generator_gtp_remat_token", since="0.19"),
    #: ``SymmetricMemoryManager`` makes 512 MiB buffers by default (256 in 0.17, the first with it).
    Fact("symmetric_memory_512_mb", since="0.18"),
)
