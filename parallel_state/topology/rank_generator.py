"""megatron-core 0.16's rank-layout helpers, with its names and signatures, over ``plan.Grid``.

``RankGenerator``, ``generate_masked_orthogonal_rank_groups``, ``default_embedding_ranks`` and
``default_position_embedding_ranks`` answer exactly as megatron-core's do. The pure part of
megatron-core's two group builders is here (``hierarchical_rank_groups``, ``hybrid_rank_groups``:
which ranks form each group); the builders themselves, ``create_hierarchical_groups`` and
``create_hybrid_dp_cp_groups``, create groups, so they live in ``parallel_state.groups.hierarchical``.

Nothing here imports torch.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

from parallel_state.errors import (
    ParallelStateAssertionError,
    ParallelStateError,
    ParallelStateTypeError,
    ParallelStateValueError,
)
from parallel_state.topology import releases
from parallel_state.topology.arguments import flag, is_int, non_negative_int, positive_int
from parallel_state.topology.grid import Grid, normalize_order
from parallel_state.topology.kinds import default_embedding_ranks, default_position_embedding_ranks, hybrid_sizes  # noqa: F401


def _rank_list(name: str, ranks: object) -> list[int]:
    """``ranks`` as a non-empty list of distinct ints >= 0, or an error naming ``name``."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) and not hasattr(ranks, "tolist"):
        raise ParallelStateTypeError(f"{name} must be a list of global ranks (ints), got {ranks!r}")
    values = ranks.tolist() if hasattr(ranks, "tolist") else list(ranks)
    if not values:
        raise ParallelStateError(f"{name} is empty; pass at least one global rank")
    for r in values:
        if not is_int(r):
            raise ParallelStateTypeError(f"{name} must hold ints (global ranks), got {r!r} in {values!r}")
    out = [operator.index(r) for r in values]
    if min(out) < 0:
        raise ParallelStateError(f"{name} holds a negative rank: {out}")
    if len(set(out)) != len(out):
        raise ParallelStateError(f"{name} repeats a rank: {out}; name each rank once")
    return out


