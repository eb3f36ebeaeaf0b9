"""Per-sample context parallelism (``cp.plan_samples``) against one cp size for all and megatron-core's hybrid CP.

Predicted (one cost model for all three): seeded batches of videos at 480 x 832 (1,560 tokens per latent
frame, 4 latent frames a second), each batch holding about ``BUDGET`` tokens per rank: clips of 1 to 20 s
(1 + Pareto(alpha), capped at 20 s; alpha 1.5, and 1.2 for a heavy tail), short clips (1 to 2 s, uniform),
single-frame images, and a mix of chunk-causal clips (chunks of 3 latent frames: an autoregressive world
model) and full-attention images, at 8, 16 and 64 dp x cp ranks. Each is priced as
``cp.plan_dispatch(mask, L, c, rates=CostRates(), shape=AttentionShape()).predicted_ms`` per sample on ``c``
ranks, a step as its busiest rank's sum, a plan as the sum of its steps:

- fixed cp = world: every sample on all ranks, one after another;
- megatron-core: ``BalancedCPScheduler(max_seq_len_per_rank, group).get_groups_and_subsamples`` (its code,
  called on a CPU: it reads only the group's size) for a sweep of ``max_seq_len_per_rank``, each of its
  plans priced as above (a sample on the ranks listing it, its groups as steps, which end with its
  barrier; waits inside a step that its order may cause are not counted), the best kept;
- ours: ``cp.plan_samples(lengths, world, mask=...)``, and with megatron-core's best cap as
  ``max_tokens_per_rank``;
- bound: no plan on these groups beats ``max(sum of each sample's least rank-time / world, the slowest
  sample's best time)``.

Measured: on 4 gloo ranks, one training step (attention + MLP, forward and backward, the gradient
all-reduce) of a variable-length batch, by its plan (``cp.run_samples``; rates from ``cp.measure_rates``)
and with every sample on all 4 ranks (``cp.plan_dispatch(mask, L, 4)``), the same model and data; both
checked to give the same loss and gradients first.

``python -m benchmarks.bench_samples [--worlds 8,16,64] [--reps N] [--frames 24,48] [--no-measure] [--no-predict]``
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from benchmarks.harness import spawn_measure, table

#: Tokens per latent frame at 480 x 832 (60 x 104 latent, 2 x 2 patches) and latent frames per second.
FRAME_TOKENS, FRAMES_PER_S = 1560, 4
#: Tokens per rank a batch holds (about 10 s of video per rank).
BUDGET = 62_400
SEED = 38


def _draw(kind: str) -> Callable[[Any], int]:
    """A sampler of one sample's latent frames for a batch ``kind``."""
    def clip(alpha: float) -> Callable[[Any], int]:
        return lambda rng: max(1, round(min(20.0, 1.0 + rng.pareto(alpha)) * FRAMES_PER_S))

    return {"clips": clip(1.5), "clips, heavy tail": clip(1.2),
            "short clips": lambda rng: round(rng.uniform(1.0, 2.0) * FRAMES_PER_S),
            "images": lambda rng: 1}[kind]


#: The batches of the predicted table: name -> (sampler kind or "mixed", mask name).
BATCHES = ("clips", "clips, heavy tail", "short clips", "images", "mixed")


def batch(kind: str, world: int, seed: int = SEED, budget: int = BUDGET, frame_tokens: int = FRAME_TOKENS
          ) -> tuple[list[int], list[Any]]:
    """A seeded batch of about ``world * budget`` tokens: (lengths, masks). "mixed": chunk-causal clips (as
    "clips") and full-attention images, about half the tokens each."""
    import numpy as np

    import cp

    rng = np.random.default_rng((seed, world, BATCHES.index(kind)))
    full, chunked = cp.Mask.full(), cp.Mask.chunk_causal(3 * frame_tokens)
    lengths: list[int] = []
    masks: list[Any] = []
    if kind == "mixed":
        while sum(lengths) < world * budget / 2:
            lengths.append(_draw("clips")(rng) * frame_tokens)
            masks.append(chunked)
        while sum(lengths) < world * budget:
            lengths.append(frame_tokens)
            masks.append(full)
        return lengths, masks
    draw = _draw(kind)
    while sum(lengths) < world * budget:
        lengths.append(draw(rng) * frame_tokens)
    return lengths, [full] * len(lengths)


def sample_ms(mask: Any, length: int, c: int, rates: Any = None, shape: Any = None) -> float:
    """One sample on ``c`` ranks: its default dispatch plan's predicted time (``plan_samples``' cost)."""
    import cp

    return cp.plan_dispatch(mask, length, c, rates=rates, shape=shape).predicted_ms


