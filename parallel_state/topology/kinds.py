"""Every group kind megatron-core builds, each one typed row: its ranks rule and every fact it carries.

Design. A kind's shape is its class, and the shape answers the layout questions (``ranks``,
``rank``, ``size``, ``count``, ``index``, ``groups``, ``signature``) for a plan, so the plan
dispatches by method, never by type:

- :class:`GridKind`: a set of dimensions (:class:`~parallel_state.topology.grid.Dim`) of the decoder or the
  expert grid (``tp``, ``dp-cp``, ``edp``);
- :class:`SplitKind`: one level of a mixed-radix split of another kind's groups (the hierarchical
  context-parallel levels; :class:`InstanceSplit`: one distributed-optimizer instance's part);
- :class:`BlockKind`: contiguous blocks of another kind's groups (hybrid context parallelism);
- :class:`PickKind`: the stages a callable picks from each pipeline (embedding groups);
- :class:`InstanceKind`: a run of whole expert tp x ep x pp groups (a distributed-optimizer instance).

Every row also carries the facts the layers above read, once: megatron-core's global and its gloo
twin's, the NCCL config section, the ``group_desc``, the kinds it may share a group with, how
messages name it, whether its answers keep its ranks (and megatron-core's global holding them),
when megatron-core reports 0 for it, its ``ProcessGroupCollection`` field with the releases that
have it, and what to do when it was not built. A row is written by keyword, and states only what
follows no rule: megatron-core names a kind's global ``_<group_desc>``, its gloo twin's global and
``group_desc`` with ``_GLOO`` appended, and its global-ranks global with ``_GROUP`` read as
``_GLOBAL_RANKS``; :class:`Kind` derives those where a row leaves them out (:data:`BY_RULE`). So a
new kind is one keyword row of :data:`ROWS`, which also names it for the code above
(``kinds.TP``), whose answer keys it makes (``TP.key(Fact.RANK)``). A numbered kind (a
hierarchical cp level, a hybrid block size) is a row made by its :class:`Family` with the number as
a field; its name is made from the number and never read back. :data:`ROWS` lists the rows in
megatron-core's creation order; ``Kind.bind`` gives a plan its rows (present or not, the plan's
numbers filled in).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Final, Iterator, NamedTuple, Protocol, Sequence

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.topology.answer_keys import AnswerKey, Fact, key
from parallel_state.topology.grid import Dim, Grid
from parallel_state.topology.rank_map import RankMap
from parallel_state.topology.str_enum import StrEnum


class Plan(Protocol):
    """What a kind reads of the plan it answers for: ``plan.TopologyPlan`` is one (that module imports this
    one, so the kinds name the plan by what they read of it, never by its class)."""

    world_size: int
    cp: int
    pp: int
    ep: int
    dist_opt_instances: int
    hierarchical_cp: tuple[int, ...] | None
    hybrid_cp: bool
    all_gather: bool
    expert_all_gather: bool
    embedding_ranks: Callable[..., Any] | None
    position_embedding_ranks: Callable[..., Any] | None
    decoder: Grid
    expert: Grid
    rank_map: RankMap

    @property
    def dp(self) -> int: ...
    @property
    def edp(self) -> int: ...
    @property
    def all_ranks(self) -> tuple[int, ...]: ...
    def kind(self, name: str) -> Kind: ...
    def group_ranks(self, kind: str, rank: int) -> tuple[int, ...]: ...
    def group_size(self, kind: str, rank: int = 0) -> int: ...
    def num_groups(self, kind: str) -> int: ...
    def group_index(self, kind: str, rank: int) -> int: ...
    def groups(self, kind: str) -> Iterator[tuple[int, ...]]: ...
    def signature(self, kind: str) -> Any: ...


class Field(NamedTuple):
    """A ``ProcessGroupCollection`` field: its name, its place in megatron-core 0.19's declaration
    order (``slot``) and the first release that declares it."""

    name: str
    slot: int
    since: str = "0.16"


class GridLayout(StrEnum):
    """The grid a grid kind's dimensions belong to: the decoder's or the expert's (``TopologyPlan.decoder``,
    ``.expert``). Not a dispatch plan's token ``Layout`` (``ps.Layout``, ``topology.dispatch_layout``)."""

    DECODER = "decoder"
    EXPERT = "expert"


class Pick(StrEnum):
    """The stages a picked kind takes from each pipeline: megatron-core's ``get_<value>_ranks`` picks them."""

    EMBEDDING = "embedding"
    POSITION_EMBEDDING = "position_embedding"


