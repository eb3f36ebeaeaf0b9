"""The kernel of one attention tile: which fused op computes it, and the calls (forward and backward).

A tile is ``R`` query rows of every query head against ``C`` keys of one block. Its result is
normalized within the tile and comes with its log-sum-exp, so tiles merge by the online softmax;
its backward takes the whole attention's output and log-sum-exp (the tile's softmax is then its
share of the whole one). Three kinds of tile (``cp.mask_schedule.Tile.kind``):

- ``"full"``: every pair allowed; no mask is built.
- ``"causal"``: square (``R == C``), row i sees keys 0..i; the kernel's own causal flag (top-left
  and bottom-right alignment coincide on a square, so the flash op's top-left flag is exact). On a
  CPU a tile of 512 rows or more is cut into diagonal blocks and full tiles below them
  (``cp.diagonal``; ``KernelChoice.diagonal_blocks``): the CPU op skips masked work only in whole
  key blocks of 512, the CUDA ops skip it at their own tile size, so they take the flag whole.
- ``"masked"``: each row sees one interval of the keys; a [R, C] mask from the intervals.

``choose_kernel`` is a pure function of the device type, the card (its compute capability), dtype, shapes and
tile kind, so the choice for every card is tested without one. On CUDA the card sets the order (``cuda_order``,
as SDPA itself prefers its kernels there), and the first that takes the tile and torch's switches
(``torch.backends.cuda.enable_*_sdp``, ``sdpa_kernel``) allow runs:

| card (compute capability) | full and causal tiles | masked tiles |
|---|---|---|
| Hopper, Blackwell (9.0 and later) | cuDNN, flash, efficient (GQA: flash first) | efficient, cuDNN |
| Ampere, Ada (8.x) | flash, efficient, cuDNN | efficient, cuDNN |
| before 8.0 | efficient | efficient |

What each kernel takes:

- ``cuda_flash`` (``aten._scaled_dot_product_flash_attention``): float16 / bfloat16, one feature size
  for q, k and v, a multiple of 8 up to 256; full and causal tiles; GQA natively.
- ``cuda_efficient`` (``aten._scaled_dot_product_efficient_attention``): also float32, v's feature size
  free (both a multiple of 8, 4 for float32); masked tiles by an additive float bias; K/V heads
  repeated for GQA. Left out under ``torch.use_deterministic_algorithms(True)`` (torch documents its
  backward as non-deterministic).
- ``cuda_cudnn`` (``aten._scaled_dot_product_cudnn_attention``): float16 / bfloat16, one feature size, a
  multiple of 8 up to 128; bias for masked tiles; K/V heads repeated for GQA (so GQA tiles try flash first on
  every card). Left out under ``torch.use_deterministic_algorithms(True)``, as SDPA leaves it out.

Every CUDA backward op gets its dropout seed and offset (``philox_state``) where torch's own forward puts them:
on the device for flash and cuDNN, on the host for memory-efficient.

On a CPU, ``cpu_flash`` (``aten._scaled_dot_product_flash_attention_for_cpu``) takes every tile kind
(masked ones by an additive mask) when q, k and v have one feature size, in the inputs' dtype (half inputs
accumulate in float32 inside the op, as SDPA runs it). Everything else runs ``math``, the reference: plain
matmuls that hold the tile's scores, e.g. float64 on CUDA, feature sizes of q/k and v that differ
(flash, cuDNN, CPU), or not a multiple of 8 (4) on CUDA, head dims above 256 with no other kernel.
Statistics are float32 for float16 / bfloat16 / float32 inputs (float64 for float64): every fused
op returns a float32 log-sum-exp, and the merge accumulates in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

import parallel_state
from cp import diagonal


class Name(parallel_state.StrEnum):
    """A member of one of cp's closed sets of names: a ``str`` equal to its value, which it formats as (on
    Python 3.10 as on 3.11+), so a misspelt member fails where it is read, not when a string is compared."""


class TileKind(Name):
    """How a tile's (query, key) pairs are allowed (``cp.mask_schedule.Tile.kind``)."""

    FULL = "full"
    CAUSAL = "causal"
    MASKED = "masked"


