"""initialize + destroy at simulated world sizes: parallel_state against megatron-core.

torch's fake process-group backend lets one process pretend to be one rank of a world of any
size: group creation does all of its Python work but no communication, so the figure is the
Python cost a rank pays before any communicator exists. Each implementation and world size
runs in a fresh interpreter, because the fake world is process-global. Both skip the gloo side
groups (``create_gloo_process_groups=False``: gloo cannot rendezvous on a fake store), and
parallel_state skips its one consistency collective (``check_consistency=False``), which the
fake backend cannot answer and megatron-core does not have.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.harness import emit, median, ratio, run_worker, table

IMPLS = ("parallel_state", "megatron-core")
DEFAULT_SIZES = (8, 1024, 4096, 16384)


def _worker(impl: str, world: int, rank: int, sizes: dict[str, int], repeat: int) -> dict[str, Any]:
    """In a fresh interpreter: time ``repeat`` initialize/destroy cycles of one simulated rank."""
    import gc
    import time
    import warnings

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    if impl == "parallel_state":
        import parallel_state as ps

        extra: dict[str, Any] = {"check_consistency": False}
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as ps
        extra = {}
    kwargs = dict(tensor_model_parallel_size=sizes["tp"], context_parallel_size=sizes["cp"],
                  pipeline_model_parallel_size=sizes["pp"], expert_model_parallel_size=sizes["ep"],
                  create_gloo_process_groups=False, **extra)
    init, destroy = [], []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        ps.initialize_model_parallel(**kwargs)
        t1 = time.perf_counter()
        ps.destroy_model_parallel()
        t2 = time.perf_counter()
        init.append(t1 - t0)
        destroy.append(t2 - t1)
    # One more, untimed cycle counts the new_group calls and the groups this rank ends up in.
    real_new_group, calls = dist.new_group, [0]

    def counting_new_group(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real_new_group(*args, **kw)

    dist.new_group = counting_new_group
    try:
        before = len(c10d._world.pg_map)
        ps.initialize_model_parallel(**kwargs)
        member_of = len(c10d._world.pg_map) - before
        ps.destroy_model_parallel()
    finally:
        dist.new_group = real_new_group
    return {"init": init, "destroy": destroy, "new_group_calls": calls[0], "member_of": member_of}


def measure(world: int, sizes: dict[str, int], repeat: int, timeout: float) -> dict[str, dict[str, Any]]:
    """Both implementations at one world size, each in its own fresh interpreter."""
    rank = world // 2 + 1 if world > 2 else world - 1
    out = {}
    for impl in IMPLS:
        out[impl] = run_worker(
            ["-m", "benchmarks.bench_init", "--worker", impl, "--world", str(world), "--rank", str(rank),
             "--tp", str(sizes["tp"]), "--cp", str(sizes["cp"]), "--pp", str(sizes["pp"]), "--ep", str(sizes["ep"]),
             "--repeat", str(repeat)],
            timeout=timeout, what=f"bench_init worker {impl} world={world}",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 0 unless a worker failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_init", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="comma-separated simulated world sizes (default %(default)s)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1, help="expert-model-parallel size of the main rows")
    parser.add_argument("--expert-sizes", default="16384",
                        help="world sizes of the expert rows, which add --expert-ep (default %(default)s; '' for none)")
    parser.add_argument("--expert-ep", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="timed cycles per interpreter; the median is shown")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per worker")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = {"tp": args.tp, "cp": args.cp, "pp": args.pp, "ep": args.ep}
    if args.worker:
        emit(_worker(args.worker, args.world, args.rank, sizes, args.repeat))
        return 0
    rows = []
    runs = [(int(w), sizes, "") for w in args.sizes.split(",") if w]
    runs += [(int(w), {**sizes, "ep": args.expert_ep}, f" (ep {args.expert_ep})") for w in args.expert_sizes.split(",") if w]
    for world, sizes_here, tag in runs:
        res = measure(world, sizes_here, args.repeat, args.timeout)
        ours, theirs = res["parallel_state"], res["megatron-core"]
        t_ours = median([i + d for i, d in zip(ours["init"], ours["destroy"], strict=True)])
        t_theirs = median([i + d for i, d in zip(theirs["init"], theirs["destroy"], strict=True)])
        rows.append([f"{world:,}{tag}", f"{t_ours * 1e3:.2f}", f"{t_theirs * 1e3:.2f}", ratio(t_theirs, t_ours),
                     f"{ours['new_group_calls']:,} / {theirs['new_group_calls']:,}",
                     f"{ours['member_of']} / {theirs['member_of']}"])
        print(f"  world {world:,}{tag}: parallel_state {t_ours * 1e3:.2f} ms, megatron-core {t_theirs * 1e3:.2f} ms",
              flush=True)
    topo = f"tp={args.tp} cp={args.cp} pp={args.pp}" + (f" ep={args.ep}" if args.ep > 1 else "")
    print(table(
        f"initialize_model_parallel + destroy_model_parallel, one simulated rank ({topo}, fake backend)",
        ["world size", "parallel_state ms", "megatron-core ms", "speed-up", "new_group calls (ours / mc)",
         "groups joined (ours / mc)"],
        rows,
        notes=[f"Median of {args.repeat} cycles, each implementation and size in a fresh interpreter; "
               f"create_gloo_process_groups=False for both, check_consistency=False for parallel_state.",
               "new_group calls: how many times one rank called torch.distributed.new_group in one initialize.",
               "Every group megatron-core builds is built by both: expert, embedding, position-embedding and "
               "distributed-optimizer-instance groups included; rows marked (ep N) add expert parallelism."],
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
