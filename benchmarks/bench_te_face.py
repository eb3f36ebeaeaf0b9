"""Transformer Engine's face (``cp.transformer_engine.DotProductAttention``) beside the engine called directly.

The face's overhead: on 2 and 4 gloo ranks, forward + backward of ``DotProductAttention(...)(q, k, v, ...)``
as Cosmos and TE's CP test call it, beside the engine call the face makes, written out by hand with the same
plan (``cp.ring_attention`` / ``cp.ulysses_attention`` with ``plan=``: ``cp.plan_dual_chunk_swap`` for
position-dependent masks, the contiguous plan for no_mask) and the same output handling (``flatten(-2)``; thd:
zeros at padding). Both are timed in turns after a barrier, the slowest rank's time, median over repetitions;
overhead = the median over rounds of face / engine in the same round (1.00x: none; both share each round's
noise). The cases: Cosmos's self attention (bshd, no_mask, p2p), a causal sbhd layer (p2p, then all_gather),
a causal bshd layer over a2a, a packed thd batch with padding (padding_causal, p2p), and a tiny causal call
where the face's fixed cost per call shows most. All run in float32.

``python -m benchmarks te_face [-- --reps 21] [--worlds 2,4] [--threads 1]``
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.bench_attention import join
from benchmarks.faces import engine_call, face_vs_engine, per_call_us, thd_pack
from benchmarks.harness import spawn_measure, table


@dataclass(frozen=True)
class Case:
    """One face call: the format, TE's mask type, the comm type, [tokens per rank multiple, heads, head size]."""

    name: str
    qkv_format: str
    attn_mask_type: str
    comm: str
    tokens: int      # the whole sequence (thd: the padded pack)
    heads: int
    dim: int
    batch: int = 1


CASES = [
    Case("Cosmos self attention", "bshd", "no_mask", "p2p", 1024, 8, 16),
    Case("causal layer", "sbhd", "causal", "p2p", 1024, 8, 16),
    Case("causal layer", "sbhd", "causal", "all_gather", 1024, 8, 16),
    Case("causal layer", "bshd", "causal", "a2a", 1024, 8, 16),
    Case("packed clips, padded", "thd", "padding_causal", "p2p", 1024, 8, 16),
    Case("tiny causal call", "bshd", "causal", "p2p", 64, 4, 8),
]


def _measure(rank: int, world: int, store: str, opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch.distributed as dist

    join(rank, world, store, opts)
    rows = [_row(case, rank, world, dist.group.WORLD, opts) for case in CASES]
    dist.destroy_process_group()
    return rows if rank == 0 else None


def _row(case: Case, rank: int, world: int, group: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: the face and the engine call, checked equal, then timed in turns."""
    import torch

    import cp
    from cp.transformer_engine import DotProductAttention

    fmt, n, scale = case.qkv_format, case.tokens, case.dim ** -0.5
    g = torch.Generator().manual_seed(0)
    kwargs: dict[str, Any] = {}
    padding = None
    if fmt == "thd":
        kwargs, plan, padding = thd_pack(n, world, rank)
    else:
        mask = cp.Mask.full() if case.attn_mask_type == "no_mask" else cp.Mask.causal()
        transport = "allgather" if case.comm == "all_gather" else "p2p"
        plan = (cp.plan_dispatch(mask, n, world, method="contiguous", transport=transport)
                if mask == cp.Mask.full() else cp.plan_dual_chunk_swap(mask, n, world, transport=transport))
    s, h = {"sbhd": (0, 2), "bshd": (1, 2), "thd": (0, 1)}[fmt]
    shape = {"sbhd": (n, case.batch), "bshd": (case.batch, n), "thd": (n,)}[fmt] + (case.heads, case.dim)
    ins = [torch.randn(shape, generator=g).index_select(s, plan.index(rank)).requires_grad_(True) for _ in range(3)]
    grad = torch.randn(ins[0].shape[:-2] + (case.heads * case.dim,), generator=g)
    face = DotProductAttention(case.heads, case.dim, qkv_format=fmt, attn_mask_type=case.attn_mask_type)
    face.set_context_parallel_group(group, list(range(world)), None, case.comm)

    def by_face(q: Any, k: Any, v: Any) -> Any:
        return face(q, k, v, **kwargs)

    timed = face_vs_engine(case, by_face, engine_call(case.comm, group, plan, s, h, scale, padding), ins, grad, group,
                           opts)
    return {"ranks": world, "case": case.name, "format": fmt, "mask": case.attn_mask_type, "comm": case.comm,
            "shape": list(shape), **timed}


def fixed_cost_us(calls: int) -> tuple[float, float, float]:
    """The face's own work per call, in one process: microseconds per forward of the face with context parallelism
    off (a tiny bshd causal call: its key, lookup and reshape around torch's SDPA) and of that SDPA call alone,
    and the median over rounds of their difference (21 rounds of ``calls`` calls each, both in every round)."""
    import torch

    import cp
    from cp.transformer_engine import DotProductAttention

    q, k, v = (torch.randn(1, 16, 4, 8) for _ in range(3))
    face = DotProductAttention(4, 8, qkv_format="bshd")
    scale = 8 ** -0.5

    def sdpa() -> Any:
        return cp.sdpa_in_layout(q, k, v, seq_dim=1, head_dim=2, is_causal=True, scale=scale,
                                 enable_gqa=False).flatten(-2)

    return per_call_us(lambda: face(q, k, v), sdpa, calls)


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; the exit status is 1 when the run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_te_face", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", default="2,4", help="numbers of gloo ranks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--calls", type=int, default=500, help="calls per round of the fixed-cost measurement")
    args = parser.parse_args(argv)
    opts = {"reps": args.reps, "warmup": args.warmup, "threads": args.threads}
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            rows += spawn_measure(_measure, world, opts, timeout=900, prefix="bench_te_face")
    except Exception as exc:
        print(f"bench_te_face failed: {exc}", file=sys.stderr)
        return 1
    import torch

    torch.set_num_threads(args.threads)
    face_us, sdpa_us, own_us = fixed_cost_us(args.calls)
    overhead = table(
        "Transformer Engine's face beside the engine called directly with the same plan, float32, forward + backward",
        ["ranks", "case", "qkv_format", "attn_mask_type", "cp_comm_type", "global q shape", "face ms", "engine ms",
         "face / engine"],
        [[r["ranks"], r["case"], r["format"], r["mask"], r["comm"], "x".join(map(str, r["shape"])),
          f"{r['face_ms']:.2f}", f"{r['engine_ms']:.2f}", f"{r['overhead']:.2f}x"] for r in rows],
        [f"ms: median of {args.reps} repetitions in turns (slowest rank), {args.threads} thread(s) per rank; face / "
         f"engine: the median of each round's ratio; the face's output equals the engine call's bit for bit (checked "
         f"first)"])
    fixed = table(
        "The face's fixed cost per call, one process (context parallelism off), forward of a tiny bshd causal call",
        ["face us / call", "torch SDPA alone us / call", "the face's own us / call"],
        [[f"{face_us:.1f}", f"{sdpa_us:.1f}", f"{own_us:.1f}"]],
        [f"q, k, v [1, 16, 4, 8] float32, {args.threads} thread(s); medians of 21 rounds of {args.calls} calls of "
         f"each (the difference: the median of each round's)"])
    print(f"{overhead}\n{fixed}\n(bench_te_face took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
