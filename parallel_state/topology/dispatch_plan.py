"""``plan_dispatch``: which tokens of a masked sequence each context-parallel rank holds, so that the work is even.

A rank's attention work is the number of allowed (query, key) pairs of the queries it holds. Under a
causal or chunk-causal mask the later tokens see more keys, so the contiguous split (rank i holds the
i-th block) leaves the last rank with up to ``2 - 1 / cp`` times the mean. The balanced plan fixes that
while keeping what memory and the attention kernels need:

- Token counts: rank r holds exactly ``shard_sizes(length, cp_size)[r]`` tokens, the same counts as
  the contiguous split (memory balance; the gathers' uneven rule applies unchanged).
- Work: each rank's queries get as close to ``work / cp_size`` pairs as one token's key count allows.
- Runs: a few large contiguous runs per rank (two for causal kinds), for efficient kernels and a
  small K/V exchange.

How (a zigzag whose cut points are solved, not fixed): order the sequence by key count per query
(``AttentionMask.widths``), low to high. For causal and chunk-causal masks that order is the sequence
itself; otherwise pieces of it (segments, chunks, blocks of at least ``length / (4 cp)`` tokens) are
sorted by their mean key count, stably. Rank 0 then takes ``x`` tokens from the low end and
``n - x`` from the high end of that order, with ``x`` chosen so that its work is nearest to the mean
of what remains; rank 1 does the same with the rest, and so on; the last rank takes the middle. For
a non-decreasing order such an ``x`` always exists (the low end alone is at most the mean, the high
end alone at least), so every rank lands within about one token's key count of the mean: the fixed
zigzag (2 cp equal chunks, rank r taking r and 2cp-1-r) with its cut points moved to where the work
is even. The contiguous split is the other candidate; the plan with the smaller busiest rank wins
(ties: the contiguous split, one run per rank). Work per position comes from the key intervals, so
planning is O(length) tensor arithmetic plus O(cp_size) small searches; plans are cached.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parallel_state.errors import ParallelStateTypeError, ParallelStateValueError
from parallel_state.topology.attention_mask import AttentionMask, as_int
from parallel_state.topology.shards import shard_sizes

if TYPE_CHECKING:
    import torch

METHODS = ("balanced", "contiguous")

Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class DispatchPlan:
    """Which global tokens each of ``cp_size`` ranks holds for a masked sequence; build it with ``plan_dispatch``.

    ``runs[r]``: rank r's tokens as ascending, non-adjacent ``(start, stop)`` runs; rank r holds them
    in that order (``positions[r]``). ``work[r]``: the allowed (query, key) pairs of rank r's queries.
    Equal by value, hashable, the same on every rank for the same arguments.
    """

    mask: AttentionMask
    length: int
    cp_size: int
    method: str
    runs: tuple[Runs, ...]
    work: tuple[int, ...]

    def __post_init__(self) -> None:
        # Cheap consistency checks (O(runs)), so a hand-built plan cannot send tokens twice or lose some.
        what = "DispatchPlan"
        if not isinstance(self.mask, AttentionMask):
            raise ParallelStateTypeError(f"{what}: mask must be an AttentionMask, got {type(self.mask).__name__}")
        if self.method not in METHODS:
            raise ParallelStateValueError(f"{what}: method={self.method!r} is not one of {METHODS}")
        if not (len(self.runs) == len(self.work) == self.cp_size >= 1):
            raise ParallelStateValueError(f"{what}: cp_size={self.cp_size} needs that many runs and work entries, got "
                                          f"{len(self.runs)} and {len(self.work)}; build plans with plan_dispatch")
        every = []
        for rank, runs in enumerate(self.runs):
            if not runs or any(not 0 <= a < b <= self.length for a, b in runs) or any(
                    x[1] >= y[0] for x, y in zip(runs, runs[1:], strict=False)):
                raise ParallelStateValueError(f"{what}: rank {rank}'s runs {runs} must be non-empty, ascending, "
                                              f"separate (start, stop) pairs within [0, {self.length}); build plans "
                                              f"with plan_dispatch")
            every += runs
        every.sort()
        if every[0][0] != 0 or every[-1][1] != self.length or any(
                x[1] != y[0] for x, y in zip(every, every[1:], strict=False)):
            raise ParallelStateValueError(f"{what}: the ranks' runs must cover every token of [0, {self.length}) "
                                          f"exactly once; build plans with plan_dispatch")

    @functools.cached_property
    def positions(self) -> tuple[tuple[int, ...], ...]:
        """Rank r holds global tokens ``positions[r]``, ascending; together a permutation of ``range(length)``."""
        return tuple(tuple(p for start, stop in runs for p in range(start, stop)) for runs in self.runs)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each rank's token count (``shard_sizes(length, cp_size)`` for both methods)."""
        return tuple(sum(stop - start for start, stop in runs) for runs in self.runs)

    @property
    def balance(self) -> float:
        """``max(work) / mean(work)``: 1.0 is perfectly even; the step waits for the busiest rank."""
        return max(self.work) * self.cp_size / sum(self.work)

    @property
    def is_contiguous(self) -> bool:
        """Whether rank r holds the r-th contiguous block (the tensor_split layout), so no reordering is needed."""
        return all(len(runs) == 1 for runs in self.runs)

    def index(self, rank: int, device: Any = None) -> torch.Tensor:
        """Rank ``rank``'s global positions as an int64 tensor (for ``index_select`` and positional inputs)."""
        import torch

        rank = self._rank(rank)
        return torch.cat([torch.arange(start, stop, dtype=torch.int64, device=device)
                          for start, stop in self.runs[rank]])

    def owner(self, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[length]`` tensors ``(rank, offset)``: global token p is ``offset[p]``-th on rank ``rank[p]``."""
        import torch

        rank = torch.empty(self.length, dtype=torch.int64, device=device)
        offset = torch.empty(self.length, dtype=torch.int64, device=device)
        for r, runs in enumerate(self.runs):
            at = 0
            for start, stop in runs:
                rank[start:stop] = r
                offset[start:stop] = torch.arange(at, at + stop - start, dtype=torch.int64, device=device)
                at += stop - start
        return rank, offset

    def pairs(self) -> tuple[tuple[int, ...], ...]:
        """``pairs()[r][s]``: allowed (query, key) pairs with the query on rank r and the key on rank s.

        Row sums are ``work``; a zero means rank r needs nothing of rank s's K/V. O(length x cp_size).
        """
        import torch

        rank, _ = self.owner()
        counts = torch.zeros(self.length + 1, self.cp_size, dtype=torch.int64)
        counts[1:].scatter_(1, rank[:, None], 1)
        counts = counts.cumsum(0)  # counts[x, s]: tokens of rank s before position x
        lo, hi = self.mask.key_range(torch.arange(self.length), self.length)
        per_query = counts[hi] - counts[lo]  # [length, cp]: keys of each rank each query may see
        out = torch.zeros(self.cp_size, self.cp_size, dtype=torch.int64)
        out.index_add_(0, rank, per_query)
        return tuple(tuple(row) for row in out.tolist())

    def fingerprint(self) -> int:
        """A 63-bit digest of the plan, the same in every process (``hash`` is salted per process): for checking
        that every rank of a group holds the same plan."""
        text = repr((str(self.mask), self.length, self.cp_size, self.method, self.runs))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1

    def describe(self) -> str:
        """One line: method, mask, balance and runs per rank."""
        most = max(len(r) for r in self.runs)
        return (f"{self.method} plan of {self.length} tokens ({self.mask.describe()}) over {self.cp_size} ranks: "
                f"{min(self.sizes)}-{max(self.sizes)} tokens and at most {most} run{'s' * (most != 1)} per rank, "
                f"work max/mean {self.balance:.4f}")

    def _rank(self, rank: Any) -> int:
        rank = as_int("DispatchPlan", "rank", rank)
        if not 0 <= rank < self.cp_size:
            raise ParallelStateValueError(f"DispatchPlan: rank {rank} is out of range for a plan of cp_size "
                                          f"{self.cp_size} (0..{self.cp_size - 1})")
        return rank


def plan_dispatch(mask: AttentionMask, length: int, cp_size: int, *, method: str = "balanced") -> DispatchPlan:
    """Assign the ``length`` tokens of a sequence under ``mask`` to ``cp_size`` ranks.

    ``method="balanced"`` (default): the same token counts as the contiguous split, work as even as
    the mask allows, two contiguous runs per rank for causal kinds (see the module doc).
    ``method="contiguous"``: rank r holds the r-th block of ``shard_sizes(length, cp_size)``, the
    layout of ``cp.split_inputs_cp(..., uneven=True)``. Deterministic and cached. TypeError /
    ValueError subclasses for a non-mask, a bad length (packed segments must sum to it), a cp size
    below one or above the length, or an unknown method.
    """
    if not isinstance(mask, AttentionMask):
        raise ParallelStateTypeError(f"plan_dispatch: mask must be an AttentionMask (cp.Mask), got "
                                     f"{type(mask).__name__}; build one with AttentionMask.causal(), ...")
    length = mask.check_length(length)
    cp_size = as_int("plan_dispatch", "cp_size", cp_size)
    if not 1 <= cp_size <= length:
        raise ParallelStateValueError(f"plan_dispatch: cp_size={cp_size} must be between 1 and the length {length} "
                                      f"(every rank holds at least one token)")
    if method not in METHODS:
        raise ParallelStateValueError(f"plan_dispatch: method={method!r} is not one of {METHODS}")
    return _plan(mask, length, cp_size, method)


@functools.lru_cache(maxsize=64)
def _plan(mask: AttentionMask, length: int, cp_size: int, method: str) -> DispatchPlan:
    import torch

    sizes = shard_sizes(length, cp_size)
    prefix = torch.zeros(length + 1, dtype=torch.int64)
    torch.cumsum(mask.widths(length), 0, out=prefix[1:])
    cut = [0]
    for n in sizes:
        cut.append(cut[-1] + n)
    contiguous = tuple(((cut[r], cut[r + 1]),) for r in range(cp_size))
    candidates = [contiguous]
    if method == "balanced" and cp_size > 1:
        candidates.append(_zigzag(mask, length, sizes, prefix))
    best, best_work = None, None
    for runs in candidates:  # the contiguous split first: it wins ties
        work = tuple(sum(int(prefix[stop] - prefix[start]) for start, stop in rank) for rank in runs)
        if best_work is None or max(work) < max(best_work):
            best, best_work = runs, work
    assert best is not None and best_work is not None
    return DispatchPlan(mask=mask, length=length, cp_size=cp_size, method=method, runs=best, work=best_work)


def _pieces(mask: AttentionMask, length: int, cp_size: int, prefix: torch.Tensor) -> list[tuple[int, int]]:
    """The sequence cut into pieces and sorted, stably, by mean keys per query: the order the zigzag walks.

    Pieces never cross a segment; inside one they are whole chunks (key counts are constant in a
    chunk), merged up to at least ``length / (4 cp)`` tokens so that a sort across segments cannot
    scatter a rank into many small runs.
    """
    least = max(1, -(-length // (4 * cp_size)))
    bounds = mask.segment_bounds(length)
    pieces = []
    for seg_start, seg_end in zip(bounds[:-1], bounds[1:], strict=True):
        if mask.kind in ("full", "packed") and mask.chunk is None:
            step = seg_end - seg_start  # one key count throughout the segment
        else:
            chunk = mask.chunk or 1
            step = chunk * max(1, -(-least // chunk))
        pieces += [(s, min(s + step, seg_end)) for s in range(seg_start, seg_end, step)]

    def mean(piece: tuple[int, int]) -> float:
        start, stop = piece
        return int(prefix[stop] - prefix[start]) / (stop - start)

    return sorted(pieces, key=mean)


def _zigzag(mask: AttentionMask, length: int, sizes: tuple[int, ...], prefix: torch.Tensor) -> tuple[Runs, ...]:
    """Rank by rank, ``x`` tokens from the low end of the sorted order and ``n - x`` from the high end (module doc)."""
    import torch

    pieces = _pieces(mask, length, len(sizes), prefix)
    widths = prefix[1:] - prefix[:-1]
    # Slices and one cat, no gather: indexing ops are the slow ones on a busy CPU.
    vprefix = torch.zeros(length + 1, dtype=torch.int64)
    torch.cumsum(torch.cat([widths[start:stop] for start, stop in pieces]), 0, out=vprefix[1:])
    vstarts = [0]
    for start, stop in pieces:
        vstarts.append(vstarts[-1] + stop - start)

    def real(vlo: int, vhi: int) -> list[tuple[int, int]]:
        """The sequence runs under the sorted order's range [vlo, vhi)."""
        out = []
        i = bisect.bisect_right(vstarts, vlo) - 1
        while vlo < vhi:
            start, stop = pieces[i]
            take = min(vhi, vstarts[i + 1]) - vlo
            first = start + vlo - vstarts[i]
            out.append((first, first + take))
            vlo += take
            i += 1
        return out

    lo, hi = 0, length
    ranges: list[list[tuple[int, int]]] = []
    for left, n in zip(range(len(sizes), 1, -1), sizes[:-1], strict=True):
        target = float(vprefix[hi] - vprefix[lo]) / left  # an even share of what is left
        # work[x]: x tokens from the low end and n - x from the high end.
        work = (vprefix[lo:lo + n + 1] - vprefix[lo]) + (vprefix[hi] - vprefix[hi - n:hi + 1])
        take = int(torch.argmin((work.double() - target).abs()))  # the first best: deterministic
        ranges.append(real(lo, lo + take) + real(hi - n + take, hi))
        lo, hi = lo + take, hi - n + take
    ranges.append(real(lo, hi))
    return tuple(_merge(r) for r in ranges)


def _merge(runs: list[tuple[int, int]]) -> Runs:
    """Sorted, with touching runs joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in runs if r[1] > r[0]):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


__all__ = ["METHODS", "DispatchPlan", "plan_dispatch"]
