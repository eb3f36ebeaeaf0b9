"""The process groups the cp and attention test cases run on, and their error check (imported by the ranks)."""

from __future__ import annotations

import datetime

import parallel_state as ps


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
