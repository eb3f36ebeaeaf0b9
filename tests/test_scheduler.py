"""PPScheduler on real gloo ranks: the pipeline ring, FIFO queued receives, lifecycle, teardown, errors."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import warnings
from collections import deque

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


# --- MAGI-1's calling pattern: dropped send handles, receives queued ahead, samples in flight ----------

#: Sequence lengths of the samples in flight (each splits evenly over cp 2) and the toy DiT's sizes.
SAMPLE_ROWS = (8, 12, 4)
HIDDEN, BLOCKS, STEPS, DT = 4, 4, 3, 0.25


def dit_weights():
    from cpgroups import data

    return data((BLOCKS, HIDDEN, HIDDEN), seed=46) / HIDDEN


def dit_block(full, weight):
    """One block over the whole sequence (all cp ranks' rows): it mixes rows, as attention does."""
    import torch

    return torch.tanh(full @ weight) + full.mean(0)


def dit_head(hidden):
    """The velocity: a view of a wider output, so not contiguous, like the slices MAGI-1's DiT returns."""
    import torch

    return torch.cat([-hidden, hidden], dim=1).chunk(2, dim=1)[0]


def one_process_samples():
    """What MAGI-1's walk gives in one process: each sample integrated STEPS times through every block."""
    from cpgroups import data

    weights, out = dit_weights(), []
    for i, rows in enumerate(SAMPLE_ROWS):
        x = data((rows, HIDDEN), seed=i)
        for _ in range(STEPS):
            h = x
            for weight in weights:
                h = dit_block(h, weight)
            x = x + DT * dit_head(h)
        out.append(x)
    return out


def magi_walk(pieces):
    """SampleTransport.walk and the DiT's forward as MAGI-1 writes them, on this rank's rows of each sample.

    Every send's handle is dropped; the first stage queues the receive of each sample's velocity
    right after its forward and collects them oldest first; the last stage sends the velocity back
    to the first. Returns the first stage's integrated rows and the most sends held at once.
    """
    import torch
    import torch.distributed as dist

    sched = scheduler.pp_scheduler()
    stage, stages = ps.get_pp_rank(), ps.get_pp_world_size()
    first, last = stage == 0, stage == stages - 1
    per_stage = BLOCKS // stages
    weights = dit_weights()[stage * per_stage:(stage + 1) * per_stage]
    cp, cp_group = ps.get_cp_world_size(), ps.get_cp_group()
    held = 0

    def block(rows, weight):
        parts = [torch.empty_like(rows) for _ in range(cp)]
        dist.all_gather(parts, rows, group=cp_group)
        return dit_block(torch.cat(parts), weight).chunk(cp)[ps.get_cp_rank()]

    def forward(i):
        nonlocal held
        h = pieces[i].clone() if first else sched.recv_prev_data(pieces[i].shape, pieces[i].dtype)
        for weight in weights:
            h = block(h, weight)
        if not last:
            sched.isend_next(h)
        velocity = dit_head(h)
        if first:
            sched.queue_irecv_prev(velocity.shape, velocity.dtype)
        if last:
            assert not velocity.is_contiguous()
            sched.isend_next(velocity)
        held = max(held, sched.pending_sends)

    for i in range(len(pieces)):
        forward(i)
    work = deque((i, 0) for i in range(len(pieces)))
    while work:
        i, step = work.popleft()
        if first:
            pieces[i] = pieces[i] + DT * sched.queue_irecv_prev_data()
        if step + 1 < STEPS:
            work.append((i, step + 1))
            forward(i)
    return pieces if first else None, held


def case_magi_pipeline(topologies):
    """MAGI-1's dist_init from its config, the walk, destroy_model_parallel; once per (cp, pp), in order."""
    from types import SimpleNamespace

    from cpgroups import data

    out = []
    for cp, pp in topologies:
        ps.dist_init(SimpleNamespace(engine_config=SimpleNamespace(
            distributed_backend="gloo", distributed_timeout_minutes=1, cp_size=cp, pp_size=pp)))
        rank = ps.get_cp_rank()
        pieces = [data((rows, HIDDEN), seed=i).chunk(cp)[rank].clone() for i, rows in enumerate(SAMPLE_ROWS)]
        result, held = magi_walk(pieces)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ps.destroy_model_parallel()  # the last stage's final sends complete here at the latest
        out.append(dict(cp_rank=rank, result=result, held=held,
                        warnings=[str(w.message) for w in caught if issubclass(w.category, ParallelStateWarning)]))
    return out


@pytest.mark.parametrize("world, topologies", [(2, [(1, 2)]), (4, [(1, 4), (2, 2)])])
def test_magi_pipeline_with_dropped_send_handles_equals_one_process(pools, world, topologies):
    import torch

    expected = one_process_samples()
    outs = pools(world).run(case_magi_pipeline, topologies)
    for t, (cp, pp) in enumerate(topologies):
        firsts = [out[t] for out in outs if out[t]["result"] is not None]
        assert len(firsts) == cp  # the first stage's ranks, one per cp rank
        for i, want in enumerate(expected):
            got = torch.cat([out["result"][i] for out in sorted(firsts, key=lambda o: o["cp_rank"])])
            assert torch.equal(got, want), (cp, pp, i)
        for out in outs:
            assert out[t]["warnings"] == []  # every send arrived; every queued receive was collected
            assert 1 <= out[t]["held"] <= scheduler.PPScheduler.max_pending_sends


SOAK_SENDS, SOAK_LIMIT = 600, 8


def case_soak():
    """Stage 0 sends SOAK_SENDS tensors and drops every handle but a few, which it waits on twice."""
    import gc
    import weakref

    import torch

    ps.dist_init(distributed_backend="gloo", pp_size=2, timeout=TIMEOUT)
    sched = scheduler.pp_scheduler()
    sched.max_pending_sends = SOAK_LIMIT
    if ps.get_pp_rank() == 1:
        wrong = sum(not torch.equal(sched.recv_prev_data((2, 64), torch.float32), torch.full((2, 64), float(i)))
                    for i in range(SOAK_SENDS))
        return dict(wrong=wrong)
    alive, held, most_alive = [], 0, 0
    for i in range(SOAK_SENDS):
        tensor = torch.full((2, 64), float(i))
        if i % 2:  # every other one as a non-contiguous view: the scheduler sends (and holds) a copy
            tensor = torch.full((64, 2), float(i)).t()
        else:
            alive.append(weakref.ref(tensor))
        handle = sched.isend_next(tensor)
        if i % 200 == 0:  # the caller may wait, as often as it likes
            handle.wait()
            handle.wait()
        del tensor, handle
        held = max(held, sched.pending_sends)
        alive = [ref for ref in alive if ref() is not None]  # the caller's tensors something still holds
        most_alive = max(most_alive, len(alive))
    sched.wait_sends()
    gc.collect()
    out = dict(held=held, most_alive=most_alive, pending=sched.pending_sends,
               alive=sum(ref() is not None for ref in alive), watchers=[watchers()])
    ps.destroy_model_parallel()  # stops the thread that watched the sends (gloo)
    out["watchers"].append(watchers())
    return out


def watchers():
    import threading

    return sum(thread.name == "PPScheduler sends" for thread in threading.enumerate())


def test_soak_of_dropped_sends_stays_bounded(pools):
    stage0, stage1 = pools(2).run(case_soak)
    assert stage1 == dict(wrong=0)  # every send arrived, in order, with the values sent
    # The scheduler held at most SOAK_LIMIT sends and let go of each tensor once sent: nothing piles up.
    assert 1 <= stage0["held"] <= SOAK_LIMIT and stage0["most_alive"] <= SOAK_LIMIT
    assert stage0["pending"] == 0 and stage0["alive"] == 0
    assert stage0["watchers"] == [1, 0]  # one thread watched the gloo sends; the teardown ended it


def case_stage_left():
    """Stage 1 tears its groups down without receiving; stage 0's sends then fail with an explanation."""
    import torch
    import torch.distributed as dist

    ps.dist_init(distributed_backend="gloo", pp_size=2, timeout=TIMEOUT)
    sched = scheduler.pp_scheduler()
    if ps.get_pp_rank() == 1:
        dist.barrier()
        ps.destroy_model_parallel()  # leaves the pipeline with stage 0's sends unreceived
        dist.barrier()
        return None
    kept = sched.isend_next(torch.ones(3))
    sched.isend_next(torch.ones(3))  # dropped
    dist.barrier()
    dist.barrier()  # stage 1 has left
    out = {}
    for name, call in (("kept", kept.wait), ("dropped", sched.wait_sends),
                       ("new", lambda: sched.isend_next(torch.ones(3)))):
        try:
            call()
        except ParallelStateError as exc:
            out[name] = str(exc)
    out["pending"] = sched.pending_sends
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.destroy_model_parallel()
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ParallelStateWarning)]
    return out


