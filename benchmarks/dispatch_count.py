"""What one attention call costs the host and the memory, counted on any device: aten ops dispatched and the peak
of the bytes its ops allocate.

A ``TorchDispatchMode`` sees every aten op a call runs (views and copies included: each is a dispatch, and on a GPU
each op that computes is a kernel launch). Each op's outputs whose storage is new are counted as live from the op
until the storage is freed; the peak of that sum is the call's memory above its inputs (storages alive before the
call, the inputs and the output gradient, are not counted). Allocations inside a kernel (a fused op's scratch) are
not seen, on either side of a comparison.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchCount(TorchDispatchMode):
    """Counts the aten ops run under it (``ops``, by name) and the peak of the bytes their new storages hold."""

    def __init__(self, existing: Sequence[torch.Tensor] = ()):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.live = self.peak = 0
        self._seen = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: Any) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._seen or size == 0:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@dataclass(frozen=True)
class Cost:
    """One forward + backward: aten ops dispatched and peak bytes allocated above the inputs."""

    ops: int
    peak: int
    by_op: dict[str, int]


def count(call: Callable[..., torch.Tensor], shape: Sequence[int], dtype: torch.dtype = torch.bfloat16,
          device: str = "cpu", warm: bool = True) -> Cost:
    """``call(q, k, v)`` forward and backward on random [B, S, H, D] inputs of ``shape``, counted (after one
    uncounted warm-up call, which fills the caches a first call fills: plans, schedules, kernel choices)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, dtype=dtype, device=device).requires_grad_() for _ in range(3))
    do = torch.randn(shape, generator=g, dtype=dtype, device=device)
    if warm:
        call(q, k, v).backward(do)
        q.grad = k.grad = v.grad = None
    with DispatchCount((q, k, v, do)) as c:
        out = call(q, k, v)
        out.backward(do)
        del out
        q.grad = k.grad = v.grad = None
    return Cost(c.total, c.peak, dict(c.ops))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One process's unmasked SDPA on [B, S, H, D] (its default kernel)."""
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                            v.transpose(1, 2)).transpose(1, 2)


def masks(length: int) -> dict[str, Any]:
    """The masks the op and memory targets name, on ``length`` tokens: full, causal, chunk-causal of 8 runs, a window
    of 2 chunks, packed clips of 4 and of 8."""
    import cp

    eighth = length // 8
    return {"full": cp.Mask.full(), "causal": cp.Mask.causal(), "chunk_causal_8": cp.Mask.chunk_causal(eighth),
            "sliding_window": cp.Mask.sliding_window(eighth, 2),
            "packed_4": cp.Mask.packed([2 * eighth, eighth, 3 * eighth, 2 * eighth]),
            "packed_8": cp.Mask.packed([eighth] * 8)}


def planned(mask: Any, length: int) -> Callable[..., torch.Tensor]:
    """``cp.ring_attention`` on the default plan of ``mask`` in one process (a world of one)."""
    import cp

    plan = cp.plan_dispatch(mask, length, 1)
    return lambda q, k, v: cp.ring_attention(q, k, v, plan=plan)


__all__ = ["Cost", "DispatchCount", "count", "masks", "planned", "sdpa"]
