"""The accessors' fast twins (``megatron.compiled``): the answer when there is one, else the reference; bad specs refused."""

from __future__ import annotations

import inspect

import pytest

from parallel_state.megatron import compiled
from parallel_state.megatron.answers import ANSWERS


def _reference(with_context_parallel=False, partial_data_parallel=False):
    """The reference: says which arguments it got."""
    return ("reference", with_context_parallel, partial_data_parallel)


def test_fast_twin_reads_answers_and_falls_back_to_the_reference():
    fast = compiled.compile_accessor(_reference, {"default": "test.default", "cp": "test.cp"}, name="probe")
    assert (fast.__name__, fast.__doc__, fast.__code__.co_name) == ("probe", _reference.__doc__, "probe")
    assert inspect.signature(fast) == inspect.signature(_reference) and not hasattr(fast, "__signature__")
    assert fast() == ("reference", False, False)  # no answer yet
    ANSWERS.update({"test.default": "d", "test.cp": "c"})
    try:
        compiled.refresh()
        assert fast() == fast(False) == fast(0, None) == "d"
        assert fast(with_context_parallel=True) == "c"
        # A variant without a fast answer, and a truthy non-True flag, reach the reference.
        assert fast(True, True) == ("reference", True, True)
        assert fast(1) == ("reference", 1, False)
    finally:
        del ANSWERS["test.default"], ANSWERS["test.cp"]
        compiled.refresh()
    assert fast() == ("reference", False, False)  # emptied again
    # The generated source is readable where tracebacks and debuggers look for it.
    assert "return a_cp" in inspect.getsource(fast)


def test_compile_accessor_refuses_what_it_cannot_make():
    def other_default(with_context_parallel=True):
        return with_context_parallel

    with pytest.raises(ValueError, match="other_default: a variant turns on with_context_parallel, which does not "
                                         "default to False"):
        compiled.compile_accessor(other_default, {"default": "x", "cp": "y"})
    with pytest.raises(ValueError, match="_reference: the variant 'tp_only' turns on 'tp_only', which none of its "
                                         "parameters"):
        compiled.compile_accessor(_reference, {"tp_only": "x"})

    def varargs(*args):
        return args

    with pytest.raises(ValueError, match="varargs: no fast path for the parameters"):
        compiled.compile_accessor(varargs, {"default": "x"})

    def get_data_parallel_group(with_context_parallel, partial_data_parallel):  # a release-table accessor, short
        return None

    with pytest.raises(ValueError, match="are not the release table's"):
        compiled.compile_accessor(get_data_parallel_group, {"default": "x"})


def test_a_keyword_only_extension_stays_keyword_only():
    def src_rank(*, with_context_parallel=False):
        return ("reference", with_context_parallel)

    fast = compiled.compile_accessor(src_rank, {"default": "test.kw", "cp": "test.kw-cp"})
    ANSWERS.update({"test.kw": 0, "test.kw-cp": 2})
    try:
        compiled.refresh()
        assert (fast(), fast(with_context_parallel=True)) == (0, 2)
        with pytest.raises(TypeError):
            fast(True)  # positional: refused, as by the reference
    finally:
        del ANSWERS["test.kw"], ANSWERS["test.kw-cp"]
        compiled.refresh()
    assert fast(with_context_parallel=True) == ("reference", True)
