"""initialize + destroy on real gloo ranks (127.0.0.1): parallel_state against megatron-core.

For each implementation a fresh world of ``--world`` real processes (gloo, a TCPStore on
127.0.0.1 hosted by this driver) times ``--cycles`` initialize/destroy cycles of a cp x pp
topology with megatron-core's default arguments; ``--no-gloo-groups`` adds worlds that pass
``create_gloo_process_groups=False``. A cycle's figure is its slowest rank's (the topology is
ready when every rank is); the table shows the median cycle, and how many process groups
torch still holds (``_world.pg_map``, the default group excluded) after all the cycles:
megatron-core's destroy_model_parallel forgets its groups without destroying them, and every
leaked gloo group keeps threads and sockets alive, so its later cycles slow down.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

from benchmarks.harness import emit, median, parse, ratio, run_ranks, table

IMPLS = ("parallel_state", "megatron-core")
MODES = {"defaults": {}, "create_gloo_process_groups=False": {"create_gloo_process_groups": False}}


def _worker(impl: str, mode: str, rank: int, world: int, port: int, cp: int, pp: int, cycles: int) -> dict[str, Any]:
    """One rank: join the gloo world, time the cycles, count the groups left alive."""
    import warnings

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    if impl == "parallel_state":
        import parallel_state as ps
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as ps
    before = len(c10d._world.pg_map)
    times = []
    for _ in range(cycles):
        dist.barrier()
        t0 = time.perf_counter()
        ps.initialize_model_parallel(context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                     distributed_timeout_minutes=2, **MODES[mode])
        ps.destroy_model_parallel()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    alive = len(c10d._world.pg_map) - before
    dist.destroy_process_group()
    return {"times": times, "alive": alive}


def run_world(impl: str, mode: str, world: int, cp: int, pp: int, cycles: int, timeout: float) -> list[dict[str, Any]]:
    """Start ``world`` rank processes for ``impl`` and return every rank's result."""

    outputs = run_ranks("benchmarks.bench_gloo", world, lambda r: [
        "--worker", impl, "--mode", mode, "--rank", str(r), "--world", str(world), "--cp", str(cp), "--pp", str(pp),
        "--cycles", str(cycles)], timeout=timeout, what=f"bench_gloo {impl}")
    return [parse(out, f"bench_gloo {impl} rank {r}") for r, out in enumerate(outputs)]


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 0 unless a rank failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_gloo", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per world")
    parser.add_argument("--no-gloo-groups", action="store_true",
                        help="also run worlds with create_gloo_process_groups=False")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=sorted(MODES), default="defaults", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit(_worker(args.worker, args.mode, args.rank, args.world, args.port, args.cp, args.pp, args.cycles))
        return 0
    rows = []
    for mode in list(MODES)[: 2 if args.no_gloo_groups else 1]:
        fig = {}
        for impl in IMPLS:
            ranks = run_world(impl, mode, args.world, args.cp, args.pp, args.cycles, args.timeout)
            # A cycle is done when its slowest rank is.
            slowest = [max(rank["times"][c] for rank in ranks) for c in range(args.cycles)]
            fig[impl] = (median(slowest), max(rank["alive"] for rank in ranks))
            print(f"  {mode}: {impl} {fig[impl][0] * 1e3:.1f} ms", flush=True)
        (ours, ours_alive), (theirs, theirs_alive) = fig["parallel_state"], fig["megatron-core"]
        rows.append([mode, f"{ours * 1e3:.1f}", f"{theirs * 1e3:.1f}", ratio(theirs, ours),
                     f"{ours_alive} / {theirs_alive}"])
    print(table(
        f"initialize + destroy on {args.world} real gloo ranks (127.0.0.1), cp={args.cp} x pp={args.pp}",
        ["arguments", "parallel_state ms", "megatron-core ms", "speed-up",
         f"groups alive after {args.cycles} cycles (ours / mc)"],
        rows,
        notes=[f"Median over {args.cycles} cycles of the slowest rank's initialize+destroy; a fresh world of "
               f"{args.world} processes per implementation and row, all in the same run. 'defaults': every other "
               f"argument at megatron-core's default (parallel_state then also runs its consistency check)."],
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
