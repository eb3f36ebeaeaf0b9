"""Accessors with a fast path: one global read for the common argument values.

An accessor runs per layer and per micro-batch. ``compile_accessor`` gives a reference accessor
(``accessors.py``, which holds the semantics: validation, errors, megatron-core's fallbacks) a
fast twin with the same name, docstring and answers. Its parameters are the release table's for
the release in use where the accessor has rows there (``release_table.SIGNATURES``: exactly that
release's, in its order; the reference gets the other releases' defaults), else the reference's
own. The twin is
a plain ``def`` made from those parameters (``topology.codegen``), over a small globals namespace
of its own: ``reference`` (the reference accessor) and one variable per variant (``a_default``,
``a_cp``, ...) holding its precomputed answer. It first tests the common argument values, one
parameter after another (a flag that defaults to False by truth, as megatron-core does; anything
else with ``is``), and returns that variant's answer. ``refresh`` sets the variables from the
answers after every change of the state and removes those with no answer (nothing initialized, a
kind not built): the read then raises NameError, and that, like any other argument values, goes
to the reference accessor, which answers or explains. ``check_initialized`` is never tested on the
fast path: it only decides what happens without an answer, which the reference accessor handles.
The twin passes every argument to the reference by keyword, so the reference needs no order.

Why a namespace per twin rather than closures: a global read is what megatron-core's own accessors
cost (its ``assert _GROUP is not None; return _GROUP``), while a closure pays to copy its cells into
every call's frame. Measured with ``python -m benchmarks.bench_accessors`` on this project's 2-CPU
machine: closures cost 3 to 6 ns more per call than global reads (about 45 against 40 ns). Why
plain parameters, and none of another release: CPython specializes a call only to a function
without ``*args``, ``**kwargs`` or keyword-only parameters; a keyword-only parameter (another
release's keyword, such as 0.19's ``with_gtp_remat`` under 0.16) made every call of that accessor a
generic one, about 30 ns more (`python -m benchmarks.bench_accessors --direct`). Only for a release
parallel_state does not know does a twin keep keyword-only parameters (every known release's
keywords after the shared positions).
"""

from __future__ import annotations

import builtins
import inspect
import types
from typing import Any, Callable

from parallel_state.groups import state as _st
from parallel_state.megatron.answers import ANSWERS
from parallel_state.topology import codegen, releases
from parallel_state.topology.release_table import REQUIRED, SIGNATURES

#: Every variable of every fast twin: (its globals, the variable, the answer key it holds).
_VARIABLES: list[tuple[dict[str, Any], str, str]] = []

#: A variant's name is ``default`` or words joined by ``_``; each word turns on one flag (the one the accessor has).
WORDS: dict[str, tuple[str, ...]] = {
    "cp": ("with_context_parallel",), "partial": ("partial_data_parallel", "partial_expert_data_parallel"),
    "tp_only": ("tp_only_amax_red",), "egtp": ("with_egtp_remat",),
}
#: Parameters the fast path does not test: they only decide what happens without an answer.
UNTESTED = ("check_initialized",)

#: The compiled code of each shape (parameters, variants), made once and shared by every accessor of that shape.
_SHAPES: dict[Any, types.FunctionType] = {}


def _parameters(reference: Callable[..., Any], name: str
                ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]], str | None]:
    """(positional, keyword-only, var-positional name) of ``name``'s twin: the release table's, else the reference's."""
    # Read from the code object, not inspect.signature: this runs for every accessor at import.
    code = reference.__code__
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS) or code.co_posonlyargcount:
        raise ValueError(f"{name}: no fast path for the parameters {inspect.signature(reference)}")
    positional = list(code.co_varnames[:code.co_argcount])
    keyword_only = list(code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount])
    if name in SIGNATURES:
        rows = SIGNATURES[name]
        if {p.name for p in rows} != {*positional, *keyword_only}:
            raise ValueError(f"{name}: the reference's parameters {positional + keyword_only} are not the release "
                             f"table's {[p.name for p in rows]}")
        if releases.beyond() is None:  # a known release: exactly its parameters, as its function has them
            return [(p.name, p.default) for p in releases.positional(name)], [], None
        return ([(p.name, p.default) for p in releases.positional(name)],
                [(p.name, p.default) for p in releases.keyword_only(name)], releases.beyond())
    defaults = reference.__defaults__ or ()
    required = len(positional) - len(defaults)
    kwdefaults = reference.__kwdefaults__ or {}
    return ([(n, REQUIRED if i < required else defaults[i - required]) for i, n in enumerate(positional)],
            [(n, kwdefaults.get(n, REQUIRED)) for n in keyword_only], None)


