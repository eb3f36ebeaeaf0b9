"""megatron-core 0.17, 0.18 and 0.19 beside 0.16: the release in use, gtp_remat, rank_offset, the
all-gather groups and process-group collections, on real gloo ranks.

The installed megatron-core 0.16.1 is the live oracle elsewhere (test_megatron_parity); 0.17+ needs
Python >= 3.12, so their facts (read from their release tags) are test data: tests/data/megatron_releases.json,
checked here against what parallel_state builds.
"""

from __future__ import annotations

import datetime
import inspect
import os
import sys

import megatron_releases as mr
import pytest

import parallel_state as ps
from parallel_state import ParallelStateError, TopologyPlan
from parallel_state.megatron import megatron_globals
from parallel_state.topology import releases
from parallel_state.topology.release_table import KNOWN, REQUIRED, SIGNATURES

SECONDS = datetime.timedelta(seconds=30)
HERE = os.path.dirname(os.path.abspath(__file__))


# --- the release in use ---------------------------------------------------------------------------

def test_the_installed_release_is_read_without_importing_megatron(tmp_path, monkeypatch):
    package = tmp_path / "megatron" / "core"
    package.mkdir(parents=True)
    (package / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), str(tmp_path)])
    monkeypatch.delitem(sys.modules, "megatron.core.package_info", raising=False)
    assert releases.installed() == "0.19"
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere")])
    assert releases.installed() is None
    with pytest.raises(ValueError, match="write it as major.minor"):
        releases.parse("nineteen")


def test_the_test_machine_mirrors_the_installed_megatron_core():
    from importlib.metadata import version

    assert releases.installed() == ".".join(version("megatron-core").split(".")[:2]) == ps.megatron_release()


# --- the release table against each release's facts ----------------------------------------------

def _public(function, release):
    """A function's parameters in a release's data (``Class.method``: without ``self``), or None if it has none."""
    try:
        params = mr.signature(release, function)
    except KeyError:
        return None
    return [p for p in params if p["name"] != "self"]


def test_every_releases_signatures_are_the_tables():
    assert mr.names() == list(KNOWN)
    for release in KNOWN:
        for function, rows in SIGNATURES.items():
            data = _public(function, release)
            table = releases.positional(function, release)
            # The release's parameters, in its order, with its defaults: exactly the table's rows for it.
            assert [p["name"] for p in data] == [p.name for p in table], (release, function)
            assert [p["default"] for p in data] == [None if p.default is REQUIRED else repr(p.default)
                                                    for p in table], (release, function)
            assert {p.name for p in releases.keyword_only(function, release)} == {p.name for p in rows} - {
                p["name"] for p in data}


def test_every_function_whose_parameters_change_between_releases_has_rows():
    changed = set()
    for old, new in zip(KNOWN, KNOWN[1:], strict=False):
        changed |= {f for f in mr.changed_signatures(old, new) if _public(f, old) and _public(f, new)}
    assert changed == set(SIGNATURES), "a function whose parameters differ between releases needs rows in " \
                                       "release_table.SIGNATURES (or has rows but no difference)"


def test_each_releases_globals_are_the_tables():
    for release in KNOWN:
        module = set(mr.release(release)["globals"]["module"])
        ours = {name for name in megatron_globals.NAMES if releases.has_global(name, release)}
        assert ours == module & megatron_globals.NAMES, release
        assert not module - megatron_globals.NAMES, f"globals of {release} that parallel_state does not serve"
    assert releases.has_global("_GTP_WEIGHT_REMAT_GROUP", "0.20") is None  # unknown: the module's own


def test_the_installed_016_signatures_are_the_tables():
    import megatron.core.parallel_state as mps

    for function in SIGNATURES:
        owner, _, method = function.partition(".")
        theirs = inspect.signature(getattr(getattr(mps, owner), method) if method else getattr(mps, function))
        want = [(p.name, p.default) for p in releases.positional(function, "0.16")]
        got = [(p.name, REQUIRED if p.default is p.empty else p.default) for p in theirs.parameters.values()
               if p.name != "self"]
        assert got == want, function


