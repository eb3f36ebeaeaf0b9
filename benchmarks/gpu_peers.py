"""The GPU check's peers and yardsticks: one process's SDPA (the float32 reference and the bfloat16 call),
FlexAttention on the same ``cp.Mask``, the work a mask allows, the card's matmul ceiling, and host / device time.

Every function runs on CUDA and, for the test suite's tiny run, on a CPU: there FlexAttention runs eagerly and,
since torch has no FlexAttention backward on a CPU, forward only (:attr:`Flex.backward` says which).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.bench_attention import time_in_turns
from benchmarks.flex_mask import block_mask
from benchmarks.harness import median

#: Floating-point operations per allowed (query, key) pair, per head and per unit of head dim: the forward's two
#: matmuls (scores, scores x V) are 4; forward + backward (the scores again, dV, dP, dQ, dK) are 14.
FLOPS_FORWARD = 4
FLOPS_FORWARD_BACKWARD = 14


def allowed_flops(mask: Any, length: int, heads: int, dim: int) -> int:
    """The flops of forward + backward on the (query, key) pairs ``mask`` lets attend on ``length`` tokens (the sum
    of its key ranges' widths): what a kernel does for the user, whatever it computes besides."""
    import torch

    lo, hi = mask.key_range(torch.arange(length), length)
    return FLOPS_FORWARD_BACKWARD * int((hi - lo).sum()) * heads * dim


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


# ---------------------------------------------------------------- measuring one call

def forward_backward(fn: Callable[..., Any], ins: list[Any], grad: Any) -> tuple[Any, ...]:
    """``fn(*ins)`` and the gradients of ``ins`` for the output gradient ``grad``: (out, dq, dk, dv)."""
    import torch

    out = fn(*ins)
    return (out.detach(), *torch.autograd.grad(out, ins, grad))


def errors(got: tuple[Any, ...], want: tuple[Any, ...], scale: list[float]) -> dict[str, float | None]:
    """max |diff| and max |diff| / ``scale`` (the whole reference's max |ref|) of out and of the worst gradient
    (want: out, dq, dk, dv, or this rank's tokens of them; got: the same, or out alone, whose grad figures are
    then None)."""
    diffs = [(g.float() - w.float()).abs().max().item() for g, w in zip(got, want[:len(got)], strict=True)]
    rel = [d / (s or 1.0) for d, s in zip(diffs, scale, strict=False)]
    return {"out_abs": diffs[0], "out_rel": rel[0], "grad_abs": max(diffs[1:], default=None),
            "grad_rel": max(rel[1:], default=None)}


def peak_bytes(fn: Callable[[], Any], device: Any) -> int | None:
    """The most memory allocated during ``fn()`` beyond what was allocated before it (None off CUDA)."""
    import torch

    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def clocked_turns(ways: dict[str, Callable[[], Any]], group: Any, opts: dict[str, Any],
                  device: Any) -> dict[str, dict[str, float]]:
    """Time ``ways`` (calls that do not synchronize) in turns (``time_in_turns``, one warmup round): per way the
    median ms of the whole call to its end on the device (the slowest rank's), and this rank's median host ms
    (until the call returns, before any synchronize) and device ms (CUDA events around it; off CUDA, the host's)."""
    import torch

    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    samples: dict[str, list[tuple[float, float]]] = {key: [] for key in ways}

    def clocked(key: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def way() -> None:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if events:
                events[0].record()
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0
            if events:
                events[1].record()
            sync()
            samples[key].append((host, events[0].elapsed_time(events[1]) / 1e3 if events else host))
        return way

    warmup = 1
    wall = time_in_turns({k: clocked(k, fn) for k, fn in ways.items()}, group, {"reps": opts["reps"],
                                                                                  "warmup": warmup}, device=device)
    return {key: {"ms": median(wall[key]) * 1e3, "host_ms": median([h for h, _ in samples[key][warmup:]]) * 1e3,
                  "device_ms": median([d for _, d in samples[key][warmup:]]) * 1e3} for key in ways}


# ---------------------------------------------------------------- the card's ceiling

def matmul_ceiling(device: Any, reps: int = 10) -> dict[str, Any]:
    """A bfloat16 n x n x n matmul's TFLOP/s on ``device`` (n = 8192 on CUDA, 256 on a CPU): the most a fused
    attention kernel can hope for on this card, measured in the same run as the rows."""
    import torch

    n = 8192 if device.type == "cuda" else 256
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    seconds = []
    for rep in range(reps + 2):  # two warmups: cuBLAS picks its kernel on the first
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            took = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            took = time.perf_counter() - t0
        if rep >= 2:
            seconds.append(took)
    return {"n": n, "tflops": tflops(2 * n**3, median(seconds))}


# ---------------------------------------------------------------- one process's SDPA

def sdpa_kwargs(mask_name: str, mask: Any, length: int, device: Any) -> dict[str, Any]:
    """One process's SDPA arguments for ``mask`` on the whole sequence: none for full, torch's causal flag for
    causal (its fused causal kernels), else the dense bool mask (True: may attend), built once."""
    if mask_name == "full":
        return {}
    if mask_name == "causal":
        return {"is_causal": True}
    return {"attn_mask": mask.dense(length).to(device)}


def fused_only() -> Any:
    """On CUDA: SDPA without its math fallback, so that a reference no fused kernel takes fails with torch's
    reason instead of holding a [heads, L, L] float32 score matrix."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


# ---------------------------------------------------------------- FlexAttention

@dataclass(frozen=True)
class Flex:
    """FlexAttention on one mask, called as the engine is: [batch, length, heads, dim] in and out.

    ``how``: compiled (CUDA) or eager (a CPU); ``backward``: whether :meth:`step` runs the backward too (torch has
    none for FlexAttention on a CPU, so there it is the forward alone)."""

    attend: Callable[..., Any]
    how: str
    backward: bool

    def flops(self, forward_backward: float) -> float:
        """The flops of :meth:`step` where a forward + backward does ``forward_backward``."""
        return forward_backward if self.backward else forward_backward * FLOPS_FORWARD / FLOPS_FORWARD_BACKWARD

    def step(self, ins: list[Any], grad: Any) -> tuple[Any, ...]:
        """(out, dq, dk, dv), or (out,) where :attr:`backward` is False."""
        import torch

        if self.backward:
            return forward_backward(self.attend, ins, grad)
        with torch.no_grad():
            return (self.attend(*ins),)


def flex(mask: Any, length: int, device: Any) -> Flex:
    """FlexAttention for ``mask`` on ``length`` tokens: its block mask built from the mask's key ranges
    (``flex_mask.block_mask``), compiled with ``torch.compile`` on CUDA (the
    first call compiles), eager on a CPU. Raises what torch raises where it has no FlexAttention."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    blocks = block_mask(mask, length, device)

    def call(kernel: Callable[..., Any], q: Any, k: Any, v: Any) -> Any:
        return kernel(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=blocks).transpose(1, 2)

    if device.type != "cuda":
        def eager(q: Any, k: Any, v: Any) -> Any:
            with warnings.catch_warnings():  # eager on purpose: no C++ toolchain needed, the tiny run stays fast
                warnings.simplefilter("ignore")
                return call(flex_attention, q, k, v)

        return Flex(eager, "eager, forward only", backward=False)
    import torch._dynamo

    # One compiled kernel can serve every mask of a shape (dynamo guards the mask function by its code, and lo / hi
    # are its inputs: seen on a CPU); each shape compiles anew, and past the recompile limit dynamo would fall back
    # to eager FlexAttention, whose dense scores do not fit at the video size: keep the limit out of the way.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(flex_attention, dynamic=False)
    return Flex(lambda q, k, v: call(compiled, q, k, v), "compiled", backward=True)


# ---------------------------------------------------------------- the reference of one mask

def reference(full: list[Any], mask_name: str, mask: Any, length: int, device: Any,
              with_flex: bool) -> dict[str, Any]:
    """The float32 reference (out, dq, dk, dv), one process's bfloat16 SDPA call with its error and peak memory,
    the flops of forward + backward on the mask's allowed pairs and, ``with_flex``, FlexAttention (built and
    compiled here, outside any timing) with its error and peak memory, or the exception that stopped it."""
    import torch

    import cp

    kwargs = sdpa_kwargs(mask_name, mask, length, device)

    def sdpa(q: Any, k: Any, v: Any) -> Any:
        with fused_only():
            return cp.sdpa_in_layout(q, k, v, **kwargs)

    fp32 = forward_backward(sdpa, [t.clone().requires_grad_(True) for t in full[:3]], full[3])
    ins = [t.to(torch.bfloat16).requires_grad_(True) for t in full[:3]]
    grad = full[3].to(torch.bfloat16)
    scale = [t.abs().max().item() for t in fp32]
    ref = {"fp32": fp32, "scale": scale, "sdpa": sdpa, "bf16": (ins, grad),
           "flops": allowed_flops(mask, length, *full[0].shape[2:]),
           "sdpa_err": errors(forward_backward(sdpa, ins, grad), fp32, scale),
           "sdpa_peak": peak_bytes(lambda: forward_backward(sdpa, ins, grad), device)}
    if with_flex:
        try:
            peer = flex(mask, length, device)
            flex_ins = ins if peer.backward else [t.detach() for t in ins]
            ref.update(flex=peer, flex_ins=flex_ins, flex_err=errors(peer.step(flex_ins, grad), fp32, scale),
                       flex_peak=peak_bytes(lambda: peer.step(flex_ins, grad), device))
        except Exception as exc:  # no FlexAttention in this torch, a compile failure, out of memory: the row says so
            ref["flex"] = exc
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return ref
