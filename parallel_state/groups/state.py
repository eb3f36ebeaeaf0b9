"""The one object that holds the live topology, and the lifecycle that builds and frees it."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable

from parallel_state.errors import ParallelStateAssertionError, ParallelStateError, ParallelStateTypeError
from parallel_state.groups import group_cache
from parallel_state.topology.kinds import Kind
from parallel_state.topology.plan import TopologyPlan


@dataclass
class ParallelState:
    """The live topology of this process: the plan, this rank, and its process groups."""

    plan: TopologyPlan
    rank: int
    timeout: datetime.timedelta
    #: kind -> this rank's group (None where it is in no group of the kind); one group per kind,
    #: except where megatron-core itself shares (``topology.kinds.Kind.shares``).
    groups: dict[str, Any] = field(default_factory=dict)
    #: kind -> this rank's gloo group (only with create_gloo_process_groups).
    gloo_groups: dict[str, Any] = field(default_factory=dict)
    #: every group this state uses (created, or taken from the group cache), each once.
    owned: list[Any] = field(default_factory=list)
    #: The topology's key in the group cache (None: the cache was off when it was built).
    cache_key: str | None = None
    #: ("main" | "gloo", kind) -> the key of that group in the group cache.
    group_keys: dict[tuple[str, str], Any] = field(default_factory=dict)
    #: Whether the whole topology came back from the group cache (no group was created).
    from_cache: bool = False
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
        # Grid and split kinds answer arithmetically; the others read the member list held here.
        return self.plan.group_rank(kind, self.rank, self._ranks.get(kind))


_state: ParallelState | None = None
#: Values set through Megatron's set_* functions; they win over the live groups, as in Megatron.
overrides: dict[str, Any] = {}
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


def set_override(key: str, value: Any, name: str | None = None) -> None:
    """Set (or, with None, clear) one of Megatron's set_* values, which win over the live groups: a rank
    is an int >= 0, a size an int >= 1 (errors name ``name``, default ``key``)."""
    from parallel_state.topology.arguments import non_negative_int, positive_int

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


def build(
    plan: TopologyPlan,
    *,
    timeout: datetime.timedelta,
    create_gloo_process_groups: bool,
    pipeline_backend: str | None = None,
    nccl_options: Callable[[Kind], Any] = lambda kind: None,
    nccl_key: Callable[[Kind], Any] = lambda kind: None,
    virtual_pipeline_size: int | None = None,
    sharp_kind: str | None = None,
    cache_key: str | None = None,
    caches_agree: bool | None = None,
) -> ParallelState:
    """Create this rank's groups for ``plan`` and install them; on any error nothing is left behind.

    ``plan.ranks`` (a subset of the world) limits every group, and every exchange, to those ranks.
    With the group cache on, ``cache_key`` names the topology: a cached one comes back whole, and
    each group of a new one is taken from the cache where one with the same key is there.
    ``caches_agree`` says whether the ranks involved hold the same cached topologies (None: not
    known yet, so the build compares them in a round of its own).
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
    state = ParallelState(plan=plan, rank=rank, timeout=timeout,
                          virtual_pipeline_size=virtual_pipeline_size,
                          virtual_pipeline_rank=0 if virtual_pipeline_size is not None else None)
    caching = group_cache.enabled() and cache_key is not None
    if caching:
        from parallel_state.groups.consistency import values_if_different

        # Every rank involved must hold the same cached topologies, or their reuse decisions would differ.
        if caches_agree is None:
            fingerprint = group_cache.fingerprint()
            caches_agree = values_if_different("parallel_state group cache", fingerprint, timeout, members) is None
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
                  ] if create_gloo_process_groups else []
    # The counter span depends on the plan only, so it is the same on every rank even when
    # this build fails part-way on some of them.
    reserve = sum(plan.num_groups(k) for k in plan.kinds) + sum(plan.num_groups(k) for k in gloo_kinds)
    base = None if members is None else subset_base(members, reserve, timeout)
    batch = GroupBatch(timeout=timeout, reserve=reserve, base=base)
    used: list[Any] = []
    try:
        _create_kinds(state, batch, [("main", k) for k in plan.kinds] + [("gloo", k) for k in gloo_kinds], used,
                      pipeline_backend=pipeline_backend, nccl_options=nccl_options, nccl_key=nccl_key,
                      sharp_kind=sharp_kind, reuse=reuse)
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


