"""SDPA in any layout: the sequence and head dims wherever the caller keeps them.

Shared by every attention method (Ulysses, ring, usp, masked), below all of them; the dims themselves
are checked with the rest of a call's arguments (``cp.inputs``).
"""

from __future__ import annotations

from typing import Any

import torch


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


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_dim: int = 1, head_dim: int = 2,
             **attn_kwargs: Any) -> torch.Tensor:
    """``sdpa_in_layout`` for K/V with fewer heads than q (GQA / MQA): query head i meets K/V head
    i // (q heads / K/V heads), the K/V heads repeated (torch 2.4, this package's floor, has no ``enable_gqa``;
    repeat_interleave's backward sums the copies' gradients). One process's attention wherever cp needs it."""
    groups = q.shape[head_dim] // k.shape[head_dim]
    if groups > 1:
        k, v = (x.repeat_interleave(groups, dim=head_dim) for x in (k, v))
    return sdpa_in_layout(q, k, v, seq_dim=seq_dim, head_dim=head_dim, **attn_kwargs)
