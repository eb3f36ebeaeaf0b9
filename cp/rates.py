"""``measure_rates``: the cost model's rates (``cp.CostRates``) measured once on a group, the same on every rank.

A few milliseconds of work on the attention's device, every rank of the group taking part:

- compute: a block of fused attention (``scaled_dot_product_attention``, forward and backward
  unless ``backward=False``) of 256 queries x 1,024 keys on every rank at once: ``flops_per_ms``;
- sharing: ``parallel``, how many ranks can compute at once, counted rather than timed (a timing of
  one rank alone is at the mercy of whatever else the machine runs): on CUDA the distinct devices
  of the group, on CPU per host the usable cores over each rank's torch threads (at most its ranks);
- transfer: each rank sends its neighbour a small and a large message (batch_isend_irecv, as the
  attention's transfers): ``latency_ms`` is the small one's time, ``bytes_per_ms`` the large one's
  extra bytes over its extra time;
- overlap: the large transfer started just before the block and waited for after it; ``overlap`` is
  the share of the shorter of the two that this hid (1 where copy engines move the bytes, near 0
  where the cores that compute also copy them, as on CPU ranks).

Every time is agreed as the median over the ranks of each rank's fastest repetition (one small
all-gather: a rank descheduled once does not set the group's rates), so every rank derives the same
rates and plans the same layout. Cached per (group, device, dtype, heads, head_dim, backward): a
second call is a lookup, no communication. Every rank of the group must call it (a collective).
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist

import parallel_state
from cp.comm import all_gather_into, backend_map, check_group, global_ranks, local_device, meta_device

#: Queries and keys of the timed block; message sizes in bytes (small; large on CPU and on a GPU).
QUERIES, KEYS = 256, 1024
SMALL_BYTES, LARGE_BYTES_CPU, LARGE_BYTES_GPU = 1024, 4 << 20, 16 << 20
#: Timed repetitions of each measurement (the fastest counts, after one untimed warm-up).
REPEATS = 5
_TAG = 15

#: (id(group), params) -> (group, rates): the group is held so that its id is not reused while listed.
_cache: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _device_of(group: Any, device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    if "cuda" in backend_map(group) and torch.cuda.is_available():
        return local_device("cuda")
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], Any], device: torch.device) -> float:
    """The fastest of REPEATS timed calls of ``fn`` (after one warm-up), in ms."""
    fn()
    _sync(device)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def measure_rates(group: Any, *, heads: int = 8, head_dim: int = 64, dtype: torch.dtype | None = None,
                  device: Any = None, backward: bool = True) -> Any:
    """The ``cp.CostRates`` of ``group``'s ranks for attention with ``heads`` x ``head_dim`` of ``dtype``
    (default bfloat16 on CUDA, float32 on CPU) on ``device`` (default: CUDA when the group has a CUDA
    backend and this process a GPU, else CPU), measured once and cached; the same value on every rank.

    Pass it to ``cp.plan_dispatch(..., rates=...)`` (with ``shape=cp.AttentionShape(...)`` of the real
    attention). ``backward``: time forward and backward (training) or the forward only. Every rank of
    the group must call it. TypeError for a non-group, ValueError for a group of one rank (nothing is
    sent: plan without rates) or sizes below one.
    """
    what = "measure_rates"
    check_group(group, what, "group")
    n, rank = group.size(), group.rank()
    if n < 2:
        raise ValueError(f"{what}: the group has {n} rank; rates of transfers need two or more (a plan for one "
                         f"rank sends nothing: leave rates out)")
    for name, value in (("heads", heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}: {name} must be an int >= 1, got {value!r}")
    dev = _device_of(group, device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    key = (id(group), str(dev), dtype, heads, head_dim, backward)
    hit = _cache.get(key)
    if hit is not None and hit[0] is group:
        return hit[1]
    rates = _measure(group, n, rank, dev, dtype, heads, head_dim, backward)
    _cache[key] = (group, rates)
    return rates


def _measure(group: Any, n: int, rank: int, dev: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
             backward: bool) -> Any:
    block = _attention_block(rank, dev, dtype, heads, head_dim, backward)
    large = LARGE_BYTES_GPU if dev.type == "cuda" else LARGE_BYTES_CPU
    start = _ring_exchange(group, n, rank, dev, large)

    def exchange(size: int) -> Callable[[], None]:
        def run() -> None:
            for w in start(size):
                w.wait()
        return run

    def both() -> None:
        works = start(large)
        block()
        for w in works:
            w.wait()

    dist.barrier(group=group)
    together = _best(block, dev)
    dist.barrier(group=group)
    small, big = _best(exchange(SMALL_BYTES), dev), _best(exchange(large), dev)
    dist.barrier(group=group)
    overlapped = _best(both, dev)
    mine = torch.tensor([together, small, big, overlapped, *_placement(dev)], dtype=torch.float64,
                        device=meta_device(group))
    every = torch.empty(n * mine.numel(), dtype=torch.float64, device=mine.device)
    all_gather_into(every, mine, group)
    return _rates(every.view(n, mine.numel()).cpu(), dev, large, heads, head_dim, backward)


def _attention_block(rank: int, dev: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                     backward: bool) -> Callable[[], None]:
    """The timed block: fused attention of QUERIES x KEYS on this rank's own random inputs (and its backward)."""
    g = torch.Generator(device="cpu").manual_seed(rank)
    q, k, v = (torch.randn(1, heads, s, head_dim, generator=g).to(dev, dtype) for s in (QUERIES, KEYS, KEYS))
    if backward:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def block() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if backward:
            out.sum().backward()

    return block