class Kernel(Name):
    """The op that computes a tile."""

    CPU_FLASH = "cpu_flash"
    CUDA_FLASH = "cuda_flash"
    CUDA_EFFICIENT = "cuda_efficient"
    CUDA_CUDNN = "cuda_cudnn"
    MATH = "math"


class HeadLayout(Name):
    """How a kernel's query heads meet the K/V heads (GQA)."""

    HEADS = "heads"    # q [B, Hq, R, D] against K/V [B, Hkv, C, D]: the kernel takes GQA itself
    EXPAND = "expand"  # K/V heads repeated to q's, their gradients summed back
    ROWS = "rows"      # q [B, Hkv, G * R, D]: a K/V head's query heads as rows (the reference)


#: The CUDA kernels; each can be switched off as SDPA's own are. ``cuda_order`` says which is tried first on a card.
CUDA_KERNELS = (Kernel.CUDA_FLASH, Kernel.CUDA_EFFICIENT, Kernel.CUDA_CUDNN)
#: The card ``choose_kernel`` assumes when it is not told one: an Ampere (compute capability 8.0).
AMPERE = (8, 0)
_HALF = (torch.float16, torch.bfloat16)

#: Whether tiles may use fused kernels at all (tests switch it off to check the reference against them).
use_fused = True


@dataclass(frozen=True)
class KernelChoice:
    """How one tile is computed.

    ``name``: the kernel. ``dtype``: the dtype the kernel computes in (its inputs). ``layout``: how the query
    heads meet the K/V heads (``HeadLayout``).
    ``is_causal``: the kernel's own causal flag (square tiles). ``bias``: an additive float mask [R, C]
    built from the tile's intervals (-inf where masked). ``reason``: why ``math`` (else empty).
    ``diagonal_blocks``: a causal tile computed as that many diagonal blocks and the full tiles below
    them (``cp.diagonal``; read by ``cpu_flash`` only; 1: one call with the causal flag).
    """

    name: Kernel
    dtype: torch.dtype
    layout: HeadLayout
    is_causal: bool = False
    bias: bool = False
    reason: str = ""
    diagonal_blocks: int = 1

    def __post_init__(self) -> None:  # names given as strings become the members (a misspelt one a ValueError)
        object.__setattr__(self, "name", Kernel(self.name))
        object.__setattr__(self, "layout", HeadLayout(self.layout))

    @property
    def needs_mask(self) -> bool:
        """Whether the kernel takes the tile's bool mask: the reference always (causal tiles too), a fused one as
        a bias."""
        return self.name is Kernel.MATH or self.bias


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where scores, softmax statistics and gradient sums are accumulated."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cuda_kernels_enabled() -> frozenset[Kernel]:
    """The CUDA kernels torch's SDPA switches allow now (``torch.backends.cuda.enable_*_sdp``, ``sdpa_kernel``)."""
    b = torch.backends.cuda
    on = {Kernel.CUDA_FLASH: b.flash_sdp_enabled(), Kernel.CUDA_EFFICIENT: b.mem_efficient_sdp_enabled(),
          Kernel.CUDA_CUDNN: getattr(b, "cudnn_sdp_enabled", lambda: False)()}
    return frozenset(k for k, v in on.items() if v)


def _cuda_fits(name: Kernel, dtype: torch.dtype, d: int, dv: int, kind: TileKind) -> str:
    """Why kernel ``name`` cannot take the tile ('' when it can)."""
    if name is Kernel.CUDA_FLASH:
        if dtype not in _HALF:
            return "flash takes float16 / bfloat16 only"
        if d != dv or d % 8 or d > 256:
            return f"flash wants one feature size for q, k and v, a multiple of 8 up to 256 (got {d} and {dv})"
        if kind is TileKind.MASKED:
            return "flash takes no mask"
        return ""
    if name is Kernel.CUDA_EFFICIENT:
        if dtype not in (*_HALF, torch.float32):
            return "efficient takes float16 / bfloat16 / float32"
        align = 4 if dtype == torch.float32 else 8
        if d % align or dv % align:
            return f"efficient wants feature sizes that are multiples of {align} (got {d} and {dv})"
        return ""
    if dtype not in _HALF:
        return "cuDNN takes float16 / bfloat16 only"
    if d != dv or d % 8 or d > 128:
        return f"cuDNN wants one feature size for q, k and v, a multiple of 8 up to 128 (got {d} and {dv})"
    return ""


