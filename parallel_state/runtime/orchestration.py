"""Rank-0-driven orchestration for long-lived workers, and the local-device helper.

WorldFoundry's ``rank_orchestration`` API (names and parameters read from
weed33834/WorldFoundry ``worldfoundry/core/distributed/rank_orchestration.py``; written here):
the master rank (0 unless ``master_rank`` says otherwise) serves requests and drives every other
rank, which sits in ``RankCoordinator.worker_loop``. One call of a ``@distributed_op`` method on
the master is one *round* on every rank of the default process group:

1. the master broadcasts ``[counter, signal]`` (``SignalBus``); the counter catches a rank that
   fell out of step;
2. the master broadcasts the call's arguments (``PayloadBus``, pickled); every worker takes part,
   even one with no handler for the signal, so nobody is left waiting;
3. every rank runs the method with those arguments;
4. every rank reports its outcome in one agreement round (``groups.consistency``, the project's
   one way for ranks to compare values, through the default store): a rank whose method raised
   is named, with its exception, in the master's error (``DistributedOpError``; the workers
   report it and keep serving), and a signal some worker has no handler for raises
   ``UnknownSignalError`` on every rank, which ends every loop.

``send_exit`` ends the worker loops. Steps 1 and 2 are collectives over the default group (or the
``group`` passed, an extension) and step 4 is a round among its ranks, each bounded by the group's
timeout, so a dead or stuck rank becomes an error on the others, never a hang (an idle worker
also waits at most that long for the next request: give the group a timeout that covers it).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar, cast

from parallel_state.errors import ParallelStateError
from parallel_state.runtime.resolve import collective_device, dist_ready

if TYPE_CHECKING:
    import torch

_PayloadT = TypeVar("_PayloadT")
_ResultT = TypeVar("_ResultT")
_SignalT = TypeVar("_SignalT", bound=IntEnum)

#: The attribute ``distributed_op`` puts its DistributedOpSpec under (WorldFoundry's name).
_SPEC_ATTR = "__distributed_op_spec__"


class DistributedOpError(ParallelStateError):
    """A distributed op raised on one or more ranks; raised on the master, naming each rank and its exception."""


class UnknownSignalError(ParallelStateError):
    """A signal reached a worker that has no handler for it (or is not a member of the signal type); raised on every rank."""


def get_distributed_device(local_rank: int | None = None) -> torch.device:
    """The device this rank's collectives use: ``cuda:local_rank`` (or the bound CUDA device) on NCCL, the CPU on gloo.

    Outside a distributed run: ``cuda:local_rank`` when CUDA is available and ``local_rank`` is
    given, else the launcher's local CUDA device, else the CPU (``resolve.collective_device``).
    """
    import torch

    if local_rank is not None and (isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0):
        raise TypeError(f"get_distributed_device: local_rank must be a non-negative int or None, got {local_rank!r}")
    if dist_ready():
        import torch.distributed as dist

        backend = str(dist.get_backend()).lower()
        if "nccl" in backend and local_rank is not None:
            return torch.device("cuda", local_rank)
        if "nccl" not in backend and "gloo" not in backend:
            raise ParallelStateError(
                f"get_distributed_device: the default process group runs backend {backend!r}; only nccl (CUDA) "
                f"and gloo (CPU) have a known device: pass the device to use explicitly"
            )
        return collective_device()
    if local_rank is not None and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return collective_device()


def _rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    if not dist_ready():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


def _members(group: Any) -> list[int]:
    """The global ranks of ``group`` (the default group when None); [0] outside a distributed run."""
    if not dist_ready():
        return [0]
    import torch.distributed as dist

    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _check_master_rank(what: str, master_rank: Any, group: Any) -> int:
    if isinstance(master_rank, bool) or not isinstance(master_rank, int):
        raise TypeError(f"{what}: master_rank must be an int global rank, got {master_rank!r}")
    members = _members(group)
    if master_rank not in members:
        raise ValueError(f"{what}: master_rank={master_rank} is not a member of the group (global ranks "
                         f"{members}); pass one of them")
    if _rank() not in members:
        raise ValueError(f"{what}: this rank ({_rank()}) is not a member of the group (global ranks {members}); "
                         f"create the coordinator on the group's members only")
    return master_rank


def _comm_failure(what: str, exc: BaseException) -> ParallelStateError:
    return ParallelStateError(
        f"rank {_rank()}: {what} failed: another rank died, left the protocol, or was silent for longer than the "
        f"group's timeout ({type(exc).__name__}: {exc})"
    )


@dataclass(frozen=True)
class DistributedOpSpec(Generic[_SignalT]):
    """What ``@distributed_op`` records on a method: its signal and its name."""

    signal: _SignalT
    method_name: str


@dataclass(frozen=True)
class _Invocation:
    """The arguments of one call, as the master broadcasts them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class SignalBus(Generic[_SignalT]):
    """Broadcasts the master's signals to every rank, numbered so that a rank out of step is an error."""

    def __init__(self, *, device: torch.device, signal_type: type[_SignalT], master_rank: int = 0,
                 group: Any = None) -> None:
        """``device``: where the two-int packet travels (the CPU on gloo, the rank's CUDA device on NCCL).

        ``group`` (an extension; default: the whole world) is the process group the signals go
        over, and its timeout bounds every wait; ``master_rank`` is a global rank in it.
        """
        if not (isinstance(signal_type, type) and issubclass(signal_type, IntEnum)):
            raise TypeError(f"SignalBus: signal_type must be an IntEnum subclass, got {signal_type!r}")
        self.device = device
        self.signal_type = signal_type
        self.group = group
        self.master_rank = _check_master_rank("SignalBus", master_rank, group)
        self._counter = 0

    def _coerce(self, signal: Any) -> _SignalT:
        try:
            return self.signal_type(signal)
        except ValueError:
            raise ValueError(f"signal {signal!r} is not a member of {self.signal_type.__name__} "
                             f"({', '.join(s.name for s in self.signal_type)})") from None

    def send(self, signal: _SignalT) -> None:
        """Master: broadcast ``signal`` with the next sequence number (only numbers it outside a distributed run)."""
        signal = self._coerce(signal)
        if dist_ready():
            import torch
            import torch.distributed as dist

            rank = _rank()
            if rank != self.master_rank:
                raise ParallelStateError(f"SignalBus.send: rank {rank} is not the master (rank {self.master_rank}); "
                                         f"only the master sends signals, the others receive them")
            packet = torch.tensor([self._counter, int(signal)], dtype=torch.int64, device=self.device)
            try:
                dist.broadcast(packet, src=self.master_rank, group=self.group)
            except RuntimeError as exc:
                raise _comm_failure(f"sending signal {signal.name}", exc) from exc
        self._counter += 1

    def _recv_value(self) -> int:
        """Worker: the next signal's raw value (it may name no member of the signal type)."""
        if not dist_ready():
            raise ParallelStateError("SignalBus.recv: torch.distributed is not initialized, so there is no master "
                                     "to receive from; initialize the process group first")
        import torch
        import torch.distributed as dist

        packet = torch.tensor([self._counter, 0], dtype=torch.int64, device=self.device)
        try:
            dist.broadcast(packet, src=self.master_rank, group=self.group)
        except RuntimeError as exc:
            raise _comm_failure(f"waiting for signal #{self._counter} from master rank {self.master_rank}",
                                exc) from exc
        counter, value = (int(v) for v in packet.tolist())
        if counter != self._counter:
            raise ParallelStateError(
                f"rank {_rank()}: signal number {counter} arrived where number {self._counter} was expected: "
                f"this rank and the master are out of step (a signal was sent or received outside the protocol)"
            )
        self._counter += 1
        return value

    def recv(self) -> _SignalT:
        """Worker: the master's next signal; ValueError when it is not a member of ``signal_type``."""
        return self._coerce(self._recv_value())


