"""parallel_state against the facts of megatron-core 0.17, 0.18 and 0.19 (tests/data/megatron_releases.json).

0.17+ needs Python >= 3.12, so its own initialize cannot run here; its facts were read from each
release's source on real gloo ranks (see the data's ``generated_by``, and test_megatron_release_data,
which checks that method against the installed 0.16.1). For every case of those releases, every
rank runs ``parallel_state.initialize_model_parallel`` with the case's arguments and describes the same
things: every megatron-core module global (as parallel_state serves it), which globals are one
object, every accessor call with its flag variants, ``ProcessGroupCollection``'s fields, the
follow-up calls. Each must equal the release's, but for the differences docs/megatron.md names.
World-8 cases run on the session's real gloo ranks; world-16 cases (all with gtp_remat, so no gloo
group) on torch's fake backend, one simulated rank after another, in a subprocess.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import megatron_releases as mr
import megatron_snapshot as ms
import pytest

import parallel_state as ps

SECONDS = datetime.timedelta(seconds=60)
HERE = os.path.dirname(os.path.abspath(__file__))
RELEASES = ("0.17", "0.18", "0.19")

#: (release, case) -> why parallel_state answers otherwise (docs/megatron.md says so too).
INITIALIZES_WHERE_MEGATRON_FAILS = {
    ("0.19", "cp2-order-without-tp"): "0.19 fails on an order without 'tp' (ValueError: 'tp' is not in list, after "
                                      "building some groups); 0.16-0.18 and parallel_state lay tp out last",
}


def _cases(world):
    out = []
    for release in RELEASES:
        for name, layout in mr.layouts(release).items():
            if layout["world_size"] == world:
                out.append(dict(release=release, name=name, kwargs=layout["kwargs"],
                                calls=ms.accessor_calls(mr.release(release)["public"]["functions"], world),
                                globals=sorted({g for g in layout.get("globals", {})}),
                                fields=mr.pg_collection_fields(release), then=layout.get("then_calls", [])))
    return out


def _error(exc):
    return {"error": type(exc).__name__, "assertion": isinstance(exc, AssertionError),
            "value": isinstance(exc, ValueError), "message": str(exc)[:200]}


def snapshot(case):
    """This rank's view of parallel_state after the case's initialize, in megatron_snapshot's terms."""
    import torch.distributed as dist

    out = {"globals": {n: ms.describe(getattr(ps, n)) for n in case["globals"]}}
    seen, aliases = {}, {}
    for name in case["globals"]:
        value = getattr(ps, name)
        if isinstance(value, dist.ProcessGroup) and seen.setdefault(id(value), name) != name:
            aliases[name] = seen[id(value)]
    out["aliases"] = aliases
    out["accessors"] = {}
    for key, kwargs in case["calls"].items():
        try:
            out["accessors"][key] = ms.describe(getattr(ps, key.split("(", 1)[0])(**kwargs))
        except Exception as exc:
            out["accessors"][key] = _error(exc)
    try:
        collection = ps.process_group_collection(case["fields"], megatron=False)
        out["pg_collection"] = {f: ms.describe(getattr(collection, f)) for f in case["fields"]}
    except Exception as exc:
        out["pg_collection_error"] = _error(exc)
    for step in case["then"]:
        key = f"{step['call']}({', '.join(f'{k}={v}' for k, v in step['kwargs'].items())})"
        out.setdefault("then", {})[key] = ms.describe(getattr(ps, step["call"])(**step["kwargs"]))
    return out


def case_layouts(cases, **init):
    """Every case on this rank: initialize as the case says, describe, destroy. Cases of several releases
    with the same arguments (these ranks follow one API for all of them) share one initialize, unless
    one has follow-up calls, which may change what the next would describe."""
    init = {"timeout": SECONDS, **init}
    runs = {}
    for case in cases:
        key = (json.dumps(case["kwargs"], sort_keys=True),) if not case["then"] else (id(case),)
        runs.setdefault(key, []).append(case)
    out = {}
    for same in runs.values():
        labels = [f"{case['release']}/{case['name']}" for case in same]
        try:
            ps.initialize_model_parallel(**same[0]["kwargs"], **init)
        except Exception as exc:
            out.update(dict.fromkeys(labels, {"initialize": _error(exc)}))
            continue
        try:
            out.update(zip(labels, map(snapshot, same), strict=True))
        finally:
            ps.destroy_model_parallel()
    return out


def fake_world(cases, world):
    """Each case on each rank of a fake ``world``, one simulated rank at a time (torch's fake backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    per_rank = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            per_rank.append(case_layouts(cases, check_consistency=False))
        finally:
            dist.destroy_process_group()
    return per_rank


def _agree(theirs, ours):
    """Equal answers; or both errors, ours an AssertionError / ValueError where megatron-core's is one."""
    if not (isinstance(theirs, dict) and "error" in theirs):
        return theirs == ours
    if not (isinstance(ours, dict) and "error" in ours):
        return False
    return {"AssertionError": ours["assertion"], "ValueError": ours["value"]}.get(theirs["error"], True)


