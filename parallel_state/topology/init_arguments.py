"""``initialize_model_parallel``'s arguments as one frozen value: bound once, compared across ranks, passed on.

Every parameter is a field of :class:`InitArguments`: one per row of the release table's
``initialize_model_parallel`` (``release_table.SIGNATURES``, megatron-core's parameters in the
releases' merged order, with the releases that have them; ``python -m parallel_state.tools.generate``
writes those fields), then parallel_state's own keywords. From those fields come the signature
``initialize_model_parallel`` has for the release in use (that release's parameters positional, in
its order; every other release's and parallel_state's own keyword-only), the binding of a call, what
the ranks compare, the group cache's key and the topology plan (the sizes, ``sizes.Sizes``). A new
megatron-core argument is one row of that table (and, where it changes the layout, its place in the
plan).

Binding raises what Python would (an unknown keyword, too many positional arguments, a value
given twice) at once; the values themselves are checked by :meth:`InitArguments.validated`, after
the ranks have compared them, so that a bad value on one rank is named on every rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from parallel_state.errors import (
    ParallelStateAssertionError,
    ParallelStateError,
    ParallelStateTypeError,
    ParallelStateValueError,
)
from parallel_state.topology import arguments as a
from parallel_state.topology import releases, validation
from parallel_state.topology.grid import normalize_order
from parallel_state.topology.kinds import DP_CP, EDP_INTER
from parallel_state.topology.plan import TopologyPlan
from parallel_state.topology.sizes import PARAMETERS, Sizes

#: Settings the ranks may hold differently (timeouts, per-node NCCL tuning): not compared across ranks,
#: though the group cache's key holds them.
LOCAL = frozenset({"distributed_timeout_minutes", "timeout", "nccl_communicator_config_path",
                   "high_priority_stream_groups", "check_consistency"})

#: MAGI-1 / WorldFoundry spellings of three sizes: bound onto the megatron-core parameter.
ALIASES = {"tp_size": "tensor_model_parallel_size", "cp_size": "context_parallel_size",
           "pp_size": "pipeline_model_parallel_size"}


@dataclass(frozen=True)
class InitArguments:
    """What ``initialize_model_parallel`` was called with: megatron-core 0.16-0.19's parameters (one field
    per row of ``release_table.SIGNATURES['initialize_model_parallel']``) and ours."""

    # <generated: init-arguments> by `python -m parallel_state.tools.generate` from the release table
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_model_parallel_comm_backend: str | None = None
    use_sharp: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: Sequence[int] | None = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    #: megatron-core 0.19 and later
    gtp_remat_size: int = 1
    #: megatron-core 0.19 and later
    expert_gtp_remat_size: int = 1
    num_distributed_optimizer_instances: int = 1
    expert_tensor_parallel_size: int | None = None
    nccl_communicator_config_path: str | None = None
    distributed_timeout_minutes: int = 30
    order: str = "tp-cp-ep-dp-pp"
    get_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None
    get_position_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None
    create_gloo_process_groups: bool = True
    high_priority_stream_groups: Sequence[str] | None = None
    sharp_enabled_group: str | None = None
    #: megatron-core 0.16 to 0.17 only
    create_all_gather_group: bool | None = False
    #: megatron-core 0.17 and later
    rank_offset: int = 0
    #: megatron-core 0.17 and later
    local_world_size: int | None = None
    # </generated: init-arguments>
    # parallel_state's own keywords, keyword-only in every release:
    #: The groups' timeout, finer than distributed_timeout_minutes.
    timeout: datetime.timedelta | None = field(default=None, metadata={"own": True})
    #: Compare every rank's arguments before building, and confirm every rank built, through the store.
    check_consistency: bool = field(default=True, metadata={"own": True})
    #: The global ranks to build the topology over (None: the whole world).
    ranks: Sequence[int] | None = field(default=None, metadata={"own": True})
    #: Which of the three sizes were passed under their short name (for error messages only).
    spelled: tuple[str, ...] = field(default=(), metadata={"internal": True}, compare=False, repr=False)

    # --- the signature of each release ---------------------------------------------------------

    @classmethod
    def parameters(cls) -> tuple[dataclasses.Field, ...]:
        """Every parameter, in megatron-core's order (the releases' orders merged), ours last."""
        return tuple(f for f in dataclasses.fields(cls) if not f.metadata.get("internal"))

    @classmethod
    def own(cls) -> tuple[dataclasses.Field, ...]:
        """parallel_state's own parameters (keyword-only in every release)."""
        return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("own"))

    @classmethod
    def positional(cls, release: str | None = None) -> tuple[str, ...]:
        """The parameters ``release`` (default: in use) takes positionally, in its order."""
        return tuple(p.name for p in releases.positional("initialize_model_parallel", release))

    @classmethod
    def keyword_only(cls, release: str | None = None) -> tuple[tuple[str, Any], ...]:
        """``(name, default)`` of every keyword-only parameter in ``release``: other releases', the aliases, ours."""
        others = [(p.name, p.default) for p in releases.keyword_only("initialize_model_parallel", release)]
        return (*others, *((alias, None) for alias in ALIASES), *((f.name, f.default) for f in cls.own()))

    @classmethod
    def signature(cls, release: str | None = None) -> inspect.Signature:
        """``initialize_model_parallel``'s signature for ``release`` (default: the release in use)."""
        by_name = {f.name: f for f in cls.parameters()}
        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=by_name[n].default,
                                    annotation=by_name[n].type) for n in cls.positional(release)]
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d,
                                     annotation=by_name[n].type if n in by_name else "int | None")
                   for n, d in cls.keyword_only(release)]
        return inspect.Signature(params, return_annotation="None")

    @classmethod
    def bind(cls, args: Sequence[Any], kwargs: Mapping[str, Any], release: str | None = None) -> InitArguments:
        """The arguments of one call, bound as ``release`` (default: the release in use) binds them."""
        what = "initialize_model_parallel()"
        release = release or releases.in_use()
        positional = cls.positional(release)
        if len(args) > len(positional):
            raise ParallelStateTypeError(releases.too_many(what, len(positional), len(args), release))
        names = {f.name for f in cls.parameters()} | set(ALIASES)
        values: dict[str, Any] = dict(zip(positional, args, strict=False))
        for key, value in kwargs.items():
            if key not in names:
                close = difflib.get_close_matches(key, sorted(names), n=1)
                raise ParallelStateTypeError(
                    f"{what} got an unexpected keyword argument {key!r}"
                    + (f"; did you mean {close[0]!r}?" if close else "")
                )
            if key in values:
                raise ParallelStateTypeError(f"{what} got multiple values for argument {key!r}")
            values[key] = value
        return cls.from_call(values)

    @classmethod
    def from_call(cls, values: Mapping[str, Any]) -> InitArguments:
        """The value of a call's bound arguments (``initialize_model_parallel``'s parameters, the aliases
        among them); a parameter left out takes its default. An alias given beside its parameter set to
        another value than its default is a TypeError."""
        out = {k: v for k, v in values.items() if k not in ALIASES}
        spelled = []
        defaults = {f.name: f.default for f in cls.parameters()}
        for alias, target in ALIASES.items():
            value = values.get(alias)
            if value is None:
                continue
            if out.get(target, defaults[target]) != defaults[target]:
                raise ParallelStateTypeError(
                    f"initialize_model_parallel() got both {target}={out[target]!r} and its alias {alias}={value!r}; "
                    f"pass only one of them"
                )
            out[target] = value
            spelled.append(alias)
        return cls(**out, spelled=tuple(spelled))  # type: ignore[call-arg]

    # --- what the ranks compare ------------------------------------------------------------

    def comparable(self) -> dict[str, Any]:
        """Every argument as ranks can compare it: callables by name, the order by the layout it means.

        The ranks compare all but ``LOCAL``; the group cache keys a topology by all of them.
        """
        out: dict[str, Any] = {}
        for f in self.parameters():
            value = getattr(self, f.name)
            if callable(value):
                value = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
            elif isinstance(value, datetime.timedelta):
                value = value.total_seconds()
            elif isinstance(value, (list, tuple)):
                value = list(value)
            elif value is not None and not isinstance(value, (bool, int, float, str)):
                value = repr(value)
            out[f.name] = value
        out["order"] = self._layout_order()
        return out

    def _layout_order(self) -> Any:
        """The order as the decoder and expert layouts it means (tokens completed, gtp_remat placed)."""
        try:  # before validation (the ranks compare first): a value that is no size keeps the order as written
            checked = validation.sizes(self.sizes())
            decoder_order, expert_order = checked.orders()
            decoder = "-".join(normalize_order(decoder_order, {"tp": checked.tp, "cp": checked.cp, "pp": checked.pp,
                                                               "gtp_remat": checked.gtp}))
            expert = "-".join(normalize_order(expert_order, {"tp": checked.expert_tp, "ep": checked.ep,
                                                             "pp": checked.pp, "gtp_remat": checked.egtp}))
            return decoder if decoder == expert else [decoder, expert]
        except ParallelStateError:
            return self.order

    def sizes(self) -> Sizes:
        """The topology's sizes, each read from its parameter (``sizes.PARAMETERS``), as given."""
        return Sizes(**{name: getattr(self, parameter) for name, parameter in PARAMETERS.items()})

    # --- the values, checked ---------------------------------------------------------------

    def _size_name(self, name: str) -> str:
        alias = next((k for k, v in ALIASES.items() if v == name and k in self.spelled), None)
        return alias or name

    def validated(self) -> InitArguments:
        """The same arguments with every value checked and normalized (ints, tuples), or the error naming it.

        The sizes are checked by ``validation.sizes``, the rules TopologyPlan applies, under these names.
        """
        checked = validation.sizes(self.sizes(), {name: self._size_name(parameter)
                                                   for name, parameter in PARAMETERS.items()})
        sizes = {parameter: getattr(checked, name) for name, parameter in PARAMETERS.items()}
        optional = {name: a.optional_positive_int(name, getattr(self, name)) for name in (
            "virtual_pipeline_model_parallel_size", "local_world_size")}
        flags = {name: a.flag(name, getattr(self, name)) for name in (
            "use_sharp", "hybrid_context_parallel", "create_gloo_process_groups", "check_consistency")}
        if self.create_all_gather_group is not None:  # Megatron's type is Optional[bool]
            flags["create_all_gather_group"] = a.flag("create_all_gather_group", self.create_all_gather_group)
        backend = a.optional_str("pipeline_model_parallel_comm_backend", self.pipeline_model_parallel_comm_backend,
                                 "gloo")
        if backend not in (None, "nccl", "gloo", "ucc"):
            raise ParallelStateError(
                f"pipeline_model_parallel_comm_backend={backend!r} is not a backend; use None (the default "
                f"group's), 'nccl', 'gloo' or 'ucc'"
            )
        sharp_group = a.optional_str("sharp_enabled_group", self.sharp_enabled_group, "dp")
        for name in ("get_embedding_ranks", "get_position_embedding_ranks"):
            a.optional_callable(name, getattr(self, name))
        priority = a.optional_str_list("high_priority_stream_groups", self.high_priority_stream_groups, "cp")
        path = self.nccl_communicator_config_path
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ParallelStateTypeError(
                f"nccl_communicator_config_path must be the path of a YAML file or None, got {path!r}"
            )
        if sharp_group is not None:
            if not flags["use_sharp"]:
                raise ParallelStateAssertionError(
                    f"sharp_enabled_group={sharp_group!r} is only valid with use_sharp=True; pass use_sharp=True "
                    f"or leave sharp_enabled_group None"
                )
            if sharp_group not in ("dp", "dp_replica"):
                raise ParallelStateAssertionError(
                    f"sharp_enabled_group={sharp_group!r} is not a SHARP group; use 'dp' or 'dp_replica'"
                )
            if sharp_group == "dp_replica" and checked.dist_opt_instances == 1:
                raise ParallelStateAssertionError(
                    "sharp_enabled_group='dp_replica' needs num_distributed_optimizer_instances > 1 (the replica "
                    "group spans the instances)"
                )
        offset = a.non_negative_int("rank_offset", self.rank_offset)
        if self.ranks is not None and (offset or optional["local_world_size"] is not None):
            raise ParallelStateTypeError(
                f"initialize_model_parallel() got ranks={self.ranks!r} and rank_offset={offset} / local_world_size="
                f"{optional['local_world_size']}: they are two spellings of one thing (the ranks to build over); "
                f"pass one of them"
            )
        return dataclasses.replace(
            self, **sizes, **optional, **flags, pipeline_model_parallel_comm_backend=backend,
            sharp_enabled_group=sharp_group, rank_offset=offset,
            high_priority_stream_groups=None if priority is None else tuple(priority),
            timeout=self.groups_timeout(),
        )

    def groups_timeout(self) -> datetime.timedelta:
        """The groups' timeout: ``timeout`` when given, else ``distributed_timeout_minutes``."""
        return a.timeout_of(self.timeout, self.distributed_timeout_minutes)

    # --- what the arguments build ----------------------------------------------------------

    def subset(self, world_size: int) -> tuple[int, ...] | None:
        """The global ranks ``rank_offset`` / ``local_world_size`` lay the topology over (None: the world)."""
        offset, local = self.rank_offset, self.local_world_size
        if not offset and local is None:
            return None
        local = world_size if local is None else local  # megatron-core 0.17: the whole world's size
        if offset + local > world_size:
            raise ParallelStateValueError(
                f"rank_offset={offset} with local_world_size={self.local_world_size} lays the topology over ranks "
                f"{offset} to {offset + local - 1}, beyond the world of {world_size} ranks; pass a local_world_size "
                f"of at most {world_size - offset}"
            )
        return tuple(range(offset, offset + local))

    def plan(self, world_size: int, members: tuple[int, ...] | None = None) -> TopologyPlan:
        """The topology these (validated) arguments lay out over ``world_size`` ranks (``members``, if given)."""
        return TopologyPlan(
            world_size, **self.sizes().values(), hybrid_cp=self.hybrid_context_parallel,
            all_gather=bool(self.create_all_gather_group), embedding_ranks=self.get_embedding_ranks,
            position_embedding_ranks=self.get_position_embedding_ranks, ranks=members,
        )

    def sharp_kind(self) -> str | None:
        """The kind whose NCCL communicator SHARP is enabled for (megatron-core: dp x cp, or the replica group)."""
        if not self.use_sharp:
            return None
        return EDP_INTER.name if self.sharp_enabled_group == "dp_replica" else DP_CP.name