def _turned_on(name: str, variant: str, names: set[str], absent: set[str]) -> frozenset[str] | None:
    """The flags ``variant`` turns on; None if one is another release's (``absent``): no call reaches it."""
    if variant == "default":
        return frozenset()
    on, words, word = set(), [], ""
    for part in variant.split("_"):  # the words, longest first: "cp_tp_only" is cp, tp_only
        word = f"{word}_{part}" if word else part
        if word in WORDS or not any(w.startswith(f"{word}_") for w in WORDS):
            words.append(word)
            word = ""
    for part in words + ([word] if word else []):
        found = [flag for flag in WORDS.get(part, ()) if flag in names]
        if not found and absent.intersection(WORDS.get(part, ())):
            return None
        if not found:
            raise ValueError(f"{name}: the variant {variant!r} turns on {part!r}, which none of its parameters "
                             f"{sorted(names)} is (variant words: {sorted(WORDS)})")
        on.add(found[0])
    return frozenset(on)


def _test(name: str, default: Any, on: bool) -> str:
    if on:
        return f"{name} is True"
    if default is False:
        return f"not {name}"
    if default is True or default is None:
        return f"{name} is {default}"
    raise ValueError(f"a fast path tests flags defaulting to False, True or None; {name} defaults to {default!r}")


def _tree(params: list[tuple[str, Any]], variants: list[tuple[frozenset[str], str]], indent: str) -> list[str]:
    """Nested tests, one parameter per level, each variant's return at its leaf."""
    if not params:
        return [f"{indent}return a_{variants[0][1]}"]
    (name, default), rest = params[0], params[1:]
    groups: dict[str, list[tuple[frozenset[str], str]]] = {}
    for on, variant in variants:
        groups.setdefault(_test(name, default, name in on), []).append((on, variant))
    lines = []
    for i, (test, group) in enumerate(groups.items()):
        lines.append(f"{indent}{'elif' if i else 'if'} {test}:")
        lines += _tree(rest, group, indent + "    ")
    return lines


def compile_accessor(reference: Callable[..., Any], variants: dict[str, str], name: str | None = None
                     ) -> Callable[..., Any]:
    """``reference``'s fast twin, named ``name``: for each variant (``default``, ``cp``, ...), its answer key."""
    name = name or reference.__name__
    positional, keyword_only, beyond = _parameters(reference, name)
    names = {n for n, _ in positional + keyword_only}
    absent = tuple((p.name, p.default) for p in SIGNATURES.get(name, ()) if p.name not in names)
    flags = {variant: _turned_on(name, variant, names, {n for n, _ in absent}) for variant in variants}
    variants = {variant: key for variant, key in variants.items() if flags[variant] is not None}
    flags = {variant: on for variant, on in flags.items() if on is not None}
    for n in names & set().union(*flags.values()):
        if dict(positional + keyword_only)[n] is not False:
            raise ValueError(f"{name}: a variant turns on {n}, which does not default to False")
    if len(set(flags.values())) != len(flags):
        raise ValueError(f"{name}: two variants turn on the same flags {flags}")
    shape = (codegen.parameter_text(positional, keyword_only, beyond), tuple(flags.items()), absent)
    if shape not in _SHAPES:
        tested = [(n, d) for n, d in positional + keyword_only if n not in UNTESTED]
        body = [f"    if {beyond}:", f"        refuse(len({beyond}))"] if beyond else []
        if variants:
            body += ["    try:", *_tree(tested, [(on, v) for v, on in flags.items()], " " * 8),
                     "    except NameError:  # no answer: the reference accessor explains",
                     "        pass"]
        # The reference takes every release's parameters: those the twin lacks get their defaults.
        passed = [f"{n}={n}" for n, _ in positional + keyword_only]
        passed += [f"{n}={codegen.default_text(n, d)}" for n, d in absent]  # other releases' parameters
        body.append(f"    return reference({', '.join(passed)})")
        _SHAPES[shape] = codegen.define("twin", shape[0], "\n".join(body) + "\n", {}, module=__name__)
    return _twin(_SHAPES[shape], reference, variants, name, len(positional))


def _twin(shape: types.FunctionType, reference: Callable[..., Any], variants: dict[str, str], name: str,
          positional: int) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"__builtins__": builtins, "reference": reference,
                                 "refuse": lambda extra: releases.refuse(f"{name}()", positional, extra)}
    for variant, key in variants.items():
        variable = f"a_{variant}"
        _VARIABLES.append((namespace, variable, key))
        if key in ANSWERS:
            namespace[variable] = ANSWERS[key]
    fast = codegen.rebind(shape, namespace, name)
    fast.__doc__, fast.__module__ = reference.__doc__, reference.__module__
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
