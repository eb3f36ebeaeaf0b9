"""Every group kind megatron-core builds, each one typed row: its ranks rule and every fact it carries.

Design. A kind's shape is its class, and the shape answers the layout questions (``ranks``,
``rank``, ``size``, ``count``, ``index``, ``groups``, ``signature``) for a plan, so the plan
dispatches by method, never by type:

- :class:`GridKind`: a set of dimensions of the decoder or the expert grid (``tp``, ``dp-cp``, ``edp``);
- :class:`SplitKind`: one level of a mixed-radix split of another kind's groups (the hierarchical
  context-parallel levels; :class:`InstanceSplit`: one distributed-optimizer instance's part);
- :class:`BlockKind`: contiguous blocks of another kind's groups (hybrid context parallelism);
- :class:`PickKind`: the stages a callable picks from each pipeline (embedding groups);
- :class:`InstanceKind`: a run of whole expert tp x ep x pp groups (a distributed-optimizer instance).

Every row also carries the facts the layers above read, once: megatron-core's global and its gloo
twin's, the NCCL config section, the ``group_desc``, the kinds it may share a group with, how
messages name it, whether its answers keep its ranks (and megatron-core's global holding them),
when megatron-core reports 0 for it, its ``ProcessGroupCollection`` field with the releases that
have it, and what to do when it was not built. A numbered kind (a hierarchical cp level, a hybrid
block size) is a row made by its :class:`Family` with the number as a field; its name is made from
the number and never read back. :data:`ROWS` lists the rows in megatron-core's creation order;
``Kind.bind`` gives a plan its rows (present or not, the plan's numbers filled in).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

from parallel_state.errors import ParallelStateError
from parallel_state.topology.grid import Grid

if TYPE_CHECKING:  # plan.py imports this module: the plan is named here for annotations only
    from parallel_state.topology.plan import TopologyPlan


class Field(NamedTuple):
    """A ``ProcessGroupCollection`` field: its name, its place in megatron-core 0.19's declaration
    order (``slot``) and the first release that declares it."""

    name: str
    slot: int
    since: str = "0.16"


@dataclass(frozen=True)
class Kind:
    """One group kind: its name, the facts its group carries, and (in a subclass) its ranks rule."""

    name: str
    #: megatron-core's module global holding this rank's group ("" where it has none of its own).
    megatron: str = ""
    #: The section of megatron-core's NCCL communicator config (and high_priority_stream_groups) for it.
    nccl: str = ""
    #: The group's description (``group_desc``): how NCCL's flight recorder and torch's logs name it.
    label: str = ""
    #: How messages name it ("the <title> group").
    title: str = ""
    #: megatron-core's global for the gloo twin, where megatron-core builds one with create_gloo_process_groups.
    gloo: str | None = None
    #: The gloo twin's ``group_desc``.
    gloo_label: str = ""
    #: The kinds whose group object this kind reuses, the first the plan gives the same ranks, as
    #: megatron-core does: the intra-instance data-parallel groups with one optimizer instance, and
    #: megatron-core 0.19's full data-parallel groups (spanning gtp_remat) where gtp_remat is 1.
    shares: tuple[str, ...] = ()
    #: Whether the answers keep its global ranks (an accessor or a global returns them; other
    #: kinds' groups can hold thousands of ranks nobody reads).
    with_ranks: bool = False
    #: megatron-core's global holding those ranks ("" where none does).
    ranks_global: str = ""
    #: When megatron-core reports its rank and size as 0 without groups: "dist" (while torch.distributed
    #: is not initialized), "groups" (megatron-core 0.19: whenever its group is not built), None (never).
    zero_without: str | None = None
    #: Its ProcessGroupCollection field, if it has one.
    field: Field | None = None
    #: A group of its own even where another kind has the same ranks (megatron-core's all-gather groups).
    separate: bool = False
    #: What to do when the kind was not built (or this rank is in none of its groups).
    hint: str = ""
    #: megatron-core's value of its global while nothing is initialized, as a factory (None: None).
    empty: Callable[[], Any] | None = None
    #: The plan has the kind only where this holds (None: always).
    when: Callable[[TopologyPlan], bool] | None = None
    #: A numbered kind's family (``hcp``, ``hybrid``) and number (level, block size).
    family: str = ""
    number: int = 0
    # The shape's parameters, each read by its own shape only: the kinds are one dataclass, since a
    # dataclass per shape made importing this module cost 15 ms more (its generated methods).
    #: GridKind: the grid ("decoder" or "expert") and its dimensions ('-'-joined tokens).
    grid: str = "decoder"
    dims: str = ""
    #: Parts of another kind's groups (SplitKind, BlockKind): that kind.
    base: str = ""
    #: SplitKind: the radices of the split (first fastest) and the level this kind is.
    radices: tuple[int, ...] = ()
    level: int = 0
    #: BlockKind: the block size.
    block: int = 0
    #: PickKind: "embedding" or "position_embedding".
    which: str = ""
    #: InstanceKind: the expert tp x ep x pp groups one instance holds.
    runs: int = 0
    #: Family: the members' NCCL section and group_desc template (``{number}``: the member's number).
    member_nccl: str = ""
    member_label: str = ""

    #: Whether every rank is in one of its groups (a picked kind can leave a rank out).
    everyone = True
    #: Whether a group lists its ranks ascending, so that a rank's position in it is its torch rank.
    ascending = False

    @property
    def answer(self) -> str:
        """The answer key holding this rank's group (what megatron-core's global holds)."""
        return f"{self.name}.group"

    @property
    def optional(self) -> bool:
        """Whether a rank's group may not exist (its collection field then holds None)."""
        return self.when is not None or not self.everyone

    def bind(self, plan: TopologyPlan) -> Iterator[Kind]:
        """The kinds this row gives ``plan``: itself where the plan has it, with the plan's numbers."""
        if self.when is None or self.when(plan):
            yield self

    def expert(self, plan: TopologyPlan) -> bool:
        """Whether the kind belongs to the expert layout."""
        return False

    def ranks(self, plan: TopologyPlan, rank: int) -> tuple[int, ...]:
        """Global ranks of the group holding ``rank`` (empty when it is in none)."""
        raise NotImplementedError(f"{type(self).__name__} has no ranks rule")

    def position(self, plan: TopologyPlan, rank: int, members: tuple[int, ...] | None = None) -> int:
        """Index of ``rank`` in its group as :meth:`ranks` lists it (``members``: that group, if known)."""
        return (self.ranks(plan, rank) if members is None else members).index(rank)

    def rank(self, plan: TopologyPlan, rank: int, members: tuple[int, ...] | None = None) -> int:
        """Index of ``rank`` in its group as torch numbers it (by global rank); ``members``: its group, if known."""
        members = self.ranks(plan, rank) if members is None else members
        if rank not in members:
            raise ParallelStateError(f"rank {rank} is in no {self.name} group")
        return sorted(members).index(rank)

    def size(self, plan: TopologyPlan, rank: int) -> int:
        """Number of ranks in the group holding ``rank``."""
        return len(self.ranks(plan, rank))

    def count(self, plan: TopologyPlan) -> int:
        """Number of groups of the kind in the world."""
        raise NotImplementedError(f"{type(self).__name__} has no count rule")

    def index(self, plan: TopologyPlan, rank: int) -> int:
        """Index of ``rank``'s group among the kind's groups: the same on every member."""
        raise NotImplementedError(f"{type(self).__name__} has no index rule")

    def groups(self, plan: TopologyPlan) -> Iterator[tuple[int, ...]]:
        """Every group of the kind, in megatron-core's creation order (O(world size))."""
        raise NotImplementedError(f"{type(self).__name__} has no groups rule")

    def signature(self, plan: TopologyPlan) -> Any:
        """Equal signatures mean equal groups on every rank (one group serves both kinds)."""
        raise NotImplementedError(f"{type(self).__name__} has no signature rule")