def _compare(release, name, merged, followed):
    """What differs between the release's facts and ours for one case (an empty list when nothing does),
    on ranks that followed release ``followed``'s API."""
    layout = mr.layouts(release)[name]
    if "initialize" in layout:
        if (release, name) in INITIALIZES_WHERE_MEGATRON_FAILS:
            return [] if "initialize" not in merged else [f"initialize failed: {merged['initialize']}"]
        ours = merged.get("initialize") or [None] * len(layout["initialize"])
        return [] if all(_agree(t, o) for t, o in zip(layout["initialize"], ours, strict=True)) else \
            [f"initialize: megatron-core {layout['initialize'][0]}, parallel_state {ours[0]}"]
    wrong = []
    for rank in range(layout["world_size"]):
        theirs, ours = (_same_objects(side.get("aliases", {}), rank) for side in (layout, merged))
        if theirs != ours:
            wrong.append(f"rank {rank}: the same object in megatron-core {sorted(map(sorted, theirs))}, "
                         f"in parallel_state {sorted(map(sorted, ours))}")
    for section in ("globals", "accessors", "pg_collection"):
        for key, theirs in layout.get(section, {}).items():
            if section == "accessors" and key == "get_all_ranks()" and release != followed:
                continue  # its format is the release in use's (test_megatron_releases checks 0.19's)
            ours = merged.get(section, {}).get(key, [None] * len(theirs))
            for rank, (t, o) in enumerate(zip(theirs, ours, strict=True)):
                if not _agree(t, o):
                    wrong.append(f"{section} {key} rank {rank}: megatron-core {t} parallel_state {o}")
    errors = layout.get("pg_collection_error", [])
    for rank, theirs in enumerate(errors):
        if theirs is not None and not (merged.get("pg_collection_error") or [None] * len(errors))[rank]:
            wrong.append(f"pg_collection rank {rank}: megatron-core fails ({theirs['message']}), ours does not")
    return wrong


def _same_objects(aliases, rank):
    """The sets of globals holding one object on ``rank``, from a snapshot's ``aliases`` (name -> the first
    global holding its object, per rank): which global is first depends on a module's order of names."""
    classes = {}
    for name, firsts in aliases.items():
        if firsts[rank] is not None:
            classes.setdefault(firsts[rank], {firsts[rank]}).add(name)
    return {frozenset(c) for c in classes.values()}


def _then_checks(release, name, merged):
    """create_all_gather_groups: the dp x cp / expert dp groups' own ranks (megatron-core 0.18+ lays them out
    with the default order and no offset, and fails under gtp_remat: docs/megatron.md)."""
    wrong = []
    for key, per_rank in merged.get("then", {}).items():
        for rank, (ag, expert_ag) in enumerate(per_rank):
            if ag != merged["globals"]["_DATA_PARALLEL_GROUP_WITH_CP"][rank]:
                wrong.append(f"{key} rank {rank}: {ag}")
            wanted = merged["globals"]["_EXPERT_DATA_PARALLEL_GROUP"][rank] if "True" in key and \
                mr.layouts(release)[name]["kwargs"].get("expert_model_parallel_size", 1) > 1 else None
            if expert_ag != wanted:
                wrong.append(f"{key} rank {rank}: expert {expert_ag}, wanted {wanted}")
        theirs = mr.layouts(release)[name].get("then", {}).get(key)
        if name == "ep2-tp2" and theirs != per_rank:  # the default order: megatron-core's own layout
            wrong.append(f"{key}: megatron-core {theirs} parallel_state {per_rank}")
    return wrong


#: The release whose API the ranks follow for each release's cases: 0.19's accessors take 0.19's keywords
#: (with_gtp_remat) only where 0.19 is the release in use; 0.17's and 0.18's are the installed 0.16's or fewer.
FOLLOWED = {"0.17": None, "0.18": None, "0.19": "0.19"}


@pytest.fixture(scope="module")
def real_ranks(pools):
    cases = _cases(8)
    per_rank = {}
    for followed in dict.fromkeys(FOLLOWED.values()):
        mine = [c for c in cases if FOLLOWED[c["release"]] == followed]
        pool = pools(8) if followed is None else pools(8, megatron=False, release=followed)
        for rank, out in enumerate(pool.run(case_layouts, mine, timeout=600)):
            per_rank.setdefault(rank, {}).update(out)
    return cases, [per_rank[r] for r in sorted(per_rank)]


def test_every_world_8_case_of_017_to_019_answers_as_megatron_core(real_ranks):
    cases, per_rank = real_ranks
    assert len(cases) >= 28 and {c["release"] for c in cases} == set(RELEASES)
    for case in cases:
        label = f"{case['release']}/{case['name']}"
        merged = ms.merge([r[label] for r in per_rank])
        followed = FOLLOWED[case["release"]] or ps.megatron_release()
        wrong = (_compare(case["release"], case["name"], merged, followed)
                 + _then_checks(case["release"], case["name"], merged))
        assert not wrong, (label, wrong[:8], len(wrong))
        if case["globals"]:  # real layouts, not empty answers
            assert any(isinstance(v, dict) and len(v.get("group", ())) > 1
                       for v in merged["globals"]["_MODEL_PARALLEL_GROUP"] + merged["globals"]["_DATA_PARALLEL_GROUP"])


def test_every_world_16_case_of_019_answers_as_megatron_core():
    cases = _cases(16)
    assert {c["name"] for c in cases} >= {"tp2-gtp2-cp2-pp2", "tp2-gtp2-ep2-egtp2-etp1-pp2"}
    code = (f"import json, sys; sys.path[:0] = [{HERE!r}, {os.path.dirname(HERE)!r}]; "
            "import test_megatron_release_layouts as t; "
            "print(json.dumps(t.fake_world(json.loads(sys.stdin.read()), 16)))")
    env = {**os.environ, "PARALLEL_STATE_MEGATRON_RELEASE": "0.19"}  # 0.19's API: its accessors' keywords
    run = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    per_rank = json.loads(run.stdout.strip().splitlines()[-1])
    for case in cases:
        label = f"{case['release']}/{case['name']}"
        merged = ms.merge([r[label] for r in per_rank])
        wrong = _compare(case["release"], case["name"], merged, "0.19")
        assert not wrong, (label, wrong[:8], len(wrong))
