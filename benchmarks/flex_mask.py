"""A ``cp.Mask`` as FlexAttention's block mask: every peer that runs ``flex_attention`` builds it here."""

from __future__ import annotations

from typing import Any


def block_mask(mask: Any, length: int, device: Any) -> Any:
    """``create_block_mask`` for ``mask`` (a ``cp.Mask``) on ``length`` tokens, batch and heads broadcast: its
    mask_mod reads the mask's key ranges as tensors (query i may attend keys lo[i] <= j < hi[i]; one interval per
    query for every mask kind), so the compiled kernel takes them as inputs."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    lo, hi = mask.key_range(torch.arange(length, device=device), length)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (lo[q_idx] <= kv_idx) & (kv_idx < hi[q_idx])

    return create_block_mask(mask_mod, 1, 1, length, length, device=device)
