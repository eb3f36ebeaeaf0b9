"""The topology plan: every group kind megatron-core builds (the rows of ``topology.kinds``) over two grids.

megatron-core lays out the world twice with the same order string: the decoder grid (tp, cp,
dp, pp) and the expert grid (expert tp, ep, expert dp, pp). Every group it builds is a kind of
this plan: a set of dimensions of one grid, a level of a hierarchical split of another kind's
groups (hierarchical context parallelism, distributed-optimizer instances), contiguous blocks
of one (hybrid context parallelism), the stages a callable picks from each pipeline (embedding
groups), or a run of whole expert model-parallel groups (a distributed-optimizer instance).
The plan answers, for any rank and kind, the group's members, the rank's index in it and the
group's index among its kind, without processes and without walking the world: each question
is the kind's own method (``Kind.ranks``, ``rank``, ``size``, ``count``, ``index``, ``groups``,
``signature``), with the plan's sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable, Iterator

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.topology import validation
from parallel_state.topology.arguments import positive_int
from parallel_state.topology.grid import DEFAULT_ORDER, DIMS, Grid, insert_gtp_remat, normalize_order, parse_dims  # noqa: F401
from parallel_state.topology.kinds import ROWS, GridKind, Kind, hybrid_sizes  # noqa: F401
from parallel_state.topology.rank_map import RankMap
from parallel_state.topology.sizes import Sizes


@dataclass(frozen=True)
class TopologyPlan(Sizes):
    """A validated topology: the sizes, the order, and every group kind megatron-core would build.

    The sizes are :class:`Sizes`' fields, by keyword: ``ep`` and ``etp`` (default ``tp``) size the
    expert grid; ``hierarchical_cp`` splits each context-parallel group level by level;
    ``dist_opt_instances`` splits the data-parallel domain into distributed-optimizer instances;
    ``gtp`` and ``egtp`` are megatron-core 0.19's generalized tensor parallelism with weight
    rematerialization (``gtp_remat_size``, ``expert_gtp_remat_size``): a ``gtp_remat`` dimension of
    each grid, inserted after tp (decoder) and after ep (expert) as megatron-core 0.19 inserts it.
    ``hybrid_cp`` adds power-of-two blocks of each dp x cp group; ``all_gather`` adds a second dp x cp
    group for all-gathers, ``expert_all_gather`` a second expert dp group (with ep > 1);
    ``embedding_ranks`` / ``position_embedding_ranks`` pick the embedding stages from a
    pipeline's ranks (megatron-core's defaults: first and last, first). The plan holds its sizes
    checked: ``etp`` resolved, the order completed with every token.
    """

    world_size: int
    _: KW_ONLY
    hybrid_cp: bool = False
    all_gather: bool = False
    #: The expert data-parallel all-gather group (megatron-core 0.18's create_all_gather_groups), with ep > 1.
    expert_all_gather: bool = False
    embedding_ranks: Callable[..., Any] | None = field(default=None, compare=False)
    position_embedding_ranks: Callable[..., Any] | None = field(default=None, compare=False)
    #: The global ranks the plan lays out, ascending (None: ``0 .. world_size - 1``). The layout is
    #: computed over positions ``0 .. world_size - 1`` and every rank in or out is a global rank.
    ranks: tuple[int, ...] | None = None
    decoder: Grid = field(init=False, repr=False)
    expert: Grid = field(init=False, repr=False)
    #: Every kind of this plan by name, in creation order (``topology.kinds``' rows, bound to the plan).
    kinds: dict[str, Kind] = field(init=False, repr=False, compare=False)
    #: Plan positions to the global ranks (``ranks``) and back.
    rank_map: RankMap = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        world = positive_int("world_size", self.world_size)
        checked = validation.sizes(self)
        decoder, expert = validation.layout(world, checked, self.hybrid_cp)
        rank_map = RankMap(world, self.ranks)
        object.__setattr__(self, "rank_map", rank_map)
        object.__setattr__(self, "ranks", rank_map.ranks)
        for name in ("embedding_ranks", "position_embedding_ranks"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise ParallelStateTypeError(f"{name} must be a function of the pipeline's ranks, got {fn!r}")
        held = dataclasses.replace(checked, etp=checked.expert_tp, order=decoder.order,
                                   hierarchical_cp=checked.hierarchical_cp or None)
        for name, value in (*held.values().items(), ("world_size", world), ("decoder", decoder),
                            ("expert", expert)):
            object.__setattr__(self, name, value)
        self._kind_table()

    def _kind_table(self) -> None:
        """Every kind, in creation order: each row of ``topology.kinds`` bound to this plan."""
        kinds: dict[str, Kind] = {}
        object.__setattr__(self, "kinds", kinds)  # filled in place: a row may read the rows before it
        for row in ROWS:
            for kind in row.bind(self):
                kinds[kind.name] = kind

    def gloo_allowed(self, kind: str) -> bool:
        """Whether megatron-core builds a gloo twin of ``kind`` (if asked to) for this plan.

        megatron-core 0.19 builds no gloo groups under generalized tensor parallelism: none of the
        decoder's when gtp_remat > 1, and none of the expert's when either gtp_remat size is.
        """
        row = self.kinds.get(kind)
        if row is None:
            return False
        return self.gtp == 1 and (not row.expert(self) or self.egtp == 1)

    # --- sizes -----------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Data-parallel size: what is left of the world after tp, cp and pp."""
        return self.decoder.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: what is left of the world after expert tp, ep, pp and expert gtp_remat."""
        return self.world_size // (self.etp * self.ep * self.pp * self.egtp)

    @property
    def dims(self) -> tuple[str, ...]:
        """The decoder grid's dimension tokens in layout order."""
        return self.decoder.dims

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every decoder dimension, keyed by token (ep is the expert grid's)."""
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pp": self.pp, "gtp_remat": self.gtp}

    def size(self, dim: str) -> int:
        """Size of one dimension (``ep``, ``etp``, ``edp`` and ``egtp`` are the expert grid's)."""
        if dim in ("ep", "etp", "edp", "egtp"):
            return {"ep": self.ep, "etp": self.etp, "edp": self.edp, "egtp": self.egtp}[dim]
        return self.decoder.size(dim)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every decoder dimension."""
        return self.decoder.coords(self.rank_map.position(rank))

    # --- kinds ---------------------------------------------------------------------------------

    def kind(self, name: str) -> Kind:
        """The row of kind ``name``; a plain set of decoder tokens ('tp-cp-pp') works too."""
        row = self.kinds.get(name) if isinstance(name, str) else None
        if row is not None:
            return row
        if not isinstance(name, str):
            raise ParallelStateTypeError(f"a group kind is a str such as 'tp-cp', got {name!r}")
        try:
            dims = parse_dims(name)
        except ParallelStateError as exc:
            raise ParallelStateError(f"{exc}; or one of this plan's kinds {list(self.kinds)}") from None
        return GridKind(name=name, dims=dims)

    @property
    def all_ranks(self) -> tuple[int, ...]:
        """Every global rank of the plan, ascending."""
        return self.rank_map.all

    def group_ranks(self, kind: str, rank: int) -> tuple[int, ...]:
        """Global ranks of the group of ``kind`` that holds ``rank`` (empty when it is in none)."""
        return self.kind(kind).ranks(self, rank)

    def group_rank(self, kind: str, rank: int, members: tuple[int, ...] | None = None) -> int:
        """Index of ``rank`` in its group of ``kind`` as torch numbers it (by global rank); ``members``:
        that group, where the caller holds it (kinds without an arithmetic answer read it)."""
        return self.kind(kind).rank(self, rank, members)

    def group_size(self, kind: str, rank: int = 0) -> int:
        """Number of ranks in the group of ``kind`` holding ``rank`` (the same for every group of most kinds)."""
        return self.kind(kind).size(self, rank)

    def num_groups(self, kind: str) -> int:
        """Number of groups of ``kind`` in the world (counter slots to reserve)."""
        return self.kind(kind).count(self)

    def group_index(self, kind: str, rank: int) -> int:
        """Index of ``rank``'s group among all groups of ``kind``: the same on every member."""
        return self.kind(kind).index(self, rank)

    def groups(self, kind: str) -> Iterator[tuple[int, ...]]:
        """Every group of ``kind`` in the world, in megatron-core's creation order (O(world size))."""
        return self.kind(kind).groups(self)

    def signature(self, kind: str) -> Any:
        """Equal signatures mean the two kinds hold the same ranks on every rank (one group serves both)."""
        return self.kind(kind).signature(self)

    def same_group(self, kind_a: str, kind_b: str) -> bool:
        """Whether every rank's group of ``kind_a`` equals its group of ``kind_b``."""
        return self.signature(kind_a) == self.signature(kind_b)

