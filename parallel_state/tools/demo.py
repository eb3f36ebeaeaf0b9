"""``python -m parallel_state demo``: validate the request, then start the ranks with PyTorch's launcher.

The rank program is ``examples/parallel_state_demo.py`` (with its model, ``examples/demo_dit.py``)
in the source checkout, not a module of this package: it uses ``cp`` and ``scheduler``, which
depend on ``parallel_state``, never the other way round, and as an example it does not belong in
site-packages. This module only launches it, by path, in worker processes started by
``torch.distributed``'s elastic agent; it never imports it. So the demo runs from a clone after
``pip install -e .``; an installed wheel has no examples and says so.

Everything binds to 127.0.0.1: the launcher's TCPStore listens on a socket bound to loopback
before the agent starts (the agent's static rendezvous reuses it through ``multi_tenant``), the
workers get ``MASTER_ADDR=127.0.0.1`` and gloo uses the loopback interface.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from parallel_state.tools.plan_report import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    CliError,
    int_list,
    make_plan,
    parse_mask,
    split_report,
)

#: The rank program, relative to the checkout's root.
RANK_PROGRAM = os.path.join("examples", "parallel_state_demo.py")
#: dist_init's layout; with cp * pp == world size it equals Megatron's default.
DEMO_ORDER = "tp-cp-pp-dp"


@dataclass(frozen=True)
class DemoConfig:
    """A validated demo request."""

    nproc: int
    topologies: tuple[tuple[int, int], ...]  # (cp, pp) per build, in order
    latent: tuple[int, ...]
    patch: tuple[int, int, int]
    timeout: float
    corrupt_rank: int | None = None
    mask: str = "full"  # the DiT's attention mask; anything else runs the autoregressive variant

    def rank_args(self) -> list[str]:
        """The rank program's command line."""
        (cp, pp), (cp2, pp2) = self.topologies
        args = ["--cp", str(cp), "--pp", str(pp), "--rebuild-cp", str(cp2), "--rebuild-pp", str(pp2),
                "--latent", ",".join(map(str, self.latent)), "--patch", ",".join(map(str, self.patch)),
                "--timeout", str(self.timeout)]
        if self.corrupt_rank is not None:
            args += ["--corrupt-rank", str(self.corrupt_rank)]
        if self.mask != "full":
            args += ["--mask", self.mask]
        return args


