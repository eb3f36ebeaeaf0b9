"""``python -m parallel_state.tools.generate [--check]``: write the source that follows the release table.

Some of parallel_state's source is a function of a table: the parameters of
``initialize_model_parallel``, ``RankGenerator`` and a few accessors differ between megatron-core
releases (``topology/release_table.py``), the accessors follow their rules
(``megatron/accessor_keys.py``), ``ProcessGroupCollection``'s fields follow the kind rows. That
source is written by this command, not by hand, and checked in, so that what runs is what a reader,
grep and a type checker see: nothing is made from text at import. Each piece is a region between two
marker lines::

    # <generated: NAME> ...
    ...
    # </generated: NAME>

A region of more than a few lines is a module of its own, written whole by this command: its
docstring says so, then its imports, the region and its ``__all__`` (``megatron/generated_accessors.py``,
``megatron/generated_initialize.py``); the short ones (a dataclass's fields, one ``__init__``) are a region
of the hand-written module they belong to. This command rewrites every region and every generated module
from its table (``--check``: only says which are stale, exit status 1 if any);
``tests/test_tools_generate.py`` fails while one is. Where a function's parameters differ between
releases, the region defines it once per distinct parameter list, under ``if releases.in_use() ...``:
the def of the release in use is the one Python runs.

The command imports ``parallel_state``, so the package must import before it runs: where a new rule
replaces an accessor written by hand, keep the hand-written def until the region holds the new one.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from parallel_state.errors import ParallelStateError
from parallel_state.topology import releases
from parallel_state.topology.release_table import KNOWN, REQUIRED, SIGNATURES, Param

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A release name that parallel_state does not know: its functions take the positions every release shares.
UNKNOWN = "99.99"
LINE = 125  # ruff's line length (pyproject.toml)

_REGION = re.compile(r"^(?P<indent>[ \t]*)# <generated: (?P<name>[\w-]+)>[^\n]*\n(?P<body>.*?)"
                     r"^[ \t]*# </generated: (?P=name)>$", re.M | re.S)


# --- parameters as source text -------------------------------------------------------------------

def literal(name: str, value: Any) -> str:
    """``value`` as source text that reads back equal, or an error naming the parameter."""
    text = repr(value)
    if isinstance(value, str) and '"' not in text and "\\" not in text:
        text = f'"{value}"'  # the project's quotes
    try:
        back = ast.literal_eval(text)
        same = back == value and type(back) is type(value)
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ValueError(f"the default of {name} ({text}) is not a literal; generated source needs one")
    return text


@dataclass(frozen=True)
class Parameters:
    """A def's parameters: ``(name, annotation, default)`` each (``REQUIRED``: no default)."""

    positional: tuple[tuple[str, str, Any], ...]
    keyword_only: tuple[tuple[str, str, Any], ...] = ()
    #: The ``*`` parameter collecting positional values beyond the shared ones (a release parallel_state does not know).
    beyond: str | None = None

    def names(self) -> list[str]:
        return [n for n, _, _ in self.positional + self.keyword_only]

    def text(self) -> list[str]:
        """Each parameter as it is written between a def's parentheses."""
        def one(name: str, annotation: str, default: Any) -> str:
            head = f"{name}: {annotation}" if annotation else name
            return head if default is REQUIRED else f"{head} = {literal(name, default)}"

        parts = [one(*p) for p in self.positional]
        if self.beyond is not None:
            parts.append(f"*{self.beyond}")
        elif self.keyword_only:
            parts.append("*")
        return parts + [one(*p) for p in self.keyword_only]


#: The widest a generated line may be before its region's indentation (a class body and a release branch: 8).
WIDTH = LINE - 8


def pack(parts: Sequence[str], indent: str) -> list[str]:
    """``parts`` joined by ", " (a trailing one too) into lines at ``indent`` no wider than ``WIDTH``."""
    lines, line = [], indent
    for part in parts:
        if line != indent and len(line) + len(part) + 1 > WIDTH:
            lines.append(line.rstrip())
            line = indent
        line += part + ", "
    return [*lines, line.rstrip()]


