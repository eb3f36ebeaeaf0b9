"""``find_split``: how context parallelism divides a video latent, and the ``cp_size_t`` it records.

Pure integer arithmetic: usable before, after or without process groups. The temporal axis is
split first because a temporal split keeps every frame whole; what is left of ``cp_size`` splits
the height; the width is never split.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import Any, Sequence

from parallel_state.groups.state import register_teardown_hook

_MEGATRON = "megatron.core.parallel_state"


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


def find_split(
    shape: Sequence[int],
    cp_size: int,
    patch_values: Sequence[int] = (1, 2, 2),
    view_factor: int = 1,
) -> Any:
    """Split a [B, C, T, H, W] latent over ``cp_size`` context-parallel ranks; return ``torch.Size([T', H', W])``.

    The temporal factor is ``gcd(T // view_factor // pT, cp_size)``; the rest of ``cp_size``
    must divide the patched height ``H // pH`` and splits it; the width is never split.
    ``T' = (T // view_factor) // temporal factor`` and ``H' = H // height factor`` are per-rank
    sizes in latent (unpatched) units. Records the temporal factor as ``parallel_state.cp_size_t``
    (and ``megatron.core.parallel_state.cp_size_t`` when that module is loaded) until the next
    ``destroy_model_parallel()``. Raises ValueError for a shape that is not 5-D, T not divisible
    by ``view_factor``, T or H not divisible by their patch size, ``cp_size`` < 1, or a plan that
    would have to split the width; TypeError for non-integers.
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
    import torch

    _record_cp_size_t(cp_t)
    return torch.Size([t_view // cp_t, h // cp_h, w])


def _record_cp_size_t(value: int) -> None:
    import parallel_state

    parallel_state.cp_size_t = value
    mirror_cp_size_t()


def mirror_cp_size_t() -> None:
    """Copy ``parallel_state.cp_size_t`` (when set) to megatron-core's module, when that is loaded."""
    pkg = sys.modules.get("parallel_state")
    megatron = sys.modules.get(_MEGATRON)
    if pkg is None or megatron is None or "cp_size_t" not in vars(pkg):
        return
    megatron.cp_size_t = pkg.cp_size_t


def _forget_cp_size_t() -> None:
    # destroy_model_parallel() removes cp_size_t, ours and megatron-core's copy, so that a rebuilt
    # topology never reads a stale value.
    for name in ("parallel_state", _MEGATRON):
        module = sys.modules.get(name)
        if module is not None and "cp_size_t" in vars(module):
            delattr(module, "cp_size_t")


register_teardown_hook(_forget_cp_size_t)