def default_topologies(nproc: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """cp 2 x pp nproc/2 (cp nproc x pp 1 for odd nproc), then a different one: cp nproc x pp 1, or cp 1 x pp nproc."""
    first = (2, nproc // 2) if nproc % 2 == 0 else (nproc, 1)
    second = (nproc, 1) if first != (nproc, 1) else (1, nproc)
    return first, second


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Check everything that can be checked before a process starts; CliError otherwise."""
    nproc = args.nproc
    if nproc < 1:
        raise CliError(f"--nproc must be >= 1, got {nproc}")
    first, second = default_topologies(nproc)
    cp = args.cp if args.cp is not None else (first[0] if args.pp is None else nproc // max(args.pp, 1))
    pp = args.pp if args.pp is not None else max(nproc // max(cp, 1), 1)
    if args.rebuild_cp is None and args.rebuild_pp is None:
        cp2, pp2 = second if (cp, pp) != second else first
    else:
        cp2 = args.rebuild_cp if args.rebuild_cp is not None else nproc // max(args.rebuild_pp, 1)
        pp2 = args.rebuild_pp if args.rebuild_pp is not None else max(nproc // max(cp2, 1), 1)
    latent = int_list("--latent", args.latent, 5, "B,C,T,H,W")
    patch = int_list("--patch", args.patch, 3, "pT,pH,pW")
    for flag_cp, flag_pp, c, p in (("--cp", "--pp", cp, pp), ("--rebuild-cp", "--rebuild-pp", cp2, pp2)):
        if c < 1 or p < 1:
            raise CliError(f"{flag_cp} and {flag_pp} must be >= 1, got cp {c} and pp {p}")
        if c * p != nproc:
            raise CliError(f"{flag_cp} {c} x {flag_pp} {p} = {c * p} ranks, but --nproc is {nproc}; the demo runs "
                           f"dist_init, which needs cp * pp == world size")
        plan = make_plan(nproc, 1, c, p, DEMO_ORDER)
        split = split_report(plan, latent, patch, 1)  # type: ignore[arg-type]
        if not split.ok:
            sizes = ", ".join(map(str, split.suggested_cp_sizes))
            raise CliError(f"--latent {args.latent} cannot be split with cp {c}: {split.error} "
                           f"(cp sizes that can, for {nproc} ranks: {sizes})")
        t_, h_, _ = split.per_rank or (0, 0, 0)
        cp_t, cp_h = split.cp_size_t or 1, split.cp_size_h or 1
        if t_ * cp_t != latent[2] or h_ * cp_h != latent[3]:
            raise CliError(f"--latent {args.latent}: find_split gives per-rank [T', H'] = [{t_}, {h_}] for cp {c}, "
                           f"which does not tile T={latent[2]}, H={latent[3]} evenly; choose T and H divisible by "
                           f"the patch sizes")
    if not args.timeout > 0:
        raise CliError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.corrupt_rank is not None and not 0 <= args.corrupt_rank < nproc:
        raise CliError(f"--corrupt-rank must name one of the {nproc} ranks, got {args.corrupt_rank}")
    mask = getattr(args, "mask", "full")
    parse_mask("--mask", mask, 1)  # its form only: the tokens per frame are known once the ranks plan the DiT
    return DemoConfig(nproc, ((cp, pp), (cp2, pp2)), latent, patch, float(args.timeout), args.corrupt_rank, mask)


def _source_root() -> str:
    """The directory that holds this ``parallel_state`` package (a clone's root after ``pip install -e .``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # parallel_state/tools/demo.py
    return os.path.dirname(package)


def _rank_program(root: str) -> str:
    """The rank program's path, or an error saying where it is expected and how to get it."""
    path = os.path.join(root, RANK_PROGRAM)
    if os.path.isfile(path):
        return path
    raise CliError(f"the demo's rank program {RANK_PROGRAM} is not in {root}: it ships with the source, not the "
                   f"wheel; run the demo from a clone of the project after 'pip install -e .'")


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    # The elastic agent hands its own environment to the workers.
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    # The agent logs every worker start and stop; the demo prints its own one-line outcome.
    logger = logging.getLogger("torch.distributed.elastic")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _DemoTimeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _DemoTimeout in the launcher after ``seconds``; the agent then stops every worker."""
    if not _in_main_thread() or not hasattr(signal, "SIGALRM"):  # signals reach the main thread only
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _DemoTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _loopback_store() -> tuple[Any, int]:
    """A TCPStore server listening on 127.0.0.1 only, on a free port chosen by the OS."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # multi_tenant: the agent's static rendezvous asks for a master store on this port and
    # gets this server back instead of binding every interface itself.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, master_listen_fd=sock.fileno(),
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    return (store, sock), port


def _failure_line(exc: Any) -> str:
    failures = getattr(exc, "failures", {}) or {}
    parts = []
    for rank, failure in sorted(failures.items()):
        code = getattr(failure, "exitcode", None)
        how = (f"stopped by signal {-code}" if isinstance(code, int) and code < 0
               else f"exited with code {code}")
        parts.append(f"rank {rank} {how}")
    return "; ".join(parts) or str(exc)


def run_demo(args: argparse.Namespace) -> int:
    """Launch the demo's ranks and return the exit code (0 only when every check on every rank passed)."""
    config = config_from_args(args)
    root = _source_root()
    program = _rank_program(root)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    keep_alive, port = _loopback_store()
    (cp, pp), (cp2, pp2) = config.topologies
    print(f"parallel_state demo: {config.nproc} CPU rank{'s' * (config.nproc != 1)} (gloo) started by "
          f"torch.distributed's elastic launcher on 127.0.0.1:{port}; topologies cp {cp} x pp {pp}, "
          f"then cp {cp2} x pp {pp2}", flush=True)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=config.nproc,
        run_id=f"parallel_state_demo_{uuid.uuid4().hex[:8]}",
        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0, "timeout": 60},
        local_addr="127.0.0.1", max_restarts=0, monitor_interval=0.1, start_method="spawn",
    )
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(PYTHONPATH=pythonpath, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        with _environment(**env), _quiet_elastic_logs(), _deadline(config.timeout):
            elastic_launch(launch, sys.executable)(program, *config.rank_args())
    except ChildFailedError as exc:
        raise CliError(f"demo FAILED: {_failure_line(exc)} (each failing rank printed its reason above)",
                       EXIT_CHECK_FAILED) from None
    except SignalException as exc:  # Ctrl-C or a kill: the agent has already stopped the ranks
        raise CliError(f"demo stopped by signal {getattr(exc, 'sigval', '?')}; the ranks were stopped too",
                       EXIT_CHECK_FAILED) from None
    except _DemoTimeout:
        raise CliError(f"demo FAILED: stopped after --timeout {config.timeout:g} s; the ranks were still running "
                       f"(raise --timeout on a busy machine)", EXIT_CHECK_FAILED) from None
    finally:
        del keep_alive
    sys.stdout.flush()
    print(f"parallel_state demo: all ranks exited cleanly after {time.monotonic() - start:.1f} s", flush=True)
    return EXIT_OK