def test_send_to_a_stage_that_left_fails_with_an_explanation(pools):
    out = pools(2).run(case_stage_left)[0]
    for name in ("kept", "dropped", "new"):
        assert "send to the next pipeline stage (global rank 1) failed" in out[name], (name, out)
        assert "has left" in out[name] and "before either tears down" in out[name]
    assert out["pending"] == 0 and out["warnings"] == []  # each failure was raised once, none left behind


def case_left_before_teardown():
    """Stage 0 drops a send stage 1 never receives and queues a receive stage 1 never answers, holding
    no reference to the scheduler (as MAGI-1); its destroy_model_parallel reports both instead of hanging."""
    import torch
    import torch.distributed as dist

    ps.dist_init(distributed_backend="gloo", pp_size=2, timeout=TIMEOUT)
    if ps.get_pp_rank() == 1:
        dist.barrier()
        ps.destroy_model_parallel()
        dist.barrier()
        return None
    scheduler.pp_scheduler().isend_next(torch.ones(3))  # dropped
    scheduler.pp_scheduler().queue_irecv_prev((3,), torch.float32)
    dist.barrier()
    dist.barrier()  # stage 1 has left
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.destroy_model_parallel()
    return [str(w.message) for w in caught if issubclass(w.category, ParallelStateWarning)]


