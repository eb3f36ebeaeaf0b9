"""Attention work balance of ``plan_dispatch`` for every mask kind on real video token counts, at cp 2, 4, 8 and 16.

For each mask and cp size: max over ranks / mean of the attention work (allowed query-key pairs of a
rank's queries) under the contiguous split (``method="contiguous"``, torch.tensor_split's layout),
under the fixed zigzag baseline (2 cp equal chunks, rank r holding r and 2cp-1-r, as Transformer
Engine's causal context parallelism splits) and under the balanced plan, all from the same run;
the balanced plan's most runs per rank; its planning time and that of the default plan (``method="auto"``:
every candidate layout and transport priced by the cost model, here with a GPU node's default rates for a
Wan2.1-14B-like attention, 40 heads of 128 in bfloat16) with what it chose (median of fresh plans, caches
cleared). One process, no communication: this is arithmetic over the masks' key intervals.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.harness import median, table

FRAME = 1560  # tokens per latent frame: Wan2.1 at 480p, 60 x 104 latent patched 2 x 2 -> 30 x 52
FRAMES = 21  # 81 video frames -> 21 latent frames
CHUNK = 3 * FRAME  # MAGI-1-style chunks of 3 latent frames
CLIPS = (5, 9, 7)  # packed clips of mixed lengths, in latent frames (21 in all)


def masks():
    """(label, mask) for every kind at 21 x 1,560 = 32,760 tokens."""
    from parallel_state import AttentionMask as Mask

    clips = [n * FRAME for n in CLIPS]
    return [
        ("full", Mask.full()),
        ("causal (token)", Mask.causal()),
        ("chunk_causal, 3 frames", Mask.chunk_causal(CHUNK)),
        ("sliding_window, 2 x 3 frames", Mask.sliding_window(CHUNK, 2)),
        ("sliding_window, 4 x 1 frame", Mask.sliding_window(FRAME, 4)),
        ("packed 5+9+7 frames, full", Mask.packed(clips)),
        ("packed 5+9+7 frames, chunk 3", Mask.packed(clips, CHUNK)),
        ("packed 5+9+7 frames, causal", Mask.packed(clips, 1)),
    ]


def zigzag_balance(mask, length: int, cp_size: int) -> float:
    """max / mean work of the fixed zigzag: 2 cp tensor_split chunks, rank r holds chunks r and 2cp-1-r."""
    import torch

    prefix = torch.zeros(length + 1, dtype=torch.int64)
    torch.cumsum(mask.widths(length), 0, out=prefix[1:])
    cuts = [0]
    for piece in torch.arange(length).tensor_split(2 * cp_size):
        cuts.append(cuts[-1] + piece.numel())
    work = [int(prefix[cuts[r + 1]] - prefix[cuts[r]] + prefix[cuts[2 * cp_size - r]] - prefix[cuts[2 * cp_size - 1 - r]])
            for r in range(cp_size)]
    return max(work) * cp_size / sum(work)


#: The attention the default plan is priced for: Wan2.1 14B's (40 heads of 128), bfloat16, forward and backward.
SHAPE = {"heads": 40, "head_dim": 128, "dtype": "bfloat16"}


def plan_ms(mask, length: int, cp_size: int, reps: int, method: str = "balanced") -> float:
    """Median wall time of a fresh plan (the plan and layout caches cleared before each)."""
    from parallel_state import AttentionShape, plan_dispatch
    from parallel_state.topology.dispatch_cost import _needs
    from parallel_state.topology.dispatch_plan import _layouts, _plan

    times = []
    for _ in range(reps):
        _plan.cache_clear()
        _layouts.cache_clear()
        _needs.cache_clear()
        t0 = time.perf_counter()
        plan_dispatch(mask, length, cp_size, method=method, shape=AttentionShape(**SHAPE))
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 1 when a plan broke its promises."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_balance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", default="2,4,8,16", help="cp sizes (default 2,4,8,16)")
    parser.add_argument("--reps", type=int, default=5, help="fresh plans timed per row (default 5)")
    args = parser.parse_args(argv)
    from parallel_state import AttentionShape, plan_dispatch, shard_sizes

    length = FRAMES * FRAME
    plan_dispatch(masks()[1][1], length, 2)  # torch's first-use costs stay out of the timings
    rows, worst = [], 0.0
    for label, mask in masks():
        for cp_size in (int(c) for c in args.cp.split(",")):
            ms = plan_ms(mask, length, cp_size, args.reps)
            auto_ms = plan_ms(mask, length, cp_size, args.reps, method="auto")
            balanced = plan_dispatch(mask, length, cp_size, method="balanced")
            contiguous = plan_dispatch(mask, length, cp_size, method="contiguous")
            auto = plan_dispatch(mask, length, cp_size, shape=AttentionShape(**SHAPE))
            base = min(c.predicted_ms for c in auto.candidates if c.method == "contiguous")
            if balanced.sizes != shard_sizes(length, cp_size) or max(balanced.work) > max(contiguous.work) or \
                    auto.predicted_ms > base:
                print(f"bench_balance: the balanced plan of {label} at cp {cp_size} broke its promises",
                      file=sys.stderr)
                return 1
            worst = max(worst, balanced.balance)
            rows.append([label, cp_size, f"{contiguous.balance:.4f}", f"{zigzag_balance(mask, length, cp_size):.4f}",
                         f"{balanced.balance:.4f}", max(len(r) for r in balanced.runs), f"{ms:.1f}",
                         f"{auto.method}/{auto.transport}", f"{auto.balance:.4f}", f"{base / auto.predicted_ms:.2f}x",
                         f"{auto_ms:.1f}"])
    print(table(
        f"attention work balance, {FRAMES} latent frames x {FRAME} tokens = {length} tokens (max over ranks / mean)",
        ["mask", "cp", "contiguous", "zigzag 2cp", "balanced", "runs/rank", "plan ms", "auto chose", "auto",
         "predicted speed-up", "auto plan ms"],
        rows,
        ["work: allowed (query, key) pairs of a rank's queries; balanced: method='balanced', token counts "
         "equal to the contiguous split's; runs/rank: most contiguous runs a rank holds under it; plan ms: median "
         f"of {args.reps} fresh plans. auto: the default plan (method='auto') for 40 heads of 128 in bfloat16 "
         "with a GPU node's default CostRates(), its layout/transport, work max/mean, and predicted step time of "
         f"the contiguous split's best over its own. Worst balanced figure: {worst:.4f}."],
    ))
    # Planning time as the sequence grows (chunk-causal in chunks of 3 frames, cp 16): O(length) tensor work.
    from parallel_state import AttentionMask

    scale = []
    for frames, frame_tokens, what in ((21, FRAME, "Wan2.1 480p"), (33, 3600, "HunyuanVideo 720p"),
                                       (120, 8192, "a long 1M-token world-model rollout")):
        n = frames * frame_tokens
        mask = AttentionMask.chunk_causal(3 * frame_tokens)
        plan = plan_dispatch(mask, n, 16, method="balanced")
        ms = plan_ms(mask, n, 16, args.reps)
        auto_ms = plan_ms(mask, n, 16, args.reps, method="auto")
        scale.append([what, f"{frames} x {frame_tokens}", n, f"{plan.balance:.4f}", f"{ms:.1f}", f"{auto_ms:.1f}"])
    print(table("planning time, chunk-causal (3 frames per chunk) at cp 16",
                ["sequence", "frames x tokens", "tokens", "balanced", "plan ms", "auto plan ms"], scale,
                [f"median of {args.reps} fresh plans (cache cleared), one process"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
