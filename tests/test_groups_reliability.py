"""Reliability of the core on real gloo ranks: cross-rank checks, real timeouts, a dead rank,
every bad input with its documented error, and no half-built state after any failure."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import uuid

import pytest

import parallel_state as ps
from parallel_state import ParallelStateError, TopologyPlan
from parallel_state.errors import ParallelStateTypeError
from rankpool import RankFailure, RankPool, scaled

SECONDS = datetime.timedelta(seconds=30)


# --- helpers that run on the ranks ----------------------------------------------------------

def _registry():
    """Sizes of every table torch keeps per process group: a leak shows in one of them."""
    from torch.distributed import distributed_c10d as c10d

    w = c10d._world
    return {"pg_map": len(w.pg_map), "pg_names": len(w.pg_names), "pg_group_ranks": len(w.pg_group_ranks),
            "pg_backend_config": len(w.pg_backend_config), "pg_to_tag": len(w.pg_to_tag),
            "tags": len(w.tags_to_pg), "tagged": sum(len(v) for v in w.tags_to_pg.values())}


def _groups():
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map)


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _correct_call_works():
    """A correct initialize_model_parallel succeeds, its groups carry a collective, and it tears down."""
    import torch
    import torch.distributed as dist

    before = _groups()
    ps.initialize_model_parallel(context_parallel_size=2, pipeline_model_parallel_size=2, timeout=SECONDS)
    t = torch.ones(1)
    dist.all_reduce(t, group=ps.get_context_parallel_group())
    dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    ok = t.item() == 4.0
    ps.destroy_model_parallel()
    return ok and _groups() == before


def _describe(exc):
    return {"type": type(exc).__name__, "message": str(exc), "is_pse": isinstance(exc, ParallelStateError),
            "is_type": isinstance(exc, TypeError), "is_nie": isinstance(exc, NotImplementedError),
            "is_assert": isinstance(exc, AssertionError)}


def _missing(message):
    """The ranks a 'did not arrive' error names (a loaded machine may delay more than one)."""
    import re

    from parallel_state.groups.consistency import _ranges

    found = re.search(r"rank\(s\) ([0-9, -]+) of \d+ did not arrive within the timeout", message)
    if not found:
        return None
    ranks = []
    for part in found.group(1).split(", "):
        lo, _, hi = part.partition("-")
        ranks += range(int(lo), int(hi or lo) + 1)
    assert _ranges(ranks) == found.group(1)
    return ranks


def _attempt(fn, *args, **kwargs):
    """Call ``fn``; describe what it raised, or None with its result."""
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        return _describe(exc), None
    return None, result


# --- 1. cross-rank consistency --------------------------------------------------------------

def _stray_embedding_ranks(ranks, vp=None):
    return [99]


def case_mismatch(odd_rank, odd_kwargs, kwargs):
    import torch.distributed as dist

    before = _groups()
    mine = odd_kwargs if dist.get_rank() == odd_rank else kwargs
    error, _ = _attempt(ps.initialize_model_parallel, timeout=SECONDS, **mine)
    clean = _groups() == before and not ps.is_initialized()
    ps.destroy_model_parallel()  # when it (rightly) succeeded
    return {"error": error, "clean": clean or error is None, "retry": _correct_call_works()}


@pytest.mark.parametrize("odd, kwargs, expected", [
    (dict(context_parallel_size=1), dict(context_parallel_size=2),
     ["ranks 0-2 passed context_parallel_size=2", "rank 3 passed context_parallel_size=1",
      "fix the command line or config of rank 3"]),
    # A bad value on one rank is named on every rank, not only where local validation would catch it.
    (dict(cp_size="2"), dict(cp_size=2), ["rank 3 passed context_parallel_size='2'"]),
    (dict(context_parallel_size=2, order="tp-cp-pp-dp"), dict(context_parallel_size=2),
     ["order='tp-cp-ep-dp-pp'", "order='tp-cp-pp-dp-ep'"]),
    (dict(create_gloo_process_groups=False), dict(), ["create_gloo_process_groups=False"]),
    (dict(expert_model_parallel_size=4), dict(expert_model_parallel_size=2),
     ["ranks 0-2 passed expert_model_parallel_size=2", "rank 3 passed expert_model_parallel_size=4"]),
    (dict(cp_size=2, hierarchical_context_parallel_sizes=[1, 2]),
     dict(cp_size=2, hierarchical_context_parallel_sizes=[2, 1]), ["hierarchical_context_parallel_sizes=[1, 2]"]),
    (dict(num_distributed_optimizer_instances=2), dict(), ["num_distributed_optimizer_instances=2"]),
    (dict(pp_size=2, get_embedding_ranks=_stray_embedding_ranks), dict(pp_size=2),
     ["get_embedding_ranks='test_groups_reliability._stray_embedding_ranks'"]),
], ids=["cp", "str-size", "order", "gloo-flag", "ep", "hierarchical", "instances", "embedding-ranks"])
def test_a_mismatch_raises_on_every_rank_naming_ranks_and_values(pools, odd, kwargs, expected):
    results = pools(4).run(case_mismatch, 3, odd, kwargs)
    for rank, out in enumerate(results):
        err = out["error"]
        assert err is not None and err["is_pse"], (rank, err)
        assert "initialize_model_parallel was called with different arguments" in err["message"]
        for text in expected:
            assert text in err["message"], (rank, text, err["message"])
        assert out["clean"] and out["retry"], rank


def test_one_order_spelled_differently_agrees(pools):
    # Case and the tokens Megatron appends do not change the order: no false alarm.
    sizes = dict(context_parallel_size=2, pipeline_model_parallel_size=2)
    out = pools(4).run(case_mismatch, 1, dict(sizes, order="TP-CP-DP-PP"), dict(sizes, order="tp-cp-dp-pp-ep"))
    assert [o["error"] for o in out] == [None] * 4


def case_missing_rank(late_rank, tag, timeout_s):
    """``late_rank`` reaches initialize_model_parallel only after the others have given up on it."""
    import torch.distributed as dist

    store, rank = _store(), dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    before = _groups()
    if rank == late_rank:
        store.wait([f"{tag}/all-failed"], datetime.timedelta(seconds=120))
        error, _ = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2, timeout=timeout)
    else:
        error, _ = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2, timeout=timeout)
        if store.add(f"{tag}/failed", 1) == dist.get_world_size() - 1:
            store.set(f"{tag}/all-failed", "1")
    return {"error": error, "clean": _groups() == before, "retry": _correct_call_works()}


def test_a_rank_that_never_arrives_is_named_within_the_timeout(pools):
    results = pools(4).run(case_missing_rank, 3, uuid.uuid4().hex, 2.0)
    for rank in (0, 1, 2):
        err = results[rank]["error"]
        assert err["is_pse"] and "did not arrive within the timeout (0:00:02)" in err["message"], err
        assert 3 in _missing(err["message"]), err
    late = results[3]["error"]
    assert late["is_pse"] and "arrived too far apart" in late["message"] and "rank 3 was the last" in late["message"]
    # Every rank failed the same check, so the next call lines up again.
    assert all(r["clean"] and r["retry"] for r in results)


def case_check_api(tag):
    """check_same_everywhere as the runtime's dist_init will use it: a name and a dict."""
    import torch.distributed as dist

    from parallel_state.groups.consistency import check_same_everywhere

    rank = dist.get_rank()
    for i in range(30):  # many rounds: old rounds' keys are dropped, names never collide
        check_same_everywhere(f"dist_init[{tag}]", {"backend": "gloo", "cp_size": 2, "round": i}, timeout=SECONDS)
    odd = {"backend": "nccl" if rank == 2 else "gloo", "cp_size": 2}
    mismatch, _ = _attempt(check_same_everywhere, f"dist_init[{tag}]", odd, timeout=SECONDS)
    bad = [_attempt(check_same_everywhere, *a, **k)[0] for a, k in [
        ((5, {}), {}), (("x", [1]), {}), (("x", {1: 2}), {}), (("x", {}), {"timeout": 3})]]
    prefix = f"parallel_state/same_everywhere/dist_init[{tag}]"
    leftover = [k for k in range(1, 40) if _store().check([f"{prefix}/{k}/count"])]
    return mismatch, bad, leftover


