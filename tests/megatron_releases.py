"""Facts of megatron-core 0.16 to 0.19's ``parallel_state``, read from ``tests/data/megatron_releases.json``.

Only megatron-core 0.16.1 installs on this project's Python 3.11; 0.17.1, 0.18.2 and 0.19.2 need Python >= 3.12.
``python -m tests.oracles snapshot`` wrote the file from the real packages installed in Python 3.12 environments
(``tests/oracles``; how: the file's ``generated_by``); the facts are looked up here:

- ``version``: the megatron-core version described;
- ``public``: each public function and class ``parallel_state.py`` defines, with its parameters in order
  (``name``, ``kind``, ``default`` as its ``repr`` or None when it has none, ``annotation``), and the public
  names it only imports;
- ``globals``: the module's ``_UPPER_CASE`` globals with their import-time ``repr``, those
  ``initialize_model_parallel`` declares ``global``, and its ``global_a = global_b`` aliases with their conditions;
- ``process_group_collection``: ``ProcessGroupCollection``'s fields in order and, for each, the getter and keyword
  arguments ``use_mpu_process_groups`` fills it with (None where it fills None);
- ``group_desc``: every ``group_desc`` with its NCCL config section (``get_nccl_options``' first argument);
- ``layouts``: per case (``world_size``, ``kwargs`` of ``initialize_model_parallel``, ``then_calls``: calls
  made after it, each ``{"call": name, "kwargs": {...}}``), the sections ``globals``, ``aliases``,
  ``accessors``, ``pg_collection`` and ``then`` (each maps a name to the list of every global rank's value),
  and ``process_group_list``, ``initialize`` (its error) and ``pg_collection_error`` (one value per rank).
  A process group reads ``{"group": sorted global ranks}``, an error ``{"error": type name, "message": its first
  line}``. The file stores a list whose ranks all agree once (``{"every_rank": value}``); ``load`` gives the lists.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_releases.json")
POSITIONAL = ("positional-only", "positional-or-keyword")


#: The layout sections that map a name to per-rank lists, and those that are one per-rank list.
TABLES = ("globals", "aliases", "accessors", "pg_collection", "then")
LISTS = ("process_group_list", "initialize", "pg_collection_error")
EVERY_RANK = "every_rank"


def _converted(layout: dict[str, Any], convert: Any) -> dict[str, Any]:
    out = dict(layout)
    for section, value in layout.items():
        if section in TABLES:
            out[section] = {k: convert(v) for k, v in value.items()}
        elif section in LISTS:
            out[section] = convert(value)
    return out


def pack(layout: dict[str, Any]) -> dict[str, Any]:
    """A layout as the file stores it: each per-rank list whose ranks all agree as ``{"every_rank": value}``."""
    def one(per_rank: Any) -> Any:
        same = isinstance(per_rank, list) and per_rank and all(v == per_rank[0] for v in per_rank)
        return {EVERY_RANK: per_rank[0]} if same else per_rank

    return _converted(layout, one)


def unpack(layout: dict[str, Any]) -> dict[str, Any]:
    """A stored layout with every per-rank list ``world_size`` long again."""
    def full(value: Any) -> Any:
        stored_once = isinstance(value, dict) and set(value) == {EVERY_RANK}
        return [value[EVERY_RANK]] * layout["world_size"] if stored_once else value

    return _converted(layout, full)


@functools.lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    """The whole file, read once, every layout's per-rank lists in full."""
    with open(PATH, encoding="utf-8") as f:
        data = json.load(f)
    for release in data["releases"].values():
        release["layouts"] = {n: unpack(lay) for n, lay in release["layouts"].items()}
    return data


def names() -> list[str]:
    """The releases the file describes, oldest first: ``["0.16", "0.17", "0.18", "0.19"]``."""
    return sorted(load()["releases"], key=lambda n: tuple(map(int, n.split("."))))


def release(name: str) -> dict[str, Any]:
    """Everything about one release (``"0.16"`` ... ``"0.19"``); KeyError names the known ones."""
    releases = load()["releases"]
    if name not in releases:
        raise KeyError(f"no megatron-core release {name!r} in {PATH}; known: {sorted(releases)}")
    return releases[name]


def public_names(name: str) -> set[str]:
    """The public functions and classes the release's ``parallel_state.py`` defines."""
    public = release(name)["public"]
    return set(public["functions"]) | set(public["classes"])


