"""The accessors' fast path (``megatron/generated_accessors.py``, written from ``accessor_keys``' rules): every flag
combination reads its rule's answer from a global; an absent answer, or any other argument, goes to ``answer``."""

from __future__ import annotations

import contextlib
import inspect
import itertools

import pytest

from parallel_state.groups import state as _st
from parallel_state.megatron import accessor_keys, accessors, answers, generated_accessors
from parallel_state.megatron.accessor_keys import RULES, answer


def _outcome(fn, *args, **kwargs):
    try:
        return ("value", fn(*args, **kwargs))
    except Exception as exc:  # the same error on both paths: type and message
        return (type(exc).__name__, str(exc))


@contextlib.contextmanager
def _answers(fill: bool):
    """Every fast-path answer set to a value of its own (``fill``), or none; afterwards as before."""
    assert _st.peek() is None  # this process holds no topology: the answers are the test's
    if fill:
        answers.ANSWERS.update({key: f"<{key}>" for key in accessors.VARIABLES.values()})
    accessors._refresh()
    try:
        yield
    finally:
        answers.refresh()
        accessors._refresh()


def _flag_combinations(fn):
    flags = [p.name for p in inspect.signature(fn).parameters.values() if p.name != "check_initialized"]
    for values in itertools.product((False, True), repeat=len(flags)):
        yield dict(zip(flags, values, strict=True))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the deprecated names warn on every call, as megatron-core's
def test_every_flag_combination_reads_its_rules_answer_from_a_global():
    with _answers(fill=True):
        expected = {(name, tuple(c.items())): _outcome(answer, name, **c)
                    for name in RULES for c in _flag_combinations(getattr(accessors, name))}
        assert sum(value[0] == "value" for value in expected.values()) >= 90  # the combinations the rules refuse aside
        answers.ANSWERS.clear()  # the globals stay: only the fast path can answer now
        for (name, combination), want in expected.items():
            assert _outcome(getattr(accessors, name), **dict(combination)) == want, (name, combination)
        assert generated_accessors._TP_CP_GROUP == "<tp-cp.group>"
    assert "_TP_CP_GROUP" not in vars(generated_accessors)  # no answer: no global


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_without_answers_every_accessor_asks_answer():
    with _answers(fill=False):
        for name in RULES:
            assert _outcome(getattr(accessors, name)) == _outcome(answer, name), name
        assert accessors.is_initialized() is False and accessors.get_tensor_model_parallel_group(False) is None
        with pytest.raises(AssertionError, match="call parallel_state.initialize_model_parallel"):
            accessors.get_tensor_model_parallel_group()


def test_other_values_than_bools_go_to_the_check():
    with _answers(fill=True):
        assert accessors.get_tp_group(0) == accessors.get_tp_group(None) == "<tp.group>"  # falsy: False, as megatron
        for value in ("yes", 1, "False"):
            with pytest.raises(TypeError, match=f"with_context_parallel must be True or False, got {value!r}"):
                accessors.get_tp_group(value)


def test_the_generator_refuses_a_rule_it_cannot_write(monkeypatch):
    from parallel_state.tools import generate

    def counted(tries: int = 3) -> str:
        return "x.group"

    monkeypatch.setitem(RULES, "get_counted", accessor_keys.Rule(counted, "A rule of an int."))
    with pytest.raises(ValueError, match="get_counted: a rule takes flags; tries defaults to 3"):
        generate.accessors()
    monkeypatch.delitem(RULES, "get_counted")

    def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> str:
        return "dp.rank"

    monkeypatch.setitem(RULES, "get_data_parallel_rank", accessor_keys.Rule(get_data_parallel_rank, "Short."))
    with pytest.raises(ValueError, match="the rule of get_data_parallel_rank takes .* not the release table's"):
        generate.accessors()