def test_no_public_function_pastes_a_signature():
    for name in dir(ps):
        obj = getattr(ps, name)
        for fn in (obj, getattr(obj, "__init__", None)) if inspect.isclass(obj) else (obj,):
            if inspect.isfunction(fn) and fn.__module__.startswith("parallel_state"):
                assert "__signature__" not in vars(fn), name
                kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
                assert inspect.Parameter.VAR_KEYWORD not in kinds, name


EXTENDED = tuple(f for f in mr.EXTENDED if "." not in f)  # the functions among them


def test_every_other_function_takes_exactly_the_release_in_uses_parameters():
    """Under 0.16 (the installed release): no other release's parameter, by position or by keyword."""
    assert sorted(mr.signature_differences("0.16", ps)) == sorted(EXTENDED)


def case_probe():
    """What this process binds, as the release its environment declares: run on ranks that were given that
    environment before they imported parallel_state (a world of one, without megatron-core loaded)."""

    from parallel_state import RankGenerator

    out = {"release": ps.megatron_release()}
    if out["release"] in mr.names():
        out["differences"] = sorted(mr.signature_differences(out["release"], ps))
    names = ["initialize_model_parallel", "get_data_parallel_group", "get_data_parallel_rank",
             "get_expert_data_parallel_group", "get_expert_data_parallel_rank"]
    out["signatures"] = {n: [[p.name, p.kind.name] for p in inspect.signature(getattr(ps, n)).parameters.values()]
                         for n in names}

    def target(function):
        owner, _, method = function.partition(".")
        return getattr(getattr(ps, owner), method) if method else getattr(ps, function)

    def positional(function):
        return [p.name for p in inspect.signature(target(function)).parameters.values()
                if p.kind.name == "POSITIONAL_OR_KEYWORD" and p.name != "self"]

    def refused(function, count):
        fn = target(function)
        try:  # one positional value too many: refused before anything runs (a method gets its self first)
            fn(*range(count + 1 + (fn.__name__ == "__init__")))
        except TypeError:
            return True
        except Exception:
            return False
        return False

    out["table"] = {f: [positional(f), refused(f, len(positional(f)))] for f in SIGNATURES}

    from test_layout import functions_made_from_text  # the layout test's rule, under this release

    out["made_from_text"] = functions_made_from_text(("parallel_state",))
    ps.initialize_model_parallel(timeout=datetime.timedelta(seconds=20))

    def outcome(fn, *args):
        try:
            fn(*args)
            return "ok"
        except Exception as exc:
            return type(exc).__name__ + ": " + str(exc)[:400]

    out["dp(False, True)"] = outcome(ps.get_data_parallel_group, False, True)
    out["dp(True, True, True)"] = outcome(ps.get_data_parallel_group, True, True, True)
    out["edp_rank(True)"] = outcome(ps.get_expert_data_parallel_rank, True)
    out["all_ranks"] = ps.get_all_ranks()
    out["rank_generator_order"] = RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-dp").order
    return out


def _probe(release, pools):
    # A rank of its own pool: the release is in its environment before it imports parallel_state, as in a
    # fresh process, but forked from the session's torch template instead of starting an interpreter.
    [out] = pools(1, megatron=False, release=release).run(case_probe)
    return out


