"""An autoregressive video DiT rolled out chunk by chunk on a context-parallel group, with ``cp.KVCache``.

The model is ``demo_dit``'s (patchify, 3-D rotary embedding, blocks of attention and MLP), without its
register token. The video is generated chunk by chunk (``FRAMES_PER_CHUNK`` latent frames each): a chunk
starts as noise and is denoised in ``steps`` Euler steps; at every step its tokens (this rank's uneven
shard, ``cp.split_inputs_cp(..., uneven=True)``) go through the blocks, whose attention is each block's
``cp.KVCache.attend``: the chunk's queries see the kept earlier chunks' K/V and the whole chunk. At the
chunk's last step every block appends the chunk's K/V to its cache, so the next chunk sees them.

``recompute=True`` is what a model without a cache does at every step: the whole prefix (every earlier
chunk's tokens as they were at its last step, then the chunk's) through the blocks under
``cp.Mask.chunk_causal(chunk)`` (``cp.Mask.sliding_window(chunk, W)`` with a window) by
``cp.ring_attention``, keeping the chunk's rows. Both give the same video.

``serve`` rolls the video out at several cp sizes in one worker, as a long-lived inference worker does
(``parallel_state``'s group cache on, ``destroy_model_parallel`` between sizes); nothing of a rollout
outlives it. Run it on 4 CPU ranks:
    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 4 --master-addr 127.0.0.1 examples/autoregressive_dit.py
"""

from __future__ import annotations

import datetime
import gc
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

import cp
import demo_dit
import parallel_state as ps

CFG = demo_dit.DiTConfig(channels=4, patch=(1, 2, 2), heads=4, blocks=2)
#: The latent of one frame, (C, H, W): 3 x 5 = 15 tokens a frame, so a chunk's tokens split unevenly over 2 and 4.
FRAME = (4, 6, 10)
FRAMES_PER_CHUNK = 2
SEED = 7


