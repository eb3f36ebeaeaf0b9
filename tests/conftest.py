"""Shared fixtures: session-wide pools of real gloo ranks, one pool per world size and kind.

The test files follow the package's layers by name prefix: ``test_topology_*``, ``test_groups_*``,
``test_megatron_*``, ``test_runtime*``, ``test_tools_*``, then ``test_cp*`` and ``test_scheduler``
for the two packages on top, and ``test_layout`` / ``test_docs`` for the project as a whole.
Helpers shared across them live here and in ``rankpool.py``, ``cpgroups.py``, ``fakeworld.py`` and
the ``launch_*.py`` programs that tests start under real launchers.

``pools(n)`` gives ``n`` ranks without megatron-core; ``pools(n, megatron=True)`` gives ``n`` ranks
that imported megatron-core once, before forking (the default in ``test_megatron_*`` files);
``pools(n, release="0.19")`` gives ranks that follow that megatron-core release's API (its accessors
take exactly its parameters), whatever is installed. The kinds never mix, so code that behaves
differently once megatron-core is loaded (the bridge) is tested both ways, whatever order the files
run in.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from launches import Launches  # noqa: E402
from rankpool import RankPool  # noqa: E402

#: What the megatron-core ranks import before the first case: the model code the tests run, with its
#: dependencies (one import, shared by every rank of every megatron-core pool).
MEGATRON_PRELOAD = (
    "megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.transformer",
    "megatron.core.pipeline_parallel", "megatron.core.distributed", "megatron.core.process_groups_config",
    "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.experts",
)


class Pools:
    """Hands out one live pool per world size and kind, rebuilding any that a failure killed."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, bool], RankPool] = {}

    def __call__(self, world_size: int, *, megatron: bool = False, release: str | None = None) -> RankPool:
        key = (world_size, megatron, release)
        pool = self._pools.get(key)
        if pool is None or pool.broken:
            preload = MEGATRON_PRELOAD if megatron and importlib.util.find_spec("megatron") else ()
            env = {} if release is None else {"PARALLEL_STATE_MEGATRON_RELEASE": release}
            pool = self._pools[key] = RankPool(world_size, preload=preload, env=env)
        return pool

    def close(self) -> None:
        # The session is over: no test reads how the ranks leave, so end them at once instead of
        # waiting for each to tear its world down.
        for pool in self._pools.values():
            pool.close(kill=True)


@pytest.fixture(scope="session")
def session_pools():
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="module")
def pools(request, session_pools):
    """``pools(n)`` / ``pools(n, megatron=True)``; megatron-core ranks by default in ``test_megatron_*`` files."""
    default = request.module.__name__.rpartition(".")[2].startswith("test_megatron_")

    def get(world_size: int, *, megatron: bool = default, release: str | None = None) -> RankPool:
        return session_pools(world_size, megatron=megatron, release=release)

    return get


# --- real launchers, started in the background (launches.py) -------------------------------------

LAUNCHES = Launches()


def pytest_configure(config):
    config.addinivalue_line("markers", "launch(commands, timeout): the test reads a real launcher job (launches.py), "
                                       "started in the background once collected")


def pytest_collection_finish(session):
    for item in session.items:
        marker = item.get_closest_marker("launch")
        if marker is not None:
            LAUNCHES.submit(item.nodeid, marker.args[0], marker.kwargs["timeout"])


def pytest_sessionfinish(session):
    LAUNCHES.close()


@pytest.fixture
def launched(request):
    """The outcome of this test's ``@pytest.mark.launch`` job: one ``Outcome`` per process, in order."""
    marker = request.node.get_closest_marker("launch")
    return LAUNCHES.outcome(request.node.nodeid, marker.args[0], marker.kwargs["timeout"])
