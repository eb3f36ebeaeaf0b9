"""Autoregressive attention, chunk by chunk: ``cp.KVCache.attend`` against recomputing the prefix with ``cp.ring_attention``.

A rollout of ``--chunks`` chunks of ``--chunk`` tokens, q, k, v [1, chunk, 8 heads, 64] float32, on 2 gloo
ranks (``--world``). For each chunk index c, one denoising step's attention of chunk c:

- "cache": ``cache.attend`` of this rank's uneven shard, the cache holding chunks 0 .. c-1 (every rank its
  split of each); "cache, window W": ``KVCache(window_chunks=W)``, holding at most W - 1 chunks;
- "recompute": what a model without a cache does at each step: ``cp.ring_attention(plan=...)`` over the whole
  prefix of c + 1 chunks under ``cp.Mask.chunk_causal(chunk)`` (``Mask.sliding_window(chunk, W)`` beside the
  window), on the default plan (``cp.plan_dispatch``: its balanced layout and transport), forward only.

Both are checked equal (the chunk's rows) before timing. Times: median of ``--reps`` calls of the slowest rank,
in turns after a barrier; cache bytes: this rank's K and V held when chunk c attends. Attention work of the last
chunk: the cache computes chunk x (kept + 1) x chunk scores; the recomputation every earlier chunk's rows too.

``python -m benchmarks.bench_kv_cache [--world 2] [--chunks 8] [--chunk 512] [--window 3] [--reps 5] [--threads 1]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from benchmarks.harness import spawn_measure, table

HEADS, HEAD_DIM = 8, 64


def _measure(rank: int, world: int, store: str, opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch
    import torch.distributed as dist

    import cp
    from benchmarks.bench_attention import join, time_in_turns

    join(rank, world, store, opts)
    group = dist.group.WORLD
    chunk, chunks, window = opts["chunk"], opts["chunks"], opts["window"]
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, chunk * chunks, HEADS, HEAD_DIM, generator=gen) for _ in range(3)]  # q, k, v
    caches = {"cache": cp.KVCache(group), f"cache, window {window}": cp.KVCache(group, window_chunks=window)}
    masks = {"cache": cp.Mask.chunk_causal(chunk), f"cache, window {window}": cp.Mask.sliding_window(chunk, window)}
    rows = []
    with torch.no_grad():
        for c in range(chunks):
            part = [cp.split_inputs_cp(x[:, c * chunk:(c + 1) * chunk], 1, group, uneven=True) for x in whole]
            length = (c + 1) * chunk
            ways, row = {}, {"chunk": c}
            for name, cache in caches.items():
                plan = cp.plan_dispatch(masks[name], length, world)
                prefix = [cp.dispatch(x[:, :length], plan, 1, group) for x in whole]
                mine = cache.attend(*part)
                again = cp.undispatch(cp.ring_attention(*prefix, group, plan=plan), plan, 1, group)[:, c * chunk:]
                got = cp.cat_outputs_cp(mine, 1, group, uneven=True)
                err = ((got - again).abs().max() / again.abs().max()).item()
                if err > 1e-4:
                    raise AssertionError(f"chunk {c}, {name}: the cache and the recomputation differ (rel {err:.2g})")
                ways[name] = lambda cache=cache, part=part: cache.attend(*part)
                ways[f"recompute ({name})"] = lambda prefix=prefix, plan=plan: cp.ring_attention(*prefix, group,
                                                                                                plan=plan)
                row[f"{name} bytes"] = cache.local_bytes
                row[f"{name} kept"] = len(cache)
            times = time_in_turns(ways, group, opts)
            row.update({name: statistics.median(t) * 1e3 for name, t in times.items()})
            rows.append(row)
            for cache in caches.values():
                cache.append(*part[1:])
    dist.destroy_process_group()
    return None if rank else rows


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 1 when a run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv_cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--window", type=int, default=3, help="window_chunks of the windowed cache")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    opts = vars(args)
    try:
        rows = spawn_measure(_measure, args.world, opts, timeout=900, prefix="bench_kv_cache")
    except Exception as exc:
        print(f"bench_kv_cache failed: {exc}", file=sys.stderr)
        return 1
    w = f"cache, window {args.window}"
    out = []
    for r in rows:
        out.append([r["chunk"], f"{r['cache']:.2f}", f"{r['recompute (cache)']:.2f}",
                    f"{r['cache'] / r['recompute (cache)']:.2f}x", f"{r[w]:.2f}", f"{r[f'recompute ({w})']:.2f}",
                    f"{r[w] / r[f'recompute ({w})']:.2f}x", f"{r['cache bytes'] / 2 ** 20:.2f} ({r['cache kept']})",
                    f"{r[f'{w} bytes'] / 2 ** 20:.2f} ({r[f'{w} kept']})"])
    print(table(
        f"one denoising step's attention of chunk c on {args.world} gloo ranks: KVCache.attend vs recomputing the "
        f"prefix (ms)",
        ["chunk c", "cache", "recompute", "cache / recompute", f"window {args.window}", "recompute window",
         "window / recompute", "cache MiB on rank 0 (chunks)", "window MiB (chunks)"],
        out,
        [f"{args.chunks} chunks of {args.chunk} tokens, q, k, v [1, {args.chunk}, {HEADS} heads, {HEAD_DIM}] float32, "
         f"{args.threads} torch thread(s) per rank; recompute: cp.ring_attention(plan=cp.plan_dispatch(mask, "
         f"(c + 1) x {args.chunk}, {args.world})) under chunk_causal / sliding_window({args.chunk}, {args.window}); "
         f"median of {args.reps} calls, slowest rank; both checked equal first"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
