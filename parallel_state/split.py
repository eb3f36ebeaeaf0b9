"""``find_split``: how context parallelism divides a video latent, and the ``cp_size_t`` it records.

Pure integer arithmetic: usable before, after or without process groups. The temporal axis is
split first because a temporal split keeps every frame whole; what is left of ``cp_size`` splits
the height; the width is never split.
"""

from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from parallel_state.state import register_teardown_hook

_MEGATRON = "megatron.core.parallel_state"


def _int(name: str, value: Any, what: str = "find_split") -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an int, got {value!r}") from None


def _ints(name: str, values: Any, expected: str, what: str = "find_split") -> list[int]:
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{what}: {name} must be {expected}, got {values!r}") from None
    return [_int(f"{name}[{i}]", v, what) for i, v in enumerate(items)]


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


@dataclass(frozen=True)
class Latent:
    """A checked [B, C, T, H, W] latent with its patch sizes: what find_split and the planner split."""

    shape: tuple[int, int, int, int, int]
    patch: tuple[int, int, int]
    view_factor: int
    #: T of one view (T // view_factor), and the patched T and H (the axes context parallelism splits).
    t_view: int
    t_patched: int
    h_patched: int


def check_latent(shape: Sequence[int], cp_size: int, patch_values: Sequence[int] = (1, 2, 2), view_factor: int = 1,
                 what: str = "find_split") -> tuple[Latent, int]:
    """Validate find_split's arguments (no side effects); the Latent and ``cp_size`` as an int.

    Raises ValueError / TypeError, prefixed with ``what``, exactly as find_split documents.
    """
    if hasattr(shape, "dim") and hasattr(shape, "shape"):  # a tensor, not its shape
        raise TypeError(f"{what}: pass the latent's shape (x.shape), not the tensor itself")
    dims = _ints("shape", shape, "a sequence of 5 ints [B, C, T, H, W]", what)
    if len(dims) != 5:
        raise ValueError(
            f"{what}: shape must be 5-D [B, C, T, H, W], got {len(dims)}-D shape {tuple(dims)}"
        )
    if any(d < 1 for d in dims):
        raise ValueError(f"{what}: every dimension of shape must be >= 1, got {tuple(dims)}")
    cp_size = _int("cp_size", cp_size, what)
    if cp_size < 1:
        raise ValueError(f"{what}: cp_size must be >= 1, got {cp_size}")
    view_factor = _int("view_factor", view_factor, what)
    if view_factor < 1:
        raise ValueError(f"{what}: view_factor must be >= 1, got {view_factor}")
    patches = _ints("patch_values", patch_values, "three ints (pT, pH, pW)", what)
    if len(patches) != 3 or any(p < 1 for p in patches):
        raise ValueError(f"{what}: patch_values must be three ints >= 1 (pT, pH, pW), got {tuple(patches)}")

    _, _, t, h, w = dims
    p_t, p_h, _ = patches
    if t % view_factor:
        raise ValueError(
            f"{what}: T={t} is not divisible by view_factor={view_factor}; "
            f"each view must have the same number of latent frames"
        )
    t_view = t // view_factor
    if t_view % p_t or h % p_h:
        raise ValueError(
            f"{what}: the latent does not patch evenly: T/view_factor={t_view} by pT={p_t}, "
            f"H={h} by pH={p_h}; pad the latent or change patch_values"
        )
    latent = Latent(tuple(dims), tuple(patches), view_factor, t_view, t_view // p_t, h // p_h)  # type: ignore[arg-type]
    return latent, cp_size


def grid_split(latent: Latent, cp_size: int) -> tuple[int, int] | None:
    """find_split's factors (temporal, height) of ``cp_size`` for ``latent``; None when the width would
    have to be split. Pure arithmetic, no side effects."""
    cp_t = math.gcd(latent.t_patched, cp_size)
    left = cp_size // cp_t
    cp_h = math.gcd(latent.h_patched, left)
    return (cp_t, cp_h) if cp_h == left else None


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
    latent, cp_size = check_latent(shape, cp_size, patch_values, view_factor)
    factors = grid_split(latent, cp_size)
    if factors is None:
        cp_t = math.gcd(latent.t_patched, cp_size)
        left = cp_size // cp_t
        cp_h = math.gcd(latent.h_patched, left)
        raise ValueError(
            f"find_split: cp_size={cp_size} cannot split this latent without splitting the width: "
            f"the patched T={latent.t_patched} takes a factor {cp_t} and the patched H={latent.h_patched} takes "
            f"{cp_h} of the remaining {left}, leaving {left // cp_h}; cp sizes that work for shape "
            f"{latent.shape} with patch_values={latent.patch}, view_factor={latent.view_factor}: "
            f"{_working_cp_sizes(latent.t_patched, latent.h_patched, cp_size)}"
        )
    cp_t, cp_h = factors
    import torch

    _record_cp_size_t(cp_t)
    return torch.Size([latent.t_view // cp_t, latent.shape[3] // cp_h, latent.shape[4]])


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
