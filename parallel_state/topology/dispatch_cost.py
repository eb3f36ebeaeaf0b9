"""The cost model ``plan_dispatch`` chooses by: a layout's and a transport's predicted step time, from a few rates.

Two small values state the inputs: ``CostRates``, what one rank does per millisecond (given by the
user, or measured once on the group by ``cp.measure_rates``), and ``AttentionShape``, the attention
(heads, head dim, element type, batch, forward only or forward and backward). ``predict`` prices one
layout (each rank's token runs and its attention work) under one transport.

The model, for ``n = u * r`` cp ranks (``u`` the Ulysses size; ring block ``j`` is cp ranks
``j*u .. j*u+u-1`` and holds the union of their tokens; ``u = 1``: each rank is a block), with ``H``
/ ``K`` q / K/V heads, ``D`` the head dim, ``e`` the element size, ``B`` the batch and ``P = 3`` passes
with backward (K/V forward; K/V again and dK/dV back in backward), ``P = 1`` without::

    compute_j = B * H * W_j * F / (u * flops_per_ms)      W_j: allowed (query, key) pairs of block j's queries
                                                          F = 4 D forward, 14 D with backward (2.5x forward)
    stretch   = max(1, n * mean_j compute_j / (parallel * max_j compute_j))   only `parallel` ranks compute at once
    xfer_j    = P * recv_j * 2 K D e B / (u * bytes_per_ms)   recv_j: tokens of other blocks block j receives
    cost_c    = a2a_c + P * msgs_j * latency_ms + c + x - o * min(c, x),  c = stretch * compute_j, x = xfer_j
    predicted_ms = max over cp ranks c (of block j) of cost_c

``o`` is ``overlap`` for "p2p" and "ring" (the next block's transfer runs under this block's compute)
and 0 for "allgather" (it gathers before it computes). ``a2a_c`` (``u > 1``) is Ulysses' all-to-all
of rank c's ``s_c`` tokens, ``P' * s_c (2H + 2K) D e B (u - 1) / (u * bytes_per_ms) + P' * latency_ms``
with ``P' = 2`` with backward, the same for every transport. Per transport (``Transport``, a closed set: a
member equals its string, so "p2p" names ``Transport.P2P`` wherever a transport is asked for):

- "p2p": block j receives from block i the tokens of i that some query of j may see (the mask's
  cover), one message per block i that has any: today's masked path.
- "ring": K/V pass to the neighbour; block i travels as far round the ring as its farthest reader,
  so j receives i's whole block when ``0 < (j - i) mod r <= reach_i``; every block waits for every
  step (``msgs = max reach``). On the contiguous split of a causal mask nothing travels backwards.
- "allgather": every block receives every other block's tokens in one collective
  (``msgs = ceil(log2 r)``): the fewest messages, the most bytes.

Pure arithmetic on a few numbers per rank: the token runs come from the layouts, the key intervals
from ``AttentionMask.key_range`` at each run's first and last query (a run's queries see one
interval: every kind's ``lo`` and ``hi`` never decrease and each query sees itself).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from parallel_state.errors import ParallelStateTypeError, ParallelStateValueError
from parallel_state.topology.attention_mask import as_int
from parallel_state.topology.dispatch_layout import TRANSPORTS, Layout, Runs, Transport, merged

if TYPE_CHECKING:
    from parallel_state.topology.attention_mask import AttentionMask

#: Bytes per element of the dtypes a plan is usually sized for, by name (a torch.dtype works too).
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

#: FLOPs of one allowed (query, key) pair of one head, per head-dim element: QK^T and PV forward (4);
#: with backward 2.5 times that again (recomputed scores, dV, dP, dQ, dK), 14 in all.
FLOPS_FORWARD, FLOPS_TRAINING = 4, 14


def itemsize(what: str, dtype: Any) -> int:
    """Bytes per element of ``dtype``: a torch.dtype, its name ("bfloat16") or the size in bytes."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    if isinstance(dtype, str):
        if dtype not in ITEMSIZE:
            raise ParallelStateValueError(f"{what}: unknown dtype name {dtype!r}; use one of {sorted(ITEMSIZE)}, "
                                          f"a torch.dtype or the element size in bytes")
        return ITEMSIZE[dtype]
    if isinstance(getattr(dtype, "itemsize", None), int):
        return dtype.itemsize
    raise ParallelStateTypeError(f"{what}: dtype must be a torch.dtype, a dtype name or an int byte size, "
                                 f"got {type(dtype).__name__} {dtype!r}")


