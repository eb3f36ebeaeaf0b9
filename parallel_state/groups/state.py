"""The one object that holds the live topology, and the lifecycle that builds and frees it."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable

from parallel_state.errors import ParallelStateAssertionError, ParallelStateError, ParallelStateTypeError
from parallel_state.groups import group_cache
from parallel_state.groups.flavor import Flavor
from parallel_state.groups.options import BuildOptions
from parallel_state.topology.arguments import non_negative_int, positive_int
from parallel_state.topology.kinds import PP
from parallel_state.topology.plan import TopologyPlan
from parallel_state.topology.str_enum import StrEnum


class Override(StrEnum):
    """A value megatron-core's ``set_*`` testing hooks set (or code writes into its ``_MPU_*`` global), which
    wins over the live groups."""

    TENSOR_MODEL_PARALLEL_WORLD_SIZE = "tensor_model_parallel_world_size"
    TENSOR_MODEL_PARALLEL_RANK = "tensor_model_parallel_rank"
    PIPELINE_MODEL_PARALLEL_WORLD_SIZE = "pipeline_model_parallel_world_size"
    PIPELINE_MODEL_PARALLEL_RANK = "pipeline_model_parallel_rank"
    DATA_PARALLEL_RANK = "data_parallel_rank"
    #: No set_* function: megatron-core's _MPU_DATA_PARALLEL_WORLD_SIZE, which code writes directly.
    DATA_PARALLEL_WORLD_SIZE = "data_parallel_world_size"
    VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = "virtual_pipeline_model_parallel_world_size"
    VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = "virtual_pipeline_model_parallel_rank"
    EXPERT_MODEL_PARALLEL_WORLD_SIZE = "expert_model_parallel_world_size"
    EXPERT_MODEL_PARALLEL_RANK = "expert_model_parallel_rank"
    EXPERT_TENSOR_PARALLEL_WORLD_SIZE = "expert_tensor_parallel_world_size"
    EXPERT_TENSOR_PARALLEL_RANK = "expert_tensor_parallel_rank"


@dataclass
class ParallelState:
    """The live topology of this process: the plan, this rank, and its process groups."""

    plan: TopologyPlan
    rank: int
    #: How its groups were built (the all-gather groups added later take their own timeout and NCCL settings).
    options: BuildOptions
    #: kind -> this rank's group (None where it is in no group of the kind); one group per kind,
    #: except where megatron-core itself shares (``topology.kinds.Kind.shares``).
    groups: dict[str, Any] = field(default_factory=dict)
    #: kind -> this rank's gloo group (only with create_gloo_process_groups).
    gloo_groups: dict[str, Any] = field(default_factory=dict)
    #: every group this state uses (created, or taken from the group cache), each once.
    owned: list[Any] = field(default_factory=list)
    #: The topology's key in the group cache (None: the cache was off when it was built).
    cache_key: str | None = None
    #: (flavor, kind) -> the key of that group in the group cache.
    group_keys: dict[tuple[Flavor, str], Any] = field(default_factory=dict)
    #: Whether the whole topology came back from the group cache (no group was created).
    from_cache: bool = False
    #: The interleaved schedule's current model chunk: 0 when built, as in megatron-core (None without one).
    virtual_pipeline_rank: int | None = None
    #: kind -> this rank's group's ranks, computed once (a group can hold thousands of ranks).
    _ranks: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def timeout(self) -> datetime.timedelta:
        """The groups' timeout."""
        return self.options.timeout

    @property
    def virtual_pipeline_size(self) -> int | None:
        """The interleaved schedule's model chunks per stage (None: no virtual pipeline)."""
        return self.options.virtual_pipeline_size

    def ranks(self, kind: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of ``kind``."""
        ranks = self._ranks.get(kind)
        if ranks is None:
            ranks = self._ranks[kind] = self.plan.group_ranks(kind, self.rank)
        return ranks

    def group_rank(self, kind: str) -> int:
        """This rank's index in its group of ``kind`` (torch numbers members by global rank)."""
        # Grid and split kinds answer arithmetically; the others read the member list held here.
        return self.plan.group_rank(kind, self.rank, self._ranks.get(kind))


_state: ParallelState | None = None
#: Values set through Megatron's set_* functions; they win over the live groups, as in Megatron.
overrides: dict[Override, Any] = {}
#: megatron-core's private globals written by hand (``parallel_state._CONTEXT_PARALLEL_GROUP = g``), by
#: name: they replace what the live groups answer, as in megatron-core, until destroy_model_parallel().
written: dict[str, Any] = {}
_teardown_hooks: list[Callable[[], None]] = []
#: Called after every change of the state, the overrides or the written globals (the answers refresh there).
_change_hooks: list[Callable[[], None]] = []


def on_change(hook: Callable[[], None]) -> None:
    """Call ``hook`` after every build, teardown and override change."""
    if hook not in _change_hooks:
        _change_hooks.append(hook)


def _changed() -> None:
    for hook in _change_hooks:
        hook()


def set_override(key: Override, value: Any, name: str | None = None) -> None:
    """Set (or, with None, clear) one of Megatron's set_* values, which win over the live groups: a rank
    is an int >= 0, a size an int >= 1 (errors name ``name``, default ``key``)."""
    if value is None:
        overrides.pop(key, None)
    else:
        overrides[key] = (non_negative_int if key.endswith("rank") else positive_int)(name or key, value)
    _changed()


def write_global(name: str, value: Any) -> None:
    """Record a write of megatron-core's private global ``name`` (the answers follow); on an error, none."""
    previous = written.get(name, _UNSET)
    written[name] = value
    try:
        _changed()
    except BaseException:
        if previous is _UNSET:
            forget_global(name)
        else:
            write_global(name, previous)
        raise


def forget_global(name: str) -> None:
    """Drop the write of ``name``: the live groups answer for it again."""
    if written.pop(name, _UNSET) is not _UNSET:
        _changed()


_UNSET = object()


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


def build(plan: TopologyPlan, options: BuildOptions) -> ParallelState:
    """Create this rank's groups for ``plan`` as ``options`` say and install them; on any error nothing
    is left behind.

    ``plan.ranks`` (a subset of the world) limits every group, and every exchange, to those ranks.
    With the group cache on, ``options.cache_key`` names the topology: a cached one comes back
    whole, and each group of a new one is taken from the cache where one with the same key is there.
    """
    global _state
    import torch.distributed as dist

    from parallel_state.groups.create import GroupBatch, eager_nccl, subset_base

    if _state is not None:
        raise ParallelStateAssertionError(
            "model-parallel groups are already initialized; call "
            "parallel_state.destroy_model_parallel() before initializing again"
        )
    held = [name for name, value in written.items() if value is not None]
    if held:
        # As megatron-core's initialize asserts its globals are None before it sets them.
        raise ParallelStateAssertionError(
            f"model-parallel groups are already initialized by hand: {', '.join(held)} "
            f"{'was' if len(held) == 1 else 'were'} written; call parallel_state.destroy_model_parallel() "
            f"(which forgets the writes) before initialize_model_parallel"
        )
    rank = dist.get_rank()
    members = plan.ranks
    if members is not None and eager_nccl():
        raise ParallelStateError(
            "initialize_model_parallel(ranks=...) cannot build groups on a subset of an eagerly initialised NCCL "
            "world (there every new communicator is split collectively over all ranks); call "
            "torch.distributed.init_process_group without device_id, or build over the whole world"
        )
    state = ParallelState(plan=plan, rank=rank, options=options,
                          virtual_pipeline_rank=0 if options.virtual_pipeline_size is not None else None)
    cache_key = options.cache_key
    caching = group_cache.enabled() and cache_key is not None
    if caching:
        from parallel_state.groups.consistency import values_if_different

        # Every rank involved must hold the same cached topologies, or their reuse decisions would differ.
        caches_agree = options.caches_agree
        if caches_agree is None:
            fingerprint = group_cache.fingerprint()
            caches_agree = values_if_different("parallel_state group cache", fingerprint, options.timeout,
                                               members) is None
        if not caches_agree:
            group_cache.drop_all()
        state.cache_key = cache_key
        entry = group_cache.take(cache_key)
        if entry is not None:
            state.groups, state.gloo_groups, state.owned = entry.groups, entry.gloo_groups, entry.owned
            state.group_keys = dict(entry.keys)
            state.from_cache = True
            _state = state
            written.clear()  # Nones only (checked above): initialize sets those globals, as megatron-core's does
            _changed()
            return state
    reuse = caching and not eager_nccl()  # eager NCCL: every rank takes part in every creation
    gloo_kinds = [name for name, kind in plan.kinds.items() if kind.gloo and plan.gloo_allowed(name)
                  ] if options.gloo else []
    # The counter span depends on the plan only, so it is the same on every rank even when
    # this build fails part-way on some of them.
    reserve = sum(plan.num_groups(k) for k in plan.kinds) + sum(plan.num_groups(k) for k in gloo_kinds)
    base = None if members is None else subset_base(members, reserve, options.timeout)
    batch = GroupBatch(timeout=options.timeout, reserve=reserve, base=base)
    used: list[Any] = []
    try:
        work = [(Flavor.MAIN, k) for k in plan.kinds] + [(Flavor.GLOO, k) for k in gloo_kinds]
        _create_kinds(state, batch, work, used, options, reuse=reuse)
        batch.wait_for_members()
    except BaseException:
        state.groups.clear()  # hand every reference to destroy_groups, which frees the groups
        state.gloo_groups.clear()
        _abandon(batch, used)
        raise
    batch.close()
    state.owned = batch.created + used
    _state = state
    written.clear()  # Nones only (checked above): initialize sets those globals, as megatron-core's does
    _changed()
    return state


def extend(plan: TopologyPlan, options: BuildOptions) -> list[str]:
    """Build the kinds ``plan`` adds to the live plan (megatron-core 0.18's all-gather groups) as
    ``options`` say and make ``plan`` the live one; return the added kinds. On any error the state is
    as it was."""
    from parallel_state.groups.create import GroupBatch, eager_nccl, subset_base

    state = current("create_all_gather_groups")
    added = [k for k in plan.kinds if k not in state.plan.kinds]
    missing = [k for k in added if k not in state.groups]  # a topology from the group cache may hold them
    reserve = sum(plan.num_groups(k) for k in missing)
    base = None if plan.ranks is None or not missing else subset_base(plan.ranks, reserve, options.timeout)
    batch = GroupBatch(timeout=options.timeout, reserve=reserve, base=base)
    previous, state.plan = state.plan, plan
    used: list[Any] = []
    try:
        _create_kinds(state, batch, [(Flavor.MAIN, k) for k in missing], used, options,
                      reuse=group_cache.enabled() and not eager_nccl())
        batch.wait_for_members()
    except BaseException:
        for kind in missing:
            state.groups.pop(kind, None)
            state.group_keys.pop((Flavor.MAIN, kind), None)
        state.plan = previous
        _abandon(batch, used)
        raise
    batch.close()
    state.owned += batch.created + used
    _changed()
    return added


def _abandon(batch: Any, used: list[Any]) -> None:
    """Free the groups a failed build created (the build's own error is the one to report)."""
    from parallel_state.groups.create import destroy_groups

    used.clear()
    try:
        destroy_groups(batch.created)
    except Exception:
        pass
    batch.close()


def _create_kinds(state: ParallelState, batch: Any, work: list[tuple[Flavor, str]], used: list[Any],
                  options: BuildOptions, *, reuse: bool) -> None:
    """Create (or take from the group cache, with ``reuse``) this rank's group of each (flavor, kind) of ``work``."""
    from parallel_state.groups.create import sharp_enabled

    plan, timeout = state.plan, options.timeout
    # Every kind gets a communicator of its own, as in megatron-core: two kinds on one
    # communicator would pair their collectives up in issue order and compute wrong sums.
    # The one exception is megatron-core's own: a kind whose row says it shares another
    # kind's group does so where the plan gives both the same ranks.
    for flavor, kind in work:
        groups = flavor.of(state)
        row = plan.kind(kind)
        shared = next((k for k in row.shares if plan.same_group(kind, k)), None)
        if shared is not None:
            groups[kind] = groups[shared]
            state.group_keys[(flavor, kind)] = state.group_keys[(flavor, shared)]
            batch.skip(plan.num_groups(kind))
            continue
        main = flavor is Flavor.MAIN
        # A gloo twin is a separate gloo group even on a gloo world, as megatron-core builds it.
        backend = (options.pipeline_backend if kind == PP.name else None) if main else "gloo"
        desc = flavor.label(row)
        # NCCL options go to NCCL groups only (megatron-core: none for a ucc pipeline).
        nccl = main and backend in (None, "nccl")
        sharp = main and kind == options.sharp_kind
        key = (flavor, desc, state.ranks(kind), backend, options.nccl.key(row.nccl) if nccl else None, sharp,
               timeout.total_seconds())
        state.group_keys[(flavor, kind)] = key
        cached = group_cache.find(key) if reuse and state.ranks(kind) else None
        if cached is not None:
            groups[kind] = cached
            used.append(cached)
            batch.skip(plan.num_groups(kind))
            continue
        with sharp_enabled(sharp) as enable:
            groups[kind] = enable(_create(batch, state, kind, backend=backend,
                                          pg_options=options.nccl.options(row.nccl) if nccl else None, desc=desc))


def _create(batch: Any, state: ParallelState, kind: str, **kwargs: Any) -> Any:
    """This rank's group of ``kind`` (None where it is in none), in the batch's slot for the kind."""
    plan = state.plan
    return batch.create(state.ranks(kind), index=plan.group_index(kind, state.rank),
                        count=plan.num_groups(kind), all_groups=lambda: plan.groups(kind), **kwargs)


def teardown() -> None:
    """Free every group the live state uses (or hand them to the group cache), run the teardown hooks,
    and forget everything."""
    global _state
    from parallel_state.groups.create import destroy_groups

    state, _state = _state, None
    overrides.clear()
    written.clear()
    errors: list[BaseException] = []
    for hook in list(_teardown_hooks):
        try:
            hook()
        except BaseException as exc:  # keep tearing down; report after
            errors.append(exc)
    if state is not None:
        owned, state.owned = state.owned, []
        refreshed = False
        try:
            if group_cache.enabled() and state.cache_key is not None:
                # The groups stay alive for the next initialize; everything else is reset as usual.
                group_cache.keep(state.cache_key, group_cache.Entry(
                    groups=dict(state.groups), gloo_groups=dict(state.gloo_groups), keys=dict(state.group_keys),
                    slots=len(state.group_keys), owned=owned))
                owned = []
            state.groups.clear()  # hand every reference to destroy_groups, which frees the groups
            state.gloo_groups.clear()
            del state
            # The answers (and the accessors' fast paths) drop their references first, so that
            # destroy_groups holds the last ones and frees the groups off this thread.
            refreshed = True
            _changed()
            destroy_groups(owned)
        finally:
            if not refreshed:
                _changed()
    else:
        _changed()
    if errors:
        raise errors[0]


def _live_owned() -> list[Any]:
    live = peek()
    return live.owned if live is not None else []


# The cache never destroys the live topology's groups; it asks here which they are (it does not
# import this module, which imports it).
group_cache.live_groups = _live_owned
