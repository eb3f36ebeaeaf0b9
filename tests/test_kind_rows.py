"""Each group kind is one row of ``topology.kinds``: its facts agree with each other, with the views made
from them, with megatron-core 0.16.1 (installed) and with the release data of 0.16 to 0.19."""

from __future__ import annotations

import dataclasses
import re

import megatron_releases as mr
import pytest

import parallel_state as ps
from parallel_state.megatron import answers, megatron_globals, pg_collection
from parallel_state.topology import answer_keys, kinds, releases
from parallel_state.topology.answer_keys import Fact
from parallel_state.topology.grid import Dim
from parallel_state.topology.kinds import BY_NAME, ROWS, Family, GridKind, Kind, PickKind, Zero

#: group_descs megatron-core creates but keeps in no global (so no kind): create_hierarchical_groups builds a gloo
#: twin of the inter-instance level too, and initialize_model_parallel drops it.
UNKEPT_DESCS = {"HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L1"}


def _all_kinds():
    """Every row, with the numbered kinds a plan with hierarchical cp and hybrid cp makes."""
    plan = ps.TopologyPlan(8, cp=4, hierarchical_cp=(2, 2), hybrid_cp=True)
    numbered = [k for k in plan.kinds.values() if k.family]
    assert {k.family for k in numbered} == {r.name for r in ROWS if isinstance(r, Family)}
    return [r for r in ROWS if not isinstance(r, Family)] + numbered


def test_rows_name_each_fact_once_and_refer_only_to_earlier_rows():
    kinds = _all_kinds()
    for attr in ("name", "title"):
        values = [getattr(r, attr) for r in ROWS]
        assert len(values) == len(set(values)), attr
    names = [r.megatron for r in ROWS if r.megatron] + [r.gloo_global for r in ROWS if r.gloo_global] + \
        [r.ranks_global for r in ROWS if r.ranks_global]
    assert len(names) == len(set(names))
    fields = [r.field for r in ROWS if r.field]
    assert len({f.name for f in fields}) == len({f.slot for f in fields}) == len(fields)
    # A group_desc is one kind's, but where megatron-core gives a kind the group of another it shares.
    by_label = {}
    for kind in kinds:
        by_label.setdefault(kind.label, []).append(kind.name)
    for label, owners in by_label.items():
        for i, later in enumerate(owners[1:], 1):
            assert set(owners[:i]) <= set(BY_NAME[later].shares), (label, owners)
    order = [r.name for r in ROWS]
    for row in ROWS:
        for other in row.shares + ((row.base,) if getattr(row, "base", "") else ()):
            assert other in order[:order.index(row.name)], (row.name, other)  # built before, so it can be reused
        assert row.gloo == bool(row.gloo_global) == bool(row.gloo_label), row.name
        assert not row.ranks_global or row.with_ranks, row.name
        assert row.zero_without is None or isinstance(row.zero_without, Zero), row.name
        if row.optional and row.field:
            assert row.hint, f"{row.name}: a kind a plan or a rank may lack says what to do without it"


def test_each_row_is_named_for_the_code_above_and_makes_its_answer_keys():
    # kinds.DP_CP is the row named "dp-cp": a reader names a kind by the row, so a misspelt kind is a
    # NameError where it is written, and each row is that one name (the table is the only place).
    named = {name: value for name, value in vars(kinds).items() if isinstance(value, Kind)}
    assert named == {r.name.upper().replace("-", "_"): r for r in ROWS}
    for row in ROWS:
        assert all(isinstance(d, Dim) for d in row.dims) and (isinstance(row, GridKind) == bool(row.dims)), row.name
        for fact in Fact:
            key = row.key(fact)
            assert key == f"{row.name}.{fact.value}" and key is row.key(fact), (row.name, fact)
            assert answer_keys.parts(key) == (row.name, fact)
        assert row.answer == row.key(Fact.GROUPS if isinstance(row, Family) else Fact.GROUP)
    assert answer_keys.parts("tp.rnak") is None  # a string no row made is no key
    # Every key the answers hold is made from a row (or is one of the few answers of no kind).
    assert all(answer_keys.parts(k) for k in (*answers.DERIVED, *answers.ZERO_WITHOUT_DIST, *answers.ZERO_WITHOUT_GROUPS,
                                              *(k for keys in answers.OVERRIDES.values() for k in keys)))


