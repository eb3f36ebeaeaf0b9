"""The live tier's verdict on megatron-core's own test file (tests/oracles/live.py), on made-up outcomes.

The live tier itself needs the Python 3.12 environments (``python -m tests.oracles test``); what it
concludes from the ranks' junit files is plain code, checked here.
"""

from __future__ import annotations

from tests.oracles import live

MEGATRON = "When not using pp-last rank ordering, the data parallel size of the attention and moe layers must be the same"
DESELECTED = "; megatron-core's CI deselects it (marked flaky, flaky_in_dev)"
THEIRS = {"refused": f"rank 0: AssertionError: {MEGATRON}; 8 of 8 ranks failed{DESELECTED}"}


def _ours(message: str = f'ParallelStateAssertionError: order ... ("{MEGATRON}"),', ranks: str = "8 of 8",
          deselected: str = DESELECTED) -> str:
    return f"rank 0: {message}; {ranks} ranks failed{deselected}"


def test_only_a_deselected_test_refused_alike_by_megatron_core_is_excused():
    assert live._regressions({"refused": _ours()}, THEIRS) == []
    # without megatron-core's run to compare with, every failure counts
    assert live._regressions({"refused": _ours()}, None) == ["refused"]
    # a test megatron-core's CI runs, another reason, other ranks, or one megatron-core passes: each counts
    assert live._regressions({"refused": _ours(deselected="")}, THEIRS) == ["refused"]
    assert live._regressions({"refused": _ours(message="TypeError: no such keyword")}, THEIRS) == ["refused"]
    assert live._regressions({"refused": _ours(ranks="4 of 8")}, THEIRS) == ["refused"]
    assert live._regressions({"other": _ours()}, THEIRS) == ["other"]


def test_a_ranks_junit_file_gives_each_tests_outcome_and_markers(tmp_path):
    xml = tmp_path / "rank0.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase name="a"><properties><property name="markers" value="flaky flaky_in_dev parametrize"/>'
        '</properties><failure message="AssertionError: no&#10;second line">trace</failure></testcase>'
        '<testcase name="b"/>'
        '<testcase name="c"><skipped message="needs CUDA"/></testcase>'
        '</testsuite></testsuites>')
    outcomes, markers = live._outcomes(str(xml))
    assert outcomes == {"a": ("failed", "AssertionError: no"), "b": ("passed", ""), "c": ("skipped", "needs CUDA")}
    assert markers == {"a": {"flaky", "flaky_in_dev", "parametrize"}, "b": set(), "c": set()}
