"""Run under ``python -m torch.distributed.run`` with 4 CPU processes; driven by tests/test_runtime.py.

``single``: dist_init (gloo, cp 2, pp 2) from a MAGI-1-shaped config, activations through both
stages and back around the ring with several queued receives, then rebuilt as cp 1 x pp 4 and
again as cp 2 x pp 2. ``nodes``: run as 2 "nodes" x 2 processes; DistributedManager.initialize()
starts torch.distributed, dist_init adopts it, one pipeline round, cleanup(). Each rank prints
``OK rank <r>`` on success; any failed check raises, so the launcher exits non-zero.
"""

from __future__ import annotations

import datetime
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parallel_state as ps  # noqa: E402
import scheduler  # noqa: E402
from parallel_state import ParallelStateError, TopologyPlan  # noqa: E402

MICROBATCHES = 3
SHAPE = (2, 3)
TIMEOUT = datetime.timedelta(seconds=60)


def pipeline_round(tag: int) -> scheduler.PPScheduler:
    """Stage 0 feeds microbatches in; each stage adds 100; the last stage sends back to stage 0."""
    sched = scheduler.pp_scheduler()
    assert sched.device == torch.device("cpu"), sched.device
    stage, stages, cp = ps.get_pp_rank(), ps.get_pp_world_size(), ps.get_cp_rank()
    assert sched.next_rank == ps.get_pipeline_model_parallel_next_rank()
    assert sched.prev_rank == ps.get_pipeline_model_parallel_prev_rank()
    for _ in range(MICROBATCHES):  # every receive is posted before any data moves
        sched.queue_irecv_prev(SHAPE, torch.float32)
    dist.barrier()

    def value(m: int, hops: int) -> torch.Tensor:
        return torch.full(SHAPE, 1000.0 * tag + 10 * m + cp + 100 * hops)

    if stage == 0:
        for m in range(MICROBATCHES):
            sched.send_next_data(value(m, 0))
        for m in range(MICROBATCHES):  # the ring: the last stage's output comes back here
            out = sched.queue_irecv_prev_data()
            assert torch.equal(out, value(m, stages - 1)), (tag, m, out)
    else:
        for m in range(MICROBATCHES):
            got = sched.queue_irecv_prev_data()
            assert torch.equal(got, value(m, stage - 1)), (tag, stage, m, got)
            sched.send_next_data(got + 100)
    assert not sched.recv_queue
    return sched


def default_group_timeout() -> datetime.timedelta:
    """The timeout the default (gloo) process group was started with."""
    group = dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout


def check_layout(cp: int, pp: int) -> None:
    plan = TopologyPlan(dist.get_world_size(), cp=cp, pp=pp, order="tp-cp-pp-dp")
    rank = dist.get_rank()
    assert ps.get_context_parallel_global_ranks() == list(plan.group_ranks("cp", rank))
    assert dist.get_process_group_ranks(ps.get_pp_group()) == list(plan.group_ranks("pp", rank))
    assert ps.is_last_tp_cp_rank() == (ps.get_cp_rank() == cp - 1)


def single() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert (ps.resolve_global_rank(), ps.resolve_world_size()) == (rank, world)  # from the environment
    config = SimpleNamespace(engine_config=SimpleNamespace(
        distributed_backend="gloo", distributed_timeout_minutes=1, cp_size=2, pp_size=2))
    ps.dist_init(config)
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert default_group_timeout() == datetime.timedelta(minutes=1)  # the config's timeout
    assert (ps.resolve_global_rank(), ps.resolve_world_size()) == (rank, world)  # from torch.distributed
    assert ps.collective_device() == torch.device("cpu")
    assert ps.is_last_rank() == (rank == world - 1)
    check_layout(2, 2)
    first = pipeline_round(1)

    ps.destroy_model_parallel()
    try:
        scheduler.pp_scheduler()
        raise AssertionError("pp_scheduler() worked after destroy_model_parallel()")
    except ParallelStateError:
        pass
    ps.dist_init(distributed_backend="gloo", cp_size=1, pp_size=4, timeout=TIMEOUT)
    check_layout(1, 4)
    pipeline_round(2)

    ps.destroy_model_parallel()
    ps.dist_init(config)
    check_layout(2, 2)
    again = pipeline_round(3)
    assert again is not first
    try:
        first.queue_irecv_prev(SHAPE, torch.float32)
        raise AssertionError("a scheduler of destroyed groups still worked")
    except ParallelStateError:
        pass
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return rank


def nodes() -> int:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    node = int(os.environ["GROUP_RANK"])
    assert local == rank - 2 * node, (rank, local, node)
    ps.DistributedManager.initialize(timeout=TIMEOUT)
    manager = ps.DistributedManager()
    assert dist.is_initialized() and manager.distributed and manager.launch.launcher == "torchrun"
    assert (manager.rank, manager.local_rank, manager.world_size) == (rank, local, 4)
    assert manager.device == ps.collective_device() == torch.device("cpu") and not manager.cuda
    assert default_group_timeout() == TIMEOUT
    assert (ps.resolve_global_rank(), ps.resolve_world_size()) == (rank, 4)
    ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2, timeout=TIMEOUT)
    check_layout(2, 2)
    pipeline_round(1)
    ps.DistributedManager.cleanup()
    assert not dist.is_initialized() and not ps.is_initialized()
    assert not ps.DistributedManager.is_initialized()
    return rank


if __name__ == "__main__":
    done = {"single": single, "nodes": nodes}[sys.argv[1]]()
    print(f"OK rank {done} local {os.environ['LOCAL_RANK']}", flush=True)
