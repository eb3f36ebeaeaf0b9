"""The demo's model: a small video DiT in plain torch (patchify, 3-D rotary embedding, one register
token, blocks of context-parallel self-attention and MLP, unpatchify).

The same code runs context-parallel (this rank's latent shard, its part of the rotary table and an
``Attention`` over the cp groups) and in one process (``attn=None``, the whole latent): the demo
compares the two. Attention sees the whole sequence either way (``cp.usp_attention``: Ulysses over
one group, a ring over the other), and it does not care in which order the tokens come as long as
each token carries its own rotary position, so a rank's tokens may stay in its shard's raster order
while the one-process run uses the whole grid's. A learned register token (no position: the identity
rotation) goes first in the sequence, so cp rank 0 holds one token more than the others and the
token count is odd: the shards are uneven, as ``cp.shard_sizes`` cuts them.

The autoregressive variant (a ``cp.Mask`` such as chunk-causal over frames) has no register token:
every rank holds the tokens a balanced ``cp.DispatchPlan`` gives it (``cp.dispatch``; the rotary
angles follow them through ``plan.index``) and attends under the mask (``usp(..., plan=plan)``);
the one-process reference attends under the mask's dense matrix.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

import cp

HEAD_DIM = 16
#: How many of a head's dims the t, h and w positions rotate (each even: rotations act on pairs).
ROPE_SPLIT = (4, 6, 6)
ROPE_THETA = 10000.0
MLP_RATIO = 4
#: The one-process reference attends over every token: past this many, the demo embeds bigger patches.
MAX_TOKENS = 4096


@dataclass(frozen=True)
class DiTConfig:
    channels: int
    patch: tuple[int, int, int]   # the token patch (pT, pH, pW)
    heads: int                    # Ulysses takes gcd(heads, cp) of the cp ranks, the ring the rest
    blocks: int

    @property
    def dim(self) -> int:
        return self.heads * HEAD_DIM

    @property
    def patch_dim(self) -> int:
        return self.channels * math.prod(self.patch)


def token_patch(per_rank: tuple[int, int, int], whole: tuple[int, int, int], patch: tuple[int, int, int],
                max_tokens: int = MAX_TOKENS) -> tuple[int, int, int]:
    """The DiT's patch: ``patch`` with its H and W sides doubled, largest token axis first, until the
    whole latent ``whole`` (T, H, W) has at most ``max_tokens`` tokens or no side can double and still
    tile this rank's shard ``per_rank`` (T', H', W). Full attention costs tokens squared; on a CPU the
    one-process check must stay cheap.
    """
    pt, ph, pw = patch
    while True:
        tokens = (whole[0] // pt) * (whole[1] // ph) * (whole[2] // pw)
        if tokens <= max_tokens:
            break
        # Double the side with more tokens per rank, if that side still tiles the shard evenly.
        options = sorted(((per_rank[1] // ph, 1), (per_rank[2] // pw, 2)), reverse=True)
        for count, axis in options:
            if count % 2 == 0:
                ph, pw = (ph * 2, pw) if axis == 1 else (ph, pw * 2)
                break
        else:
            break
    return pt, ph, pw


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, tokens, C * pT * pH * pW], tokens in (t, h, w) raster order."""
    b, c, t, h, w = x.shape
    pt, ph, pw = patch
    x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, (t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, patch: tuple[int, int, int], grid: tuple[int, int, int],
               channels: int) -> torch.Tensor:
    """The inverse of patchify for a token grid of ``grid`` (t, h, w)."""
    b = tokens.shape[0]
    (pt, ph, pw), (gt, gh, gw) = patch, grid
    x = tokens.reshape(b, gt, gh, gw, channels, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, channels, gt * pt, gh * ph, gw * pw)