def bracketed(head: str, parts: Sequence[str], tail: str, indent: str = "") -> list[str]:
    """``head + ", ".join(parts) + tail`` at ``indent``: one line where it fits, else ``parts`` on lines of their
    own between ``head`` and ``tail`` (``def f(`` ... ``) -> None:``, ``g(`` ... ``)``)."""
    one = f"{indent}{head}{', '.join(parts)}{tail}"
    if len(one) <= WIDTH:
        return [one]
    return [f"{indent}{head}", *pack(parts, indent + "    "), f"{indent}{tail}"]


def def_line(name: str, params: Sequence[str], returns: str) -> list[str]:
    """``def name(params) -> returns:``."""
    return bracketed(f"def {name}(", params, f") -> {returns}:")


def docstring(doc: str, indent: str) -> list[str]:
    """``doc`` as a docstring at ``indent`` (its lines as written, re-indented)."""
    lines = inspect.cleandoc(doc).splitlines()
    if len(lines) == 1:
        return [f'{indent}"""{lines[0]}"""']
    return [f'{indent}"""{lines[0]}', *(f"{indent}{line}" if line else "" for line in lines[1:]), f'{indent}"""']


def table_parameters(function: str, release: str, extended: bool) -> Parameters:
    """The parameters ``function`` (a ``SIGNATURES`` key) takes in ``release``: exactly the release's, or
    (``extended``) every other release's too, keyword-only; a release parallel_state does not know takes
    the shared positions, a ``*beyond`` (but ``extended`` ones, whose Python refuses more) and the rest by keyword."""
    def row(p: Param) -> tuple[str, str, Any]:
        return p.name, p.annotation, p.default

    positional = tuple(row(p) for p in releases.positional(function, release))
    rest = tuple(row(p) for p in releases.keyword_only(function, release))
    if releases.known(release):
        return Parameters(positional, rest if extended else ())
    return Parameters(positional, rest, None if extended else releases.beyond(release))


def by_release(render: Callable[[str], list[str]], indent: str) -> list[str]:
    """``render(release)`` for every known release and an unknown one, each distinct text once, under
    ``if releases.in_use() ...`` (the unknown release's under ``else``)."""
    texts: dict[tuple[str, ...], list[str]] = {}
    for release in (*KNOWN, UNKNOWN):
        texts.setdefault(tuple(render(release)), []).append(release)
    if len(texts) == 1:
        return [line and indent + line for line in next(iter(texts))]
    out: list[str] = []
    ordered = sorted(texts.items(), key=lambda item: UNKNOWN in item[1])  # the unknown release's last: else
    for i, (text, group) in enumerate(ordered):
        known = [r for r in group if r != UNKNOWN]
        if UNKNOWN in group:
            also = f"megatron-core {', '.join(known)} and " if known else ""
            out.append(f"{indent}else:  # {also}any release parallel_state does not know")
        else:
            test = f"== {literal('release', known[0])}" if len(known) == 1 else \
                f"in ({', '.join(literal('release', r) for r in known)})"
            out.append(f"{indent}{'elif' if i else 'if'} releases.in_use() {test}:")
        out += [line and f"{indent}    {line}" for line in text]
    return out


# --- the regions ----------------------------------------------------------------------------------

def init_arguments_fields() -> list[str]:
    """``InitArguments``' fields: one per row of the release table's ``initialize_model_parallel``."""
    out = []
    for p in SIGNATURES["initialize_model_parallel"]:
        if p.since != KNOWN[0] or p.until is not None:
            span = f"{p.since} to {p.until}" if p.until else f"{p.since} and later"
            out.append(f"#: megatron-core {span} only" if p.until else f"#: megatron-core {span}")
        out.append(f"{p.name}: {p.annotation} = {literal(p.name, p.default)}")
    return out


