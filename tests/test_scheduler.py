"""PPScheduler on real gloo ranks: the pipeline ring, FIFO queued receives, lifecycle, teardown, errors."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import warnings

import pytest

import parallel_state as ps
import scheduler
from parallel_state import ParallelStateError, ParallelStateWarning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = datetime.timedelta(seconds=30)


def _init(cp, pp):
    ps.initialize_model_parallel(context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                 order="tp-cp-pp-dp", timeout=TIMEOUT)


def case_ring(pp):
    """Every stage sends its rank to the next stage and checks what the previous one sent."""
    import torch

    _init(4 // pp, pp)
    assert scheduler.pipeline._scheduler is None
    sched = scheduler.pp_scheduler()  # created on first use
    assert scheduler.pp_scheduler() is sched
    rank = torch.distributed.get_rank()
    sched.queue_irecv_prev((3,), torch.int64)
    sched.send_next_data(torch.full((3,), rank, dtype=torch.int64))
    got_queued = sched.queue_irecv_prev_data().tolist()
    # The other pair of calls: an async send and a blocking receive.
    handle = sched.isend_next(torch.tensor([rank * 1.5]))
    got_blocking = sched.recv_prev_data((1,), torch.float32).item()
    handle.wait()
    return dict(next=sched.next_rank, prev=sched.prev_rank, device=str(sched.device),
                pp_ranks=torch.distributed.get_process_group_ranks(sched.group),
                group_is_pp=sched.group is ps.get_pp_group(), queued=got_queued, blocking=got_blocking)


@pytest.mark.parametrize("pp", [2, 4])
def test_ring_over_the_pipeline_group(pools, pp):
    for rank, out in enumerate(pools(4).run(case_ring, pp)):
        ring = out["pp_ranks"]
        stage = ring.index(rank)
        assert out["next"] == ring[(stage + 1) % pp] and out["prev"] == ring[(stage - 1) % pp]
        assert out["group_is_pp"] and out["device"] == "cpu"
        assert out["queued"] == [out["prev"]] * 3
        assert out["blocking"] == out["prev"] * 1.5
        # The ring MAGI-1's loop needs: the last stage sends to the first, the first hears from the last.
        if stage == pp - 1:
            assert out["next"] == ring[0]
        if stage == 0:
            assert out["prev"] == ring[-1]


def case_fifo():
    """Three receives posted before any data moves come back oldest first, each with its own shape and dtype."""
    import torch

    ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2, timeout=TIMEOUT)
    sched = scheduler.pp_scheduler()
    rank = torch.distributed.get_rank()
    specs = [((2, 2), torch.float32), ((5,), torch.int64), ((1, 3), torch.float64)]
    for shape, dtype in specs:
        sched.queue_irecv_prev(shape, dtype)
    assert len(sched.recv_queue) == 3
    torch.distributed.barrier()
    sent = [torch.full(shape, 100 * rank + i).to(dtype) for i, (shape, dtype) in enumerate(specs)]
    handles = [sched.isend_next(t) for t in sent]
    got = [sched.queue_irecv_prev_data() for _ in specs]
    for h in handles:
        h.wait()
    return dict(prev=sched.prev_rank, got=[(list(t.shape), str(t.dtype), t.flatten()[0].item()) for t in got])


def test_queued_receives_are_fifo(pools):
    for out in pools(4).run(case_fifo):
        prev = out["prev"]
        assert out["got"] == [([2, 2], "torch.float32", 100 * prev), ([5], "torch.int64", 100 * prev + 1),
                              ([1, 3], "torch.float64", 100 * prev + 2)]


def case_teardown_and_rebuild():
    """destroy_model_parallel drops the scheduler and its uncollected receives; a rebuild gets a fresh one."""
    import torch

    ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2, timeout=TIMEOUT)
    first = scheduler.pp_scheduler()
    stage = ps.get_pp_rank()
    # Stage 1 posts two receives and stage 0 sends only one; stage 0 posts one nobody answers.
    for _ in range(2 if stage == 1 else 1):
        first.queue_irecv_prev((4,), torch.float32)
    if stage == 0:
        first.send_next_data(torch.ones(4))
    torch.distributed.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.destroy_model_parallel()
    out = {"warnings": [str(w.message) for w in caught if issubclass(w.category, ParallelStateWarning)]}
    for name, call in (("pp_scheduler", scheduler.pp_scheduler),
                       ("stale", lambda: first.queue_irecv_prev((4,), torch.float32)),
                       ("stale_collect", first.queue_irecv_prev_data)):
        try:
            call()
        except ParallelStateError as exc:
            out[name] = str(exc)
    ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2, timeout=TIMEOUT)
    second = scheduler.pp_scheduler()
    out["fresh"] = second is not first and not second.recv_queue
    # The new ring carries new data; nothing left over from the dropped receives interferes.
    second.queue_irecv_prev((4,), torch.float32)
    second.send_next_data(torch.full((4,), 7.0 + torch.distributed.get_rank()))
    out["got"] = second.queue_irecv_prev_data().tolist()
    out["prev"] = second.prev_rank
    return out


def test_teardown_drops_scheduler_and_pending_receives(pools):
    for rank, out in enumerate(pools(4).run(case_teardown_and_rebuild)):
        stage = (rank // 2) % 2  # order tp-cp-pp-dp with cp 2: ranks 0,1 are stage 0
        assert len(out["warnings"]) == 1
        assert f"dropped {2 if stage == 1 else 1} receive(s)" in out["warnings"][0]
        assert "not initialized" in out["pp_scheduler"] and "dist_init" in out["pp_scheduler"]
        assert "destroy_model_parallel() has destroyed" in out["stale"]
        assert "destroy_model_parallel() has destroyed" in out["stale_collect"]
        assert out["fresh"] and out["got"] == [7.0 + out["prev"]] * 4


def case_scheduler_errors():
    import torch

    out = {}
    ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2, timeout=TIMEOUT)
    sched = scheduler.pp_scheduler()
    attempts = {
        "empty_queue": sched.queue_irecv_prev_data,
        "init_twice": scheduler.init_pp_scheduler,
        "wrong_device": lambda: sched.isend_next(torch.empty(2, device="meta")),
        "wrong_buffer": lambda: sched.irecv_prev(torch.empty(2, device="meta")),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except (ParallelStateError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    ps.destroy_model_parallel()
    ps.dist_init(distributed_backend="gloo", cp_size=4, pp_size=1, timeout=TIMEOUT)
    out["created_for_one_stage"] = scheduler.pipeline._scheduler is not None
    for name, attempt in (("one_stage", scheduler.pp_scheduler), ("one_stage_init", scheduler.init_pp_scheduler)):
        try:
            attempt()
        except ParallelStateError as exc:
            out[name] = str(exc)
    return out


def test_scheduler_errors_are_explained(pools):
    for out in pools(4).run(case_scheduler_errors):
        assert out["empty_queue"][0] == "ParallelStateError" and "queue_irecv_prev(shape, dtype) first" \
            in out["empty_queue"][1]
        assert "already initialized" in out["init_twice"][1] and "pp_scheduler()" in out["init_twice"][1]
        assert out["wrong_device"][0] == "ValueError" and "is on meta" in out["wrong_device"][1] \
            and "cpu" in out["wrong_device"][1]
        assert out["wrong_buffer"][0] == "ValueError" and "receive buffer is on meta" in out["wrong_buffer"][1]
        assert out["created_for_one_stage"] is False
        assert "single stage" in out["one_stage"] and "single stage" in out["one_stage_init"]


def test_before_init_says_what_to_call():
    assert not ps.is_initialized()
    for call in (scheduler.pp_scheduler, scheduler.init_pp_scheduler, scheduler.PPScheduler):
        with pytest.raises(ParallelStateError, match=r"parallel_state\.dist_init"):
            call()


IMPORTS = """
import json, sys
import parallel_state
after_ps = sorted(m for m in ("scheduler", "torch", "loguru", "megatron") if m in sys.modules)
import scheduler
after_sched = sorted(m for m in ("torch", "loguru", "megatron") if m in sys.modules)
print(json.dumps([after_ps, after_sched]))
"""


def test_imports_are_light_and_one_way():
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # parallel_state never imports scheduler; neither imports torch, loguru or megatron up front.
    assert json.loads(proc.stdout) == [[], []]
