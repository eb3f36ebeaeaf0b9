"""A pool of real gloo ranks that runs many test cases without restarting processes.

Each worker joins one ``torch.distributed`` world (gloo, a FileStore, loopback sockets) and
then runs module-level functions sent to it, so a test costs a function call, not a process
start. A case that does not answer within its timeout kills the pool, which is rebuilt on
next use: a hang becomes a test failure, never a stuck suite.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable


class RankFailure(AssertionError):
    """One or more ranks raised; carries each failing rank's exception type, message and traceback."""

    def __init__(self, failures: dict[int, tuple[str, str, str]]):
        self.failures = failures
        lines = [f"rank {r}: {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(failures.items())]
        super().__init__("\n".join(lines))


def _worker(rank: int, world_size: int, store_path: str, conn: Any, path: list[str], env: dict[str, str]) -> None:
    sys.path[:] = path
    os.environ.update(env)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs, cleanup = pickle.loads(msg)
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # report every failure to the driver
            reply = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
        if cleanup:
            try:
                import parallel_state

                parallel_state.destroy_model_parallel()
            except BaseException as exc:
                if reply[0] == "ok":
                    reply = ("err", (type(exc).__name__, f"cleanup: {exc}", traceback.format_exc()))
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result
            conn.send(("err", (type(exc).__name__, f"result not picklable: {exc}", "")))
    dist.destroy_process_group()


@dataclass
class _Rank:
    proc: Any
    conn: Any


class RankPool:
    """``world_size`` gloo ranks in real processes, started once and reused."""

    def __init__(self, world_size: int, *, start_timeout: float = 120.0, env: dict[str, str] | None = None):
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix=f"rankpool{world_size}-")
        store = os.path.join(self._dir.name, "store")
        ctx = mp.get_context("spawn")
        # One intra-op thread per rank: the ranks already outnumber the cores.
        worker_env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})}
        self._ranks: list[_Rank] = []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(r, world_size, store, child, list(sys.path), worker_env),
                               daemon=True, name=f"rank{r}")
            proc.start()
            child.close()
            self._ranks.append(_Rank(proc, parent))
        self.broken = False
        self._collect(start_timeout, "start")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        import time

        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str, str]] = {}
        for r, rank in enumerate(self._ranks):
            left = max(0.0, deadline - time.monotonic())
            try:
                ready = rank.conn.poll(left)
            except (EOFError, OSError):
                ready = False
            if not ready:
                self.close(kill=True)
                raise TimeoutError(f"rank {r} did not answer {what} within {timeout:.0f}s; pool killed")
            try:
                status, value = rank.conn.recv()
            except (EOFError, OSError) as exc:
                self.close(kill=True)
                raise RankFailure({r: ("EOFError", f"rank {r} died during {what}", repr(exc))}) from None
            if status == "ok" or status == "ready":
                results[r] = value
            else:
                failures[r] = value
        if failures:
            raise RankFailure(failures)
        return [results[r] for r in range(len(self._ranks))]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, cleanup: bool = True,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return each rank's result, in rank order.

        Raises RankFailure when any rank raised, TimeoutError when any rank did not answer.
        With ``cleanup`` every rank destroys the model-parallel state afterwards.
        """
        if self.broken:
            raise RuntimeError("this pool was killed by an earlier failure")
        msg = pickle.dumps((fn, args, kwargs, cleanup))
        for rank in self._ranks:
            rank.conn.send(msg)
        return self._collect(timeout, getattr(fn, "__name__", "the case"))

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely unless ``kill``)."""
        if not kill and not self.broken:
            for rank in self._ranks:
                try:
                    rank.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for rank in self._ranks:
                rank.proc.join(10)
        for rank in self._ranks:
            if rank.proc.is_alive():
                rank.proc.kill()
                rank.proc.join(5)
        self.broken = True
        self._dir.cleanup()