RANK_GENERATOR_DOC = "Lay out the dimensions: sizes, the order, an offset added to every rank."


def rank_generator_init() -> list[str]:
    """``RankGenerator.__init__`` per release: the release's parameters (later releases' keyword-only)."""
    function = "RankGenerator.__init__"

    def render(release: str) -> list[str]:
        params = table_parameters(function, release, extended=True)
        return [*def_line("__init__", ["self", *params.text()], "None"), *docstring(RANK_GENERATOR_DOC, "    "),
                *bracketed("self._build(", [f"{n}={n}" for n in params.names()], ")", "    ")]

    return by_release(render, "")


def initialize_model_parallel() -> list[str]:
    """``initialize_model_parallel`` per release: the release's parameters, then every other release's,
    the aliases and parallel_state's own, keyword-only."""
    from parallel_state.topology.init_arguments import ALIASES, InitArguments

    own = [(f.name, str(f.type), f.default) for f in InitArguments.own()]

    def render(release: str) -> list[str]:
        table = table_parameters("initialize_model_parallel", release, extended=True)
        params = Parameters(table.positional, (*table.keyword_only, *((a, "int | None", None) for a in ALIASES), *own),
                            releases.beyond(release))
        body = []
        if params.beyond:
            body += [f"    if {params.beyond}:",
                     f'        releases.refuse("initialize_model_parallel()", {len(params.positional)}, '
                     f"len({params.beyond}))",
                     f"    del {params.beyond}  # empty"]
        body.append("    initialize(InitArguments.from_call(locals()))  # locals(): the call's arguments, by name")
        return [*def_line("initialize_model_parallel", params.text(), "None"), *body]

    return [*by_release(render, ""), "", "",
            "initialize_model_parallel.__doc__ = DOC  # one docstring for every release's def"]


INITIALIZE_HEAD = '''"""``initialize_model_parallel``: one def per distinct parameter list of the megatron-core releases, the
release in use's the one Python runs. Its docstring and what it does are ``megatron/initialize.py``'s (``DOC``,
``initialize``): each def hands its arguments, by name, to ``InitArguments.from_call``.
"""

from __future__ import annotations

import datetime
from typing import Callable, Sequence

from parallel_state.megatron.initialize import DOC, initialize
from parallel_state.topology import releases
from parallel_state.topology.init_arguments import InitArguments
'''


def pg_collection_fields() -> list[str]:
    """The plain ``ProcessGroupCollection``'s fields: one per kind row's collection field."""
    from parallel_state.megatron.pg_collection import FIELDS

    return [f"{name}: Any = None" for name in FIELDS]


def _variable(key: str) -> str:
    """The accessors module's global that holds answer ``key`` (``"tp-dp.group"``: ``_TP_DP_GROUP``)."""
    return "_" + re.sub(r"[^A-Za-z0-9]", "_", key).upper()


def key_source(key: str) -> str:
    """The source of answer ``key`` as ``generated_accessors.py`` writes it: its constant in ``answer_keys``, or its
    kind's constant in ``kinds`` and its fact (``kinds.TP_DP.key(Fact.GROUP)``): made by ``key`` at import."""
    from parallel_state.topology import answer_keys, kinds

    for name, value in sorted(vars(answer_keys).items()):
        if name.isupper() and isinstance(value, str) and value == key:
            return f"answer_keys.{name}"
    made = answer_keys.parts(key)
    if made is not None:
        for name, value in sorted(vars(kinds).items()):
            if name.isupper() and isinstance(value, kinds.Kind) and value.name == made[0]:
                return f"kinds.{name}.key(Fact.{made[1].name})"
    raise ValueError(f"the answer {key!r} is no kind's fact and no constant of answer_keys")


