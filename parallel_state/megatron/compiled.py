"""Accessors with a fast path: one global read for the common argument values.

An accessor runs per layer and per micro-batch. ``compile_accessor`` gives a reference accessor
(``accessors.py``, which holds the semantics: validation, errors, megatron-core's fallbacks) a
fast twin with the same name, parameters, defaults and docstring. The twin is one of the
templates below, written out by hand, one per parameter list megatron-core's accessors have, made
into a function with ``types.FunctionType`` over the template's own code and a small globals
namespace of its own: ``reference`` (the reference accessor) and one variable per variant
(``a_default``, ``a_cp``, ...) holding its precomputed answer. A template first tests the common
argument values (a flag that defaults to False by truth, as megatron-core does; anything else
with ``is``) and returns that variant's answer. ``refresh`` sets the variables from the answers
after every change of the state and removes those with no answer (nothing initialized, a kind not
built): the read then raises NameError, and that, like any other argument values, goes to the
reference accessor, which answers or explains. ``check_initialized`` is never tested on the fast
path: it only decides what happens without an answer, which the reference accessor handles.

Why a namespace per twin rather than closures: a global read is what megatron-core's own accessors
cost (its ``assert _GROUP is not None; return _GROUP``), while a closure pays to copy its cells into
every call's frame. Measured with ``python -m benchmarks.bench_accessors`` on this project's 2-CPU
machine: closures cost 3 to 6 ns more per call than global reads (about 45 against 40 ns), which
left group getters such as ``is_initialized`` and ``get_virtual_pipeline_model_parallel_rank``
behind megatron-core's; the global reads tie or win on every row (docs/benchmarks.md). Earlier the
same functions were generated as source and run with ``exec``; this is the same code, written once,
that a reader can step through.
"""

# The templates read names that exist only in each twin's own globals (see above).
# ruff: noqa: F821

from __future__ import annotations

import builtins
import inspect
import types
from typing import Any, Callable

from parallel_state.groups import state as _st
from parallel_state.megatron.answers import ANSWERS

#: Every variable of every fast twin: (its globals, the variable, the answer key it holds).
_VARIABLES: list[tuple[dict[str, Any], str, str]] = []


def _t0():
    try:
        return a_default
    except NameError:  # no answer: the reference accessor explains
        pass
    return reference()


def _t_ci(check_initialized=True):
    try:
        return a_default
    except NameError:
        pass
    return reference(check_initialized)


def _t_cp(with_context_parallel=False):
    try:
        if not with_context_parallel:
            return a_default
        if with_context_parallel is True:
            return a_cp
    except NameError:
        pass
    return reference(with_context_parallel)


def _t_cp_ci(with_context_parallel=False, check_initialized=True):
    try:
        if not with_context_parallel:
            return a_default
        if with_context_parallel is True:
            return a_cp
    except NameError:
        pass
    return reference(with_context_parallel, check_initialized)


def _t_kw_cp(*, with_context_parallel=False):
    # A keyword-only extension of an accessor megatron-core has without arguments.
    try:
        if not with_context_parallel:
            return a_default
        if with_context_parallel is True:
            return a_cp
    except NameError:
        pass
    return reference(with_context_parallel=with_context_parallel)


def _t_ci_cp(check_initialized=True, with_context_parallel=False):
    try:
        if not with_context_parallel:
            return a_default
        if with_context_parallel is True:
            return a_cp
    except NameError:
        pass
    return reference(check_initialized, with_context_parallel)


def _t_cp_partial(with_context_parallel=False, partial_data_parallel=False):
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


# The data-parallel accessors take megatron-core 0.19's with_gtp_remat, which 0.19 put before the
# partial flag. Each has two templates: megatron-core 0.16-0.18's order with with_gtp_remat last, and
# 0.19's; the release in use picks one. Plain positional-or-keyword parameters only, because
# CPython specializes calls to such functions alone (``*args`` or keyword-only parameters cost about
# twice as much per call). They call the reference with keywords, so it needs no order.

def _t_dp(with_context_parallel=False, partial_data_parallel=False, with_gtp_remat=True):
    try:
        if with_gtp_remat is True:
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
    return reference(with_context_parallel, with_gtp_remat=with_gtp_remat, partial_data_parallel=partial_data_parallel)


