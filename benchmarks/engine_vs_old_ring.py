"""The merged engine (cp.engine, transport "ring") against the ring it replaced, on the ring's own cases, one run.

The old ring is ``cp/ring.py`` and ``cp/blocks.py`` of commit 9ef554f (the last with ``_RingAttention``), read
from git and loaded beside today's cp, so both run in the same processes on the same tensors. Cases: the
ring rows of ``bench_attention`` (q, k, v [1, 2048, 8, 8] float32, 2 and 4 gloo ranks), full and causal,
forward + backward, each checked equal (1e-5) to the other before timing; times in rotating order,
the slowest rank's, medians. A one-off (needs a git checkout with that commit), so it is not a ``bench_*``.

``python -m benchmarks.engine_vs_old_ring [--reps N] [--worlds 2,4]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import subprocess
import sys
import types
from typing import Any

from benchmarks.bench_attention import make_qkv, time_in_turns
from benchmarks.harness import spawn_ranks, table

OLD = "9ef554f"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _old_ring() -> types.ModuleType:
    """cp.ring as of OLD, with that commit's cp.blocks, as a module of its own."""
    def load(name: str, path: str) -> types.ModuleType:
        source = subprocess.run(["git", "-C", ROOT, "show", f"{OLD}:{path}"], check=True, capture_output=True,
                                text=True).stdout
        spec = importlib.util.spec_from_loader(name, loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        exec(compile(source, f"{OLD}:{path}", "exec"), module.__dict__)
        return module

    saved = sys.modules.get("cp.blocks")
    sys.modules["cp.blocks"] = load("cp_old_blocks", "cp/blocks.py")  # the old ring imports it by this name
    try:
        return load("cp_old_ring", "cp/ring.py")
    finally:
        if saved is None:
            del sys.modules["cp.blocks"]
        else:
            sys.modules["cp.blocks"] = saved


def _rank_main(rank: int, world: int, store: str, opts: dict[str, Any], conn: Any) -> None:
    try:
        conn.send(("ok", _measure(rank, world, store, opts)))
    except BaseException as exc:
        import traceback

        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _measure(rank: int, world: int, store: str, opts: dict[str, Any]) -> Any:
    import torch
    import torch.distributed as dist

    import cp

    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    old = _old_ring()
    group = dist.group.WORLD
    q, k, v = make_qkv()
    mine = [cp.split_inputs_cp(t, 1, group).contiguous() for t in (q, k, v)]
    grad = torch.randn(mine[0].shape, generator=torch.Generator().manual_seed(1))

    def step(fn: Any, causal: bool) -> Any:
        ins = [t.detach().requires_grad_(True) for t in mine]
        out = fn(*ins, group, causal=causal)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in ins]

    ways = {}
    for causal in (False, True):
        a, b = step(old.ring_attention, causal), step(cp.ring_attention, causal)
        err = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b, strict=True))
        if err > 1e-5:
            raise AssertionError(f"engine differs from the old ring (causal={causal}): {err:.3g}")
        ways[("old ring", causal)] = lambda c=causal: step(old.ring_attention, c)
        ways[("engine", causal)] = lambda c=causal: step(cp.ring_attention, c)
    times = time_in_turns(ways, group, opts)
    dist.destroy_process_group()
    return None if rank else {key: statistics.median(t) * 1e3 for key, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_vs_old_ring", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    opts = {"reps": args.reps, "warmup": args.warmup, "threads": args.threads}
    load = os.getloadavg()[0]
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        r = spawn_ranks(_rank_main, world, opts, timeout=600, prefix="engine_vs_old_ring")
        for causal in (False, True):
            o, e = r[("old ring", causal)], r[("engine", causal)]
            rows.append([world, "causal" if causal else "full", f"{o:.2f}", f"{e:.2f}", f"{o / e:.2f}x"])
    q = make_qkv()[0]
    print(table(f"ring attention, forward + backward: the engine vs the old ring ({OLD}), q, k, v {list(q.shape)} "
                f"float32, gloo ranks", ["ranks", "mask", "old ring ms", "engine ms", "old / engine"], rows,
                [f"median of {args.reps} repetitions in rotating order (slowest rank), {args.threads} thread(s) per "
                 f"rank; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