def accessors() -> list[str]:
    """Every accessor with a rule (``accessor_keys.RULES``), per release where its parameters differ."""
    from parallel_state.megatron.accessor_keys import RULES, Rule

    variables: dict[str, str] = {}

    def parameters(name: str, rule: Rule, release: str) -> Parameters:
        signature = inspect.signature(rule.key)
        if name not in SIGNATURES:
            return Parameters(tuple((p.name, str(p.annotation), p.default) for p in signature.parameters.values()))
        rows = [(p.name, p.default) for p in SIGNATURES[name]]
        if rows != [(p.name, p.default) for p in signature.parameters.values()]:
            raise ValueError(f"the rule of {name} takes {signature}, not the release table's {rows}")
        return table_parameters(name, release, extended=False)

    def tree(name: str, rule: Rule, tested: list[tuple[str, Any]], fixed: dict[str, bool], indent: str) -> list[str]:
        """Nested tests of the flags, one per level, the answer's variable at each leaf (none where the
        rule refuses the combination)."""
        if not tested:
            try:
                key = rule.key(**fixed)
            except ParallelStateError:
                return []
            variables.setdefault(_variable(key), key)
            if variables[_variable(key)] != key:
                raise ValueError(f"the answers {key!r} and {variables[_variable(key)]!r} share a variable")
            return [f"{indent}return {_variable(key)}"]
        (flag, default), rest = tested[0], tested[1:]
        if default not in (True, False):
            raise ValueError(f"{name}: a rule takes flags; {flag} defaults to {default!r}")
        out: list[str] = []
        for value in (default, not default):  # the default first: the common call tests least
            inner = tree(name, rule, rest, {**fixed, flag: value}, indent + "    ")
            if inner:
                out += [f"{indent}{'elif' if out else 'if'} {flag if value else 'not ' + flag}"
                        f"{' is True' if value else ''}:", *inner]
        return out

    def render_one(name: str, rule: Rule, release: str) -> list[str]:
        params = parameters(name, rule, release)
        tested = [(n, d) for n, _, d in params.positional + params.keyword_only if n != "check_initialized"]
        out = [*def_line(name, params.text(), rule.returns), *docstring(rule.doc, "    ")]
        if rule.deprecated:  # level 1, as megatron-core: a deeper level walks frames on every call of a hot name
            out += bracketed("warnings.warn(", [literal("deprecated", rule.deprecated), "DeprecationWarning", "1"], ")",
                             "    ")
        if params.beyond:
            out += [f"    if {params.beyond}:",
                    f'        releases.refuse("{name}()", {len(params.positional)}, len({params.beyond}))']
        slow = [literal("name", name), *(f"{n}={n}" for n in params.names())]
        if not tested:
            return [*out, "    try:", *tree(name, rule, [], {}, " " * 8), "    except NameError:",
                    *bracketed("return answer(", slow, ")", " " * 8)]
        return [*out, "    try:", *tree(name, rule, tested, {}, " " * 8),
                "    except NameError:  # an answer absent: answer() gives megatron-core's fallback or says why",
                "        pass", *bracketed("return answer(", slow, ")", "    ")]

    defs: list[str] = []
    for name, rule in RULES.items():
        defs += ["", "", *by_release(lambda release, n=name, r=rule: render_one(n, r, release), "")]
    head = ["#: Each global an accessor reads on its fast path, and the key of the answer it holds (``accessors._refresh``",
            "#: sets them here).",
            "VARIABLES: dict[str, AnswerKey] = {"]
    head += [f"    {literal('variable', v)}: {key_source(k)}," for v, k in variables.items()]
    return [*head, "}", *defs]


ACCESSORS_HEAD = '''"""megatron-core's accessors that return what their rule (``accessor_keys.RULES``) names for their flags,
one def per distinct parameter list of the releases: how they answer, and why so, is ``megatron/accessors.py``'s
docstring (the fast path: a global of this module; a NameError sends the call to ``accessor_keys.answer``).
``accessors`` re-exports them, sets and removes their globals (``_refresh``) and holds the accessors written by hand.
"""

from __future__ import annotations

import warnings
from typing import Any

from parallel_state.megatron.accessor_keys import answer
from parallel_state.topology import answer_keys, kinds, releases
from parallel_state.topology.answer_keys import AnswerKey, Fact
'''


