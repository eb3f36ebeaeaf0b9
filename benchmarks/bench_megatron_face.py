"""megatron-core's core attention face (``cp.megatron.DotProductAttention``): its overhead, and a GPTModel step.

1. The face's overhead: on 2 and 4 gloo ranks, forward + backward of the face called as megatron-core's attention
   layer calls it (``core(q, k, v, attention_mask, attn_mask_type=..., attention_bias=None, packed_seq_params=...)``
   on ``[s, b, np, hn]``), beside the engine call it makes, written out by hand with the same plan
   (``cp.plan_dual_chunk_swap``: megatron-core's ``get_batch_on_this_cp_rank`` layout) and the same output handling.
   Timed in turns after a barrier, the slowest rank's time, median over repetitions; overhead = the median over
   rounds of face / engine in the same round. Cases: causal over p2p, all_gather and a2a, a chunk-causal ``mask=``,
   and a padded thd pack (``packed_seq_params``). Beside it, what the face adds per call to the Transformer
   Engine face it subclasses, in one process.
2. megatron-core's training step (benchmarks/megatron_gpt.py: ``get_batch_on_this_cp_rank``, the schedule of
   ``get_forward_backward_func()``, ``finalize_model_grads``) of one GPTModel from ``get_gpt_layer_local_spec()``
   on one sequence: at cp 1 with megatron-core's own attention (the peer) and with the face, at cp 2 and cp 4
   with the face (p2p and a2a). The slowest rank's step, median over repetitions.

Everything in float32 on CPU ranks (``--threads`` torch threads each).

``python -m benchmarks megatron_face [-- --reps 15] [--worlds 2,4] [--seq 2048]``
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.bench_attention import join, time_in_turns
from benchmarks.faces import engine_call, face_vs_engine, per_call_us, thd_pack
from benchmarks.harness import median, spawn_measure, table


@dataclass(frozen=True)
class Case:
    """One face call: its data ("causal", "chunk" for mask=cp.Mask.chunk_causal(64), "thd"), the comm type, sizes."""

    data: str
    comm: str
    tokens: int   # the whole sequence (thd: the padded pack)
    heads: int = 8
    dim: int = 16


CASES = [Case("causal", "p2p", 1024), Case("causal", "all_gather", 1024), Case("causal", "a2a", 1024),
         Case("chunk", "p2p", 1024), Case("thd", "p2p", 1024), Case("causal", "p2p", 64, 4, 8)]
CHUNK = 64


def _measure_face(rank: int, world: int, store: str, opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch.distributed as dist

    import parallel_state as ps

    join(rank, world, store, opts)
    ps.initialize_model_parallel(context_parallel_size=world)
    rows = [_face_row(case, rank, world, opts) for case in CASES]
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return rows if rank == 0 else None


def _face_row(case: Case, rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: the face and the engine call, checked equal, then timed in turns."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    import cp
    import cp.megatron
    import parallel_state as ps

    n, scale = case.tokens, case.dim ** -0.5
    group = ps.get_context_parallel_group()
    packed, padding, mask = None, None, None
    if case.data == "thd":
        kwargs, plan, padding = thd_pack(n, world, rank)
        packed = PackedSeqParams(qkv_format="thd", max_seqlen_q=n, max_seqlen_kv=n, **kwargs)
        shape = (n, case.heads, case.dim)
    else:
        mask = cp.Mask.chunk_causal(CHUNK) if case.data == "chunk" else None
        transport = "allgather" if case.comm == "all_gather" else "p2p"
        plan = cp.plan_dual_chunk_swap(mask or cp.Mask.causal(), n, world, transport=transport)
        shape = (n, 1, case.heads, case.dim)
    config = TransformerConfig(num_layers=1, hidden_size=case.heads * case.dim, num_attention_heads=case.heads,
                               context_parallel_size=world, attention_dropout=0.0)
    face = cp.megatron.DotProductAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type=case.comm,
                                           pg_collection=ps.process_group_collection(), mask=mask)
    g = torch.Generator().manual_seed(0)
    ins = [torch.randn(shape, generator=g).index_select(0, plan.index(rank)).requires_grad_(True) for _ in range(3)]
    grad = torch.randn(ins[0].shape[:-2] + (case.heads * case.dim,), generator=g)

    def by_face(q: Any, k: Any, v: Any) -> Any:  # as megatron-core's Attention.forward calls its core attention
        return face(q, k, v, None, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=packed)

    by_engine = engine_call(case.comm, group, plan, 0, 1 if case.data == "thd" else 2, scale, padding)
    return {"ranks": world, "data": case.data, "comm": case.comm, "shape": list(shape),
            **face_vs_engine(case, by_face, by_engine, ins, grad, group, opts)}


def own_cost_us(calls: int) -> tuple[float, float, float]:
    """What this face adds per call to the Transformer Engine face it subclasses, in one process: microseconds
    per forward of each, context parallelism off, on a tiny sbhd causal call as megatron-core's attention layer
    makes it, and the median over rounds of their difference."""
    import warnings
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    import cp.megatron
    from cp.transformer_engine import DotProductAttention

    warnings.simplefilter("ignore")
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0)
    face = cp.megatron.DotProductAttention(config, 1, AttnMaskType.causal, "self",
                                           pg_collection=SimpleNamespace(tp=None, cp=None, hcp=None))
    te = DotProductAttention(4, 8, qkv_format="sbhd", attn_mask_type="causal")
    q, k, v = (torch.randn(16, 1, 4, 8) for _ in range(3))
    return per_call_us(lambda: face(q, k, v, None, attn_mask_type=AttnMaskType.causal, attention_bias=None,
                                    packed_seq_params=None), lambda: te(q, k, v), calls)


#: The model-step rows: (ranks, attention, cp_comm_type).
STEPS = [(1, "megatron-core", None), (1, "cp.megatron", None), (2, "cp.megatron", "p2p"), (2, "cp.megatron", "a2a"),
         (4, "cp.megatron", "p2p"), (4, "cp.megatron", "a2a")]


def _measure_step(rank: int, world: int, store: str, opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The GPTModel step rows of this world size (cp = world), timed in turns."""
    import warnings

    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import cp.megatron
    import parallel_state as ps
    from benchmarks import megatron_gpt as mg

    warnings.simplefilter("ignore")
    join(rank, world, store, opts)
    ps.initialize_model_parallel(context_parallel_size=world)
    model = mg.Model(layers=2, hidden=128, heads=8, query_groups=8, seq=opts["seq"], dtype=torch.float32)
    batch = mg.global_batch(model, 1)
    steps, rows = {}, []
    for ranks, attention, comm in STEPS:
        if ranks != world:
            continue
        spec = get_gpt_layer_local_spec()
        if attention == "cp.megatron":
            spec = cp.megatron.swap_core_attention(spec)
        wrapped = mg.build(model, spec, dict(context_parallel_size=world, cp_comm_type=comm))
        steps[(attention, comm)] = lambda w=wrapped: mg.step(w, [batch])
    times = time_in_turns(steps, dist.group.WORLD, opts)
    for (attention, comm), t in times.items():
        rows.append({"ranks": world, "attention": attention, "comm": comm or "-", "tokens": opts["seq"],
                     "ms": median(t) * 1e3})
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return rows if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    """Measure and print both tables; the exit status is 1 when the run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_megatron_face",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", default="2,4", help="numbers of gloo ranks for the face's overhead")
    parser.add_argument("--seq", type=int, default=2048, help="tokens of the GPTModel step's sequence")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--calls", type=int, default=500, help="calls per round of the own-cost measurement")
    args = parser.parse_args(argv)
    opts = {"reps": args.reps, "warmup": args.warmup, "threads": args.threads, "seq": args.seq}
    start = time.perf_counter()
    faces: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            faces += spawn_measure(_measure_face, world, opts, timeout=900, prefix="bench_megatron_face")
        for world in sorted({ranks for ranks, _, _ in STEPS}):
            steps += spawn_measure(_measure_step, world, opts, timeout=1800, prefix="bench_megatron_step")
    except Exception as exc:
        print(f"bench_megatron_face failed: {exc}", file=sys.stderr)
        return 1
    print(table(
        "megatron-core's core attention face beside the engine called directly with the same plan, float32, "
        "forward + backward",
        ["ranks", "attention", "cp_comm_type", "global q shape", "face ms", "engine ms", "face / engine"],
        [[r["ranks"], {"causal": "causal", "chunk": f"mask=chunk_causal({CHUNK})", "thd": "thd, padded"}[r["data"]],
          r["comm"], "x".join(map(str, r["shape"])), f"{r['face_ms']:.2f}", f"{r['engine_ms']:.2f}",
          f"{r['overhead']:.2f}x"] for r in faces],
        [f"ms: median of {args.reps} repetitions in turns (slowest rank), {args.threads} thread(s) per rank; face / "
         f"engine: the median of each round's ratio; the face's output equals the engine call's bit for bit (checked "
         f"first)"],
    ))
    import torch

    torch.set_num_threads(args.threads)
    face_us, te_us, own_us = own_cost_us(args.calls)
    print(table(
        "What megatron-core's face adds per call to Transformer Engine's face, one process (context parallelism off)",
        ["megatron face us / call", "TE face us / call", "the megatron face's own us / call"],
        [[f"{face_us:.1f}", f"{te_us:.1f}", f"{own_us:.1f}"]],
        [f"q, k, v [16, 1, 4, 8] float32, causal, {args.threads} thread(s); medians of 21 rounds of {args.calls} calls "
         f"of each (the difference: the median of each round's)"],
    ))
    cp1 = next(r["ms"] for r in steps if r["ranks"] == 1 and r["attention"] == "megatron-core")
    print(table(
        f"megatron-core's GPTModel training step, one sequence of {args.seq} tokens, float32 (2 layers, hidden 128, "
        f"8 heads), megatron-core's own attention at cp 1 beside cp's face",
        ["ranks (cp)", "core attention", "cp_comm_type", "step ms", "cp 1 megatron-core / this"],
        [[r["ranks"], r["attention"], r["comm"], f"{r['ms']:.1f}", f"{cp1 / r['ms']:.2f}x"] for r in steps],
        [f"a step: get_batch_on_this_cp_rank, forward_backward_no_pipelining, finalize_model_grads (gradients summed "
         f"over dp x cp); median of {args.reps} steps in turns (slowest rank), {args.threads} thread(s) per rank; "
         f"the ranks share this machine's cores"],
    ))
    print(f"(bench_megatron_face took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