@pytest.mark.parametrize("release", ["0.17", "0.18", "0.19"])
def test_a_process_binds_as_the_release_it_declares(pools, release):
    out = _probe(release, pools)
    assert out["release"] == release
    assert out["made_from_text"] == []  # the release's functions are defs of the checked-in source
    assert out["differences"] == sorted(EXTENDED)  # every other function: exactly the release's parameters
    # Every table function takes exactly the release's parameters positionally, in its order (its data's).
    for function, (positional, refused) in out["table"].items():
        assert positional == [p["name"] for p in _public(function, release)], function
        assert refused, f"{function} accepts a positional value beyond megatron-core {release}'s parameters"
    if release == "0.17":  # 0.16's accessors; initialize_model_parallel gained rank_offset, local_world_size
        assert out["dp(True, True, True)"] == "ok"
        return
    if release == "0.18":
        assert out["dp(True, True, True)"].startswith("TypeError")  # independent_all_gather ended at 0.17
        return
    positional = {n: [p for p, kind in sig if kind == "POSITIONAL_OR_KEYWORD"] for n, sig in out["signatures"].items()}
    assert positional["initialize_model_parallel"][9:11] == ["gtp_remat_size", "expert_gtp_remat_size"]
    assert positional["get_data_parallel_group"][:3] == ["with_context_parallel", "with_gtp_remat",
                                                         "partial_data_parallel"]
    assert positional["get_expert_data_parallel_rank"] == ["with_gtp_remat", "partial_expert_data_parallel"]
    # 0.19 binds the second value to with_gtp_remat; 0.16 would bind partial_data_parallel (an error without cp).
    assert out["dp(False, True)"] == "ok" and out["dp(True, True, True)"] == "ok" and out["edp_rank(True)"] == "ok"
    assert out["all_ranks"] == "0_0_0_0_0_0"  # 0.19's format: tp, gtp_remat, dp, cp, pp, ep
    assert out["rank_generator_order"] == "tp-dp-pp-ep-cp-gtp_remat"


def test_an_unknown_release_takes_only_the_positions_every_release_shares(pools):
    out = _probe("0.20", pools)
    assert out["made_from_text"] == []
    positional = {n: [p for p, kind in sig if kind == "POSITIONAL_OR_KEYWORD"] for n, sig in out["signatures"].items()}
    assert len(positional["initialize_model_parallel"]) == 9
    assert positional["get_data_parallel_group"] == ["with_context_parallel"]
    assert out["dp(False, True)"].startswith("ParallelStateTypeError") and releases.ENV in out["dp(False, True)"]
    assert out["edp_rank(True)"].startswith("ParallelStateTypeError")


def test_the_installed_release_binds_positional_getters_as_it_does():
    assert ps.megatron_release() == "0.16"
    # 0.16: the second value is partial_data_parallel, which needs context parallelism.
    with pytest.raises(AssertionError, match="partial data parallelism"):
        ps.get_data_parallel_group(False, True)
    # Exactly 0.16's three, in its order: no other release's parameter, positional or keyword.
    assert [*inspect.signature(ps.get_data_parallel_group).parameters] == [
        "with_context_parallel", "partial_data_parallel", "independent_all_gather"]
    with pytest.raises(TypeError, match="multiple values for argument 'partial_data_parallel'"):
        ps.get_data_parallel_group(True, False, partial_data_parallel=True)
    # 0.19's keyword is refused as megatron-core 0.16 refuses it (set the release to 0.19 to use it).
    with pytest.raises(TypeError, match="unexpected keyword argument 'with_gtp_remat'"):
        ps.get_data_parallel_group(with_gtp_remat=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'with_egtp_remat'"):
        ps.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True)
    with pytest.raises(TypeError, match="from 0 to 3 positional arguments but 4 were given"):
        ps.get_data_parallel_group(False, False, False, True)


# --- gtp_remat on real ranks -------------------------------------------------------------------------

#: Two gtp_remat topologies whose groups carry real collectives here (every layout of 0.19's is checked
#: against megatron-core 0.19's own in test_megatron_release_layouts).
GTP_TOPOLOGIES = {
    "tp2-gtp2-pp2": dict(tensor_model_parallel_size=2, gtp_remat_size=2, pipeline_model_parallel_size=2),
    "ep2-egtp2": dict(expert_model_parallel_size=2, expert_gtp_remat_size=2),
}

