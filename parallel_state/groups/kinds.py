"""The group kinds as group building reads them: ``topology.kinds``' rows, looked up by name.

Each kind is one typed row there (its ranks rule, megatron-core's global, NCCL section,
``group_desc``, gloo twin, sharing rule ...); a plan's numbered kinds (``cp-l<level>``,
``dp-cp-hybrid<size>``) are rows of that plan (``TopologyPlan.kinds``), never parsed from a name.
"""

from __future__ import annotations

from parallel_state.topology.kinds import BY_NAME, ROWS, Kind

__all__ = ["BY_NAME", "ROWS", "Kind", "gloo_kinds", "row"]


def row(kind: str) -> Kind:
    """The row of kind ``kind`` (a plan's numbered kinds: ``plan.kind(name)``)."""
    try:
        return BY_NAME[kind]
    except KeyError:
        raise KeyError(f"{kind!r} is not a fixed group kind; the kinds are {list(BY_NAME)} (numbered kinds: "
                       f"TopologyPlan.kind)") from None


def gloo_kinds() -> tuple[str, ...]:
    """The kinds megatron-core gives a gloo twin, in creation order."""
    return tuple(r.name for r in ROWS if r.gloo)
