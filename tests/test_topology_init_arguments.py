"""initialize_model_parallel's arguments as one typed value: binding per release, checks, comparison, the plan."""

from __future__ import annotations

import dataclasses
import datetime
import inspect

import pytest

from parallel_state import (
    InitArguments,
    ParallelStateAssertionError,
    ParallelStateError,
    ParallelStateTypeError,
    TopologyPlan,
)
from parallel_state.topology import releases

#: The eleventh positional argument of each release (index 10), as megatron-core's signatures have it.
ELEVENTH = {"0.16": "expert_tensor_parallel_size", "0.17": "expert_tensor_parallel_size",
            "0.18": "expert_tensor_parallel_size", "0.19": "expert_gtp_remat_size"}


def test_one_field_per_parameter_and_the_release_orders_follow_from_them():
    names = [f.name for f in InitArguments.parameters()]
    assert len(names) == len(set(names)) == 27  # 24 of megatron-core's four releases, 3 of ours
    orders = {r: InitArguments.positional(r) for r in releases.KNOWN}
    assert [len(orders[r]) for r in releases.KNOWN] == [20, 22, 21, 23]
    # 0.19 inserts its two gtp sizes after expert_model_parallel_size; 0.18 drops create_all_gather_group.
    assert orders["0.19"][8:12] == ("expert_model_parallel_size", "gtp_remat_size", "expert_gtp_remat_size",
                                    "num_distributed_optimizer_instances")
    assert "create_all_gather_group" in orders["0.17"] and "create_all_gather_group" not in orders["0.18"]
    assert orders["0.17"][-2:] == orders["0.18"][-2:] == orders["0.19"][-2:] == ("rank_offset", "local_world_size")
    for release, order in orders.items():
        assert order[10] == ELEVENTH[release]
    # A release parallel_state does not know: only the nine leading parameters all four share.
    assert InitArguments.positional("0.20") == orders["0.16"][:9]