class PayloadBus:
    """Broadcasts picklable payloads from the master (identity outside a distributed run)."""

    def __init__(self, *, master_rank: int = 0, group: Any = None) -> None:
        """``master_rank``: the global rank whose payload every rank of ``group`` (default: the world) receives."""
        self.group = group
        self.master_rank = _check_master_rank("PayloadBus", master_rank, group)

    def broadcast_object(self, payload: _PayloadT) -> _PayloadT:
        """The master's ``payload`` on every rank (torch's pickle-based object broadcast: keep payloads small)."""
        if not dist_ready():
            return payload
        import torch.distributed as dist

        box = [payload]
        try:
            dist.broadcast_object_list(box, src=self.master_rank, group=self.group)
        except RuntimeError as exc:
            raise _comm_failure(f"receiving the payload from master rank {self.master_rank}", exc) from exc
        return cast(_PayloadT, box[0])


@dataclass
class _Handler:
    method_name: str
    callback: Callable[[], Any]


# Where a worker is in the current round: its callback must reach invoke, which takes the payload
# and reports; worker_loop finishes whatever part the callback did not, so the master never waits.
_SIGNAL, _PAYLOAD, _DONE = "signal", "payload", "done"
#: The agreement round each call ends with (its namespace in the store; a group's rounds are apart by its ranks).
_ROUND = "parallel_state RankCoordinator outcome"
#: A rank's outcome in that round: ok, or what went wrong and the message after the separator.
_OK, _FAILED, _UNKNOWN, _SEP = "ok", "error", "unknown", ":"


