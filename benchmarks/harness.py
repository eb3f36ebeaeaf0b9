"""What every benchmark shares: the machine line, fresh-subprocess runs, and side-by-side tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from importlib import metadata
from typing import Any, Callable, Sequence

#: The repository root: benchmarks run the packages of this checkout, not an installed copy.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Marks the line a worker subprocess prints its JSON result on, so stray output cannot confuse the parent.
RESULT_TAG = "BENCH-RESULT "


def _version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> str:
    """One line naming what the figures were measured on (load matters: the numbers are wall time)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    try:
        load = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "load average unknown"
    return (
        f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs ({usable} usable), {load}; "
        f"python {platform.python_version()}, torch {_version('torch')}, megatron-core {_version('megatron-core')}"
    )


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker subprocess: this checkout first on the path, quiet warnings."""
    env = dict(os.environ)
    # Cached bytecode, as every installed package has it (pip compiles at install): without it each
    # fresh interpreter compiles this checkout from source, and the timings measure the compiler.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.update(extra or {})
    return env


def emit(result: Any) -> None:
    """Print a worker's result for :func:`run_worker` to read."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def parse(stdout: str, what: str) -> Any:
    """The result a worker printed with :func:`emit`."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"{what} printed no result; its output was:\n{stdout[-2000:]}")


def run_worker(args: Sequence[str], *, timeout: float, what: str) -> Any:
    """Run ``python ARGS`` in a fresh interpreter from the repository root and return what it emitted."""
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed with exit status {proc.returncode}:\n{proc.stderr[-3000:]}")
    return parse(proc.stdout, what)


def run_ranks(module: str, world: int, rank_args: Callable[[int], Sequence[str]], *, timeout: float,
              what: str) -> list[str]:
    """Run ``python -m MODULE ARGS(rank)`` for every rank on 127.0.0.1 and return each one's stdout.

    The ranks rendezvous through a TCPStore this process serves on a free port, passed as
    ``--port``. Every failing rank's stderr is shown: the first to fail is rarely rank 0, whose
    error is then a lost peer.
    """
    import datetime
    import time

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout))
    env = worker_env({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, "-m", module, *rank_args(r), "--port", str(server.port)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for r, proc in enumerate(procs):
            try:
                outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{what}: rank {r} did not finish within {timeout:.0f} s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        del server
    failed = [r for r, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        detail = "\n".join(f"--- rank {r} (exit status {procs[r].returncode}):\n{outputs[r][1][-1500:]}"
                           for r in failed)
        raise RuntimeError(f"{what}: rank(s) {failed} failed\n{detail}")
    return [out for out, _ in outputs]


def spawn_ranks(target: Callable[..., Any], world: int, opts: dict[str, Any], *, timeout: float, prefix: str) -> Any:
    """Start ``target(rank, world, store_path, opts, conn)`` in ``world`` spawned processes; rank 0's reply.

    Each rank sends ``("ok", value)`` or ``("err", text)`` on ``conn``; they rendezvous through
    a FileStore at ``store_path``.
    """
    import multiprocessing as mp
    import tempfile
    import time

    ctx = mp.get_context("spawn")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix=f"{prefix}-") as tmp:
        store = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(rank, world, store, opts, child), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        try:
            deadline = time.monotonic() + timeout
            results = []
            for rank, conn in enumerate(conns):
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"rank {rank} did not finish within {timeout:.0f} s")
                status, value = conn.recv()
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed: {value}")
                results.append(value)
            return results[0]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)


def _answer(measure: Callable[..., Any], rank: int, world: int, store: str, opts: dict[str, Any], conn: Any) -> None:
    import traceback

    try:
        conn.send(("ok", measure(rank, world, store, opts)))
    except BaseException as exc:  # report, so the parent prints why instead of waiting
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def spawn_measure(measure: Callable[..., Any], world: int, opts: dict[str, Any], *, timeout: float, prefix: str) -> Any:
    """:func:`spawn_ranks` for a module-level ``measure(rank, world, store, opts)``: rank 0's return value, or
    the first failing rank's traceback raised here."""
    import functools

    return spawn_ranks(functools.partial(_answer, measure), world, opts, timeout=timeout, prefix=prefix)


def median(values: Sequence[float]) -> float:
    """The median, the figure every table reports (robust to one noisy run)."""
    return statistics.median(values)


def ratio(theirs: float, ours: float) -> str:
    """How many times the comparison's figure is the project's (above 1: the project is faster/smaller)."""
    if ours <= 0:
        return "inf" if theirs > 0 else "-"
    return f"{theirs / ours:.1f}x"


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()) -> str:
    """A plain-text table (Markdown pipe syntax, so it pastes into the README as is)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        padded = (c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        return "| " + " | ".join(padded) + " |"

    out = [f"### {title}", "", line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in cells[1:]]
    out += ["", *notes, machine(), ""]
    return "\n".join(out)