@pytest.mark.parametrize("release", releases.KNOWN)
def test_a_positional_call_binds_as_the_release_binds_it(release):
    values = tuple(range(1, 12))  # eleven distinct values: where each lands names its parameter
    bound = InitArguments.bind(values, {}, release)
    assert getattr(bound, ELEVENTH[release]) == 11
    assert getattr(bound, InitArguments.positional(release)[9]) == 10
    signature = InitArguments.signature(release)
    positional = [p.name for p in signature.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == InitArguments.positional(release)
    # Every other release's parameter, and ours, is keyword-only, with its default.
    keyword = {p.name: p.default for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert {"timeout", "check_consistency", "ranks", "tp_size", "cp_size", "pp_size"} <= set(keyword)
    assert set(positional) | set(keyword) >= {f.name for f in InitArguments.parameters()}
    assert keyword["check_consistency"] is True


def test_keywords_of_every_release_are_accepted_whatever_the_release():
    every = dict(gtp_remat_size=2, expert_gtp_remat_size=2, rank_offset=4, local_world_size=4,
                 create_all_gather_group=True, timeout=datetime.timedelta(seconds=5))
    for release in (*releases.KNOWN, "0.20"):
        bound = InitArguments.bind((), every, release)
        assert {k: getattr(bound, k) for k in every} == every


def test_binding_errors_say_what_to_do():
    cases = [
        (lambda: InitArguments.bind(tuple(range(21)), {}, "0.16"), "at most 20 positional arguments in megatron-core 0.16"),
        (lambda: InitArguments.bind(tuple(range(10)), {}, "0.20"), "beyond the first 9"),
        (lambda: InitArguments.bind((), {"context_paralel_size": 2}, "0.16"), "did you mean 'context_parallel_size'"),
        (lambda: InitArguments.bind((2,), {"tensor_model_parallel_size": 2}, "0.16"), "multiple values"),
        (lambda: InitArguments.bind((2,), {"tp_size": 2}, "0.16"), "both tensor_model_parallel_size=2 and its alias"),
        (lambda: InitArguments.bind((), {"cp_size": 2, "context_parallel_size": 2}, "0.16"), "pass only one"),
    ]
    for call, message in cases:
        with pytest.raises(ParallelStateTypeError, match=message):
            call()
    assert releases.ENV in str(pytest.raises(TypeError, InitArguments.bind, tuple(range(10)), {}, "0.20").value)


def test_aliases_land_on_megatrons_parameters_and_name_themselves_in_errors():
    bound = InitArguments.bind((), {"tp_size": 2, "cp_size": 4, "pp_size": None}, "0.16")
    assert (bound.tensor_model_parallel_size, bound.context_parallel_size) == (2, 4)
    with pytest.raises(ParallelStateTypeError, match="cp_size must be a positive int"):
        InitArguments.bind((), {"cp_size": "4"}, "0.16").validated()
    with pytest.raises(ParallelStateTypeError, match="context_parallel_size must be a positive int"):
        InitArguments.bind((), {"context_parallel_size": "4"}, "0.16").validated()


def test_validated_normalizes_and_refuses_what_cannot_work():
    args = InitArguments(hierarchical_context_parallel_sizes=[2, 2], context_parallel_size=4,
                         high_priority_stream_groups=["cp"], distributed_timeout_minutes=2).validated()
    assert args.hierarchical_context_parallel_sizes == (2, 2) and args.high_priority_stream_groups == ("cp",)
    assert args.timeout == datetime.timedelta(minutes=2)
    hash(dataclasses.astuple(args))  # every value is immutable once validated
    bad = [
        (dict(use_sharp=False, sharp_enabled_group="dp"), ParallelStateAssertionError, "only valid with use_sharp"),
        (dict(use_sharp=True, sharp_enabled_group="tp"), ParallelStateAssertionError, "not a SHARP group"),
        (dict(pipeline_model_parallel_comm_backend="mpi2"), ParallelStateError, "is not a backend"),
        (dict(gtp_remat_size=0), ParallelStateError, "gtp_remat_size must be >= 1"),
        (dict(rank_offset=-1), ParallelStateError, "rank_offset must be >= 0"),
        (dict(ranks=[0, 1], rank_offset=2), ParallelStateTypeError, "two spellings of one thing"),
        (dict(use_sharp="yes"), ParallelStateTypeError, "use_sharp must be True or False"),
        (dict(timeout=5), ParallelStateTypeError, "timeout must be a positive datetime.timedelta"),
    ]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            InitArguments(**kwargs).validated()


def test_the_ranks_compare_every_argument_and_the_order_by_the_layout_it_means():
    a = InitArguments(tensor_model_parallel_size=2, order="TP-CP-EP-DP-PP").comparable()
    b = InitArguments(tensor_model_parallel_size=2, order="tp-cp-ep-dp-pp").comparable()
    assert a == b
    # With gtp_remat, megatron-core 0.19 places the axis by the order's spelling: upper case puts it first.
    a = InitArguments(tensor_model_parallel_size=2, gtp_remat_size=2, order="TP-CP-EP-DP-PP").comparable()
    b = InitArguments(tensor_model_parallel_size=2, gtp_remat_size=2, order="tp-cp-ep-dp-pp").comparable()
    assert a["order"] != b["order"]
    assert set(InitArguments().comparable()) == {f.name for f in InitArguments.parameters()}
    named = InitArguments(get_embedding_ranks=test_one_field_per_parameter_and_the_release_orders_follow_from_them)
    assert named.comparable()["get_embedding_ranks"].endswith("test_one_field_per_parameter_and_the_release_orders_"
                                                               "follow_from_them")


def test_the_plan_and_the_subset_come_from_the_validated_value():
    args = InitArguments(tensor_model_parallel_size=2, gtp_remat_size=2, expert_model_parallel_size=2,
                         expert_gtp_remat_size=2, expert_tensor_parallel_size=1, rank_offset=8,
                         local_world_size=8).validated()
    members = args.subset(16)
    assert members == tuple(range(8, 16))
    plan = args.plan(len(members), members)
    assert plan == TopologyPlan(8, tp=2, gtp=2, ep=2, egtp=2, etp=1, ranks=members)
    assert plan.group_ranks("gtp", 8) == (8, 10)
    assert InitArguments().subset(4) is None
    with pytest.raises(ParallelStateError, match="beyond the world of 8 ranks; pass a local_world_size of at most 4"):
        InitArguments(rank_offset=4, local_world_size=8).validated().subset(8)


def test_initialize_model_parallel_has_the_signature_of_the_release_in_use():
    import parallel_state as ps

    fn = ps.initialize_model_parallel
    assert inspect.signature(fn) == InitArguments.signature(releases.in_use()) and "__signature__" not in vars(fn)
    assert fn.__code__.co_argcount == len(InitArguments.positional()) == 20  # a plain def: Python binds it
    assert "InitArguments.from_call" in inspect.getsource(fn)
    with pytest.raises(TypeError, match="from 0 to 20 positional arguments but 21 were given"):
        fn(*range(21))


def test_a_call_binds_aliases_onto_megatrons_parameters():
    assert InitArguments.from_call({"tp_size": 2, "cp_size": None}).tensor_model_parallel_size == 2
    # The parameter at its default is not a second spelling; another value is.
    assert InitArguments.from_call({"tensor_model_parallel_size": 1, "tp_size": 4}).spelled == ("tp_size",)
    with pytest.raises(ParallelStateTypeError, match="got both context_parallel_size=2 and its alias cp_size=4"):
        InitArguments.from_call({"context_parallel_size": 2, "cp_size": 4})


def test_one_validation_names_the_sizes_as_each_caller_spells_them():
    # The same rule, under initialize_model_parallel's names (or the alias used) and under the plan's.
    cases = [(dict(tensor_model_parallel_size=0), dict(tp=0), "{} must be >= 1", ("tensor_model_parallel_size",
                                                                                  "tp size")),
             (dict(expert_gtp_remat_size="2"), dict(egtp="2"), "{} must be a positive int",
              ("expert_gtp_remat_size", "expert gtp_remat size")),
             (dict(context_parallel_size=2, hierarchical_context_parallel_sizes=[4]), dict(cp=2, hierarchical_cp=[4]),
              "{}multiply to 4, not context_parallel_size=2", ("", "")),
             (dict(gtp_remat_size=2, num_distributed_optimizer_instances=2), dict(gtp=2, dist_opt_instances=2),
              "{}supports generalized tensor parallelism with one optimizer instance only", ("", ""))]
    for init, plan, message, (init_name, plan_name) in cases:
        with pytest.raises(ParallelStateError, match=message.format(init_name)):
            InitArguments(**init).validated()
        with pytest.raises(ParallelStateError, match=message.format(plan_name)):
            TopologyPlan(8, **plan)
    with pytest.raises(ParallelStateError, match="pp_size must be >= 1"):
        InitArguments.from_call({"pp_size": 0}).validated()