def cuda_order(capability: tuple[int, int], tile_kind: TileKind, gqa: bool = False) -> tuple[Kernel, ...]:
    """The CUDA kernels in the order they are tried for a tile of ``tile_kind`` on a card of compute capability
    ``capability`` (major, minor), as SDPA itself prefers them there: on Hopper and later (9.0+) cuDNN's fused
    attention, then FlashAttention-2, then memory-efficient; on Ampere / Ada (8.x) FlashAttention-2 first;
    before 8.0 memory-efficient only (torch's flash and cuDNN kernels need 8.0). With fewer K/V heads than query
    heads (``gqa``) flash comes first on 9.0+ too: it reads the K/V heads as they are, where cuDNN's op here is
    given them repeated. Masked tiles (an additive bias, which flash does not take) try memory-efficient, then
    cuDNN, on every card."""
    if tuple(capability) < (8, 0):
        return (Kernel.CUDA_EFFICIENT,)
    if tile_kind is TileKind.MASKED:
        return (Kernel.CUDA_EFFICIENT, Kernel.CUDA_CUDNN)
    if tuple(capability) >= (9, 0) and not gqa:
        return (Kernel.CUDA_CUDNN, Kernel.CUDA_FLASH, Kernel.CUDA_EFFICIENT)
    return (Kernel.CUDA_FLASH, Kernel.CUDA_EFFICIENT, Kernel.CUDA_CUDNN)


@functools.lru_cache(maxsize=1024)
def choose_kernel(device_type: str, dtype: torch.dtype, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                  v_shape: tuple[int, ...], tile_kind: TileKind, *, deterministic: bool = False,
                  cuda_kernels: frozenset[str] = frozenset(CUDA_KERNELS), fused: bool = True,
                  capability: tuple[int, int] = AMPERE) -> KernelChoice:
    """The kernel for a tile of queries ``q_shape`` [..., Hq, R, D] against keys ``k_shape`` [..., Hkv, C, D]
    and values ``v_shape`` [..., Hkv, C, Dv] of ``dtype`` on ``device_type``; ``tile_kind`` a ``TileKind``.

    ``deterministic``: torch's deterministic-algorithms setting; ``cuda_kernels``: the CUDA kernels
    allowed (``cuda_kernels_enabled()``); ``fused=False``: always the reference; ``capability``: the CUDA
    card's compute capability (``cuda_order``; ``choose_for`` reads the inputs' device). Pure and cached.
    """
    if tile_kind not in set(TileKind):
        raise ValueError(f"choose_kernel: tile_kind={tile_kind!r} is not one of {[k.value for k in TileKind]}")
    tile_kind = TileKind(tile_kind)
    (hq, r, d), (hkv, c, dk), (hv, cv, dv) = q_shape[-3:], k_shape[-3:], v_shape[-3:]
    if dk != d or (hv, cv) != (hkv, c) or hq % hkv:
        raise ValueError(f"choose_kernel: q {q_shape}, k {k_shape}, v {v_shape} are not one attention "
                         f"([..., H, rows, D] against [..., Hkv, keys, D] and [..., Hkv, keys, Dv], Hkv dividing H)")
    if tile_kind is TileKind.CAUSAL and r != c:
        raise ValueError(f"choose_kernel: a causal tile is square; got {r} rows and {c} keys")
    causal, bias = tile_kind is TileKind.CAUSAL, tile_kind is TileKind.MASKED
    cd = compute_dtype(dtype)
    if not fused:
        return KernelChoice(Kernel.MATH, cd, HeadLayout.ROWS, reason="fused kernels switched off (cp.kernels.use_fused)")
    if device_type == "cpu":
        if _CPU_FLASH is None or _CPU_FLASH_BACKWARD is None:
            return KernelChoice(Kernel.MATH, cd, HeadLayout.ROWS, reason="this torch has no fused CPU attention op")
        if d != dv:
            return KernelChoice(Kernel.MATH, cd, HeadLayout.ROWS,
                                reason=f"the CPU kernel wants one feature size (got {d} and {dv})")
        return KernelChoice(Kernel.CPU_FLASH, dtype, HeadLayout.HEADS, is_causal=causal, bias=bias,
                            diagonal_blocks=diagonal.blocks_for(r) if causal else 1)
    if device_type == "cuda":
        why = [] if tuple(capability) >= (8, 0) else [f"flash and cuDNN need compute capability 8.0 (got {capability})"]
        for name in cuda_order(capability, tile_kind, gqa=hq != hkv):
            if name not in cuda_kernels:
                why.append(f"{name} switched off")
                continue
            if name in (Kernel.CUDA_EFFICIENT, Kernel.CUDA_CUDNN) and deterministic:
                why.append(f"{name} is non-deterministic (torch.use_deterministic_algorithms)")
                continue
            no = _cuda_fits(name, dtype, d, dv, tile_kind)
            if no:
                why.append(no)
                continue
            layout = HeadLayout.HEADS if hq == hkv or name is Kernel.CUDA_FLASH else HeadLayout.EXPAND
            return KernelChoice(name, dtype, layout, is_causal=causal, bias=bias)
        return KernelChoice(Kernel.MATH, cd, HeadLayout.ROWS, reason="; ".join(why))
    return KernelChoice(Kernel.MATH, cd, HeadLayout.ROWS, reason=f"no fused kernel for device type {device_type!r}")


