"""Errors for megatron-core's bare ``assert`` and ``ValueError`` preconditions.

Code written against megatron-core may catch ``AssertionError`` (or ``ValueError``) around a
call; these types keep such code working while still being a ``ParallelStateError`` with a
message that says what was wrong and what to do.
"""

from __future__ import annotations

from parallel_state.errors import ParallelStateError


class ParallelStateAssertionError(ParallelStateError, AssertionError):
    """Raised where megatron-core asserts a precondition; both an AssertionError and a ParallelStateError."""


class ParallelStateValueError(ParallelStateError, ValueError):
    """Raised where megatron-core raises ValueError; both a ValueError and a ParallelStateError."""