class RankGenerator:
    """megatron-core's ``RankGenerator``: every group of a kind, for one layout of the dimensions.

    ``order`` names the dimensions fastest-varying first; a dimension it leaves out is appended
    (allowed only for size 1). ``rank_offset`` is added to every rank (the expert layout of a
    pipeline placed after another). ep and cp cannot both exceed 1 (megatron-core lays them out
    in two separate generators). ``gtp_remat`` (megatron-core 0.19) sizes the generalized
    tensor-parallel dimension; as in 0.19, where the release in use is 0.19 the order gains the
    ``gtp_remat`` token at its end when it does not name it.
    """

    # __init__ takes the release in use's parameters (the release table's rows) and lays out with _build.
    # <generated: rank-generator> by `python -m parallel_state.tools.generate` from the release table
    if releases.in_use() == "0.19":
        def __init__(
            self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0, gtp_remat: int = 1,
        ) -> None:
            """Lay out the dimensions: sizes, the order, an offset added to every rank."""
            self._build(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=rank_offset, gtp_remat=gtp_remat)
    else:  # megatron-core 0.16, 0.17, 0.18 and any release parallel_state does not know
        def __init__(
            self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0, *, gtp_remat: int = 1,
        ) -> None:
            """Lay out the dimensions: sizes, the order, an offset added to every rank."""
            self._build(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=rank_offset, gtp_remat=gtp_remat)
    # </generated: rank-generator>

    def _build(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int,
               gtp_remat: int) -> None:
        sizes = {name: positive_int(f"{name} size", value) for name, value in (
            ("tp", tp), ("ep", ep), ("dp", dp), ("pp", pp), ("cp", cp), ("gtp_remat", gtp_remat))}
        if sizes["ep"] > 1 and sizes["cp"] > 1:
            raise ParallelStateAssertionError(
                f"ep={sizes['ep']} and cp={sizes['cp']} are both > 1, which one RankGenerator cannot lay out: "
                f"cp belongs to the decoder generator (ep=1) and ep to the expert generator (cp=1); build two"
            )
        # megatron-core ignores a negative offset; one is always a mistake, so say so.
        self.rank_offset = non_negative_int("rank_offset", rank_offset)
        self.tp, self.ep, self.dp, self.pp, self.cp = (sizes[n] for n in ("tp", "ep", "dp", "pp", "cp"))
        self.gtp_remat = sizes["gtp_remat"]
        self.world_size = math.prod(sizes.values())
        # megatron-core's table, in its insertion order (the order missing tokens are appended in);
        # 0.19 adds gtp_remat, which it appends last.
        self.name_to_size = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp}
        if self.gtp_remat > 1 or releases.behaves("rank_generator_gtp_remat_token"):
            self.name_to_size["gtp_remat"] = self.gtp_remat
            tokens = normalize_order(order, sizes)
            order = "-".join(tokens if "gtp_remat" in tokens else (*tokens, "gtp_remat"))
        self._grid = Grid(self.world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, gtp_remat=self.gtp_remat,
                          order=order)
        self.order = self._grid.order
        self.ordered_size = [self.name_to_size[token] for token in self._grid.dims]

    def __repr__(self) -> str:
        return (f"RankGenerator(tp={self.tp}, ep={self.ep}, dp={self.dp}, pp={self.pp}, cp={self.cp}, "
                f"order={self.order!r}, rank_offset={self.rank_offset}, gtp_remat={self.gtp_remat})")

    def get_mask(self, order: str, token: str) -> list[bool]:
        """One bool per token of ``order``: whether ``token`` (e.g. ``'tp-dp'``) names it."""
        if not isinstance(order, str) or not isinstance(token, str):
            raise ParallelStateTypeError(f"order and token must be strs such as 'tp-cp-dp-pp' and 'tp-dp', "
                                         f"got {order!r} and {token!r}")
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for t in token.split("-"):
            if t not in ordered:
                raise ParallelStateValueError(
                    f"token {token!r} names {t!r}, which order {order!r} does not hold; name dimensions from {ordered}"
                )
            mask[ordered.index(t)] = True
        return mask

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group of the dimensions named by ``token`` (e.g. ``'tp-dp'``), in megatron-core's order.

        Each group's ranks, and the groups, are listed with the dimensions of ``order``
        fastest-varying first; ``rank_offset`` is added to every rank.
        """
        # gtp_remat of size 1 outside the order (releases before 0.19 do not name it) selects nothing.
        unnamed = isinstance(token, str) and "gtp_remat" in token.split("-") and "gtp_remat" not in self.order.split("-")
        named = "-".join(t for t in token.split("-") if t != "gtp_remat") if unnamed else token
        mask = self.get_mask(self.order, named) if named or not unnamed else [False] * len(self._grid.dims)
        kind = "-".join(d for d, m in zip(self._grid.dims, mask, strict=True) if m) or "gtp_remat"
        offset = self.rank_offset
        return [[r + offset for r in group] for group in self._grid.groups(kind)]

    def get_gtp_ranks(self, gtp_remat_size: int) -> list[list[int]]:
        """The gtp_remat weight-sharding groups (megatron-core 0.19); singletons with ``gtp_remat_size`` 1."""
        if positive_int("gtp_remat_size", gtp_remat_size) != self.gtp_remat:
            raise ParallelStateAssertionError(
                f"gtp_remat_size={gtp_remat_size} is not this generator's gtp_remat size ({self.gtp_remat}); "
                f"pass the size the generator was built with"
            )
        return self.get_ranks("gtp_remat")


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> list[list[int]]:
    """The groups of the dimensions selected by ``mask``, for a layout of ``parallel_size``.

    Ranks are laid out over ``parallel_size`` with its first dimension varying fastest; a group
    holds the ranks that share every unselected coordinate, listed selected-dimension-first
    fastest; groups are listed with the unselected dimensions first fastest. As in
    megatron-core, ``world_size // group size`` groups are returned, which must not exceed the
    number the layout holds.
    """
    world_size = positive_int("world_size", world_size)
    if isinstance(parallel_size, (str, bytes)) or not isinstance(parallel_size, Sequence):
        raise ParallelStateTypeError(f"parallel_size must be a list of ints such as [2, 1, 4], got {parallel_size!r}")
    sizes = [positive_int(f"parallel_size[{i}]", s) for i, s in enumerate(parallel_size)]
    if isinstance(mask, (str, bytes)) or not isinstance(mask, Sequence):
        raise ParallelStateTypeError(f"mask must be a list of bools such as [True, False, True], got {mask!r}")
    selected = [flag(f"mask[{i}]", m) for i, m in enumerate(mask)]
    if len(selected) != len(sizes):
        raise ParallelStateError(
            f"mask has {len(selected)} entries but parallel_size has {len(sizes)}; give one bool per dimension"
        )
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]

    def offsets(select: bool) -> list[int]:
        # Every combination of the chosen dimensions' coordinates, the first dimension fastest.
        out = [0]
        for size, stride, chosen in zip(sizes, strides, selected, strict=True):
            if chosen == select:
                out = [o + i * stride for i in range(size) for o in out]
        return out

    members, bases = offsets(True), offsets(False)
    count = world_size // len(members)
    if count > len(bases):
        raise ParallelStateAssertionError(
            f"world_size {world_size} holds {count} groups of {len(members)} ranks, but parallel_size {sizes} lays out "
            f"only {len(bases)}; pass world_size = product of parallel_size = {math.prod(sizes)}"
        )
    return [[b + m for m in members] for b in bases[:count]]


def _level_sizes(ranks: list[int], sizes: object) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or len(sizes) == 0:
        raise ParallelStateTypeError(
            f"hierarchical_group_sizes must be a non-empty list of ints such as [2, 4], got {sizes!r}"
        )
    levels = [positive_int(f"hierarchical_group_sizes[{i}]", s) for i, s in enumerate(sizes)]
    if math.prod(levels) != len(ranks):
        raise ParallelStateError(
            f"hierarchical_group_sizes {levels} multiply to {math.prod(levels)}, but there are {len(ranks)} ranks; "
            f"choose level sizes whose product is the number of ranks"
        )
    return levels


def hierarchical_rank_groups(ranks: Sequence[int], sizes: Sequence[int]) -> list[list[list[int]]]:
    """The sub-groups of ``ranks`` at each level of ``sizes``: one list of rank lists per level.

    Level ``i`` splits ``ranks`` into groups of ``sizes[i]`` ranks that lie ``prod(sizes[:i])``
    apart: for 16 ranks and sizes [2, 2, 4], level 0 is [0, 1], [2, 3], ...; level 1 is
    [0, 2], [1, 3], [4, 6], ...; level 2 is [0, 4, 8, 12], [1, 5, 9, 13], ... (megatron-core's
    ``create_hierarchical_groups``, in its group order).
    """
    members = _rank_list("ranks", ranks)
    levels = _level_sizes(members, sizes)
    out = []
    for level, size in enumerate(levels):
        inner, outer = math.prod(levels[:level]), math.prod(levels[level + 1:])
        block = size * inner
        out.append([[members[o * block + s * inner + u] for s in range(size)]
                    for o in range(outer) for u in range(inner)])
    return out


def hybrid_rank_groups(ranks: Sequence[int]) -> dict[int, list[list[int]]]:
    """The groups of hybrid DP x CP: for each power of two 2 <= size < len(ranks), consecutive slices.

    As in megatron-core, the sizes stop below ``len(ranks)`` (the largest power of two under
    it, exclusive when len(ranks) is itself a power of two), and when a size does not divide
    ``len(ranks)`` the last slice is shorter.
    """
    members = _rank_list("ranks", ranks)
    return {size: [members[i:i + size] for i in range(0, len(members), size)] for size in hybrid_sizes(len(members))}


__all__ = [
    "RankGenerator",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "generate_masked_orthogonal_rank_groups",
    "hierarchical_rank_groups",
    "hybrid_rank_groups",
]
