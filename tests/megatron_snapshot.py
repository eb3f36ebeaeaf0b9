"""What a megatron-core ``parallel_state`` module offers and built on this rank, as JSON-able data.

The method behind ``tests/data/megatron_releases.json``: a release's own ``parallel_state`` runs its
``initialize_model_parallel`` on real gloo ranks, and each rank describes every module global, every
accessor's answer (with its flag variants) and ``ProcessGroupCollection.use_mpu_process_groups()``'s
fields, a process group by its sorted global ranks. ``test_megatron_release_data`` runs the same
method on the installed megatron-core and compares with the data, so the method is checked by the
oracle. ``snapshot`` takes any module with megatron's names, so it also describes ``parallel_state``.
"""

from __future__ import annotations

import inspect
import itertools
import warnings
from typing import Any

KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional-or-keyword",
    inspect.Parameter.VAR_POSITIONAL: "var-positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "var-keyword",
}


def describe(value: Any) -> Any:
    """``value`` as JSON: a process group as ``{"group": sorted global ranks}``, containers element-wise,
    scalars as they are, anything else as ``{"object": its type's name}``."""
    import torch.distributed as dist

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dist.ProcessGroup):
        return {"group": sorted(dist.get_process_group_ranks(value))}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return {"object": type(value).__name__}


def signature(fn: Any) -> list[dict[str, Any]]:
    """``fn``'s parameters in order: name, kind, default as its ``repr`` (None when it has none), annotation."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        out.append({
            "name": p.name,
            "kind": KINDS[p.kind],
            "default": None if p.default is p.empty else repr(p.default),
            "annotation": None if p.annotation is p.empty else inspect.formatannotation(p.annotation),
        })
    return out


def public_api(module: Any) -> dict[str, Any]:
    """The public functions and classes ``module`` defines (in definition order, with their parameters),
    and the public functions and classes it only imports (by name)."""
    functions, classes, imported = {}, {}, []
    for name, value in vars(module).items():
        if name.startswith("_") or not (inspect.isfunction(value) or inspect.isclass(value)):
            continue
        if value.__module__ != module.__name__:
            imported.append(name)
        elif inspect.isfunction(value):
            functions[name] = signature(value)
        else:
            methods = {m: signature(getattr(value, m)) for m, v in vars(value).items()
                       if not m.startswith("_") and (inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod)))}
            classes[name] = {"__init__": signature(value.__init__), "methods": methods}
    return {"functions": functions, "classes": classes, "imported": sorted(imported)}


def _is_accessor(name: str) -> bool:
    return name.startswith(("get_", "is_", "has_")) or name == "model_parallel_is_initialized"


def accessor_calls(functions: dict[str, list[dict[str, Any]]], world_size: int) -> dict[str, dict[str, Any]]:
    """Every call of an accessor (``get_*``, ``is_*``, ``has_*``) whose parameters all have defaults:
    with no argument, with every combination of its boolean flags turned over (``check_initialized``
    aside), with ``ignore_virtual=False`` for each ``vp_stage`` in 0 and 1, and with each power-of-two
    ``group_size`` up to ``world_size``. Keys read ``name(flag=value, ...)``, parameters in signature order."""
    calls = {}
    for name, params in functions.items():
        if not _is_accessor(name) or any(p["default"] is None and not p["kind"].startswith("var") for p in params):
            continue
        names = [p["name"] for p in params]
        flags = [p for p in params if p["default"] in ("True", "False")
                 and p["name"] not in ("check_initialized", "ignore_virtual")]
        variants = []
        for turned in itertools.product((False, True), repeat=len(flags)):
            variants.append({p["name"]: p["default"] == "False" for p, t in zip(flags, turned, strict=True) if t})
        if "ignore_virtual" in names:
            variants += [{"ignore_virtual": False, "vp_stage": s} if "vp_stage" in names else {"ignore_virtual": False}
                         for s in ((0, 1) if "vp_stage" in names else (None,))]
        if "group_size" in names:
            variants += [{"group_size": 2 ** i} for i in range(world_size.bit_length()) if 2 ** i <= world_size]
        for kwargs in variants:
            ordered = {k: kwargs[k] for k in names if k in kwargs}
            calls[f"{name}({', '.join(f'{k}={v}' for k, v in ordered.items())})"] = ordered
    return calls


def _state_names(module: Any) -> list[str]:
    return [n for n in vars(module) if n.startswith("_") and n[1:2].isupper()]


def _error(exc: BaseException) -> dict[str, str]:
    """An error as its type and its message's first line (200 characters at most): never a traceback."""
    return {"error": type(exc).__name__, "message": (str(exc).splitlines() or [""])[0][:200]}