class Zero(StrEnum):
    """When megatron-core reports a kind's rank and size as 0 without its group."""

    #: While torch.distributed is not initialized.
    WITHOUT_DIST = "dist"
    #: Whenever its group is not built (megatron-core 0.19's gtp_remat kinds).
    WITHOUT_GROUPS = "groups"


#: The default of a name a row may leave to megatron-core's naming rule (see the field).
BY_RULE: Final = "<by rule>"


@dataclass(frozen=True)
class Kind:
    """One group kind: its name, the facts its group carries, and (in a subclass) its ranks rule."""

    name: str
    #: How messages name it ("the <title> group").
    title: str = ""
    #: The group's description (``group_desc``): how NCCL's flight recorder and torch's logs name it.
    label: str = ""
    #: The section of megatron-core's NCCL communicator config (and high_priority_stream_groups) for it.
    nccl: str = ""
    #: megatron-core's module global holding this rank's group: by rule ``_<label>``; None where it has none of its own.
    megatron: str | None = BY_RULE
    #: Whether megatron-core builds a gloo twin of it (with create_gloo_process_groups), held in the global
    #: ``<megatron>_GLOO`` (:attr:`gloo_global`).
    gloo: bool = False
    #: The gloo twin's ``group_desc``: by rule ``<label>_GLOO``.
    gloo_label: str | None = BY_RULE
    #: The kinds whose group object this kind reuses, the first the plan gives the same ranks, as
    #: megatron-core does: the intra-instance data-parallel groups with one optimizer instance, and
    #: megatron-core 0.19's full data-parallel groups (spanning gtp_remat) where gtp_remat is 1.
    shares: tuple[str, ...] = ()
    #: Whether the answers keep its global ranks (an accessor or a global returns them; other
    #: kinds' groups can hold thousands of ranks nobody reads).
    with_ranks: bool = False
    #: megatron-core's global holding those ranks: by rule :attr:`megatron` with ``_GROUP`` read as
    #: ``_GLOBAL_RANKS``; None where none does.
    ranks_global: str | None = BY_RULE
    #: When megatron-core reports its rank and size as 0 without groups (None: never).
    zero_without: Zero | None = None
    #: Its ProcessGroupCollection field, if it has one.
    field: Field | None = None
    #: A group of its own even where another kind has the same ranks (megatron-core's all-gather groups).
    separate: bool = False
    #: What to do when the kind was not built (or this rank is in none of its groups).
    hint: str = ""
    #: megatron-core's value of its global while nothing is initialized, as a factory (None: None).
    empty: Callable[[], Any] | None = None
    #: The plan has the kind only where this holds (None: always).
    when: Callable[[Plan], bool] | None = None
    #: A numbered kind's family (``hcp``, ``hybrid``) and number (level, block size).
    family: str = ""
    number: int = 0
    # The shape's parameters, each read by its own shape only: the kinds are one dataclass, since a
    # dataclass per shape made importing this module cost 15 ms more (its generated methods).
    #: GridKind: the layout and its dimensions.
    layout: GridLayout = GridLayout.DECODER
    dims: tuple[Dim, ...] = ()
    #: Parts of another kind's groups (SplitKind, BlockKind): that kind.
    base: str = ""
    #: SplitKind: the radices of the split (first fastest) and the level this kind is.
    radices: tuple[int, ...] = ()
    level: int = 0
    #: BlockKind: the block size.
    block: int = 0
    #: PickKind: the stages it picks.
    which: Pick | None = None
    #: InstanceKind: the expert tp x ep x pp groups one instance holds.
    runs: int = 0
    #: Family: the members' NCCL section and group_desc template (``{number}``: the member's number).
    member_nccl: str = ""
    member_label: str = ""
    #: megatron-core's global holding the gloo twin (``<megatron>_GLOO``; None without a twin). Derived.
    gloo_global: str | None = dataclasses.field(init=False, default=None)

    #: Whether every rank is in one of its groups (a picked kind can leave a rank out).
    everyone = True
    #: Whether a group lists its ranks ascending, so that a rank's position in it is its torch rank.
    ascending = False

    def __post_init__(self) -> None:
        # The names megatron-core derives from a kind's group_desc, where the row left them to the rule.
        megatron = self.megatron
        if megatron == BY_RULE:
            megatron = f"_{self.label}" if self.label else None
        gloo_label = self.gloo_label
        if gloo_label == BY_RULE:
            gloo_label = f"{self.label}_GLOO" if self.gloo else None
        ranks_global = self.ranks_global
        if ranks_global == BY_RULE:
            ranks_global = megatron.replace("_GROUP", "_GLOBAL_RANKS", 1) if self.with_ranks and megatron else None
        for name, value in (("megatron", megatron), ("gloo_label", gloo_label), ("ranks_global", ranks_global),
                            ("gloo_global", f"{megatron}_GLOO" if self.gloo and megatron else None)):
            object.__setattr__(self, name, value)
        # A wrong type here is a typo in a row: an error where the row is written, not where it is read.
        if not all(isinstance(d, Dim) for d in self.dims):
            raise TypeError(f"kind {self.name!r}: dims are Dims (Dim.TP, ...), got {self.dims!r}")
        for name, value, cls in (("zero_without", self.zero_without, Zero), ("which", self.which, Pick)):
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"kind {self.name!r}: {name} is a {cls.__name__} or None, got {value!r}")
        if not isinstance(self.layout, GridLayout):
            raise TypeError(f"kind {self.name!r}: layout is a GridLayout, got {self.layout!r}")
        if self.gloo and not (megatron and gloo_label):
            raise TypeError(f"kind {self.name!r}: a gloo twin needs megatron-core's global and group_desc")

    def key(self, fact: Fact) -> AnswerKey:
        """The answer key of ``fact`` about this kind (``TP.key(Fact.RANK)``)."""
        return key(self.name, fact)

    @property
    def answer(self) -> AnswerKey:
        """The answer key holding this rank's group (what megatron-core's global holds)."""
        return self.key(Fact.GROUP)

    @property
    def optional(self) -> bool:
        """Whether a rank's group may not exist (its collection field then holds None)."""
        return self.when is not None or not self.everyone

    def bind(self, plan: Plan) -> Iterator[Kind]:
        """The kinds this row gives ``plan``: itself where the plan has it, with the plan's numbers."""
        if self.when is None or self.when(plan):
            yield self

    def expert(self, plan: Plan) -> bool:
        """Whether the kind belongs to the expert layout."""
        return False

    def ranks(self, plan: Plan, rank: int) -> tuple[int, ...]:
        """Global ranks of the group holding ``rank`` (empty when it is in none)."""
        raise NotImplementedError(f"{type(self).__name__} has no ranks rule")

    def position(self, plan: Plan, rank: int, members: tuple[int, ...] | None = None) -> int:
        """Index of ``rank`` in its group as :meth:`ranks` lists it (``members``: that group, if known)."""
        return (self.ranks(plan, rank) if members is None else members).index(rank)

    def rank(self, plan: Plan, rank: int, members: tuple[int, ...] | None = None) -> int:
        """Index of ``rank`` in its group as torch numbers it (by global rank); ``members``: its group, if known."""
        members = self.ranks(plan, rank) if members is None else members
        if rank not in members:
            raise ParallelStateError(f"rank {rank} is in no {self.name} group")
        return sorted(members).index(rank)

    def size(self, plan: Plan, rank: int) -> int:
        """Number of ranks in the group holding ``rank``."""
        return len(self.ranks(plan, rank))

    def count(self, plan: Plan) -> int:
        """Number of groups of the kind in the world."""
        raise NotImplementedError(f"{type(self).__name__} has no count rule")

    def index(self, plan: Plan, rank: int) -> int:
        """Index of ``rank``'s group among the kind's groups: the same on every member."""
        raise NotImplementedError(f"{type(self).__name__} has no index rule")

    def groups(self, plan: Plan) -> Iterator[tuple[int, ...]]:
        """Every group of the kind, in megatron-core's creation order (O(world size))."""
        raise NotImplementedError(f"{type(self).__name__} has no groups rule")

    def signature(self, plan: Plan) -> Any:
        """Equal signatures mean equal groups on every rank (one group serves both kinds)."""
        raise NotImplementedError(f"{type(self).__name__} has no signature rule")