def fixed_ms(lengths: Sequence[int], masks: Sequence[Any], world: int, rates: Any = None, shape: Any = None) -> float:
    """Every sample on all ``world`` ranks, one after another."""
    return sum(sample_ms(m, L, world, rates, shape) for L, m in zip(lengths, masks, strict=True))


def bound_ms(lengths: Sequence[int], masks: Sequence[Any], world: int, rates: Any = None, shape: Any = None) -> float:
    """No plan on the hybrid groups is faster: the least total rank-time over ``world``, or the slowest sample's best."""
    from parallel_state.topology.sample_plan import group_sizes

    sizes = group_sizes(world)
    area, slowest = 0.0, 0.0
    for length, m in zip(lengths, masks, strict=True):
        times = {c: sample_ms(m, length, c, rates, shape) for c in sizes if c <= length}
        area += min(c * t for c, t in times.items())
        slowest = max(slowest, min(times.values()))
    return max(area / world, slowest)


class _Size:
    """What ``BalancedCPScheduler`` reads of its dp x cp group: the size (its scheduling is arithmetic)."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def megatron_plan(lengths: Sequence[int], world: int, cap: int) -> list[dict[int, list[int]]]:
    """megatron-core's plan for ``lengths`` with ``max_seq_len_per_rank=cap``: per step (its group), sample ->
    the ranks (positions) listing it."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    scheduler = BalancedCPScheduler(cap, _Size(world))
    _, per_step = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    steps = []
    for step in per_step:
        where: dict[int, list[int]] = {}
        for rank, samples in enumerate(step):
            for i in samples:
                where.setdefault(i, []).append(rank)
        steps.append(where)
    placed = sorted(i for step in steps for i in step)
    if placed != list(range(len(lengths))):
        raise AssertionError(f"megatron-core's plan (cap {cap}) places samples {placed}, not each of "
                             f"{len(lengths)} once")
    return steps


def price_steps(steps: Sequence[dict[int, Sequence[int]]], lengths: Sequence[int], masks: Sequence[Any], world: int,
                rates: Any = None, shape: Any = None) -> float:
    """Steps of ``sample -> ranks`` priced by the model: per step its busiest rank's sum, summed over steps."""
    total = 0.0
    for step in steps:
        load = [0.0] * world
        for i, ranks in step.items():
            ms = sample_ms(masks[i], lengths[i], len(ranks), rates, shape)
            for r in ranks:
                load[r] += ms
        total += max(load)
    return total


def megatron_caps(lengths: Sequence[int], world: int) -> list[int]:
    """The ``max_seq_len_per_rank`` values swept: the longest sample on each power of two of ranks up to ``world``,
    and 13 geometric steps between the longest over ``world`` and the longest (each a cap its scheduler can meet)."""
    longest = max(lengths)
    caps = {math.ceil(longest / 2 ** k) for k in range(world.bit_length()) if 2 ** k <= world}
    caps |= {math.ceil(longest / world * world ** (k / 12)) for k in range(13)}
    return sorted(c for c in caps if 2 ** math.ceil(math.log2(longest / c)) <= world)


def megatron_best(lengths: Sequence[int], masks: Sequence[Any], world: int, rates: Any = None, shape: Any = None
                  ) -> tuple[float, int, int]:
    """megatron-core's best plan over the swept caps, priced by the model: (ms, its cap, its steps)."""
    best = (math.inf, 0, 0)
    for cap in megatron_caps(lengths, world):
        steps = megatron_plan(lengths, world, cap)
        ms = price_steps(steps, lengths, masks, world, rates, shape)
        if ms < best[0]:
            best = (ms, cap, len(steps))
    return best


