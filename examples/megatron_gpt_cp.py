"""Train megatron-core's GPTModel with context parallelism on CPU ranks, with cp's core attention.

The model is megatron-core's own GPT from its local layer spec; one line puts cp's core attention in it:

    spec = cp.megatron.swap_core_attention(get_gpt_layer_local_spec())

(megatron-core's local attention refuses context parallelism, and its TEDotProductAttention needs Transformer
Engine and a GPU.) Each rank takes its tokens with megatron-core's ``get_batch_on_this_cp_rank`` (2 cp chunks,
rank r chunks r and 2 cp - 1 - r); the step is the model's per-token loss over this rank's tokens divided by the
global token count, backward, the gradients summed over the data x context parallel group (what
megatron-core's DistributedDataParallel does on a GPU) and AdamW. The loss printed is the global one: at
``--cp 1`` (the same model, context parallelism off) it is the same, step by step.

Run it on 4 CPU ranks (cp 2 x dp 2):

    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 4 --master-addr 127.0.0.1 examples/megatron_gpt_cp.py

``--mask chunk`` trains under a chunk-causal mask (chunks of 8 tokens, ``cp.Mask.chunk_causal(8)``) instead of
the spec's causal one. On a CPU this loop stands in for megatron-core's own schedule and DistributedDataParallel,
and the positions are learned, because those and RoPE allocate on CUDA (tests/test_megatron_model_code.py lists
where); on GPUs use them as usual: the spec line is all that changes.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Sequence

import torch
import torch.distributed as dist

import cp
import cp.megatron
import parallel_state as ps

VOCAB, SEQ, BATCH = 64, 64, 4


def batches(step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``, the same on every rank: counting sequences (each token its predecessor plus a
    per-sequence stride, modulo the vocabulary), so the next token is learnable."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (BATCH, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(SEQ).expand(BATCH, -1)}


def this_ranks(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This data-parallel rank's samples, cut to this cp rank's tokens by megatron-core's get_batch_on_this_cp_rank
    (0.18 added its ``is_hybrid_cp`` parameter)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    share = BATCH // ps.get_data_parallel_world_size()
    rank = ps.get_data_parallel_rank()
    mine = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    return get_batch_on_this_cp_rank(mine, cp_group=ps.get_context_parallel_group(), **extra)


def train(steps: int = 30, cp_size: int = 2, mask: str | None = None, seed: int = 0) -> list[float]:
    """Train on this rank (torch.distributed is up) at ``cp_size``; every step's global loss."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(context_parallel_size=cp_size)
    try:
        spec = cp.megatron.swap_core_attention(  # the one line: megatron-core's local spec, cp's core attention
            get_gpt_layer_local_spec(), mask=cp.Mask.chunk_causal(8) if mask == "chunk" else None)
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=cp_size,
                                   cp_comm_type="p2p", attention_dropout=0.0, hidden_dropout=0.0,
                                   use_cpu_initialization=True)
        torch.manual_seed(seed)
        model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="learned_absolute")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        group = ps.get_data_parallel_group(with_context_parallel=True)
        losses = []
        for i in range(steps):
            batch = this_ranks(batches(i))
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s / cp]
            loss = per_token.sum() / (BATCH * SEQ)  # this rank's part of the global mean
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():  # DistributedDataParallel's reduction, over dp x cp
                dist.all_reduce(p.grad, group=group)
            optimizer.step()
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            losses.append(total.item())
        return losses
    finally:
        ps.destroy_model_parallel()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="context parallel size (the rest is data parallel)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mask", choices=["causal", "chunk"], default="causal")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    losses = train(args.steps, args.cp, None if args.mask == "causal" else args.mask)
    if dist.get_rank() == 0:
        for i, loss in enumerate(losses):
            print(f"step {i:3d}  loss {loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
