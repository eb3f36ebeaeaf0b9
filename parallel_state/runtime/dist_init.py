"""``dist_init``: start torch.distributed and the model-parallel groups for inference (MAGI-1's entry point).

Packages built on parallel_state attach to ``dist_init`` through ``register_dist_init_hook``:
the ``scheduler`` package registers a hook when it is imported that creates the pipeline
scheduler, so ``parallel_state`` never imports (or names) ``scheduler``. A program that never
imports ``scheduler`` cannot ask for the scheduler, so nothing is lost when no hook is
registered; and ``scheduler.pp_scheduler()`` creates it on first use if ``scheduler`` was
imported only after ``dist_init``. Teardown goes the same way through
``register_teardown_hook``.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

from parallel_state.errors import ParallelStateError
from parallel_state.groups import state as _st
from parallel_state.runtime.resolve import dist_ready

#: The rank order MAGI-1 asks for: context-parallel ranks adjacent, pipeline stages outside them.
DIST_INIT_ORDER = "tp-cp-pp-dp"

#: Defaults for the keyword form: NCCL, and megatron-core's 30-minute group timeout.
_DEFAULTS: dict[str, Any] = {
    "distributed_backend": "nccl", "distributed_timeout_minutes": 30, "cp_size": 1, "pp_size": 1,
}

_dist_init_hooks: list[Callable[[], None]] = []


def register_dist_init_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` at the end of every ``dist_init``, once the model-parallel groups exist.

    This is how packages that depend on parallel_state (the pipeline scheduler) set themselves
    up without parallel_state importing them. A hook that raises makes ``dist_init`` fail and
    undo what it built.
    """
    if hook not in _dist_init_hooks:
        _dist_init_hooks.append(hook)


def _read_values(config: Any, keywords: dict[str, Any]) -> dict[str, Any]:
    given = {k: v for k, v in keywords.items() if v is not None}
    if config is None:
        return {**_DEFAULTS, **given}
    if given:
        raise TypeError(
            f"dist_init() got a config and also {', '.join(f'{k}={v!r}' for k, v in given.items())}; "
            f"pass the values either in config.engine_config or as keywords, not both"
        )
    engine = getattr(config, "engine_config", None)
    if engine is None:
        raise TypeError(
            f"dist_init(config): config ({type(config).__name__}) has no engine_config; pass an object whose "
            f"engine_config has {', '.join(_DEFAULTS)}, or pass those as keywords"
        )
    missing = [k for k in _DEFAULTS if not hasattr(engine, k)]
    if missing:
        raise TypeError(f"dist_init(config): config.engine_config lacks {', '.join(missing)}")
    return {k: getattr(engine, k) for k in _DEFAULTS}


def _validate(values: dict[str, Any], timeout: datetime.timedelta | None) -> tuple[str, int, int, datetime.timedelta]:
    backend = values["distributed_backend"]
    if not isinstance(backend, str) or not backend.strip():
        raise TypeError(f"distributed_backend must be a backend name such as 'nccl' or 'gloo', got {backend!r}")
    sizes = []
    for name in ("cp_size", "pp_size"):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        sizes.append(value)
    if timeout is None:
        minutes = values["distributed_timeout_minutes"]
        if isinstance(minutes, bool) or not isinstance(minutes, (int, float)):
            raise TypeError(f"distributed_timeout_minutes must be a number, got {minutes!r}")
        if not minutes > 0:
            raise ValueError(f"distributed_timeout_minutes must be > 0, got {minutes}")
        timeout = datetime.timedelta(minutes=minutes)
    elif not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    elif timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return backend.strip(), sizes[0], sizes[1], timeout


def _check_sizes(cp: int, pp: int, world: int) -> None:
    if cp * pp != world:
        raise ParallelStateError(
            f"cp_size * pp_size must equal the world size: cp_size={cp} * pp_size={pp} = {cp * pp}, "
            f"but the world size is {world}; choose sizes whose product is {world} or launch {cp * pp} processes"
        )


