"""One rank layout: sizes + order -> every group's ranks and each rank's coordinates.

Nothing here touches ``torch.distributed``. The layout is megatron-core's ``RankGenerator``:
ranks are laid out over the dimensions of ``order`` with the first dimension varying fastest,
and the group of a kind (a set of dimensions) holds the ranks that share every other coordinate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.topology.arguments import is_int, positive_int
from parallel_state.topology.str_enum import StrEnum


class Dim(StrEnum):
    """A dimension of a rank layout, by megatron-core's token for it (its order strings name them).

    ``GTP_REMAT`` (megatron-core 0.19's generalized tensor parallelism) takes part in a layout only
    where an order names it: ``TopologyPlan`` inserts it where megatron-core 0.19 does when its size
    exceeds 1, and a dimension of size 1 changes no group.
    """

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"
    GTP_REMAT = "gtp_remat"


#: Megatron's dimension tokens (``Dim``'s values, as plain strings for messages) and its default order.
DIMS: tuple[str, ...] = tuple(d.value for d in Dim)
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
#: A group kind of a layout: its dimensions (a kind row's), or megatron-core's '-'-joined tokens ('tp-cp').
KindDims = str | tuple[Dim, ...]


def parse_dims(kind: str) -> tuple[Dim, ...]:
    """The dimensions of a group kind written as megatron-core writes one (``'tp-cp'``): its tokens, each once."""
    if not isinstance(kind, str):
        raise ParallelStateTypeError(f"a group kind is a str such as 'tp-cp', got {kind!r}")
    wanted = kind.split("-")
    if any(t not in DIMS for t in wanted) or len(set(wanted)) != len(wanted):
        raise ParallelStateError(
            f"unknown group kind {kind!r}; name each dimension once, with tokens from {list(DIMS)}, e.g. 'tp-cp'"
        )
    return tuple(Dim(t) for t in wanted)


def normalize_order(order: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """Validate ``order`` the way megatron-core's ``RankGenerator`` reads it and complete it.

    Tokens are case-insensitive; tokens missing from ``order`` are appended in Megatron's
    order (tp, pp, dp, ep, cp), which is only allowed for dimensions of size 1.
    """
    if not isinstance(order, str):
        raise ParallelStateTypeError(f"order must be a string like {DEFAULT_ORDER!r}, got {order!r}")
    tokens = [t.strip() for t in order.lower().split("-")]
    unknown = [t for t in tokens if t not in DIMS]
    if unknown:
        raise ParallelStateError(
            f"order {order!r} has unknown token(s) {unknown}; use '-'-separated tokens from "
            f"{list(DIMS)}, for example {DEFAULT_ORDER!r}"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ParallelStateError(f"order {order!r} repeats token(s) {repeated}; name each once")
    # Megatron appends missing tokens in the order of its name_to_size table. An unnamed gtp_remat
    # of size 1 stays out, so that every order of the releases before it reads as it did.
    if "gtp_remat" not in tokens and sizes.get("gtp_remat", 1) != 1:
        raise ParallelStateError(
            f"gtp_remat size is {sizes['gtp_remat']} but order {order!r} does not name 'gtp_remat'; add it to the order"
        )
    for name in ("tp", "pp", "dp", "ep", "cp"):
        if name not in tokens:
            if sizes.get(name, 1) != 1:
                raise ParallelStateError(
                    f"{name} size is {sizes[name]} but order {order!r} does not name {name!r}; "
                    f"add it to the order"
                )
            tokens.append(name)
    return tuple(tokens)


def insert_gtp_remat(order: str, after: str) -> str:
    """``order`` with the ``gtp_remat`` token where megatron-core 0.19 puts it: right after ``after``
    ('tp' for the decoder layout, 'ep' for the expert one), after 'tp' where ``after`` is missing, first
    where both are. The tokens are matched as written (megatron-core does not lower-case them here), and
    an order that names gtp_remat already is kept.
    """
    if not isinstance(order, str):
        raise ParallelStateTypeError(f"order must be a string like {DEFAULT_ORDER!r}, got {order!r}")
    tokens = order.split("-")
    if "gtp_remat" in tokens:
        return order
    anchor = after if after in tokens else "tp"
    tokens.insert(tokens.index(anchor) + 1 if anchor in tokens else 0, "gtp_remat")
    return "-".join(tokens)


@dataclass(frozen=True)
class Grid:
    """One rank layout (megatron-core's ``RankGenerator``): world size, each dimension's size, their order.

    Every question about groups is answered arithmetically, in time proportional to the size
    of the answer, never to the world size.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    gtp_remat: int = 1
    dims: tuple[str, ...] = field(init=False, repr=False)
    _stride: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_size", positive_int("world_size", self.world_size))
        for name in ("tp", "cp", "pp", "ep", "gtp_remat"):
            object.__setattr__(self, name, positive_int(f"{name} size", getattr(self, name)))
        model = self.tp * self.cp * self.pp * self.ep * self.gtp_remat
        if self.world_size % model:
            names = ["tp", "cp", "pp", "ep"] + (["gtp_remat"] if self.gtp_remat > 1 else [])
            raise ParallelStateError(
                f"world size {self.world_size} is not divisible by {'*'.join(names)} = "
                f"{'*'.join(str(getattr(self, n)) for n in names)} = {model}; choose sizes whose product "
                f"divides the world size"
            )
        dims = normalize_order(self.order, self.sizes)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "order", "-".join(dims))
        stride, acc = {}, 1
        for d in dims:
            stride[d] = acc
            acc *= self.size(d)
        object.__setattr__(self, "_stride", stride)

    @property
    def dp(self) -> int:
        """Data-parallel size: what is left of the world after tp, cp, pp, ep and gtp_remat."""
        return self.world_size // (self.tp * self.cp * self.pp * self.ep * self.gtp_remat)

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every dimension, keyed by token."""
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pp": self.pp, "gtp_remat": self.gtp_remat}

    def size(self, dim: str) -> int:
        """Size of one dimension."""
        if dim not in DIMS:
            raise ParallelStateError(f"unknown dimension {dim!r}; use one of {list(DIMS)}")
        return getattr(self, dim)

    def _kind_dims(self, kind: KindDims) -> list[str]:
        # A kind row's dimensions are Dims already (checked when the row was made); a str is parsed.
        wanted = kind if isinstance(kind, tuple) else parse_dims(kind)
        # Group members are enumerated with the dimensions in layout order.
        return [d for d in self.dims if d in wanted]

    def _check_rank(self, rank: int) -> None:
        if not is_int(rank):
            raise ParallelStateTypeError(f"a rank is an int in [0, {self.world_size}), got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise ParallelStateError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every dimension."""
        self._check_rank(rank)
        return {d: (rank // self._stride[d]) % self.size(d) for d in self.dims}

    def group_size(self, kind: KindDims) -> int:
        """Number of ranks in each group of ``kind``."""
        return math.prod(self.size(d) for d in self._kind_dims(kind))

    def num_groups(self, kind: KindDims) -> int:
        """Number of groups of ``kind`` in the world."""
        return self.world_size // self.group_size(kind)

    def group_ranks(self, kind: KindDims, rank: int) -> tuple[int, ...]:
        """Global ranks of the group of ``kind`` that holds ``rank``, in Megatron's order."""
        kdims = self._kind_dims(kind)
        coords = self.coords(rank)
        base = rank - sum(coords[d] * self._stride[d] for d in kdims)
        members = [base]
        # Expand one dimension at a time, the first (fastest) dimension innermost.
        for d in kdims:
            step = self._stride[d]
            members = [m + i * step for i in range(self.size(d)) for m in members]
        return tuple(members)

    def group_rank(self, kind: KindDims, rank: int) -> int:
        """Index of ``rank`` inside its group of ``kind``."""
        coords, index, acc = self.coords(rank), 0, 1
        for d in self._kind_dims(kind):
            index += coords[d] * acc
            acc *= self.size(d)
        return index

    def group_index(self, kind: KindDims, rank: int) -> int:
        """Index of ``rank``'s group among all groups of ``kind`` (Megatron's enumeration order)."""
        kdims = set(self._kind_dims(kind))
        coords, index, acc = self.coords(rank), 0, 1
        for d in self.dims:
            if d not in kdims:
                index += coords[d] * acc
                acc *= self.size(d)
        return index

    def groups(self, kind: KindDims) -> Iterator[tuple[int, ...]]:
        """Every group of ``kind`` in the world, in Megatron's order (O(world size))."""
        kdims = set(self._kind_dims(kind))
        outer = [d for d in self.dims if d not in kdims]
        bases = [0]
        for d in outer:
            step = self._stride[d]
            bases = [b + i * step for i in range(self.size(d)) for b in bases]
        for b in bases:
            yield self.group_ranks(kind, b)

    def same_group(self, kind_a: KindDims, kind_b: KindDims) -> bool:
        """Whether every rank's group of ``kind_a`` equals its group of ``kind_b``."""
        return self.signature(kind_a) == self.signature(kind_b)

    def signature(self, kind: KindDims) -> tuple[tuple[int, int], ...]:
        """The groups of ``kind`` as (stride, size) runs: equal signatures mean equal groups, across grids too.

        A group holds ``base + sum(i * stride)``; dimensions of size 1 add nothing and adjacent
        dimensions whose strides chain merge into one run, so the form is canonical.
        """
        runs: list[tuple[int, int]] = []
        for d in self._kind_dims(kind):
            size, stride = self.size(d), self._stride[d]
            if size == 1:
                continue
            if runs and runs[-1][0] * runs[-1][1] == stride:
                runs[-1] = (runs[-1][0], runs[-1][1] * size)
            else:
                runs.append((stride, size))
        return tuple(runs)