def _ring_exchange(group: Any, n: int, rank: int, dev: torch.device, large: int) -> Callable[[int], list[Any]]:
    """Starts this rank's send of a message of SMALL_BYTES or ``large`` bytes to the next rank and its receive from
    the previous one (buffers made once), as the attention's transfers go; returns the works."""
    ranks = global_ranks(group)
    to, frm = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    bufs = {size: (torch.zeros(size, dtype=torch.uint8, device=dev), torch.empty(size, dtype=torch.uint8, device=dev))
            for size in (SMALL_BYTES, large)}

    def start(size: int) -> list[Any]:
        send, recv = bufs[size]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to, group, _TAG),
                                       dist.P2POp(dist.irecv, recv, frm, group, _TAG)])

    return start


def _placement(dev: torch.device) -> tuple[float, float, float]:
    """This rank's (host, device slot, cores over threads), for ``ranks_at_once``."""
    host = zlib.crc32(socket.gethostname().encode())
    if dev.type == "cuda":  # ranks on one host sharing a device index share that GPU
        return host, float(dev.index or 0), 1.0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return host, 0.0, usable / max(1, torch.get_num_threads())


def _rates(rows: torch.Tensor, dev: torch.device, large: int, heads: int, head_dim: int, backward: bool) -> Any:
    """The group's ``CostRates`` from every rank's row (block, small, large and overlapped ms, then placement)."""
    together, small, big, overlapped = (float(rows[:, i].median()) for i in range(4))
    parallel = ranks_at_once(rows[:, 4:].tolist(), dev.type == "cuda")
    flops = parallel_state.AttentionShape(heads=heads, head_dim=head_dim, backward=backward).pair_flops * QUERIES * KEYS
    xfer = max(big - small, 1e-6)
    hidden = (together + big - overlapped) / max(min(together, big), 1e-6)
    return parallel_state.CostRates(
        flops_per_ms=flops / together, bytes_per_ms=(large - SMALL_BYTES) / xfer, latency_ms=small,
        overlap=min(1.0, max(0.0, hidden)), parallel=parallel)


def ranks_at_once(rows: list[list[float]], cuda: bool) -> float:
    """How many of the ranks compute at once, from each rank's (host, device slot, cores over threads)."""
    hosts: dict[float, list[list[float]]] = {}
    for row in rows:
        hosts.setdefault(row[0], []).append(row)
    if cuda:
        return float(sum(len({row[1] for row in ranks}) for ranks in hosts.values()))
    return float(sum(min(len(ranks), max(1.0, min(row[2] for row in ranks))) for ranks in hosts.values()))


def clear_rates() -> None:
    """Forget every measured rate (the next ``measure_rates`` measures again, on every rank)."""
    _cache.clear()


__all__ = ["clear_rates", "measure_rates"]
