"""Context-parallel split and gather for lists of Python objects (captions, prompts, metadata).

The gather pickles every object (torch's all_gather_object): fine for per-sample metadata, too slow
for tensors of any size, which belong in cat_outputs_cp.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from cp.comm import check_group, global_ranks
from cp.shard import shard_sizes


def _check_list(what: str, objs: Any) -> None:
    if not isinstance(objs, (list, tuple)):
        raise TypeError(f"{what}: objs must be a list or tuple, got {type(objs).__name__}")


def split_inputs_cp_object_list(objs: Sequence[Any], cp_group: Any = None, *, uneven: bool = False
                                ) -> Sequence[Any]:
    """This rank's contiguous part of ``objs`` (part i for the group's rank i), of the same type as ``objs``.

    The length must divide by the group size, unless ``uneven``: then part i holds
    ``shard_sizes(len(objs), n)[i]`` objects. ``cp_group=None`` (or a group of one) returns ``objs`` itself.
    """
    if cp_group is None:
        return objs
    what = "split_inputs_cp_object_list"
    _check_list(what, objs)
    check_group(cp_group, what)
    if not isinstance(uneven, bool):
        raise TypeError(f"{what}: uneven must be True or False, got {type(uneven).__name__} {uneven!r}")
    n = cp_group.size()
    if uneven and len(objs) < n:
        raise ValueError(f"{what}: cannot split a list of length {len(objs)} into {n} parts of at least one "
                         f"object for a group of size {n}: use a group of at most {len(objs)} ranks")
    if not uneven and len(objs) % n:
        raise ValueError(
            f"{what}: cannot split a list of length {len(objs)} into {n} equal parts for a group of size "
            f"{n}: pass uneven=True (parts differing by at most one) or a multiple of {n} objects"
        )
    if n == 1:
        return objs
    sizes = shard_sizes(len(objs), n)
    start = sum(sizes[:cp_group.rank()])
    return objs[start:start + sizes[cp_group.rank()]]


def cat_outputs_cp_object_list(objs: Sequence[Any], cp_group: Any = None, *, length: int | None = None
                               ) -> list[Any]:
    """Every rank's ``objs`` concatenated in group-rank order (ranks may hold different lengths).

    ``length``: the expected total; then rank i must hold ``shard_sizes(length, n)[i]`` objects, and any
    other count is a ValueError naming the ranks, raised on every rank (checked after the one gather,
    which sends every rank's count anyway). ``cp_group=None`` (or a group of one) returns ``objs`` itself.
    """
    if cp_group is None:
        return objs  # type: ignore[return-value]
    what = "cat_outputs_cp_object_list"
    _check_list(what, objs)
    check_group(cp_group, what)
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise TypeError(f"{what}: length must be an int or None, got {type(length).__name__} {length!r}")
    n = cp_group.size()
    if n == 1:
        if length is not None and len(objs) != length:
            raise ValueError(f"{what}: got {len(objs)} objects but length={length}; in a group of one the part "
                             f"is the whole list")
        return objs  # type: ignore[return-value]
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, (length, list(objs)), group=cp_group)
    ranks = global_ranks(cp_group)
    lengths = [want for want, _ in gathered]
    if len(set(lengths)) > 1:
        got = "; ".join(f"group rank {i} (global {ranks[i]}): {v}" for i, v in enumerate(lengths))
        raise ValueError(f"{what}: the ranks passed different lengths ({got}); pass the same length on every rank")
    if length is not None:
        counts = tuple(len(part) for _, part in gathered)
        if length < n:
            raise ValueError(f"{what}: length={length} is shorter than the group of size {n}: every rank needs at "
                             f"least one object")
        want = shard_sizes(length, n)
        if counts != want:
            bad = "; ".join(f"group rank {i} (global {ranks[i]}) holds {c}, expected {w}"
                            for i, (c, w) in enumerate(zip(counts, want, strict=True)) if c != w)
            raise ValueError(f"{what}: the parts hold {counts} objects, but length={length} splits over {n} ranks "
                             f"as shard_sizes({length}, {n}) = {want}: {bad}; give rank i the part "
                             f"split_inputs_cp_object_list(objs, group, uneven=True) gives it")
    return [obj for _, part in gathered for obj in part]
