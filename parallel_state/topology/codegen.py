"""Real functions made from a parameter list: the signatures that depend on the megatron-core release.

A function whose positional parameters depend on the release in use (``release_table``) is made
once, when its module is imported, as the source text of a plain ``def`` with that release's
parameters, compiled and run over a namespace the caller gives. ``inspect.signature`` reads it
like any function, Python binds a call to it as it binds the release's own function, and CPython
specializes calls to it (which a ``*args`` wrapper, or a pasted ``__signature__``, would defeat:
keyword-only parameters cost a generic call, measured in ``compiled``). The source is registered
with ``linecache``, so tracebacks, debuggers and ``inspect.getsource`` show it.
"""

from __future__ import annotations

import ast
import itertools
import linecache
import types
from typing import Any, Sequence

from parallel_state.topology.release_table import REQUIRED

_serial = itertools.count()


def default_text(name: str, value: Any) -> str:
    """``value`` as source text (a literal that reads back equal), or an error naming the parameter."""
    text = repr(value)
    try:
        same = ast.literal_eval(text) == value and type(ast.literal_eval(text)) is type(value)
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ValueError(f"the default of {name} ({text}) is not a literal; a generated function needs one")
    return text


def parameter_text(positional: Sequence[tuple[str, Any]], keyword_only: Sequence[tuple[str, Any]] = (),
                   var_positional: str | None = None) -> str:
    """The text between a def's parentheses: ``(name, default)`` pairs (``REQUIRED``: none)."""
    def one(name: str, default: Any) -> str:
        return name if default is REQUIRED else f"{name}={default_text(name, default)}"

    parts = [one(n, d) for n, d in positional]
    if var_positional is not None:
        parts.append(f"*{var_positional}")
    elif keyword_only:
        parts.append("*")
    parts += [one(n, d) for n, d in keyword_only]
    return ", ".join(parts)


def define(name: str, parameters: str, body: str, namespace: dict[str, Any], *, module: str,
           doc: str | None = None, annotations: dict[str, Any] | None = None) -> types.FunctionType:
    """``def name(parameters): body`` compiled and run in ``namespace`` (its globals), named as in ``module``.

    ``body`` is the function's indented body (4 spaces). The function's file is a
    ``<generated ...>`` name whose lines ``linecache`` holds.
    """
    source = f"def {name}({parameters}):\n{body}"
    filename = f"<generated {module}.{name} #{next(_serial)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - source built here from the release table
    fn = namespace.pop(name)
    fn.__module__, fn.__doc__ = module, doc
    if annotations:
        fn.__annotations__ = dict(annotations)
    return fn


def rebind(fn: types.FunctionType, namespace: dict[str, Any], name: str) -> types.FunctionType:
    """``fn``'s code as a new function named ``name`` over the globals ``namespace`` (one compile, many twins)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    twin = types.FunctionType(code, namespace, name, fn.__defaults__)
    twin.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    return twin
