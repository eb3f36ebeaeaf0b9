"""The global ranks a plan lays out: plan position ``i`` (what the grids number) is global rank ``ranks[i]``."""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel_state.errors import ParallelStateError


@dataclass(frozen=True)
class RankMap:
    """Positions ``0 .. world_size - 1`` to global ranks and back; ``ranks`` None: each position is its rank."""

    world_size: int
    #: The global ranks, ascending, one per position (None: ``0 .. world_size - 1``).
    ranks: tuple[int, ...] | None = None
    _position: dict[int, int] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        subset = self.ranks
        if subset is None:
            return
        subset = tuple(subset)
        world = self.world_size
        if list(subset) != sorted(set(subset)) or len(subset) != world:
            raise ParallelStateError(
                f"ranks {list(subset)} must be {world} distinct global ranks in ascending order (one per "
                f"position of the plan's world of {world})"
            )
        object.__setattr__(self, "ranks", subset)
        # Ranks 0 .. world_size - 1 need no mapping (a subset that starts at 0 included).
        if subset != tuple(range(world)):
            object.__setattr__(self, "_position", {r: i for i, r in enumerate(subset)})

    @property
    def all(self) -> tuple[int, ...]:
        """Every global rank, ascending."""
        return self.ranks if self.ranks is not None else tuple(range(self.world_size))

    def position(self, rank: int) -> int:
        """The position of global ``rank``."""
        if self._position is None:
            return rank
        try:
            return self._position[rank]
        except KeyError:
            raise ParallelStateError(f"rank {rank} is not one of this plan's ranks {list(self.ranks)}") from None

    def global_ranks(self, positions: tuple[int, ...]) -> tuple[int, ...]:
        """The global ranks at ``positions``."""
        return positions if self._position is None else tuple(self.ranks[p] for p in positions)
