"""The two groups a kind can have (:class:`Flavor`): its main group and its gloo twin, and what holds them.

The kinds themselves are ``topology.kinds``' rows (``topology.kinds.row(name)``; a plan's numbered kinds:
``TopologyPlan.kind``).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Protocol

from parallel_state.topology.kinds import Kind

__all__ = ["Flavor", "HoldsGroups"]


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
