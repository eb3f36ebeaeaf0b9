"""The 0.16 facts of ``tests/data/megatron_releases.json`` hold for the installed megatron-core 0.16.1.

0.17 to 0.19 need Python >= 3.12, so their facts were read by running each release's own
``parallel_state.py`` with ``megatron_snapshot`` (see the file's ``generated_by``). The same method,
run here on the installed 0.16.1 (the live oracle), must give exactly the 0.16 data: its public API,
its ``ProcessGroupCollection`` and what its own ``initialize_model_parallel`` builds on real gloo ranks.
"""

from __future__ import annotations

import dataclasses

import megatron_releases as mr
import megatron_snapshot as ms


def test_the_data_describes_four_releases_with_their_layouts():
    assert mr.names() == ["0.16", "0.17", "0.18", "0.19"]
    assert mr.positional_order("0.19", "initialize_model_parallel")[8:11] == [
        "expert_model_parallel_size", "gtp_remat_size", "expert_gtp_remat_size"]
    assert mr.positional_order("0.18", "get_data_parallel_group")[1] == "partial_data_parallel"
    assert mr.positional_order("0.19", "get_data_parallel_group")[1] == "with_gtp_remat"
    assert mr.use_mpu_process_groups("0.19")["dp_cp_ag"] is None
    gtp = mr.layouts("0.19")["tp2-gtp2-pp2"]
    assert gtp["world_size"] == 8 and mr.rank_view(gtp, 5)["globals"]["_GTP_WEIGHT_REMAT_GROUP"] == {"group": [5, 7]}


def test_installed_public_api_is_the_016_data():
    import megatron.core.parallel_state as mps

    api = ms.public_api(mps)
    want = mr.release("0.16")["public"]
    assert list(api["functions"]) == list(want["functions"]) and len(want["functions"]) >= 86
    assert api == want


def test_installed_process_group_collection_fields_are_the_016_data():
    from megatron.core.process_groups_config import ProcessGroupCollection

    assert [f.name for f in dataclasses.fields(ProcessGroupCollection)] == mr.pg_collection_fields("0.16")


def test_installed_layouts_are_the_016_data(pools):
    layouts = mr.layouts("0.16")
    assert {layout["world_size"] for layout in layouts.values()} == {8} and len(layouts) >= 5
    cases = mr.case_specs("0.16")
    results = pools(8).run(ms.run_cases, cases, timeout=300, cleanup=False)
    for name, layout in layouts.items():
        got = ms.merge([r["cases"][name] for r in results])
        want = {k: v for k, v in layout.items() if k not in ("world_size", "kwargs", "then_calls")}
        wrong = {f"{section}:{key}": (want[section].get(key), got.get(section, {}).get(key))
                 for section in want if isinstance(want[section], dict)
                 for key in set(want[section]) | set(got.get(section, {}))
                 if want[section].get(key) != got.get(section, {}).get(key)}
        assert not wrong, (name, dict(list(wrong.items())[:5]))
        assert got == want, name
        # Real layouts, not empty answers: groups of several ranks on every rank.
        assert any(len(v["group"]) > 1 for v in got["globals"]["_DATA_PARALLEL_GROUP_WITH_CP"]), name
