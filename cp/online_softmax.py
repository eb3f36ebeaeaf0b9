"""The online-softmax merge: two attentions' normalized outputs and log-sum-exps over disjoint keys as one."""

from __future__ import annotations

import torch


def merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, blse: torch.Tensor) -> None:
    """Merge ``out`` [..., R, Dv] / ``blse`` [..., R] into ``acc`` / ``lse`` in place (``out`` is scaled in place)."""
    new = torch.logaddexp(lse, blse)
    acc.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(out.mul_(torch.exp(blse - new).unsqueeze(-1)))
    lse.copy_(new)


__all__ = ["merge"]
