"""What the face benchmarks share (bench_te_face, bench_megatron_face): a padded thd pack, the engine call a face
makes written out by hand, the face timed in turns beside it, and a face's own cost per call in one process."""

from __future__ import annotations

from typing import Any, Callable

from benchmarks.bench_attention import time_in_turns
from benchmarks.harness import median


def thd_bounds(tokens: int, world: int) -> tuple[list[int], list[int]]:
    """Three sequences filling ``tokens`` (rooms multiples of 2 x world), each but the last padded by a few."""
    unit = 2 * world
    rooms = [tokens // 2 // unit * unit, tokens // 4 // unit * unit]
    rooms.append(tokens - sum(rooms))
    lengths = [rooms[0] - 3, rooms[1] - 1, rooms[2]]
    return [sum(lengths[:i]) for i in range(4)], [sum(rooms[:i]) for i in range(4)]


def thd_pack(tokens: int, world: int, rank: int) -> tuple[dict[str, Any], Any, Any]:
    """A padded thd pack of ``tokens`` on ``world`` ranks: TE's cu_seqlens keywords, its DualChunkSwap plan (each
    sequence causal, padding a segment of its own) and this rank's padding tokens as a ``[t, 1, 1]`` bool."""
    import torch

    import cp

    real, padded = thd_bounds(tokens, world)
    cu, cu_padded = (torch.tensor(b, dtype=torch.int32) for b in (real, padded))
    kwargs = {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "cu_seqlens_q_padded": cu_padded,
              "cu_seqlens_kv_padded": cu_padded}
    lengths = [real[i + 1] - real[i] for i in range(3)]
    segments = [p for i in range(3) for p in (lengths[i], padded[i + 1] - padded[i] - lengths[i]) if p > 0]
    plan = cp.plan_dual_chunk_swap(cp.Mask.packed(segments, chunk=1), tokens, world, cu_seqlens=padded)
    keep = torch.zeros(tokens, dtype=torch.bool)
    for i in range(3):
        keep[padded[i]:padded[i] + lengths[i]] = True
    return kwargs, plan, (~keep)[plan.index(rank)].view(-1, 1, 1)


def engine_call(comm: str, group: Any, plan: Any, seq_dim: int, head_dim: int, scale: float,
                padding: Any = None) -> Callable[[Any, Any, Any], Any]:
    """The engine call a face makes for ``cp_comm_type=comm`` (p2p / all_gather: the ring with the plan's
    transport; a2a: Ulysses), with its output handling (zeros at ``padding``; heads and head size flattened)."""
    import cp

    def attend(q: Any, k: Any, v: Any) -> Any:
        if comm == "a2a":
            out = cp.ulysses_attention(q, k, v, group, plan=plan, seq_dim=seq_dim, head_dim=head_dim, scale=scale)
        else:
            out = cp.ring_attention(q, k, v, group, plan=plan, seq_dim=seq_dim, head_dim=head_dim,
                                    softmax_scale=scale)
        if padding is not None:
            out = out.masked_fill(padding, 0)
        return out.flatten(-2)

    return attend


def face_vs_engine(what: Any, by_face: Callable, by_engine: Callable, ins: list[Any], grad: Any, group: Any,
                   opts: dict[str, Any]) -> dict[str, float]:
    """Forward + backward of the face and of the engine call, checked equal bit for bit, then timed in turns:
    the medians in ms and the face's overhead (the median over rounds of face / engine in the same round, so
    both share each round's noise)."""
    import torch

    a, b = by_face(*ins), by_engine(*ins)
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: the face and the engine call differ by {(a - b).abs().max().item()}")
    times = time_in_turns({way: (lambda fn=fn: torch.autograd.grad(fn(*ins), ins, grad))
                           for way, fn in (("face", by_face), ("engine", by_engine))}, group, opts)
    return {"face_ms": median(times["face"]) * 1e3, "engine_ms": median(times["engine"]) * 1e3,
            "overhead": median([f / e for f, e in zip(times["face"], times["engine"], strict=True)])}


def per_call_us(face: Callable[[], Any], peer: Callable[[], Any], calls: int) -> tuple[float, float, float]:
    """Microseconds per call of ``face`` and of ``peer`` in this process, and the median over rounds of their
    difference: 21 rounds of ``calls`` calls of each, both in every round in alternating order, so both share
    each round's load."""
    import time

    runs: dict[str, list[float]] = {"face": [], "peer": []}
    ways = [("face", face), ("peer", peer)]
    for rnd in range(21):
        for name, fn in ways[rnd % 2:] + ways[:rnd % 2]:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            runs[name].append((time.perf_counter() - start) / calls * 1e6)
    return (median(runs["face"]), median(runs["peer"]),
            median([f - p for f, p in zip(runs["face"], runs["peer"], strict=True)]))
