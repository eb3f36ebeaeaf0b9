"""The layout of attention tensors: which dims are the sequence and the heads, and SDPA in any layout.

Shared by every attention method (Ulysses, ring, usp, masked), below all of them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cp.shard import check_tensor, normalize_dim


def _check_length(what: str, length: Any, n: int) -> int:
    """``length`` as an int of at least ``n``; TypeError/ValueError (the same on every rank) otherwise."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"{what}: length must be an int (the full sequence length over the group) or None, "
                        f"got {type(length).__name__} {length!r}")
    if length < n:
        raise ValueError(f"{what}: length={length} is shorter than the group of size {n}: every rank needs at "
                         f"least one token; use a group of at most {length} ranks or a longer sequence")
    return length


def _check_dims(what: str, x: Any, name: str, seq_dim: Any, head_dim: Any, n: int) -> tuple[int, int]:
    """Type- and range-check one tensor's dims; the normalized (seq_dim, head_dim)."""
    check_tensor(what, x, name)
    label = what if name == "x" else f"{what}, {name}"
    s = normalize_dim(label, x.shape, seq_dim, n, "seq_dim")
    h = normalize_dim(label, x.shape, head_dim, n, "head_dim")
    if s == h:
        raise ValueError(f"{what}: seq_dim={seq_dim} and head_dim={head_dim} both name dim {s} of {name}'s shape "
                         f"{tuple(x.shape)}; pass the sequence dimension and the head dimension, which must differ")
    return s, h


def sdpa_in_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_dim: int = 1, head_dim: int = 2,
                   **attn_kwargs: Any) -> torch.Tensor:
    """torch's scaled_dot_product_attention on tensors laid out with the given sequence and head dims.

    SDPA wants [..., H, S, D]: the two dims move there (the remaining last dim is the feature dim, the
    others are batch), attention runs, and the output moves back to q's layout.
    """
    dims = (head_dim % q.dim(), seq_dim % q.dim())
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.movedim(dims, (-3, -2)) for t in (q, k, v)), **attn_kwargs)
    return out.movedim((-3, -2), dims)


def _scale(what: str, softmax_scale: Any, feature: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(feature)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"{what}: softmax_scale must be a positive number or None (1/sqrt(feature dim)), got "
                         f"{softmax_scale!r}")
    return float(softmax_scale)
