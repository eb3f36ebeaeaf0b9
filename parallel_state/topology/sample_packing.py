"""The search behind ``plan_samples``: each sample's group size, and which block of that size it runs on.

Arithmetic on costs only (``cost(i, c)``: sample i's time on c ranks, in ms); ``sample_plan`` states the
problem and the cost model. Blocks of size ``c`` start at the multiples of ``c`` below ``world - c + 1``
(whole blocks only) and nest, so a rank's time is the sum of its samples' costs and the step is the
busiest rank's (``sample_plan``'s module doc says why no rank waits).

- ``Packing.fill``: heaviest sample first onto the block of its size whose busiest rank is least
  loaded (longest-processing-time list scheduling), then ``improve``: while a sample on the busiest
  rank can move to another block of its size, or swap with a lighter sample of its size there,
  leaving the receiving ranks below the busiest, do it (each move lowers the busiest rank or the
  number of ranks at that time).
- ``search``: for a target time ``T``, each sample takes its smallest allowed size with cost at most
  ``T`` (else its fastest); ``T`` sweeps geometrically from ``bottom`` to ``high``; from the best few
  packings a local search moves one sample of the busiest rank one allowed size up or down (a
  sample of each kind once: equal samples are interchangeable) while that shortens the step.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

#: Target times the sweep tries (geometric, both ends included), before the local search.
SWEEP = 32
#: The sweep starts at the anchors' best time over this: a rank's share of a step rarely needs smaller pieces.
SHARE = 8
#: The local search starts from this many of the sweep's best packings, with this many re-packings each.
STARTS, TRIALS = 3, 120
#: A change counts only if it shortens the busiest rank by more than this share (float noise is not a gain).
EPS = 1e-9

Cost = Callable[[int, int], float]


class Packing:
    """Each sample's size (``allot``) and block start (``start``), its cost (``ms``) and each rank's load."""

    __slots__ = ("allot", "load", "ms", "on", "start", "world")

    def __init__(self, world: int, count: int):
        self.world = world
        self.allot = [0] * count
        self.start = [0] * count
        self.ms = [0.0] * count
        self.load = [0.0] * world
        #: The samples whose block holds each rank.
        self.on: list[set[int]] = [set() for _ in range(world)]

    def copy(self) -> Packing:
        out = Packing.__new__(Packing)
        out.world, out.allot, out.start, out.ms = self.world, list(self.allot), list(self.start), list(self.ms)
        out.load, out.on = list(self.load), [set(s) for s in self.on]
        return out

    @property
    def top(self) -> float:
        """The busiest rank's time: the step's."""
        return max(self.load)

    def _blocks(self, c: int) -> range:
        return range(0, self.world - c + 1, c)

    def _peak(self, b: int, c: int) -> float:
        return self.load[b] if c == 1 else max(self.load[b:b + c])

    def _set(self, i: int, c: int, b: int, ms: float) -> None:
        self.allot[i], self.start[i], self.ms[i] = c, b, ms
        for r in range(b, b + c):
            self.load[r] += ms
            self.on[r].add(i)

    def add(self, i: int, c: int, ms: float) -> None:
        """Sample i on the block of size ``c`` whose busiest rank is least loaded (the first of equals)."""
        if c == 1:
            b = self.load.index(min(self.load))
        else:
            peaks = [max(self.load[b:b + c]) for b in self._blocks(c)]
            b = peaks.index(min(peaks)) * c
        self._set(i, c, b, ms)

    def remove(self, i: int) -> None:
        c, b, ms = self.allot[i], self.start[i], self.ms[i]
        for r in range(b, b + c):
            self.load[r] -= ms
            self.on[r].discard(i)

    def fill(self, allot: Sequence[int], cost: Cost) -> Packing:
        """Every sample at its size in ``allot``, heaviest first, then ``improve``; returns self."""
        ms = [cost(i, c) for i, c in enumerate(allot)]
        for i in sorted(range(len(allot)), key=lambda i: (-ms[i], -allot[i], i)):
            self.add(i, allot[i], ms[i])
        return self.improve()

    def improve(self) -> Packing:
        """Moves and swaps off the busiest rank while they keep the receiving ranks below it (module doc)."""
        for _ in range(4 * len(self.allot) + self.world):
            top = self.top
            limit = top * (1 - 1e-12)
            r = self.load.index(top)
            seen: set[tuple[float, int]] = set()
            for i in sorted(self.on[r], key=lambda i: (-self.ms[i], i)):
                c, a, ms = self.allot[i], self.start[i], self.ms[i]
                if (ms, c) in seen:  # an equal sample on this rank already found nothing
                    continue
                seen.add((ms, c))
                if self._move_or_swap(i, c, a, ms, limit):
                    break
            else:
                return self
        return self

    def _move_or_swap(self, i: int, c: int, a: int, ms: float, limit: float) -> bool:
        for b in self._blocks(c):
            if b != a and self._peak(b, c) + ms < limit:
                self.remove(i)
                self._set(i, c, b, ms)
                return True
        for b in self._blocks(c):
            room = limit - self._peak(b, c)
            if b == a or room <= 0:
                continue
            for j in sorted(self.on[b]):
                if self.allot[j] == c and self.start[j] == b and 0 < ms - self.ms[j] < room:
                    mj = self.ms[j]
                    self.remove(i)
                    self.remove(j)
                    self._set(i, c, b, ms)
                    self._set(j, c, a, mj)
                    return True
        return False


def allot(target: float, allowed: Sequence[Sequence[int]], cost: Cost, best: Callable[[int], int],
          kinds: Sequence[Hashable]) -> tuple[int, ...]:
    """Each sample's smallest allowed size whose cost is at most ``target``, else its fastest (``best``); once per
    kind of sample."""
    chosen: dict[Hashable, int] = {}
    for i, sizes in enumerate(allowed):
        if kinds[i] not in chosen:
            c = next((c for c in sizes if cost(i, c) <= target), None)
            chosen[kinds[i]] = best(i) if c is None else c
    return tuple(chosen[k] for k in kinds)


def search(world: int, allowed: Sequence[Sequence[int]], cost: Cost, kinds: Sequence[Hashable],
           anchors: Sequence[int]) -> tuple[Packing, int, float, float]:
    """The best packing found (module doc), how many packings were tried, and the sweep's two ends in ms.

    ``allowed[i]``: sample i's sizes, ascending; ``kinds[i]``: equal for interchangeable samples (the same
    mask and length); ``anchors``: samples whose best time bounds the step from below (the longest ones).
    """
    count = len(allowed)
    fastest: dict[int, int] = {}

    def best(i: int) -> int:
        if i not in fastest:
            fastest[i] = min(allowed[i], key=lambda c: (cost(i, c), c))
        return fastest[i]

    packed: dict[tuple[int, ...], Packing] = {}

    def pack(sizes: tuple[int, ...]) -> Packing:
        if sizes not in packed:
            packed[sizes] = Packing(world, count).fill(sizes, cost)
        return packed[sizes]

    smallest = tuple(sizes[0] for sizes in allowed)
    high = max(cost(i, c) for i, c in enumerate(smallest))
    bottom = max(cost(i, best(i)) for i in anchors) / SHARE
    targets = [bottom * (high / bottom) ** (k / SWEEP) for k in range(SWEEP + 1)] if high > bottom > 0 else [high]
    ranked = sorted({smallest, *(allot(t, allowed, cost, best, kinds) for t in targets)}, key=lambda a: (pack(a).top, a))
    winner = pack(ranked[0])
    tried = len(packed)
    for sizes in ranked[:STARTS]:
        found, n = _descend(pack(sizes), allowed, cost, kinds, TRIALS)
        tried += n
        if found.top < winner.top * (1 - EPS):
            winner = found
    return winner, tried, bottom, high


def _descend(p: Packing, allowed: Sequence[Sequence[int]], cost: Cost, kinds: Sequence[Hashable],
             budget: int) -> tuple[Packing, int]:
    """From ``p``, one sample of the busiest rank one allowed size up or down (re-placed, then ``improve``), while
    that shortens the step, in at most ``budget`` trials; the best packing and the trials used."""
    used = 0
    while used < budget:
        top = p.top
        r = p.load.index(top)
        seen: set[tuple[Hashable, int]] = set()
        better = None
        for i in sorted(p.on[r], key=lambda i: (-p.ms[i], i)):
            if (kinds[i], p.allot[i]) in seen:
                continue
            seen.add((kinds[i], p.allot[i]))
            sizes = allowed[i]
            at = sizes.index(p.allot[i])
            for j in (at + 1, at - 1):
                if 0 <= j < len(sizes) and used < budget:
                    used += 1
                    trial = p.copy()
                    trial.remove(i)
                    trial.add(i, sizes[j], cost(i, sizes[j]))
                    if trial.improve().top < top * (1 - EPS):
                        better = trial
                        break
            if better is not None:
                break
        if better is None:
            break
        p = better
    return p, used


__all__ = ["Packing", "allot", "search"]
