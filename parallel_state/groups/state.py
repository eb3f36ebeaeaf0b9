"""The one object that holds the live topology, and the lifecycle that builds and frees it."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable

from parallel_state.errors import ParallelStateAssertionError, ParallelStateTypeError
from parallel_state.topology.plan import GridKind, TopologyPlan

#: The gloo side groups Megatron builds for CPU-side data-parallel work (kinds of the plan).
GLOO_KINDS: tuple[str, ...] = ("dp-cp", "dp-cp-intra", "dp", "edp", "edp-intra")


@dataclass
class ParallelState:
    """The live topology of this process: the plan, this rank, and its process groups."""

    plan: TopologyPlan
    rank: int
    timeout: datetime.timedelta
    #: kind -> this rank's group (None where it is in no group of the kind); kinds with equal
    #: rank sets share one group object.
    groups: dict[str, Any] = field(default_factory=dict)
    #: kind -> this rank's gloo group (only with create_gloo_process_groups).
    gloo_groups: dict[str, Any] = field(default_factory=dict)
    #: every group this state created, each once, in creation order.
    owned: list[Any] = field(default_factory=list)
    virtual_pipeline_size: int | None = None
    virtual_pipeline_rank: int | None = None
    #: kind -> this rank's group's ranks, computed once (a group can hold thousands of ranks).
    _ranks: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    def ranks(self, kind: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of ``kind``."""
        ranks = self._ranks.get(kind)
        if ranks is None:
            ranks = self._ranks[kind] = self.plan.group_ranks(kind, self.rank)
        return ranks

    def group_rank(self, kind: str) -> int:
        """This rank's index in its group of ``kind`` (torch numbers members by global rank)."""
        if isinstance(self.plan.spec(kind), GridKind):
            return self.plan.group_rank(kind, self.rank)  # arithmetic, no member list
        return sorted(self.ranks(kind)).index(self.rank)


_state: ParallelState | None = None
#: Values set through Megatron's set_* functions; they win over the live groups, as in Megatron.
overrides: dict[str, Any] = {}
_teardown_hooks: list[Callable[[], None]] = []
#: Called after every change of the state or the overrides (the accessors' answers refresh there).
_change_hooks: list[Callable[[], None]] = []


def on_change(hook: Callable[[], None]) -> None:
    """Call ``hook`` after every build, teardown and override change."""
    if hook not in _change_hooks:
        _change_hooks.append(hook)


def _changed() -> None:
    for hook in _change_hooks:
        hook()


def set_override(key: str, value: Any) -> None:
    """Set (or, with None, clear) one of Megatron's set_* values, which win over the live groups."""
    if value is None:
        overrides.pop(key, None)
    else:
        overrides[key] = value
    _changed()


def current(what: str = "this accessor") -> ParallelState:
    """The live state, or a ParallelStateError that says what to call first."""
    if _state is None:
        raise ParallelStateAssertionError(
            f"{what} needs the model-parallel groups, which are not initialized: call "
            f"parallel_state.initialize_model_parallel(...) (after torch.distributed.init_process_group) first"
        )
    return _state


def peek() -> ParallelState | None:
    """The live state or None, for code that must work with and without groups."""
    return _state


