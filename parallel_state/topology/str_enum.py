"""``StrEnum``: the base of every closed set of names in ``parallel_state`` (dimensions, answer facts, ...).

A member is its name as a ``str`` (``Dim.TP == "tp"``, same hash), so it keys the dicts that
plain names key and formats as the name; a misspelt member is an AttributeError where the
module naming it is imported, not a KeyError when the name is first looked up. Python 3.11's
``enum.StrEnum``; on 3.10 (which lacks it) the same behaviour on ``(str, Enum)``. ``one_of`` turns a
string an API was given into the member, at the boundary.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any, Sequence, TypeVar

from parallel_state.errors import ParallelStateValueError

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10
    class StrEnum(str, Enum):
        """A member is its value, a ``str``; ``str()`` and formatting give the value, as on Python 3.11."""

        __str__ = str.__str__
        __format__ = str.__format__

T = TypeVar("T", bound=str)


def one_of(what: str, name: str, value: Any, allowed: Sequence[T], tail: str = "") -> T:
    """The entry of ``allowed`` (members, or plain strings such as a request's "auto") that ``value`` equals: a
    member given as its string comes back as the member. ValueError listing the allowed values as plain strings
    (then ``tail``) for anything else."""
    for entry in allowed:
        if value == entry:
            return entry
    shown = repr(value.value if isinstance(value, Enum) else value)  # as the user would type it
    raise ParallelStateValueError(f"{what}: {name}={shown} is not one of {tuple(str(e) for e in allowed)}{tail}")


__all__ = ["StrEnum", "one_of"]
