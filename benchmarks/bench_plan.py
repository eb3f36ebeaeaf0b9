"""The default plan (``method="auto"``, priced with rates measured on the group) beside the contiguous split and
the balanced plan: predicted and measured step times, from one run.

The masked table's work (``bench_attention``: 21 latent frames of 96 tokens, q, k, v [1, 2016, 8 heads, 16]
float32, chunk-causal in chunks of 3 frames and packed clips of 9, 5 and 7 frames, forward + backward) on 2 and
4 gloo ranks, through ``ring_attention(plan=)`` and ``usp_attention(plan=)`` (Ulysses 2 x ring n/2). Every rank
first measures the group's rates (``cp.measure_rates``, the same on every rank), then plans with them for this
attention (``cp.AttentionShape(8, 16, dtype="float32")``, ``ulysses_size`` 1 for the ring, 2 for usp). Each
way is checked against one process under the dense mask before timing; times are the slowest rank's, median
of the repetitions in rotating order; bytes are ``cp.count_attention``'s (K/V and their gradients sent point
to point, the busiest rank's); each plan runs with its own transport (``plan.transport``). Where the auto plan
is the contiguous split or the balanced plan (equal values: the same layout and transport) it is timed once, as
that plan.

``python -m benchmarks.bench_plan [--reps N] [--worlds 2,4] [--threads 1]``
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import traceback
from typing import Any

from benchmarks.bench_attention import (
    FRAME_TOKENS,
    FRAMES,
    MASKED_DIM,
    MASKED_HEADS,
    SEED,
    masked_cases,
    time_in_turns,
)
from benchmarks.harness import spawn_ranks, table

PLANS = ("auto", "contiguous", "balanced")


def _rank_main(rank: int, world: int, store: str, opts: dict[str, Any], conn: Any) -> None:
    """One rank: join the group, measure, send ("ok", rank 0's figures) or ("err", why) to the parent."""
    import torch
    import torch.distributed as dist

    import parallel_state as ps

    reply: tuple[str, Any]
    try:
        torch.set_num_threads(opts["threads"])
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        ps.initialize_model_parallel(context_parallel_size=world, hierarchical_context_parallel_sizes=[2, world // 2])
        reply = ("ok", _measure(rank, world, opts))
    except BaseException as exc:  # report, so the parent prints why instead of waiting
        reply = ("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    conn.send(reply)


def _measure(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    import cp
    import parallel_state as ps
    from cp.comm import all_gather_into

    ug, rg = ps.get_hierarchical_context_parallel_groups()
    group = dist.group.WORLD
    rates = cp.measure_rates(group, heads=MASKED_HEADS, head_dim=MASKED_DIM, dtype=torch.float32)
    shape = cp.AttentionShape(heads=MASKED_HEADS, head_dim=MASKED_DIM, dtype="float32")
    length = FRAMES * FRAME_TOKENS
    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, length, MASKED_HEADS, MASKED_DIM, generator=g) for _ in range(3))
    grad = torch.randn(1, length, MASKED_HEADS, MASKED_DIM, generator=g)
    ways: dict[tuple[str, str, str], Any] = {}
    plans: dict[tuple[str, str, str], Any] = {}
    for mask_name, mask in masked_cases().items():
        want = cp.sdpa_in_layout(q, k, v, attn_mask=mask.dense(length))
        for how, u in (("ring", 1), (f"usp 2x{world // 2}", 2)):
            attend = (functools.partial(cp.ring_attention, cp_group=group) if u == 1 else
                      functools.partial(cp.usp_attention, ulysses_group=ug, ring_group=rg))
            for label in PLANS:
                plan = cp.plan_dispatch(mask, length, world, method=label, rates=rates, shape=shape, ulysses_size=u)
                mine = plan.index(rank)
                step = functools.partial(_step, attend, plan, [t[:, mine].requires_grad_(True) for t in (q, k, v)],
                                         grad[:, mine])
                err = ((step().detach() - want[:, mine]).abs().max() / want.abs().max()).item()  # before timing
                if err > 1e-5:
                    raise AssertionError(f"{how} {mask_name} {label}: max |diff| / max |ref| = {err:.3g}")
                ways[(mask_name, how, label)] = step
                plans[(mask_name, how, label)] = plan
    counted = {}
    for key, fn in ways.items():
        with cp.count_attention() as count:
            fn()
        every = torch.empty(world, dtype=torch.float64)
        all_gather_into(every, torch.tensor([sum(count.kv_sent.values()) + sum(count.grad_sent.values())],
                                            dtype=torch.float64), group)
        counted[key] = every.max().item()
    # The auto plan where it equals another (the same layout and transport) is that plan: timed once.
    same = {key: next(other for other in ways if other[:2] == key[:2] and other[2] != "auto"
                      and plans[other] == plans[key]) for key in ways if key[2] == "auto"
            and any(o[:2] == key[:2] and o[2] != "auto" and plans[o] == plans[key] for o in ways)}
    times = time_in_turns({key: fn for key, fn in ways.items() if key not in same}, group, opts)
    times.update({key: times[other] for key, other in same.items()})
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    if rank:
        return None
    return {"rates": rates.describe(),
            "rows": {" | ".join(key): {"ms": statistics.median(times[key]) * 1e3, "bytes": counted[key],
                                       "predicted": plans[key].predicted_ms, "method": plans[key].method,
                                       "transport": plans[key].transport, "balance": plans[key].balance,
                                       "same": same[key][2] if key in same else ""}
                     for key in ways}}


def _step(attend: Any, plan: Any, ins: list[Any], grad: Any) -> Any:
    """One forward + backward of ``attend`` on this rank's q, k, v under ``plan``; the output."""
    out = attend(*ins, plan=plan)
    out.backward(grad)
    return out


def rows_for(world: int, opts: dict[str, Any]) -> tuple[str, list[list[Any]], list[float], list[float]]:
    """One world's rows, its rates, and per row the speed-up of auto over contiguous and (packed) its bytes ratio."""
    r = spawn_ranks(_rank_main, world, opts, timeout=900, prefix="bench_plan")
    rows, speed, ratio = [], [], []
    for mask_name in masked_cases():
        for how in ("ring", f"usp 2x{world // 2}"):
            a, c, b = (r["rows"][f"{mask_name} | {how} | {p}"] for p in PLANS)
            speed.append(c["ms"] / a["ms"])
            if mask_name.startswith("packed"):
                ratio.append(a["bytes"] / c["bytes"] if c["bytes"] else (1.0 if not a["bytes"] else float("inf")))
            chose = f"{a['method']}/{a['transport']}" + (f" (= {a['same']})" if a["same"] else "")
            rows.append([world, mask_name, how, chose, f"{a['balance']:.3f}",
                         f"{a['predicted']:.1f} / {c['predicted']:.1f} / {b['predicted']:.1f}",
                         f"{a['ms']:.1f} / {c['ms']:.1f} / {b['ms']:.1f}",
                         f"{a['bytes'] / 2**20:.2f} / {c['bytes'] / 2**20:.2f} / {b['bytes'] / 2**20:.2f}",
                         f"{c['ms'] / a['ms']:.2f}x"])
    return r["rates"], rows, speed, ratio


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 1 when the run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", default="2,4", help="numbers of gloo ranks (even)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    opts = {"reps": args.reps, "warmup": args.warmup, "threads": args.threads}
    rows, notes, speeds, ratios = [], [], [], []
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            rates, more, speed, ratio = rows_for(world, opts)
            rows += more
            speeds += speed
            ratios += ratio
            notes.append(f"{world} ranks, measured rates: {rates}")
    except Exception as exc:
        print(f"bench_plan failed: {exc}", file=sys.stderr)
        return 1
    print(table(
        f"the default plan (auto, measured rates) / contiguous split / balanced plan: q, k, v [1, "
        f"{FRAMES * FRAME_TOKENS}, {MASKED_HEADS}, {MASKED_DIM}] float32, gloo ranks, forward + backward",
        ["ranks", "mask", "method", "auto chose", "auto work max/mean", "predicted ms", "measured ms",
         "MiB sent/rank (max)", "auto vs contiguous"],
        rows,
        notes + [f"median of {args.reps} repetitions in rotating order (slowest rank), {args.threads} thread(s) per "
                 f"rank; predicted: plan.predicted_ms; all match one-process attention within 1e-5 before timing; "
                 f"each plan runs with its own transport. Worst auto vs contiguous: "
                 f"{min(speeds):.2f}x; worst packed bytes auto / contiguous: "
                 f"{max(ratios) if ratios else float('nan'):.2f}"],
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