@dataclass(frozen=True)
class Region:
    """A generated region: the module holding it, what writes it and, for a module written whole, the text
    before the region (its docstring and imports) and its ``__all__`` (the names the module exports)."""

    path: str
    render: Callable[[], list[str]]
    head: str | None = None
    exports: Callable[[], list[str]] | None = None

    def module(self, name: str) -> str:
        """The whole text of a generated module (``head`` set): head, the region between its markers, ``__all__``."""
        body = "".join(f"{line}\n" for line in self.render())
        names = "".join(f"    {literal('name', n)},\n" for n in sorted(self.exports())) if self.exports else ""
        return (f"{GENERATED_BY}\n{self.head}\n# <generated: {name}> by `python -m parallel_state.tools.generate`\n"
                f"{body}# </generated: {name}>\n\n__all__ = [\n{names}]\n")


#: The first line of every module this command writes whole.
GENERATED_BY = "# Generated by `python -m parallel_state.tools.generate`: edit its tables, not this file, and run it."


def _accessor_names() -> list[str]:
    from parallel_state.megatron.accessor_keys import RULES

    return ["VARIABLES", *RULES]


#: Every region by name: the module holding it and what writes it.
REGIONS: dict[str, Region] = {
    "init-arguments": Region("parallel_state/topology/init_arguments.py", init_arguments_fields),
    "rank-generator": Region("parallel_state/topology/rank_generator.py", rank_generator_init),
    "initialize-model-parallel": Region("parallel_state/megatron/generated_initialize.py", initialize_model_parallel,
                                        INITIALIZE_HEAD, lambda: ["initialize_model_parallel"]),
    "accessors": Region("parallel_state/megatron/generated_accessors.py", accessors, ACCESSORS_HEAD, _accessor_names),
    "pg-collection": Region("parallel_state/megatron/pg_collection.py", pg_collection_fields),
}


def _rewritten(text: str, path: str, names: dict[str, Region]) -> tuple[str, list[str]]:
    """``text`` with its regions rewritten, and the names of those whose text changed."""
    changed: list[str] = []
    seen: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        name, indent = match.group("name"), match.group("indent")
        if name not in names:
            raise ValueError(f"{path}: region {name!r} is none of {sorted(names)}")
        seen.add(name)
        body = "".join(f"{indent}{line}\n" if line else "\n" for line in names[name].render())
        if body != match.group("body"):
            changed.append(name)
        # The marker lines as they are, the body between them new.
        return text[match.start():match.start("body")] + body + text[match.end("body"):match.end()]

    out = _REGION.sub(replace, text)
    missing = set(names) - seen
    if missing:
        raise ValueError(f"{path} has no region {sorted(missing)}: add its marker lines")
    return out, changed


def generate(write: bool = True) -> list[str]:
    """Rewrite every region and generated module (``write`` False: only compare); the names of those that were
    stale."""
    stale: list[str] = []
    for path in sorted({r.path for r in REGIONS.values()}):
        full = os.path.join(ROOT, path)
        text = ""
        if os.path.exists(full):
            with open(full, encoding="utf-8") as f:
                text = f.read()
        here = {n: r for n, r in REGIONS.items() if r.path == path}
        whole = [n for n, r in here.items() if r.head is not None]
        if whole:  # a generated module: one region, the whole file compared
            new = here[whole[0]].module(whole[0])
            changed = whole if new != text else []
        else:
            new, changed = _rewritten(text, path, here)
        stale += changed
        if write and new != text:
            with open(full, "w", encoding="utf-8") as f:
                f.write(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    """Rewrite the regions (or, with ``--check``, report the stale ones); 1 if ``--check`` found one."""
    parser = argparse.ArgumentParser(prog="python -m parallel_state.tools.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region is stale")
    args = parser.parse_args(argv)
    stale = generate(write=not args.check)
    for name in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {REGIONS[name].path} region {name!r}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
