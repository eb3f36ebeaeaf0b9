"""A pool of real gloo ranks that runs many test cases without restarting processes.

Each worker joins one ``torch.distributed`` world (gloo, a FileStore, loopback sockets) and
then runs module-level functions sent to it, so a test costs a function call, not a process
start. A case that does not answer within its timeout kills the pool, which is rebuilt on
next use: a hang becomes a test failure, never a stuck suite. A rank that dies is reported as
such, after the surviving ranks have answered (they see the death as errors of their own);
the survivors are then shut down politely, and ``exitcodes`` tells how each process ended.

Ranks are forked from a template process that imported torch (and, for ``preload``, more:
megatron-core) once, so a pool starts in a fraction of a second and an 8-rank pool pays one
megatron-core import, not eight. The template never runs torch code, holds one thread, and
forks each rank with only that rank's end of its pipe open.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

#: The load factor's ceiling: a real hang is still reported within minutes on a crowded machine.
MAX_LOAD_FACTOR = 8.0


def load_factor() -> float:
    """How much slower than an idle machine this one runs now: the 1-minute load per core, at least 1.

    Hang guards and the timeouts a case must survive are multiplied by it, so a busy machine
    stretches them instead of turning one slow case into a cascade of timeouts.
    """
    return min(MAX_LOAD_FACTOR, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def scaled(seconds: float) -> datetime.timedelta:
    """``seconds`` stretched by ``load_factor()``, as the timedelta torch.distributed takes."""
    return datetime.timedelta(seconds=seconds * load_factor())


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


def _worker(rank: int, world_size: int, store_path: str, conn: Any, env: dict[str, str], timeout: float) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the driver is gone
            break
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


# --- the template: imports once, forks ranks on request, reports their exit codes ------------------

def _template(ctl: Any, path: list[str], env: dict[str, str], preload: tuple[str, ...]) -> None:
    sys.path[:] = path
    os.environ.update(env)
    import importlib

    import torch.distributed  # noqa: F401  (the import every rank shares)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notices about missing Transformer Engine and Apex
        for name in preload:
            importlib.import_module(name)
    children: dict[int, int] = {}  # pid -> pidfd (or -1)
    ctl.send(("ready", os.getpid()))
    while True:
        fds = [ctl, *(fd for fd in children.values() if fd >= 0)]
        wait(fds, None if all(fd >= 0 for fd in children.values()) else 0.05)
        for pid, fd in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if fd >= 0:
                    os.close(fd)
                del children[pid]
                ctl.send(("exit", pid, os.waitstatus_to_exitcode(status)))
        if not ctl.poll():
            continue
        try:
            msg = ctl.recv()
        except EOFError:
            break
        if msg is None:
            break
        args = msg[1]
        fd = reduction.recv_handle(ctl)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                ctl.close()
                for other in children.values():
                    if other >= 0:
                        os.close(other)
                _worker(*args[:3], Connection(fd), *args[3:])
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(fd)
        children[pid] = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else -1  # the child cannot be reaped yet
        ctl.send(("pid", pid))
    for pid in children:  # the driver is gone: so are its ranks
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Template:
    """The driver's handle on one template process."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]):
        ctx = mp.get_context("spawn")
        self._ctl, child = ctx.Pipe()
        self._proc = ctx.Process(target=_template, args=(child, list(sys.path), env, preload), daemon=True,
                                 name=f"rank template {'+'.join(preload) or 'torch'}")
        self._proc.start()
        child.close()
        self.exitcodes: dict[int, int] = {}
        self._replies: list[Any] = []
        self._reply(("ready",), 300 * load_factor())

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def _reply(self, kind: tuple[str, ...], timeout: float | None) -> Any:
        """Read messages until one of ``kind`` comes, recording exit codes on the way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"the rank template did not answer {kind} within {timeout:.0f}s")
            if not wait([self._ctl, self._proc.sentinel], left):
                continue
            if not self._ctl.poll():
                raise RuntimeError(f"the rank template died (exit code {self._proc.exitcode})")
            msg = self._ctl.recv()
            if msg[0] == "exit":
                self.exitcodes[msg[1]] = msg[2]
            if msg[0] in kind:
                return msg

    def fork(self, args: tuple[Any, ...], conn: Any) -> int:
        self._ctl.send(("fork", args))
        reduction.send_handle(self._ctl, conn.fileno(), self._proc.pid)
        return self._reply(("pid",), 60 * load_factor())[1]

    def exitcode(self, pid: int, timeout: float = 0.0) -> int | None:
        """The exit code of rank ``pid``, waiting up to ``timeout`` seconds for it; None while it runs."""
        deadline = time.monotonic() + timeout
        while pid not in self.exitcodes:
            left = deadline - time.monotonic()
            if left <= 0 and not self._ctl.poll():
                return None
            try:
                self._reply(("exit",), max(left, 0.0) or 0.01)
            except TimeoutError:
                return self.exitcodes.get(pid)
        return self.exitcodes[pid]


_TEMPLATES: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], _Template] = {}


def _template_for(preload: tuple[str, ...], env: dict[str, str]) -> _Template:
    key = (preload, tuple(sorted(env.items())))
    template = _TEMPLATES.get(key)
    if template is None or not template.alive:
        template = _TEMPLATES[key] = _Template(preload, env)
    return template


class _Rank:
    """One forked rank: its pipe, its pid, a sentinel that fires when it ends, and its exit code."""

    def __init__(self, template: _Template, args: tuple[Any, ...]):
        self.conn, child = mp.Pipe()
        self._template = template
        try:
            self.pid = template.fork(args, child)
        finally:
            child.close()
        self.sentinel: Any = self.conn  # without a pidfd, a death shows as the pipe's end of file
        if hasattr(os, "pidfd_open"):
            try:
                self.sentinel = os.pidfd_open(self.pid)
            except ProcessLookupError:  # already gone: the pipe reads as ended
                pass

    def is_alive(self) -> bool:
        return self._template.exitcode(self.pid) is None

    def join(self, timeout: float) -> None:
        self._template.exitcode(self.pid, timeout)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def exitcode(self) -> int | None:
        return self._template.exitcode(self.pid)

    def close(self) -> None:
        self.conn.close()
        if self.sentinel is not self.conn:
            os.close(self.sentinel)


@dataclass
class _Slot:
    proc: _Rank
    conn: Any


class RankPool:
    """``world_size`` gloo ranks in real processes, started once and reused."""

    def __init__(self, world_size: int, *, start_timeout: float = 120.0, env: dict[str, str] | None = None,
                 default_timeout: float = 60.0, preload: tuple[str, ...] = ()):
        """``default_timeout``: seconds, the timeout of the default process group on every rank.

        ``preload``: modules the ranks have imported before the first case (one import for all ranks).
        """
        self.world_size = world_size
        self.preload = tuple(preload)
        self._dir = tempfile.TemporaryDirectory(prefix=f"rankpool{world_size}-")
        store = os.path.join(self._dir.name, "store")
        # One intra-op thread per rank: the ranks already outnumber the cores. No GPU: the ranks are CPU
        # processes on every machine (gloo, CPU tensors), so a case means the same on a GPU machine.
        template = _template_for(self.preload, {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                                                "CUDA_VISIBLE_DEVICES": ""})
        self._ranks: list[_Slot] = []
        self.broken = self._closed = False
        for r in range(world_size):
            rank = _Rank(template, (r, world_size, store, dict(env or {}), default_timeout))
            self._ranks.append(_Slot(rank, rank.conn))
        self._collect(start_timeout, "start")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        timeout *= load_factor()
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

        Raises RankFailure when any rank raised, TimeoutError when any rank did not answer within
        ``timeout`` seconds times ``load_factor()``. With ``cleanup`` every rank destroys the
        model-parallel state afterwards.
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
                rank.proc.join(10 * load_factor())
        for rank in self._ranks:
            if rank.proc.is_alive():
                rank.proc.kill()
                rank.proc.join(5)
        for rank in self._ranks:
            rank.proc.close()
        self.broken = self._closed = True
        self._dir.cleanup()
