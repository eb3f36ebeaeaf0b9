"""Switching topology in a long-lived worker: cold init, warm switch (group cache on), megatron-core.

A fresh world of ``--world`` real gloo processes (127.0.0.1) per row cycles four topologies
(cp 8; cp 4; cp 2 x pp 2; tp 2 x cp 4 on 8 ranks) for ``--rounds`` rounds, each switch a
``destroy_model_parallel()`` then ``initialize_model_parallel()``:
- cold: parallel_state with the cache off (every switch builds every group);
- warm: parallel_state with ``enable_group_cache()``; the first round builds, later switches reuse;
- megatron-core: its own destroy + initialize (which leaks the old groups instead of freeing them).
A switch's figure is its slowest rank's; the table shows the median switch of the rounds after the
first (the warm row's steady state), the process groups created after the first round, and the
groups alive at the end (``_world.pg_map`` less the default group).
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

from benchmarks.harness import emit, median, parse, ratio, run_ranks, table

ROWS = ("cold", "warm", "megatron-core")


def _topologies(world: int) -> list[dict[str, int]]:
    return [dict(context_parallel_size=world), dict(context_parallel_size=world // 2),
            dict(context_parallel_size=2, pipeline_model_parallel_size=2),
            dict(tensor_model_parallel_size=2, context_parallel_size=world // 2)]


def _worker(row: str, rank: int, world: int, port: int, rounds: int) -> dict[str, Any]:
    """One rank: join the world, time every switch, count groups created and alive."""
    import warnings

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    if row == "megatron-core":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as ps
    else:
        import parallel_state as ps

        if row == "warm":
            ps.enable_group_cache()
    kwargs = {} if row == "megatron-core" else {"timeout": timeout}
    before = len(c10d._world.pg_map)
    real_new_group, calls = dist.new_group, [0]

    def counting_new_group(*args: Any, **kw: Any) -> Any:  # both implementations create through it
        calls[0] += 1
        return real_new_group(*args, **kw)

    dist.new_group = counting_new_group
    times, created_later = [], 0
    for r in range(rounds):
        for topology in _topologies(world):
            dist.barrier()
            made = calls[0]
            t0 = time.perf_counter()
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(**topology, **kwargs)
            times.append(time.perf_counter() - t0)
            if r:
                created_later += calls[0] - made
    dist.new_group = real_new_group
    ps.destroy_model_parallel()
    dist.barrier()
    alive = len(c10d._world.pg_map) - before
    if row == "warm":
        ps.clear_group_cache()
    dist.destroy_process_group()
    return {"times": times, "created_later": created_later, "alive": alive}


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 0 unless a rank failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_switch", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per world")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit(_worker(args.worker, args.rank, args.world, args.port, args.rounds))
        return 0
    n = len(_topologies(args.world))
    fig = {}
    for row in ROWS:
        # megatron-core keeps every group it ever built (its destroy forgets them), so each of its
        # switches gets slower: a few rounds show its steady cost without running for many minutes.
        rounds = min(args.rounds, 3) if row == "megatron-core" else args.rounds
        outputs = run_ranks("benchmarks.bench_switch", args.world, lambda r, row=row, rounds=rounds: [
            "--worker", row, "--rank", str(r), "--world", str(args.world), "--rounds", str(rounds)],
            timeout=args.timeout, what=f"bench_switch {row}")
        ranks = [parse(out, f"bench_switch {row} rank {r}") for r, out in enumerate(outputs)]
        slowest = [max(rank["times"][i] for rank in ranks) for i in range(len(ranks[0]["times"]))]
        fig[row] = (median(slowest[n:]), max(r["created_later"] for r in ranks), max(r["alive"] for r in ranks))
        print(f"  {row}: {fig[row][0] * 1e3:.1f} ms", flush=True)
    cold = fig["cold"][0]
    rows = [[row, f"{t * 1e3:.1f}", ratio(cold, t), created, alive] for row, (t, created, alive) in fig.items()]
    print(table(
        f"topology switch (destroy + initialize) on {args.world} real gloo ranks, 4 topologies x {args.rounds} rounds",
        ["row", "median switch ms", "vs cold", "new_group calls after round 1 (max per rank)",
         "groups alive at the end"],
        rows,
        notes=["Topologies: cp 8; cp 4; cp 2 x pp 2; tp 2 x cp 4 (world 8). Median over the switches after the "
               "first round of the slowest rank's destroy + initialize; a fresh world per row, all in the same "
               "run. 'warm' keeps groups in the cache across switches (alive at the end: before "
               "clear_group_cache); megatron-core's destroy forgets its groups without freeing them, so its "
               f"row runs {min(args.rounds, 3)} rounds (its leaked groups slow every later switch)."],
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