def choose_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_kind: TileKind) -> KernelChoice:
    """``choose_kernel`` for these tensors (q [B, Hq, R, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv]), their device's
    card and torch's settings now."""
    device = q.device.type
    if device != "cuda":
        return choose_kernel(device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), tile_kind,
                             deterministic=torch.are_deterministic_algorithms_enabled(), fused=use_fused)
    return choose_kernel(device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), tile_kind,
                         deterministic=torch.are_deterministic_algorithms_enabled(),
                         cuda_kernels=cuda_kernels_enabled(), fused=use_fused, capability=_capability(q.device))


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device (read once per device)."""
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the ops

_aten = torch.ops.aten
#: torch's fused ops that also return the log-sum-exp (private ops: looked up, not assumed).
_CPU_FLASH = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_OPS = {
    Kernel.CUDA_FLASH: ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
    Kernel.CUDA_EFFICIENT: ("_scaled_dot_product_efficient_attention",
                            "_scaled_dot_product_efficient_attention_backward"),
    Kernel.CUDA_CUDNN: ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
}


def _op(choice: KernelChoice, backward: bool, device: torch.device) -> Any:
    """The aten op of a CUDA choice; a clear error where CUDA (or the op) is missing. Meta tensors are let
    through (torch's meta kernels check shapes)."""
    name = _OPS[choice.name][backward]
    if device.type not in ("cuda", "meta"):
        raise RuntimeError(f"cp attention: kernel {choice.name} (aten.{name}) runs on CUDA tensors, got tensors on "
                           f"{device}; choose_kernel(device_type='cuda', ...) is for CUDA inputs")
    op = getattr(_aten, name, None)
    if op is None:
        raise RuntimeError(f"cp attention: this torch ({torch.__version__}) has no aten.{name}; kernel "
                           f"{choice.name} needs a CUDA build of torch that has it")
    return op


def mask_of(lo: torch.Tensor | None, hi: torch.Tensor | None, rows: int, cols: int, kind: TileKind,
            device: torch.device) -> torch.Tensor | None:
    """Bool [rows, cols], True where a row must not see a key, from each row's key interval [lo, hi) (masked
    tiles) or the causal triangle; None for a full tile."""
    if kind is TileKind.FULL:
        return None
    if kind is TileKind.CAUSAL:
        return torch.ones(rows, cols, dtype=torch.bool, device=device).triu_(1)
    assert lo is not None and hi is not None
    c = torch.arange(cols, device=device)
    return (c < lo[:, None]) | (c >= hi[:, None])


def _bias(masked: torch.Tensor, dtype: torch.dtype, align: int) -> torch.Tensor:
    """The additive float mask: 0 where allowed, -inf where masked; its rows start at multiples of ``align``
    elements (the efficient CUDA op reads the bias in aligned rows)."""
    rows, cols = masked.shape
    padded = -(-cols // align) * align
    bias = torch.zeros(rows, padded, dtype=dtype, device=masked.device)[:, :cols]
    return bias.masked_fill_(masked, float("-inf"))


def features_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its last (feature) dim is contiguous, as it nearly always is; else a contiguous copy.
    The fused ops take any strides but that one's: they read the features as contiguous (SDPA's dispatcher falls
    back to its math kernel there; called directly, the CPU op computes garbage and the CUDA ops refuse)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def as_input(t: torch.Tensor) -> torch.Tensor:
    """[..., H, L, D] as the kernels take it: one batch dim and contiguous features (a view where it can be)."""
    t = features_contiguous(t)
    return t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])


