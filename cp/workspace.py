"""A reusable receive buffer for cat_outputs_cp on CPU.

Gathering into a fresh buffer every call pays for first-touch page faults on memory that is read
once and dropped. The gather only lands here; cat_outputs_cp always copies out into a new result
tensor that the caller owns, so nothing a later call overwrites is ever handed out.

One buffer per (thread, device): two threads gathering at once never share one. CUDA tensors do
not use it: the caching allocator already makes their buffers cheap, and a buffer held across
streams would need stream bookkeeping for no gain.
"""

from __future__ import annotations

import threading

import torch

_buffers: dict[tuple[int, torch.device], torch.Tensor] = {}
_hooked = False


def workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of exactly ``nbytes`` on ``device``, valid until this thread's next call."""
    key = (threading.get_ident(), device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < nbytes:
        _buffers.pop(key, None)  # free the old one first so the peak is one buffer, not two
        buf = _buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _hook_teardown()
    return buf[:nbytes]


def discard(device: torch.device) -> None:
    """Forget this thread's buffer on ``device``: after a failed collective it may still be written to."""
    _buffers.pop((threading.get_ident(), device), None)


def release_gather_workspace() -> None:
    """Free the buffers cat_outputs_cp keeps for reuse (also done by destroy_model_parallel)."""
    _buffers.clear()


def _hook_teardown() -> None:
    global _hooked
    if not _hooked:
        import parallel_state

        parallel_state.register_teardown_hook(release_gather_workspace)
        _hooked = True