class RankCoordinator(Generic[_SignalT]):
    """Runs the master's calls on every rank: the master calls, the workers serve in ``worker_loop``."""

    def __init__(self, *, device: torch.device, signal_type: type[_SignalT], is_master: bool, master_rank: int = 0,
                 signal_bus: SignalBus[_SignalT] | None = None, payload_bus: PayloadBus | None = None,
                 group: Any = None) -> None:
        """``is_master`` must be true exactly on ``master_rank``; the buses default to ones on ``device``.

        ``group`` (an extension; default: the whole world) is the process group every round
        runs over; its timeout bounds every wait.
        """
        master_rank = _check_master_rank("RankCoordinator", master_rank, group)
        rank = _rank()
        if dist_ready() and bool(is_master) != (rank == master_rank):
            raise ValueError(f"RankCoordinator: is_master={is_master!r} on rank {rank}, but the master is rank "
                             f"{master_rank}; pass is_master=(rank == master_rank)")
        self.group = group
        self.signal_bus = signal_bus or SignalBus(device=device, signal_type=signal_type, master_rank=master_rank,
                                                  group=group)
        self.payload_bus = payload_bus or PayloadBus(master_rank=master_rank, group=group)
        self.is_master = bool(is_master)
        self._lock = threading.RLock()
        self._handlers: dict[Any, _Handler] = {}
        self._stage: str | None = None
        self._reported: BaseException | None = None

    # --- one round --------------------------------------------------------------------------

    def invoke(self, *, signal: _SignalT, payload: _PayloadT | None,
               handler: Callable[[_PayloadT], _ResultT]) -> _ResultT:
        """Run ``handler`` on every rank with the master's ``payload`` (workers pass None); return its result.

        The master sends ``signal`` first. Afterwards every rank reports: on the master, a
        handler that raised on a worker raises DistributedOpError naming each failed rank (its
        own exception alone is re-raised as it is); a worker re-raises its own exception, which
        ``worker_loop`` logs and survives.
        """
        with self._lock:
            if self.is_master:
                signal = self.signal_bus._coerce(signal)
                if payload is None:
                    raise ValueError(f"RankCoordinator.invoke: the master must pass a payload for signal "
                                     f"{signal.name}; None is what the workers pass")
                self.signal_bus.send(signal)
            elif payload is not None:
                raise ValueError(f"RankCoordinator.invoke: worker rank {_rank()} passed a payload for signal "
                                 f"{getattr(signal, 'name', signal)}; only the master's payload is used, pass None")
            self._stage = _PAYLOAD  # from here on a failure is the collective's: nothing left to finish
            synced = self.payload_bus.broadcast_object(payload)
            error: BaseException | None = None
            result: Any = None
            try:
                result = handler(cast(_PayloadT, synced))
            except Exception as exc:  # reported to every rank below; BaseException (Ctrl-C) still escapes
                error = exc
            self._report(getattr(signal, "name", str(signal)), error)
            if error is not None:
                self._reported = error
                raise error
            return cast(_ResultT, result)

    def _report(self, what: str, error: BaseException | None, unknown: str | None = None) -> None:
        """Every rank's outcome of this round to every rank; raise what the outcomes call for."""
        self._stage = _DONE
        rank, members = _rank(), sorted(_members(self.group))
        if unknown is not None:
            mine = f"{_UNKNOWN}{_SEP}{unknown}"
        elif error is not None:
            mine = f"{_FAILED}{_SEP}{type(error).__name__}: {error}"
        else:
            mine = _OK
        values = None
        if len(members) > 1:
            from parallel_state.groups.consistency import values_if_different
            from parallel_state.groups.process_groups import group_timeout

            try:
                values = values_if_different(_ROUND, mine, group_timeout(self.group),
                                             None if self.group is None else members)
            except ParallelStateError as exc:
                raise _comm_failure(f"reporting the outcome of {what}", exc) from exc
        # None: every rank's outcome is this one's.
        outcomes = [tuple(v.split(_SEP, 1)) if v != _OK else None for v in values or [mine] * len(members)]
        unknown_on = [(members[i], o[1]) for i, o in enumerate(outcomes) if o is not None and o[0] == _UNKNOWN]
        if unknown_on:
            raise UnknownSignalError(
                f"signal {unknown_on[0][1]} has no handler on rank(s) {[r for r, _ in unknown_on]}: every worker "
                f"must register a handler for every signal the master sends (register_distributed_ops(obj) on an "
                f"object of the same class), and the master may only send members of its signal type"
            )
        failed = [(members[i], o[1]) for i, o in enumerate(outcomes) if o is not None]
        if not self.is_master or not failed or [r for r, _ in failed] == [rank]:
            return
        raise DistributedOpError(
            f"{what} failed on {len(failed)} rank(s): " + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from error

    # --- workers ----------------------------------------------------------------------------

    def register(self, *, signal: _SignalT, method_name: str, callback: Callable[[], Any]) -> None:
        """Serve ``signal`` with ``callback`` (which must call ``invoke``); a second method for one signal is an error."""
        signal = self.signal_bus._coerce(signal)
        if not callable(callback):
            raise TypeError(f"RankCoordinator.register: callback for {signal.name} must be callable, got {callback!r}")
        existing = self._handlers.get(signal)
        if existing is not None and existing.method_name != method_name:
            raise ValueError(f"signal {signal.name} is already registered to {existing.method_name!r}; "
                             f"give {method_name!r} a signal of its own")
        self._handlers[signal] = _Handler(method_name, callback)

    def register_distributed_ops(self, obj: Any) -> None:
        """Register every ``@distributed_op`` method of ``type(obj)``, bound to ``obj``."""
        for name in dir(type(obj)):
            spec = getattr(getattr(type(obj), name, None), _SPEC_ATTR, None)
            if isinstance(spec, DistributedOpSpec):
                self.register(signal=spec.signal, method_name=name, callback=getattr(obj, name))

    def worker_loop(self, *, exit_signal: _SignalT) -> None:
        """Worker: serve the master's signals until ``exit_signal``.

        A handler that raises is reported to the master and the loop goes on; a signal with no
        handler raises UnknownSignalError here and on every rank; a lost master (or one that
        goes silent past the group's timeout) raises ParallelStateError.
        """
        if self.is_master:
            raise ParallelStateError("RankCoordinator.worker_loop runs on the workers; the master calls the "
                                     "distributed ops and ends the loops with send_exit")
        exit_signal = self.signal_bus._coerce(exit_signal)
        while True:
            value = self.signal_bus._recv_value()
            if value == int(exit_signal):
                return
            name = self._signal_name(value)
            handler = self._handlers.get(value)
            self._stage, self._reported = _SIGNAL, None
            if handler is None:
                self.payload_bus.broadcast_object(None)  # keep in step with the master, then tell everyone
                self._report(name, None, unknown=f"{name} (rank {_rank()})")
            try:
                handler.callback()
            except BaseException as exc:
                if self._stage == _DONE and exc is self._reported:  # the handler's error, reported already
                    self._log_reported(name, handler.method_name, exc)
                    continue
                if self._stage != _SIGNAL or not isinstance(exc, Exception):
                    raise  # the round broke in a collective, ended everywhere, or an interrupt: nothing to finish
                self.payload_bus.broadcast_object(None)  # raised before invoke: finish the round for it
                self._report(name, exc)
                self._log_reported(name, handler.method_name, exc)
                continue
            if self._stage == _SIGNAL:  # the callback never reached invoke: finish the round for it
                self.payload_bus.broadcast_object(None)
                self._report(name, ParallelStateError(
                    f"the callback registered for {name} ({handler.method_name}) returned without calling "
                    f"RankCoordinator.invoke; register @distributed_op methods (register_distributed_ops)"))

    def _signal_name(self, value: int) -> str:
        try:
            return self.signal_bus.signal_type(value).name
        except ValueError:
            return f"{value} (not a member of {self.signal_bus.signal_type.__name__})"

    @staticmethod
    def _log_reported(name: str, method: str, exc: BaseException) -> None:
        from parallel_state.runtime.log import print_per_rank

        print_per_rank(f"{method} ({name}) raised {type(exc).__name__}: {exc}; reported to the master, still serving")

    def send_exit(self, *, exit_signal: _SignalT) -> None:
        """Master: end every worker's ``worker_loop``."""
        if not self.is_master:
            raise ParallelStateError("RankCoordinator.send_exit: only the master sends the exit signal")
        with self._lock:
            self.signal_bus.send(exit_signal)


def distributed_op(signal: _SignalT, *, coordinator_attr: str = "rank_coordinator"
                   ) -> Callable[[Callable[..., _ResultT]], Callable[..., _ResultT]]:
    """Make a method run on every rank when the master calls it, with the master's arguments.

    The method's object holds its RankCoordinator as ``coordinator_attr``. The master calls
    the method normally; workers run it from ``worker_loop`` (after ``register_distributed_ops``)
    or by calling it without arguments. Every rank returns its own result.
    """

    def decorator(method: Callable[..., _ResultT]) -> Callable[..., _ResultT]:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> _ResultT:
            coordinator = getattr(self, coordinator_attr, None)
            if not isinstance(coordinator, RankCoordinator):
                raise TypeError(f"{method.__name__}: self.{coordinator_attr} must be a RankCoordinator, got "
                                f"{type(coordinator).__name__}; set it in __init__ or pass coordinator_attr=")
            payload: _Invocation | None = None
            if coordinator.is_master:
                payload = _Invocation(tuple(args), dict(kwargs))
            elif args or kwargs:
                raise ValueError(f"{method.__name__}: a worker calls a distributed op without arguments; the "
                                 f"master's arguments are used")
            return coordinator.invoke(signal=signal, payload=payload,
                                      handler=lambda call: method(self, *call.args, **call.kwargs))

        setattr(wrapper, _SPEC_ATTR, DistributedOpSpec(signal=signal, method_name=method.__name__))
        return wrapper

    return decorator