def test_the_check_is_reusable_by_name_and_dict(pools):
    results = pools(4).run(case_check_api, uuid.uuid4().hex[:8])
    for mismatch, bad, _ in results:
        assert mismatch["is_pse"]
        assert "ranks 0-1, 3 passed backend='gloo'; rank 2 passed backend='nccl'" in mismatch["message"]
        assert all(b["is_type"] and b["is_pse"] for b in bad), bad
    # Rank 0 drops each round once every rank has reached the next: only the last one is left.
    assert results[0][2] == [31]


def case_check_off():
    import torch.distributed as dist

    keys = [f"parallel_state/same_everywhere/initialize_model_parallel{what}/calls/{dist.get_rank()}"
            for what in ("", " group creation")]
    store = _store()
    before = [store.add(k, 0) for k in keys]
    ps.initialize_model_parallel(cp_size=2, pp_size=2, timeout=SECONDS, check_consistency=False)
    off = [store.add(k, 0) for k in keys]
    dist.barrier()  # without the closing round, the caller synchronizes before destroying
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(cp_size=2, pp_size=2, timeout=SECONDS)
    on = [store.add(k, 0) for k in keys]
    return [b - a for a, b in zip(before, off, strict=True)], [b - a for a, b in zip(off, on, strict=True)]


def test_check_consistency_false_skips_both_rounds(pools):
    assert pools(4).run(case_check_off) == [([0, 0], [1, 1])] * 4


def test_rank_lists_stay_short():
    from parallel_state.groups.consistency import _ranges

    assert _ranges([0, 1, 2, 5, 7, 8, 9, 12]) == "0-2, 5, 7-9, 12"
    assert _ranges([3]) == "3" and _ranges([]) == "none"


# --- 2. timeouts are real: a stalled peer and a dead rank -----------------------------------

def case_stalled_peer(tag, timeout_s):
    """Rank 3 skips a collective (alive, not dead): its partner fails after the configured timeout."""
    import torch
    import torch.distributed as dist

    ps.initialize_model_parallel(cp_size=2, pp_size=2, timeout=datetime.timedelta(seconds=timeout_s))
    rank, store = dist.get_rank(), _store()
    if rank == 3:
        store.wait([f"{tag}/released"], datetime.timedelta(seconds=120))
        return None
    error, _ = _attempt(dist.all_reduce, torch.ones(1), group=ps.get_context_parallel_group())
    if rank == 2:
        store.set(f"{tag}/released", "1")
    return error


def case_rank_dies(victim, iteration, timeout_s):
    """Pipeline-like traffic; ``victim`` exits abruptly at ``iteration``; the others must fail and clean up."""
    import os
    import time

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    before = _registry()
    ps.initialize_model_parallel(cp_size=2, pp_size=2, timeout=timeout)
    rank, t = dist.get_rank(), torch.ones(1)
    for i in range(5):
        if rank == victim and i == iteration:
            os._exit(17)  # no cleanup, no goodbye: sockets just close
        start = time.monotonic()
        try:
            dist.all_reduce(t, group=ps.get_context_parallel_group())
            dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        except Exception as exc:
            seconds = time.monotonic() - start
            error = _describe(exc)
            break
    else:
        return {"error": None}
    ps.destroy_model_parallel()
    after_destroy = _registry()
    # Initializing again must not hang on the dead rank: the check names it within the timeout.
    start = time.monotonic()
    again, _ = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2, timeout=timeout)
    again_seconds = time.monotonic() - start
    ps.destroy_model_parallel()
    return {"error": error, "iteration": i, "seconds": seconds, "clean": after_destroy == before,
            "again": again, "again_seconds": again_seconds, "clean_again": _registry() == before}