def signature(name: str, function: str) -> list[dict[str, Any]]:
    """Parameters of ``function`` in ``name``'s release: a function's name, or ``"Class.method"`` /
    ``"Class.__init__"``. KeyError when the release has no such function."""
    public = release(name)["public"]
    if "." in function:
        cls, method = function.split(".", 1)
        entry = public["classes"][cls]
        return entry["__init__"] if method == "__init__" else entry["methods"][method]
    return public["functions"][function]


def positional_order(name: str, function: str) -> list[str]:
    """The names a positional call binds, in order."""
    return [p["name"] for p in signature(name, function) if p["kind"] in POSITIONAL]


def defaults(name: str, function: str) -> dict[str, str | None]:
    """Each parameter's default as its ``repr``, None where it has none."""
    return {p["name"]: p["default"] for p in signature(name, function)}


def pg_collection_fields(name: str) -> list[str]:
    """``ProcessGroupCollection``'s field names, in declaration order."""
    return list(release(name)["process_group_collection"]["fields"])


def use_mpu_process_groups(name: str) -> dict[str, dict[str, Any] | None]:
    """Per field: ``{"getter": parallel_state function, "kwargs": {...}}``, or None where megatron fills None."""
    return dict(release(name)["process_group_collection"]["use_mpu_process_groups"])


def group_descs(name: str) -> list[dict[str, Any]]:
    """Every ``group_desc`` (``{group_size}`` / ``{level}`` templates kept) with ``nccl_config``, ``backend``,
    the ``function`` that creates it and, for the helpers' groups, ``via``."""
    return list(release(name)["group_desc"])


def layouts(name: str) -> dict[str, dict[str, Any]]:
    """The release's cases by name."""
    return dict(release(name)["layouts"])


def case_specs(name: str, world_size: int | None = None) -> list[dict[str, Any]]:
    """The release's cases as ``megatron_snapshot.run_cases`` takes them (``name``, ``world_size``, ``kwargs``,
    ``then``), optionally only those of one world size."""
    return [{"name": n, "world_size": lay["world_size"], "kwargs": lay["kwargs"], "then": lay["then_calls"]}
            for n, lay in layouts(name).items() if world_size in (None, lay["world_size"])]


def rank_view(layout: dict[str, Any], rank: int) -> dict[str, Any]:
    """One rank's part of a case: each section's names mapped to that rank's value (per-rank sections
    such as ``initialize`` and ``process_group_list`` give the value itself)."""
    out: dict[str, Any] = {}
    for section, value in layout.items():
        if section in ("world_size", "kwargs", "then_calls"):
            continue
        if isinstance(value, dict):
            out[section] = {k: v[rank] for k, v in value.items()}
        elif isinstance(value, list):
            out[section] = value[rank]
    return out


def added_and_removed(old: str, new: str) -> tuple[list[str], list[str]]:
    """Public names ``new`` defines that ``old`` does not, and the reverse, each sorted."""
    a, b = public_names(old), public_names(new)
    return sorted(b - a), sorted(a - b)


def changed_signatures(old: str, new: str) -> list[str]:
    """Functions (and ``Class.method``) present in both whose parameter lists differ, sorted."""
    def entries(name: str) -> dict[str, Any]:
        public = release(name)["public"]
        out = dict(public["functions"])
        for cls, entry in public["classes"].items():
            out[f"{cls}.__init__"] = entry["__init__"]
            out.update({f"{cls}.{m}": v for m, v in entry["methods"].items()})
        return out

    a, b = entries(old), entries(new)
    return sorted(k for k in a.keys() & b.keys() if a[k] != b[k])


#: parallel_state's functions (and constructors) that add keyword-only parameters (this project's, or another
#: release's) after megatron-core's own: each is called once per topology, not per layer, so the generic call
#: a keyword-only parameter costs does not matter there. Every other public function takes exactly the
#: parameters of the release in use.
EXTENDED = ("initialize_model_parallel", "update_pg_timeout", "GlobalMemoryBuffer.__init__", "RankGenerator.__init__")


def signature_differences(name: str, module: Any) -> dict[str, list[list[Any]]]:
    """``module``'s functions whose parameters (names, kinds, defaults) are not exactly those of release
    ``name``'s function of that name: function -> ours as ``[name, kind, repr(default) or None]``."""
    import inspect

    wrong = {}
    for function, theirs in release(name)["public"]["functions"].items():
        ours = [[p.name, p.kind.name.lower().replace("_", "-"), None if p.default is p.empty else repr(p.default)]
                for p in inspect.signature(getattr(module, function)).parameters.values()]
        if ours != [[p["name"], p["kind"], p["default"]] for p in theirs]:
            wrong[function] = ours
    return wrong
