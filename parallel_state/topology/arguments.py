"""Argument checks shared by the public functions: each names the argument and what to pass.

A wrong type raises ParallelStateTypeError (a TypeError that is also a ParallelStateError); a
value of the right type that cannot work raises ParallelStateError.
"""

from __future__ import annotations

import datetime
import operator
from typing import Any

from parallel_state.errors import ParallelStateError, ParallelStateTypeError


def _type_name(value: object) -> str:
    return type(value).__name__


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (numpy integers included) and not a bool."""
    if isinstance(value, bool) or _type_name(value) in ("bool_", "bool"):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1, or an error that names ``name``."""
    if not is_int(value):
        raise ParallelStateTypeError(f"{name} must be a positive int, got {value!r} ({_type_name(value)})")
    number = operator.index(value)  # type: ignore[arg-type]
    if number < 1:
        raise ParallelStateError(f"{name} must be >= 1, got {number}")
    return number


def optional_positive_int(name: str, value: object) -> int | None:
    """``value`` as None or an int >= 1."""
    return None if value is None else positive_int(name, value)


def non_negative_int(name: str, value: object) -> int:
    """``value`` as an int >= 0."""
    if not is_int(value):
        raise ParallelStateTypeError(f"{name} must be an int >= 0, got {value!r} ({_type_name(value)})")
    number = operator.index(value)  # type: ignore[arg-type]
    if number < 0:
        raise ParallelStateError(f"{name} must be >= 0, got {number}")
    return number


def flag(name: str, value: object) -> bool:
    """``value`` as a bool; a string such as ``"False"`` is truthy, so only real bools pass."""
    if value is True or value is False:
        return value  # type: ignore[return-value]
    if _type_name(value) == "bool_":  # numpy's bool
        return bool(value)
    raise ParallelStateTypeError(f"{name} must be True or False, got {value!r} ({_type_name(value)})")


def optional_str(name: str, value: object, example: str) -> str | None:
    """``value`` as None or a str."""
    if value is None or isinstance(value, str):
        return value
    raise ParallelStateTypeError(f"{name} must be a str such as {example!r} or None, got {value!r} ({_type_name(value)})")


def optional_str_list(name: str, value: object, example: str) -> list[str] | None:
    """``value`` as None or a list/tuple of str."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ParallelStateTypeError(f"{name} must be a list of str such as [{example!r}] or None, got {value!r}")


def timeout_of(timeout: object, minutes: object) -> datetime.timedelta:
    """The groups' timeout: ``timeout`` when given, else ``minutes`` (Megatron's distributed_timeout_minutes)."""
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)):
        raise ParallelStateTypeError(
            f"distributed_timeout_minutes must be a positive number, got {minutes!r} ({_type_name(minutes)})"
        )
    if not minutes > 0:
        raise ParallelStateError(f"distributed_timeout_minutes must be a positive number, got {minutes!r}")
    if timeout is None:
        return datetime.timedelta(minutes=minutes)
    return positive_timedelta("timeout", timeout)


def positive_timedelta(name: str, value: object) -> datetime.timedelta:
    """``value`` as a positive datetime.timedelta, or an error that names ``name``."""
    if not isinstance(value, datetime.timedelta):
        raise ParallelStateTypeError(
            f"{name} must be a positive datetime.timedelta such as datetime.timedelta(seconds=30), "
            f"got {value!r} ({_type_name(value)})"
        )
    if value.total_seconds() <= 0:
        raise ParallelStateError(f"{name} must be a positive datetime.timedelta, got {value!r}")
    return value


def optional_callable(name: str, value: Any) -> Any:
    """``value`` as None or a callable."""
    if value is None or callable(value):
        return value
    raise ParallelStateTypeError(f"{name} must be a function or None, got {value!r} ({_type_name(value)})")
