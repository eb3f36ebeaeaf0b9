"""The topology plan: every group kind megatron-core builds, as rows of one table over two grids.

megatron-core lays out the world twice with the same order string: the decoder grid (tp, cp,
dp, pp) and the expert grid (expert tp, ep, expert dp, pp). Every group it builds is a kind of
this plan: a set of dimensions of one grid, a level of a hierarchical split of another kind's
groups (hierarchical context parallelism, distributed-optimizer instances), contiguous blocks
of one (hybrid context parallelism), the stages a callable picks from each pipeline (embedding
groups), or a run of whole expert model-parallel groups (a distributed-optimizer instance).
The plan answers, for any rank and kind, the group's members, the rank's index in it and the
group's index among its kind, without processes and without walking the world.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.topology import validation
from parallel_state.topology.arguments import positive_int
from parallel_state.topology.grid import DEFAULT_ORDER, DIMS, Grid, insert_gtp_remat, normalize_order  # noqa: F401


@dataclass(frozen=True)
class GridKind:
    """The groups of ``dims`` (a '-'-joined set of tokens) in the decoder or the expert grid."""

    grid: str
    dims: str


@dataclass(frozen=True)
class SplitKind:
    """Level ``level`` of a mixed-radix split of each ``base`` group (positions, first radix fastest)."""

    base: str
    radices: tuple[int, ...]
    level: int


@dataclass(frozen=True)
class BlockKind:
    """Contiguous blocks of ``size`` positions of each ``base`` group; the last block may be short."""

    base: str
    size: int


@dataclass(frozen=True)
class PickKind:
    """The ranks a callable picks from each pipeline group (``which``: "embedding" or "position_embedding")."""

    which: str


@dataclass(frozen=True)
class InstanceKind:
    """``runs`` consecutive expert tp-ep-pp groups (one distributed-optimizer instance), as one group."""

    runs: int


KindSpec = Any  # one of the dataclasses above

#: Kinds that are a separate group even where another kind has the same ranks.
SEPARATE = ("dp-cp-ag", "edp-ag")


def _member_order(ranks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(ranks))


@dataclass(frozen=True)
class TopologyPlan:
    """A validated topology: the sizes, the order, and every group kind megatron-core would build.

    ``ep`` and ``etp`` (default ``tp``) size the expert grid; ``hierarchical_cp`` splits each
    context-parallel group level by level; ``dist_opt_instances`` splits the data-parallel
    domain into distributed-optimizer instances; ``hybrid_cp`` adds power-of-two blocks of each
    dp x cp group; ``all_gather`` adds a second dp x cp group for all-gathers, ``expert_all_gather``
    a second expert dp group (with ep > 1);
    ``embedding_ranks`` / ``position_embedding_ranks`` pick the embedding stages from a
    pipeline's ranks (megatron-core's defaults: first and last, first). ``gtp`` and ``egtp`` are
    megatron-core 0.19's generalized tensor parallelism with weight rematerialization
    (``gtp_remat_size``, ``expert_gtp_remat_size``): a ``gtp_remat`` dimension of each grid, inserted
    after tp (decoder) and after ep (expert) as megatron-core 0.19 inserts it.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    order: str = DEFAULT_ORDER
    hierarchical_cp: tuple[int, ...] | None = None
    dist_opt_instances: int = 1
    hybrid_cp: bool = False
    all_gather: bool = False
    #: The expert data-parallel all-gather group (megatron-core 0.18's create_all_gather_groups), with ep > 1.
    expert_all_gather: bool = False
    gtp: int = 1
    egtp: int = 1
    embedding_ranks: Callable[..., Any] | None = field(default=None, compare=False)
    position_embedding_ranks: Callable[..., Any] | None = field(default=None, compare=False)
    #: The global ranks the plan lays out, ascending (None: ``0 .. world_size - 1``). The layout is
    #: computed over positions ``0 .. world_size - 1`` and every rank in or out is a global rank.
    ranks: tuple[int, ...] | None = None
    decoder: Grid = field(init=False, repr=False)
    expert: Grid = field(init=False, repr=False)
    kinds: dict[str, KindSpec] = field(init=False, repr=False, compare=False)
    _position: dict[int, int] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        world = positive_int("world_size", self.world_size)
        checked = validation.sizes({k: getattr(self, k) for k in validation.PLAN_NAMES})
        decoder, expert = validation.layout(world, checked, self.hybrid_cp)
        subset = self.ranks
        if subset is not None:
            subset = tuple(subset)
            if list(subset) != sorted(set(subset)) or len(subset) != world:
                raise ParallelStateError(
                    f"ranks {list(subset)} must be {world} distinct global ranks in ascending order (one per "
                    f"position of the plan's world of {world})"
                )
        object.__setattr__(self, "ranks", subset)
        # Ranks 0 .. world_size - 1 need no mapping (a subset that starts at 0 included).
        identity = subset is None or subset == tuple(range(world))
        object.__setattr__(self, "_position", None if identity else {r: i for i, r in enumerate(subset)})
        for name in ("embedding_ranks", "position_embedding_ranks"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise ParallelStateTypeError(f"{name} must be a function of the pipeline's ranks, got {fn!r}")
        for name, value in (("tp", checked.tp), ("cp", checked.cp), ("pp", checked.pp), ("ep", checked.ep),
                            ("etp", checked.expert_tp), ("gtp", checked.gtp), ("egtp", checked.egtp),
                            ("world_size", world), ("order", decoder.order),
                            ("hierarchical_cp", checked.hierarchical_cp or None),
                            ("dist_opt_instances", checked.dist_opt_instances), ("decoder", decoder),
                            ("expert", expert)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "kinds", self._kind_table())

    def _kind_table(self) -> dict[str, KindSpec]:
        """Every kind, in creation order: the rows that state, accessors and bridge read."""
        # megatron-core 0.19 builds the gtp_remat groups first; the model-parallel, tp x dp (x cp)
        # groups span gtp_remat, the plain dp (x cp) ones replicate across it.
        kinds: dict[str, KindSpec] = {"gtp": GridKind("decoder", "gtp_remat")}
        kinds.update({k: GridKind("decoder", dims) for k, dims in (
            ("dp-cp", "dp-cp"), ("dp", "dp"), ("gtp-dp", "gtp_remat-dp"), ("gtp-dp-cp", "gtp_remat-dp-cp"),
            ("cp", "cp"), ("tp-pp", "tp-gtp_remat-pp"), ("tp", "tp"), ("pp", "pp"),
            ("tp-dp-cp", "tp-gtp_remat-dp-cp"), ("tp-dp", "tp-gtp_remat-dp"), ("tp-cp", "tp-cp"))})
        n = self.decoder.dp * self.cp
        kinds["dp-cp-intra"] = SplitKind("dp-cp", (n // self.dist_opt_instances, self.dist_opt_instances), 0)
        # One instance whenever gtp_remat > 1: the split is the whole full group (never built: it shares).
        kinds["gtp-dp-cp-intra"] = SplitKind("gtp-dp-cp", (n * self.gtp // self.dist_opt_instances,
                                                           self.dist_opt_instances), 0)
        if self.all_gather:
            kinds["dp-cp-ag"] = GridKind("decoder", "dp-cp")
        for level in range(len(self.hierarchical_cp or ())):
            kinds[f"cp-l{level}"] = SplitKind("cp", self.hierarchical_cp, level)  # type: ignore[arg-type]
        if self.hybrid_cp:
            for size in hybrid_sizes(n):
                kinds[f"dp-cp-hybrid{size}"] = BlockKind("dp-cp", size)
        kinds["embd"] = PickKind("embedding")
        kinds["pos-embd"] = PickKind("position_embedding")
        edp = "dp-cp" if self.expert is self.decoder else "dp"
        for name, dims in (("egtp", "gtp_remat"), ("ep", "ep"), ("etp", "tp"), ("etp-ep", "tp-ep"),
                           ("etp-ep-pp", "tp-ep-pp"), ("etp-ep-egtp-pp", "tp-ep-gtp_remat-pp"), ("edp", edp),
                           ("egtp-edp", f"gtp_remat-{edp}")):
            kinds[name] = GridKind("expert", dims)
        m, instances = self.edp // self.dist_opt_instances, self.dist_opt_instances
        kinds["edp-intra"] = SplitKind("edp", (m, instances), 0)
        kinds["egtp-edp-intra"] = SplitKind("egtp-edp", (m * self.egtp, instances), 0)
        if self.expert_all_gather and self.ep > 1:
            kinds["edp-ag"] = GridKind("expert", edp)
        if instances > 1:
            kinds["edp-inter"] = SplitKind("edp", (m, instances), 1)
        # megatron-core 0.19: with gtp_remat or expert gtp_remat the instance is the whole world (one instance).
        kinds["dist-opt"] = InstanceKind(m)
        return kinds

    def gloo_allowed(self, kind: str) -> bool:
        """Whether megatron-core builds a gloo twin of ``kind`` (if asked to) for this plan.

        megatron-core 0.19 builds no gloo groups under generalized tensor parallelism: none of the
        decoder's when gtp_remat > 1, and none of the expert's when either gtp_remat size is.
        """
        if kind not in self.kinds:
            return False
        expert = isinstance(self.kinds[kind], GridKind) and self.kinds[kind].grid == "expert" or kind.startswith("edp")
        return self.gtp == 1 and (not expert or self.egtp == 1)

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
        return self.decoder.coords(self._pos(rank))

    # --- kinds ---------------------------------------------------------------------------------

    def spec(self, kind: str) -> KindSpec:
        """The row of ``kind``; a plain set of decoder tokens ('tp-cp') works too."""
        spec = self.kinds.get(kind) if isinstance(kind, str) else None
        if spec is not None:
            return spec
        if not isinstance(kind, str):
            raise ParallelStateTypeError(f"a group kind is a str such as 'tp-cp', got {kind!r}")
        try:
            self.decoder._kind_dims(kind)
        except ParallelStateError as exc:
            raise ParallelStateError(f"{exc}; or one of this plan's kinds {list(self.kinds)}") from None
        return GridKind("decoder", kind)

    def _grid(self, spec: GridKind) -> Grid:
        return self.decoder if spec.grid == "decoder" else self.expert

    def _pos(self, rank: int) -> int:
        """The plan position of global ``rank``."""
        if self._position is None:
            return rank
        try:
            return self._position[rank]
        except KeyError:
            raise ParallelStateError(f"rank {rank} is not one of this plan's ranks {list(self.ranks)}") from None

    def _global(self, positions: tuple[int, ...]) -> tuple[int, ...]:
        """Global ranks of plan ``positions``."""
        return positions if self._position is None else tuple(self.ranks[p] for p in positions)

    @property
    def all_ranks(self) -> tuple[int, ...]:
        """Every global rank of the plan, ascending."""
        return self.ranks if self.ranks is not None else tuple(range(self.world_size))

    def group_ranks(self, kind: str, rank: int) -> tuple[int, ...]:
        """Global ranks of the group of ``kind`` that holds ``rank`` (empty when it is in none)."""
        spec = self.spec(kind)
        if isinstance(spec, GridKind):
            return self._global(self._grid(spec).group_ranks(spec.dims, self._pos(rank)))
        if isinstance(spec, SplitKind):
            base = self.group_ranks(spec.base, rank)
            return tuple([base[p] for p in _split_positions(spec, self._position_in(spec.base, rank, base))])
        if isinstance(spec, BlockKind):
            base = self.group_ranks(spec.base, rank)
            start = base.index(rank) // spec.size * spec.size
            return base[start:start + spec.size]
        if isinstance(spec, PickKind):
            picked = self.picked(spec.which, self.group_ranks("pp", rank))
            return picked if rank in picked else ()
        # A rank's position in its expert dp group is its expert-dp coordinate, shared by its
        # whole tp x ep x pp group: an instance is the runs at positions [first, first + runs).
        if spec.runs == self.edp:
            return self.all_ranks  # one instance: the whole world, without walking it
        edp = self.group_ranks("edp", rank)
        first = edp.index(rank) // spec.runs * spec.runs
        return _member_order(sum([self.group_ranks("etp-ep-pp", q) for q in edp[first:first + spec.runs]], ()))

    def picked(self, which: str, pp_ranks: tuple[int, ...]) -> tuple[int, ...]:
        """The embedding (or position-embedding) ranks of one pipeline, checked."""
        fn = getattr(self, f"{which}_ranks")
        if fn is None:
            fn = default_embedding_ranks if which == "embedding" else default_position_embedding_ranks
        try:
            picked = fn(list(pp_ranks))
        except Exception as exc:
            raise ParallelStateError(
                f"get_{which}_ranks({list(pp_ranks)}) raised {type(exc).__name__}: {exc}; it must return the "
                f"ranks of that pipeline that hold the {which.replace('_', ' ')}"
            ) from exc
        try:
            picked = tuple(int(r) for r in picked)
        except (TypeError, ValueError):
            raise ParallelStateError(
                f"get_{which}_ranks({list(pp_ranks)}) returned {picked!r}; it must return a list of global ranks"
            ) from None
        stray = [r for r in picked if r not in pp_ranks]
        if stray or not picked or len(set(picked)) != len(picked):
            why = (f"ranks {stray} are not in that pipeline" if stray else
                   "no rank" if not picked else "a rank twice")
            raise ParallelStateError(
                f"get_{which}_ranks({list(pp_ranks)}) returned {list(picked)}: {why}; return distinct ranks of "
                f"the pipeline group it is given"
            )
        return picked

    def group_rank(self, kind: str, rank: int) -> int:
        """Index of ``rank`` in its group of ``kind`` as torch numbers it (by global rank)."""
        spec = self.spec(kind)
        if isinstance(spec, GridKind):  # positions keep the global ranks' order, so the index is the same
            return self._grid(spec).group_rank(spec.dims, self._pos(rank))
        if isinstance(spec, SplitKind) and isinstance(self.spec(spec.base), GridKind):
            # A grid group lists its ranks ascending, and a split keeps every unit-th of them: the
            # index is the rank's digit at the split's level, with no member list (one can be the world).
            position = self.group_rank(spec.base, rank)
            return position // math.prod(spec.radices[:spec.level]) % spec.radices[spec.level]
        members = self.group_ranks(kind, rank)
        if rank not in members:
            raise ParallelStateError(f"rank {rank} is in no {kind} group")
        return sorted(members).index(rank)

    def _position_in(self, kind: str, rank: int, members: tuple[int, ...]) -> int:
        """Index of ``rank`` in ``members``, its group of ``kind`` as group_ranks lists it."""
        if isinstance(self.spec(kind), GridKind):
            return self._grid(self.spec(kind)).group_rank(self.spec(kind).dims, self._pos(rank))
        return members.index(rank)

    def group_size(self, kind: str, rank: int = 0) -> int:
        """Number of ranks in the group of ``kind`` holding ``rank`` (the same for every group of most kinds)."""
        spec = self.spec(kind)
        if isinstance(spec, GridKind):
            return self._grid(spec).group_size(spec.dims)
        if isinstance(spec, SplitKind):
            return spec.radices[spec.level]
        return len(self.group_ranks(kind, rank))

    def num_groups(self, kind: str) -> int:
        """Number of groups of ``kind`` in the world (counter slots to reserve)."""
        spec = self.spec(kind)
        if isinstance(spec, GridKind):
            return self._grid(spec).num_groups(spec.dims)
        if isinstance(spec, SplitKind):
            return self.num_groups(spec.base) * (math.prod(spec.radices) // spec.radices[spec.level])
        if isinstance(spec, BlockKind):
            return self.num_groups(spec.base) * -(-self.group_size(spec.base) // spec.size)
        if isinstance(spec, PickKind):
            return self.num_groups("pp")
        return self.edp // spec.runs

    def group_index(self, kind: str, rank: int) -> int:
        """Index of ``rank``'s group among all groups of ``kind``: the same on every member."""
        spec = self.spec(kind)
        if isinstance(spec, GridKind):
            return self._grid(spec).group_index(spec.dims, self._pos(rank))
        if isinstance(spec, SplitKind):
            position = self.group_ranks(spec.base, rank).index(rank)
            per_base = math.prod(spec.radices) // spec.radices[spec.level]
            return self.group_index(spec.base, rank) * per_base + _split_index(spec, position)
        if isinstance(spec, BlockKind):
            position = self.group_ranks(spec.base, rank).index(rank)
            per_base = -(-self.group_size(spec.base) // spec.size)
            return self.group_index(spec.base, rank) * per_base + position // spec.size
        if isinstance(spec, PickKind):
            return self.group_index("pp", rank)
        return self.group_ranks("edp", rank).index(rank) // spec.runs

    def groups(self, kind: str) -> Iterator[tuple[int, ...]]:
        """Every group of ``kind`` in the world, in megatron-core's creation order (O(world size))."""
        spec = self.spec(kind)
        if isinstance(spec, GridKind):
            for positions in self._grid(spec).groups(spec.dims):
                yield self._global(positions)
        elif isinstance(spec, (SplitKind, BlockKind)):
            for base in self.groups(spec.base):
                seen: set[tuple[int, ...]] = set()
                for r in base:
                    g = self.group_ranks(kind, r)
                    if g not in seen:
                        seen.add(g)
                        yield g
        elif isinstance(spec, PickKind):
            for pp_ranks in self.groups("pp"):
                yield self.picked(spec.which, pp_ranks)
        else:
            edp = self.group_ranks("edp", self.all_ranks[0])
            for first in range(0, self.edp, spec.runs):
                yield self.group_ranks(kind, edp[first])

    def signature(self, kind: str) -> Any:
        """Equal signatures mean the two kinds hold the same ranks on every rank (one group serves both)."""
        spec = self.spec(kind)
        if kind in SEPARATE:
            return ("separate", kind)
        if isinstance(spec, GridKind):
            return self._grid(spec).signature(spec.dims)
        if isinstance(spec, SplitKind):
            radix = spec.radices[spec.level]
            return () if radix == 1 else self.signature(spec.base) if radix == math.prod(spec.radices) \
                else ("split", self.signature(spec.base), spec.radices, spec.level)
        if isinstance(spec, BlockKind):
            return ("blocks", self.signature(spec.base), spec.size)
        if isinstance(spec, PickKind):
            # A pick is a non-empty subset of the pipeline: all of it with one stage, and
            # megatron-core's default embedding pick (first and last) is all of it up to two.
            if self.pp == 1 or (spec.which == "embedding" and self.embedding_ranks is None and self.pp == 2):
                return self.signature("pp")
            return ("picked", spec.which)
        if spec.runs == self.edp:
            return ((1, self.world_size),)  # the whole world
        return ("instance", spec.runs)

    def same_group(self, kind_a: str, kind_b: str) -> bool:
        """Whether every rank's group of ``kind_a`` equals its group of ``kind_b``."""
        return self.signature(kind_a) == self.signature(kind_b)


def _split_positions(spec: SplitKind, position: int) -> list[int]:
    """Positions in the base group that differ from ``position`` only in digit ``level``."""
    radices, level = spec.radices, spec.level
    unit = math.prod(radices[:level])
    digit = position // unit % radices[level]
    base = position - digit * unit
    return [base + i * unit for i in range(radices[level])]


def _split_index(spec: SplitKind, position: int) -> int:
    """Index of the split group holding ``position`` among the split groups of one base group."""
    index, acc = 0, 1
    for i, radix in enumerate(spec.radices):
        if i == spec.level:
            continue
        index += (position // math.prod(spec.radices[:i]) % radix) * acc
        acc *= radix
    return index


def hybrid_sizes(n: int) -> list[int]:
    """megatron-core's hybrid dp x cp group sizes for ``n`` ranks: the powers of two from 2 below 2**floor(log2 n)."""
    # int(log2(n)) without floating point: the position of n's highest set bit.
    return [2 ** i for i in range(1, n.bit_length() - 1)]


def _pp_rank_list(pp_ranks: object) -> list[Any]:
    if isinstance(pp_ranks, (str, bytes)) or not isinstance(pp_ranks, Sequence):
        raise ParallelStateTypeError(f"pp_ranks must be the list of a pipeline's global ranks, got {pp_ranks!r}")
    if len(pp_ranks) == 0:
        raise ParallelStateError("pp_ranks is empty; pass the global ranks of one pipeline, first stage first")
    return list(pp_ranks)


def default_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """The ranks that hold the word embeddings by default: the first and last pipeline stages."""
    ranks = _pp_rank_list(pp_ranks)
    return [ranks[0]] if len(ranks) == 1 else [ranks[0], ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """The ranks that hold the position embeddings by default: the first pipeline stage."""
    return [_pp_rank_list(pp_ranks)[0]]