class GridKind(Kind):
    """The groups of ``dims`` (a set of dimensions) in the decoder or the expert grid (``layout``)."""

    ascending = True

    def bind(self, plan: Plan) -> Iterator[Kind]:
        # Where the expert layout is the decoder's (no expert parallelism, an order megatron-core
        # refuses), the expert data-parallel groups take the context-parallel ranks in too.
        for kind in super().bind(plan):
            if (self.layout is GridLayout.EXPERT and plan.expert is plan.decoder and Dim.DP in self.dims
                    and Dim.CP not in self.dims):
                kind = dataclasses.replace(self, dims=(*self.dims, Dim.CP))
            yield kind

    def _grid(self, plan: Plan) -> Grid:
        return plan.decoder if self.layout is GridLayout.DECODER else plan.expert

    def expert(self, plan: Plan) -> bool:
        return self.layout is GridLayout.EXPERT

    def ranks(self, plan: Plan, rank: int) -> tuple[int, ...]:
        return plan.rank_map.global_ranks(self._grid(plan).group_ranks(self.dims, plan.rank_map.position(rank)))

    def position(self, plan: Plan, rank: int, members: tuple[int, ...] | None = None) -> int:
        return self._grid(plan).group_rank(self.dims, plan.rank_map.position(rank))

    def rank(self, plan: Plan, rank: int, members: tuple[int, ...] | None = None) -> int:
        # Positions keep the global ranks' order, so the layout's index is torch's.
        return self.position(plan, rank)

    def size(self, plan: Plan, rank: int = 0) -> int:
        return self._grid(plan).group_size(self.dims)

    def count(self, plan: Plan) -> int:
        return self._grid(plan).num_groups(self.dims)

    def index(self, plan: Plan, rank: int) -> int:
        return self._grid(plan).group_index(self.dims, plan.rank_map.position(rank))

    def groups(self, plan: Plan) -> Iterator[tuple[int, ...]]:
        for positions in self._grid(plan).groups(self.dims):
            yield plan.rank_map.global_ranks(positions)

    def signature(self, plan: Plan) -> Any:
        return ("separate", self.name) if self.separate else self._grid(plan).signature(self.dims)


