"""The project's own exception and warning types."""

from __future__ import annotations


class ParallelStateError(RuntimeError):
    """Raised where megatron-core would assert: wrong lifecycle state or an invalid topology."""


class ParallelStateTypeError(ParallelStateError, TypeError):
    """An argument of the wrong type; both a TypeError and a ParallelStateError, so either catches it."""


class ParallelStateWarning(UserWarning):
    """Warns about use that works but is probably not what was meant."""


class ParallelStateAssertionError(ParallelStateError, AssertionError):
    """A broken precondition where megatron-core asserts (not initialized, initialized twice, a missing group).

    Also an AssertionError, so code written against megatron-core that catches AssertionError
    keeps working; the message still says what to do.
    """


class ParallelStateValueError(ParallelStateError, ValueError):
    """Raised where megatron-core raises ValueError; both a ValueError and a ParallelStateError."""
