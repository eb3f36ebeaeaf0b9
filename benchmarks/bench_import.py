"""Import time of ``parallel_state, cp, scheduler`` against ``import torch`` and megatron-core's parallel_state.

Each figure is the wall time of import statements alone (interpreter start-up excluded), in
fresh interpreters, interleaved so that load on the machine hits every case alike; the table
shows medians. The cost that matters is the one on top of torch, which every user has loaded
anyway, so it is timed in the same interpreter right after ``import torch``: no noise from
comparing two interpreters' torch imports.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.harness import emit, median, ratio, run_worker, table

OURS = "import parallel_state, cp, scheduler"
MEGATRON = "import megatron.core.parallel_state"
#: Each case is a list of statements timed one after the other in one fresh interpreter.
CASES = {
    "ours": [OURS],
    "torch+ours": ["import torch", OURS],
    "torch+megatron": ["import torch", MEGATRON],
}
#: Modules whose presence after the imports tells what came in with them.
HEAVY = ("torch", "megatron", "loguru", "numpy", "yaml", "transformer_engine")
#: The budget from the scale issue: the three packages cost at most this much on top of torch.
BUDGET_S = 0.15


def _worker(statements: list[str]) -> dict[str, Any]:
    import time
    import warnings

    seconds = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for statement in statements:
            t0 = time.perf_counter()
            exec(statement, {})
            seconds.append(time.perf_counter() - t0)
    loaded = sorted({name.split(".")[0] for name in sys.modules} & set(HEAVY))
    return {"seconds": seconds, "heavy": loaded}


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 0 unless a worker failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_import", description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh interpreters per case (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per interpreter")
    parser.add_argument("--worker", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit(_worker(CASES[args.worker]))
        return 0
    runs: dict[str, list[list[float]]] = {k: [] for k in CASES}
    heavy: dict[str, list[str]] = {}
    for key in CASES:  # one untimed round writes the checkout's bytecode cache
        run_worker(["-m", "benchmarks.bench_import", "--worker", key], timeout=args.timeout, what="warm-up")
    for _ in range(args.repeat):
        for key in CASES:
            res = run_worker(["-m", "benchmarks.bench_import", "--worker", key], timeout=args.timeout,
                             what=f"bench_import worker {key!r}")
            runs[key].append(res["seconds"])
            heavy[key] = res["heavy"]
    torch_s = median([r[0] for k in ("torch+ours", "torch+megatron") for r in runs[k]])
    alone = median([r[0] for r in runs["ours"]])
    ours_extra = median([r[1] for r in runs["torch+ours"]])
    mc_extra = median([r[1] for r in runs["torch+megatron"]])

    def mods(key: str) -> str:
        return ", ".join(heavy[key]) or "none"

    rows = [
        ["import torch", f"{torch_s:.3f}", "-", "-", "torch"],
        [f"{OURS} (fresh interpreter)", f"{alone:.3f}", "-", "-", mods("ours")],
        [f"{OURS} after import torch", f"{torch_s + ours_extra:.3f}", f"{ours_extra:.3f}", "-", mods("torch+ours")],
        [f"{MEGATRON} after import torch", f"{torch_s + mc_extra:.3f}", f"{mc_extra:.3f}",
         ratio(mc_extra, ours_extra), mods("torch+megatron")],
    ]
    within = "within" if ours_extra <= BUDGET_S else "OVER"
    print(table(
        "Import time (seconds, medians over fresh interpreters)",
        ["import", "total s", "s beyond torch", "megatron-core / ours", "top-level modules loaded (of interest)"],
        rows,
        notes=[f"{args.repeat} interpreters per case. The three packages cost {ours_extra:.3f} s beyond torch "
               f"({within} the {BUDGET_S} s budget); megatron-core's parallel_state costs {mc_extra:.3f} s."],
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
