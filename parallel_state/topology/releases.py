"""Which megatron-core release this process mirrors where releases differ, and that release's rows.

Where megatron-core's releases disagree (the rows of ``release_table``: parameters and their
positional order, globals, a format, a layout rule), parallel_state follows the release in use:
each accessor takes exactly that release's parameters (``initialize_model_parallel`` also every
other release's keywords, keyword-only). The release in use is the one named by the
``PARALLEL_STATE_MEGATRON_RELEASE`` environment variable (``"0.19"``), else the megatron-core that
``import megatron.core`` would load, else 0.16. The installed release is read from its
``megatron/core/package_info.py`` on ``sys.path`` (or from the module, when it is already imported),
never by importing megatron-core, which takes seconds.
"""

from __future__ import annotations

import os
import re
import sys

from parallel_state.errors import ParallelStateTypeError, ParallelStateValueError
from parallel_state.topology.release_table import BEHAVIOURS, GLOBALS, KNOWN, SIGNATURES, Fact, Param

#: The release assumed when no megatron-core is installed.
DEFAULT = "0.16"
ENV = "PARALLEL_STATE_MEGATRON_RELEASE"

_in_use: str | None = None


def parse(release: str) -> tuple[int, int]:
    """``"0.19"`` (or ``"0.19.1"``) as ``(0, 19)``."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\S*)?\s*", release) if isinstance(release, str) else None
    if match is None:
        raise ParallelStateValueError(
            f"{release!r} is not a megatron-core release; write it as major.minor, one of {', '.join(KNOWN)}"
        )
    return int(match.group(1)), int(match.group(2))


def installed() -> str | None:
    """``"major.minor"`` of the megatron-core ``import megatron.core`` would load, or None without one."""
    info = sys.modules.get("megatron.core.package_info")
    if info is not None and hasattr(info, "MAJOR"):
        return f"{info.MAJOR}.{info.MINOR}"
    for entry in sys.path:
        path = os.path.join(entry or os.curdir, "megatron", "core", "package_info.py")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError:
                continue
            major, minor = (re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR"))
            if major and minor:
                return f"{major.group(1)}.{minor.group(1)}"
    return None


def in_use() -> str:
    """The release whose positional orders and formats parallel_state follows (``"0.16"`` ... ``"0.19"``)."""
    global _in_use
    if _in_use is None:
        named = os.environ.get(ENV)
        if named:
            major, minor = parse(named)
            _in_use = f"{major}.{minor}"
        else:
            _in_use = installed() or DEFAULT
    return _in_use


def at_least(release: str, other: str) -> bool:
    """Whether ``release`` is ``other`` or newer."""
    return parse(release) >= parse(other)


def known(release: str) -> bool:
    """Whether parallel_state knows ``release``'s API (0.16 to 0.19)."""
    return f"{parse(release)[0]}.{parse(release)[1]}" in KNOWN


def member(release: str, since: str = KNOWN[0], until: str | None = None) -> bool:
    """Whether a parameter present from ``since`` up to ``until`` (inclusive; None: still there) is in ``release``."""
    return at_least(release, since) and (until is None or at_least(until, release))


def positional(function: str, release: str | None = None) -> tuple[Param, ...]:
    """The parameters of ``function`` (a ``SIGNATURES`` key) that ``release`` (default: in use) takes positionally.

    For a release parallel_state does not know, only the leading parameters every known release
    binds alike: beyond them a positional value could mean another parameter.
    """
    release = release or in_use()
    params = SIGNATURES[function]
    if known(release):
        return tuple(p for p in params if member(release, p.since, p.until))
    orders = [positional(function, r) for r in KNOWN]
    shared = []
    for names in zip(*orders, strict=False):
        if len(set(names)) > 1:
            break
        shared.append(names[0])
    return tuple(shared)


def keyword_only(function: str, release: str | None = None) -> tuple[Param, ...]:
    """The parameters of ``function`` that ``release`` does not take positionally: other releases' keywords."""
    taken = positional(function, release)
    return tuple(p for p in SIGNATURES[function] if p not in taken)


def _fact(facts: tuple[Fact, ...], name: str) -> Fact:
    for fact in facts:
        if fact.name == name:
            return fact
    raise KeyError(f"{name!r} is not a row of the release table; known: {[f.name for f in facts]}")


def behaves(behaviour: str, release: str | None = None) -> bool:
    """Whether ``release`` (default: in use) has ``behaviour``, a ``BEHAVIOURS`` row.

    A release parallel_state does not know behaves as the newest known one.
    """
    release = release or in_use()
    fact = _fact(BEHAVIOURS, behaviour)
    return member(release if known(release) else KNOWN[-1], fact.since, fact.until)


def has_global(name: str, release: str) -> bool | None:
    """Whether megatron-core ``release`` has the module global ``name`` (rows of ``GLOBALS``; any other
    global is in every release), or None for a release parallel_state does not know."""
    if not known(release):
        return None
    try:
        fact = _fact(GLOBALS, name)
    except KeyError:
        return True
    return member(release, fact.since, fact.until)


def too_many(what: str, limit: int, got: int, release: str) -> str:
    """The error for ``got`` positional arguments where ``release`` takes ``limit``."""
    if known(release):
        return (f"{what} takes at most {limit} positional arguments in megatron-core {release} (the release in "
                f"use), got {got}; pass the rest by keyword")
    return (f"{what} got {got} positional arguments, but beyond the first {limit} megatron-core's releases bind "
            f"them to different parameters and the release in use ({release}) is not one parallel_state knows "
            f"({', '.join(KNOWN)}): pass them by keyword, or set {ENV} to the release whose order you mean")


def beyond(release: str | None = None) -> str | None:
    """The name of the ``*`` parameter a generated function has after the shared positions for a release
    parallel_state does not know (its values are refused by :func:`refuse`); None for a known release."""
    return None if known(release or in_use()) else "beyond"


def refuse(what: str, limit: int, extra: int) -> None:
    """Raise the TypeError for ``extra`` positional values beyond the ``limit`` a function takes."""
    raise ParallelStateTypeError(too_many(what, limit, limit + extra, in_use()))