#: accessor call -> the kind whose ranks it holds
GROUP_CALLS = {
    "get_gtp_weight_remat_group()": "gtp", "get_expert_gtp_weight_remat_group()": "egtp",
    "get_data_parallel_group()": "gtp-dp", "get_data_parallel_group(with_gtp_remat=False)": "dp",
    "get_data_parallel_group(with_context_parallel=True)": "gtp-dp-cp",
    "get_data_parallel_group(with_context_parallel=True, with_gtp_remat=False)": "dp-cp",
    "get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)": "gtp-dp-cp",
    "get_model_parallel_group()": "tp-pp", "get_tensor_and_data_parallel_group()": "tp-dp",
    "get_expert_data_parallel_group()": "egtp-edp", "get_expert_data_parallel_group(with_gtp_remat=False)": "edp",
    "get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True)": "etp-ep-egtp-pp",
    "get_expert_tensor_model_pipeline_parallel_group()": "etp-ep-pp",
    "get_intra_distributed_optimizer_instance_group()": "dist-opt",
}


def case_gtp(topologies):
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)
    out = {}
    for label, kwargs in topologies.items():
        ps.initialize_model_parallel(**kwargs, timeout=SECONDS)
        calls = {call: eval(f"ps.{call}") for call in GROUP_CALLS}  # noqa: S307 - the table's own calls
        ranks = {call: dist.get_process_group_ranks(g) for call, g in calls.items()}
        # One communicator per kind: the full (gtp) and replicate groups are distinct where gtp_remat > 1.
        distinct = calls["get_data_parallel_group()"] is not calls["get_data_parallel_group(with_gtp_remat=False)"]
        sums = {call: None for call in ("get_gtp_weight_remat_group()", "get_data_parallel_group()")}
        for call in sums:
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=calls[call])
            sums[call] = t.item()
        numbers = {"gtp": (ps.get_gtp_weight_remat_rank(), ps.get_gtp_weight_remat_world_size()),
                   "egtp": (ps.get_expert_gtp_weight_remat_rank(), ps.get_expert_gtp_weight_remat_world_size()),
                   "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
                   "dp_replicate": (ps.get_data_parallel_rank(with_gtp_remat=False),
                                    ps.get_data_parallel_world_size(with_gtp_remat=False)),
                   "edp": (ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size())}
        try:
            ps.get_data_parallel_group_gloo()
            gloo = "built"
        except AssertionError as exc:
            gloo = str(exc)
        out[label] = dict(ranks=ranks, distinct=distinct, sums=sums, numbers=numbers, gloo=gloo,
                          global_ranks=ps.get_gtp_weight_remat_global_ranks())
        ps.destroy_model_parallel()
    out["left"] = len(set(c10d._world.pg_map) - before)
    return out


@pytest.fixture(scope="module")
def gtp_results(pools):
    # gtp_remat is 0.19's: its accessors take with_gtp_remat where 0.19 is the release in use.
    return pools(8, megatron=False, release="0.19").run(case_gtp, GTP_TOPOLOGIES, timeout=240)


