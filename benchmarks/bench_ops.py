"""What a planned attention call costs the host and the memory beside one process's SDPA, on this machine's CPU.

For each mask (full, causal, chunk-causal of 8 runs, a sliding window, packed clips of 4 and 8) and two shapes,
``cp.ring_attention(q, k, v, plan=cp.plan_dispatch(mask, L, 1))`` forward + backward in bfloat16 (a world of one)
beside unmasked SDPA's, counted in the same run (``benchmarks.dispatch_count``): aten ops dispatched (on a GPU
each op that computes is a kernel launch: at cp 8 a ring step of a real model is this small, and the host sets
the pace) and the peak of the bytes the call's ops allocate above its inputs.

``python -m benchmarks ops``
"""

from __future__ import annotations

import argparse
import time

from benchmarks import dispatch_count as dc
from benchmarks.harness import table

SHAPES = ((1, 2048, 8, 64), (1, 8192, 4, 64))


def rows() -> list[list[str]]:
    """One row per shape and mask: ours and SDPA's ops and peak, and their ratios."""
    out = []
    for shape in SHAPES:
        base = dc.count(dc.sdpa, shape)
        for name, mask in dc.masks(shape[1]).items():
            ours = dc.count(dc.planned(mask, shape[1]), shape)
            out.append([str(list(shape)), name, str(ours.ops), str(base.ops), f"{ours.ops / base.ops:.1f}x",
                        f"{ours.peak / 2**20:.1f}", f"{base.peak / 2**20:.1f}", f"{ours.peak / base.peak:.2f}x"])
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m benchmarks ops", description=__doc__.split("\n\n")[0]).parse_args(argv)
    start = time.time()
    print(table("ops and memory of one planned attention call beside unmasked SDPA (bfloat16, forward + backward, "
                "one process, CPU)",
                ["shape [B, S, H, D]", "mask", "ops", "SDPA's ops", "ops / SDPA's", "peak MiB", "SDPA's peak MiB",
                 "peak / SDPA's"], rows(),
                ["ops: aten ops dispatched (views and copies included); peak: the most bytes the call's ops "
                 "hold at once above its inputs (scratch inside a fused kernel is not seen, on either side)"]))
    print(f"(bench_ops took {time.time() - start:.0f} s)")
    return 0