def snapshot(module: Any, calls: dict[str, dict[str, Any]], pg_collection_class: Any = None) -> dict[str, Any]:
    """This rank's view of ``module`` now: every ``_UPPER_CASE`` module global described, which of them
    hold the very same process group as an earlier one (``aliases``), the groups ``update_pg_timeout``
    would visit, each accessor call's answer (or its error) and, given ``ProcessGroupCollection``, what
    its ``use_mpu_process_groups()`` fills each field with (or ``pg_collection_error``)."""
    import torch.distributed as dist

    names = _state_names(module)
    seen: dict[int, str] = {}
    aliases = {}
    for name in names:
        value = getattr(module, name)
        if isinstance(value, dist.ProcessGroup):
            aliases[name] = seen.setdefault(id(value), name)
    listed = getattr(module, "_global_process_group_list", None)
    out = {
        "globals": {n: describe(getattr(module, n)) for n in names},
        "aliases": {n: a for n, a in aliases.items() if a != n},
        "process_group_list": None if listed is None else sorted(
            (describe(g)["group"] if g is not None else "default" for g in listed), key=lambda g: (g != "default", str(g))),
        "accessors": {},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for key, kwargs in calls.items():
            name = key.split("(", 1)[0]
            try:
                out["accessors"][key] = describe(getattr(module, name)(**kwargs))
            except Exception as exc:  # an accessor that refuses is a fact too
                out["accessors"][key] = _error(exc)
    if pg_collection_class is not None:
        import dataclasses

        fields = [f.name for f in dataclasses.fields(pg_collection_class)]
        try:
            # Every field, named in declaration order: by default megatron-core fills them in the order of a
            # set of strings, so which getter fails first would change from one process to the next.
            pgc = pg_collection_class.use_mpu_process_groups(required_pgs=fields)
            out["pg_collection"] = {f: describe(getattr(pgc, f, None)) for f in fields}
        except Exception as exc:  # e.g. on a rank outside rank_offset's window
            out["pg_collection_error"] = _error(exc)
    return out


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank-by-rank snapshots as one table: each section maps a name to the list of every rank's value."""
    out: dict[str, Any] = {}
    for rank, snap in enumerate(per_rank):
        for section, value in snap.items():
            if isinstance(value, dict) and "error" not in value:
                table = out.setdefault(section, {})
                for key, v in value.items():
                    table.setdefault(key, [None] * len(per_rank))[rank] = v
            else:
                out.setdefault(section, [None] * len(per_rank))[rank] = value
    return out


_IMPORT_TIME_STATE: dict[str, dict[str, Any]] = {}


def run_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """On every rank of a gloo world: for each case, megatron-core's own ``initialize_model_parallel(**kwargs)``,
    this rank's ``snapshot``, then each follow-up call of ``then`` (its answer described), then teardown.

    ``megatron.core.parallel_state`` is whichever the path finds: the installed one, or a release's file
    laid out elsewhere. megatron-core's teardown leaves groups alive and some globals set, so the case's
    new process groups are destroyed and every module global is put back as it was at import.
    """
    import megatron.core.parallel_state as mps
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError:
        ProcessGroupCollection = None
    state = _IMPORT_TIME_STATE.setdefault(mps.__file__, {n: getattr(mps, n) for n in _state_names(mps)})
    state["_global_process_group_list"] = None
    api = public_api(mps)
    out = {"api": api, "cases": {}}
    for case in cases:
        calls = accessor_calls(api["functions"], dist.get_world_size())
        before = set(c10d._world.pg_map)
        result: dict[str, Any] = {}
        try:
            mps.initialize_model_parallel(**case["kwargs"])
        except Exception as exc:
            result["initialize"] = _error(exc)
        else:
            result.update(snapshot(mps, calls, ProcessGroupCollection))
            for step in case.get("then", ()):
                key = f"{step['call']}({', '.join(f'{k}={v}' for k, v in step['kwargs'].items())})"
                try:
                    result.setdefault("then", {})[key] = describe(getattr(mps, step["call"])(**step["kwargs"]))
                except Exception as exc:
                    result.setdefault("then", {})[key] = _error(exc)
        # No rank frees a group before every rank has finished building it (gloo connects its members
        # while they build it, and torch's new_group returns without a barrier).
        dist.barrier()
        try:
            mps.destroy_model_parallel()
        except Exception:  # a half-built state: the reset below is what counts
            pass
        for name, value in state.items():
            setattr(mps, name, value.copy() if isinstance(value, (dict, list)) else value)
        for pg in set(c10d._world.pg_map) - before:
            dist.destroy_process_group(pg)
        out["cases"][case["name"]] = result
    return out