@pytest.mark.parametrize("label", sorted(GTP_TOPOLOGIES))
def test_gtp_remat_groups_on_real_ranks(gtp_results, label):
    kwargs = GTP_TOPOLOGIES[label]
    plan = TopologyPlan(8, tp=kwargs.get("tensor_model_parallel_size", 1), pp=kwargs.get("pipeline_model_parallel_size", 1),
                        ep=kwargs.get("expert_model_parallel_size", 1), gtp=kwargs.get("gtp_remat_size", 1),
                        egtp=kwargs.get("expert_gtp_remat_size", 1), order=kwargs.get("order", "tp-cp-ep-dp-pp"))
    for rank, results in enumerate(gtp_results):
        r = results[label]
        for call, kind in GROUP_CALLS.items():
            assert r["ranks"][call] == list(plan.group_ranks(kind, rank)), (rank, call)
        assert r["distinct"] == (plan.gtp > 1)
        assert r["sums"]["get_gtp_weight_remat_group()"] == sum(plan.group_ranks("gtp", rank))
        assert r["numbers"]["gtp"] == (plan.group_rank("gtp", rank), plan.gtp)
        assert r["numbers"]["dp"] == (plan.group_rank("gtp-dp", rank), plan.dp * plan.gtp)
        assert r["numbers"]["dp_replicate"] == (plan.group_rank("dp", rank), plan.dp)
        assert r["numbers"]["edp"][1] == plan.edp * plan.egtp
        assert r["global_ranks"] == list(plan.group_ranks("gtp", rank))
        # megatron-core 0.19 builds no gloo groups under gtp_remat, and says so here.
        assert (r["gloo"] == "built") == (plan.gtp == 1 and plan.egtp == 1) or plan.gtp == 1
        if plan.gtp > 1:
            assert "no gloo groups under generalized tensor parallelism" in r["gloo"]
            # With gtp_remat the distributed-optimizer instance is the whole world, as in 0.19.
            assert r["ranks"]["get_intra_distributed_optimizer_instance_group()"] == list(range(8))
        assert results["left"] == 0


# --- rank_offset / local_world_size ------------------------------------------------------------------

def case_rank_offset():
    import torch.distributed as dist

    me = dist.get_rank()
    out = {}
    # megatron-core 0.17's spelling: every rank calls; the topology lies over ranks 2 and 3.
    ps.initialize_model_parallel(context_parallel_size=2, rank_offset=2, local_world_size=2, timeout=SECONDS)
    out["initialized"] = ps.is_initialized()
    if me < 2:
        # The left-out ranks build their own topology beside it, with the same spelling.
        ps.initialize_model_parallel(context_parallel_size=2, rank_offset=0, local_world_size=2, timeout=SECONDS)
    out["cp"] = ps.get_context_parallel_global_ranks()
    out["sizes"] = (ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size())
    ps.destroy_model_parallel()
    # The same topology spelled with ranks=, by its members only.
    subset = [0, 1] if me < 2 else [2, 3]
    ps.initialize_model_parallel(context_parallel_size=2, ranks=subset, timeout=SECONDS)
    out["cp_by_ranks"] = ps.get_context_parallel_global_ranks()
    ps.destroy_model_parallel()
    try:
        ps.initialize_model_parallel(rank_offset=3, local_world_size=2, timeout=SECONDS)
        out["error"] = None
    except ParallelStateError as exc:
        out["error"] = str(exc)
    out["after_error"] = ps.is_initialized()
    return out


def test_rank_offset_lays_a_topology_over_a_slice_of_the_world(pools):
    results = pools(4).run(case_rank_offset, timeout=120)
    for rank, r in enumerate(results):
        assert r["initialized"] == (rank >= 2)
        assert r["cp"] == r["cp_by_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["sizes"] == (2, 1)
        assert "ranks 3 to 4, beyond the world of 4 ranks; pass a local_world_size of at most 1" in r["error"]
        assert r["after_error"] is False


# --- all-gather groups and process-group collections -------------------------------------------------

def case_all_gather():
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out = {}
    try:
        ps.create_all_gather_groups()
    except ParallelStateError as exc:
        out["before_init"] = str(exc)
    before = set(c10d._world.pg_map)
    ps.initialize_model_parallel(expert_model_parallel_size=2, context_parallel_size=2, timeout=SECONDS)
    ag, expert_ag = ps.create_all_gather_groups(for_expert_parallelism=True)
    out["ranks"] = (dist.get_process_group_ranks(ag), dist.get_process_group_ranks(expert_ag))
    out["own"] = ag is not ps.get_data_parallel_group(with_context_parallel=True) and \
        expert_ag is not ps.get_expert_data_parallel_group()
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=ag)
    out["sum"] = t.item()
    out["again"] = ps.create_all_gather_groups(for_expert_parallelism=True) == (ag, expert_ag)
    collection = ps.process_group_collection(megatron=False)
    out["collection"] = collection.dp_cp_ag is ag and collection.expt_dp_ag is expert_ag and \
        collection.tp is ps.get_tensor_model_parallel_group() and collection.intra_dist_opt is \
        ps.get_intra_distributed_optimizer_instance_group()
    out["has_separate"] = ps.has_separate_all_gather_group()
    try:  # every rank must ask alike: rank 0 leaves the experts out
        ps.create_all_gather_groups(for_expert_parallelism=dist.get_rank() != 0)
        out["mismatch"] = None
    except ParallelStateError as exc:
        out["mismatch"] = str(exc)
    ps.destroy_model_parallel()
    out["left"] = len(set(c10d._world.pg_map) - before)
    # 0.16 / 0.17's flag builds the dp x cp one at initialize; the 0.18 call then returns it.
    ps.initialize_model_parallel(context_parallel_size=2, create_all_gather_group=True, timeout=SECONDS)
    out["flag_then_call"] = ps.create_all_gather_groups()[0] is ps.get_data_parallel_group(
        with_context_parallel=True, independent_all_gather=True)
    ps.destroy_model_parallel()
    return out