def extend(plan: TopologyPlan, *, timeout: datetime.timedelta | None = None,
           nccl_options: Callable[[Kind], Any] = lambda kind: None,
           nccl_key: Callable[[Kind], Any] = lambda kind: None) -> list[str]:
    """Build the kinds ``plan`` adds to the live plan (megatron-core 0.18's all-gather groups) and make
    ``plan`` the live one; return the added kinds. Their groups take ``timeout`` (default: the
    topology's). On any error the state is as it was."""
    from parallel_state.groups.create import GroupBatch, eager_nccl, subset_base

    state = current("create_all_gather_groups")
    added = [k for k in plan.kinds if k not in state.plan.kinds]
    missing = [k for k in added if k not in state.groups]  # a topology from the group cache may hold them
    reserve = sum(plan.num_groups(k) for k in missing)
    timeout = timeout or state.timeout
    base = None if plan.ranks is None or not missing else subset_base(plan.ranks, reserve, timeout)
    batch = GroupBatch(timeout=timeout, reserve=reserve, base=base)
    previous, state.plan = state.plan, plan
    used: list[Any] = []
    try:
        _create_kinds(state, batch, [("main", k) for k in missing], used, nccl_options=nccl_options,
                      nccl_key=nccl_key, reuse=group_cache.enabled() and not eager_nccl(), timeout=timeout)
        batch.wait_for_members()
    except BaseException:
        for kind in missing:
            state.groups.pop(kind, None)
            state.group_keys.pop(("main", kind), None)
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


def _create_kinds(state: ParallelState, batch: Any, work: list[tuple[str, str]], used: list[Any], *,
                  pipeline_backend: str | None = None, nccl_options: Callable[[Kind], Any] = lambda kind: None,
                  nccl_key: Callable[[Kind], Any] = lambda kind: None, sharp_kind: str | None = None,
                  reuse: bool = False, timeout: datetime.timedelta | None = None) -> None:
    """Create (or take from the group cache) this rank's group of each ("main" | "gloo", kind) of ``work``."""
    from parallel_state.groups.create import sharp_enabled

    plan, timeout = state.plan, timeout or state.timeout
    # Every kind gets a communicator of its own, as in megatron-core: two kinds on one
    # communicator would pair their collectives up in issue order and compute wrong sums.
    # The one exception is megatron-core's own: a kind whose row says it shares another
    # kind's group does so where the plan gives both the same ranks.
    for where, kind in work:
        groups = state.groups if where == "main" else state.gloo_groups
        row = plan.kind(kind)
        shared = next((k for k in row.shares if plan.same_group(kind, k)), None)
        if shared is not None:
            groups[kind] = groups[shared]
            state.group_keys[(where, kind)] = state.group_keys[(where, shared)]
            batch.skip(plan.num_groups(kind))
            continue
        if where == "main":
            backend, desc = pipeline_backend if kind == "pp" else None, row.label
        else:  # a separate gloo group even on a gloo world, as megatron-core builds it
            backend, desc = "gloo", row.gloo_label
        # NCCL options go to NCCL groups only (megatron-core: none for a ucc pipeline).
        nccl = where == "main" and backend in (None, "nccl")
        sharp = where == "main" and kind == sharp_kind
        key = (where, desc, state.ranks(kind), backend, nccl_key(row) if nccl else None, sharp,
               timeout.total_seconds())
        state.group_keys[(where, kind)] = key
        cached = group_cache.find(key) if reuse and state.ranks(kind) else None
        if cached is not None:
            groups[kind] = cached
            used.append(cached)
            batch.skip(plan.num_groups(kind))
            continue
        with sharp_enabled(sharp) as enable:
            groups[kind] = enable(_create(batch, state, kind, backend=backend,
                                          pg_options=nccl_options(row) if nccl else None, desc=desc))


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