def predicted_rows(worlds: Sequence[int]) -> tuple[list[list[Any]], dict[str, float]]:
    """The predicted table's rows, and the worst ratios that the issue's bar reads."""
    import cp
    from parallel_state.topology import dispatch_plan
    from parallel_state.topology.sample_plan import placement_ms

    rows: list[list[Any]] = []
    worst = {"vs fixed (16, 64 ranks)": math.inf, "vs fixed (short clips, 8)": math.inf, "vs megatron-core": math.inf}
    for world in worlds:
        for kind in BATCHES:
            lengths, masks = batch(kind, world)
            for cache in (placement_ms, dispatch_plan._plan, dispatch_plan._layouts):
                cache.cache_clear()  # cold: every cost priced afresh, no dispatch plan of an earlier batch kept
            start = time.perf_counter()
            plan = cp.plan_samples(lengths, world, mask=masks)
            cold = time.perf_counter() - start
            start = time.perf_counter()
            cp.plan_samples(lengths, world, mask=masks)
            warm = time.perf_counter() - start
            fixed = fixed_ms(lengths, masks, world)
            mc, cap, mc_steps = megatron_best(lengths, masks, world)
            capped = cp.plan_samples(lengths, world, mask=masks, max_tokens_per_rank=cap)
            bound = bound_ms(lengths, masks, world)
            if world >= 16:
                worst["vs fixed (16, 64 ranks)"] = min(worst["vs fixed (16, 64 ranks)"], fixed / plan.predicted_ms)
            if world == 8 and kind == "short clips":
                worst["vs fixed (short clips, 8)"] = fixed / plan.predicted_ms
            worst["vs megatron-core"] = min(worst["vs megatron-core"], mc / plan.predicted_ms,
                                            mc / capped.predicted_ms)
            rows.append([world, kind, len(lengths), f"{sum(lengths) / 1e6:.2f}M", f"{fixed:.1f}",
                         f"{mc:.1f} ({cap}, {mc_steps})", f"{plan.predicted_ms:.1f}", f"{capped.predicted_ms:.1f}",
                         f"{bound:.1f}", f"{fixed / plan.predicted_ms:.2f}x", f"{fixed / bound:.2f}x",
                         f"{mc / plan.predicted_ms:.2f}x", f"{cold:.1f} / {warm:.2f}"])
    return rows, worst


def print_predicted(worlds: Sequence[int]) -> None:
    rows, worst = predicted_rows(worlds)
    print(table(
        "one cost model for all: fixed cp = world, megatron-core's best hybrid-CP plan, ours (ms per step, predicted)",
        ["ranks", "batch", "samples", "tokens", "fixed cp=world", "megatron-core best (cap, steps)", "ours",
         "ours at its cap", "bound", "ours vs fixed", "bound vs fixed", "ours vs megatron-core", "plan s cold / warm"],
        rows,
        [f"CostRates() and AttentionShape() (one GPU of an 8-GPU NVLink node, bfloat16, 24 heads of 128, forward + "
         f"backward); batches of about {BUDGET} tokens per rank, seed {SEED}. bound vs fixed: the most any plan on "
         f"these groups can gain over fixed cp = world under the model. plan s: cold (every cost priced) / warm "
         f"(costs cached, as from the second batch of a run whose lengths are whole latent frames). Worst ratios: "
         + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items())]))


# --- the measured step ---------------------------------------------------------------------------------------

#: The measured batches: the clips batch's durations with latent frames of these many tokens (small latents),
#: 8 heads of 16, MLP 4x, float32.
STEP_FRAMES, STEP_HEADS, STEP_DIM = (24, 48), 8, 16


def make_block(dim: int, heads: int, dtype: Any, seed: int = 0) -> Any:
    """A DiT block's token mixing: qkv projection, attention over the sample, output projection, MLP (4x)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    block = nn.ModuleDict({"qkv": nn.Linear(dim, 3 * dim), "out": nn.Linear(dim, dim),
                           "up": nn.Linear(dim, 4 * dim), "down": nn.Linear(4 * dim, dim)})
    block.heads = heads
    return block.to(dtype)


def block_out(block: Any, xs: Any, attend: Callable[[Any, Any, Any], Any]) -> Any:
    """The block on tokens ``xs`` [1, S, dim], with ``attend(q, k, v)`` ([1, S, heads, head dim]) as its attention."""
    import torch

    s, dim = xs.shape[1], xs.shape[2]
    q, k, v = block["qkv"](xs).view(1, s, 3, block.heads, dim // block.heads).unbind(2)
    h = xs + block["out"](attend(q, k, v).reshape(1, s, dim))
    return h + block["down"](torch.nn.functional.gelu(block["up"](h)))


def block_loss(block: Any, x: Any, target: Any, group: Any, plan: Any) -> Any:
    """This rank's tokens of one sample (``plan``'s, on ``group``) through the block; the squared error summed
    over them. ``x``, ``target``: the whole sample, [1, L, dim], as every rank of its group loads it."""
    import cp

    xs, ts = cp.dispatch(x, plan, 1, group), cp.dispatch(target, plan, 1, group)
    y = block_out(block, xs, lambda q, k, v: cp.ring_attention(q, k, v, group, plan=plan))
    return ((y - ts) ** 2).sum()


def step_data(lengths: Sequence[int], dim: int, dtype: Any, seed: int = SEED) -> list[tuple[Any, Any]]:
    """Each sample's (x, target), [1, L, dim], the same on every rank (a loader reads them by index)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, L, dim, generator=g, dtype=dtype), torch.randn(1, L, dim, generator=g, dtype=dtype))
            for L in lengths]


