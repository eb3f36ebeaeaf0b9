"""megatron-core's GPTModel trained by megatron-core's own training step on CPU ranks (tests and benchmarks).

Shared by tests/test_megatron_cp_attention.py and benchmarks/bench_megatron_face.py. ``build`` makes a small
``GPTModel`` from a layer spec; ``step`` slices each rank's batch with megatron-core's ``get_batch_on_this_cp_rank``
and runs ``get_forward_backward_func()``'s schedule with a per-token loss and ``finalize_model_grads``;
``train_step`` does both and returns the loss and every parameter's whole gradient (tensor-parallel shards
gathered), the same on every rank.

What a GPU gives megatron-core's step is supplied here, and only this:

- ``DataParallel``: ``DistributedDataParallel`` keeps its gradient buffers on CUDA, so the model is wrapped in a
  subclass of megatron-core's own ``_BaseDataParallel`` whose ``finish_grad_sync`` does what DDP's does with
  ``calculate_per_token_loss`` (sum every gradient over the data x context parallel group: real gloo
  all-reduces) and whose ``scale_gradients`` scales them, as ``finalize_model_grads`` asks.
- ``cpu_as_cuda``: the schedules allocate one scalar, the token count, with ``device="cuda"``
  (``forward_backward_no_pipelining``; see tests/test_megatron_model_code.py's blockers), the rotary
  embedding moves its frequencies to ``torch.cuda.current_device()`` on first use, and its context-parallel
  slice builds its index in pinned memory and copies it with ``.cuda()``. Inside it torch's tensor
  constructors asked for a CUDA device or pinned memory build on the CPU, ``Tensor.cuda()`` returns the tensor
  itself, and ``torch.cuda.current_device()`` names the CPU.
- the RNG tracker: megatron-core's attention forks the CUDA RNG around its dropout (here 0); megatron-core's
  own inference tracker (``initialize_rng_tracker(inference_rng_tracker=True)``) makes that fork a no-op.

Weights are the same at every tensor-parallel size: with ``use_cpu_initialization`` megatron-core draws each
layer's whole weight from torch's default generator and keeps this rank's shard, so seeding it before the model
is built gives one model whatever the split.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

VOCAB = 32


@contextlib.contextmanager
def cpu_as_cuda():
    """Tensor constructors asked for a CUDA device or pinned memory build on the CPU, ``Tensor.cuda()`` is the
    tensor itself and ``torch.cuda.current_device()`` returns the CPU device."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()

    class OnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0]
            if func in constructors:
                if torch.device(kwargs.get("device") or "cpu").type == "cuda":
                    kwargs = {**kwargs, "device": "cpu"}
                if kwargs.get("pin_memory"):
                    kwargs = {**kwargs, "pin_memory": False}
            return func(*args, **kwargs)

    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        with OnCpu():
            yield
    finally:
        torch.cuda.current_device = current_device


@dataclass(frozen=True)
class Model:
    """The tiny GPT: sizes and the TransformerConfig keywords that vary between cases."""

    layers: int = 2
    hidden: int = 16
    heads: int = 4
    query_groups: int = 2
    seq: int = 16
    dtype: torch.dtype = torch.float64
    position_embedding: str = "rope"
    config: dict = field(default_factory=dict)