def register_teardown_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` on every destroy_model_parallel(); packages built on this one free their state there."""
    if not callable(hook):
        raise ParallelStateTypeError(f"register_teardown_hook needs a callable taking no arguments, got {hook!r}")
    if hook not in _teardown_hooks:
        _teardown_hooks.append(hook)


def build(
    plan: TopologyPlan,
    *,
    timeout: datetime.timedelta,
    create_gloo_process_groups: bool,
    pipeline_backend: str | None = None,
    nccl_options: Callable[[str], Any] = lambda kind: None,
    virtual_pipeline_size: int | None = None,
    sharp_kind: str | None = None,
) -> ParallelState:
    """Create this rank's groups for ``plan`` and install them; on any error nothing is left behind."""
    global _state
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from parallel_state.groups.create import GroupBatch, destroy_groups, sharp_enabled

    if _state is not None:
        raise ParallelStateAssertionError(
            "model-parallel groups are already initialized; call "
            "parallel_state.destroy_model_parallel() before initializing again"
        )
    rank = dist.get_rank()
    state = ParallelState(plan=plan, rank=rank, timeout=timeout,
                          virtual_pipeline_size=virtual_pipeline_size,
                          virtual_pipeline_rank=0 if virtual_pipeline_size is not None else None)
    gloo_kinds = GLOO_KINDS if create_gloo_process_groups else ()
    # The counter span depends on the plan only, so it is the same on every rank even when
    # this build fails part-way on some of them.
    reserve = sum(plan.num_groups(k) for k in plan.kinds) + sum(plan.num_groups(k) for k in gloo_kinds)
    batch = GroupBatch(timeout=timeout, reserve=reserve)
    try:
        # Kinds whose groups hold the same ranks on every rank share one group.
        by_signature: dict[Any, Any] = {}
        whole_world = ((1, plan.world_size),)
        for kind in plan.kinds:
            signature = plan.signature(kind)
            if signature not in by_signature:
                options = nccl_options(kind)  # only for a kind that gets a group of its own
                if signature == whole_world and options is None and (kind != "pp" or pipeline_backend is None) \
                        and kind != sharp_kind:
                    # A kind whose one group is the whole world is the default group: no new
                    # communicator, and no rank walks a world-sized rank list.
                    by_signature[signature] = c10d._get_default_group()
            if signature in by_signature:
                state.groups[kind] = by_signature[signature]
                batch.skip(plan.num_groups(kind))
                continue
            with sharp_enabled(kind == sharp_kind) as enable:
                state.groups[kind] = by_signature[signature] = enable(_create(
                    batch, state, kind, backend=pipeline_backend if kind == "pp" else None,
                    pg_options=options, desc=kind))
        reuse = dist.get_backend() == "gloo"
        gloo_by_signature: dict[Any, Any] = {}
        for kind in gloo_kinds:
            signature = plan.signature(kind)
            if reuse:
                state.gloo_groups[kind] = state.groups[kind]
            elif signature in gloo_by_signature:
                state.gloo_groups[kind] = gloo_by_signature[signature]
                batch.skip(plan.num_groups(kind))
            else:
                state.gloo_groups[kind] = gloo_by_signature[signature] = _create(
                    batch, state, kind, backend="gloo", desc=f"{kind}-gloo")
        batch.wait_for_members()
    except BaseException:
        state.groups.clear()  # hand every reference to destroy_groups, which frees the groups
        state.gloo_groups.clear()
        by_signature = gloo_by_signature = {}
        try:
            destroy_groups(batch.created)
        except Exception:  # the build's own error is the one to report
            pass
        batch.close()
        raise
    batch.close()
    state.owned = batch.created
    _state = state
    _changed()
    return state


def _create(batch: Any, state: ParallelState, kind: str, **kwargs: Any) -> Any:
    """This rank's group of ``kind`` (None where it is in none), in the batch's slot for the kind."""
    plan = state.plan
    return batch.create(state.ranks(kind), index=plan.group_index(kind, state.rank),
                        count=plan.num_groups(kind), all_groups=lambda: plan.groups(kind), **kwargs)


def teardown() -> None:
    """Free every group the live state created, run the teardown hooks, and forget everything."""
    global _state
    from parallel_state.groups.create import destroy_groups

    state, _state = _state, None
    overrides.clear()
    errors: list[BaseException] = []
    for hook in list(_teardown_hooks):
        try:
            hook()
        except BaseException as exc:  # keep tearing down; report after
            errors.append(exc)
    if state is not None:
        owned, state.owned = state.owned, []
        state.groups.clear()  # hand every reference to destroy_groups, which frees the groups
        state.gloo_groups.clear()
        del state
        try:
            destroy_groups(owned)
        finally:
            _changed()
    else:
        _changed()
    if errors:
        raise errors[0]