def test_a_dead_rank_fails_the_others_within_the_timeout_and_they_shut_down_cleanly():
    # The default group's timeout is 10 minutes, so only the configured timeouts of a second or so
    # (more on a loaded machine) can end the waits before the pool's own hang guard (90 s) would.
    timeout_s = round(scaled(1.0).total_seconds(), 3)
    pool = RankPool(4, default_timeout=600)
    try:
        stalled = pool.run(case_stalled_peer, uuid.uuid4().hex, timeout_s, timeout=90)
        assert stalled[0] is None and stalled[1] is None and stalled[3] is None
        assert stalled[2]["type"] == "RuntimeError", stalled[2]
        assert f"Timed out waiting {round(timeout_s * 1000)}ms" in stalled[2]["message"], stalled[2]
        with pytest.raises(RankFailure) as info:
            pool.run(case_rank_dies, 3, 2, timeout_s, timeout=90)
    finally:
        pool.close()
    failure = info.value
    assert failure.failures == {3: ("RankDied", "rank 3 died during case_rank_dies (exit code 17)", "")}
    print("\nrank death: survivors' errors")
    for rank in (0, 1, 2):
        out = failure.results[rank]
        print(f"  rank {rank}: iteration {out['iteration']} after {out['seconds']:.2f}s: {out['error']['message'][:90]}"
              f"\n          re-initialize after {out['again_seconds']:.2f}s: {out['again']['message'][:90]}")
        assert out["error"] is not None and out["iteration"] == 2, out
        assert out["clean"] and out["clean_again"], out
        assert out["again"]["is_pse"] and 3 in (_missing(out["again"]["message"]) or []), out["again"]
    assert pool.exitcodes == [0, 0, 0, 17]  # the survivors left their world and exited normally


# --- 3. bad inputs: every public function, with the documented error ------------------------

NO_NCCL_BACKEND = next((b for b in ("nccl", "ucc") if not __import__("torch").distributed.is_backend_available(b)), None)

