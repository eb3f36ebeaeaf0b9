"""Drop-in parity with the installed megatron-core: every public name, its parameters, and every answer.

The oracle is megatron-core itself, run on the same real gloo ranks: its own
``initialize_model_parallel`` for a topology, every accessor's answer (with every flag variant)
and every module global its initialize set, then ours for the same arguments. Ours must answer
alike, and after ours the bridged megatron-core module must hold groups with the same ranks.
"""

from __future__ import annotations

import datetime
import inspect
import warnings

import megatron_releases as mr
import pytest

import parallel_state as ps

SECONDS = datetime.timedelta(seconds=60)


def _megatron():
    import megatron.core.parallel_state as mps

    return mps


def _public(module):
    return {n: v for n, v in vars(module).items()
            if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))}


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_public_name_exists_with_megatrons_parameters():
    mps = _megatron()
    names = _public(mps)
    assert len(names) >= 86
    missing = sorted(n for n in names if not hasattr(ps, n))
    assert not missing, f"missing from parallel_state: {missing}"
    different = []
    for name, theirs in names.items():
        ours = getattr(ps, name)
        if inspect.isclass(theirs):
            pairs = [(f"{name}.{m}", getattr(theirs, m), getattr(ours, m, None))
                     for m, v in vars(theirs).items()
                     if (inspect.isfunction(v) or isinstance(v, classmethod)) and not m.startswith("_")]
            pairs.append((f"{name}.__init__", theirs.__init__, ours.__init__))
        else:
            pairs = [(name, theirs, ours)]
        for label, a, b in pairs:
            try:
                want = _params(a)
            except ValueError:  # a builtin (datetime.timedelta): nothing to compare
                continue
            # Exactly megatron-core's parameters (the release in use is the installed one), but for the
            # functions called once per topology, which may add keyword-only ones after megatron-core's.
            ours_params = None if b is None else _params(b)
            extended = label in mr.EXTENDED and ours_params is not None and ours_params[:len(want)] == want and all(
                p[1] is inspect.Parameter.KEYWORD_ONLY and p[2] is not inspect.Parameter.empty
                for p in ours_params[len(want):])
            if ours_params != want and not extended:
                different.append((label, want, ours_params))
    assert not different, different
    if "SymmetricMemoryManager" in names:  # 0.17+: the default buffer size is the release's (a BEHAVIOURS row)
        assert ps.SymmetricMemoryManager._size_mb() == mps.SymmetricMemoryManager._default_size_mb


# --- the differential run -----------------------------------------------------------------------

def stray_free_embedding_ranks(pp_ranks, vp=None):
    """A custom embedding pick: the first and the second stage."""
    return list(pp_ranks[:2])


TOPOLOGIES = {  # each row exercises several features, so that megatron-core's slow initialize runs few times
    "tp2-cp2-pp2-vpp": dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
                            virtual_pipeline_model_parallel_size=2),
    "tp2-etp1-ep4-pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                             expert_model_parallel_size=4, expert_tensor_parallel_size=1),
    "hierarchical-cp4-ep4": dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                 expert_model_parallel_size=4),
    "ep2-cp2-pp2-two-instances-hybrid-all-gather": dict(
        context_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
        num_distributed_optimizer_instances=2, hybrid_context_parallel=True, create_all_gather_group=True),
    "embedding-pp4-order-tp-pp-dp": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                                         order="tp-pp-dp", get_embedding_ranks=stray_free_embedding_ranks),
}


#: Topologies megatron-core refuses (every release 0.16-0.19: its check that the attention and MoE layers'
#: data-parallel sizes are equal when pp is not last, on the order as written); parallel_state must refuse
#: them alike, an AssertionError that quotes megatron-core's message and says what to change.
REFUSED = {
    "tp-pp-ep-dp-ep2-pp2": ((1, 2), dict(expert_model_parallel_size=2, order="tp-pp-ep-dp")),
    "tp2-ep2-pp2-tp-cp-ep-pp-dp": ((2, 2), dict(expert_model_parallel_size=2, order="tp-cp-ep-pp-dp")),
    "upper-case-order-ep2-pp2": ((1, 2), dict(expert_model_parallel_size=2, order="TP-CP-EP-DP-PP")),
}


def _refusal(initialize, args, kwargs):
    try:
        initialize(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, isinstance(exc, AssertionError), str(exc)
    return None


def _describe(value):
    """A value as ranks can compare it: groups by their members, buffers by kind."""
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(sorted(dist.get_process_group_ranks(value))))
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in sorted(value.items())}
    if type(value).__name__ in ("GlobalMemoryBuffer", "GlobalSymmetricMemoryBuffer"):
        return type(value).__name__
    return value


def _calls(fn, topology):
    """Every way to call ``fn`` that megatron-core's callers use: defaults, then each flag turned on."""
    params = inspect.signature(fn).parameters
    if any(p.default is inspect.Parameter.empty for p in params.values()):
        return []
    calls = [{}]
    for flag in ("with_context_parallel", "tp_only_amax_red", "partial_expert_data_parallel"):
        if flag in params:
            calls.append({flag: True})
    if "partial_data_parallel" in params:
        calls += [{"partial_data_parallel": True}, {"with_context_parallel": True, "partial_data_parallel": True}]
    if "independent_all_gather" in params:
        calls.append({"with_context_parallel": True, "independent_all_gather": True})
    if "ignore_virtual" in params:
        calls += [{"ignore_virtual": False, "vp_stage": s} for s in (0, 1)]
    if "group_size" in params:
        calls += [{"group_size": s} for s in (2, 4, 8)]
    return calls