def rope_table(grid: tuple[int, int, int]) -> torch.Tensor:
    """The rotary angles' cos and sin for every token of the whole grid: [1, HEAD_DIM, t, h, w].

    Channels 0..HEAD_DIM/2-1 are cos, the rest sin, one per rotated pair; laid out like a latent so
    the demo shards it exactly as it shards the latent.
    """
    angles = []
    for size, dims, axis in zip(grid, ROPE_SPLIT, range(3), strict=True):
        freqs = ROPE_THETA ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        a = torch.arange(size, dtype=torch.float64)[:, None] * freqs            # [size, dims/2]
        shape = [1, 1, 1, dims // 2]
        shape[axis] = size
        angles.append(a.reshape(shape).expand(*grid, dims // 2))
    a = torch.cat(angles, dim=-1)                                                  # [t, h, w, HEAD_DIM/2]
    table = torch.cat([a.cos(), a.sin()], dim=-1).to(torch.float32)
    return table.permute(3, 0, 1, 2).unsqueeze(0).contiguous()


def rope_for_tokens(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [tokens, HEAD_DIM/2], for a table block [1, HEAD_DIM, t, h, w] in raster order."""
    flat = table.reshape(HEAD_DIM, -1).t()
    return flat[:, :HEAD_DIM // 2].contiguous(), flat[:, HEAD_DIM // 2:].contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of [B, S, H, HEAD_DIM] by its token's angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None], sin[None, :, None]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


#: Seconds spent in usp_attention's forward since the last reset (the demo's summary reports it).
attention_seconds = [0.0]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def usp(ulysses_group: Any, ring_group: Any, length: int | None, plan: Any = None) -> Attention:
    """Attention over the whole sequence of ``length`` tokens for [B, S, H, D] shards: ``cp.usp_attention``.

    With ``plan`` (a ``cp.DispatchPlan``): this rank holds the plan's tokens and attends under its mask.
    """
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if plan is not None:
            return cp.usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, plan=plan)
        return cp.usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, length=length)

    return attn


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One process: both groups of one."""
    return cp.usp_attention(q, k, v, ulysses_group=None, ring_group=None)


def dense_masked_attention(mask: Any, length: int) -> Attention:
    """One process under ``mask`` (a ``cp.Mask``): SDPA with the whole bool [length, length] matrix, the reference
    the masked context-parallel attention is checked against (the demo's sequences are a few thousand tokens)."""
    dense = mask.dense(length)

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp.sdpa_in_layout(q, k, v, attn_mask=dense)

    return attn


def register_rope(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The angles with the register token's first: the identity rotation (cos 1, sin 0), as it has no position."""
    return torch.cat([torch.ones_like(cos[:1]), cos]), torch.cat([torch.zeros_like(sin[:1]), sin])


def with_register(x: torch.Tensor, register: torch.Tensor) -> torch.Tensor:
    """[B, S, dim] tokens with the register token ([1, dim]) put first."""
    return torch.cat([register.expand(x.shape[0], 1, -1), x], dim=1)


class Block(nn.Module):
    """Pre-norm self-attention (3-D rotary, context-parallel over the cp groups) and MLP, both residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, MLP_RATIO * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(MLP_RATIO * dim, dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention | None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, HEAD_DIM).unbind(2)
        start = time.perf_counter()
        a = (attn or plain_attention)(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [B, S, H, Dh]
        attention_seconds[0] += time.perf_counter() - start
        x = x + self.proj(a.reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def build(cfg: DiTConfig, seed: int) -> nn.ModuleDict:
    """The whole model with weights from ``seed``: identical in every process that builds it."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.ModuleDict({
            "embed": nn.Linear(cfg.patch_dim, cfg.dim),
            "register": nn.Embedding(1, cfg.dim),  # its weight [1, dim] is the register token
            "blocks": nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.blocks)),
            "head": nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.patch_dim)),
        })


def run_blocks(model: nn.ModuleDict, blocks: range, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn: Attention | None) -> torch.Tensor:
    for i in blocks:
        x = model["blocks"][i](x, cos, sin, attn)
    return x