def _t_dp_019(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False):
    try:
        if with_gtp_remat is True:
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
    return reference(with_context_parallel, with_gtp_remat=with_gtp_remat, partial_data_parallel=partial_data_parallel)


def _t_dp_group(with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False,
                with_gtp_remat=True):
    try:
        if with_gtp_remat is True and not independent_all_gather:
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
    return reference(with_context_parallel, with_gtp_remat=with_gtp_remat, partial_data_parallel=partial_data_parallel,
                     independent_all_gather=independent_all_gather)


def _t_dp_group_019(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False,
                    independent_all_gather=False):
    try:
        if with_gtp_remat is True and not independent_all_gather:
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
    return reference(with_context_parallel, with_gtp_remat=with_gtp_remat, partial_data_parallel=partial_data_parallel,
                     independent_all_gather=independent_all_gather)


def _t_amax(with_context_parallel=False, tp_only_amax_red=False):
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


def _t_edp(partial_expert_data_parallel=False):
    try:
        if not partial_expert_data_parallel:
            return a_default
        if partial_expert_data_parallel is True:
            return a_partial
    except NameError:
        pass
    return reference(partial_expert_data_parallel)


def _t_edp_n(partial_expert_data_parallel=False, with_gtp_remat=True):
    try:
        if with_gtp_remat is True:
            if not partial_expert_data_parallel:
                return a_default
            if partial_expert_data_parallel is True:
                return a_partial
    except NameError:
        pass
    return reference(with_gtp_remat=with_gtp_remat, partial_expert_data_parallel=partial_expert_data_parallel)


def _t_edp_n_019(with_gtp_remat=True, partial_expert_data_parallel=False):
    try:
        if with_gtp_remat is True:
            if not partial_expert_data_parallel:
                return a_default
            if partial_expert_data_parallel is True:
                return a_partial
    except NameError:
        pass
    return reference(with_gtp_remat=with_gtp_remat, partial_expert_data_parallel=partial_expert_data_parallel)


def _t_ci_edp(check_initialized=True, partial_expert_data_parallel=False, with_gtp_remat=True):
    try:
        if with_gtp_remat is True:
            if not partial_expert_data_parallel:
                return a_default
            if partial_expert_data_parallel is True:
                return a_partial
    except NameError:
        pass
    return reference(check_initialized, with_gtp_remat=with_gtp_remat,
                     partial_expert_data_parallel=partial_expert_data_parallel)


def _t_ci_edp_019(check_initialized=True, with_gtp_remat=True, partial_expert_data_parallel=False):
    try:
        if with_gtp_remat is True:
            if not partial_expert_data_parallel:
                return a_default
            if partial_expert_data_parallel is True:
                return a_partial
    except NameError:
        pass
    return reference(check_initialized, with_gtp_remat=with_gtp_remat,
                     partial_expert_data_parallel=partial_expert_data_parallel)


def _t_any(*args, **kwargs):
    # A release whose positional order parallel_state does not know: no fast path, the reference binds.
    return reference(*args, **kwargs)


def _t_ci_egtp(check_initialized=True, with_egtp_remat=False):
    try:
        if not with_egtp_remat:
            return a_default
        if with_egtp_remat is True:
            return a_egtp
    except NameError:
        pass
    return reference(check_initialized, with_egtp_remat)


def _t_stage(ignore_virtual=True, vp_stage=None):
    try:
        if ignore_virtual is True and vp_stage is None:
            return a_default
    except NameError:
        pass
    return reference(ignore_virtual, vp_stage)



