"""The debug mode: with PARALLEL_STATE_DEBUG=1, check across the group that tensors agree before using them.

A shard of another shape on one rank makes a gather fail obscurely, hang until the timeout or,
worse, succeed with garbage. The check costs one small all-gather per call and is off by default;
when off it costs one environment lookup.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from cp import meta
from cp.agree import gather
from cp.comm import global_ranks

ENV = "PARALLEL_STATE_DEBUG"
_ON = frozenset({"1", "true", "yes", "on"})


def enabled() -> bool:
    """Whether PARALLEL_STATE_DEBUG is set to 1 (or true/yes/on); read on every call, so it can be toggled."""
    value = os.environ.get(ENV)
    return value is not None and value.strip().lower() in _ON


def gather_meta(item: Any, group: Any) -> list[meta.Meta]:
    """Every rank's header for its ``item``, in group-rank order (one all-gather)."""
    return [meta.decode(row) for row in gather(meta.encode(item, objects=True), group)]


def _signature(m: meta.Meta) -> tuple[Any, ...]:
    return (m.kind, m.shape, m.dtype, m.device_type)


def _describe(metas: list[meta.Meta], group: Any) -> str:
    ranks = global_ranks(group)
    by_value: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(metas):
        by_value.setdefault(_signature(m), []).append(i)
    parts = []
    for idxs in by_value.values():
        who = ", ".join(f"{i} (global {ranks[i]})" for i in idxs)
        parts.append(f"group rank{'s' if len(idxs) > 1 else ''} {who}: {metas[idxs[0]].describe()}")
    return "; ".join(parts)


def check_same(what: str, x: torch.Tensor, group: Any) -> None:
    """Raise ValueError on every rank unless every rank of ``group`` passed the same shape, dtype and device."""
    metas = gather_meta(x, group)
    if all(_signature(m) == _signature(metas[0]) for m in metas):
        return
    raise ValueError(
        f"{what} ({ENV}): the tensors differ across the group: {_describe(metas, group)}; "
        f"every rank must pass a shard of the same shape, dtype and device"
    )


def check_matches_source(what: str, item: Any, src_index: int, group: Any) -> None:
    """Raise ValueError on every rank when a rank passed a tensor unlike the source's.

    Receivers may pass None or a non-tensor placeholder; a tensor they pass must match the source's.
    """
    metas = gather_meta(item, group)
    src = metas[src_index]
    if src.kind != meta.TENSOR:
        return  # the broadcast itself reports a source without a tensor
    # Receivers get the data on the source's device type, so only shape and dtype must agree.
    bad = [i for i, m in enumerate(metas) if m.kind not in (meta.NONE, meta.OBJECT)
           and _signature(m)[:3] != _signature(src)[:3]]
    if not bad:
        return
    ranks = global_ranks(group)
    differ = "; ".join(f"group rank {i} (global {ranks[i]}): {metas[i].describe()}" for i in bad)
    raise ValueError(
        f"{what} ({ENV}): tensors differ from the source's (group rank {src_index}, global "
        f"{ranks[src_index]}: {src.describe()}): {differ}; pass the same shape and dtype on every rank, "
        f"or None on the receiving ranks"
    )
