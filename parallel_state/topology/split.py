"""How context parallelism divides a video latent: the arithmetic behind ``find_split``.

Pure integer arithmetic: usable before, after or without process groups, and it records nothing
(``parallel_state.megatron.cp_size_t.find_split`` records the temporal factor as ``cp_size_t``).
The temporal axis is split first because a temporal split keeps every frame whole; what is left of
``cp_size`` splits the height; the width is never split.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"find_split: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"find_split: {name} must be an int, got {value!r}") from None


def _ints(name: str, values: Any, expected: str) -> list[int]:
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"find_split: {name} must be {expected}, got {values!r}") from None
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(items)]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _working_cp_sizes(t_patched: int, h_patched: int, cp_size: int) -> list[int]:
    """The cp sizes near ``cp_size`` that split this shape without touching the width.

    A cp size works exactly when it is (a divisor of the patched T) * (a divisor of the patched H).
    """
    sizes = sorted({a * b for a in _divisors(t_patched) for b in _divisors(h_patched)})
    below = [c for c in sizes if c < cp_size][-6:]
    above = [c for c in sizes if c > cp_size][:3]
    return below + above


def split_latent(
    shape: Sequence[int],
    cp_size: int,
    patch_values: Sequence[int] = (1, 2, 2),
    view_factor: int = 1,
) -> tuple[tuple[int, int, int], int]:
    """``find_split``'s answer without recording it: the per-rank ``(T', H', W)`` and the temporal factor.

    Same rule and same errors as :func:`parallel_state.find_split`.
    """
    if hasattr(shape, "dim") and hasattr(shape, "shape"):  # a tensor, not its shape
        raise TypeError("find_split: pass the latent's shape (x.shape), not the tensor itself")
    dims = _ints("shape", shape, "a sequence of 5 ints [B, C, T, H, W]")
    if len(dims) != 5:
        raise ValueError(
            f"find_split: shape must be 5-D [B, C, T, H, W], got {len(dims)}-D shape {tuple(dims)}"
        )
    if any(d < 1 for d in dims):
        raise ValueError(f"find_split: every dimension of shape must be >= 1, got {tuple(dims)}")
    cp_size = _int("cp_size", cp_size)
    if cp_size < 1:
        raise ValueError(f"find_split: cp_size must be >= 1, got {cp_size}")
    view_factor = _int("view_factor", view_factor)
    if view_factor < 1:
        raise ValueError(f"find_split: view_factor must be >= 1, got {view_factor}")
    patches = _ints("patch_values", patch_values, "three ints (pT, pH, pW)")
    if len(patches) != 3 or any(p < 1 for p in patches):
        raise ValueError(f"find_split: patch_values must be three ints >= 1 (pT, pH, pW), got {tuple(patches)}")

    _, _, t, h, w = dims
    p_t, p_h, _ = patches
    if t % view_factor:
        raise ValueError(
            f"find_split: T={t} is not divisible by view_factor={view_factor}; "
            f"each view must have the same number of latent frames"
        )
    t_view = t // view_factor
    if t_view % p_t or h % p_h:
        raise ValueError(
            f"find_split: the latent does not patch evenly: T/view_factor={t_view} by pT={p_t}, "
            f"H={h} by pH={p_h}; pad the latent or change patch_values"
        )
    t_patched, h_patched = t_view // p_t, h // p_h
    cp_t = math.gcd(t_patched, cp_size)
    left = cp_size // cp_t
    cp_h = math.gcd(h_patched, left)
    if cp_h != left:
        raise ValueError(
            f"find_split: cp_size={cp_size} cannot split this latent without splitting the width: "
            f"the patched T={t_patched} takes a factor {cp_t} and the patched H={h_patched} takes "
            f"{cp_h} of the remaining {left}, leaving {left // cp_h}; cp sizes that work for shape "
            f"{tuple(dims)} with patch_values={tuple(patches)}, view_factor={view_factor}: "
            f"{_working_cp_sizes(t_patched, h_patched, cp_size)}"
        )
    return (t_view // cp_t, h // cp_h, w), cp_t
