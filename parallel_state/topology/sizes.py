"""The sizes of a topology, named once: the one value validation, ``InitArguments`` and ``TopologyPlan`` share.

Each size is one field of :class:`Sizes`, and the field carries what the others need of it: the
``initialize_model_parallel`` parameter that gives it (``InitArguments`` reads the size from that
parameter and names it so in errors), how the plan's messages name it, and the check of a single
value (``validation.sizes`` runs it, then the rules between sizes). ``TopologyPlan`` is a ``Sizes``
(its sizes are its fields, as the caller passed them, and checked, as the plan holds them). A new
size is one field here; what it means for the layout is written where the layout is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from parallel_state.topology.arguments import optional_positive_int, positive_int
from parallel_state.topology.grid import DEFAULT_ORDER, insert_gtp_remat


def _size(default: Any, parameter: str, title: str, check: Callable[[str, Any], Any] | None = positive_int) -> Any:
    """A field of :class:`Sizes`: its default, its ``initialize_model_parallel`` parameter, its name in the
    plan's messages, and the check of its value alone (None: checked only by the rules between sizes)."""
    return dataclasses.field(default=default, metadata={"parameter": parameter, "title": title, "check": check})


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """A topology's sizes: ints >= 1 (``etp`` None: the same as tp), the order, the hierarchical cp sizes.

    As given they may hold anything; ``validation.sizes`` returns them checked.
    """

    tp: int = _size(1, "tensor_model_parallel_size", "tp size")
    cp: int = _size(1, "context_parallel_size", "cp size")
    pp: int = _size(1, "pipeline_model_parallel_size", "pp size")
    ep: int = _size(1, "expert_model_parallel_size", "ep size")
    etp: int | None = _size(None, "expert_tensor_parallel_size", "etp size", optional_positive_int)
    #: megatron-core 0.19's generalized tensor parallelism with weight rematerialization (decoder, expert).
    gtp: int = _size(1, "gtp_remat_size", "gtp_remat size")
    egtp: int = _size(1, "expert_gtp_remat_size", "expert gtp_remat size")
    dist_opt_instances: int = _size(1, "num_distributed_optimizer_instances", "dist_opt_instances")
    order: str = _size(DEFAULT_ORDER, "order", "order", None)
    hierarchical_cp: tuple[int, ...] | None = _size(None, "hierarchical_context_parallel_sizes",
                                                    "hierarchical_context_parallel_sizes", None)

    @property
    def expert_tp(self) -> int:
        """The expert grid's tensor-parallel size."""
        return self.tp if self.etp is None else self.etp

    def orders(self) -> tuple[str, str]:
        """The decoder's and the expert grid's orders as written, with gtp_remat where megatron-core 0.19 puts it."""
        decoder = insert_gtp_remat(self.order, "tp") if self.gtp > 1 else self.order
        expert = insert_gtp_remat(self.order, "ep") if self.egtp > 1 else self.order
        return decoder, expert

    def values(self) -> dict[str, Any]:
        """Every size by its field's name (to pass on as keywords)."""
        return {f.name: getattr(self, f.name) for f in FIELDS}


#: The fields of :class:`Sizes`, in order.
FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(Sizes)
#: Each size's ``initialize_model_parallel`` parameter, by field name.
PARAMETERS: dict[str, str] = {f.name: f.metadata["parameter"] for f in FIELDS}
#: How the plan's messages name each size, by field name.
TITLES: dict[str, str] = {f.name: f.metadata["title"] for f in FIELDS}