class GridKind(Kind):
    """The groups of ``dims`` (a '-'-joined set of tokens) in the decoder or the expert grid."""

    ascending = True

    def bind(self, plan: TopologyPlan) -> Iterator[Kind]:
        # Where the expert layout is the decoder's (no expert parallelism, an order megatron-core
        # refuses), the expert data-parallel groups take the context-parallel ranks in too.
        for kind in super().bind(plan):
            dims = self.dims.split("-")
            if self.grid == "expert" and plan.expert is plan.decoder and "dp" in dims and "cp" not in dims:
                kind = dataclasses.replace(self, dims=f"{self.dims}-cp")
            yield kind

    def _layout(self, plan: TopologyPlan) -> Grid:
        return plan.decoder if self.grid == "decoder" else plan.expert

    def expert(self, plan: TopologyPlan) -> bool:
        return self.grid == "expert"

    def ranks(self, plan: TopologyPlan, rank: int) -> tuple[int, ...]:
        return plan._global(self._layout(plan).group_ranks(self.dims, plan._pos(rank)))

    def position(self, plan: TopologyPlan, rank: int, members: tuple[int, ...] | None = None) -> int:
        return self._layout(plan).group_rank(self.dims, plan._pos(rank))

    def rank(self, plan: TopologyPlan, rank: int, members: tuple[int, ...] | None = None) -> int:
        # Positions keep the global ranks' order, so the layout's index is torch's.
        return self.position(plan, rank)

    def size(self, plan: TopologyPlan, rank: int = 0) -> int:
        return self._layout(plan).group_size(self.dims)

    def count(self, plan: TopologyPlan) -> int:
        return self._layout(plan).num_groups(self.dims)

    def index(self, plan: TopologyPlan, rank: int) -> int:
        return self._layout(plan).group_index(self.dims, plan._pos(rank))

    def groups(self, plan: TopologyPlan) -> Iterator[tuple[int, ...]]:
        for positions in self._layout(plan).groups(self.dims):
            yield plan._global(positions)

    def signature(self, plan: TopologyPlan) -> Any:
        return ("separate", self.name) if self.separate else self._layout(plan).signature(self.dims)


