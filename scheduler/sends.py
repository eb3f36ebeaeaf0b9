"""The sends a ``PPScheduler`` has started, each held with its tensor until it has completed.

A ``torch.distributed`` send arrives only if its ``Work`` lives until the send completes: gloo
cancels a send whose ``Work`` is freed, even while the tensor lives. MAGI-1 drops the handles
of its sends, so the scheduler holds them here (``Sends``) and gives the caller a
``SendHandle`` over the same ``Work``.

How a completed send is seen differs by backend:

* NCCL: ``Work.is_completed()`` queries the send's CUDA event without blocking, so held sends
  are let go by polling at the scheduler's next call; no host synchronization is added.
* gloo (and any other backend): ``Work.is_completed()`` stays False until someone calls
  ``Work.wait()``, and a second ``wait()`` on a gloo send blocks until the group's timeout. So
  one daemon thread per scheduler (``_Watcher``) waits on the sends, oldest first (the wait
  releases the GIL); a ``SendHandle``'s ``wait()`` waits for that thread's verdict, never on the
  ``Work`` a second time. Waiting for the sends at the scheduler's next receive instead could
  deadlock (the next stage may post its receive only after something this stage does later)
  and would hold each receive until the next stage has received everything sent before it.
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from parallel_state import ParallelStateError

if TYPE_CHECKING:
    import torch


def send_failed(peer: int, error: BaseException) -> ParallelStateError:
    """The error for a send to global rank ``peer`` that failed with ``error``."""
    return ParallelStateError(
        f"the send to the next pipeline stage (global rank {peer}) failed: {error}. That stage has left "
        f"(its process ended or it destroyed its model-parallel groups) or never received the tensor; "
        f"every stage must receive what its previous stage sends before either tears down"
    )


class SendHandle:
    """What ``PPScheduler.isend_next`` returns: ``wait()`` and ``is_completed()`` as on a ``Work``.

    The caller may drop it: the scheduler holds the send until it completes. ``wait()`` may be
    called any number of times, by the caller and the scheduler alike.
    """

    __slots__ = ("peer", "_work", "_tensor", "_watched", "_settled", "_error", "_raised")

    def __init__(self, work: Any, tensor: torch.Tensor, peer: int, watched: bool):
        self.peer = peer
        self._work: Any = work
        self._tensor: torch.Tensor | None = tensor  # the tensor being sent (a contiguous copy where needed)
        self._watched = watched
        self._settled = threading.Event()  # set once the scheduler no longer needs to hold the send
        self._error: BaseException | None = None
        self._raised = False  # whether wait() has raised the send's failure to someone

    def is_completed(self) -> bool:
        """Whether the send has completed (or failed); never blocks."""
        if self._settled.is_set():
            return True
        return not self._watched and self._work.is_completed()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the send as ``Work.wait`` does; ParallelStateError if it failed or ``timeout`` passed.

        On NCCL this is ``Work.wait`` (the current stream waits for the send); elsewhere the
        host waits for the scheduler's watcher thread to see the send complete.
        """
        if self._watched:
            if not self._settled.wait(None if timeout is None else timeout.total_seconds()):
                raise ParallelStateError(
                    f"the send to the next pipeline stage (global rank {self.peer}) did not complete within "
                    f"{timeout}; the next stage has not received it yet"
                )
        elif not self._settled.is_set():
            # Then the current stream waits for the send, and ProcessGroupNCCL holds the send while
            # it runs: nothing here needs the Work any longer.
            self._wait_work(*(() if timeout is None else (timeout,)))
        if self._error is not None:
            self._raised = True
            raise send_failed(self.peer, self._error) from self._error
        return True

    def _finish(self) -> None:
        """Wait for the send; raise its failure unless a wait() has raised it already."""
        if not (self._raised and self._settled.is_set()):
            self.wait()

    def _wait_work(self, *timeout: datetime.timedelta) -> None:
        """Wait on the Work (for a watched send, the watcher thread's one call) and record how it ended."""
        error = None
        try:
            self._work.wait(*timeout)
        except Exception as exc:  # raised by the next wait() on this send
            error = exc
        self._error = error
        self._work = self._tensor = None
        self._settled.set()


class _Watcher:
    """One daemon thread that waits on watched sends oldest first, as they were started."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[SendHandle | None] = queue.SimpleQueue()
        # The thread holds the queue only, never the scheduler, whose teardown stops it.
        self._thread = threading.Thread(target=self._run, args=(self._queue,), name="PPScheduler sends",
                                        daemon=True)
        self._thread.start()
        # A scheduler dropped without a teardown lets its thread end once the queued sends are done.
        self._end = weakref.finalize(self, self._queue.put, None)

    @staticmethod
    def _run(handles: queue.SimpleQueue[SendHandle | None]) -> None:
        while (handle := handles.get()) is not None:
            handle._wait_work()

    def watch(self, handle: SendHandle) -> None:
        self._queue.put(handle)

    def stop(self) -> None:
        self._end()
        self._thread.join()


class Sends:
    """The sends started and not yet seen complete, oldest first."""

    def __init__(self, watched: bool):
        self.watched = watched
        self._pending: deque[SendHandle] = deque()
        self._watcher: _Watcher | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, work: Any, tensor: torch.Tensor, peer: int) -> SendHandle:
        handle = SendHandle(work, tensor, peer, self.watched)
        self._pending.append(handle)
        if self.watched:
            if self._watcher is None:
                self._watcher = _Watcher()
            self._watcher.watch(handle)
        return handle

    def prune(self) -> None:
        """Let go of the sends that have completed; the first that failed raises (and is let go)."""
        # Sends to one peer over one group complete in the order they started.
        while self._pending and self._pending[0].is_completed():
            self._pending.popleft()._finish()  # returns at once, or raises the send's failure

    def make_room(self, limit: int) -> None:
        """Prune, then, with ``limit`` sends still in flight, wait for the oldest (back-pressure)."""
        self.prune()
        while self._pending and len(self._pending) >= limit:
            self._pending.popleft()._finish()

    def wait_all(self) -> None:
        """Wait for every held send, oldest first; the first that failed raises (the rest stay held)."""
        while self._pending:
            self._pending.popleft()._finish()

    def close(self) -> list[ParallelStateError]:
        """Wait for every held send and stop the watcher thread; return the failures instead of raising."""
        failures = []
        while self._pending:
            try:
                self._pending.popleft()._finish()
            except ParallelStateError as exc:
                failures.append(exc)
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        return failures
