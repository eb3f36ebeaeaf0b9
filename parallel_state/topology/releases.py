"""Which megatron-core release this process mirrors where releases differ: the one in use.

parallel_state accepts the keywords of every megatron-core release from 0.16 to 0.19. Where the
releases disagree (the positional order of a few functions, the format of ``get_all_ranks``,
``RankGenerator``'s order string), it follows the release in use: the one named by the
``PARALLEL_STATE_MEGATRON_RELEASE`` environment variable (``"0.19"``), else the megatron-core that
``import megatron.core`` would load, else 0.16. The installed release is read from its
``megatron/core/package_info.py`` on ``sys.path`` (or from the module, when it is already imported),
never by importing megatron-core, which takes seconds.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Sequence

from parallel_state.errors import ParallelStateValueError

#: The releases whose API parallel_state knows, oldest first.
KNOWN: tuple[str, ...] = ("0.16", "0.17", "0.18", "0.19")
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


def positional(params: Sequence[tuple[str, str, str | None]], release: str) -> tuple[str, ...]:
    """The names of ``params`` (name, since, until; in the releases' merged order) ``release`` takes positionally.

    For a release parallel_state does not know, only the leading parameters every known release
    binds alike: beyond them a positional value could mean another parameter.
    """
    if known(release):
        return tuple(name for name, since, until in params if member(release, since, until))
    orders = [positional(params, r) for r in KNOWN]
    shared = []
    for names in zip(*orders, strict=False):
        if len(set(names)) > 1:
            break
        shared.append(names[0])
    return tuple(shared)


def too_many(what: str, limit: int, got: int, release: str) -> str:
    """The error for ``got`` positional arguments where ``release`` takes ``limit``."""
    if known(release):
        return (f"{what} takes at most {limit} positional arguments in megatron-core {release} (the release in "
                f"use), got {got}; pass the rest by keyword")
    return (f"{what} got {got} positional arguments, but beyond the first {limit} megatron-core's releases bind "
            f"them to different parameters and the release in use ({release}) is not one parallel_state knows "
            f"({', '.join(KNOWN)}): pass them by keyword, or set {ENV} to the release whose order you mean")