# id -> (kwargs, documented exception, text the message must hold)
INIT_ROWS = {
    "tp-str": (dict(tensor_model_parallel_size="2"), TypeError, "tensor_model_parallel_size must be a positive int"),
    "tp-float": (dict(tensor_model_parallel_size=2.0), TypeError, "got 2.0 (float)"),
    "tp-bool": (dict(tensor_model_parallel_size=True), TypeError, "must be a positive int"),
    "pp-none": (dict(pipeline_model_parallel_size=None), TypeError, "pipeline_model_parallel_size must be"),
    "cp-alias-str": (dict(cp_size="4"), TypeError, "cp_size must be a positive int"),
    "tp-zero": (dict(tensor_model_parallel_size=0), ParallelStateError, "tensor_model_parallel_size must be >= 1"),
    "cp-negative": (dict(context_parallel_size=-2), ParallelStateError, "context_parallel_size must be >= 1, got -2"),
    "pp-alias-zero": (dict(pp_size=0), ParallelStateError, "pp_size must be >= 1"),
    "cp-not-dividing": (dict(context_parallel_size=3), ParallelStateError,
                        "world size 4 is not divisible by tp*cp*pp = 1*3*1 = 3"),
    "too-many": (dict(tp_size=2, cp_size=2, pp_size=2), ParallelStateError, "= 8; choose sizes"),
    "both-spellings": (dict(context_parallel_size=2, cp_size=2), TypeError, "pass only one of them"),
    "order-unknown": (dict(order="tp-cp-xp-dp-pp"), ParallelStateError, "unknown token(s) ['xp']"),
    "order-repeated": (dict(order="tp-cp-cp-dp-pp"), ParallelStateError, "repeats token(s) ['cp']"),
    "order-empty": (dict(order=""), ParallelStateError, "unknown token(s) ['']"),
    "order-float": (dict(order=1.5), TypeError, "order must be a string"),
    "order-missing-cp": (dict(context_parallel_size=2, order="tp-dp-pp"), ParallelStateError, "add it to the order"),
    "vpp-without-pp": (dict(virtual_pipeline_model_parallel_size=2), ParallelStateError,
                       "needs pipeline_model_parallel_size > 1"),
    "vpp-str": (dict(pp_size=2, virtual_pipeline_model_parallel_size="2"), TypeError,
                "virtual_pipeline_model_parallel_size must be a positive int"),
    "vpp-zero": (dict(pp_size=2, virtual_pipeline_model_parallel_size=0), ParallelStateError, ">= 1, got 0"),
    "backend-unknown": (dict(pipeline_model_parallel_comm_backend="mpi2"), ParallelStateError, "is not a backend"),
    "backend-int": (dict(pipeline_model_parallel_comm_backend=5), TypeError, "must be a str"),
    "gloo-flag-str": (dict(create_gloo_process_groups="False"), TypeError,
                      "create_gloo_process_groups must be True or False"),
    "check-flag-int": (dict(check_consistency=1), TypeError, "check_consistency must be True or False"),
    "sharp-str": (dict(use_sharp="yes"), TypeError, "use_sharp must be True or False"),
    "sharp-group-alone": (dict(sharp_enabled_group="dp"), AssertionError, "only valid with use_sharp=True"),
    "sharp-group-unknown": (dict(use_sharp=True, sharp_enabled_group="tp"), AssertionError, "not a SHARP group"),
    "sharp-replica-one-instance": (dict(use_sharp=True, sharp_enabled_group="dp_replica"), AssertionError,
                                   "needs num_distributed_optimizer_instances > 1"),
    "minutes-zero": (dict(distributed_timeout_minutes=0), ParallelStateError,
                     "distributed_timeout_minutes must be a positive"),
    "minutes-str": (dict(distributed_timeout_minutes="30"), TypeError, "distributed_timeout_minutes must be a positive"),
    "timeout-int": (dict(timeout=5), TypeError, "datetime.timedelta(seconds=30)"),
    "timeout-zero": (dict(timeout=datetime.timedelta(0)), ParallelStateError, "positive datetime.timedelta"),
    "timeout-negative": (dict(timeout=datetime.timedelta(seconds=-1)), ParallelStateError, "positive datetime.timedelta"),
    "ep-not-dividing": (dict(expert_model_parallel_size=3), ParallelStateError,
                        "not divisible by expert tp*ep*pp = 1*3*1 = 3"),
    "ep-pp-order": (dict(expert_model_parallel_size=2, pp_size=2, order="tp-cp-ep-pp-dp"), AssertionError,
                    "When not using pp-last rank ordering, the data parallel size of the attention and moe layers "
                    "must be the same"),  # megatron-core's first check (dp 2, expert dp 1), quoted
    "ep-str": (dict(expert_model_parallel_size="2"), TypeError, "expert_model_parallel_size must be a positive int"),
    "ep-zero": (dict(expert_model_parallel_size=0), ParallelStateError, "expert_model_parallel_size must be >= 1"),
    "etp-not-dividing": (dict(expert_tensor_parallel_size=3), ParallelStateError, "expert tp*ep*pp = 3*1*1 = 3"),
    "etp-zero": (dict(expert_tensor_parallel_size=0), ParallelStateError, "expert_tensor_parallel_size must be >= 1"),
    "optimizer-instances": (dict(num_distributed_optimizer_instances=3), AssertionError,
                            "must divide the data-parallel sizes"),
    "hierarchical-cp": (dict(hierarchical_context_parallel_sizes=[2, 2]), AssertionError,
                        "multiply to 4, not context_parallel_size=1"),
    "hierarchical-zero": (dict(cp_size=2, hierarchical_context_parallel_sizes=[2, 0]), ParallelStateError,
                          "a hierarchical context-parallel size must be >= 1"),
    "hierarchical-int": (dict(hierarchical_context_parallel_sizes=4), TypeError, "list of ints"),
    "hybrid-cp": (dict(tp_size=2, pp_size=2, hybrid_context_parallel=True), AssertionError,
                  "hybrid_context_parallel needs an even number of dp x cp ranks, got 1"),
    "embedding-ranks": (dict(pp_size=2, get_embedding_ranks=_stray_embedding_ranks), ParallelStateError,
                        "returned [99]: ranks [99] are not in that pipeline"),
    "embedding-ranks-int": (dict(get_embedding_ranks=3), TypeError, "get_embedding_ranks must be a function"),
    "all-gather-group-str": (dict(create_all_gather_group="no"), TypeError, "create_all_gather_group must be True"),
    "priority-groups-str": (dict(high_priority_stream_groups="cp"), TypeError, "list of str"),
    "nccl-config-int": (dict(nccl_communicator_config_path=5), TypeError, "path of a YAML file"),
    "nccl-config-missing": (dict(nccl_communicator_config_path="/nonexistent/nccl.yaml"), ParallelStateError,
                            "nccl_communicator_config_path"),
    "sharp-group": (dict(sharp_enabled_group=3), TypeError, "sharp_enabled_group must be a str"),
}
if NO_NCCL_BACKEND:
    INIT_ROWS["backend-unavailable"] = (dict(pipeline_model_parallel_comm_backend=NO_NCCL_BACKEND), ParallelStateError,
                                        "is not available in this torch build")

_KIND = {TypeError: "is_type", ParallelStateError: "is_pse", NotImplementedError: "is_nie", AssertionError: "is_assert"}


#: A correct initialize (about 0.1-0.2 s on 4 ranks) follows every RETRY_EVERY-th row and the last one; after
#: every row, torch's group tables and parallel_state's state and answers are as before it.
RETRY_EVERY = 4


def case_bad_initialize(rows):
    """Every row fails with nothing left behind, and a correct call right after it (every few rows) succeeds."""
    from parallel_state.groups import state
    from parallel_state.megatron.answers import ANSWERS

    out = {}
    for i, (name, kwargs) in enumerate(rows.items()):
        kwargs = dict(kwargs)
        if "timeout" not in kwargs and "distributed_timeout_minutes" not in kwargs:
            kwargs["timeout"] = SECONDS
        before = _registry()
        error, _ = _attempt(ps.initialize_model_parallel, **kwargs)
        clean = _registry() == before and not ps.is_initialized() and state.peek() is None and not ANSWERS
        retry = _correct_call_works() if i % RETRY_EVERY == RETRY_EVERY - 1 or i == len(rows) - 1 else None
        out[name] = {"error": error, "clean": clean, "retry": retry}
    return out


@pytest.fixture(scope="module")
def bad_initialize(pools):
    rows = {name: kwargs for name, (kwargs, _, _) in INIT_ROWS.items()}
    return pools(4).run(case_bad_initialize, rows, timeout=180)


@pytest.mark.parametrize("row", sorted(INIT_ROWS))
def test_bad_initialize_arguments(bad_initialize, row):
    _, exc_type, text = INIT_ROWS[row]
    for rank, results in enumerate(bad_initialize):
        out = results[row]
        assert out["error"] is not None, (rank, row, "no error")
        assert out["error"][_KIND[exc_type]], (rank, row, out["error"])
        assert text in out["error"]["message"], (rank, row, out["error"]["message"])
        assert out["clean"], (rank, row, "left state behind")
        assert out["retry"] in (True, None), (rank, row, "a correct call failed afterwards")


