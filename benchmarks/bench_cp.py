"""cp's gather and split against the usual way of writing them, side by side in one run.

Two gloo ranks on this machine gather a [1, 16, 32, 88, 160] float32 latent split along each
seq_dim. "usual" is the common inline code: a list of ``zeros_like`` buffers, ``all_gather`` into
it, ``torch.cat``; and for the split, view + ``index_select`` + ``contiguous``. Each repetition
times both, in alternating order, after a barrier; a call's time is the slowest rank's. The
speedup is the median over repetitions of usual/ours (the machine is noisy: ratios from the same
repetition share its noise).

``python -m benchmarks.bench_cp [--reps N] [--shape 1,16,32,88,160] [--dims 2,1,3,4] [--threads 1]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import traceback
from functools import partial
from typing import Any

from benchmarks.harness import spawn_ranks

DEFAULT_SHAPE = (1, 16, 32, 88, 160)
MAIN_DIM = 2


# ---------------------------------------------------------------- the usual way, written inline

def usual_cat(x: Any, seq_dim: int, group: Any) -> Any:
    import torch
    import torch.distributed as dist

    gathered = [torch.zeros_like(x) for _ in range(group.size())]
    dist.all_gather(gathered, x, group=group)
    return torch.cat(gathered, dim=seq_dim)


def usual_split(x: Any, seq_dim: int, group: Any) -> Any:
    import torch

    n = group.size()
    x = x.view(*x.shape[:seq_dim], n, x.shape[seq_dim] // n, *x.shape[seq_dim + 1:])
    x = x.index_select(seq_dim, torch.tensor([group.rank()], device=x.device))
    return x.view(*x.shape[:seq_dim], -1, *x.shape[seq_dim + 2:]).contiguous()


# ---------------------------------------------------------------- one rank

def _timed(fn: Any, sync: Any) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _rank_main(rank: int, world: int, store: str, opts: dict[str, Any], conn: Any) -> None:
    try:
        conn.send(("ok", _measure(rank, world, store, opts)))
    except BaseException as exc:  # report, so the parent prints why instead of waiting
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _measure(rank: int, world: int, store: str, opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch
    import torch.distributed as dist

    import cp

    torch.set_num_threads(opts["threads"])
    backend = opts["backend"]
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    cuda_sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    slowest = torch.zeros(1, dtype=torch.float64, device=device)

    def across_ranks(seconds: float) -> float:
        slowest.fill_(seconds)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        return float(slowest.item())

    def barrier() -> None:
        cuda_sync()
        dist.barrier(group=group)

    full = torch.randn(opts["shape"], generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for d in opts["dims"]:
        if full.shape[d] % world:
            continue
        reps = opts["reps"] if d == MAIN_DIM else max(5, opts["reps"] // 2)
        shard = cp.split_inputs_cp(full, d, group).clone()
        # Same bits both ways, checked before timing anything.
        if not torch.equal(cp.cat_outputs_cp(shard, d, group), usual_cat(shard, d, group)):
            raise AssertionError(f"cat_outputs_cp differs from the usual gather at seq_dim={d}")
        if not torch.equal(cp.split_inputs_cp(full, d, group), usual_split(full, d, group)):
            raise AssertionError(f"split_inputs_cp differs from the usual split at seq_dim={d}")
        pairs = {
            "cat": (partial(usual_cat, shard, d, group), partial(cp.cat_outputs_cp, shard, d, group), barrier),
            "split": (partial(usual_split, full, d, group), partial(cp.split_inputs_cp, full, d, group), cuda_sync),
        }
        for op, (usual, ours, sync) in pairs.items():
            times: dict[str, list[float]] = {"usual": [], "ours": []}
            # A split costs a few ms and no communication: it gets three times the repetitions.
            op_reps = reps if op == "cat" else 3 * reps
            for rep in range(op_reps + opts["warmup"]):
                order = (("usual", usual), ("ours", ours)) if rep % 2 == 0 else (("ours", ours), ("usual", usual))
                for name, fn in order:
                    seconds = across_ranks(_timed(fn, sync))
                    if rep >= opts["warmup"]:
                        times[name].append(seconds)
            rows.append({"op": op, "dim": d, "shard": list(shard.shape), "reps": op_reps,
                         "usual": statistics.median(times["usual"]), "ours": statistics.median(times["ours"]),
                         "ratio": statistics.median(
                             [u / o for u, o in zip(times["usual"], times["ours"], strict=True)])})
    dist.destroy_process_group()
    return rows if rank == 0 else None


# ---------------------------------------------------------------- driver

def run(opts: dict[str, Any], world: int = 2, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Start ``world`` ranks, measure, and return rank 0's rows."""
    return spawn_ranks(_rank_main, world, opts, timeout=timeout, prefix="bench_cp")


def _machine() -> str:
    import torch

    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return (f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, load average {load}; "
            f"python {platform.python_version()}, torch {torch.__version__}")


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; the exit status is 1 when the run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=31, help="timed gathers at seq_dim=2 (half elsewhere; 3x for splits)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)))
    parser.add_argument("--dims", default="2,1,3,4", help="seq_dims to measure (dims not divisible by 2 skipped)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks on 2 cores: 1)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl needs one GPU per rank (cuda:0, cuda:1)")
    args = parser.parse_args(argv)
    opts = {"reps": args.reps, "warmup": args.warmup, "shape": tuple(int(s) for s in args.shape.split(",")),
            "dims": [int(d) for d in args.dims.split(",")], "threads": args.threads, "backend": args.backend}
    start = time.perf_counter()
    try:
        rows = run(opts)
    except Exception as exc:
        print(f"bench_cp failed: {exc}", file=sys.stderr)
        return 1
    mb = 4 * __import__("math").prod(opts["shape"]) / 1e6
    print(f"cp helpers vs the usual inline code: 2 {args.backend} ranks, full tensor {list(opts['shape'])} float32 "
          f"({mb:.1f} MB), {args.threads} thread(s) per rank, median over alternating repetitions")
    print(_machine())
    header = f"{'op':<6} {'seq_dim':>7} {'shard':<22} {'reps':>4} {'usual ms':>9} {'ours ms':>9} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        shard = "[" + ", ".join(map(str, row["shard"])) + "]"
        print(f"{row['op']:<6} {row['dim']:>7} {shard:<22} {row['reps']:>4} {row['usual'] * 1e3:>9.2f} "
              f"{row['ours'] * 1e3:>9.2f} {row['ratio']:>7.2f}x")
    print("usual = zeros_like + all_gather + cat / view + index_select + contiguous; speedup = median(usual/ours)")
    print(f"(bench_cp took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
