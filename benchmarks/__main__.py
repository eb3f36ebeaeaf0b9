"""``python -m benchmarks [NAME ...] [-- OPTION ...]``: run every ``benchmarks/bench_*.py`` (or the named ones) in turn.

Options after ``--`` go to the one named benchmark (``python -m benchmarks gpu -- --device cpu --tiny``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
import traceback


def available() -> list[str]:
    """The benchmark modules, by short name (``init`` for ``bench_init.py``), sorted."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([here]) if m.name.startswith("bench_"))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks with their defaults; the exit status is 1 when any of them failed."""
    names = available()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all of {names})")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, rest = parser.parse_args(argv[:cut]), argv[cut + 1:]
    unknown = [n for n in args.names if n not in names]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {names}")
    if rest and len(args.names) != 1:
        parser.error(f"options after -- ({' '.join(rest)}) go to one benchmark: name exactly one, got {args.names}")
    failed: list[str] = []
    for name in args.names or names:
        print(f"## bench_{name}", flush=True)
        start = time.perf_counter()
        try:
            status = importlib.import_module(f"benchmarks.bench_{name}").main(rest)
        except Exception:  # keep going: one broken benchmark must not hide the others' tables
            traceback.print_exc()
            status = 1
        if status:
            failed.append(name)
        print(f"(bench_{name}: {time.perf_counter() - start:.0f} s)\n", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
