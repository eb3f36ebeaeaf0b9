"""Shared fixtures: session-wide pools of real gloo ranks, one pool per world size.

The test files follow the package's layers by name prefix: ``test_topology_*``, ``test_groups_*``,
``test_megatron_*``, ``test_runtime*``, ``test_tools_*``, then ``test_cp*`` and ``test_scheduler``
for the two packages on top, and ``test_layout`` / ``test_docs`` for the project as a whole.
Helpers shared across them live here and in ``rankpool.py``, ``cpgroups.py``, ``fakeworld.py`` and
the ``launch_*.py`` programs that tests start under real launchers.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from rankpool import RankPool  # noqa: E402


class Pools:
    """Hands out one live pool per world size, rebuilding any that a failure killed."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def close(self) -> None:
        # The session is over: no test reads how the ranks leave, so end them at once instead of
        # waiting for each to tear its world down.
        for pool in self._pools.values():
            pool.close(kill=True)


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