class _PartKind(Kind):
    """A kind whose groups are parts of each group of another kind, ``base``."""

    def expert(self, plan: Plan) -> bool:
        return plan.kind(self.base).expert(plan)

    def groups(self, plan: Plan) -> Iterator[tuple[int, ...]]:
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

    def ranks(self, plan: Plan, rank: int) -> tuple[int, ...]:
        base = plan.group_ranks(self.base, rank)
        position = plan.kind(self.base).position(plan, rank, base)
        unit, digit = self._digits(position)
        first = position - digit * unit
        return tuple([base[first + i * unit] for i in range(self.radices[self.level])])

    def rank(self, plan: Plan, rank: int, members: tuple[int, ...] | None = None) -> int:
        # A base group listing its ranks ascending (a grid's) keeps them ascending in every part: the
        # index is the rank's digit at the split's level, with no member list (one can be the world).
        base = plan.kind(self.base)
        if not base.ascending:
            return super().rank(plan, rank, members)
        return self._digits(base.position(plan, rank))[1]

    def size(self, plan: Plan, rank: int = 0) -> int:
        return self.radices[self.level]

    def _per_base(self) -> int:
        return math.prod(self.radices) // self.radices[self.level]

    def count(self, plan: Plan) -> int:
        return plan.num_groups(self.base) * self._per_base()

    def index(self, plan: Plan, rank: int) -> int:
        position = plan.kind(self.base).position(plan, rank)
        index, acc = 0, 1  # the split's index among one base group's: its other digits
        for i, radix in enumerate(self.radices):
            if i != self.level:
                index += (position // math.prod(self.radices[:i]) % radix) * acc
                acc *= radix
        return plan.group_index(self.base, rank) * self._per_base() + index

    def signature(self, plan: Plan) -> Any:
        radix = self.radices[self.level]
        if radix == 1:
            return ()
        if radix == math.prod(self.radices):
            return plan.signature(self.base)
        return ("split", plan.signature(self.base), self.radices, self.level)


class InstanceSplit(SplitKind):
    """One distributed-optimizer instance's part of each ``base`` group (level 0) or the group
    across the instances (level 1): ``base`` split by the number of instances."""

    def bind(self, plan: Plan) -> Iterator[Kind]:
        instances = plan.dist_opt_instances
        for kind in super().bind(plan):
            yield dataclasses.replace(kind, radices=(plan.group_size(self.base) // instances, instances))


class BlockKind(_PartKind):
    """Contiguous blocks of ``block`` positions of each ``base`` group; the last block may be short."""

    def ranks(self, plan: Plan, rank: int) -> tuple[int, ...]:
        base = plan.group_ranks(self.base, rank)
        start = base.index(rank) // self.block * self.block
        return base[start:start + self.block]

    def _per_base(self, plan: Plan) -> int:
        return -(-plan.group_size(self.base) // self.block)

    def count(self, plan: Plan) -> int:
        return plan.num_groups(self.base) * self._per_base(plan)

    def index(self, plan: Plan, rank: int) -> int:
        position = plan.group_ranks(self.base, rank).index(rank)
        return plan.group_index(self.base, rank) * self._per_base(plan) + position // self.block

    def signature(self, plan: Plan) -> Any:
        return ("blocks", plan.signature(self.base), self.block)


class PickKind(Kind):
    """The ranks a callable picks from each pipeline group (``which``)."""

    everyone = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.which is None:
            raise TypeError(f"kind {self.name!r}: a picked kind says which stages it picks (which=Pick....)")

    def picked(self, plan: Plan, pp_ranks: tuple[int, ...]) -> tuple[int, ...]:
        """The stages of one pipeline (its global ranks ``pp_ranks``) this kind holds: the plan's pick, checked."""
        which = self.which
        fn = getattr(plan, f"{which}_ranks")
        if fn is None:
            fn = default_embedding_ranks if which is Pick.EMBEDDING else default_position_embedding_ranks
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

    def ranks(self, plan: Plan, rank: int) -> tuple[int, ...]:
        picked = self.picked(plan, plan.group_ranks(PP.name, rank))
        return picked if rank in picked else ()

    def count(self, plan: Plan) -> int:
        return plan.num_groups(PP.name)

    def index(self, plan: Plan, rank: int) -> int:
        return plan.group_index(PP.name, rank)

    def groups(self, plan: Plan) -> Iterator[tuple[int, ...]]:
        for pp_ranks in plan.groups(PP.name):
            yield self.picked(plan, pp_ranks)

    def signature(self, plan: Plan) -> Any:
        # A pick is a non-empty subset of the pipeline: all of it with one stage, and
        # megatron-core's default embedding pick (first and last) is all of it up to two.
        if plan.pp == 1 or (self.which is Pick.EMBEDDING and plan.embedding_ranks is None and plan.pp == 2):
            return plan.signature(PP.name)
        return ("picked", self.which)


class InstanceKind(Kind):
    """``runs`` consecutive expert tp-ep-pp groups (one distributed-optimizer instance), as one group."""

    def bind(self, plan: Plan) -> Iterator[Kind]:
        # megatron-core 0.19: with gtp_remat or expert gtp_remat the instance is the whole world (one instance).
        for kind in super().bind(plan):
            yield dataclasses.replace(kind, runs=plan.edp // plan.dist_opt_instances)

    def expert(self, plan: Plan) -> bool:
        return True

    def ranks(self, plan: Plan, rank: int) -> tuple[int, ...]:
        # A rank's position in its expert dp group is its expert-dp coordinate, shared by its
        # whole tp x ep x pp group: an instance is the runs at positions [first, first + runs).
        if self.runs == plan.edp:
            return plan.all_ranks  # one instance: the whole world, without walking it
        edp = plan.group_ranks(EDP.name, rank)
        first = edp.index(rank) // self.runs * self.runs
        return tuple(sorted(sum([plan.group_ranks(ETP_EP_PP.name, q) for q in edp[first:first + self.runs]], ())))

    def count(self, plan: Plan) -> int:
        return plan.edp // self.runs

    def index(self, plan: Plan, rank: int) -> int:
        return plan.group_ranks(EDP.name, rank).index(rank) // self.runs

    def groups(self, plan: Plan) -> Iterator[tuple[int, ...]]:
        edp = plan.group_ranks(EDP.name, plan.all_ranks[0])
        for first in range(0, plan.edp, self.runs):
            yield self.ranks(plan, edp[first])

    def signature(self, plan: Plan) -> Any:
        return ((1, plan.world_size),) if self.runs == plan.edp else ("instance", self.runs)


class Family(Kind):
    """A container of numbered kinds (megatron-core holds their groups in one list or dict global):
    not a kind of its own, the row its members are made from."""

    @property
    def answer(self) -> AnswerKey:
        return self.key(Fact.GROUPS)

    @property
    def optional(self) -> bool:
        return True

    def numbers(self, plan: Plan) -> list[int]:
        """The members' numbers in ``plan``."""
        raise NotImplementedError

    def member(self, plan: Plan, number: int) -> Kind:
        """The kind numbered ``number``."""
        raise NotImplementedError

    def bind(self, plan: Plan) -> Iterator[Kind]:
        for number in self.numbers(plan):
            yield self.member(plan, number)

    def collect(self, groups: dict[int, Any]) -> Any:
        """The family's answer from its members' groups keyed by number (None: no answer)."""
        return dict(groups)

    def _facts(self, number: int) -> dict[str, Any]:
        # A member's group is held in the family's global, none of its own.
        return dict(nccl=self.member_nccl, label=self.member_label.format(number=number), title=self.title,
                    hint=self.hint, family=self.name, number=number, megatron=None)


class Levels(Family):
    """Hierarchical context parallelism: level ``number`` of each cp group, innermost first."""

    def numbers(self, plan: Plan) -> list[int]:
        return list(range(len(plan.hierarchical_cp or ())))

    def member(self, plan: Plan, number: int) -> Kind:
        return SplitKind(name=f"{CP.name}-l{number}", base=CP.name, radices=plan.hierarchical_cp, level=number,
                         **self._facts(number))

    def collect(self, groups: dict[int, Any]) -> Any:
        return [groups[level] for level in sorted(groups)] or None


class Blocks(Family):
    """Hybrid context parallelism: blocks of ``number`` ranks of each dp x cp group."""

    def numbers(self, plan: Plan) -> list[int]:
        return hybrid_sizes(plan.dp * plan.cp) if plan.hybrid_cp else []

    def member(self, plan: Plan, number: int) -> Kind:
        return BlockKind(name=f"{DP_CP.name}-hybrid{number}", base=DP_CP.name, block=number, **self._facts(number))


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


def hybrid_sizes(n: int) -> list[int]:
    """megatron-core's hybrid dp x cp group sizes for ``n`` ranks: the powers of two from 2 below 2**floor(log2 n)."""
    # int(log2(n)) without floating point: the position of n's highest set bit.
    return [2 ** i for i in range(1, n.bit_length() - 1)]


#: Every kind (and family of numbered kinds), in megatron-core's creation order, each named for the code
#: above (a row may refer only to the rows before it). megatron-core 0.19 builds the gtp_remat groups
#: first; the model-parallel, tp x dp (x cp) groups span gtp_remat, the plain dp (x cp) ones replicate across it.
ROWS: tuple[Kind, ...] = (
    GTP := GridKind(
        name="gtp", dims=(Dim.GTP_REMAT,), title="generalized tensor-parallel (gtp_remat)",
        label="GTP_WEIGHT_REMAT_GROUP", nccl="gtp_remat", with_ranks=True, zero_without=Zero.WITHOUT_GROUPS,
        field=Field("gtp_remat", 18, "0.19")),
    DP_CP := GridKind(
        name="dp-cp", dims=(Dim.DP, Dim.CP), title="data-parallel (with context parallel)",
        label="DATA_PARALLEL_GROUP_WITH_CP", nccl="dp_cp", gloo=True, with_ranks=True, zero_without=Zero.WITHOUT_DIST,
        field=Field("dp_cp", 15)),
    DP := GridKind(
        name="dp", dims=(Dim.DP,), title="data-parallel", label="DATA_PARALLEL_GROUP", nccl="dp", gloo=True,
        with_ranks=True, zero_without=Zero.WITHOUT_DIST, field=Field("dp", 14)),
    GTP_DP := GridKind(
        name="gtp-dp", dims=(Dim.GTP_REMAT, Dim.DP), title="data-parallel (with gtp_remat)",
        label="DATA_PARALLEL_GROUP_WITH_GTP_REMAT", nccl="gtp_remat_dp", shares=(DP.name,),
        zero_without=Zero.WITHOUT_DIST),
    GTP_DP_CP := GridKind(
        name="gtp-dp-cp", dims=(Dim.GTP_REMAT, Dim.DP, Dim.CP), title="data-parallel (with context parallel and gtp_remat)",
        label="DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", nccl="gtp_remat_dp_cp", shares=(DP_CP.name,),
        zero_without=Zero.WITHOUT_DIST, field=Field("dp_cp_gtp_remat", 16, "0.19")),
    CP := GridKind(
        name="cp", dims=(Dim.CP,), title="context-parallel", label="CONTEXT_PARALLEL_GROUP", nccl="cp", with_ranks=True,
        zero_without=Zero.WITHOUT_DIST, field=Field("cp", 5)),
    TP_PP := GridKind(
        name="tp-pp", dims=(Dim.TP, Dim.GTP_REMAT, Dim.PP), title="model-parallel (tp-pp)", label="MODEL_PARALLEL_GROUP",
        nccl="mp", with_ranks=True, field=Field("mp", 2)),
    TP := GridKind(
        name="tp", dims=(Dim.TP,), title="tensor-model-parallel", label="TENSOR_MODEL_PARALLEL_GROUP", nccl="tp",
        with_ranks=True, field=Field("tp", 0)),
    PP := GridKind(
        name="pp", dims=(Dim.PP,), title="pipeline-model-parallel", label="PIPELINE_MODEL_PARALLEL_GROUP", nccl="pp",
        with_ranks=True, ranks_global="_PIPELINE_GLOBAL_RANKS", field=Field("pp", 1)),
    TP_DP_CP := GridKind(
        name="tp-dp-cp", dims=(Dim.TP, Dim.GTP_REMAT, Dim.DP, Dim.CP),
        title="tensor-and-data-parallel (with context parallel)", label="TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
        nccl="tp_dp_cp", field=Field("tp_dp_cp", 13)),
    TP_DP := GridKind(
        name="tp-dp", dims=(Dim.TP, Dim.GTP_REMAT, Dim.DP), title="tensor-and-data-parallel",
        label="TENSOR_AND_DATA_PARALLEL_GROUP", nccl="tp_dp"),
    TP_CP := GridKind(
        name="tp-cp", dims=(Dim.TP, Dim.CP), title="tensor-and-context-parallel", label="TENSOR_AND_CONTEXT_PARALLEL_GROUP",
        nccl="tp_cp", with_ranks=True, ranks_global=None, zero_without=Zero.WITHOUT_DIST, field=Field("tp_cp", 6)),
    DP_CP_INTRA := InstanceSplit(
        name="dp-cp-intra", base=DP_CP.name, title="partial (one optimizer instance) data-parallel",
        label="INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", nccl="intra_dp_cp", gloo=True, shares=(DP_CP.name,),
        zero_without=Zero.WITHOUT_DIST, field=Field("intra_dp_cp", 23)),
    # One instance whenever gtp_remat > 1: the split is the whole full group, whose group it takes (never built).
    GTP_DP_CP_INTRA := InstanceSplit(
        name="gtp-dp-cp-intra", base=GTP_DP_CP.name, title="partial data-parallel (with gtp_remat)",
        label=GTP_DP_CP.label, nccl=GTP_DP_CP.nccl, megatron="_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
        shares=(DP_CP_INTRA.name, GTP_DP_CP.name), zero_without=Zero.WITHOUT_DIST),
    DP_CP_AG := GridKind(
        name="dp-cp-ag", dims=(Dim.DP, Dim.CP), title="separate all-gather data-parallel",
        label="DATA_PARALLEL_GROUP_WITH_CP_AG", nccl=DP_CP.nccl, separate=True, field=Field("dp_cp_ag", 17, "0.18"),
        when=lambda plan: plan.all_gather,
        hint="call parallel_state.create_all_gather_groups() (megatron-core 0.18+) or initialize with "
             "create_all_gather_group=True (0.16, 0.17) to have the separate all-gather group"),
    HCP := Levels(
        name="hcp", title="hierarchical context-parallel", megatron="_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
        member_nccl="hcp", member_label="HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{number}", field=Field("hcp", 7),
        hint="initialize with hierarchical_context_parallel_sizes=[...] to have hierarchical context-parallel groups"),
    HYBRID := Blocks(
        name="hybrid", title="hybrid data-and-context-parallel", megatron="_HYBRID_DP_CP_GROUPS",
        member_nccl=DP_CP.nccl, member_label="HYBRID_DP_CP_GROUP_{number}", empty=dict),
    EMBD := PickKind(
        name="embd", which=Pick.EMBEDDING, title="embedding", label="EMBEDDING_GROUP", nccl="embd", with_ranks=True,
        field=Field("embd", 3),
        hint="this rank holds no embedding (its pipeline stage is not one get_embedding_ranks picked)"),
    POS_EMBD := PickKind(
        name="pos-embd", which=Pick.POSITION_EMBEDDING, title="position-embedding", label="POSITION_EMBEDDING_GROUP",
        nccl="pos_embd", with_ranks=True, field=Field("pos_embd", 4),
        hint="this rank holds no position embedding (its stage is not one get_position_embedding_ranks picked)"),
    EGTP := GridKind(
        name="egtp", layout=GridLayout.EXPERT, dims=(Dim.GTP_REMAT,), title="expert generalized tensor-parallel (gtp_remat)",
        label="EXPERT_GTP_WEIGHT_REMAT_GROUP", nccl="expt_gtp_remat", with_ranks=True, zero_without=Zero.WITHOUT_GROUPS,
        field=Field("expt_gtp_remat", 19, "0.19")),
    EP := GridKind(
        name="ep", layout=GridLayout.EXPERT, dims=(Dim.EP,), title="expert-model-parallel",
        label="EXPERT_MODEL_PARALLEL_GROUP",
        nccl="ep", with_ranks=True, ranks_global="_EXPERT_MODEL_PARALLEL_RANKS", zero_without=Zero.WITHOUT_DIST,
        field=Field("ep", 8)),
    ETP := GridKind(
        name="etp", layout=GridLayout.EXPERT, dims=(Dim.TP,), title="expert-tensor-parallel",
        label="EXPERT_TENSOR_PARALLEL_GROUP", nccl="ep_tp", field=Field("expt_tp", 9)),
    ETP_EP := GridKind(
        name="etp-ep", layout=GridLayout.EXPERT, dims=(Dim.TP, Dim.EP), title="expert tensor-and-model-parallel",
        label="EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", nccl="tp_ep_mp", zero_without=Zero.WITHOUT_DIST,
        field=Field("tp_ep", 10)),
    ETP_EP_PP := GridKind(
        name="etp-ep-pp", layout=GridLayout.EXPERT, dims=(Dim.TP, Dim.EP, Dim.PP),
        title="expert tensor-model-pipeline-parallel",
        label="EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", nccl="tp_ep_pp", field=Field("tp_ep_pp", 11)),
    ETP_EP_EGTP_PP := GridKind(
        name="etp-ep-egtp-pp", layout=GridLayout.EXPERT, dims=(Dim.TP, Dim.EP, Dim.GTP_REMAT, Dim.PP),
        title="expert tensor-model-pipeline-parallel (with expert gtp_remat)",
        label="EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", nccl="tp_ep_gtp_remat_pp",
        field=Field("tp_ep_pp_with_egtp_remat", 12, "0.19")),
    EDP := GridKind(
        name="edp", layout=GridLayout.EXPERT, dims=(Dim.DP,), title="expert data-parallel",
        label="EXPERT_DATA_PARALLEL_GROUP",
        nccl="ep_dp", gloo=True, zero_without=Zero.WITHOUT_DIST, field=Field("expt_dp", 20)),
    EGTP_EDP := GridKind(
        name="egtp-edp", layout=GridLayout.EXPERT, dims=(Dim.GTP_REMAT, Dim.DP),
        title="expert data-parallel (with gtp_remat)",
        label="EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", nccl="ep_gtp_remat_dp", shares=(EDP.name,),
        zero_without=Zero.WITHOUT_DIST, field=Field("expt_dp_gtp_remat", 21, "0.19")),
    EDP_INTRA := InstanceSplit(
        name="edp-intra", base=EDP.name, title="partial expert data-parallel",
        label="HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0", nccl="intra_ep_dp",
        megatron="_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", gloo=True,
        gloo_label="HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L0", shares=(EDP.name,), zero_without=Zero.WITHOUT_DIST,
        field=Field("intra_expt_dp", 24)),
    EGTP_EDP_INTRA := InstanceSplit(
        name="egtp-edp-intra", base=EGTP_EDP.name, title="partial expert data-parallel (with gtp_remat)",
        label=EGTP_EDP.label, nccl=EGTP_EDP.nccl, megatron="_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
        shares=(EDP_INTRA.name, EGTP_EDP.name), zero_without=Zero.WITHOUT_DIST),
    EDP_AG := GridKind(
        name="edp-ag", layout=GridLayout.EXPERT, dims=(Dim.DP,), title="expert all-gather data-parallel",
        label="EXPERT_DATA_PARALLEL_GROUP_AG", nccl=EDP.nccl, megatron=None, separate=True,
        field=Field("expt_dp_ag", 22, "0.18"), when=lambda plan: plan.expert_all_gather and plan.ep > 1,
        hint="call parallel_state.create_all_gather_groups(for_expert_parallelism=True) with "
             "expert_model_parallel_size > 1 to have the expert all-gather group"),
    EDP_INTER := InstanceSplit(
        name="edp-inter", base=EDP.name, level=1, title="inter distributed-optimizer-instance",
        label="HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1", nccl="inter_ep_dp",
        megatron="_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", field=Field("inter_dist_opt", 25),
        when=lambda plan: plan.dist_opt_instances > 1,
        hint="initialize with num_distributed_optimizer_instances > 1 to have the inter-instance group"),
    DIST_OPT := InstanceKind(
        name="dist-opt", title="intra distributed-optimizer-instance", label="INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
        nccl="intra_dist_opt_instance", field=Field("intra_dist_opt", 26)),
)

#: Every row by name (the families' too; numbered kinds are a plan's: ``Plan.kinds``).
BY_NAME: dict[str, Kind] = {r.name: r for r in ROWS}

def row(kind: str) -> Kind:
    """The row of kind ``kind`` (a plan's numbered kinds: ``plan.kind(name)``)."""
    try:
        return BY_NAME[kind]
    except KeyError:
        raise KeyError(f"{kind!r} is not a fixed group kind; the kinds are {list(BY_NAME)} (numbered kinds: "
                       f"TopologyPlan.kind)") from None


#: ``ProcessGroupCollection``'s fields (every one is a kind's or a family's), in megatron-core 0.19's order.
FIELDS: tuple[Kind, ...] = tuple(sorted((r for r in ROWS if r.field is not None), key=lambda r: r.field.slot))  # type: ignore[union-attr]
