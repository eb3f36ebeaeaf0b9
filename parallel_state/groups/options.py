"""``BuildOptions``: how one build makes its groups, beside its plan, as one value."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from parallel_state.groups.nccl import NcclSettings


@dataclass(frozen=True)
class BuildOptions:
    """What ``ParallelState.build`` needs beyond the plan (initialize_model_parallel's arguments, checked)."""

    #: Every group's timeout.
    timeout: datetime.timedelta
    #: Whether to build the gloo twins megatron-core builds with ``create_gloo_process_groups``.
    gloo: bool = False
    #: The pipeline groups' backend (None: the default group's).
    pipeline_backend: str | None = None
    #: The NCCL communicator settings, by config section.
    nccl: NcclSettings = field(default_factory=NcclSettings)
    #: The interleaved schedule's model chunks per stage (None: no virtual pipeline).
    virtual_pipeline_size: int | None = None
    #: The kind whose communicator gets SHARP (None: none).
    sharp_kind: str | None = None
    #: The topology's key in the group cache (None: it is not cached).
    cache_key: str | None = None
    #: Whether the ranks involved hold the same cached topologies (None: not known yet, so the build
    #: compares them in a round of its own).
    caches_agree: bool | None = None