def _answers(module, topology):
    out = {}
    for name in sorted(_public(_megatron())):
        if not name.startswith(("get_", "is_", "has_", "model_parallel")):
            continue
        # The call forms megatron-core's signature allows: our keyword-only extensions are not its API.
        for kwargs in _calls(getattr(_megatron(), name), topology):
            key = f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    out[key] = ("ok", _describe(getattr(module, name)(**kwargs)))
            except Exception as exc:
                out[key] = ("error", isinstance(exc, AssertionError), f"{type(exc).__name__}: {exc}"[:200])
    return out


def _globals(module, names):
    out = {n: _describe(getattr(module, n)) for n in names}
    if "_global_process_group_list" in out:
        # The groups update_pg_timeout visits, compared as sets of rank lists (the creation order differs);
        # the whole world's rank list stands for both the default group (the list's None) and world-sized kinds.
        import torch.distributed as dist

        world = repr(("group", tuple(range(dist.get_world_size()))))
        out["_global_process_group_list"] = sorted({repr(g) for g in out["_global_process_group_list"]} - {world})
    return out


def case_parity(topologies, refused):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    mps = _megatron()
    names = [n for n in vars(mps) if n.startswith("_") and n.isupper() or n == "_global_process_group_list"]
    results = {"refused": {label: (_refusal(mps.initialize_model_parallel, args, kwargs),
                                   _refusal(ps.initialize_model_parallel, args, {**kwargs, "timeout": SECONDS}),
                                   ps.is_initialized())
                           for label, (args, kwargs) in refused.items()}}
    for label, topology in topologies.items():
        before_groups = set(c10d._world.pg_map)
        empty = {n: getattr(mps, n) for n in names}
        mps.initialize_model_parallel(**topology)
        theirs = _answers(mps, topology)
        changed = sorted(n for n in names if getattr(mps, n) is not empty[n] and getattr(mps, n) != empty[n])
        their_globals = _globals(mps, changed)
        # megatron-core's destroy leaks every group but the gloo ones: free them for the next case.
        dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
        mps.destroy_model_parallel()
        mps._HYBRID_DP_CP_GROUPS = {}
        for pg in set(c10d._world.pg_map) - before_groups:
            dist.destroy_process_group(pg)

        ps.initialize_model_parallel(**topology, timeout=SECONDS)  # bridges megatron-core by itself
        ours = _answers(ps, topology)
        bridged = _globals(mps, changed)
        bridged_answers = _answers(mps, topology)
        via_getattr = _globals(ps, changed)
        ps.destroy_model_parallel()
        cleared = {n: getattr(mps, n) for n in changed if getattr(mps, n) != empty[n]}
        left = set(c10d._world.pg_map) - before_groups
        results[label] = dict(theirs=theirs, ours=ours, changed=changed, their_globals=their_globals,
                              bridged=bridged, bridged_answers=bridged_answers, via_getattr=via_getattr,
                              cleared=sorted(cleared), left=len(left))
    return results


def _for_installed(topologies):
    """Each topology with only the keywords the installed release takes (0.18 dropped create_all_gather_group),
    so the live tier (python -m tests.oracles test) runs these rows on every release."""
    params = inspect.signature(_megatron().initialize_model_parallel).parameters
    return {label: {k: v for k, v in t.items() if k in params} for label, t in topologies.items()}


@pytest.fixture(scope="module")
def parity(pools):
    return pools(8).run(case_parity, _for_installed(TOPOLOGIES), REFUSED, timeout=300)


@pytest.mark.parametrize("label", sorted(REFUSED))
def test_what_megatron_refuses_is_refused_alike(parity, label):
    for results in parity:
        theirs, ours, left = results["refused"][label]
        assert theirs is not None and theirs[1], theirs  # megatron-core 0.16.1 asserts
        assert ours is not None and ours[1] and not left, ours
        assert theirs[2] in ours[2] and "end the order with 'pp'" in ours[2]


def _agree(theirs, ours):
    """Equal answers, or both failing, ours with an AssertionError wherever megatron-core asserts."""
    if theirs[0] == "ok":
        return ours == theirs
    return ours[0] == "error" and (ours[1] or not theirs[1])


@pytest.mark.parametrize("label", sorted(TOPOLOGIES))
def test_every_accessor_answers_as_megatron_does(parity, label):
    for rank, results in enumerate(parity):
        r = results[label]
        assert set(r["ours"]) == set(r["theirs"])
        wrong = {k: (r["theirs"][k], r["ours"][k]) for k in r["theirs"] if not _agree(r["theirs"][k], r["ours"][k])}
        assert not wrong, (rank, wrong)
        # Answered at all: the table has every accessor, most with real values.
        assert sum(v[0] == "ok" for v in r["ours"].values()) > 60


@pytest.mark.parametrize("label", sorted(TOPOLOGIES))
def test_bridged_megatron_globals_hold_the_same_ranks(parity, label):
    for rank, results in enumerate(parity):
        r = results[label]
        assert len(r["changed"]) > 25  # derived from megatron-core's own initialize, not a list kept here
        assert r["bridged"] == r["their_globals"], rank
        assert r["via_getattr"] == r["their_globals"], rank
        # megatron-core's own accessors, reading our groups, answer as they did on their own groups.
        wrong = {k: (v, r["bridged_answers"][k]) for k, v in r["theirs"].items() if v != r["bridged_answers"][k]}
        assert not wrong, (rank, wrong)
        assert r["cleared"] == [] and r["left"] == 0, rank
