"""Accessors with a fast path: one closure-variable read for the common argument values.

An accessor runs per layer and per micro-batch. ``compile_accessor`` wraps a reference accessor
(``accessors.py``, which holds the semantics: validation, errors, megatron-core's fallbacks) in a
plain closure with the same name, parameters, defaults and docstring. Each parameter list that
megatron-core's accessors have gets one template below, written out by hand. A template first
tests the common argument values (a flag that defaults to False by truth, as megatron-core does;
anything else with ``is``) and returns that variant's precomputed answer, held in one closure
variable per variant (``a_default``, ``a_cp``, ...). ``refresh`` sets those variables from the
answers after every change of the state and empties them when there is no answer (nothing
initialized, a kind not built): reading an empty closure variable raises NameError, and that, like
any other argument values, goes to the reference accessor, which answers or explains. A closure
variable read is what megatron-core's own accessors cost (its ``assert _GROUP is not None;
return _GROUP`` reads a global twice), so these are as fast or faster
(``python -m benchmarks.bench_accessors`` prints both; see docs/benchmarks.md).

``check_initialized`` is never tested on the fast path: it only decides what happens without an
answer, which the reference accessor handles (validating it there).
"""

from __future__ import annotations

import inspect
from types import CellType
from typing import Any, Callable

from parallel_state.groups import state as _st
from parallel_state.megatron.answers import ANSWERS

#: Every variable of every compiled accessor, with the answer key it holds.
_CELLS: list[tuple[CellType, str]] = []