def test_a_correct_call_works_after_every_few_bad_ones(bad_initialize):
    for results in bad_initialize:
        retries = [out["retry"] for out in results.values()]
        assert retries.count(True) == -(-len(INIT_ROWS) // RETRY_EVERY) and retries[-1] is True, retries


def test_wrong_types_are_both_type_errors_and_parallel_state_errors(bad_initialize):
    out = bad_initialize[0]["tp-str"]["error"]
    assert out["type"] == "ParallelStateTypeError" and out["is_type"] and out["is_pse"]


#: An interface no machine has: gloo cannot make a device for it, so torch's new_group fails at once.
MISSING_NIC = "ps-test-nic0"


@contextlib.contextmanager
def _network_fails_at(desc):
    """On this rank, gloo cannot build the group ``desc``: while it is created GLOO_SOCKET_IFNAME names
    an interface this machine lacks (a node with wrong network settings), so torch's own new_group
    raises. Yields the descriptions of the groups created before, in order."""
    import os

    from parallel_state.groups import create as groups

    created = []
    original = groups.GroupBatch.create

    def create(self, *args, **kwargs):  # our own code, observed; torch.distributed stays real
        saved = os.environ.get("GLOO_SOCKET_IFNAME")
        if kwargs["desc"] == desc:
            os.environ["GLOO_SOCKET_IFNAME"] = MISSING_NIC
        try:
            pg = original(self, *args, **kwargs)
        finally:
            if saved is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = saved
        created.append(kwargs["desc"])
        return pg

    groups.GroupBatch.create = create
    try:
        yield created
    finally:
        groups.GroupBatch.create = original


def case_failure_mid_creation():
    """Group creation fails at the model-parallel (tp-pp) group, after others were built; then the
    NCCL stream options, which this torch build may or may not have, on these gloo groups."""
    import torch
    import torch.distributed as dist

    out = {}
    before = _registry()
    with _network_fails_at("MODEL_PARALLEL_GROUP") as created:
        out["error"], _ = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2, timeout=SECONDS)
    out.update(created_before_failure=created, clean=_registry() == before, retry=_correct_call_works())
    # Options are made when their kind's group is built: without NCCL the build fails there (and rolls
    # back); with NCCL, gloo groups ignore them, as in megatron-core.
    out["nccl_error"], _ = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2, timeout=SECONDS,
                                    high_priority_stream_groups=["mp"])
    if out["nccl_error"] is None:
        t = torch.ones(1)
        dist.all_reduce(t, group=ps.get_model_parallel_group())
        out["nccl_groups_work"] = t.item() == 2.0
        ps.destroy_model_parallel()
    out["nccl_clean"] = _registry() == before and not ps.is_initialized()
    out["nccl_retry"] = _correct_call_works()
    return out


@pytest.fixture(scope="module")
def mid_creation(pools):
    return pools(4).run(case_failure_mid_creation)


#: How gloo reports a connection a peer closed while this rank still connected (torch's message, either way round).
PEER_CLOSED = ("closed by peer", "reset by peer")


def test_a_failure_in_the_middle_of_group_creation_rolls_back(mid_creation):
    built = ["GTP_WEIGHT_REMAT_GROUP", "DATA_PARALLEL_GROUP_WITH_CP", "DATA_PARALLEL_GROUP", "CONTEXT_PARALLEL_GROUP"]
    named = 0
    for out in mid_creation:
        # torch's new_group raised on the tp-pp group, after the gtp_remat, dp-cp, dp and cp groups
        # (each kind its own group, in megatron-core 0.19's order; the full data-parallel groups are the
        # dp ones where gtp_remat is 1); nothing of them is left, and a correct call works after.
        message = out["error"]["message"]
        assert out["error"]["is_pse"], out
        assert out["clean"] and out["retry"], out
        if "could not create its MODEL_PARALLEL_GROUP process group" in message:
            assert f"Unable to find address for: {MISSING_NIC}" in message, out
            assert out["created_before_failure"] == built, out
            named += 1
            continue
        # A rank still connecting an earlier group when its peer, done with it, failed on the tp-pp group and
        # rolled back (a loaded machine): that group's connection closed under it, and its error names it.
        failed_at = built[len(out["created_before_failure"])]
        assert out["created_before_failure"] == built[:built.index(failed_at)], out
        assert f"could not create its {failed_at} process group" in message, out
        assert any(words in message for words in PEER_CLOSED), out
    assert named >= 1, mid_creation  # the rank that got furthest names the tp-pp group and the missing interface


def test_nccl_options_fail_cleanly_without_nccl_and_are_ignored_by_gloo_groups(mid_creation):
    import torch.distributed as dist

    named = 0
    for out in mid_creation:
        if hasattr(dist, "ProcessGroupNCCL"):
            assert out["nccl_error"] is None and out["nccl_groups_work"], out
        else:
            message = out["nccl_error"]["message"]
            assert out["nccl_error"]["is_pse"], out
            # As above: a rank still connecting an earlier group when a peer failed on the tp-pp group's
            # options and rolled back sees that group's connection closed, and says so.
            named += "this torch build has no NCCL" in message
            assert "this torch build has no NCCL" in message or any(words in message for words in PEER_CLOSED), out
        assert out["nccl_clean"] and out["nccl_retry"], out
    assert hasattr(dist, "ProcessGroupNCCL") or named >= 1, mid_creation


