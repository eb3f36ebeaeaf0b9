"""A pool of real gloo ranks that runs many test cases without restarting processes.

Each worker joins one ``torch.distributed`` world (gloo, a FileStore, loopback sockets) and
then runs module-level functions sent to it, so a test costs a function call, not a process
start. A case that does not answer within its timeout kills the pool, which is rebuilt on
next use: a hang becomes a test failure, never a stuck suite. A rank that dies is reported as
such, after the surviving ranks have answered (they see the death as errors of their own);
the survivors are then shut down politely, and ``exitcodes`` tells how each process ended.
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
    """One or more ranks raised or died; carries each failing rank's exception type, message and traceback.

    ``results`` holds the return values of the ranks that did not fail; a rank that died is
    reported with type ``"RankDied"``.
    """

    def __init__(self, failures: dict[int, tuple[str, str, str]], results: dict[int, Any] | None = None):
        self.failures = failures
        self.results = results or {}
        lines = [f"rank {r}: {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(failures.items())]
        super().__init__("\n".join(lines))


def _worker(rank: int, world_size: int, store_path: str, conn: Any, path: list[str], env: dict[str, str],
            timeout: float) -> None:
    sys.path[:] = path
    os.environ.update(env)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
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

    def __init__(self, world_size: int, *, start_timeout: float = 120.0, env: dict[str, str] | None = None,
                 default_timeout: float = 60.0):
        """``default_timeout``: seconds, the timeout of the default process group on every rank."""
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix=f"rankpool{world_size}-")
        store = os.path.join(self._dir.name, "store")
        ctx = mp.get_context("spawn")
        # One intra-op thread per rank: the ranks already outnumber the cores.
        worker_env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})}
        self._ranks: list[_Rank] = []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker,
                               args=(r, world_size, store, child, list(sys.path), worker_env, default_timeout),
                               daemon=True, name=f"rank{r}")
            proc.start()
            child.close()
            self._ranks.append(_Rank(proc, parent))
        self.broken = self._closed = False
        self._collect(start_timeout, "start")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        import time
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str, str]] = {}
        pending = dict(enumerate(self._ranks))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # A dead rank's pipe reads as EOF and its sentinel fires; wait for either, from any rank.
            ready = set(wait([x for rank in pending.values() for x in (rank.conn, rank.proc.sentinel)], left))
            for r, rank in list(pending.items()):
                if rank.conn not in ready and rank.proc.sentinel not in ready:
                    continue
                try:
                    if rank.conn in ready or rank.conn.poll():
                        status, value = rank.conn.recv()
                        (results if status in ("ok", "ready") else failures)[r] = value
                        del pending[r]
                        continue
                except (EOFError, OSError):
                    pass
                rank.proc.join(5)
                failures[r] = ("RankDied", f"rank {r} died during {what} (exit code {rank.proc.exitcode})", "")
                del pending[r]
        dead = [r for r, f in failures.items() if f[0] == "RankDied"]
        if pending:
            self.close(kill=True)
            raise TimeoutError(
                f"rank(s) {sorted(pending)} did not answer {what} within {timeout:.0f}s; pool killed"
                + (f"; rank(s) {dead} died" if dead else "")
                + "".join(f"\nrank {r}: {t}: {m}" for r, (t, m, _) in sorted(failures.items()))
            )
        if dead:
            self.close()  # the world lost a rank: let the survivors leave politely
            raise RankFailure(failures, results)
        if failures:
            raise RankFailure(failures, results)
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

    @property
    def exitcodes(self) -> list[int | None]:
        """Each worker process's exit code (None while it runs)."""
        return [rank.proc.exitcode for rank in self._ranks]

    def close(self, kill: bool = False) -> None:
        """Stop the workers: politely (each leaves its world and exits) unless ``kill``."""
        if self._closed:
            return
        if not kill:
            for rank in self._ranks:
                if rank.proc.is_alive():
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
        self.broken = self._closed = True
        self._dir.cleanup()
