"""Per-group NCCL communicator settings: megatron-core 0.16's ``get_nccl_options`` and friends.

The settings are a mapping from megatron-core's group names (``"tp"``, ``"dp_cp"``, ``"pp"``,
...) to a mapping of ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``,
``min_ctas`` and ``net_name`` (a group left out, or a setting left out, keeps NCCL's default).
``load_nccl_comm_cfgs`` reads them from megatron-core's YAML file (its
``nccl_communicator_config_path``) and adds ``high_priority_stream_groups``; :class:`NcclSettings`
is one build's settings as one value, which gives each kind its options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from parallel_state.errors import ParallelStateError, ParallelStateTypeError
from parallel_state.topology.arguments import optional_str_list

#: The ``ProcessGroupNCCL.Options.config`` fields a group's settings may set.
CONFIG_KEYS: tuple[str, ...] = ("cga_cluster_size", "max_ctas", "min_ctas", "net_name")
#: Every key megatron-core reads from a group's settings.
KNOWN_KEYS: tuple[str, ...] = ("is_high_priority_stream", *CONFIG_KEYS)


def _cfgs(nccl_comm_cfgs: object) -> Mapping[str, Any]:
    if not isinstance(nccl_comm_cfgs, Mapping):
        raise ParallelStateTypeError(
            f"nccl_comm_cfgs must be a dict of group name -> settings such as {{'tp': {{'max_ctas': 16}}}}, "
            f"got {nccl_comm_cfgs!r}"
        )
    return nccl_comm_cfgs


def get_nccl_options(pg_name: str, nccl_comm_cfgs: Mapping[str, Mapping[str, Any]]) -> Any:
    """``ProcessGroupNCCL.Options`` for the group ``pg_name`` from ``nccl_comm_cfgs``; None when it has no entry.

    A setting the entry leaves out keeps NCCL's default (on Hopper: cga_cluster_size 4,
    max_ctas 32, min_ctas 1).
    """
    if pg_name not in _cfgs(nccl_comm_cfgs):
        return None
    cfg = nccl_comm_cfgs[pg_name]
    if not isinstance(cfg, Mapping):
        raise ParallelStateTypeError(
            f"the NCCL settings of group {pg_name!r} must be a mapping such as {{'max_ctas': 16}}, got {cfg!r}"
        )
    import torch.distributed as dist

    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise ParallelStateError(
            f"NCCL settings are configured for group {pg_name!r}, but this torch build has no NCCL "
            f"(torch.distributed.ProcessGroupNCCL); drop nccl_communicator_config_path and "
            f"high_priority_stream_groups on a CPU run, or install a CUDA build of torch"
        )
    options = nccl.Options(is_high_priority_stream=cfg.get("is_high_priority_stream", False))
    for key in CONFIG_KEYS:
        if key in cfg:
            setattr(options.config, key, cfg[key])
    if "net_name" in cfg and str(options.config.net_name).lower() not in ("ib", "socket"):
        raise ParallelStateError(
            f"net_name {options.config.net_name!r} of group {pg_name!r} is not supported; use 'IB' or 'socket'"
        )
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: dict[str, dict[str, Any]], pg_name: str,
                             key_value_pair: Sequence[Any]) -> None:
    """Set one setting of group ``pg_name`` in ``nccl_comm_cfgs`` (in place), adding the group if needed."""
    _cfgs(nccl_comm_cfgs)
    if isinstance(key_value_pair, (str, bytes)) or not isinstance(key_value_pair, Sequence) or len(key_value_pair) != 2:
        raise ParallelStateTypeError(
            f"key_value_pair must be a (key, value) pair such as ('is_high_priority_stream', True), got {key_value_pair!r}"
        )
    key, value = key_value_pair
    if pg_name not in nccl_comm_cfgs:
        nccl_comm_cfgs[pg_name] = {}
    elif not isinstance(nccl_comm_cfgs[pg_name], dict):
        raise ParallelStateTypeError(
            f"the NCCL settings of group {pg_name!r} must be a dict, got {nccl_comm_cfgs[pg_name]!r}"
        )
    nccl_comm_cfgs[pg_name][key] = value


def load_nccl_comm_cfgs(path: str | None, high_priority_stream_groups: Sequence[str] | None = None
                        ) -> dict[str, dict[str, Any]]:
    """The per-group NCCL settings: the YAML file at ``path`` (None: none), plus a high-priority stream
    for each group named in ``high_priority_stream_groups``.

    As megatron-core's ``initialize_model_parallel`` reads them; an empty file (or one whose
    entries are all commented out) means no settings, and a file that is not a mapping of group
    name -> mapping of settings is an error here rather than later.
    """
    cfgs: dict[str, dict[str, Any]] = {}
    if path is not None:
        if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
            raise ParallelStateTypeError(
                f"nccl_communicator_config_path must be the path of a YAML file, or None, got {path!r}"
            )
        try:
            import yaml
        except ImportError as exc:
            raise ParallelStateError(
                "nccl_communicator_config_path needs the 'yaml' package: pip install pyyaml "
                "(or pass nccl_communicator_config_path=None)"
            ) from exc
        try:
            with open(path) as stream:
                loaded = yaml.safe_load(stream)
        except (OSError, yaml.YAMLError) as exc:
            raise ParallelStateError(
                f"nccl_communicator_config_path={path!r} cannot be read ({exc}); pass the path of a YAML file "
                f"of per-group NCCL settings, or None"
            ) from exc
        if loaded is None:  # empty, or every entry commented out: no settings (megatron-core would crash later)
            loaded = {}
        if not isinstance(loaded, dict):
            raise ParallelStateError(
                f"nccl_communicator_config_path={path!r} holds {type(loaded).__name__} {repr(loaded)[:80]}, not a "
                f"mapping of group name -> settings, e.g.\n  tp:\n    max_ctas: 16\n  dp_cp:\n"
                f"    is_high_priority_stream: true"
            )
        for name, settings in loaded.items():
            if not isinstance(settings, dict):
                raise ParallelStateError(
                    f"nccl_communicator_config_path={path!r}: the settings of group {name!r} must be a mapping of "
                    f"{list(KNOWN_KEYS)} to values, got {settings!r}"
                )
        cfgs = loaded
    groups = optional_str_list("high_priority_stream_groups", high_priority_stream_groups, "dp_cp") or []
    for name in groups:
        overwrite_nccl_comm_cfgs(cfgs, name, ("is_high_priority_stream", True))
    return cfgs


@dataclass(frozen=True)
class NcclSettings:
    """One build's NCCL communicator settings, by config section (megatron-core's ``nccl_comm_cfgs``)."""

    cfgs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | None, high_priority_stream_groups: Sequence[str] | None = None) -> NcclSettings:
        """The settings megatron-core's ``initialize_model_parallel`` reads (:func:`load_nccl_comm_cfgs`)."""
        return cls(load_nccl_comm_cfgs(path, high_priority_stream_groups))

    def options(self, section: str) -> Any:
        """``ProcessGroupNCCL.Options`` for a group of ``section`` (None where nothing is configured)."""
        return get_nccl_options(section, self.cfgs) if self.cfgs else None

    def key(self, section: str) -> str:
        """``section``'s settings as a comparable value: a cached group serves only equal settings."""
        return repr(self.cfgs.get(section))
