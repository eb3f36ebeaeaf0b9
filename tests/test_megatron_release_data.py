"""The facts of ``tests/data/megatron_releases.json`` hold for the installed megatron-core.

``python -m tests.oracles snapshot`` wrote them from the real releases, each in a Python 3.12 environment, with
``megatron_snapshot``'s method (see the file's ``generated_by``). The same method, run here on whichever release is
installed (0.16.1 under the README's command; any release under ``python -m tests.oracles test``), must give
exactly that release's data: its public API, its ``ProcessGroupCollection`` and what its own
``initialize_model_parallel`` builds on real gloo ranks.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import version

import megatron_releases as mr
import megatron_snapshot as ms

INSTALLED = ".".join(version("megatron-core").split(".")[:2])


def test_the_data_describes_four_releases_with_their_layouts():
    assert mr.names() == ["0.16", "0.17", "0.18", "0.19"]
    assert [mr.release(n)["version"] for n in mr.names()] == ["0.16.1", "0.17.1", "0.18.2", "0.19.2"]
    assert mr.positional_order("0.19", "initialize_model_parallel")[8:11] == [
        "expert_model_parallel_size", "gtp_remat_size", "expert_gtp_remat_size"]
    assert mr.positional_order("0.18", "get_data_parallel_group")[1] == "partial_data_parallel"
    assert mr.positional_order("0.19", "get_data_parallel_group")[1] == "with_gtp_remat"
    assert mr.use_mpu_process_groups("0.19")["dp_cp_ag"] is None
    gtp = mr.layouts("0.19")["tp2-gtp2-pp2"]
    assert gtp["world_size"] == 8 and mr.rank_view(gtp, 5)["globals"]["_GTP_WEIGHT_REMAT_GROUP"] == {"group": [5, 7]}
    # Stored once where every rank agrees, read back as one value per rank.
    assert len(gtp["globals"]["_GTP_WEIGHT_REMAT_GROUP"]) == len(gtp["accessors"]["get_context_parallel_world_size()"]) == 8
    assert mr.unpack(mr.pack(gtp)) == gtp


def test_installed_public_api_is_its_data():
    import megatron.core.parallel_state as mps

    api = ms.public_api(mps)
    want = mr.release(INSTALLED)["public"]
    assert version("megatron-core").split("+")[0] == mr.release(INSTALLED)["version"]
    assert set(api["functions"]) == set(want["functions"]) and len(want["functions"]) >= 82
    assert api == want


def test_installed_process_group_collection_fields_are_its_data():
    from megatron.core.process_groups_config import ProcessGroupCollection

    assert [f.name for f in dataclasses.fields(ProcessGroupCollection)] == mr.pg_collection_fields(INSTALLED)


def test_installed_layouts_are_its_data(pools):
    layouts = mr.layouts(INSTALLED)
    assert len(layouts) >= 5
    for world in sorted({layout["world_size"] for layout in layouts.values()}):
        results = pools(world).run(ms.run_cases, mr.case_specs(INSTALLED, world), timeout=600, cleanup=False)
        for name, layout in layouts.items():
            if layout["world_size"] != world:
                continue
            got = ms.merge([r["cases"][name] for r in results])
            want = {k: v for k, v in layout.items() if k not in ("world_size", "kwargs", "then_calls")}
            wrong = {f"{section}:{key}": (want[section].get(key), got.get(section, {}).get(key))
                     for section in want if isinstance(want[section], dict)
                     for key in set(want[section]) | set(got.get(section, {}))
                     if want[section].get(key) != got.get(section, {}).get(key)}
            assert not wrong, (name, dict(list(wrong.items())[:5]))
            assert got == want, name
            # Real layouts, not empty answers: groups of several ranks (not always data-parallel ones: tp2-gtp2-pp2
            # on 8 ranks has dp 1); None on ranks outside rank_offset's window.
            if "initialize" not in got:
                assert any(isinstance(v, dict) and len(v.get("group") or ()) > 1
                           for values in got["globals"].values() if isinstance(values, list) for v in values), name