def case_timeout_mid_creation(tag):
    """Without the check, rank 3 comes late: ranks fail at different groups, each rolls back alone.

    Ranks 0 and 1 build their cp group together and then time out on the pp group; rank 2
    times out on its first group; rank 3 fails when it finally comes. Every rank's group
    counter must still end equal, or the next correct call would hang.
    """
    import torch.distributed as dist

    store, rank = _store(), dist.get_rank()
    timeout = datetime.timedelta(seconds=1)
    before = _registry()
    if rank == 3:
        store.wait([f"{tag}/all-failed"], datetime.timedelta(seconds=120))
    error, _ = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2, timeout=timeout, check_consistency=False)
    if rank != 3 and store.add(f"{tag}/failed", 1) == 3:
        store.set(f"{tag}/all-failed", "1")
    return {"error": error, "clean": _registry() == before, "retry": _correct_call_works()}


def test_a_timeout_in_the_middle_of_group_creation_rolls_back_everywhere(pools):
    for rank, out in enumerate(pools(4).run(case_timeout_mid_creation, uuid.uuid4().hex, timeout=120)):
        assert out["error"]["is_pse"], (rank, out)
        message = out["error"]["message"]
        # A rank fails creating a group, or waiting for a group's members to finish theirs.
        assert ("could not create its" in message and "(timeout 0:00:01)" in message) or \
            ("not every member of the" in message and "within 0:00:01" in message), message
        assert out["clean"] and out["retry"], (rank, out)


def case_one_rank_fails_to_build(bad_rank, timeout_s):
    """Only ``bad_rank``'s network fails, at its model-parallel group: only its build fails."""
    import contextlib

    import torch.distributed as dist

    before = _registry()
    broken = _network_fails_at("MODEL_PARALLEL_GROUP") if dist.get_rank() == bad_rank else contextlib.nullcontext()
    with broken:
        error, _ = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return {"error": error, "clean": _registry() == before and not ps.is_initialized(),
            "retry": _correct_call_works()}


def test_all_ranks_keep_their_groups_or_none_does(pools):
    # Rank 3 fails building its model-parallel group [1, 3]; rank 1 times out creating it; ranks 0
    # and 2 built all their groups, but members of their dp-cp groups never finished theirs.
    results = pools(4).run(case_one_rank_fails_to_build, 3, scaled(1.0).total_seconds(), timeout=120)
    message = results[3]["error"]["message"]
    assert "could not create its MODEL_PARALLEL_GROUP process group with ranks [1, 3]" in message, message
    assert f"Unable to find address for: {MISSING_NIC}" in message, message
    for rank in (0, 1, 2):
        message = results[rank]["error"]["message"]
        assert results[rank]["error"]["is_pse"], message
        # Usually rank 1 "could not create its tp-pp process group with ranks [1, 3]" and ranks 0
        # and 2 find "not every member of the dp-cp group ... finished creating it"; a loaded
        # machine can move a timeout to another group, never let a rank succeed.
        assert "could not create its" in message or "not every member of the" in message, message
    assert all(r["clean"] and r["retry"] for r in results), results


def case_confirm(failing_rank):
    """The closing round on its own: one rank reports a failure, the others succeeded."""
    import torch.distributed as dist

    from parallel_state.groups.consistency import confirm_everywhere

    mine = ValueError("disk full") if dist.get_rank() == failing_rank else None
    return _attempt(confirm_everywhere, "load_checkpoint", mine, timeout=SECONDS)[0]


def test_ranks_that_succeeded_learn_which_failed(pools):
    results = pools(4).run(case_confirm, 2)
    assert results[2] is None  # the failing rank raises its own error; the round only informs
    for rank in (0, 1, 3):
        message = results[rank]["message"]
        assert results[rank]["is_pse"], message
        assert message.startswith("load_checkpoint failed on rank 2 (rank 2: ValueError: disk full); this rank"), message


def case_destroy_right_after_initialize(cycles):
    """No collective between initialize and destroy: a fast rank must not tear down a group a slow
    peer is still connecting to (it did, at the first or second cycle, before the closing round)."""
    for i in range(cycles):
        ps.initialize_model_parallel(**[dict(cp_size=2, pp_size=2), dict(cp_size=4), dict(tp_size=2, cp_size=2),
                                        dict(cp_size=2)][i % 4], timeout=SECONDS)
        ps.destroy_model_parallel()
    return True


def test_destroy_right_after_initialize_is_safe(pools):
    # Each topology twice: the race showed at the first or second cycle.
    assert pools(4).run(case_destroy_right_after_initialize, 8, timeout=120) == [True] * 4


# Accessors: what each one does before initialize_model_parallel (on an initialized torch.distributed).
BEFORE_INIT_VALUE = {
    "is_initialized": False, "model_parallel_is_initialized": False, "is_unitialized": True,
    "get_virtual_pipeline_model_parallel_world_size": None, "get_virtual_pipeline_model_parallel_rank": None,
    # megatron-core: no embedding ranks, no separate group; the expert tensor sizes fall back to tp's override.
    "is_rank_in_embedding_group": False, "is_rank_in_position_embedding_group": False,
    "has_separate_all_gather_group": False, "get_expert_tensor_parallel_world_size": None,
    "get_expert_tensor_parallel_rank": None,
    # megatron-core 0.19: 0 wherever the gtp_remat group is not built.
    "get_gtp_weight_remat_rank": 0, "get_gtp_weight_remat_world_size": 0, "get_expert_gtp_weight_remat_rank": 0,
    "get_expert_gtp_weight_remat_world_size": 0,
}
SETTERS = {"set_data_parallel_rank", "set_pipeline_model_parallel_rank", "set_pipeline_model_parallel_world_size",
           "set_tensor_model_parallel_rank", "set_tensor_model_parallel_world_size",
           "set_virtual_pipeline_model_parallel_rank", "set_virtual_pipeline_model_parallel_world_size",
           "set_expert_model_parallel_rank", "set_expert_model_parallel_world_size", "set_expert_tensor_parallel_rank",
           "set_expert_tensor_parallel_world_size"}


#: The modules whose functions are the accessors: the hand-written ones and those the generator writes.
ACCESSOR_MODULES = ("parallel_state.megatron.accessors", "parallel_state.megatron.generated_accessors")


