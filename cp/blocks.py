"""One block of attention and its backward, the kernels of every blockwise method (ring, masked).

A block is a set of query rows against a set of keys; its result is normalized within the block and
comes with its log-sum-exp, so blocks merge by the online softmax. Rows are one K/V head's
``groups`` query heads side by side ([..., Hkv, G * rows, D]), so GQA repeats nothing.

On a CPU, when q, k and v have one feature size, a block runs torch's fused attention kernel (which
returns the log-sum-exp the merge needs); anywhere else it runs as plain matmuls that hold the
block's scores. Sums are kept in float32 (float64 inputs in float64).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where scores, softmax statistics and gradient sums are accumulated."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _p2p(ops: list[Any]) -> list[Any]:
    """Start a batch of point-to-point ops (none is fine); their works."""
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


#: torch's fused CPU attention that also returns the log-sum-exp (a private op, so looked up, not assumed).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor, v: torch.Tensor, allow: bool) -> bool:
    """Whether this block can use the fused CPU kernel (``allow``ed, and it wants one feature size for q, k and v)."""
    return (allow and q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and _CPU_FLASH is not None
            and _CPU_FLASH_BACKWARD is not None)


def _flat4(x: torch.Tensor) -> torch.Tensor:
    """[..., H, S, D] as [B, H, S, D], the fused kernel's layout."""
    return x.reshape(-1, *x.shape[-3:])


def _mask_args(mask: torch.Tensor | None, groups: int, dtype: torch.dtype, diag: bool) -> tuple[bool, torch.Tensor | None]:
    """The fused kernel's (is_causal, attn_mask): for the diagonal block's causal mask (``diag``) its own
    causal flag when the rows are one query head's; else an additive mask."""
    if mask is None or (diag and groups == 1):
        return mask is not None, None
    return False, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                   groups: int, fused: bool, diag: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention, normalized within the block, and its log-sum-exp ([..., rows]).

    ``mask``: True where a query row must not see a key; every row must see at least one key.
    ``fused``: may use torch's fused CPU kernel. ``diag``: the mask is the causal one of a square block
    (the fused kernel then takes its own flag).
    """
    if _fused(q, v, fused):
        causal, attn_mask = _mask_args(mask, groups, q.dtype, diag)
        out, lse = _CPU_FLASH(_flat4(q), _flat4(k), _flat4(v), 0.0, causal, attn_mask=attn_mask, scale=scale)
        return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    m = s.amax(-1, keepdim=True)  # finite: every query sees at least one key (in the diagonal block, itself)
    p = torch.exp_(s.sub_(m))
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v).div_(total)
    return out, m.add_(total.log_()).squeeze(-1)


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, scale: float, mask: torch.Tensor | None,
                    groups: int, fused: bool, diag: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's dq, dk, dv, given the whole attention's output and log-sum-exp (so the block's softmax is
    its share of the whole one) and ``delta`` = rowsum(do * out)."""
    if _fused(q, v, fused):
        causal, attn_mask = _mask_args(mask, groups, q.dtype, diag)
        dq, dk, dv = _CPU_FLASH_BACKWARD(_flat4(do), _flat4(q), _flat4(k), _flat4(v), _flat4(out),
                                         lse.reshape(-1, *lse.shape[-2:]), 0.0, causal, attn_mask=attn_mask,
                                         scale=scale)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    p = torch.exp_(s.sub_(lse.unsqueeze(-1)))  # the softmax itself, from the whole attention's log-sum-exp
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p.mul_(torch.matmul(do, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)))
    dq = torch.matmul(ds, k).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q).mul_(scale)
    return dq, dk, dv
