"""A square causal tile on a CPU as diagonal blocks and full tiles below them, each kind one batched kernel call.

The CPU's fused op (``aten._scaled_dot_product_flash_attention_for_cpu``) skips masked work only
in whole key blocks of up to 512 keys, so with its causal flag a square tile of 512 rows costs as
much as a full one (and its backward, with the mask applied per score, as much again). Cut the
tile's R rows into ``m = 2^L`` blocks of ``b = R / m``: the m diagonal blocks (b x b, causal) are
one call, their rows and keys the batch; then for each level l = 1 .. L, with s = R / 2^l, the
second half of every run of 2s rows sees the first half's s keys fully: 2^(l-1) full s x s tiles,
one call. That computes about R^2 / 2 + R b / 2 scores instead of R^2 (at R = 512, b = 128:
forward about 0.8x, backward about 0.55x the single causal call on one core). Results merge by the
online softmax (forward); the backward adds each call's dq, dk and dv at their rows and keys.

Tensors are 4-d, [B, H, R, D] (K/V heads may be fewer: the op takes GQA itself).
"""

from __future__ import annotations

from typing import Any

import torch

from cp import online_softmax

#: Causal tiles of at least this many rows are split (below it the single call is as fast, forward).
MIN_ROWS = 512
#: The diagonal blocks' rows: halved while above this (fewer rows cost more per score than they save).
BLOCK_ROWS = 128


def blocks_for(rows: int) -> int:
    """How many diagonal blocks a causal tile of ``rows`` rows is cut into (1: not cut): a power of two
    dividing ``rows``, halving the blocks while they are longer than BLOCK_ROWS."""
    m = 1
    if rows < MIN_ROWS:
        return m
    while rows % (2 * m) == 0 and rows // m > BLOCK_ROWS:
        m *= 2
    return m


def _diag(x: torch.Tensor, m: int) -> torch.Tensor:
    """[B, H, R, ...] -> [B * m, H, R / m, ...]: the m row blocks as the batch."""
    b, h, r = x.shape[:3]
    return x.reshape(b, h, m, r // m, *x.shape[3:]).transpose(1, 2).reshape(b * m, h, r // m, *x.shape[3:])


def _undiag(x: torch.Tensor, b: int) -> torch.Tensor:
    """The inverse of ``_diag`` for a batch of ``b``."""
    bm, h, s = x.shape[:3]
    return x.reshape(b, bm // b, h, s, *x.shape[3:]).transpose(1, 2).reshape(b, h, bm // b * s, *x.shape[3:])


def _halves(x: torch.Tensor, s: int, which: int) -> torch.Tensor:
    """A view [B, H, R / 2s, s, ...]: the first (``which`` 0) or second (1) s rows of every run of 2s."""
    b, h, r = x.shape[:3]
    return x.view(b, h, r // (2 * s), 2, s, *x.shape[3:]).select(3, which)


def _batch(x: torch.Tensor) -> torch.Tensor:
    """A [B, H, n, s, ...] view as the kernel's [B * n, H, s, ...]."""
    return x.transpose(1, 2).flatten(0, 1)


def _unbatch(x: torch.Tensor, b: int) -> torch.Tensor:
    """The kernel's [B * n, H, s, ...] as [B, H, n, s, ...]."""
    return x.unflatten(0, (b, -1)).transpose(1, 2)


def _levels(rows: int, m: int) -> list[int]:
    """The full tiles' sizes s, one per level: R/2, R/4, ..., R/m."""
    return [rows >> level for level in range(1, m.bit_length())]


def forward(op: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, m: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal tile's normalized output [B, H, R, Dv] and log-sum-exp [B, H, R] by ``op`` (the CPU's fused
    forward), in ``m`` diagonal blocks."""
    b, r = q.shape[0], q.shape[2]
    out, lse = op(_diag(q, m), _diag(k, m), _diag(v, m), 0.0, True, scale=scale)
    out, lse = _undiag(out, b).to(lse.dtype), _undiag(lse, b)  # merged below: in the statistics' float32 (float64)
    for s in _levels(r, m):
        o2, l2 = op(_batch(_halves(q, s, 1)), _batch(_halves(k, s, 0)), _batch(_halves(v, s, 0)), 0.0, False,
                    scale=scale)
        o2, l2 = _unbatch(o2, b), _unbatch(l2, b)
        online_softmax.merge(_halves(out, s, 1), _halves(lse, s, 1), o2, l2)
    return out, lse


def backward(op: Any, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the causal tile by ``op`` (the CPU's fused backward), given the whole attention's ``out`` and
    ``lse`` at the tile's rows, in ``m`` diagonal blocks."""
    b, r = q.shape[0], q.shape[2]
    grads = op(_diag(do, m), _diag(q, m), _diag(k, m), _diag(v, m), _diag(out, m), _diag(lse, m), 0.0, True,
               scale=scale)
    dq, dk, dv = (_undiag(g, b) for g in grads)
    for s in _levels(r, m):
        gq, gk, gv = op(_batch(_halves(do, s, 1)), _batch(_halves(q, s, 1)), _batch(_halves(k, s, 0)),
                        _batch(_halves(v, s, 0)), _batch(_halves(out, s, 1)), _batch(_halves(lse, s, 1)), 0.0,
                        False, scale=scale)
        _halves(dq, s, 1).add_(_unbatch(gq, b))
        _halves(dk, s, 0).add_(_unbatch(gk, b))
        _halves(dv, s, 0).add_(_unbatch(gv, b))
        del gq, gk, gv  # before the next level's call allocates its own
    return dq, dk, dv


__all__ = ["BLOCK_ROWS", "MIN_ROWS", "backward", "blocks_for", "forward"]
