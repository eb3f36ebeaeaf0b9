"""What a release's ``parallel_state.py`` and ``process_groups_config.py`` say in their source, read with ``ast``.

These are the facts no call can observe: which globals ``initialize_model_parallel`` declares, which of them it
sets to another global (and under which ``if``), every ``group_desc`` with its NCCL config section, and the
getter ``ProcessGroupCollection.use_mpu_process_groups`` fills each field with. Only the standard library is
used, so this runs under any Python on any release's files.
"""

from __future__ import annotations

import ast
from typing import Any

INITIALIZE = "initialize_model_parallel"


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _globals_declared(fn: ast.FunctionDef) -> list[str]:
    out: list[str] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Global):
            out += [n for n in node.names if n not in out]
    return out


def _called_names(fn: ast.FunctionDef) -> list[str]:
    calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)),
                   key=lambda n: (n.lineno, n.col_offset))
    out: list[str] = []
    for call in calls:
        if call.func.id not in out:
            out.append(call.func.id)
    return out


def _is_state(name: str) -> bool:
    return name.startswith("_") and name[1:2].isupper()


def _aliases(fn: ast.FunctionDef) -> list[dict[str, Any]]:
    """``_A = _B`` between module globals inside ``fn``, with the ``if`` conditions around it (an ``else``
    branch reads ``not (condition)``) and whether a loop encloses it."""
    out: list[dict[str, Any]] = []

    def visit(stmts: list[ast.stmt], when: list[str], in_loop: bool) -> None:
        for st in stmts:
            if isinstance(st, ast.Assign) and isinstance(st.value, ast.Name) and _is_state(st.value.id):
                for target in st.targets:
                    if isinstance(target, ast.Name) and _is_state(target.id):
                        out.append({"global": target.id, "is": st.value.id, "line": st.lineno, "when": list(when),
                                    "in_loop": in_loop})
            elif isinstance(st, ast.If):
                test = ast.unparse(st.test)
                visit(st.body, when + [test], in_loop)
                visit(st.orelse, when + [f"not ({test})"], in_loop)
            elif isinstance(st, (ast.For, ast.While)):
                visit(st.body, when, True)
                visit(st.orelse, when, in_loop)
            elif isinstance(st, (ast.With, ast.Try)):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(st, part, []), when, in_loop)
                for handler in getattr(st, "handlers", []):
                    visit(handler.body, when, in_loop)

    visit(fn.body, [], False)
    return out


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _nccl_section(expr: ast.expr | None) -> str | None:
    """The section of the ``get_nccl_options("dp", ...)`` call in ``expr`` (also inside ``x if c else y``), or None."""
    for node in ast.walk(expr) if expr is not None else ():
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_nccl_options"
                and node.args and isinstance(node.args[0], ast.Constant)):
            return node.args[0].value
    return None


def _text(expr: ast.expr | None, bound: dict[str, Any]) -> str | None:
    """A constant or f-string as text: a name bound to a constant is filled in, others stay ``{name}``."""
    if expr is None:
        return None
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.JoinedStr):
        parts = []
        for value in expr.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                name = ast.unparse(value.value)
                parts.append(str(bound[name]) if name in bound else "{" + name + "}")
        return "".join(parts)
    if isinstance(expr, ast.Name):
        return f"<{expr.id}>"
    return f"<{ast.unparse(expr)}>"