def _measure(rank: int, world: int, store: str, opts: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    import cp
    import parallel_state as ps

    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    ps.initialize_model_parallel(context_parallel_size=world, hybrid_context_parallel=True)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    rates = cp.measure_rates(group, heads=STEP_HEADS, head_dim=STEP_DIM, dtype=torch.float32)
    rows = [_step_row(rank, world, group, rates, frame, opts) for frame in opts["frames"]]
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return None if rank else {"rates": rates.describe(), "rows": rows}


def _step_row(rank: int, world: int, group: Any, rates: Any, frame: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One batch (latent frames of ``frame`` tokens): both plans checked against each other, then timed in turns."""
    import torch

    import cp
    import parallel_state as ps
    from benchmarks.bench_attention import time_in_turns

    lengths, masks = batch("clips", world, budget=opts["budget"], frame_tokens=frame)
    shape = cp.AttentionShape(heads=STEP_HEADS, head_dim=STEP_DIM, dtype="float32")
    ours = cp.plan_samples(lengths, group, mask=masks, rates=rates, shape=shape)
    fixed = ps.SamplePlan(lengths=tuple(lengths), world=world, masks=tuple(masks), rates=rates, shape=shape,
                          steps=(tuple(ps.Placement(i, tuple(range(world))) for i in range(len(lengths))),))
    dim = STEP_HEADS * STEP_DIM
    block = make_block(dim, STEP_HEADS, torch.float32)
    data = step_data(lengths, dim, torch.float32)
    params = list(block.parameters())

    def step(plan: Any) -> tuple[float, list[Any]]:
        for p in params:
            p.grad = None
        loss = cp.run_samples(plan, lambda i, g, dp: block_loss(block, *data[i], g, dp), params)
        return float(loss), [p.grad.clone() for p in params]

    (a, ga), (b, gb) = step(ours), step(fixed)
    worst = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(ga, gb, strict=True))
    if abs(a - b) > 1e-4 * abs(b) or worst > 1e-3:
        raise AssertionError(f"the two plans disagree: loss {a} vs {b}, gradients max rel diff {worst:.3g}")
    times = time_in_turns({"ours": lambda: step(ours), "fixed": lambda: step(fixed)}, group, opts)
    return {"frame": frame, "lengths": lengths, "plan": ours.describe(),
            "ours": statistics.median(times["ours"]) * 1e3, "fixed": statistics.median(times["fixed"]) * 1e3,
            "ours_pred": ours.predicted_ms, "fixed_pred": fixed_ms(lengths, masks, world, rates, shape)}


def main(argv: list[str] | None = None) -> int:
    """Print both tables; the exit status is 1 when a run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_samples", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,16,64", help="dp x cp ranks of the predicted table")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (measured step)")
    parser.add_argument("--budget", type=int, default=1200, help="tokens per rank of the measured batches")
    parser.add_argument("--frames", default=",".join(map(str, STEP_FRAMES)),
                        help="tokens per latent frame of each measured batch")
    parser.add_argument("--no-measure", action="store_true", help="the predicted table only")
    parser.add_argument("--no-predict", action="store_true", help="the measured table only")
    args = parser.parse_args(argv)
    if not args.no_predict:
        print_predicted([int(w) for w in args.worlds.split(",")])
    if args.no_measure:
        return 0
    opts = {"reps": args.reps, "warmup": args.warmup, "threads": args.threads, "budget": args.budget,
            "frames": [int(f) for f in args.frames.split(",")]}
    try:
        r = spawn_measure(_measure, 4, opts, timeout=1800, prefix="bench_samples")
    except Exception as exc:
        print(f"bench_samples failed: {exc}", file=sys.stderr)
        return 1
    print(table(
        "one training step (attention + MLP, forward and backward, gradient all-reduce) on 4 gloo ranks: "
        "by its sample plan vs every sample on all 4 ranks",
        ["tokens per frame", "batch (tokens per sample)", "our plan", "ours ms", "fixed cp=4 ms", "ours vs fixed",
         "predicted ours / fixed"],
        [[row["frame"], " ".join(map(str, row["lengths"])), row["plan"], f"{row['ours']:.0f}", f"{row['fixed']:.0f}",
          f"{row['fixed'] / row['ours']:.2f}x", f"{row['ours_pred']:.0f} / {row['fixed_pred']:.0f}"]
         for row in r["rows"]],
        [f"the clips batch's durations (about {args.budget} tokens per rank), {STEP_HEADS} heads of {STEP_DIM}, MLP "
         f"4x, float32; median of {args.reps} steps each, in turns (slowest rank); both plans give the same loss and "
         f"gradients before timing; rates measured on the group: {r['rates']}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