def _expand(choice: KernelChoice, x: torch.Tensor, groups: int) -> torch.Tensor:
    """k or v [B, Hkv, C, D], its heads repeated ``groups`` times for the ``expand`` layout."""
    return x.repeat_interleave(groups, dim=1) if choice.layout is HeadLayout.EXPAND and groups > 1 else x


def _unexpand(choice: KernelChoice, g4: torch.Tensor, groups: int) -> torch.Tensor:
    """dK or dV of repeated heads summed back onto their K/V head."""
    if choice.layout is not HeadLayout.EXPAND or groups == 1:
        return g4
    b, h, c, d = g4.shape
    return g4.view(b, h // groups, groups, c, d).sum(2)


# Each fused kernel's call: 4-d q, k, v in the choice's layout and the additive bias (None: no mask) in, the
# normalized output and the log-sum-exp [B, H, R] out (forward); dq, dk, dv (backward, given do, out and lse).

def _cpu_flash_forward(choice: KernelChoice, q4: Any, k4: Any, v4: Any, scale: float, bias: Any) -> tuple[Any, Any]:
    if choice.diagonal_blocks > 1:
        return diagonal.forward(_CPU_FLASH, q4, k4, v4, scale, choice.diagonal_blocks)
    out, lse = _CPU_FLASH(q4, k4, v4, 0.0, choice.is_causal, attn_mask=bias, scale=scale)
    return out, lse


def _cuda_flash_forward(choice: KernelChoice, q4: Any, k4: Any, v4: Any, scale: float, bias: Any
                        ) -> tuple[Any, Any]:
    out, lse, *_ = _op(choice, False, q4.device)(q4, k4, v4, 0.0, choice.is_causal, False, scale=scale)
    return out, lse


def _expanded(bias: Any, q4: Any) -> Any:
    """The [R, C] bias as the [B, H, R, C] the CUDA ops read (a view)."""
    return None if bias is None else bias.expand(q4.shape[0], q4.shape[1], q4.shape[2], bias.shape[-1])


def _cuda_efficient_forward(choice: KernelChoice, q4: Any, k4: Any, v4: Any, scale: float, bias: Any
                            ) -> tuple[Any, Any]:
    out, lse, *_ = _op(choice, False, q4.device)(q4, k4, v4, _expanded(bias, q4), True, 0.0, choice.is_causal,
                                                 scale=scale)
    return out, lse[..., :q4.shape[2]]  # its rows are padded to a multiple of 32


def _cuda_cudnn_forward(choice: KernelChoice, q4: Any, k4: Any, v4: Any, scale: float, bias: Any
                        ) -> tuple[Any, Any]:
    out, lse, *_ = _op(choice, False, q4.device)(q4, k4, v4, _expanded(bias, q4), True, 0.0, choice.is_causal,
                                                 False, scale=scale)
    return out, lse.reshape(*lse.shape[:2], q4.shape[2])  # [B, H, R, 1]


def _cpu_flash_backward(choice: KernelChoice, do4: Any, q4: Any, k4: Any, v4: Any, out4: Any, lse: Any,
                        scale: float, bias: Any) -> tuple[Any, Any, Any]:
    if choice.diagonal_blocks > 1:
        return diagonal.backward(_CPU_FLASH_BACKWARD, do4, q4, k4, v4, out4, lse, scale, choice.diagonal_blocks)
    dq, dk, dv = _CPU_FLASH_BACKWARD(do4, q4, k4, v4, out4, lse, 0.0, choice.is_causal, attn_mask=bias, scale=scale)
    return dq, dk, dv


@functools.lru_cache(maxsize=64)
def philox_state(name: Kernel, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dropout seed and offset a CUDA backward op reads, made once per kernel and device (dropout is 0, so
    their values are never read), placed and typed as torch's own forward returns them: flash, uint64 [2] and
    [] on the device; cuDNN, int64 [1] and [1] on the device; efficient, int64 [] and [] on the host (torch
    keeps them there outside CUDA-graph capture)."""
    if name is Kernel.CUDA_FLASH:
        return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)
    if name is Kernel.CUDA_CUDNN:
        return torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    return torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _cuda_flash_backward(choice: KernelChoice, do4: Any, q4: Any, k4: Any, v4: Any, out4: Any, lse: Any,
                         scale: float, bias: Any) -> tuple[Any, Any, Any]:
    r, c = q4.shape[2], k4.shape[2]
    seed, offset = philox_state(choice.name, q4.device)
    dq, dk, dv = _op(choice, True, q4.device)(do4, q4, k4, v4, out4, _lse4(lse), None, None, r, c, 0.0,
                                              choice.is_causal, seed, offset, scale=scale)
    return dq, dk, dv


def _lse4(lse: Any) -> Any:
    """The log-sum-exp as the CUDA backward ops read it: [B, H, R] float32, contiguous (a tile's rows of a longer
    one are a strided view)."""
    return lse.float().contiguous()


def _cuda_efficient_backward(choice: KernelChoice, do4: Any, q4: Any, k4: Any, v4: Any, out4: Any, lse: Any,
                             scale: float, bias: Any) -> tuple[Any, Any, Any]:
    r, lse4 = q4.shape[2], _lse4(lse)
    seed, offset = philox_state(choice.name, q4.device)
    padded = lse4.new_zeros(*lse4.shape[:-1], -(-r // 32) * 32)  # the op's own row padding
    padded[..., :r] = lse4
    dq, dk, dv, _ = _op(choice, True, q4.device)(do4, q4, k4, v4, _expanded(bias, q4), out4, padded, seed, offset,
                                                 0.0, [True, True, True, False], choice.is_causal, scale=scale)
    return dq, dk, dv


def _cuda_cudnn_backward(choice: KernelChoice, do4: Any, q4: Any, k4: Any, v4: Any, out4: Any, lse: Any,
                         scale: float, bias: Any) -> tuple[Any, Any, Any]:
    r, c = q4.shape[2], k4.shape[2]
    seed, offset = philox_state(choice.name, q4.device)
    dq, dk, dv = _op(choice, True, q4.device)(do4, q4, k4, v4, out4, _lse4(lse).unsqueeze(-1), seed, offset,
                                              _expanded(bias, q4), None, None, r, c, 0.0, choice.is_causal,
                                              scale=scale)
    return dq, dk, dv


#: Each fused kernel's forward and backward call.
_CALLS = {
    Kernel.CPU_FLASH: (_cpu_flash_forward, _cpu_flash_backward),
    Kernel.CUDA_FLASH: (_cuda_flash_forward, _cuda_flash_backward),
    Kernel.CUDA_EFFICIENT: (_cuda_efficient_forward, _cuda_efficient_backward),
    Kernel.CUDA_CUDNN: (_cuda_cudnn_forward, _cuda_cudnn_backward),
}


def forward(choice: KernelChoice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            masked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile: q [B, Hq, R, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv] (any strides, any dtype: cast to the
    choice's); ``masked`` bool [R, C] (None for full tiles; causal tiles need it only on the math path).

    Returns the tile's normalized output [B, Hq, R, Dv] (the kernel's dtype) and its log-sum-exp [B, Hq, R]
    (float32, float64 for float64).
    """
    q, k, v = (t.to(choice.dtype) for t in (q, k, v))
    if choice.name is Kernel.MATH:
        out, lse = _math_forward(q, k, v, scale, masked)
    else:
        g = q.shape[1] // k.shape[1]
        bias = None if not choice.bias else _bias(masked, q.dtype, 16)  # type: ignore[arg-type]
        out, lse = _CALLS[choice.name][0](choice, q, _expand(choice, k, g), _expand(choice, v, g), scale, bias)
    return out, lse.to(compute_dtype(q.dtype))


def backward(choice: KernelChoice, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor | None, scale: float,
             masked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's dq, dk, dv (the kernel's dtype), given the whole attention's output ``out`` and log-sum-exp
    ``lse`` at the tile's rows (so the tile's softmax is its share of the whole one), and ``delta`` =
    rowsum(do * out) (read by the math path only; the fused kernels compute it themselves). Layouts as
    ``forward``."""
    q, k, v, do, out = (t.to(choice.dtype) for t in (q, k, v, do, out))
    if choice.name is Kernel.MATH:
        assert delta is not None, "the reference backward reads delta = rowsum(do * out)"
        return _math_backward(do, q, k, v, lse, delta, scale, masked)
    g = q.shape[1] // k.shape[1]
    bias = None if not choice.bias else _bias(masked, q.dtype, 16)  # type: ignore[arg-type]
    dq, dk, dv = _CALLS[choice.name][1](choice, do, q, _expand(choice, k, g), _expand(choice, v, g), out, lse,
                                        scale, bias)
    return dq, _unexpand(choice, dk, g), _unexpand(choice, dv, g)


def _math_scores(q: torch.Tensor, k: torch.Tensor, scale: float, masked: torch.Tensor | None) -> torch.Tensor:
    """Scores [B, Hq, R, C] of q [B, Hq, R, D] against k [B, Hkv, C, D], masked entries -inf."""
    b, hq, r, d = q.shape
    hkv = k.shape[1]
    s = torch.matmul(q.reshape(b, hkv, hq // hkv * r, d), k.transpose(-1, -2)).mul_(scale)
    s = s.view(b, hq, r, k.shape[-2])
    if masked is not None:
        s.masked_fill_(masked, float("-inf"))  # [R, C] broadcasts over every head
    return s


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  masked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    s = _math_scores(q, k, scale, masked)
    m = s.amax(-1, keepdim=True)  # finite: every row of a tile sees at least one key
    p = torch.exp_(s.sub_(m))
    total = p.sum(-1, keepdim=True)
    b, hq, r, _ = q.shape
    hkv = k.shape[1]
    out = torch.matmul(p.view(b, hkv, hq // hkv * r, -1), v).view(b, hq, r, v.shape[-1]).div_(total)
    return out, m.add_(total.log_()).squeeze(-1)


def _math_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, scale: float, masked: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, r, d = q.shape
    hkv = k.shape[1]
    p = torch.exp_(_math_scores(q, k, scale, masked).sub_(lse.unsqueeze(-1)))  # the whole attention's softmax
    rows = (b, hkv, hq // hkv * r)
    p2, do2 = p.view(*rows, -1), do.reshape(*rows, do.shape[-1])
    dv = torch.matmul(p2.transpose(-1, -2), do2)
    ds = p2.mul_(torch.matmul(do2, v.transpose(-1, -2)).sub_(delta.reshape(rows).unsqueeze(-1)))
    dq = torch.matmul(ds, k).mul_(scale).view(q.shape)
    dk = torch.matmul(ds.transpose(-1, -2), q.reshape(*rows, d)).mul_(scale)
    return dq, dk, dv


__all__ = ["AMPERE", "CUDA_KERNELS", "HeadLayout", "Kernel", "KernelChoice", "Name", "TileKind", "as_input", "backward",
           "choose_kernel", "compute_dtype", "cuda_kernels_enabled", "cuda_order", "features_contiguous", "forward",
           "mask_of", "philox_state"]

