"""Which K/V each rank of a masked attention needs, who sends it, and the tiles each rank computes.

Pure bookkeeping from a mask and a token layout (the global positions each group rank holds, in its
order); no communication. Built once per (layout, mask, rank) and cached.

Every mask kind lets a query at position p see exactly the keys lo(p) <= j < hi(p)
(``mask.key_range``). Hence, with a block's keys sorted by position, each query sees one contiguous
run of the block's columns, and everything below is interval arithmetic:

- Rank d needs key j iff j lies in some interval of d's queries (a difference array over the
  sequence gives this cover in O(length)). Rank s sends rank d only the tokens of s that d's cover
  holds, in ascending position; none at all when d's cover holds none of them.
- A received block is computed as tiles of query rows x a column range: a run of at least
  ``full_rows`` consecutive queries (in position order) with the same column interval is a fully
  allowed tile, computed without a mask; a run as long along a causal diagonal (one more column
  per row) is a square causal tile (the kernel's causal flag, no mask); shorter runs are grouped,
  up to ``tile_rows`` rows, into a tile over the union of their columns, with a mask built from
  the intervals. Queries that see none of the block's keys are in no tile.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from cp.kernels import Name, TileKind, mask_of


class Cover(Name):
    """How the tiles of a pass meet a rank's query rows (or a block's keys): whether their results are written or
    merged."""

    ONE_TILE = "one_tile"  # one tile holds every row in order: its result is the pass's
    RUNS = "runs"          # consecutive runs in order, each row in one: results concatenated
    ONCE = "once"          # every row in at most one tile (any order, some maybe in none): written at their rows
    MERGED = "merged"      # some row in several tiles: merged (the online softmax; gradients summed)


#: A run of at least this many queries with one key interval is a tile of its own, computed without a mask.
FULL_ROWS = 16
#: Shorter runs are grouped into masked tiles of at most about this many queries.
TILE_ROWS = 128
#: Schedules kept (each holds index tensors of about one rank's length).
CACHE_SIZE = 32

Rows = Any  # a slice of local query rows, or a LongTensor of them


@dataclass(frozen=True)
class Tile:
    """Queries ``rows`` (local indices) x the block's columns [c0, c1); lo/hi: each row's interval relative
    to c0 (masked tiles only). ``kind``: full (every pair allowed), causal (a square tile whose row i sees
    columns c0 .. c0 + i: the kernels' own causal flag; no mask is built) or masked."""

    rows: Rows
    c0: int
    c1: int
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    allowed: int  # allowed (query, key) pairs in the tile
    kind: TileKind

    @property
    def num_rows(self) -> int:
        r = self.rows
        return r.stop - r.start if isinstance(r, slice) else r.numel()

    def masked_out(self, device: torch.device) -> torch.Tensor | None:
        """Bool [rows, c1 - c0], True where the query must not see the key; None for a fully allowed tile."""
        return mask_of(self.lo, self.hi, self.num_rows, self.c1 - self.c0, self.kind, device)

    def to(self, device: torch.device) -> Tile:
        return Tile(_to(self.rows, device), self.c0, self.c1, _to(self.lo, device), _to(self.hi, device), self.allowed,
                    self.kind)


@dataclass(frozen=True)
class Block:
    """The K/V block this rank computes at one step: ``size`` tokens of group rank ``source`` (ascending
    positions), ``index`` the source's local indices of them (None: all of its tokens, in its order)."""

    source: int
    size: int
    index: torch.Tensor | None
    tiles: tuple[Tile, ...]

    @property
    def allowed(self) -> int:
        return sum(t.allowed for t in self.tiles)

    @functools.cached_property
    def column_cover(self) -> Cover:
        """How the block's keys meet its tiles (whether their dK/dV are written or summed)."""
        return _cover(self.size, [(t.c0, t.c1) for t in self.tiles])

    def to(self, device: torch.device) -> Block:
        return Block(self.source, self.size, _to(self.index, device), tuple(t.to(device) for t in self.tiles))


@dataclass(frozen=True)
class Send:
    """What this rank sends group rank ``dest`` at one step: ``size`` of its tokens, ``index`` (None: all)."""

    dest: int
    size: int
    index: torch.Tensor | None


@dataclass(frozen=True)
class Schedule:
    """One rank's part of a masked attention over n ranks: step t computes blocks[t] (from group rank
    rank - t; None when no query of this rank sees its tokens) and sends sends[t] (to rank + t)."""

    rank: int
    n: int
    local: int                          # tokens this rank holds
    sizes: tuple[int, ...]              # every rank's token count
    blocks: tuple[Block | None, ...]
    sends: tuple[Send | None, ...]      # sends[0] is None (a rank's own block is no transfer)
    needed: tuple[tuple[bool, ...], ...] = ()  # needed[d][s]: some query of rank d sees a key of rank s

    def ring_forwards(self, rank: int, t: int) -> bool:
        """Whether, passing whole blocks round the ring, group rank ``rank`` sends the block it holds at step t
        (group rank rank - t's) on to rank + 1: while a rank further down the ring still needs it."""
        n, s = self.n, (rank - t) % self.n
        return any(self.needed[(s + j) % n][s] for j in range(t + 1, n))

    @property
    def allowed(self) -> int:
        """Allowed (query, key) pairs of this rank's queries over all blocks."""
        return sum(b.allowed for b in self.blocks if b is not None)

    @functools.cached_property
    def row_cover(self) -> Cover:
        """How this rank's query rows meet the tiles of all its blocks (what the engine merges)."""
        return _cover(self.local, [t.rows for b in self.blocks if b is not None for t in b.tiles])

    def to(self, device: torch.device) -> Schedule:
        """The same schedule with its index tensors on ``device`` (where the attention's tensors are)."""
        return Schedule(self.rank, self.n, self.local, self.sizes,
                        tuple(None if b is None else b.to(device) for b in self.blocks),
                        tuple(None if s is None else Send(s.dest, s.size, _to(s.index, device)) for s in self.sends),
                        self.needed)


def _cover(count: int, spans: Sequence[Any]) -> Cover:
    """How ``count`` rows (or keys) meet ``spans`` in order: slices, index tensors or (start, stop) pairs."""
    bounds = [(s.start, s.stop) if isinstance(s, slice) else s for s in spans if not isinstance(s, torch.Tensor)]
    if len(bounds) == len(spans) and bounds and bounds[0][0] == 0 and bounds[-1][1] == count and all(
            a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False)):
        return Cover.ONE_TILE if len(bounds) == 1 else Cover.RUNS
    seen = torch.zeros(count + 1, dtype=torch.int64)
    for span in spans:
        if isinstance(span, torch.Tensor):
            seen.index_add_(0, span.cpu(), torch.ones(span.numel(), dtype=torch.int64))
        else:
            a, b = (span.start, span.stop) if isinstance(span, slice) else span
            seen[a:b] += 1
    return Cover.MERGED if count == 0 or int(seen.max()) > 1 else Cover.ONCE


