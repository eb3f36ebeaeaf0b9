"""``PPScheduler``: point-to-point transfers between adjacent pipeline stages (MAGI-1's).

Stages form a ring: the last stage's next is the first and the first stage's previous is the
last, as MAGI-1's denoising loop needs to hand the last stage's output back to the first. All
traffic goes over this rank's pipeline group. Every send is held until it completes (``sends``), so
a caller may drop what ``isend_next`` returns, as MAGI-1 does. The one scheduler of the process is created by
``dist_init`` (through the hook this module registers with parallel_state when imported), by
``init_pp_scheduler()``, or on first ``pp_scheduler()``; ``destroy_model_parallel()`` drops it.
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

import parallel_state as ps
from parallel_state import ParallelStateError, ParallelStateWarning
from scheduler.sends import SendHandle, Sends, send_failed

if TYPE_CHECKING:
    import torch

#: Every PPScheduler whose groups are alive: the teardown hook marks them dead.
_INSTANCES: weakref.WeakSet[PPScheduler] = weakref.WeakSet()

_INIT_HINT = "call parallel_state.dist_init(...) (or initialize_model_parallel with pipeline_model_parallel_size > 1) first"


class PPScheduler:
    """Sends to the next pipeline stage and receives from the previous one, over the pipeline group.

    Buffers live on the CPU for gloo and on the rank's current CUDA device for NCCL.
    Receives posted with ``queue_irecv_prev`` are collected oldest first by ``queue_irecv_prev_data``.
    Sends are held until they complete: every call lets go of those that have, a send that failed
    raises ParallelStateError at the next call, and with ``max_pending_sends`` still in flight
    ``isend_next`` first waits for the oldest.
    """

    #: Sends in flight before ``isend_next`` waits for the oldest: bounds what the held sends keep alive.
    max_pending_sends: int = 64

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        if not ps.is_initialized():
            raise ParallelStateError(f"the pipeline scheduler is not initialized: {_INIT_HINT}")
        if ps.get_pipeline_model_parallel_world_size() < 2:
            raise ParallelStateError(
                "the pipeline has a single stage (pipeline_model_parallel_size=1), so a PPScheduler has "
                "no neighbour to talk to; initialize with pp_size > 1"
            )
        # Cleared by destroy_model_parallel() (the teardown hook below): the groups die with it.
        self._live = True
        _INSTANCES.add(self)
        self.group = ps.get_pipeline_model_parallel_group()
        self.next_rank: int = ps.get_pipeline_model_parallel_next_rank()
        self.prev_rank: int = ps.get_pipeline_model_parallel_prev_rank()
        backend = str(dist.get_backend(self.group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend.lower() \
            else torch.device("cpu")
        self.recv_queue: deque[tuple[Any, torch.Tensor]] = deque()
        # Only NCCL's Work tells, without a wait, that it has completed (see scheduler.sends).
        self._sends = Sends(watched="nccl" not in backend.lower())

    def _check_live(self) -> None:
        """Refuse a scheduler of destroyed groups; let go of the sends that have completed."""
        if not self._live:
            raise ParallelStateError(
                "this PPScheduler belongs to model-parallel groups that destroy_model_parallel() has "
                "destroyed; get the current one with scheduler.pp_scheduler()"
            )
        self._sends.prune()

    @property
    def pending_sends(self) -> int:
        """How many sends this scheduler holds because they have not been seen to complete."""
        return len(self._sends)

    def _check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"{what} is on {tensor.device}, but the pipeline group sends and receives on {self.device}; "
                f"move it with .to({str(self.device)!r})"
            )

    def isend_next(self, tensor: torch.Tensor) -> SendHandle:
        """Start sending ``tensor`` (its contiguous copy if it is not contiguous) to the next stage.

        The scheduler holds the send and its tensor until it completes, so the returned handle
        may be dropped; its ``wait()`` waits for the send.
        """
        import torch.distributed as dist

        self._check_live()
        self._check_tensor(tensor, "the tensor to send")
        self._sends.make_room(self.max_pending_sends)
        sent = tensor.contiguous()
        try:
            work = dist.isend(sent, dst=self.next_rank, group=self.group)
        except RuntimeError as exc:  # gloo refuses at once when the next stage has left
            raise send_failed(self.next_rank, exc) from exc
        return self._sends.add(work, sent, self.next_rank)

    def wait_sends(self) -> None:
        """Wait for every send this scheduler holds; ParallelStateError for the first that failed."""
        self._check_live()
        self._sends.wait_all()

    def irecv_prev(self, buffer: torch.Tensor) -> Any:
        """Start receiving from the previous stage into ``buffer``; returns the work handle.

        Keep the handle and wait on it before reading ``buffer``: gloo loses a receive whose handle is freed.
        """
        import torch.distributed as dist

        self._check_live()
        self._check_tensor(buffer, "the receive buffer")
        return dist.irecv(buffer, src=self.prev_rank, group=self.group)

    def recv_prev_data(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Receive a tensor of ``shape`` and ``dtype`` from the previous stage and wait for it."""
        import torch

        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self.irecv_prev(buffer).wait()
        self._sends.prune()
        return buffer

    def queue_irecv_prev(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Post a receive from the previous stage now; collect it later with ``queue_irecv_prev_data``."""
        import torch

        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self.recv_queue.append((self.irecv_prev(buffer), buffer))

    def queue_irecv_prev_data(self) -> torch.Tensor:
        """Wait for the oldest receive posted by ``queue_irecv_prev`` and return its tensor."""
        self._check_live()
        if not self.recv_queue:
            raise ParallelStateError(
                "queue_irecv_prev_data() found no posted receive; call queue_irecv_prev(shape, dtype) first"
            )
        handle, buffer = self.recv_queue.popleft()
        handle.wait()
        self._sends.prune()
        return buffer

    def send_next_data(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` to the next stage and wait until it and every earlier send complete."""
        self.isend_next(tensor)
        self._sends.wait_all()

    def _discard_pending(self) -> None:
        """Forget posted receives on teardown, warning about each one nobody collected.

        Waiting on them could hang (their sender may never send), so they are dropped; their
        groups are destroyed right after, which gloo and NCCL allow with receives in flight.
        """
        pending = len(self.recv_queue)
        if not pending:
            return
        arrived = sum(1 for handle, _ in self.recv_queue if handle.is_completed())
        self.recv_queue.clear()
        warnings.warn(
            f"destroy_model_parallel() dropped {pending} receive(s) posted with queue_irecv_prev() that were "
            f"never collected with queue_irecv_prev_data() ({arrived} had arrived, {pending - arrived} were "
            f"still in flight); collect every posted receive before tearing down",
            ParallelStateWarning, stacklevel=3,
        )

    def _finish_sends(self) -> None:
        """On teardown, wait for every held send before the groups go, warning about those that failed.

        A send whose receiver tore down without receiving fails at once (its connection closes);
        one whose receiver lives on but never receives fails at the group's timeout.
        """
        failures = self._sends.close()
        if failures:
            warnings.warn(
                f"destroy_model_parallel() found {len(failures)} send(s) to the next pipeline stage that did "
                f"not arrive; the first: {failures[0]}",
                ParallelStateWarning, stacklevel=3,
            )


_scheduler: PPScheduler | None = None


def init_pp_scheduler() -> PPScheduler:
    """Create the process's pipeline scheduler; ParallelStateError if one exists or the groups do not."""
    global _scheduler
    if _scheduler is not None:
        raise ParallelStateError(
            "the pipeline scheduler is already initialized; use scheduler.pp_scheduler() to get it "
            "(destroy_model_parallel() drops it)"
        )
    _scheduler = PPScheduler()
    return _scheduler


def pp_scheduler() -> PPScheduler:
    """The process's pipeline scheduler, created on first use once the pipeline groups exist."""
    if _scheduler is not None:
        return _scheduler
    return init_pp_scheduler()  # PPScheduler explains why when the groups or the stages are missing


def _on_dist_init() -> None:
    if _scheduler is None and ps.get_pipeline_model_parallel_world_size() > 1:
        init_pp_scheduler()


def _on_teardown() -> None:
    global _scheduler
    # Listed before _scheduler lets go: it is the last reference when the caller holds none (MAGI-1's
    # pp_scheduler().isend_next(x)), and the scheduler's held sends and receives must be seen to.
    live = list(_INSTANCES)
    _scheduler = None
    for sched in live:
        sched._live = False
        sched._discard_pending()
        sched._finish_sends()
    _INSTANCES.clear()


ps.register_dist_init_hook(_on_dist_init)
ps.register_teardown_hook(_on_teardown)
