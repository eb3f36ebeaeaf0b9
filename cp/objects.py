"""Context-parallel split and gather for lists of Python objects (captions, prompts, metadata).

The gather pickles every object (torch's all_gather_object): fine for per-sample metadata, too slow
for tensors of any size, which belong in cat_outputs_cp.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from cp.comm import check_group


def _check_list(what: str, objs: Any) -> None:
    if not isinstance(objs, (list, tuple)):
        raise TypeError(f"{what}: object_list must be a list or tuple, got {type(objs).__name__}")


def split_inputs_cp_object_list(object_list: Sequence[Any], cp_group: Any = None) -> Sequence[Any]:
    """This rank's contiguous part of ``object_list`` (part i for the group's rank i), of the same type as ``object_list``.

    ``cp_group=None`` (or a group of one) returns ``object_list`` itself.
    """
    objs = object_list  # WorldFoundry's parameter name
    if cp_group is None:
        return objs
    what = "split_inputs_cp_object_list"
    _check_list(what, objs)
    check_group(cp_group, what)
    n = cp_group.size()
    if len(objs) % n:
        raise ValueError(
            f"{what}: cannot split a list of length {len(objs)} into {n} equal parts for a group of size "
            f"{n}: pass a multiple of {n} objects"
        )
    if n == 1:
        return objs
    k = len(objs) // n
    start = cp_group.rank() * k
    return objs[start:start + k]


def cat_outputs_cp_object_list(object_list: Sequence[Any], cp_group: Any = None) -> list[Any]:
    """Every rank's ``object_list`` concatenated in group-rank order (ranks may hold different lengths).

    ``cp_group=None`` (or a group of one) returns ``object_list`` itself.
    """
    objs = object_list  # WorldFoundry's parameter name
    if cp_group is None:
        return objs  # type: ignore[return-value]
    what = "cat_outputs_cp_object_list"
    _check_list(what, objs)
    check_group(cp_group, what)
    n = cp_group.size()
    if n == 1:
        return objs  # type: ignore[return-value]
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, list(objs), group=cp_group)
    return [obj for part in gathered for obj in part]
