"""Accessors compiled to one global read on their hot path.

An accessor runs per layer and per micro-batch. ``compile_accessor`` turns a reference accessor
(``accessors.py``, which holds the semantics: validation, errors, megatron-core's fallbacks) into
a function with the same name, parameters, defaults and docstring whose body first tests the
common argument values (``is True`` / ``is None``, or a false flag by truth) and returns the
precomputed answer for them, read as a global of a namespace the answers refresh writes into.
An answer that is not there (nothing initialized, a kind not built) is absent from the
namespace, so the read raises NameError, and that, like any other argument values, goes to the
reference accessor, which answers or explains. A global read is what megatron-core's own
accessors cost (its ``assert _GROUP is not None; return _GROUP``), so these are as fast or faster.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from parallel_state import state as _st
from parallel_state.answers import ANSWERS

#: The generated functions' globals: each reference accessor, and one variable per present answer.
_NS: dict[str, Any] = {}
#: variable name -> answer key, for every answer some compiled accessor reads.
_VARIABLES: dict[str, str] = {}


def _variable(key: str) -> str:
    name = "a_" + "".join(c if c.isalnum() else "_" for c in key)
    if _VARIABLES.setdefault(name, key) != key:
        raise ValueError(f"answer keys {key!r} and {_VARIABLES[name]!r} map to one variable {name!r}")
    if key in ANSWERS:
        _NS[name] = ANSWERS[key]
    return name


def compile_accessor(reference: Callable[..., Any], fast: dict[tuple[tuple[str, Any], ...], str],
                     name: str | None = None) -> Callable[..., Any]:
    """``reference`` with a fast path, named ``name``: for the argument values in each key of ``fast``, its answer key.

    A key of ``fast`` lists (parameter, value) pairs; parameters it omits must have their
    defaults. Values are True, False or None, tested with ``is``.
    """
    name = name or reference.__name__
    params = inspect.signature(reference).parameters
    for p in params.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.default not in (True, False, None):
            raise ValueError(f"{name}: only parameters with True/False/None defaults can be compiled")
    ref = f"ref_{name}"
    _NS[ref] = reference
    # Keyword-only parameters (extensions beyond megatron-core's signature) stay keyword-only.
    decl, call = [], []
    for p in params.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in decl:
            decl.append("*")
        decl.append(f"{p.name}={p.default!r}")
        call.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
    lines = [f"def {name}({', '.join(decl)}):", "    try:"]
    for pairs, key in fast.items():
        values = {p: params[p].default for p in params} | dict(pairs)
        # check_initialized only decides what happens without an answer, which the reference
        # accessor handles (validating it there): testing it here would only cost time. A flag
        # that defaults to False is tested by truth, as megatron-core does (a bool's truth test is
        # one instruction, `is False` three): any false value means False there too, and a true
        # value other than True still reaches the reference accessor, which rejects it.
        test = " and ".join(f"not {p}" if v is False and params[p].default is False else f"{p} is {v!r}"
                            for p, v in values.items() if p != "check_initialized")
        lines += [f"        if {test}:", f"            return {_variable(key)}"] if test else \
            [f"        return {_variable(key)}"]
    lines += ["    except NameError:  # no answer yet: the reference accessor explains", "        pass",
              f"    return {ref}({', '.join(call)})"]
    exec("\n".join(lines), _NS)  # noqa: S102  (source built above from parameter names and answer keys)
    compiled = _NS.pop(name)
    compiled.__doc__, compiled.__module__, compiled.__qualname__ = reference.__doc__, reference.__module__, name
    compiled.__annotations__ = dict(reference.__annotations__)
    return compiled


def refresh() -> None:
    """Copy every answer a compiled accessor reads into its variable; remove those with no answer."""
    for name, key in _VARIABLES.items():
        if key in ANSWERS:
            _NS[name] = ANSWERS[key]
        else:
            _NS.pop(name, None)


_st.on_change(refresh)  # registered after answers.refresh (imported above), so it reads fresh answers
