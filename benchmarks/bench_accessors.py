"""Accessor call cost on real gloo ranks (127.0.0.1): parallel_state against megatron-core.

Every public ``get_*`` / ``is_*`` function of ``megatron.core.parallel_state`` that takes no
required argument is timed (plus ``with_context_parallel=True`` for those that take it) after
each implementation's own ``initialize_model_parallel`` of the same cp x pp topology, in the
same ``--world`` rank processes: parallel_state first (megatron-core not yet imported, so
nothing is bridged), then megatron-core's, so that both live side by side. Only rank 0 times,
while the others wait at a barrier, so the ranks do not compete for the cores; the two
implementations take turns on each row, so a change of load hits both alike. A row is the best
of ``--repeat`` runs of ``--calls`` calls, in ns per call (the loop included, equally for both).
Functions that raise on megatron-core's side in this topology are listed as skipped; names
parallel_state does not have (yet) are shown as missing.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import sys
from typing import Any, Callable

from benchmarks.harness import emit, parse, ratio, run_ranks, table

#: A row: (accessor name, keyword arguments), named as the table shows it.
Row = tuple[str, dict[str, Any]]


def accessor_rows() -> list[Row]:
    """megatron-core's accessors callable without arguments, plus their with_context_parallel=True variants."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as mc

    rows: list[Row] = []
    for name, fn in sorted(vars(mc).items()):
        if not name.startswith(("get_", "is_")) or not inspect.isfunction(fn) or fn.__module__ != mc.__name__:
            continue
        params = inspect.signature(fn).parameters.values()
        if any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in params):
            continue
        rows.append((name, {}))
        if "with_context_parallel" in inspect.signature(fn).parameters:
            rows.append((name, {"with_context_parallel": True}))
    return rows


def label(row: Row) -> str:
    """The row's name as the table shows it."""
    name, kwargs = row
    return name + ("(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")" if kwargs else "")


def _call(module: Any, row: Row, direct: bool = False) -> Callable[[], Any] | str:
    """The row's call on ``module``, or why there is none: "missing" or "raises <type>: <message>".

    The call goes through a ``functools.partial`` (a call from C, the same for both), or, with
    ``direct``, is written out as the statement ``fn(keyword=value)`` of a timeit loop: a call from
    Python code, as user code makes it, which CPython specializes where the callee allows.
    """
    import functools
    import timeit
    import warnings

    name, kwargs = row
    fn = getattr(module, name, None)
    if fn is None:
        return "missing"
    call = functools.partial(fn, **kwargs)  # both implementations pay the same partial
    if direct:
        statement = f"fn({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        timer = timeit.Timer(statement, globals={"fn": fn})
        call.timeit = timer.timeit  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            call()
        except Exception as exc:
            return f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:70] if str(exc) else ''}"
    return call


def _measure(modules: dict[str, Any], rows: list[Row], calls: int, repeat: int, direct: bool = False
             ) -> dict[str, dict[str, Any]]:
    """Each implementation's ns per call for each row (or why it has none), the two taking turns."""
    import functools
    import timeit
    import warnings

    out: dict[str, dict[str, Any]] = {impl: {} for impl in modules}
    for row in rows:
        found = {impl: _call(module, row, direct) for impl, module in modules.items()}
        best = {impl: float("inf") for impl in modules}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core warns on every call of its deprecated names
            for _ in range(repeat):
                for impl, call in found.items():
                    if callable(call):
                        timed = getattr(call, "timeit", None) or functools.partial(timeit.timeit, call)
                        best[impl] = min(best[impl], timed(number=calls) / calls * 1e9)
        for impl, call in found.items():
            out[impl][label(row)] = best[impl] if callable(call) else call
    return out


def _worker(rank: int, world: int, port: int, cp: int, pp: int, rows: list[Row], calls: int,
            repeat: int, direct: bool = False) -> dict[str, Any]:
    """One rank: initialize, time (rank 0), destroy; parallel_state first, then megatron-core."""
    import importlib
    import warnings

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    modules = {}
    for impl, module_name in (("parallel_state", "parallel_state"), ("megatron-core", "megatron.core.parallel_state")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            modules[impl] = importlib.import_module(module_name)
        modules[impl].initialize_model_parallel(context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                                distributed_timeout_minutes=5)
    dist.barrier()
    result = _measure(modules, rows, calls, repeat, direct) if rank == 0 else {}
    dist.barrier()
    for module in modules.values():
        module.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    return result


def run_world(world: int, cp: int, pp: int, rows: list[Row], calls: int, repeat: int,
              timeout: float, direct: bool = False) -> dict[str, Any]:
    """Start ``world`` rank processes and return rank 0's figures."""
    import json


    outputs = run_ranks("benchmarks.bench_accessors", world, lambda r: [
        "--worker", "--rank", str(r), "--world", str(world), "--cp", str(cp), "--pp", str(pp), "--calls", str(calls),
        "--repeat", str(repeat), "--rows", json.dumps(rows), *(["--direct"] if direct else [])], timeout=timeout,
        what="bench_accessors")
    return parse(outputs[0], "bench_accessors rank 0")


def _geomean(values: list[float]) -> float:
    import math

    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    """Print the table; the exit status is 0 unless a rank failed."""
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_accessors", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--direct", action="store_true",
                        help="time calls written in Python code (fn(...) in the timing loop) rather than through "
                             "functools.partial: how user code calls, where CPython specializes the call")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for the world")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rows = [(name, kwargs) for name, kwargs in json.loads(args.rows)]
        emit(_worker(args.rank, args.world, args.port, args.cp, args.pp, rows, args.calls, args.repeat,
                     args.direct))
        return 0
    rows = accessor_rows()
    figures = run_world(args.world, args.cp, args.pp, rows, args.calls, args.repeat, args.timeout, args.direct)
    ours, theirs = figures["parallel_state"], figures["megatron-core"]
    table_rows, skipped = [], []
    for row in rows:
        key = label(row)
        if not isinstance(theirs[key], float):
            skipped.append(f"{key} ({theirs[key]})")
            continue
        mine = ours[key]
        if isinstance(mine, float):
            table_rows.append([key, f"{mine:.0f}", f"{theirs[key]:.0f}", ratio(theirs[key], mine)])
        else:
            table_rows.append([key, mine, f"{theirs[key]:.0f}", "-"])
    timed = [r for r in table_rows if r[3] != "-"]
    notes = [
        f"Rank 0 of {args.world} gloo ranks, cp={args.cp} x pp={args.pp}, each implementation after its own "
        f"initialize_model_parallel; best of {args.repeat} x {args.calls:,} calls, ns per call including the loop "
        f"and {'the call written in the loop (as user code calls)' if args.direct else 'a functools.partial'} "
        f"(equal for both). 'megatron / ours' above 1: parallel_state is faster. "
        f"{len(timed)} of {len(table_rows)} accessors timed on both sides; geometric mean of megatron / ours: "
        f"{_geomean([theirs[r[0]] / ours[r[0]] for r in timed]):.2f}x.",
    ]
    if skipped:
        notes.append("Skipped, raising on megatron-core's side in this topology: " + "; ".join(skipped) + ".")
    print(table(
        f"accessor calls on {args.world} real gloo ranks (127.0.0.1), cp={args.cp} x pp={args.pp}",
        ["accessor", "ours ns", "megatron ns", "megatron / ours"],
        table_rows, notes=notes,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
