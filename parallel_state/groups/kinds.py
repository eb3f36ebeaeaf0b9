"""The group kinds as group building reads them: ``topology.kinds``' rows, looked up by name, and the
two groups a kind can have (:class:`Flavor`).

Each kind is one typed row there (its ranks rule, megatron-core's global, NCCL section,
``group_desc``, gloo twin, sharing rule ...); a plan's numbered kinds (``cp-l<level>``,
``dp-cp-hybrid<size>``) are rows of that plan (``TopologyPlan.kinds``), never parsed from a name.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Protocol

from parallel_state.topology.kinds import BY_NAME, ROWS, Kind

__all__ = ["BY_NAME", "ROWS", "Flavor", "Kind", "row"]


def row(kind: str) -> Kind:
    """The row of kind ``kind`` (a plan's numbered kinds: ``plan.kind(name)``)."""
    try:
        return BY_NAME[kind]
    except KeyError:
        raise KeyError(f"{kind!r} is not a fixed group kind; the kinds are {list(BY_NAME)} (numbered kinds: "
                       f"TopologyPlan.kind)") from None


class HoldsGroups(Protocol):
    """What holds a topology's groups by kind: the live state, or a group-cache entry."""

    groups: dict[str, Any]
    gloo_groups: dict[str, Any]


class Flavor(Enum):
    """Which of a kind's groups: its main group (the default backend's, NCCL on GPUs) or its gloo twin,
    which megatron-core builds for some kinds with ``create_gloo_process_groups``."""

    MAIN = "main"
    GLOO = "gloo"

    def of(self, holder: HoldsGroups) -> dict[str, Any]:
        """``holder``'s groups of this flavor, by kind."""
        return holder.groups if self is Flavor.MAIN else holder.gloo_groups

    def label(self, kind: Kind) -> str | None:
        """The ``group_desc`` of ``kind``'s group of this flavor."""
        return kind.label if self is Flavor.MAIN else kind.gloo_label
