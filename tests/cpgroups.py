"""The process groups the cp and attention test cases run on, and their error check (imported by the ranks)."""

from __future__ import annotations

import contextlib
import datetime

import parallel_state as ps

#: The torch.distributed calls ``spying`` records: every collective a cp helper might use, and point to point.
COMM_CALLS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all", "all_to_all_single",
              "broadcast", "all_reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send",
              "recv", "batch_isend_irecv", "isend", "irecv")


def cp_groups():
    """The world, and on 4 ranks also a CP group of 2 with non-adjacent members: (0, 2) and (1, 3)."""
    import torch.distributed as dist

    groups = [dist.group.WORLD]
    if dist.get_world_size() == 4:
        # dp before cp in the order: CP groups are (0, 2) and (1, 3), so group rank != global rank order.
        ps.initialize_model_parallel(context_parallel_size=2, order="tp-dp-cp-pp",
                                     timeout=datetime.timedelta(seconds=30))
        groups.append(ps.get_context_parallel_group())
    return groups


def data(shape, seed=0, dtype=None):
    """The same random tensor on every rank: float64 draws from ``seed``, cast to ``dtype`` (default float64)."""
    import torch

    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x if dtype is None else x.to(dtype)


def raises(exc_type, fragments, fn, *args, **kwargs):
    """Assert ``fn`` raises ``exc_type`` with every fragment in its message; return the message."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        msg = str(exc)
        missing = [f for f in fragments if f not in msg]
        assert not missing, f"{fn.__name__}: message {msg!r} lacks {missing}"
        return msg
    raise AssertionError(f"{fn.__name__}{args!r} did not raise {exc_type.__name__} (expected {fragments})")


@contextlib.contextmanager
def spying(record):
    """Inside the block every torch.distributed call of COMM_CALLS first calls ``record(name, args, kwargs)``, then
    the real function runs. batch_isend_irecv calls isend / irecv with the tensor first and the peer by keyword."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    real = {name: getattr(dist, name) for name in COMM_CALLS if hasattr(dist, name)}

    def spy(name):
        def wrapped(*args, **kwargs):
            record(name, args, kwargs)
            return real[name](*args, **kwargs)
        return wrapped

    for name in real:
        fn = spy(name)
        setattr(dist, name, fn)
        if name in ("isend", "irecv"):  # P2POp accepts only the functions c10d itself names isend and irecv
            setattr(c10d, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
            if name in ("isend", "irecv"):
                setattr(c10d, name, fn)
