"""PyTorch's own context parallelism on gloo CPU ranks, called as torch 2.13 ships it (torch's code, not a copy).

Its public entry, ``torch.distributed.tensor.experimental.context_parallel``, does not run on a CPU:
it routes SDPA through DTensor, and the CPU's fused op has no sharding rule there (torch 2.13:
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have
a sharding strategy registered``; the ring's handlers cover only the CUDA flash / efficient / cuDNN
ops). So the peer calls what that entry calls underneath, with the CPU's fused op in the CUDA op's
place:

- the ring: ``_templated_ring_attention`` and ``_templated_ring_attention_backward`` with
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), K/V passed to the next
  rank (``set_rotate_method("alltoall")``), the causal load balance on (``_cp_options``), the
  sequence laid out by its ``_HeadTailLoadBalancer``;
- flex_attention CP: ``_context_parallel_shard`` with the head-tail balancer (it also rewrites the
  BlockMask for the rank's queries), a module wrapped by ``parallelize_module(..., _ContextParallel(FLEX))``
  (its hook all-gathers K and V), and ``torch.compile(flex_attention)``, the fused CPU kernel
  (eager flex_attention materializes every score). CPU flex_attention has no backward.

The ring runs on any device torch has; only these ops were chosen for a CPU.
"""

from __future__ import annotations

from typing import Any, Callable

SEQ_DIM = 2  # torch's CP works on [B, H, S, D]


def _modules() -> tuple[Any, Any]:
    from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer

    return _attention, _load_balancer


def head_tail_index(length: int, world: int) -> Any:
    """The global positions in the order torch's head-tail balancer lays them out; rank r holds the r-th chunk."""
    return _modules()[1]._HeadTailLoadBalancer(length, world, "cpu")._generate_indices()[0]


def ring_attention(group: Any) -> Callable[[Any, Any, Any], Any]:
    """torch's causal ring attention on ``group``, differentiable: local q, k, v ([B, H, S/n, D], head-tail order)
    to the local output."""
    import torch

    attention, _ = _modules()
    attention.set_rotate_method("alltoall")  # the ring: each step passes K/V on to the next rank
    attention._cp_options.enable_load_balance = True  # the head-tail layout: skip what causality masks
    aten = torch.ops.aten

    class TorchRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
            out, lse = attention._templated_ring_attention(
                group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            q, k, v, out, lse = ctx.saved_tensors
            return tuple(attention._templated_ring_attention_backward(
                group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad.contiguous(),
                "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0)[:3])

    return TorchRing.apply


def flex_attention(mesh: Any, mask: Any, q: Any, k: Any, v: Any) -> tuple[Callable[[], Any], Any]:
    """torch's flex_attention CP under ``mask`` (a ``cp.Mask``) for the whole q, k, v ([B, H, S, D], the same on
    every rank): the forward call on this rank's shards, and the global positions of its queries."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention as flex

    from benchmarks.flex_mask import block_mask

    attention, load_balancer = _modules()
    length, world = q.shape[SEQ_DIM], mesh.size()
    balancer = load_balancer._HeadTailLoadBalancer(length, world, "cpu")
    mine = attention._context_parallel_shard(mesh, [q, k, v, block_mask(mask, length, "cpu")], [SEQ_DIM] * 4,
                                             load_balancer=balancer)

    class Flex(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fn = torch.compile(flex)

        def forward(self, q: Any, k: Any, v: Any, block_mask: Any) -> Any:
            return self.fn(q, k, v, block_mask=block_mask)

    module = parallelize_module(Flex(), mesh, attention._ContextParallel(
        seq_dim=SEQ_DIM, attention_type=attention._ContextParallel.AttentionType.FLEX))
    index = balancer._generate_indices()[0].chunk(world)[mesh.get_local_rank()]
    return (lambda: module(mine[0], mine[1], mine[2], block_mask=mine[3])), index


def ring_bytes(shard_bytes: int, world: int, backward: bool) -> int:
    """What torch's ring sends per rank, with ``shard_bytes`` one rank's K (or V): K and V on n-1 times forward;
    backward, K and V again and their float32 gradients at each of its n steps."""
    sent = 2 * (world - 1) * shard_bytes
    return 2 * sent + 2 * world * shard_bytes if backward else sent


def flex_bytes(shard_bytes: int, world: int) -> int:
    """What torch's flex_attention CP sends per rank forward: its K and V shards to the n-1 other ranks."""
    return 2 * (world - 1) * shard_bytes