def _public_accessors():
    from parallel_state.megatron import accessors

    return sorted(n for n, f in vars(accessors).items()
                  if callable(f) and not n.startswith("_") and getattr(f, "__module__", "") in ACCESSOR_MODULES)


def case_accessors_lifecycle():
    import warnings

    out = {"before": {}, "unchecked": {}, "bad_flag": {}, "after_destroy": {}}
    for name in _public_accessors():
        fn = getattr(ps, name)
        if name in SETTERS:
            out["before"][name] = _attempt(fn, 1)
            fn(None)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            out["before"][name] = _attempt(fn)
        if "check_initialized" in inspect.signature(fn).parameters:
            out["unchecked"][name] = _attempt(fn, check_initialized=False)
            out["bad_flag"][name] = _attempt(fn, check_initialized="yes")[0]
    ps.initialize_model_parallel(cp_size=2, pp_size=2, timeout=SECONDS)
    ps.destroy_model_parallel()
    out["after_destroy"] = {n: _attempt(getattr(ps, n))[0] for n in ("get_context_parallel_group", "get_pp_rank")}
    return out


def test_every_accessor_before_initialize(pools):
    out = pools(4).run(case_accessors_lifecycle)[0]
    names = _public_accessors()
    exported = {n for n in dir(ps) if getattr(getattr(ps, n), "__module__", None) in ACCESSOR_MODULES}
    assert len(names) >= 50 and exported <= set(names) and set(out["before"]) == set(names)
    for name in names:
        error, value = out["before"][name]
        if name in SETTERS:  # Megatron's testing hooks work without groups
            assert error is None, (name, error)
        elif name in BEFORE_INIT_VALUE:
            assert error is None and value == BEFORE_INIT_VALUE[name], (name, error, value)
        else:
            assert error is not None and error["is_pse"], (name, error, value)
            assert "not initialized: call parallel_state.initialize_model_parallel" in error["message"], name
    assert len(out["unchecked"]) >= 8
    assert all(err is None and value is None for err, value in out["unchecked"].values()), out["unchecked"]
    assert set(out["bad_flag"]) == set(out["unchecked"])
    assert all(e["is_type"] and "check_initialized must be True or False" in e["message"]
               for e in out["bad_flag"].values()), out["bad_flag"]
    assert all(e["is_pse"] for e in out["after_destroy"].values())


def case_accessor_arguments():
    """Wrong flag types, unsupported flags, unknown keywords and bad setter values, after initialize."""
    ps.initialize_model_parallel(cp_size=2, pp_size=2, virtual_pipeline_model_parallel_size=2, timeout=SECONDS)
    rows = {}
    for name in _public_accessors():
        fn = getattr(ps, name)
        params = inspect.signature(fn).parameters
        # check_initialized only matters without groups: case_accessors_lifecycle checks it there.
        for flag_name in ("with_context_parallel", "ignore_virtual", "partial_data_parallel", "with_gtp_remat",
                          "with_egtp_remat", "independent_all_gather", "tp_only_amax_red",
                          "partial_expert_data_parallel"):
            if flag_name in params:
                rows[f"{name}({flag_name}='yes')"] = ({flag_name: "yes"}, "is_type", f"{flag_name} must be True or False")
        if "partial_data_parallel" in params:  # megatron-core asserts: partial data parallelism includes cp
            rows[f"{name}(partial_data_parallel=True)"] = ({"partial_data_parallel": True}, "is_assert",
                                                           "pass with_context_parallel=True together")
        if name not in SETTERS:
            rows[f"{name}(no_such_flag=True)"] = ({"no_such_flag": True}, "is_type", "no_such_flag")
        else:
            size = name.endswith("world_size")
            rows[f"{name}('1')"] = (("1",), "is_type", "must be")
            rows[f"{name}({0 if size else -1})"] = ((0 if size else -1,), "is_pse", ">= 1" if size else ">= 0")
    for name in ("is_pipeline_first_stage", "is_pipeline_last_stage"):
        rows[f"{name}(ignore_virtual=False)"] = ({"ignore_virtual": False}, "is_pse", "vp_stage must be passed")
        rows[f"{name}(vp_stage=5)"] = ({"ignore_virtual": False, "vp_stage": 5}, "is_pse", "chunks 0..1")
        rows[f"{name}(vp_stage='0')"] = ({"ignore_virtual": False, "vp_stage": "0"}, "is_type", "vp_stage must be")
    out = {}
    for row, (args, kind, text) in rows.items():
        name = row.split("(")[0]
        fn = getattr(ps, name)
        error, _ = _attempt(fn, **args) if isinstance(args, dict) else _attempt(fn, *args)
        out[row] = (error, kind, text)
        if name in SETTERS:
            fn(None)
    # The state is untouched by all of that.
    out["intact"] = (ps.get_cp_world_size() == 2 and ps.get_pp_world_size() == 2
                     and ps.get_virtual_pipeline_model_parallel_world_size() == 2)
    return out


def test_accessor_arguments_are_checked(pools):
    out = pools(4).run(case_accessor_arguments)[0]
    assert out.pop("intact")
    assert len(out) >= 100
    for row, (error, kind, text) in out.items():
        assert error is not None, (row, "accepted")
        assert error[kind], (row, error)
        assert text in error["message"], (row, error["message"])


