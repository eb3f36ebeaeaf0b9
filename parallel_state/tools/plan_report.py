"""What ``plan`` and ``demo`` share: exit codes, one-line errors, argument lists, and plans of a topology and a latent.

Kept apart from ``cli`` (the parser and the printing) so that ``cli``, ``demo`` and
``layout_svg`` each import it, and none of them imports another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from parallel_state.errors import ParallelStateError
from parallel_state.topology.attention_mask import AttentionMask
from parallel_state.topology.plan import TopologyPlan
from parallel_state.topology.split import split_latent

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A user-facing error: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- parsing helpers


def int_list(flag: str, text: str, length: int, names: str) -> tuple[int, ...]:
    """Parse ``"1,2,3"`` given to ``flag`` into ``length`` positive ints, or raise CliError."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise CliError(f"{flag} needs {length} comma-separated integers {names}, got {text!r}") from None
    if len(values) != length:
        raise CliError(f"{flag} needs {length} comma-separated integers {names}, got {len(values)} in {text!r}")
    if any(v < 1 for v in values):
        raise CliError(f"{flag} values must all be >= 1, got {text!r}")
    return values


def rank_list(flag: str, text: str) -> tuple[int, ...]:
    """Parse global ranks such as ``"4-7"`` or ``"0,2,4-5"`` given to ``flag``, ascending, or raise CliError."""
    ranks: list[int] = []
    try:
        for part in str(text).split(","):
            first, _, last = part.strip().partition("-")
            ranks += range(int(first), int(last or first) + 1)
    except ValueError:
        raise CliError(f"{flag} takes global ranks such as 4-7 or 0,2,4-5, got {text!r}") from None
    if len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise CliError(f"{flag} {text!r} names a rank twice or a negative rank; name each global rank once")
    return tuple(sorted(ranks))


def parse_mask(flag: str, spec: str, frame_tokens: int) -> AttentionMask:
    """Parse ``--mask``'s text (``AttentionMask.parse``; ``f`` counts frames of ``frame_tokens``) or raise CliError."""
    try:
        return AttentionMask.parse(spec, frame_tokens=frame_tokens)
    except (ValueError, TypeError) as exc:
        raise CliError(f"{flag}: {exc}") from None


def make_plan(world_size: int, tp: int, cp: int, pp: int, order: str,
              ranks: tuple[int, ...] | None = None) -> TopologyPlan:
    """A TopologyPlan (over global ``ranks`` when given), with its errors turned into one-line CLI errors."""
    try:
        return TopologyPlan(world_size, tp=tp, cp=cp, pp=pp, order=order, ranks=ranks)
    except ParallelStateError as exc:
        raise CliError(str(exc)) from None


# ----------------------------------------------------------------------------- video split


@dataclass
class SplitReport:
    """What ``find_split`` says about one latent shape and cp size."""

    shape: tuple[int, ...]
    cp_size: int
    patch: tuple[int, int, int]
    view_factor: int
    per_rank: tuple[int, ...] | None = None  # (T', H', W) when it splits
    cp_size_t: int | None = None
    error: str | None = None
    suggested_cp_sizes: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def cp_size_h(self) -> int | None:
        return None if self.cp_size_t is None else self.cp_size // self.cp_size_t


def find_split_quietly(shape: Sequence[int], cp_size: int, patch: Sequence[int], view_factor: int
                       ) -> tuple[tuple[int, ...], int]:
    """``find_split``'s result and ``cp_size_t``, recording nothing.

    ``plan`` only reports; it must not leave a ``cp_size_t`` behind for code that runs after it in
    the same process (tests call the CLI in-process), so it asks the arithmetic, not ``find_split``.
    """
    return split_latent(list(shape), cp_size, patch_values=tuple(patch), view_factor=view_factor)


def split_report(plan: TopologyPlan, shape: tuple[int, ...], patch: tuple[int, int, int],
                 view_factor: int) -> SplitReport:
    """Plan ``shape`` for ``plan.cp``; when it cannot be split, list the cp sizes that could.

    A shape that is invalid whatever the cp size (not 5-D, T not divisible by the view factor)
    is a CliError; a shape that only this cp size cannot split is reported, not raised.
    """
    report = SplitReport(shape=shape, cp_size=plan.cp, patch=patch, view_factor=view_factor)
    try:
        find_split_quietly(shape, 1, patch, view_factor)
    except (ValueError, TypeError) as exc:
        raise CliError(f"--video-shape {','.join(map(str, shape))}: {exc}") from None
    try:
        report.per_rank, report.cp_size_t = find_split_quietly(shape, plan.cp, patch, view_factor)
        return report
    except (ValueError, TypeError) as exc:
        report.error = str(exc)
    # cp sizes that keep this world size, tp and pp and that split the latent.
    room = plan.world_size // (plan.tp * plan.pp)
    for cp in range(1, room + 1):
        if room % cp:
            continue
        try:
            find_split_quietly(shape, cp, patch, view_factor)
        except (ValueError, TypeError):
            continue
        report.suggested_cp_sizes.append(cp)
    return report