class _PartKind(Kind):
    """A kind whose groups are parts of each group of another kind, ``base``."""

    def expert(self, plan: TopologyPlan) -> bool:
        return plan.kind(self.base).expert(plan)

    def groups(self, plan: TopologyPlan) -> Iterator[tuple[int, ...]]:
        for base in plan.groups(self.base):
            seen: set[tuple[int, ...]] = set()
            for r in base:
                g = self.ranks(plan, r)
                if g not in seen:
                    seen.add(g)
                    yield g


class SplitKind(_PartKind):
    """Level ``level`` of a mixed-radix split of each ``base`` group (positions, first radix fastest)."""

    def _digits(self, position: int) -> tuple[int, int]:
        """The unit of the split's digit and ``position``'s digit there."""
        unit = math.prod(self.radices[:self.level])
        return unit, position // unit % self.radices[self.level]

    def ranks(self, plan: TopologyPlan, rank: int) -> tuple[int, ...]:
        base = plan.group_ranks(self.base, rank)
        position = plan.kind(self.base).position(plan, rank, base)
        unit, digit = self._digits(position)
        first = position - digit * unit
        return tuple([base[first + i * unit] for i in range(self.radices[self.level])])

    def rank(self, plan: TopologyPlan, rank: int, members: tuple[int, ...] | None = None) -> int:
        # A base group listing its ranks ascending (a grid's) keeps them ascending in every part: the
        # index is the rank's digit at the split's level, with no member list (one can be the world).
        base = plan.kind(self.base)
        if not base.ascending:
            return super().rank(plan, rank, members)
        return self._digits(base.position(plan, rank))[1]

    def size(self, plan: TopologyPlan, rank: int = 0) -> int:
        return self.radices[self.level]

    def _per_base(self) -> int:
        return math.prod(self.radices) // self.radices[self.level]

    def count(self, plan: TopologyPlan) -> int:
        return plan.num_groups(self.base) * self._per_base()

    def index(self, plan: TopologyPlan, rank: int) -> int:
        position = plan.kind(self.base).position(plan, rank)
        index, acc = 0, 1  # the split's index among one base group's: its other digits
        for i, radix in enumerate(self.radices):
            if i != self.level:
                index += (position // math.prod(self.radices[:i]) % radix) * acc
                acc *= radix
        return plan.group_index(self.base, rank) * self._per_base() + index

    def signature(self, plan: TopologyPlan) -> Any:
        radix = self.radices[self.level]
        if radix == 1:
            return ()
        if radix == math.prod(self.radices):
            return plan.signature(self.base)
        return ("split", plan.signature(self.base), self.radices, self.level)


class InstanceSplit(SplitKind):
    """One distributed-optimizer instance's part of each ``base`` group (level 0) or the group
    across the instances (level 1): ``base`` split by the number of instances."""

    def bind(self, plan: TopologyPlan) -> Iterator[Kind]:
        instances = plan.dist_opt_instances
        for kind in super().bind(plan):
            yield dataclasses.replace(kind, radices=(plan.group_size(self.base) // instances, instances))


class BlockKind(_PartKind):
    """Contiguous blocks of ``block`` positions of each ``base`` group; the last block may be short."""

    def ranks(self, plan: TopologyPlan, rank: int) -> tuple[int, ...]:
        base = plan.group_ranks(self.base, rank)
        start = base.index(rank) // self.block * self.block
        return base[start:start + self.block]

    def _per_base(self, plan: TopologyPlan) -> int:
        return -(-plan.group_size(self.base) // self.block)

    def count(self, plan: TopologyPlan) -> int:
        return plan.num_groups(self.base) * self._per_base(plan)

    def index(self, plan: TopologyPlan, rank: int) -> int:
        position = plan.group_ranks(self.base, rank).index(rank)
        return plan.group_index(self.base, rank) * self._per_base(plan) + position // self.block

    def signature(self, plan: TopologyPlan) -> Any:
        return ("blocks", plan.signature(self.base), self.block)


class PickKind(Kind):
    """The ranks a callable picks from each pipeline group (``which``: "embedding" or "position_embedding")."""

    everyone = False

    def ranks(self, plan: TopologyPlan, rank: int) -> tuple[int, ...]:
        picked = plan.picked(self.which, plan.group_ranks("pp", rank))
        return picked if rank in picked else ()

    def count(self, plan: TopologyPlan) -> int:
        return plan.num_groups("pp")

    def index(self, plan: TopologyPlan, rank: int) -> int:
        return plan.group_index("pp", rank)

    def groups(self, plan: TopologyPlan) -> Iterator[tuple[int, ...]]:
        for pp_ranks in plan.groups("pp"):
            yield plan.picked(self.which, pp_ranks)

    def signature(self, plan: TopologyPlan) -> Any:
        # A pick is a non-empty subset of the pipeline: all of it with one stage, and
        # megatron-core's default embedding pick (first and last) is all of it up to two.
        if plan.pp == 1 or (self.which == "embedding" and plan.embedding_ranks is None and plan.pp == 2):
            return plan.signature("pp")
        return ("picked", self.which)


class InstanceKind(Kind):
    """``runs`` consecutive expert tp-ep-pp groups (one distributed-optimizer instance), as one group."""

    def bind(self, plan: TopologyPlan) -> Iterator[Kind]:
        # megatron-core 0.19: with gtp_remat or expert gtp_remat the instance is the whole world (one instance).
        for kind in super().bind(plan):
            yield dataclasses.replace(kind, runs=plan.edp // plan.dist_opt_instances)

    def expert(self, plan: TopologyPlan) -> bool:
        return True

    def ranks(self, plan: TopologyPlan, rank: int) -> tuple[int, ...]:
        # A rank's position in its expert dp group is its expert-dp coordinate, shared by its
        # whole tp x ep x pp group: an instance is the runs at positions [first, first + runs).
        if self.runs == plan.edp:
            return plan.all_ranks  # one instance: the whole world, without walking it
        edp = plan.group_ranks("edp", rank)
        first = edp.index(rank) // self.runs * self.runs
        return tuple(sorted(sum([plan.group_ranks("etp-ep-pp", q) for q in edp[first:first + self.runs]], ())))

    def count(self, plan: TopologyPlan) -> int:
        return plan.edp // self.runs

    def index(self, plan: TopologyPlan, rank: int) -> int:
        return plan.group_ranks("edp", rank).index(rank) // self.runs

    def groups(self, plan: TopologyPlan) -> Iterator[tuple[int, ...]]:
        edp = plan.group_ranks("edp", plan.all_ranks[0])
        for first in range(0, plan.edp, self.runs):
            yield self.ranks(plan, edp[first])

    def signature(self, plan: TopologyPlan) -> Any:
        return ((1, plan.world_size),) if self.runs == plan.edp else ("instance", self.runs)


class Family(Kind):
    """A container of numbered kinds (megatron-core holds their groups in one list or dict global):
    not a kind of its own, the row its members are made from."""

    @property
    def answer(self) -> str:
        return f"{self.name}.groups"

    @property
    def optional(self) -> bool:
        return True

    def numbers(self, plan: TopologyPlan) -> list[int]:
        """The members' numbers in ``plan``."""
        raise NotImplementedError

    def member(self, plan: TopologyPlan, number: int) -> Kind:
        """The kind numbered ``number``."""
        raise NotImplementedError

    def bind(self, plan: TopologyPlan) -> Iterator[Kind]:
        for number in self.numbers(plan):
            yield self.member(plan, number)

    def collect(self, groups: dict[int, Any]) -> Any:
        """The family's answer from its members' groups keyed by number (None: no answer)."""
        return dict(groups)

    def _facts(self, number: int) -> dict[str, Any]:
        return dict(nccl=self.member_nccl, label=self.member_label.format(number=number), title=self.title,
                    hint=self.hint, family=self.name, number=number)


class Levels(Family):
    """Hierarchical context parallelism: level ``number`` of each cp group, innermost first."""

    def numbers(self, plan: TopologyPlan) -> list[int]:
        return list(range(len(plan.hierarchical_cp or ())))

    def member(self, plan: TopologyPlan, number: int) -> Kind:
        return SplitKind(f"cp-l{number}", base="cp", radices=plan.hierarchical_cp, level=number, **self._facts(number))

    def collect(self, groups: dict[int, Any]) -> Any:
        return [groups[level] for level in sorted(groups)] or None


class Blocks(Family):
    """Hybrid context parallelism: blocks of ``number`` ranks of each dp x cp group."""

    def numbers(self, plan: TopologyPlan) -> list[int]:
        return hybrid_sizes(plan.dp * plan.cp) if plan.hybrid_cp else []

    def member(self, plan: TopologyPlan, number: int) -> Kind:
        return BlockKind(f"dp-cp-hybrid{number}", base="dp-cp", block=number, **self._facts(number))


def hybrid_sizes(n: int) -> list[int]:
    """megatron-core's hybrid dp x cp group sizes for ``n`` ranks: the powers of two from 2 below 2**floor(log2 n)."""
    # int(log2(n)) without floating point: the position of n's highest set bit.
    return [2 ** i for i in range(1, n.bit_length() - 1)]


_DIST, _GROUPS = "dist", "groups"  # zero_without

#: Every kind (and family of numbered kinds), in megatron-core's creation order. megatron-core 0.19
#: builds the gtp_remat groups first; the model-parallel, tp x dp (x cp) groups span gtp_remat, the
#: plain dp (x cp) ones replicate across it.
ROWS: tuple[Kind, ...] = (
    GridKind("gtp", "_GTP_WEIGHT_REMAT_GROUP", "gtp_remat", "GTP_WEIGHT_REMAT_GROUP",
             "generalized tensor-parallel (gtp_remat)", with_ranks=True, ranks_global="_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
             zero_without=_GROUPS, field=Field("gtp_remat", 18, "0.19"), dims="gtp_remat"),
    GridKind("dp-cp", "_DATA_PARALLEL_GROUP_WITH_CP", "dp_cp", "DATA_PARALLEL_GROUP_WITH_CP",
             "data-parallel (with context parallel)", gloo="_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
             gloo_label="DATA_PARALLEL_GROUP_WITH_CP_GLOO", with_ranks=True,
             ranks_global="_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", zero_without=_DIST, field=Field("dp_cp", 15),
             dims="dp-cp"),
    GridKind("dp", "_DATA_PARALLEL_GROUP", "dp", "DATA_PARALLEL_GROUP", "data-parallel", gloo="_DATA_PARALLEL_GROUP_GLOO",
             gloo_label="DATA_PARALLEL_GROUP_GLOO",
             with_ranks=True, ranks_global="_DATA_PARALLEL_GLOBAL_RANKS", zero_without=_DIST, field=Field("dp", 14),
             dims="dp"),
    GridKind("gtp-dp", "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "gtp_remat_dp", "DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
             "data-parallel (with gtp_remat)", shares=("dp",), zero_without=_DIST, dims="gtp_remat-dp"),
    GridKind("gtp-dp-cp", "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "gtp_remat_dp_cp",
             "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "data-parallel (with context parallel and gtp_remat)",
             shares=("dp-cp",), zero_without=_DIST, field=Field("dp_cp_gtp_remat", 16, "0.19"), dims="gtp_remat-dp-cp"),
    GridKind("cp", "_CONTEXT_PARALLEL_GROUP", "cp", "CONTEXT_PARALLEL_GROUP", "context-parallel", with_ranks=True,
             ranks_global="_CONTEXT_PARALLEL_GLOBAL_RANKS", zero_without=_DIST, field=Field("cp", 5), dims="cp"),
    GridKind("tp-pp", "_MODEL_PARALLEL_GROUP", "mp", "MODEL_PARALLEL_GROUP", "model-parallel (tp-pp)", with_ranks=True,
             ranks_global="_MODEL_PARALLEL_GLOBAL_RANKS", field=Field("mp", 2), dims="tp-gtp_remat-pp"),
    GridKind("tp", "_TENSOR_MODEL_PARALLEL_GROUP", "tp", "TENSOR_MODEL_PARALLEL_GROUP", "tensor-model-parallel",
             with_ranks=True, ranks_global="_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", field=Field("tp", 0), dims="tp"),
    GridKind("pp", "_PIPELINE_MODEL_PARALLEL_GROUP", "pp", "PIPELINE_MODEL_PARALLEL_GROUP", "pipeline-model-parallel",
             with_ranks=True, ranks_global="_PIPELINE_GLOBAL_RANKS", field=Field("pp", 1), dims="pp"),
    GridKind("tp-dp-cp", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "tp_dp_cp", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
             "tensor-and-data-parallel (with context parallel)", field=Field("tp_dp_cp", 13), dims="tp-gtp_remat-dp-cp"),
    GridKind("tp-dp", "_TENSOR_AND_DATA_PARALLEL_GROUP", "tp_dp", "TENSOR_AND_DATA_PARALLEL_GROUP",
             "tensor-and-data-parallel", dims="tp-gtp_remat-dp"),
    GridKind("tp-cp", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "tp_cp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP",
             "tensor-and-context-parallel", with_ranks=True, zero_without=_DIST, field=Field("tp_cp", 6), dims="tp-cp"),
    InstanceSplit("dp-cp-intra", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "intra_dp_cp",
                  "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "partial (one optimizer instance) data-parallel",
                  gloo="_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                  gloo_label="INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", shares=("dp-cp",), zero_without=_DIST,
                  field=Field("intra_dp_cp", 23), base="dp-cp"),
    # One instance whenever gtp_remat > 1: the split is the whole full group (never built: it shares).
    InstanceSplit("gtp-dp-cp-intra", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "gtp_remat_dp_cp",
                  "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "partial data-parallel (with gtp_remat)",
                  shares=("dp-cp-intra", "gtp-dp-cp"), zero_without=_DIST, base="gtp-dp-cp"),
    GridKind("dp-cp-ag", "_DATA_PARALLEL_GROUP_WITH_CP_AG", "dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_AG",
             "separate all-gather data-parallel", field=Field("dp_cp_ag", 17, "0.18"), separate=True,
             hint="call parallel_state.create_all_gather_groups() (megatron-core 0.18+) or initialize with "
                  "create_all_gather_group=True (0.16, 0.17) to have the separate all-gather group",
             when=lambda plan: plan.all_gather, dims="dp-cp"),
    Levels("hcp", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", title="hierarchical context-parallel", field=Field("hcp", 7),
           hint="initialize with hierarchical_context_parallel_sizes=[...] to have hierarchical context-parallel groups",
           member_nccl="hcp", member_label="HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{number}"),
    Blocks("hybrid", "_HYBRID_DP_CP_GROUPS", title="hybrid data-and-context-parallel", member_nccl="dp_cp",
           member_label="HYBRID_DP_CP_GROUP_{number}", empty=dict),
    PickKind("embd", "_EMBEDDING_GROUP", "embd", "EMBEDDING_GROUP", "embedding", with_ranks=True,
             ranks_global="_EMBEDDING_GLOBAL_RANKS", field=Field("embd", 3),
             hint="this rank holds no embedding (its pipeline stage is not one get_embedding_ranks picked)",
             which="embedding"),
    PickKind("pos-embd", "_POSITION_EMBEDDING_GROUP", "pos_embd", "POSITION_EMBEDDING_GROUP", "position-embedding",
             with_ranks=True, ranks_global="_POSITION_EMBEDDING_GLOBAL_RANKS", field=Field("pos_embd", 4),
             hint="this rank holds no position embedding (its stage is not one get_position_embedding_ranks picked)",
             which="position_embedding"),
    GridKind("egtp", "_EXPERT_GTP_WEIGHT_REMAT_GROUP", "expt_gtp_remat", "EXPERT_GTP_WEIGHT_REMAT_GROUP",
             "expert generalized tensor-parallel (gtp_remat)", with_ranks=True,
             ranks_global="_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS", zero_without=_GROUPS,
             field=Field("expt_gtp_remat", 19, "0.19"), grid="expert", dims="gtp_remat"),
    GridKind("ep", "_EXPERT_MODEL_PARALLEL_GROUP", "ep", "EXPERT_MODEL_PARALLEL_GROUP", "expert-model-parallel",
             with_ranks=True, ranks_global="_EXPERT_MODEL_PARALLEL_RANKS", zero_without=_DIST, field=Field("ep", 8),
             grid="expert", dims="ep"),
    GridKind("etp", "_EXPERT_TENSOR_PARALLEL_GROUP", "ep_tp", "EXPERT_TENSOR_PARALLEL_GROUP", "expert-tensor-parallel",
             field=Field("expt_tp", 9), grid="expert", dims="tp"),
    GridKind("etp-ep", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "tp_ep_mp", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
             "expert tensor-and-model-parallel", zero_without=_DIST, field=Field("tp_ep", 10), grid="expert",
             dims="tp-ep"),
    GridKind("etp-ep-pp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "tp_ep_pp",
             "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "expert tensor-model-pipeline-parallel",
             field=Field("tp_ep_pp", 11), grid="expert", dims="tp-ep-pp"),
    GridKind("etp-ep-egtp-pp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", "tp_ep_gtp_remat_pp",
             "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
             "expert tensor-model-pipeline-parallel (with expert gtp_remat)",
             field=Field("tp_ep_pp_with_egtp_remat", 12, "0.19"), grid="expert", dims="tp-ep-gtp_remat-pp"),
    GridKind("edp", "_EXPERT_DATA_PARALLEL_GROUP", "ep_dp", "EXPERT_DATA_PARALLEL_GROUP", "expert data-parallel",
             gloo="_EXPERT_DATA_PARALLEL_GROUP_GLOO",
             gloo_label="EXPERT_DATA_PARALLEL_GROUP_GLOO", zero_without=_DIST, field=Field("expt_dp", 20), grid="expert",
             dims="dp"),
    GridKind("egtp-edp", "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "ep_gtp_remat_dp",
             "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "expert data-parallel (with gtp_remat)", shares=("edp",),
             zero_without=_DIST, field=Field("expt_dp_gtp_remat", 21, "0.19"), grid="expert", dims="gtp_remat-dp"),
    InstanceSplit("edp-intra", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "intra_ep_dp",
                  "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0", "partial expert data-parallel",
                  gloo="_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
                  gloo_label="HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L0", shares=("edp",), zero_without=_DIST,
                  field=Field("intra_expt_dp", 24), base="edp"),
    InstanceSplit("egtp-edp-intra", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "ep_gtp_remat_dp",
                  "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "partial expert data-parallel (with gtp_remat)",
                  shares=("edp-intra", "egtp-edp"), zero_without=_DIST, base="egtp-edp"),
    GridKind("edp-ag", "", "ep_dp", "EXPERT_DATA_PARALLEL_GROUP_AG", "expert all-gather data-parallel",
             field=Field("expt_dp_ag", 22, "0.18"), separate=True,
             hint="call parallel_state.create_all_gather_groups(for_expert_parallelism=True) with "
                  "expert_model_parallel_size > 1 to have the expert all-gather group",
             when=lambda plan: plan.expert_all_gather and plan.ep > 1, grid="expert", dims="dp"),
    InstanceSplit("edp-inter", "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "inter_ep_dp",
                  "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1", "inter distributed-optimizer-instance",
                  field=Field("inter_dist_opt", 25),
                  hint="initialize with num_distributed_optimizer_instances > 1 to have the inter-instance group",
                  when=lambda plan: plan.dist_opt_instances > 1, base="edp", level=1),
    InstanceKind("dist-opt", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", "intra_dist_opt_instance",
                 "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", "intra distributed-optimizer-instance",
                 field=Field("intra_dist_opt", 26)),
)

#: Every row by name (the families' too; numbered kinds are a plan's: ``TopologyPlan.kinds``).
BY_NAME: dict[str, Kind] = {r.name: r for r in ROWS}

#: ``ProcessGroupCollection``'s fields (every one is a kind's or a family's), in megatron-core 0.19's order.
FIELDS: tuple[Kind, ...] = tuple(sorted((r for r in ROWS if r.field is not None), key=lambda r: r.field.slot))  # type: ignore[union-attr]