def _check_existing(cp: int, pp: int, world: int) -> None:
    """The groups already built must be the ones dist_init would build."""
    from parallel_state.topology.plan import TopologyPlan

    have = _st.current("dist_init").plan
    want = TopologyPlan(world, cp=cp, pp=pp, order=DIST_INIT_ORDER)
    if have.tp != 1 or any(list(have.groups(k)) != list(want.groups(k)) for k in ("cp", "pp")):
        raise ParallelStateError(
            f"model-parallel groups are already initialized with tp={have.tp}, cp={have.cp}, pp={have.pp} "
            f"(order {have.order!r}), which is not the cp_size={cp}, pp_size={pp} layout (order "
            f"{DIST_INIT_ORDER!r}) dist_init was asked for; call parallel_state.destroy_model_parallel() first"
        )


def dist_init(
    config: Any = None,
    *,
    distributed_backend: str | None = None,
    distributed_timeout_minutes: float | None = None,
    cp_size: int | None = None,
    pp_size: int | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Initialize torch.distributed and the model-parallel groups for a cp x pp inference job.

    ``config.engine_config`` (MAGI-1's shape) or the keywords give the backend, the timeout in
    minutes, ``cp_size`` and ``pp_size`` (keyword defaults: nccl, 30, 1, 1); ``timeout`` (a
    timedelta) overrides the minutes. The rank and world come from the launcher (see
    ``DistributedManager``). Starts torch.distributed unless it is running (binding the local
    CUDA device for NCCL), checks ``cp_size * pp_size == world_size``, builds the groups with
    order ``tp-cp-pp-dp`` unless they exist (then they must match), and runs the registered
    dist_init hooks (the pipeline scheduler, when ``pp_size > 1``). On error, what this call
    built is torn down again.
    """
    backend, cp, pp, timeout = _validate(
        _read_values(config, {"distributed_backend": distributed_backend,
                              "distributed_timeout_minutes": distributed_timeout_minutes,
                              "cp_size": cp_size, "pp_size": pp_size}),
        timeout,
    )
    import torch.distributed as dist

    from parallel_state.groups.consistency import check_same_everywhere
    from parallel_state.megatron.generated_initialize import initialize_model_parallel
    from parallel_state.megatron.initialize import destroy_model_parallel
    from parallel_state.runtime.launch import detect_launch
    from parallel_state.runtime.log import print_rank_0
    from parallel_state.runtime.manager import check_backend_available, local_cuda_device

    started = False
    if dist_ready():
        running = str(dist.get_backend())
        if backend.lower() not in running.lower():
            raise ParallelStateError(
                f"torch.distributed is already initialized with backend {running!r}, but dist_init was "
                f"asked for {backend!r}; ask for {running!r} or start torch.distributed with {backend!r}"
            )
    else:
        check_backend_available(backend)
        info = detect_launch()
        if "nccl" in backend.lower():
            import torch

            torch.cuda.set_device(local_cuda_device(info.local_rank))
        if info.launcher == "single":
            # One process needs no rendezvous: an in-memory store, no address or port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=info.init_method, rank=info.rank,
                                    world_size=info.world_size, timeout=timeout)
        started = True
    built = False
    try:
        # Before the size check, so that a rank launched with other values is named on every rank
        # instead of failing alone and leaving the others waiting.
        check_same_everywhere("dist_init", {"distributed_backend": backend.lower(), "cp_size": cp, "pp_size": pp,
                                            "timeout_seconds": timeout.total_seconds()}, timeout=timeout)
        _check_sizes(cp, pp, dist.get_world_size())
        if _st.peek() is None:
            initialize_model_parallel(context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                      order=DIST_INIT_ORDER, timeout=timeout)
            built = True
        else:
            _check_existing(cp, pp, dist.get_world_size())
        for hook in list(_dist_init_hooks):
            hook()
    except BaseException:
        if built:
            destroy_model_parallel()
        if started:
            dist.destroy_process_group()
        raise
    print_rank_0(f"Initialized torch.distributed ({backend}) and model parallel: cp_size={cp}, pp_size={pp}")


def is_last_rank() -> bool:
    """Whether this is the last global rank; a process outside a distributed run is."""
    if not dist_ready():
        return True
    import torch.distributed as dist

    return dist.get_rank() == dist.get_world_size() - 1


def is_last_tp_cp_rank() -> bool:
    """Whether this rank is the last of its tensor-x-context-parallel group."""
    from parallel_state.megatron.accessors import get_tp_rank, get_tp_world_size

    _st.current("is_last_tp_cp_rank")
    return get_tp_rank(with_context_parallel=True) == get_tp_world_size(with_context_parallel=True) - 1
