"""``tests/data/megatron_releases.json`` from the installed releases: ``describe`` runs inside a release's
environment, ``write`` assembles every release's part into the file, the same bytes on every run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from . import RELEASES, cases, environments, source_facts

DATA = os.path.join(environments.REPO, "tests", "data", "megatron_releases.json")
#: Seconds for one world's cases on every rank (megatron-core's initialize is slow on a loaded machine).
CASES_TIMEOUT = 1800.0

GENERATED_BY = [
    "Made by `python -m tests.oracles snapshot` (tests/oracles/snapshot.py; docs/megatron-releases.md, the live tier):",
    "each release is the megatron-core wheel from the package index (its version under releases.<name>.version),",
    "installed in a Python 3.12 environment (`python -m tests.oracles build`) and imported from there.",
    "public, globals.module, process_group_collection.public/.fields: tests/megatron_snapshot.py's public_api(),",
    "the import-time repr of each _UPPER_CASE global (and _global_process_group_list) and dataclasses.fields().",
    "globals.declared_in_initialize_model_parallel / assigned_by_helpers / alias_assignments, group_desc and",
    "process_group_collection.use_mpu_process_groups: read from the installed files with ast",
    "(tests/oracles/source_facts.py).",
    "layouts: the cases of tests/oracles/cases.py that the release accepts, per world size on a tests/rankpool.py pool",
    "of real gloo ranks (one process per rank, FileStore, loopback) running tests/megatron_snapshot.py's run_cases():",
    "the release's own initialize_model_parallel, snapshot() of every rank, the then_calls, teardown; merge() makes",
    "each section a table of per-rank lists. A list whose ranks all hold one value is stored as {\"every_rank\": value}",
    "(tests/megatron_releases.py expands it). An error is its type and the first line of its message (200 characters).",
    "globals.set_by_initialize_in_the_layouts: the globals some layout shows other than at import, in module order.",
]

def _layouts(mps: Any, chosen: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    import megatron_snapshot as ms

    from rankpool import RankPool

    out = {}
    for world in sorted({c["world_size"] for c in chosen}):
        batch = [c for c in chosen if c["world_size"] == world]
        print(f"[oracles] {len(batch)} case(s) on {world} gloo ranks", file=sys.stderr, flush=True)
        pool = RankPool(world, start_timeout=600.0, default_timeout=600.0)
        try:
            results = pool.run(ms.run_cases, batch, timeout=CASES_TIMEOUT, cleanup=False)
        finally:
            pool.close()
        for case in batch:
            merged = ms.merge([r["cases"][case["name"]] for r in results])
            out[case["name"]] = {"world_size": world, "kwargs": case["kwargs"], "then_calls": case["then"], **merged}
    return out


def describe(name: str) -> dict[str, Any]:
    """Everything the data says of release ``name``, from the megatron-core this process imports."""
    from importlib.metadata import version

    import megatron.core.parallel_state as mps
    import megatron.core.process_groups_config as pgc
    import megatron_releases as mr
    import megatron_snapshot as ms

    installed = version("megatron-core")
    if installed != RELEASES[name]:
        raise SystemExit(f"this process imports megatron-core {installed} from {mps.__file__}, not {RELEASES[name]}")
    api = ms.public_api(mps)
    names = [n for n in vars(mps) if n.startswith("_") and n[1:2].isupper() or n == "_global_process_group_list"]
    import_time = {n: ms.describe(getattr(mps, n)) for n in names}
    fields = [f.name for f in dataclasses.fields(pgc.ProcessGroupCollection)]
    tree = source_facts.read(mps.__file__)
    init = {p["name"] for p in api["functions"]["initialize_model_parallel"]}
    layouts = _layouts(mps, cases.for_release(init, set(api["functions"])))
    changed = [n for n in names if any(v != import_time[n] for lay in layouts.values()
                                       for v in lay.get("globals", {}).get(n, ()))]
    return {
        "version": installed,
        "public": api,
        "globals": {"module": {n: repr(getattr(mps, n)) for n in names}, **source_facts.globals_facts(tree),
                    "set_by_initialize_in_the_layouts": changed},
        "process_group_collection": {
            "fields": fields, "public": ms.public_api(pgc),
            "use_mpu_process_groups": source_facts.use_mpu_process_groups(source_facts.read(pgc.__file__), fields)},
        "group_desc": source_facts.group_descs(tree),
        "layouts": {n: mr.pack(lay) for n, lay in layouts.items()},
    }


def dumps(value: Any, depth: int = 0) -> str:
    """JSON with sorted keys: objects down to the sixth level one member a line, everything deeper on one line."""
    if isinstance(value, dict) and value and depth < 6:
        pad = " " * (depth + 1)
        members = ",\n".join(f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in sorted(value.items()))
        return "{\n" + members + "\n" + " " * depth + "}"
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def run_describe(name: str) -> dict[str, Any]:
    """``describe(name)`` in the release's environment, as a subprocess."""
    why = environments.missing(name)
    if why:
        raise SystemExit(why)
    with tempfile.TemporaryDirectory(prefix="oracle-") as tmp:
        out = os.path.join(tmp, "release.json")
        cmd = [environments.python(), "-m", "tests.oracles", "describe", name, out]
        print(f"[oracles] describing megatron-core {RELEASES[name]}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True, cwd=environments.REPO, env=environments.env(name))
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def write(names: list[str], check: bool = False) -> bool:
    """Regenerate the data for ``names`` (the other releases' parts kept as they are); with ``check``, only say
    whether the file would change. Returns whether the file holds (or now holds) exactly the new bytes."""
    try:
        with open(DATA, encoding="utf-8") as f:
            old_text = f.read()
        releases = json.loads(old_text).get("releases", {})
    except FileNotFoundError:
        old_text, releases = None, {}
    releases = {n: r for n, r in releases.items() if n in RELEASES}
    for name in names:
        releases[name] = run_describe(name)
    text = dumps({"generated_by": GENERATED_BY, "releases": releases}) + "\n"
    if check:
        same = text == old_text
        print(f"[oracles] {DATA} {'holds exactly these bytes' if same else 'would change'} ({len(text)} bytes)")
        return same
    with open(DATA, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"[oracles] wrote {DATA} ({len(text)} bytes; {'unchanged' if text == old_text else 'changed'})")
    return True