def global_batch(model: Model, samples: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The global batch every rank draws alike: tokens, labels, a loss mask with some zeros, position ids."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, model.seq), generator=gen)
    labels = torch.randint(0, VOCAB, (samples, model.seq), generator=gen)
    loss_mask = (torch.rand(samples, model.seq, generator=gen) > 0.2).to(torch.float32)
    position_ids = torch.arange(model.seq).expand(samples, -1).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def sequences(lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """One micro-batch [1, length] per length: tokens, labels, loss mask, position ids (drawn from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        out.append({"tokens": torch.randint(0, VOCAB, (1, n), generator=gen),
                    "labels": torch.randint(0, VOCAB, (1, n), generator=gen),
                    "loss_mask": (torch.rand(1, n, generator=gen) > 0.2).to(torch.float32),
                    "position_ids": torch.arange(n).view(1, n)})
    return out


def pack(seqs: list[dict[str, torch.Tensor]], multiple: int) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """The sequences packed for thd, each padded to a multiple of ``multiple`` (padding: token 0, loss mask 0);
    with the real and the padded cumulative lengths."""
    parts, cu, padded = [], [0], [0]
    for seq in seqs:
        n = seq["tokens"].shape[1]
        room = -(-n // multiple) * multiple
        pad = {k: torch.zeros(1, room - n, dtype=v.dtype) for k, v in seq.items()}
        parts.append({k: torch.cat([v, pad[k]], dim=1) for k, v in seq.items()})
        cu.append(cu[-1] + n)
        padded.append(padded[-1] + room)
    batch = {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
    return batch, cu, padded


def thd_slice(cu: list[int], padded: list[int]) -> Callable:
    """The cut of a thd pack for this cp rank: its tokens of every sequence (Transformer Engine's
    ``thd_get_partitioned_indices``, which megatron-core's thd slicing calls, stated as cp's DualChunkSwap plan),
    and the ``PackedSeqParams`` megatron-core builds for it."""
    import megatron.core.parallel_state as mps
    from megatron.core.packed_seq_params import PackedSeqParams

    import cp

    def cut(batch):
        group = mps.get_context_parallel_group()
        plan = cp.plan_dual_chunk_swap(cp.Mask.full(), padded[-1], group.size(), cu_seqlens=padded)
        index = plan.index(group.rank())
        longest = max(b - a for a, b in zip(padded, padded[1:], strict=False))
        out = {k: v.index_select(1, index) for k, v in batch.items()}
        real, room = torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
        out["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=room,
            cu_seqlens_kv_padded=room, max_seqlen_q=longest, max_seqlen_kv=longest)
        return out

    return cut


def hybrid_slice(local_cp_size: int) -> Callable:
    """megatron-core's hybrid context parallelism for one sample [1, s] over a group of ``local_cp_size`` dp x cp
    ranks (1: this rank alone), as the installed release does it: up to 0.17 ``get_batch_on_this_hybrid_cp_rank``
    (sbhd, the group in ``PackedSeqParams.cp_group``); from 0.18 ``get_batch_on_this_cp_rank(is_hybrid_cp=True)``
    and the thd ``PackedSeqParams`` pretrain_gpt.py builds from it."""
    import megatron.core.parallel_state as mps
    from megatron.core import utils
    from megatron.core.packed_seq_params import PackedSeqParams

    def cut(batch):
        n = batch["tokens"].shape[1]
        if release() < (0, 18):
            out, params = utils.get_batch_on_this_hybrid_cp_rank({k: v[0] for k, v in batch.items()}, local_cp_size)
            return dict(out, packed_seq_params=params)
        cu = torch.tensor([[0, n]], dtype=torch.int32)
        out = utils.get_batch_on_this_cp_rank(
            dict(batch, cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=torch.tensor([n]),
                 local_cp_size=torch.tensor(local_cp_size)),
            is_hybrid_cp=True, hybrid_cp_group_func=mps.get_hybrid_data_context_parallel_groups)
        out["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu[0], cu_seqlens_kv=cu[0], cu_seqlens_q_padded=cu[0],
            cu_seqlens_kv_padded=cu[0], max_seqlen_q=n, max_seqlen_kv=n, local_cp_size=local_cp_size,
            cp_group=out.get("hybrid_cp_group"))
        return out

    return cut


def build_config(model: Model, **parallel: Any):
    """The model's TransformerConfig with ``parallel`` (and ``model.config``, which may override any keyword)."""
    from megatron.core.transformer import TransformerConfig

    keywords = dict(
        num_layers=model.layers, hidden_size=model.hidden, ffn_hidden_size=2 * model.hidden,
        num_attention_heads=model.heads, num_query_groups=model.query_groups, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=model.dtype, use_cpu_initialization=True, init_method_std=0.3,
        calculate_per_token_loss=True, **parallel)
    return TransformerConfig(**{**keywords, **model.config})


def _data_parallel(config, module):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    class DataParallel(_BaseDataParallel):
        """DDP's gradient reduction with ``calculate_per_token_loss`` (sum over dp x cp), without its CUDA buffers."""

        def __init__(self, config, module, dp_cp_group):
            super().__init__(config, module)
            self.ddp_config = DistributedDataParallelConfig()
            self.dp_cp_group = dp_cp_group

        def finish_grad_sync(self, force_all_reduce=False):
            params = list(self.module.parameters())
            flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])
            dist.all_reduce(flat, group=self.dp_cp_group)  # one bucket, as DDP's buffer
            for p, grad in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.main_grad = grad.view_as(p)

        def scale_gradients(self, scaling_factor):
            for p in self.module.parameters():
                p.main_grad *= scaling_factor

    return DataParallel


def release() -> tuple[int, int]:
    """The installed megatron-core's (major, minor)."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("megatron-core").split(".")[:2])


def dp_share(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's equal share of the global batch's samples, as one micro-batch."""
    import megatron.core.parallel_state as mps

    share = batch["tokens"].shape[0] // mps.get_data_parallel_world_size()
    rank = mps.get_data_parallel_rank()
    return [{k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}]


