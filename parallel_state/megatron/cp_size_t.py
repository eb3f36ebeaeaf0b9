"""``find_split`` and the ``cp_size_t`` it records, in ``parallel_state`` and in megatron-core's module.

The arithmetic is ``topology.split.split_latent``; this module keeps megatron-core's global: the
temporal factor lives as ``parallel_state.cp_size_t`` (and ``megatron.core.parallel_state.cp_size_t``
when that module is loaded) until the next ``destroy_model_parallel()``.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from parallel_state.groups.state import register_teardown_hook
from parallel_state.topology.split import split_latent

_MEGATRON = "megatron.core.parallel_state"
# The package is always loaded before any of its submodules, so it is read from sys.modules: an
# import of ``parallel_state`` here would run upward, from this layer to the package's __init__.
_PACKAGE = "parallel_state"


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
    per_rank, cp_t = split_latent(shape, cp_size, patch_values, view_factor)
    import torch

    _record_cp_size_t(cp_t)
    return torch.Size(per_rank)


def _record_cp_size_t(value: int) -> None:
    sys.modules[_PACKAGE].cp_size_t = value
    mirror_cp_size_t()


def mirror_cp_size_t() -> None:
    """Copy ``parallel_state.cp_size_t`` (when set) to megatron-core's module, when that is loaded."""
    pkg = sys.modules.get(_PACKAGE)
    megatron = sys.modules.get(_MEGATRON)
    if pkg is None or megatron is None or "cp_size_t" not in vars(pkg):
        return
    megatron.cp_size_t = pkg.cp_size_t


def _forget_cp_size_t() -> None:
    # destroy_model_parallel() removes cp_size_t, ours and megatron-core's copy, so that a rebuilt
    # topology never reads a stale value.
    for name in (_PACKAGE, _MEGATRON):
        module = sys.modules.get(name)
        if module is not None and "cp_size_t" in vars(module):
            delattr(module, "cp_size_t")


register_teardown_hook(_forget_cp_size_t)