def case_lifecycle():
    import torch
    import torch.distributed as dist

    before = _registry()
    found = {}
    found["destroy-before-init"] = _attempt(ps.destroy_model_parallel)[0]
    ps.initialize_model_parallel(cp_size=2, pp_size=2, timeout=SECONDS, create_gloo_process_groups=False)
    found["gloo-not-created"] = _attempt(ps.get_data_parallel_group_gloo)[0]
    groups = _registry()
    found["twice"] = _attempt(ps.initialize_model_parallel, cp_size=2, pp_size=2, timeout=SECONDS)[0]
    found["twice-other-topology"] = _attempt(ps.initialize_model_parallel, cp_size=4, timeout=SECONDS)[0]
    t = torch.ones(1)
    dist.all_reduce(t, group=ps.get_context_parallel_group())  # the first state still works
    intact = t.item() == 2 and ps.get_cp_world_size() == 2 and _registry() == groups
    ps.destroy_model_parallel()
    found["destroy-twice"] = _attempt(ps.destroy_model_parallel)[0]
    found["hook-not-callable"] = _attempt(ps.register_teardown_hook, 5)[0]
    return found, intact, _registry() == before


def test_wrong_lifecycle_calls(pools):
    found, intact, clean = pools(4).run(case_lifecycle)[0]
    assert found["destroy-before-init"] is None and found["destroy-twice"] is None  # documented: idempotent
    assert found["gloo-not-created"]["is_pse"] and "create_gloo_process_groups=False" in found["gloo-not-created"]["message"]
    for key in ("twice", "twice-other-topology"):
        assert found[key]["is_pse"] and "call parallel_state.destroy_model_parallel() before" in found[key]["message"]
    assert found["hook-not-callable"]["is_type"] and "callable" in found["hook-not-callable"]["message"]
    assert intact and clean


def test_initialize_before_torch_distributed():
    with pytest.raises(ParallelStateError, match="call torch.distributed.init_process_group"):
        ps.initialize_model_parallel(cp_size=2)
    assert not ps.is_initialized()


PLAN_ROWS = [  # (call, documented exception, text)
    (lambda: TopologyPlan("8"), ParallelStateTypeError, "world_size must be a positive int"),
    (lambda: TopologyPlan(8, cp=2.0), ParallelStateTypeError, "cp size must be a positive int, got 2.0 (float)"),
    (lambda: TopologyPlan(8, pp=None), ParallelStateTypeError, "pp size must be a positive int"),
    (lambda: TopologyPlan(8, tp=False), ParallelStateTypeError, "tp size must be a positive int"),
    (lambda: TopologyPlan(-8), ParallelStateError, "world_size must be >= 1"),
    (lambda: TopologyPlan(8, ep=0), ParallelStateError, "ep size must be >= 1"),
    (lambda: TopologyPlan(8, cp=3), ParallelStateError, "not divisible by tp*cp*pp = 1*3*1 = 3"),
    (lambda: TopologyPlan(8, order=["tp", "cp"]), ParallelStateTypeError, "order must be a string"),
    (lambda: TopologyPlan(8, order="tp-cp-ep-dp-pp-xx"), ParallelStateError, "unknown token(s) ['xx']"),
    (lambda: TopologyPlan(8, order="pp-tp-pp"), ParallelStateError, "repeats token(s) ['pp']"),
    (lambda: TopologyPlan(8, pp=2, order="tp-cp-dp"), ParallelStateError, "pp size is 2 but order"),
    (lambda: TopologyPlan(8, cp=2).coords(8), ParallelStateError, "rank 8 is outside the world of 8 ranks"),
    (lambda: TopologyPlan(8, cp=2).coords(-1), ParallelStateError, "rank -1 is outside"),
    (lambda: TopologyPlan(8, cp=2).coords("1"), ParallelStateTypeError, "a rank is an int in [0, 8)"),
    (lambda: TopologyPlan(8, cp=2).group_ranks("cp-xx", 0), ParallelStateError, "unknown group kind 'cp-xx'"),
    (lambda: TopologyPlan(8, cp=2).group_ranks("cp-cp", 0), ParallelStateError, "name each dimension once"),
    (lambda: TopologyPlan(8, cp=2).group_ranks(3, 0), ParallelStateTypeError, "a group kind is a str"),
    (lambda: TopologyPlan(8, cp=2).group_rank("cp", 9), ParallelStateError, "outside the world"),
    (lambda: TopologyPlan(8, cp=2).group_index("tp-q", 0), ParallelStateError, "unknown group kind"),
    (lambda: TopologyPlan(8, cp=2).group_size("", ), ParallelStateError, "unknown group kind ''"),
    (lambda: TopologyPlan(8, cp=2).num_groups(None), ParallelStateTypeError, "a group kind is a str"),
    (lambda: list(TopologyPlan(8, cp=2).groups("dpp")), ParallelStateError, "unknown group kind 'dpp'"),
    (lambda: TopologyPlan(8, cp=2).same_group("cp", "zz"), ParallelStateError, "unknown group kind 'zz'"),
    (lambda: TopologyPlan(8, cp=2).size("world_size"), ParallelStateError, "unknown dimension 'world_size'"),
]


@pytest.mark.parametrize("call, exc_type, text", PLAN_ROWS, ids=[f"plan{i}" for i in range(len(PLAN_ROWS))])
def test_bad_topology_plan_use(call, exc_type, text):
    with pytest.raises(exc_type) as info:
        call()
    assert text in str(info.value)


def test_numpy_style_integers_are_sizes():
    class Index:  # anything with __index__ (numpy integers) is an int size
        def __index__(self):
            return 2

    plan = TopologyPlan(8, cp=Index())
    assert plan.cp == 2 and type(plan.cp) is int


def test_the_checks_stand_aside_on_torchs_fake_backend():
    # Fake collectives and stores carry no data: the checks skip themselves rather than wait.
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        ps.initialize_model_parallel(cp_size=2, pp_size=2, create_gloo_process_groups=False, timeout=SECONDS)
        assert (ps.get_cp_world_size(), ps.get_dp_world_size(), ps.get_pp_rank()) == (2, 2, 0)
        ps.destroy_model_parallel()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    assert not dist.is_initialized()