def _create_group_calls(fn: ast.FunctionDef) -> list[tuple[ast.Call, list[ast.expr]]]:
    """Every ``create_group(...)`` call in ``fn`` in source order, with the ``if`` tests around it."""
    out: list[tuple[ast.Call, list[ast.expr]]] = []

    def visit(node: ast.AST, tests: list[ast.expr]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = tests + [child.test] if isinstance(child, ast.If) else tests
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "create_group":
                out.append((child, tests))
            visit(child, inner)

    visit(fn, [])
    return sorted(out, key=lambda item: (item[0].lineno, item[0].col_offset))


def _entry(function: str, desc: str | None, call: ast.Call, section: str | None) -> dict[str, Any]:
    return {"function": function, "group_desc": desc, "nccl_config": section,
            "backend": _text(_keyword(call, "backend"), {})}


def _bind(helper: ast.FunctionDef, call: ast.Call) -> dict[str, ast.expr | None]:
    """The call's argument expression for each of the helper's parameters (None where the default holds)."""
    params = [a.arg for a in helper.args.args]
    bound: dict[str, ast.expr | None] = dict.fromkeys(params)
    for name, value in zip(params, call.args, strict=False):
        bound[name] = value
    for k in call.keywords:
        bound[k.arg] = k.value
    defaults = dict(zip(params[len(params) - len(helper.args.defaults):], helper.args.defaults, strict=True))
    return {n: (v if v is not None else defaults.get(n)) for n, v in bound.items()}


def _via(function: str, helper: ast.FunctionDef, call: ast.Call) -> list[dict[str, Any]]:
    """The groups a helper creates for one call site: its templates filled with the caller's constants; a list
    of ``pg_options`` gives one entry per level; a group under ``if flag:`` counts unless the caller's flag is
    the constant False."""
    bound = _bind(helper, call)
    constants = {n: v.value for n, v in bound.items() if isinstance(v, ast.Constant)}
    out = []
    for inner, tests in _create_group_calls(helper):
        if any(isinstance(t, ast.Name) and isinstance(bound.get(t.id), ast.Constant) and not bound[t.id].value
               for t in tests):
            continue
        options = bound.get("pg_options")
        levels = options.elts if isinstance(options, ast.List) else [options]
        for level, option in enumerate(levels):
            filled = dict(constants, level=level) if isinstance(options, ast.List) else constants
            entry = _entry(function, _text(_keyword(inner, "group_desc"), filled), inner, _nccl_section(option))
            out.append({**entry, "via": helper.name})
    return out


def group_descs(tree: ast.Module) -> list[dict[str, Any]]:
    """Every ``create_group`` call's ``group_desc`` with ``nccl_config`` (``get_nccl_options``' first argument in
    its ``pg_options``), ``backend`` and the ``function`` it is in; the groups of helpers that take their
    ``group_desc`` / ``pg_options`` from the caller are listed per call site, after the direct ones, with ``via``;
    each entry once."""
    functions = _functions(tree)
    helpers = {name: fn for name, fn in functions.items()
               if _create_group_calls(fn) and any(name in _called_names(f) for f in functions.values())}
    direct, via = [], []
    for name, fn in functions.items():
        if name in helpers:
            continue
        for call, _tests in _create_group_calls(fn):
            direct.append(_entry(name, _text(_keyword(call, "group_desc"), {}), call,
                                 _nccl_section(_keyword(call, "pg_options"))))
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                        and n.func.id in helpers), key=lambda n: (n.lineno, n.col_offset))
        for call in calls:
            via += _via(name, helpers[call.func.id], call)
    out: list[dict[str, Any]] = []
    for entry in direct + via:  # a group created in two branches is one fact
        if entry not in out:
            out.append(entry)
    return out


def globals_facts(tree: ast.Module) -> dict[str, Any]:
    """``declared_in_initialize_model_parallel`` (its ``global`` names in order), ``assigned_by_helpers`` (the
    functions it calls that declare globals, with those) and ``alias_assignments``."""
    functions = _functions(tree)
    init = functions[INITIALIZE]
    helpers = {name: _globals_declared(functions[name]) for name in _called_names(init)
               if name in functions and _globals_declared(functions[name])}
    return {"declared_in_initialize_model_parallel": _globals_declared(init), "assigned_by_helpers": helpers,
            "alias_assignments": _aliases(init)}


def _getter(expr: ast.expr) -> dict[str, Any] | None:
    """``partial(parallel_state.get_x, k=v)`` -> ``{"getter": "get_x", "kwargs": {"k": v}}``; ``lambda: None`` -> None."""
    if isinstance(expr, ast.Lambda):
        if isinstance(expr.body, ast.Constant) and expr.body.value is None:
            return None
        expr = expr.body
    if isinstance(expr, ast.Call) and ast.unparse(expr.func) in ("partial", "functools.partial"):
        target, kwargs = expr.args[0], {k.arg: ast.literal_eval(k.value) for k in expr.keywords}
    else:
        target, kwargs = (expr.func if isinstance(expr, ast.Call) else expr), {}
    return {"getter": target.attr if isinstance(target, ast.Attribute) else ast.unparse(target), "kwargs": kwargs}


def use_mpu_process_groups(tree: ast.Module, fields: list[str]) -> dict[str, dict[str, Any] | None]:
    """Per field, in declaration order, what ``use_mpu_process_groups``' table (``pg_to_func``) fills it with."""
    table: dict[str, Any] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.FunctionDef) and node.name == "use_mpu_process_groups"):
            for st in ast.walk(node):
                if isinstance(st, ast.Assign) and isinstance(st.value, ast.Dict) and any(
                        isinstance(t, ast.Name) and t.id == "pg_to_func" for t in st.targets):
                    table = {k.value: _getter(v) for k, v in zip(st.value.keys, st.value.values, strict=True)}
    if not table:
        raise ValueError("no pg_to_func table in ProcessGroupCollection.use_mpu_process_groups: "
                         "tests/oracles/source_facts.py must learn this release's spelling")
    return {f: table[f] for f in fields if f in table}


def read(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)