def _chunk_tokens() -> int:
    return FRAMES_PER_CHUNK * (FRAME[1] // CFG.patch[1]) * (FRAME[2] // CFG.patch[2])


def _mask(window_chunks: int | None) -> Any:
    chunk = _chunk_tokens()
    return cp.Mask.chunk_causal(chunk) if window_chunks is None else cp.Mask.sliding_window(chunk, window_chunks)


def rollout(group: Any, *, chunks: int = 4, steps: int = 3, window_chunks: int | None = None, recompute: bool = False,
            dtype: torch.dtype = torch.float64, stats: dict[str, Any] | None = None) -> torch.Tensor:
    """The whole video [1, C, chunks * FRAMES_PER_CHUNK, H, W], generated chunk by chunk on ``group`` (None: one
    process); the same on every rank. ``stats`` (a dict) receives this rank's cache bytes and the caches (weakly)."""
    model = demo_dit.build(CFG, SEED).to(dtype)
    frames = chunks * FRAMES_PER_CHUNK
    c, h, w = FRAME
    grid = (frames, h // CFG.patch[1], w // CFG.patch[2])
    cos, sin = (x.to(dtype) for x in demo_dit.rope_for_tokens(demo_dit.rope_table(grid)))
    noise = torch.randn(1, c, frames, h, w, generator=torch.Generator().manual_seed(SEED), dtype=dtype)
    caches = [cp.KVCache(group, window_chunks=window_chunks) for _ in model["blocks"]]
    done: list[torch.Tensor] = []      # each chunk as it was at its last step (what the caches hold the K/V of)
    video: list[torch.Tensor] = []
    per_chunk = _chunk_tokens()
    with torch.no_grad():
        for i in range(chunks):
            x = noise[:, :, i * FRAMES_PER_CHUNK:(i + 1) * FRAMES_PER_CHUNK]
            for step in range(steps):
                tokens = demo_dit.patchify(x, CFG.patch)
                if recompute:
                    prefix = torch.cat([*done, tokens], dim=1)
                    out = _forward(model, prefix, cos[:prefix.shape[1]], sin[:prefix.shape[1]], group,
                                   _prefix_attention(group, window_chunks, prefix.shape[1]))[:, -per_chunk:]
                else:
                    at = slice(i * per_chunk, (i + 1) * per_chunk)
                    out = _forward(model, tokens, cos[at], sin[at], group,
                                   [_cached_attention(cache, step == steps - 1) for cache in caches])
                x = x - demo_dit.unpatchify(out, CFG.patch, (FRAMES_PER_CHUNK, *grid[1:]), c) / steps  # Euler
                if step == steps - 1:
                    done.append(tokens)
            video.append(x)
    if stats is not None:
        stats["cache_bytes"] = sum(cache.local_bytes for cache in caches)
        stats["caches"] = [weakref.ref(cache) for cache in caches]
    return torch.cat(video, dim=2)


def _forward(model: Any, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, group: Any,
             attention: Any) -> torch.Tensor:
    """The model on ``tokens`` [1, S, patch dim] (every rank passes all of them): this rank's uneven shard through
    the blocks, each block with its attention (one for all, or a list of one per block); every token's output."""
    local = cp.split_inputs_cp(tokens, 1, group, uneven=True)
    cos, sin = (cp.split_inputs_cp(t, 0, group, uneven=True) for t in (cos, sin))
    x = model["embed"](local)
    for b, block in enumerate(model["blocks"]):
        x = block(x, cos, sin, attention[b] if isinstance(attention, list) else attention)
    return cp.cat_outputs_cp(model["head"](x), 1, group, uneven=True)


def _cached_attention(cache: cp.KVCache, append: bool) -> demo_dit.Attention:
    """A block's attention through its cache; at a chunk's last step its K/V then join the cache."""
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = cache.attend(q, k, v)
        if append:
            cache.append(k, v)
        return out

    return attn


def _prefix_attention(group: Any, window_chunks: int | None, length: int) -> demo_dit.Attention:
    """The recomputation's attention: the whole prefix, chunk-causal (or windowed), by the ring."""
    mask = _mask(window_chunks)
    return lambda q, k, v: cp.ring_attention(q, k, v, group, mask=mask, length=length)


def serve(cp_sizes: tuple[int, ...] = (2, 4), *, chunks: int = 4, steps: int = 3,
          window_chunks: int | None = None) -> list[dict[str, Any]]:
    """Roll the video out at each cp size in turn in this worker (cache and recomputation, checked equal); one
    record per size: the video, both ways' seconds, this rank's cache bytes and whether the caches were freed."""
    ps.enable_group_cache()
    log = []
    try:
        for cp_size in cp_sizes:
            ps.initialize_model_parallel(context_parallel_size=cp_size, timeout=datetime.timedelta(seconds=60))
            group = ps.get_context_parallel_group()
            stats: dict[str, Any] = {}
            start = time.perf_counter()
            video = rollout(group, chunks=chunks, steps=steps, window_chunks=window_chunks, stats=stats)
            cached_s = time.perf_counter() - start
            start = time.perf_counter()
            again = rollout(group, chunks=chunks, steps=steps, window_chunks=window_chunks, recompute=True)
            recompute_s = time.perf_counter() - start
            ps.destroy_model_parallel()
            gc.collect()
            log.append({"cp": cp_size, "video": video, "recomputed": again, "cached_s": cached_s,
                        "recompute_s": recompute_s, "cache_bytes": stats["cache_bytes"],
                        "freed": all(ref() is None for ref in stats["caches"])})
    finally:
        ps.clear_group_cache()
    return log


def describe(record: dict[str, Any]) -> str:
    """One line of a ``serve`` record: both ways' seconds, how far apart their videos are, the cache's bytes."""
    video, again = record["video"], record["recomputed"]
    diff = ((video - again).abs().max() / again.abs().max()).item()
    return (f"cp {record['cp']}: cache {record['cached_s']:.2f} s, recompute {record['recompute_s']:.2f} s, max rel "
            f"diff {diff:.1e}, this rank's cache {record['cache_bytes']} bytes, freed {record['freed']}")


def main() -> None:
    dist.init_process_group("gloo")
    lines = [describe(record) for record in serve()]
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