def test_teardown_reports_a_send_that_never_arrived(pools):
    dropped, failed = pools(2).run(case_left_before_teardown)[0]
    assert "dropped 1 receive(s) posted with queue_irecv_prev()" in dropped
    assert "found 1 send(s) to the next pipeline stage that did not arrive" in failed
    assert "(global rank 1) failed" in failed and "has left" in failed


def case_wait_with_timeout():
    """A wait that times out leaves the send held; it arrives once the next stage receives."""
    import datetime

    import torch
    import torch.distributed as dist

    ps.dist_init(distributed_backend="gloo", pp_size=2, timeout=TIMEOUT)
    sched = scheduler.pp_scheduler()
    if ps.get_pp_rank() == 1:
        dist.barrier()  # receives only after stage 0's wait has timed out
        return sched.recv_prev_data((3,), torch.float32).tolist()
    handle = sched.isend_next(torch.full((3,), 5.0))
    out = {}
    try:
        handle.wait(datetime.timedelta(milliseconds=50))
    except ParallelStateError as exc:
        out["timed_out"] = str(exc)
    out["held"] = (sched.pending_sends, handle.is_completed())
    dist.barrier()
    out["waited"] = handle.wait()
    out["after"] = (sched.pending_sends, handle.is_completed())  # let go of at the scheduler's next call
    sched.wait_sends()
    out["pending"] = sched.pending_sends
    return out


def test_wait_with_timeout_keeps_the_send(pools):
    stage0, stage1 = pools(2).run(case_wait_with_timeout)
    assert "(global rank 1) did not complete within 0:00:00.050000" in stage0["timed_out"]
    assert stage0["held"] == (1, False) and stage0["waited"] is True
    assert stage0["after"] == (1, True) and stage0["pending"] == 0
    assert stage1 == [5.0] * 3