def test_create_all_gather_groups(pools):
    results = pools(4).run(case_all_gather, timeout=120)
    plan = TopologyPlan(4, cp=2, ep=2)
    for rank, r in enumerate(results):
        assert "call parallel_state.initialize_model_parallel() first" in r["before_init"]
        assert r["ranks"] == (list(plan.group_ranks("dp-cp", rank)), list(plan.group_ranks("edp", rank)))
        assert r["own"] and r["again"] and r["collection"] and r["has_separate"]
        assert r["sum"] == len(plan.group_ranks("dp-cp", rank))
        assert "create_all_gather_groups" in r["mismatch"] and "for_expert_parallelism" in r["mismatch"]
        assert r["left"] == 0 and r["flag_then_call"]


def case_megatron_collection():
    from dataclasses import fields

    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2, timeout=SECONDS)
    ours = ps.process_group_collection()
    theirs = ProcessGroupCollection.use_mpu_process_groups()  # megatron-core's own, reading the bridge
    names = [f.name for f in fields(ProcessGroupCollection)]
    out = {"type": type(ours) is ProcessGroupCollection,
           "same": {n: getattr(ours, n, "unset") is getattr(theirs, n, "unset") or
                    getattr(ours, n, None) == getattr(theirs, n, None) for n in names},
           "plain": {n: getattr(ps.process_group_collection(megatron=False), n) is getattr(ours, n) for n in names
                     if getattr(ours, n) is not None}}
    subset = ps.process_group_collection(["tp", "cp"])
    out["subset"] = (subset.tp is ps.get_tensor_model_parallel_group(), hasattr(subset, "dp"))
    try:
        ps.process_group_collection(["tp", "tensor"])
    except ValueError as exc:
        out["invalid"] = str(exc)
    ps.destroy_model_parallel()
    return out


def test_process_group_collection_is_megatrons_own_filled_with_our_groups(pools):
    results = pools(4).run(case_megatron_collection, timeout=120)
    for r in results:
        assert r["type"]
        assert all(r["same"].values()), r["same"]
        assert len(r["same"]) >= 20 and all(r["plain"].values()) and len(r["plain"]) >= 15
        assert r["subset"] == (True, False)
        assert "Invalid process groups requested: ['tensor']" in r["invalid"]


def test_the_plain_collection_has_every_releases_fields():
    names = {f for f in ps.ProcessGroupCollection.__dataclass_fields__}
    assert {"dp_cp_gtp_remat", "gtp_remat", "expt_gtp_remat", "tp_ep_pp_with_egtp_remat", "dp_cp_ag",
            "expt_dp_ag", "intra_dist_opt", "hcp"} <= names and len(names) == 27
    with pytest.raises(AssertionError, match="call parallel_state.initialize_model_parallel"):
        ps.process_group_collection(megatron=False)