def _to(x: Any, device: torch.device) -> Any:
    """An index tensor on ``device``; a slice or None as it is."""
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _as_rows(index: torch.Tensor) -> Rows:
    """A slice when the local rows are consecutive and ascending (a view, no copy), else the index."""
    first, count = int(index[0]), index.numel()
    if int(index[-1]) - first == count - 1 and (count == 1 or bool((index.diff() == 1).all())):
        return slice(first, first + count)
    return index


def _run_ends(continues: torch.Tensor, n: int) -> list[int]:
    """For each of n rows, where the run it starts ends (exclusive); ``continues[i]``: row i + 1 continues row i."""
    breaks = torch.cat([torch.nonzero(~continues).flatten() + 1, torch.tensor([n])])
    return breaks[torch.searchsorted(breaks, torch.arange(n), right=True)].tolist()


def _tiles(rows: torch.Tensor, clo: torch.Tensor, chi: torch.Tensor, full_rows: int, tile_rows: int) -> tuple[Tile, ...]:
    """Tiles over queries ``rows`` (in position order, each seeing at least one column) with column intervals.

    A run of at least ``full_rows`` queries with one interval is a full tile; a run as long whose
    intervals start together and end one column later per row (a causal diagonal) is a causal tile,
    after a full tile of the columns its first row sees before its own; the rest is grouped into
    masked tiles of about ``tile_rows`` rows.
    """
    n = rows.numel()
    if n == 0:
        return ()
    same_lo = clo[1:] == clo[:-1]
    same_end = _run_ends(same_lo & (chi[1:] == chi[:-1]), n)
    diag_end = _run_ends(same_lo & (chi[1:] == chi[:-1] + 1), n)

    def make(a: int, b: int) -> Tile:
        lo, hi = clo[a:b], chi[a:b]
        c0, c1 = int(lo.min()), int(hi.max())
        allowed = int((hi - lo).sum())
        if allowed == (b - a) * (c1 - c0):
            return Tile(_as_rows(rows[a:b]), c0, c1, None, None, allowed, TileKind.FULL)
        return Tile(_as_rows(rows[a:b]), c0, c1, lo - c0, hi - c0, allowed, TileKind.MASKED)

    def diagonal(a: int, b: int) -> list[Tile]:
        r, c0, first = b - a, int(clo[a]), int(chi[a]) - 1  # the first row sees c0 .. first
        out = [] if first == c0 else [Tile(_as_rows(rows[a:b]), c0, first, None, None, r * (first - c0), TileKind.FULL)]
        return out + [Tile(_as_rows(rows[a:b]), first, first + r, None, None, r * (r + 1) // 2, TileKind.CAUSAL)]

    tiles: list[Tile] = []
    pending: int | None = None  # first row of the masked tile being gathered
    i = 0
    while i < n:
        run, diag = same_end[i] - i, diag_end[i] - i
        if max(run, diag) >= full_rows:
            if pending is not None:
                tiles.append(make(pending, i))
                pending = None
            tiles.extend([make(i, i + run)] if run >= diag else diagonal(i, i + diag))
            i += max(run, diag)
            continue
        if pending is None:
            pending = i
        i += run
        if i - pending >= tile_rows:
            tiles.append(make(pending, i))
            pending = None
    if pending is not None:
        tiles.append(make(pending, n))
    return tuple(tiles)


def build(mask: Any, length: int, positions: Sequence[Sequence[int]], rank: int) -> Schedule:
    """Group rank ``rank``'s schedule for ``mask`` over a sequence of ``length`` tokens laid out as ``positions``
    (group rank i holds the global tokens positions[i], in that order), tiled by FULL_ROWS and TILE_ROWS."""
    full_rows, tile_rows = FULL_ROWS, TILE_ROWS
    n = len(positions)
    pos = [torch.as_tensor(p, dtype=torch.int64) for p in positions]
    lo_all, hi_all = mask.key_range(torch.cat(pos), length)
    bounds = [0]
    for p in pos:
        bounds.append(bounds[-1] + p.numel())
    lo = [lo_all[bounds[i]:bounds[i + 1]] for i in range(n)]
    hi = [hi_all[bounds[i]:bounds[i + 1]] for i in range(n)]
    order = [torch.argsort(p) for p in pos]
    spos = [p[o] for p, o in zip(pos, order, strict=True)]
    in_order = [bool((o == torch.arange(o.numel())).all()) for o in order]

    def cover(d: int) -> torch.Tensor:
        """Bool [length]: the keys some query of rank d may see."""
        diff = torch.zeros(length + 1, dtype=torch.int64)
        ones = torch.ones_like(lo[d])
        diff.index_add_(0, lo[d], ones).index_add_(0, hi[d], -ones)
        return diff.cumsum(0)[:length] > 0

    covers = [cover(d) for d in range(n)]
    mine = covers[rank]
    needed = tuple(tuple(bool(covers[d][pos[s]].any()) for s in range(n)) for d in range(n))
    row_lo, row_hi = lo[rank][order[rank]], hi[rank][order[rank]]
    blocks: list[Block | None] = []
    sends: list[Send | None] = [None]
    for t in range(n):
        s = (rank - t) % n
        sel = mine[spos[s]]
        keys = spos[s][sel]
        if keys.numel() == 0:
            blocks.append(None)
        else:
            clo, chi = torch.searchsorted(keys, row_lo), torch.searchsorted(keys, row_hi)
            seen = chi > clo
            tiles = _tiles(order[rank][seen], clo[seen], chi[seen], full_rows, tile_rows)
            index = None if bool(sel.all()) and in_order[s] else order[s][sel]
            blocks.append(Block(s, keys.numel(), index, tiles))
        if t:
            d = (rank + t) % n
            sel = covers[d][spos[rank]]
            count = int(sel.sum())
            sends.append(None if count == 0 else
                         Send(d, count, None if count == pos[rank].numel() and in_order[rank] else order[rank][sel]))
    return Schedule(rank, n, pos[rank].numel(), tuple(p.numel() for p in pos), tuple(blocks), tuple(sends), needed)


_cache: OrderedDict[Any, Schedule] = OrderedDict()
#: id(owner) -> (owner, {params: schedule}): a plan passed on every step is found without hashing it.
_by_id: dict[int, tuple[Any, dict[Any, Schedule]]] = {}


def cached(owner: Any, params: Any, make: Callable[[], Schedule]) -> Schedule:
    """The schedule for (``owner``, ``params``), which must determine it, built by ``make`` on the first call.

    ``owner`` is a value (a plan, equal by value): looked up by identity first, then by value, so
    the same plan object costs no hashing of its positions per call and an equal one no rebuild.
    """
    params = (params, FULL_ROWS, TILE_ROWS)
    entry = _by_id.get(id(owner))
    if entry is not None and entry[0] is owner and params in entry[1]:
        return entry[1][params]
    key = (owner, params)
    sched = _cache.get(key)
    if sched is None:
        sched = _cache[key] = make()
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    if entry is None or entry[0] is not owner:
        if len(_by_id) >= CACHE_SIZE:
            _by_id.clear()
        entry = _by_id[id(owner)] = (owner, {})  # holds the owner, so its id is not reused while listed
    entry[1][params] = sched
    return sched


def cached_on(owner: Any, params: Any, device: torch.device, build: Callable[[], Schedule]) -> Schedule:
    """``cached`` for a schedule on ``device``: ``build`` makes it on the CPU (once), and each other device gets a
    copy of that one with its index tensors moved there (once each)."""
    def make() -> Schedule:
        if device.type == "cpu":
            return build()
        return cached_on(owner, params, torch.device("cpu"), build).to(device)

    return cached(owner, (params, str(device)), make)


def clear() -> None:
    """Forget every cached schedule."""
    _cache.clear()
    _by_id.clear()