def test_names_megatron_core_derives_are_derived_and_a_wrong_row_fails_where_it_is_written():
    # megatron-core names a kind's globals after its group_desc; a row states only the exceptions, and
    # the names so made are exactly megatron-core's globals holding a group, a gloo twin or ranks (0.16-0.19).
    module = set()
    for release in mr.names():
        module |= set(mr.release(release)["globals"]["module"])
    held = {n for n in module if re.search(r"(GROUP|GROUPS|GLOO|RANKS)(_|$)", n) and not n.startswith("_MPU")}
    assert {n for r in ROWS for n in (r.megatron, r.gloo_global, r.ranks_global) if n} == held
    row = BY_NAME["dp-cp"]  # all four left to the rule
    assert (row.megatron, row.gloo_global, row.gloo_label, row.ranks_global) == (
        "_DATA_PARALLEL_GROUP_WITH_CP", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP")
    with pytest.raises(TypeError, match="dims are Dims"):
        GridKind(name="tp-cp", dims=("tp", "cp"))  # the tokens as strings: a misspelt one would pass
    with pytest.raises(TypeError, match="zero_without is a Zero"):
        GridKind(name="tp", dims=(Dim.TP,), zero_without="dist")
    with pytest.raises(TypeError, match="which stages it picks"):
        PickKind(name="embd", label="EMBEDDING_GROUP")
    with pytest.raises(TypeError, match="gloo twin needs"):
        GridKind(name="tp", dims=(Dim.TP,), gloo=True)  # no group_desc, so no global to name the twin after
    with pytest.raises(TypeError, match="is a Fact"):
        BY_NAME["tp"].key("rnak")


def test_the_views_are_made_from_the_rows():
    for row in ROWS:
        for name in (row.megatron, row.gloo_global, row.ranks_global):
            if name:
                assert name in megatron_globals.NAMES and hasattr(ps, name), (row.name, name)
        if row.field:
            assert pg_collection.FIELDS[row.field.name] == row.answer
            assert (row.field.name in pg_collection.OPTIONAL) == row.optional
    assert [f.name for f in dataclasses.fields(ps.ProcessGroupCollection)] == list(pg_collection.FIELDS)


def _since(row, release):
    return row.field is not None and releases.at_least(release, row.field.since)


def test_collection_fields_are_megatron_cores_in_every_release():
    from megatron.core.process_groups_config import ProcessGroupCollection

    ordered = sorted((r for r in ROWS if r.field), key=lambda r: r.field.slot)
    assert [f.name for f in dataclasses.fields(ProcessGroupCollection)] == \
        [r.field.name for r in ordered if _since(r, "0.16")]
    for release in mr.names():
        assert mr.pg_collection_fields(release) == [r.field.name for r in ordered if _since(r, release)], release
        # megatron-core fills None (or reads without checking) exactly where a kind may be missing.
        fills = mr.use_mpu_process_groups(release)
        for row in ordered:
            if _since(row, release) and not row.optional:
                assert fills[row.field.name] is not None, (release, row.field.name)


def test_globals_descriptions_and_nccl_sections_are_megatron_cores():
    module = set()
    descs = {}
    for release in mr.names():
        module |= set(mr.release(release)["globals"]["module"])
        for entry in mr.group_descs(release):
            template = re.sub(r"\{(level|group_size)\}", "{number}", entry["group_desc"])
            descs[template] = (entry["nccl_config"], entry["backend"])
    for row in ROWS:
        for name in (row.megatron, row.gloo_global, row.ranks_global):
            assert not name or name in module, (row.name, name)
    seen = set(UNKEPT_DESCS)
    for kind in _all_kinds():
        template = re.sub(rf"{kind.number}$" if kind.family else "$^", "{number}", kind.label)
        assert descs[template][0] == kind.nccl, kind.name
        seen.add(template)
        if kind.gloo:
            assert descs[kind.gloo_label][1] == "gloo", kind.name
            seen.add(kind.gloo_label)
    assert seen == set(descs), set(descs) - seen  # every group megatron-core keeps is a kind's