def _rate(what: str, name: str, value: Any, low: float = 0.0, high: float = math.inf, open_low: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParallelStateTypeError(f"{what}: {name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (low < value if open_low else low <= value) or not value <= high or not math.isfinite(value):
        bound = f"> {low:g}" if open_low else f">= {low:g}"
        rng = bound if high == math.inf else f"{bound} and <= {high:g}"
        raise ParallelStateValueError(f"{what}: {name}={value!r} must be finite and {rng}")
    return value


@dataclass(frozen=True)
class CostRates:
    """What one rank does per millisecond: the rates of ``plan_dispatch``'s cost model (see ``dispatch_cost``).

    The defaults are one GPU of an 8-GPU NVLink node (H100 / H200 class) running bfloat16 flash
    attention: ``flops_per_ms`` 2.5e11 (250 TFLOP/s over forward and backward, counting
    ``FLOPS_TRAINING * head_dim`` per allowed pair and head), ``bytes_per_ms`` 2e8 (200 GB/s received
    per GPU), ``latency_ms`` 0.02 (20 us per message or collective step, launch and wait included),
    ``overlap`` 1 (copy engines move K/V while the SMs compute), ``parallel`` None (every rank has
    its own device). ``cp.measure_rates(group, ...)`` measures all five on a group.
    """

    flops_per_ms: float = 2.5e11
    bytes_per_ms: float = 2.0e8
    latency_ms: float = 0.02
    #: Share of a transfer's time hidden behind compute (0: none, as on CPU ranks whose cores copy the bytes).
    overlap: float = 1.0
    #: How many of the group's ranks compute at once (None: all; 2 for 4 ranks sharing 2 cores).
    parallel: float | None = None

    def __post_init__(self) -> None:
        what = "CostRates"
        for name in ("flops_per_ms", "bytes_per_ms"):
            object.__setattr__(self, name, _rate(what, name, getattr(self, name)))
        object.__setattr__(self, "latency_ms", _rate(what, "latency_ms", self.latency_ms, open_low=False))
        object.__setattr__(self, "overlap", _rate(what, "overlap", self.overlap, 0.0, 1.0, open_low=False))
        if self.parallel is not None:
            object.__setattr__(self, "parallel", _rate(what, "parallel (ranks computing at once)", self.parallel))

    def describe(self) -> str:
        """One line: the rates with their units."""
        par = "every rank" if self.parallel is None else f"{self.parallel:.2f} ranks"
        return (f"{self.flops_per_ms / 1e9:.3g} GFLOP/ms, {self.bytes_per_ms / 1e6:.3g} MB/ms, {self.latency_ms:.3g} "
                f"ms per message, overlap {self.overlap:.2f}, {par} computing at once")


@dataclass(frozen=True)
class AttentionShape:
    """The attention a plan is priced for: ``heads`` q heads (``kv_heads`` K/V heads, default ``heads``) of
    ``head_dim``, elements of ``dtype`` (a name, a torch.dtype or bytes), ``batch`` sequences, and whether
    a step runs the backward too (training) or the forward only (inference)."""

    heads: int = 24
    head_dim: int = 128
    kv_heads: int | None = None
    dtype: Any = "bfloat16"
    batch: int = 1
    backward: bool = True

    def __post_init__(self) -> None:
        what = "AttentionShape"
        for name in ("heads", "head_dim", "batch"):
            value = as_int(what, name, getattr(self, name))
            if value < 1:
                raise ParallelStateValueError(f"{what}: {name} must be >= 1, got {value}")
            object.__setattr__(self, name, value)
        kv = self.heads if self.kv_heads is None else as_int(what, "kv_heads", self.kv_heads)
        if kv < 1 or self.heads % kv:
            raise ParallelStateValueError(f"{what}: kv_heads={kv} must be >= 1 and divide heads={self.heads} "
                                          f"(grouped-query attention)")
        object.__setattr__(self, "kv_heads", kv)
        if not isinstance(self.backward, bool):
            raise ParallelStateTypeError(f"{what}: backward must be a bool, got {self.backward!r}")
        itemsize(what, self.dtype)  # checked here, once

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return itemsize("AttentionShape", self.dtype)

    @property
    def pair_flops(self) -> int:
        """FLOPs of one allowed (query, key) pair over every head and batch element, for one step."""
        return self.batch * self.heads * (FLOPS_TRAINING if self.backward else FLOPS_FORWARD) * self.head_dim


def checked(what: str, rates: Any, shape: Any) -> tuple[CostRates, AttentionShape]:
    """``rates`` and ``shape`` with None as the defaults (a GPU node, ``AttentionShape()``); TypeError naming a
    value of another type."""
    rates = CostRates() if rates is None else rates
    if not isinstance(rates, CostRates):
        raise ParallelStateTypeError(f"{what}: rates must be a CostRates (or None: a GPU node's defaults), got "
                                     f"{type(rates).__name__}; cp.measure_rates(group) measures a group's")
    shape = AttentionShape() if shape is None else shape
    if not isinstance(shape, AttentionShape):
        raise ParallelStateTypeError(f"{what}: shape must be an AttentionShape (or None: the default), got "
                                     f"{type(shape).__name__}")
    return rates, shape


@dataclass(frozen=True)
class Candidate:
    """One priced (layout, transport): the predicted step time and its parts, for the rank predicted slowest."""

    method: Layout
    transport: Transport
    predicted_ms: float
    compute_ms: float       #: that rank's compute (stretched when ranks share cores)
    comm_ms: float          #: its transfers, messages and all-to-all, before overlap
    balance: float          #: max / mean attention work over the cp ranks
    recv_tokens: int        #: most K/V tokens a ring block receives per forward

    def row(self) -> str:
        return (f"{self.method}/{self.transport} {self.predicted_ms:.3g} ms (compute {self.compute_ms:.3g}, "
                f"comm {self.comm_ms:.3g}, work max/mean {self.balance:.3f})")


def needs(mask: AttentionMask, length: int, blocks: Sequence[Sequence[tuple[int, int]]]) -> list[list[int]]:
    """``needs[j][i]``: tokens of block i that some query of block j may see (the mask's cover of j's queries).

    ``blocks[j]``: block j's token runs. Interval arithmetic: a run's queries see one interval. Cached
    (a layout is priced under several transports).
    """
    return [list(row) for row in _needs(mask, length, tuple(tuple(map(tuple, b)) for b in blocks))]


@functools.lru_cache(maxsize=256)
def _needs(mask: AttentionMask, length: int, blocks: tuple[tuple[tuple[int, int], ...], ...]
           ) -> tuple[tuple[int, ...], ...]:
    import torch

    runs = [merged(b) for b in blocks]
    ends = torch.tensor([p for b in runs for start, stop in b for p in (start, stop - 1)], dtype=torch.int64)
    lo, hi = (t.tolist() for t in mask.key_range(ends, length))
    owned = sorted((start, stop, i) for i, b in enumerate(runs) for start, stop in b)
    starts = [o[0] for o in owned]
    out, at = [], 0
    for b in runs:
        cover = merged([(lo[at + 2 * k], hi[at + 2 * k + 1]) for k in range(len(b))])
        at += 2 * len(b)
        row = [0] * len(runs)
        for x, y in cover:
            k = max(0, bisect.bisect_right(starts, x) - 1)
            while k < len(owned) and owned[k][0] < y:
                start, stop, i = owned[k]
                row[i] += max(0, min(stop, y) - max(start, x))
                k += 1
        out.append(tuple(row))
    return tuple(out)


def received(mask: AttentionMask, length: int, blocks: Sequence[Sequence[tuple[int, int]]],
             transport: Transport) -> tuple[list[int], list[int]]:
    """Per block (its token runs): the tokens of other blocks it receives per forward under ``transport``, and
    its messages (the module doc's rules)."""
    r = len(blocks)
    if r == 1:
        return [0], [0]
    tokens = [sum(b - a for a, b in blk) for blk in blocks]
    if transport is Transport.ALLGATHER:
        return [sum(tokens) - t for t in tokens], [math.ceil(math.log2(r))] * r
    need = needs(mask, length, blocks)
    if transport is Transport.P2P:
        return ([sum(row[i] for i in range(r) if i != j) for j, row in enumerate(need)],
                [sum(1 for i in range(r) if i != j and row[i]) for j, row in enumerate(need)])
    if transport is not Transport.RING:  # a plain string here would be priced as the ring: callers pass members
        raise ParallelStateTypeError(f"received: transport must be a Transport member, got {transport!r}")
    reach = [max([(j - i) % r for j in range(r) if j != i and need[j][i]], default=0) for i in range(r)]
    return [sum(tokens[i] for i in range(r) if 0 < (j - i) % r <= reach[i]) for j in range(r)], [max(reach)] * r


def predict(mask: AttentionMask, length: int, runs: Sequence[Runs], work: Sequence[int], method: Layout,
            transport: Transport, rates: CostRates, shape: AttentionShape, ulysses_size: int = 1) -> Candidate:
    """The predicted step time of the layout ``runs`` (cp rank c holds ``runs[c]``, ``work[c]`` pairs) under
    ``transport`` (the module doc's model, stated exactly there)."""
    n, u = len(runs), ulysses_size
    r = n // u
    blocks = [[run for c in range(j * u, (j + 1) * u) for run in runs[c]] for j in range(r)]
    sizes = [sum(b - a for a, b in rank) for rank in runs]
    passes = 3 if shape.backward else 1
    e = shape.itemsize
    kv_token = 2 * shape.kv_heads * shape.head_dim * e * shape.batch  # K and V of one token, all K/V heads
    compute = [sum(work[j * u:(j + 1) * u]) * shape.pair_flops / (u * rates.flops_per_ms) for j in range(r)]
    busiest = max(compute)
    parallel = n if rates.parallel is None else min(float(n), rates.parallel)
    stretch = max(1.0, u * sum(compute) / (parallel * busiest)) if busiest > 0 else 1.0
    recv, msgs = received(mask, length, blocks, transport)
    overlap = 0.0 if transport is Transport.ALLGATHER else rates.overlap
    worst: tuple[float, float, float] = (-1.0, 0.0, 0.0)
    for c in range(n):
        j = c // u
        a2a = 0.0
        if u > 1:
            a2a_passes = 2 if shape.backward else 1
            a2a_bytes = sizes[c] * (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * e * shape.batch
            a2a = a2a_passes * (a2a_bytes * (u - 1) / u / rates.bytes_per_ms + rates.latency_ms)
        x = passes * recv[j] * kv_token / (u * rates.bytes_per_ms)
        comp = stretch * compute[j]
        fixed = a2a + passes * msgs[j] * rates.latency_ms
        cost = fixed + comp + x - overlap * min(comp, x)
        if cost > worst[0]:
            worst = (cost, comp, fixed + x)
    mean = sum(work) / n
    return Candidate(method=method, transport=transport, predicted_ms=worst[0], compute_ms=worst[1],
                     comm_ms=worst[2], balance=max(work) / mean if mean else 1.0, recv_tokens=max(recv))


__all__ = ["ITEMSIZE", "TRANSPORTS", "AttentionShape", "Candidate", "CostRates", "Transport", "checked", "itemsize",
           "needs", "predict", "received"]