#: parameter list (``*`` before keyword-only parameters, as in a signature) -> its template.
_TEMPLATES: dict[tuple[str, ...], Callable[..., Any]] = {
    (): _t0,
    ("check_initialized",): _t_ci,
    ("with_context_parallel",): _t_cp,
    ("*", "with_context_parallel"): _t_kw_cp,
    ("with_context_parallel", "check_initialized"): _t_cp_ci,
    ("check_initialized", "with_context_parallel"): _t_ci_cp,
    ("with_context_parallel", "partial_data_parallel"): _t_cp_partial,
    ("with_context_parallel", "partial_data_parallel", "with_gtp_remat"): _t_dp,
    ("with_context_parallel", "with_gtp_remat", "partial_data_parallel"): _t_dp_019,
    ("with_context_parallel", "partial_data_parallel", "independent_all_gather", "with_gtp_remat"): _t_dp_group,
    ("with_context_parallel", "with_gtp_remat", "partial_data_parallel", "independent_all_gather"): _t_dp_group_019,
    ("with_context_parallel", "tp_only_amax_red"): _t_amax,
    ("partial_expert_data_parallel",): _t_edp,
    ("partial_expert_data_parallel", "with_gtp_remat"): _t_edp_n,
    ("with_gtp_remat", "partial_expert_data_parallel"): _t_edp_n_019,
    ("check_initialized", "partial_expert_data_parallel", "with_gtp_remat"): _t_ci_edp,
    ("check_initialized", "with_gtp_remat", "partial_expert_data_parallel"): _t_ci_edp_019,
    ("check_initialized", "with_egtp_remat"): _t_ci_egtp,
    ("ignore_virtual", "vp_stage"): _t_stage,
}


def _parameter_list(params: tuple[inspect.Parameter, ...]) -> tuple[str, ...]:
    names: list[str] = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            names.append("*args")
            continue
        if p.kind is p.KEYWORD_ONLY and "*" not in names and "*args" not in names:
            names.append("*")
        names.append(p.name)
    return tuple(names)


def compile_accessor(reference: Callable[..., Any], variants: dict[str, str], name: str | None = None,
                     positional: tuple[str, ...] | None = None) -> Callable[..., Any]:
    """``reference`` with a fast path, named ``name``: for each variant (``default``, ``cp``, ...), its answer key.

    ``positional`` (for an accessor whose positional order differs between megatron-core releases)
    is the order of the release in use: the template whose parameters start with it is taken, its
    other parameters following; None takes the reference's own parameter list.
    """
    name = name or reference.__name__
    params = {p.name: p for p in inspect.signature(reference).parameters.values() if p.kind is not p.VAR_POSITIONAL}
    if positional is None:
        shape = _parameter_list(tuple(inspect.signature(reference).parameters.values()))
        template = _TEMPLATES.get(shape)
    else:
        found = [t for key, t in _TEMPLATES.items() if key[:len(positional)] == positional and set(key) == set(params)]
        shape, template = positional, found[0] if len(found) == 1 else None
    if template is None:
        raise ValueError(f"{name}: no fast-path template for the parameters {list(shape)}")
    mine = {p.name: p.default for p in inspect.signature(template).parameters.values()}
    if mine != {n: p.default for n, p in params.items()}:
        raise ValueError(f"{name}: the template {template.__name__} has other defaults than {inspect.signature(reference)}")
    return _twin(template, reference, variants, name)


def compile_passthrough(reference: Callable[..., Any], name: str, signature: inspect.Signature) -> Callable[..., Any]:
    """``reference`` under ``name`` with no fast path, showing ``signature`` (a release whose order is unknown)."""
    fast = _twin(_t_any, reference, {}, name)
    fast.__signature__ = signature  # type: ignore[attr-defined]
    return fast


def _twin(template: Callable[..., Any], reference: Callable[..., Any], variants: dict[str, str], name: str
          ) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"__builtins__": builtins, "reference": reference}
    for variant, key in variants.items():
        variable = f"a_{variant}"
        if variable not in template.__code__.co_names:
            raise ValueError(f"{name}: the template {template.__name__} has no variant {variant!r}")
        _VARIABLES.append((namespace, variable, key))
        if key in ANSWERS:
            namespace[variable] = ANSWERS[key]
    fast = types.FunctionType(template.__code__, namespace, name, template.__defaults__)
    fast.__kwdefaults__ = template.__kwdefaults__
    fast.__qualname__, fast.__doc__, fast.__module__ = name, reference.__doc__, reference.__module__
    fast.__annotations__ = dict(reference.__annotations__)
    return fast


def refresh() -> None:
    """Set every fast twin's variables from the answers; remove those with no answer."""
    for namespace, variable, key in _VARIABLES:
        try:
            namespace[variable] = ANSWERS[key]
        except KeyError:
            namespace.pop(variable, None)


_st.on_change(refresh)  # registered after answers.refresh (imported above), so it reads fresh answers