def _t0(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = None
    del a_default

    def accessor():
        try:
            return a_default
        except NameError:  # no answer: the reference accessor explains
            pass
        return reference()

    return accessor


def _t_ci(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = None
    del a_default

    def accessor(check_initialized=True):
        try:
            return a_default
        except NameError:
            pass
        return reference(check_initialized)

    return accessor


def _t_cp(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_cp = None
    del a_default, a_cp

    def accessor(with_context_parallel=False):
        try:
            if not with_context_parallel:
                return a_default
            if with_context_parallel is True:
                return a_cp
        except NameError:
            pass
        return reference(with_context_parallel)

    return accessor


def _t_cp_ci(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_cp = None
    del a_default, a_cp

    def accessor(with_context_parallel=False, check_initialized=True):
        try:
            if not with_context_parallel:
                return a_default
            if with_context_parallel is True:
                return a_cp
        except NameError:
            pass
        return reference(with_context_parallel, check_initialized)

    return accessor


def _t_ci_cp(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_cp = None
    del a_default, a_cp

    def accessor(check_initialized=True, with_context_parallel=False):
        try:
            if not with_context_parallel:
                return a_default
            if with_context_parallel is True:
                return a_cp
        except NameError:
            pass
        return reference(check_initialized, with_context_parallel)

    return accessor


def _t_dp(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_cp = a_cp_partial = None
    del a_default, a_cp, a_cp_partial

    def accessor(with_context_parallel=False, partial_data_parallel=False):
        try:
            if not with_context_parallel:
                if not partial_data_parallel:
                    return a_default
            elif with_context_parallel is True:
                if not partial_data_parallel:
                    return a_cp
                if partial_data_parallel is True:
                    return a_cp_partial
        except NameError:
            pass
        return reference(with_context_parallel, partial_data_parallel)

    return accessor


def _t_dp_group(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_cp = a_cp_partial = a_cp_all_gather = None
    del a_default, a_cp, a_cp_partial, a_cp_all_gather

    def accessor(with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False):
        try:
            if not with_context_parallel:
                if not partial_data_parallel and not independent_all_gather:
                    return a_default
            elif with_context_parallel is True:
                if not partial_data_parallel:
                    if not independent_all_gather:
                        return a_cp
                    if independent_all_gather is True:
                        return a_cp_all_gather
                elif partial_data_parallel is True and not independent_all_gather:
                    return a_cp_partial
        except NameError:
            pass
        return reference(with_context_parallel, partial_data_parallel, independent_all_gather)

    return accessor


def _t_amax(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_cp = a_tp_only = a_cp_tp_only = None
    del a_default, a_cp, a_tp_only, a_cp_tp_only

    def accessor(with_context_parallel=False, tp_only_amax_red=False):
        try:
            if not with_context_parallel:
                if not tp_only_amax_red:
                    return a_default
                if tp_only_amax_red is True:
                    return a_tp_only
            elif with_context_parallel is True:
                if not tp_only_amax_red:
                    return a_cp
                if tp_only_amax_red is True:
                    return a_cp_tp_only
        except NameError:
            pass
        return reference(with_context_parallel, tp_only_amax_red)

    return accessor


def _t_edp(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_partial = None
    del a_default, a_partial

    def accessor(partial_expert_data_parallel=False):
        try:
            if not partial_expert_data_parallel:
                return a_default
            if partial_expert_data_parallel is True:
                return a_partial
        except NameError:
            pass
        return reference(partial_expert_data_parallel)

    return accessor


def _t_ci_edp(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = a_partial = None
    del a_default, a_partial

    def accessor(check_initialized=True, partial_expert_data_parallel=False):
        try:
            if not partial_expert_data_parallel:
                return a_default
            if partial_expert_data_parallel is True:
                return a_partial
        except NameError:
            pass
        return reference(check_initialized, partial_expert_data_parallel)

    return accessor


def _t_stage(reference: Callable[..., Any]) -> Callable[..., Any]:
    a_default = None
    del a_default

    def accessor(ignore_virtual=True, vp_stage=None):
        try:
            if ignore_virtual is True and vp_stage is None:
                return a_default
        except NameError:
            pass
        return reference(ignore_virtual, vp_stage)

    return accessor


#: parameter list -> its template.
_TEMPLATES: dict[tuple[str, ...], Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    (): _t0,
    ("check_initialized",): _t_ci,
    ("with_context_parallel",): _t_cp,
    ("with_context_parallel", "check_initialized"): _t_cp_ci,
    ("check_initialized", "with_context_parallel"): _t_ci_cp,
    ("with_context_parallel", "partial_data_parallel"): _t_dp,
    ("with_context_parallel", "partial_data_parallel", "independent_all_gather"): _t_dp_group,
    ("with_context_parallel", "tp_only_amax_red"): _t_amax,
    ("partial_expert_data_parallel",): _t_edp,
    ("check_initialized", "partial_expert_data_parallel"): _t_ci_edp,
    ("ignore_virtual", "vp_stage"): _t_stage,
}


def compile_accessor(reference: Callable[..., Any], variants: dict[str, str], name: str | None = None
                     ) -> Callable[..., Any]:
    """``reference`` with a fast path, named ``name``: for each variant (``default``, ``cp``, ...), its answer key."""
    name = name or reference.__name__
    params = tuple(inspect.signature(reference).parameters.values())
    template = _TEMPLATES.get(tuple(p.name for p in params))
    if template is None:
        raise ValueError(f"{name}: no fast-path template for the parameters {[p.name for p in params]}")
    compiled = template(reference)
    shape = [(p.name, p.kind, p.default) for p in inspect.signature(compiled).parameters.values()]
    if shape != [(p.name, p.kind, p.default) for p in params]:
        raise ValueError(f"{name}: the template {template.__name__} has other defaults than {inspect.signature(reference)}")
    cells = dict(zip(compiled.__code__.co_freevars, compiled.__closure__ or (), strict=True))
    for variant, key in variants.items():
        if f"a_{variant}" not in cells:
            raise ValueError(f"{name}: the template {template.__name__} has no variant {variant!r}")
        _CELLS.append((cells[f"a_{variant}"], key))
        if key in ANSWERS:
            cells[f"a_{variant}"].cell_contents = ANSWERS[key]
    compiled.__name__ = compiled.__qualname__ = name
    compiled.__doc__, compiled.__module__ = reference.__doc__, reference.__module__
    compiled.__annotations__ = dict(reference.__annotations__)
    return compiled


def refresh() -> None:
    """Set every compiled accessor's variables from the answers; empty those with no answer."""
    for cell, key in _CELLS:
        try:
            cell.cell_contents = ANSWERS[key]
        except KeyError:
            del cell.cell_contents  # emptying an empty variable is allowed


_st.on_change(refresh)  # registered after answers.refresh (imported above), so it reads fresh answers