def cp_slice(batch: dict[str, Any], cp_group=None) -> dict[str, Any]:
    """megatron-core's ``get_batch_on_this_cp_rank`` over ``cp_group`` (None: the live cp group), in the
    installed release's signature (0.18 added ``is_hybrid_cp``)."""
    import megatron.core.parallel_state as mps
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = mps.get_context_parallel_group() if cp_group is None else cp_group
    if release() >= (0, 18):
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def build(model: Model, spec, parallel: dict[str, Any], seed: int = 1):
    """``GPTModel(spec)`` (seeded: the same whole weights at every split) in its data-parallel wrapper.

    ``parallel``: the TransformerConfig's parallel keywords; they must match the live parallel state, which the
    model reads through megatron-core's globals.
    """
    import megatron.core.parallel_state as mps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = build_config(model, **parallel)
    config.finalize_model_grads_func = finalize_model_grads
    torch.manual_seed(seed)
    # .to(): megatron-core's local norms are built in the default dtype whatever params_dtype says
    gpt = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=model.seq,
                   position_embedding_type=model.position_embedding).to(model.dtype)
    return _data_parallel(config, gpt)(config, gpt, mps.get_data_parallel_group(with_context_parallel=True))


def step(wrapped, micro_batches: list[dict[str, Any]], cut: Callable = cp_slice) -> torch.Tensor:
    """One training step: megatron-core's schedule over ``micro_batches`` (forward, backward, ``finalize_model_grads``;
    gradients in each parameter's ``main_grad``); returns this rank's (loss sum, tokens).

    Each micro-batch (tokens, labels, loss_mask, position_ids [b, s]; optional attention_mask [b, 1, s, s]) is cut
    to this rank's tokens inside the forward step by ``cut(micro_batch)`` (default ``get_batch_on_this_cp_rank``),
    which may add ``packed_seq_params``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = cut(dict(next(data_iterator)))
        out = model(mb["tokens"], mb["position_ids"], mb.get("attention_mask"), labels=mb["labels"],
                    packed_seq_params=mb.get("packed_seq_params"))
        mask = mb["loss_mask"]

        def loss_func(losses):
            total = (losses.float() * mask).sum()
            tokens = mask.sum().to(torch.int)
            return total, tokens, {"lm loss": torch.stack([total.detach().double(), tokens.double()])}

        return out, loss_func

    with cpu_as_cuda():
        stored = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[wrapped],
            num_microbatches=len(micro_batches), seq_length=micro_batches[0]["tokens"].shape[1], micro_batch_size=1)
    return torch.stack([s["lm loss"] for s in stored]).sum(0)


def train_step(model: Model, spec, parallel: dict[str, Any], micro_batches: list[dict[str, Any]], *,
               cut: Callable = cp_slice, seed: int = 1) -> dict[str, Any]:
    """``build`` then one ``step``: the loss over every rank's tokens, every parameter's whole gradient and the
    model, the same loss and gradients on every rank."""
    import megatron.core.parallel_state as mps
    import torch.distributed as dist

    wrapped = build(model, spec, parallel, seed)
    loss = step(wrapped, micro_batches, cut)
    dist.all_reduce(loss, group=wrapped.dp_cp_group)
    gpt = wrapped.module
    return {"loss": (loss[0] / loss[1]).item(), "grads": whole_grads(gpt, mps.get_tensor_model_parallel_group()),
            "model": gpt}


def whole_grads(module, tp_group) -> dict[str, torch.Tensor]:
    """Every parameter's ``main_grad``, tensor-parallel shards gathered along their partition dim."""
    import torch.distributed as dist

    named = list(module.named_parameters())
    out = {name: p.main_grad.detach().clone() for name, p in named}
    split = [(name, p) for name, p in named if getattr(p, "tensor_model_parallel", False)]
    if split and tp_group.size() > 1:
        flat = torch.cat([out[name].flatten() for name, _ in split])
        parts = [torch.empty_like(flat) for _ in range(tp_group.size())]
        dist.all_gather(parts, flat, group=tp_group)  # every rank's shards in one message
        sizes = [p.numel() for _, p in split]
        shards = [part.split(sizes) for part in parts]
        for i, (name, p) in enumerate(split):
            out[name] = torch.cat([s[i].view_as(p) for s in shards], dim=p.partition_dim)
    return out


def difference(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """The loss's relative difference and the largest gradient difference relative to that gradient's size."""
    assert set(got["grads"]) == set(want["grads"]), (sorted(got["grads"]), sorted(want["grads"]))
    grads = 0.0
    for name, g in want["grads"].items():
        scale = g.abs().max().item() or 1.0
        grads = max(grads, (got["grads"][name] - g).abs().max().item() / scale)
    return {"loss": abs(got["loss"] - want["loss"]) / abs(want["loss"]), "grads": grads}
