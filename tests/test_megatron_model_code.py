"""megatron-core's own model code computes exactly the same on parallel_state's groups as on its own.

The oracle is megatron-core 0.16.1 itself, on the same real gloo ranks. In one worker call per
topology, each piece of its model code below runs four times with the same seeds and inputs:
after megatron-core's own ``initialize_model_parallel``, reading the groups from its module
globals and then taking them explicitly, and after ``parallel_state.initialize_model_parallel``
(which bridges megatron-core's globals to this project's groups), the same two ways. Explicitly
means ``tp_group=`` and ``pg_collection=``: megatron-core's ``ProcessGroupCollection.use_mpu_process_groups()``
on its own groups, ``parallel_state.process_group_collection()`` (megatron-core's class, filled from
parallel_state's groups) on ours, which is how newer megatron-core model code receives its groups;
where a piece wants a collection and has no global fallback (the MoE router and experts),
the globals run uses megatron-core's own ``moe_utils.get_default_pg_collection()``. Outputs and
gradients must be ``torch.equal``: the same groups give the same ranks, the same shards and the
same reduction order, hence the same bits.

What is compared, on tp2 (2 ranks), tp2-pp2 (4) and tp2-cp2-pp2-vpp2-ep2 (8):

- tensor-parallel layers, sequence parallel off: ``VocabParallelEmbedding`` -> ``ColumnParallelLinear``
  -> gelu -> ``RowParallelLinear``: output, input and every weight and bias gradient (and, as a
  check that they did tensor-parallel work, within 1e-5 of the same computation on one process);
- ``tensor_parallel.vocab_parallel_cross_entropy``, label smoothing 0 and 0.1: losses and logit
  gradients (within 1e-5 of ``F.cross_entropy`` too);
- ``transformer.mlp.MLP`` from the local spec, gelu and swiglu (whose fc1 is sharded with stride 2):
  output, bias, input and every parameter gradient;
- the pipeline: ``get_forward_backward_func``'s choice (pp 1, pp 2, pp 2 with vpp 2), the stage
  helpers of ``pipeline_parallel.utils`` and ``P2PCommunicator``'s neighbours;
- ``distributed.finalize_model_grads`` over one chunk per virtual stage holding a tied word
  embedding, a sequence-parallel norm, a tp-averaged weight and a conditional embedder replicated
  on every stage: every gradient after it, and ``num_tokens``;
- MoE, on 8 ranks: ``TopKRouter.routing`` with aux, seq-aux and z losses (probs, routing map, logit
  gradients), ``moe_utils.reduce_aux_losses_tracker_across_ranks`` (the tracked losses),
  ``moe_utils.get_updated_expert_bias`` and ``experts.SequentialMLP`` (outputs and gradients).

finalize_model_grads runs over a model wrapped in a subclass of megatron-core's own
``_BaseDataParallel`` that supplies what ``DistributedDataParallel`` gives it on a GPU
(``ddp_config``, ``main_grad`` and ``finish_grad_sync(force_all_reduce=)``, here a no-op): every
reduction of finalize_model_grads itself runs (embedding group, tp, pp, dp x cp for
``num_tokens``), but not DDP's bucketed data-parallel gradient all-reduce, which cannot run here.

What does not run without CUDA (megatron-core 0.16.1, gloo): each of these fails in torch's CUDA
code because it allocates on ``torch.cuda.current_device()`` or ``device="cuda"`` (the all-to-all
dispatcher creates a ``torch.cuda.Stream``). How torch words it depends on the build and the machine:
a CPU build says ``Torch not compiled with CUDA enabled`` (``torch.cuda.Stream requires CUDA support``),
a CUDA build without a driver ``Found no NVIDIA driver on your system``, a machine whose GPUs are
hidden ``No CUDA GPUs are available``. The ranks run with CUDA hidden on every machine, and
``test_cpu_blockers_are_as_documented`` checks that each still fails where stated, for want of CUDA
(an error raised inside ``torch.cuda`` while it is unavailable), so this list stays true and a
release that lifts one is noticed:

- ``ColumnParallelLinear(gather_output=True)``: ``tensor_parallel/mappings.py:91``
  (``_gather_along_last_dim``), in forward.
- ``RowParallelLinear(input_is_parallel=False)``: the same function, in backward (the scatter's gradient).
- sequence parallelism: ``ColumnParallelLinear`` takes its all-gather buffer from
  ``get_global_memory_buffer()``; megatron-core's own buffer allocates on CUDA
  (``utils.py:631``, ``GlobalMemoryBuffer.get_tensor``), parallel_state's lives on the collective
  device, so over our groups the forward runs and the backward fails at ``tensor_parallel/layers.py:552``
  (``LinearWithGradAccumulationAndAsyncCommunication.backward``); ``RowParallelLinear`` and
  ``VocabParallelEmbedding(reduce_scatter_embeddings=True)`` fail at ``tensor_parallel/mappings.py:181``
  (``_reduce_scatter_along_first_dim``).
- the schedules: ``forward_backward_no_pipelining`` at ``pipeline_parallel/schedules.py:596``,
  ``forward_backward_pipelining_with_interleaving`` at ``schedules.py:983`` and
  ``forward_backward_pipelining_without_interleaving`` at ``schedules.py:2138``, each allocating
  ``total_num_tokens`` on ``"cuda"`` before any work; ``P2PCommunicator.recv_forward`` allocates its
  receive buffer at ``pipeline_parallel/p2p_communication.py:313``.
- ``DistributedDataParallel``: its gradient buffer, ``distributed/param_and_grad_buffer.py:806``,
  so finalize_model_grads cannot run over it (see above).
- MoE: ``TopKRouter.forward`` (and so ``MoELayer.forward``) moves the gate weights to CUDA in
  ``gating``, ``transformer/moe/router.py:90``; ``TopKRouter`` with ``moe_router_enable_expert_bias``
  registers CUDA buffers in ``__init__`` (``router.py:169``); ``MoEAllGatherTokenDispatcher.token_dispatch``
  gathers into a CUDA tensor (``tensor_parallel/mappings.py:141``, ``_gather_along_first_dim``);
  ``MoEAlltoAllTokenDispatcher`` creates a ``torch.cuda.Stream()`` in ``__init__``
  (``transformer/moe/token_dispatcher.py:445``).

The ranks are the megatron-core pools of ``conftest.py``: forked after one import of megatron-core,
shared with the other megatron tests.
"""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch

import parallel_state as ps

SECONDS = datetime.timedelta(seconds=60)

# world size -> (label, megatron-core's initialize_model_parallel arguments)
TOPOLOGIES = {
    2: ("tp2", dict(tensor_model_parallel_size=2)),
    4: ("tp2-pp2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    8: ("tp2-cp2-pp2-vpp2-ep2", dict(tensor_model_parallel_size=2, context_parallel_size=2,
                                     pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                     expert_model_parallel_size=2)),
}
SCHEDULES = {2: "forward_backward_no_pipelining", 4: "forward_backward_pipelining_without_interleaving",
             8: "forward_backward_pipelining_with_interleaving"}


def _size(topology, name):
    return topology.get(f"{name}_parallel_size") or 1


def _init(weight):
    return torch.nn.init.normal_(weight, std=0.5)


def _seed_of(group) -> int:
    """A seed shared by the members of ``group`` and different for every other group of its kind.

    Inputs that the members of a tensor-parallel group must share (they are replicated across it)
    are drawn from this, so a rank put in the wrong group would compute on other data.
    """
    import torch.distributed as dist

    return 1000 + min(dist.get_process_group_ranks(group))


def _tp_group(pg):
    import megatron.core.parallel_state as mps

    return mps.get_tensor_model_parallel_group() if pg is None else pg.tp


def _grads(module, prefix):
    return {f"{prefix}.{name}.grad": p.grad for name, p in module.named_parameters()}


# --- the pieces: each takes pg (None: groups from megatron-core's globals) and the topology ---------

def piece_tp_layers(pg, topology):
    """Embedding -> column -> gelu -> row, forward and backward; and the same on one process."""
    from megatron.core import ModelParallelConfig
    from megatron.core import tensor_parallel as tpl

    tp_group = None if pg is None else pg.tp
    group = _tp_group(pg)
    config = ModelParallelConfig(tensor_model_parallel_size=_size(topology, "tensor_model"),
                                 use_cpu_initialization=True, perform_initialization=True,
                                 params_dtype=torch.float32)
    torch.manual_seed(0)
    emb = tpl.VocabParallelEmbedding(12, 8, init_method=_init, config=config, tp_group=tp_group)
    torch.manual_seed(1)
    col = tpl.ColumnParallelLinear(8, 16, config=config, init_method=_init, bias=True, gather_output=False,
                                   keep_master_weight_for_test=True, tp_group=tp_group)
    torch.manual_seed(2)
    row = tpl.RowParallelLinear(16, 8, config=config, init_method=_init, bias=True, input_is_parallel=True,
                                skip_bias_add=False, keep_master_weight_for_test=True, tp_group=tp_group)
    gen = torch.Generator().manual_seed(_seed_of(group))
    ids = torch.randint(0, 12, (4, 2), generator=gen)
    x = emb(ids)
    x.retain_grad()
    hidden, _ = col(x)
    y, _ = row(torch.nn.functional.gelu(hidden))
    weights = torch.randn(y.shape, generator=gen)
    (y * weights).sum().backward()
    out = {"y": y.detach(), "x.grad": x.grad, **_grads(emb, "emb"), **_grads(col, "col"), **_grads(row, "row")}

    # One process, full weights: what tensor parallelism must reproduce up to rounding.
    torch.manual_seed(0)
    table = _init(torch.empty(12, 8)).requires_grad_()
    w_col = col.master_weight.clone().requires_grad_()
    w_row = row.master_weight.clone().requires_grad_()
    y_ref = torch.nn.functional.gelu(table[ids] @ w_col.T) @ w_row.T
    (y_ref * weights).sum().backward()
    rows = col.output_size_per_partition
    shard = slice(group.rank() * rows, (group.rank() + 1) * rows)
    out["one_process_diff"] = max(
        (y - y_ref).abs().max().item(),
        (emb.weight.grad - table.grad[emb.vocab_start_index:emb.vocab_end_index]).abs().max().item(),
        (col.weight.grad - w_col.grad[shard]).abs().max().item(),
        (row.weight.grad - w_row.grad[:, shard]).abs().max().item(),
    )
    return out


def piece_cross_entropy(pg, topology):
    """vocab_parallel_cross_entropy (it takes no group: megatron-core's globals only)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    group = _tp_group(None)
    gen = torch.Generator().manual_seed(_seed_of(group))
    logits = torch.randn(4, 2, 16, generator=gen)
    target = torch.randint(0, 16, (4, 2), generator=gen)
    weights = torch.rand(4, 2, generator=gen)
    out = {}
    for smoothing in (0.0, 0.1):
        part = logits.chunk(group.size(), dim=-1)[group.rank()].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(part.clone(), target, smoothing)  # it works in place on its input
        (loss * weights).sum().backward()
        out[f"loss@{smoothing}"], out[f"grad@{smoothing}"] = loss.detach(), part.grad
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 16), target.view(-1), reduction="none").view(4, 2)
    out["one_process_diff"] = (out["loss@0.0"] - ref).abs().max().item()
    return out


def piece_mlp(pg, topology):
    """MLP from the local (non-Transformer-Engine) spec, gelu and swiglu, forward and backward."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    out = {}
    gen = torch.Generator().manual_seed(_seed_of(_tp_group(pg)))
    for name, extra in (("gelu", {}), ("swiglu", dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu))):
        config = TransformerConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                                   tensor_model_parallel_size=_size(topology, "tensor_model"),
                                   use_cpu_initialization=True, add_bias_linear=True, **extra)
        torch.manual_seed(3)
        # The local spec's modules, built directly: get_mlp_module_spec(use_te=False) gives them as a ModuleSpec
        # up to 0.18 and as a TransformerLayer builder in 0.19 (python -m tests.oracles test runs every release).
        mlp = MLP(config=config, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                  ffn_hidden_size=16, tp_group=None if pg is None else pg.tp)
        x = torch.randn(4, 2, 8, generator=gen, requires_grad=True)
        y, bias = mlp(x)
        ((y + bias) * torch.randn(y.shape, generator=gen)).sum().backward()
        out.update({f"{name}.y": y.detach(), f"{name}.bias": bias.detach(), f"{name}.x.grad": x.grad,
                    **_grads(mlp, name)})
    return out


def piece_schedules(pg, topology):
    """The schedule megatron-core picks, its stage helpers, and the p2p communicator's neighbours."""
    import megatron.core.parallel_state as mps
    from megatron.core import ModelParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if pg is None:
        pp_group, choose = mps.get_pipeline_model_parallel_group(), get_forward_backward_func
    else:
        pp_group = pg.pp
        vp = topology.get("virtual_pipeline_model_parallel_size")

        def choose():
            return get_forward_backward_func(pp_size=pp_group.size(), vp_size=vp)

    p2p = P2PCommunicator(pp_group, ModelParallelConfig(pipeline_model_parallel_size=pp_group.size(),
                                                        pipeline_dtype=torch.float32))
    return {"schedule": choose().__name__, "first_stage": pp_utils.is_pp_first_stage(pp_group),
            "last_stage": pp_utils.is_pp_last_stage(pp_group), "first_rank": pp_utils.get_pp_first_rank(pp_group),
            "last_rank": pp_utils.get_pp_last_rank(pp_group), "next_rank": pp_utils.get_pp_next_rank(pp_group),
            "prev_rank": pp_utils.get_pp_prev_rank(pp_group), "p2p": (p2p.next_rank, p2p.prev_rank)}


def piece_finalize_model_grads(pg, topology):
    """finalize_model_grads over one model chunk per virtual stage, each with every reduced kind of weight."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel as tpl
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    tp, pp = _size(topology, "tensor_model"), _size(topology, "pipeline_model")
    vpp = topology.get("virtual_pipeline_model_parallel_size")
    config = TransformerConfig(num_layers=pp * (vpp or 1), hidden_size=8, num_attention_heads=2,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
                               sequence_parallel=tp > 1, use_cpu_initialization=True)
    config.has_cond_embedder = True  # a diffusion model's conditioning embedders, replicated on every stage

    class Chunk(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.pre_process = self.share_embeddings_and_output_weights = True
            self.word_embeddings = tpl.VocabParallelEmbedding(12, 8, init_method=_init, config=config,
                                                              tp_group=None if pg is None else pg.tp)
            self.norm = torch.nn.Parameter(torch.rand(8))  # a norm under sequence parallelism
            self.norm.sequence_parallel = True
            self.gate = torch.nn.Parameter(torch.rand(8))  # averaged over tp
            self.gate.average_gradients_across_tp_domain = True
            self.t_embedder = torch.nn.Parameter(torch.rand(8))  # synced over pp
            self.t_embedder.pipeline_parallel = True

        def shared_embedding_or_output_weight(self):
            return self.word_embeddings.weight

    class Wrapped(_BaseDataParallel):
        """What DistributedDataParallel gives finalize_model_grads, but its gradient all-reduce (CUDA only)."""

        def __init__(self, module):
            super().__init__(config, module)
            self.ddp_config = DistributedDataParallelConfig()

        def finish_grad_sync(self, force_all_reduce=False):
            pass

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(_seed_of(_tp_group(pg)))
    torch.manual_seed(4)
    chunks = [Chunk() for _ in range(vpp or 1)]
    for chunk in chunks:
        hidden = chunk.word_embeddings(torch.randint(0, 12, (3, 2), generator=gen))
        loss = (hidden * chunk.norm + chunk.t_embedder).sum() + (chunk.gate * hidden.detach()).sum()
        (loss * (rank + 1)).backward()  # every rank's gradients differ, so every reduction shows
        for p in chunk.parameters():
            p.main_grad = p.grad
    before = [p.main_grad.clone() for chunk in chunks for p in chunk.parameters()]
    num_tokens = torch.tensor(5 * (rank + 1))
    finalize_model_grads([Wrapped(chunk) for chunk in chunks], num_tokens=num_tokens, pg_collection=pg)
    out = {f"chunk{i}.{name}.main_grad": p.main_grad for i, chunk in enumerate(chunks)
           for name, p in chunk.named_parameters()}
    after = [p.main_grad for chunk in chunks for p in chunk.parameters()]
    out["changed"] = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    out["num_tokens"] = num_tokens
    return out


def piece_moe(pg, topology):
    """The MoE code that runs on a CPU: routing with its losses, the loss tracker, expert bias, experts."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel as tpl
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter

    groups = moe_utils.get_default_pg_collection() if pg is None else pg
    config = TransformerConfig(num_layers=1, hidden_size=8, ffn_hidden_size=8, moe_ffn_hidden_size=8,
                               num_attention_heads=2, tensor_model_parallel_size=_size(topology, "tensor_model"),
                               context_parallel_size=_size(topology, "context"),
                               expert_model_parallel_size=_size(topology, "expert_model"),
                               num_moe_experts=4, moe_router_topk=2, add_bias_linear=False,
                               moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                               moe_aux_loss_coeff=[1e-2, 1e-3], moe_z_loss_coeff=1e-3,
                               use_cpu_initialization=True)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)  # tokens differ on every rank (sequence and context shards)
    out = {}

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    torch.manual_seed(5)
    router = TopKRouter(config, pg_collection=groups)
    router.set_layer_number(1)
    logits = torch.randn(4, 2, 4, generator=gen, requires_grad=True)
    probs, routing_map = router.routing(logits)
    (probs * torch.rand(probs.shape, generator=gen)).sum().backward()
    out.update({"router.probs": probs.detach(), "router.routing_map": routing_map, "router.logits.grad": logits.grad})
    moe_utils.reduce_aux_losses_tracker_across_ranks(pg_collection=pg)
    out.update({f"tracker.{name}": entry["values"].clone() for name, entry in sorted(tracker.items())})
    tracker.clear()

    tokens = torch.randint(0, 9, (2, 4), generator=gen).float()
    out["expert_bias"] = moe_utils.get_updated_expert_bias(tokens, torch.zeros(2, 4), 0.1)
    out["expert_bias.tokens"] = tokens  # all-reduced in place over tp x dp x cp

    torch.manual_seed(6)
    experts = SequentialMLP(2, config, MLPSubmodules(linear_fc1=tpl.ColumnParallelLinear,
                                                     linear_fc2=tpl.RowParallelLinear), pg_collection=groups)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    y, _ = experts(hidden, torch.tensor([2, 4]), torch.rand(6, generator=gen))
    (y * torch.randn(y.shape, generator=gen)).sum().backward()
    out.update({"experts.y": y.detach(), "experts.hidden.grad": hidden.grad, **_grads(experts, "experts")})
    return out


PIECES = {2: ["tp_layers", "cross_entropy", "mlp", "schedules", "finalize_model_grads"],
          4: ["tp_layers", "cross_entropy", "mlp", "schedules", "finalize_model_grads"],
          8: ["tp_layers", "cross_entropy", "mlp", "schedules", "finalize_model_grads", "moe"]}
NO_EXPLICIT_GROUPS = {"cross_entropy"}  # megatron-core 0.16.1's function takes none


# --- what does not run on a CPU ---------------------------------------------------------------------

def _tp_config(**extra):
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True,
                               params_dtype=torch.float32, **extra)


def blocker_column_gather_output():
    from megatron.core import tensor_parallel as tpl

    layer = tpl.ColumnParallelLinear(8, 16, config=_tp_config(), init_method=_init, gather_output=True)
    layer(torch.randn(4, 2, 8))


def blocker_row_scatter_input():
    from megatron.core import tensor_parallel as tpl

    layer = tpl.RowParallelLinear(16, 8, config=_tp_config(), init_method=_init, bias=True,
                                  input_is_parallel=False, skip_bias_add=False)
    x = torch.randn(4, 2, 16, requires_grad=True)
    layer(x)[0].sum().backward()


def blocker_sequence_parallel_column():
    from megatron.core import tensor_parallel as tpl

    layer = tpl.ColumnParallelLinear(8, 16, config=_tp_config(sequence_parallel=True), init_method=_init)
    x = torch.randn(2, 2, 8, requires_grad=True)
    layer(x)[0].sum().backward()


def blocker_sequence_parallel_row():
    from megatron.core import tensor_parallel as tpl

    layer = tpl.RowParallelLinear(16, 8, config=_tp_config(sequence_parallel=True), init_method=_init,
                                  bias=True, input_is_parallel=True, skip_bias_add=False)
    layer(torch.randn(4, 2, 8))


def blocker_embedding_reduce_scatter():
    from megatron.core import tensor_parallel as tpl

    emb = tpl.VocabParallelEmbedding(12, 8, init_method=_init, config=_tp_config(), reduce_scatter_embeddings=True)
    emb(torch.randint(0, 12, (2, 4)))


def _schedule_run(schedule_name, chunks):
    import megatron.core.parallel_state as mps
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=4, hidden_size=4, num_attention_heads=2, use_cpu_initialization=True,
                               tensor_model_parallel_size=mps.get_tensor_model_parallel_world_size(),
                               pipeline_model_parallel_size=mps.get_pipeline_model_parallel_world_size(),
                               virtual_pipeline_model_parallel_size=mps.get_virtual_pipeline_model_parallel_world_size(),
                               pipeline_dtype=torch.float32)

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.model_type, self.input = config, ModelType.encoder_or_decoder, None
            self.linear = torch.nn.Linear(4, 4)

        def set_input_tensor(self, tensor):
            self.input = tensor

        def forward(self, x):
            return self.linear(x if self.input is None else self.input)

    def step(data, model):
        y = model(next(data))
        return y, lambda out: (out.sum(), {"loss": out.sum().detach()})

    model = [Stage() for _ in range(chunks)]
    data = [iter([torch.ones(2, 1, 4)] * 4) for _ in model]
    getattr(schedules, schedule_name)(forward_step_func=step, data_iterator=data if chunks > 1 else data[0],
                                      model=model, num_microbatches=4, seq_length=2, micro_batch_size=1)


def blocker_no_pipelining():
    _schedule_run("forward_backward_no_pipelining", 1)


def blocker_pipelining_without_interleaving():
    _schedule_run("forward_backward_pipelining_without_interleaving", 1)


def blocker_pipelining_with_interleaving():
    _schedule_run("forward_backward_pipelining_with_interleaving", 2)


def blocker_p2p_receive():
    import megatron.core.parallel_state as mps
    from megatron.core import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    p2p = P2PCommunicator(mps.get_pipeline_model_parallel_group(),
                          ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32))
    # Every rank asks to receive (is_first_stage=False), so each fails at the allocation and no sender waits.
    p2p.recv_forward([2, 1, 4], is_first_stage=False)


def blocker_distributed_data_parallel():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               tensor_model_parallel_size=2)
    DistributedDataParallel(config, DistributedDataParallelConfig(), torch.nn.Linear(4, 4))


def _moe_config(**extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                             tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2,
                             num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, **extra)


def blocker_router_forward():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter(_moe_config(), pg_collection=ProcessGroupCollection.use_mpu_process_groups())(torch.randn(4, 2, 8))


def blocker_router_expert_bias():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter(_moe_config(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
               pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def blocker_allgather_dispatcher():
    import megatron.core.parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    first = 2 * mps.get_expert_model_parallel_rank()
    dispatcher = MoEAllGatherTokenDispatcher(2, [first, first + 1], _moe_config(),
                                             pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    routing_map = torch.zeros(8, 4, dtype=torch.bool)
    routing_map[:, :2] = True
    hidden, probs = dispatcher.dispatch_preprocess(torch.randn(4, 2, 8), routing_map, torch.rand(8, 4))
    dispatcher.token_dispatch(hidden, probs)


def blocker_alltoall_dispatcher():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher(2, [0, 1], _moe_config(), pg_collection=ProcessGroupCollection.use_mpu_process_groups())


NO_CUDA = "CUDA unavailable"  # torch.cuda.current_device(), device="cuda", torch.cuda.Stream()

# blocker -> (world size it runs on, why it fails, megatron-core file and function that asks for CUDA)
BLOCKERS = {
    "column_gather_output": (2, NO_CUDA, "tensor_parallel/mappings.py", "_gather_along_last_dim"),
    "row_scatter_input": (2, NO_CUDA, "tensor_parallel/mappings.py", "_gather_along_last_dim"),
    "sequence_parallel_column": (2, NO_CUDA, "tensor_parallel/layers.py", "backward"),
    "sequence_parallel_row": (2, NO_CUDA, "tensor_parallel/mappings.py", "_reduce_scatter_along_first_dim"),
    "embedding_reduce_scatter": (2, NO_CUDA, "tensor_parallel/mappings.py", "_reduce_scatter_along_first_dim"),
    "no_pipelining": (2, NO_CUDA, "pipeline_parallel/schedules.py", "forward_backward_no_pipelining"),
    "distributed_data_parallel": (2, NO_CUDA, "distributed/param_and_grad_buffer.py", "__init__"),
    "pipelining_without_interleaving": (4, NO_CUDA, "pipeline_parallel/schedules.py",
                                        "forward_backward_pipelining_without_interleaving"),
    "p2p_receive": (4, NO_CUDA, "pipeline_parallel/p2p_communication.py", "create_tensor_recv_prev"),
    "pipelining_with_interleaving": (8, NO_CUDA, "pipeline_parallel/schedules.py",
                                     "forward_backward_pipelining_with_interleaving"),
    "router_forward": (8, NO_CUDA, "transformer/moe/router.py", "gating"),
    "router_expert_bias": (8, NO_CUDA, "transformer/moe/router.py", "__init__"),
    "allgather_dispatcher": (8, NO_CUDA, "tensor_parallel/mappings.py", "_gather_along_first_dim"),
    "alltoall_dispatcher": (8, NO_CUDA, "transformer/moe/token_dispatcher.py", "__init__"),
}


def _where_it_failed(exc):
    """``(why, megatron-core file, function)``: ``why`` is NO_CUDA for an error torch.cuda raised while CUDA
    is unavailable (whatever the build's wording), else the error itself; the file and function are
    the innermost megatron-core frame's."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    cuda_dir = os.path.dirname(torch.cuda.__file__) + os.sep
    why = NO_CUDA if frames and frames[-1].filename.startswith(cuda_dir) and not torch.cuda.is_available() else \
        f"{type(exc).__name__}: {exc}"
    ours = [f for f in frames if "/megatron/core/" in f.filename]
    last = ours[-1] if ours else None
    path = last.filename.split("/megatron/core/")[-1] if last else None
    return why, path, last.name if last else None


# --- the worker ---------------------------------------------------------------------------------------

def _run_pieces(names, topology, collection):
    """Every piece twice: groups from megatron-core's globals, then passed explicitly (``collection()``)."""
    out = {}
    for name in names:
        fn = globals()[f"piece_{name}"]
        runs = [("", None)]
        if name not in NO_EXPLICIT_GROUPS:
            runs.append(("[pg]", collection()))
        for suffix, pg in runs:
            for key, value in fn(pg, topology).items():
                out[f"{name}{suffix}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out


def case_model_code(world, topology, names, blockers):
    """megatron-core's model code on its own groups, then on ours; then the CPU blockers, on ours."""
    import megatron.core.parallel_state as mps
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed import distributed_c10d as c10d

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's deprecation notices for tp_group=None and the like
        before = set(c10d._world.pg_map)
        mps.initialize_model_parallel(**topology)
        try:
            theirs = _run_pieces(names, topology, ProcessGroupCollection.use_mpu_process_groups)
        finally:
            # megatron-core's destroy frees only its gloo groups: free the rest for the next case.
            dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
            mps.destroy_model_parallel()
            for pg in set(c10d._world.pg_map) - before:
                dist.destroy_process_group(pg)
        ps.initialize_model_parallel(**topology, timeout=SECONDS)  # bridges megatron-core by itself
        # Ours: megatron-core's ProcessGroupCollection as parallel_state fills it from its own groups.
        ours = _run_pieces(names, topology, ps.process_group_collection)
        failed = {}
        for name in blockers:
            try:
                globals()[f"blocker_{name}"]()
            except Exception as exc:
                failed[name] = _where_it_failed(exc)
            else:
                failed[name] = "ran"
        ps.destroy_model_parallel()
    return dict(theirs=theirs, ours=ours, blockers=failed)


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES), ids=[TOPOLOGIES[w][0] for w in sorted(TOPOLOGIES)])
def run(request, pools):
    world = request.param
    blockers = [name for name, (w, *_) in BLOCKERS.items() if w == world]
    results = pools(world).run(case_model_code, world, TOPOLOGIES[world][1], PIECES[world], blockers, timeout=300)
    return world, results


def _differences(theirs, ours, select):
    """What differs between two runs' results (the keys ``select`` picks), with the largest gap per tensor."""
    wrong = []
    keys = [k for k in sorted(set(theirs) | set(ours)) if select(k)]
    for key in keys:
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape:
                wrong.append(f"{key}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
            elif not torch.equal(a, b):
                wrong.append(f"{key}: max |difference| {(a.double() - b.double()).abs().max().item():.3g}")
        elif type(a) is not type(b) or a != b:
            wrong.append(f"{key}: {a!r} vs {b!r}")
    return keys, wrong


def _globals_run(key):
    return "[pg]" not in key.split(".", 1)[0]


def test_megatron_model_code_computes_the_same_on_our_groups(run):
    world, results = run
    for rank, r in enumerate(results):
        keys, wrong = _differences(r["theirs"], r["ours"], _globals_run)
        assert not wrong, (rank, wrong)
        # Every piece ran and returned its tensors: a comparison of nothing would pass.
        assert {k.split(".", 1)[0] for k in keys} == set(PIECES[world]), (rank, keys)
        assert sum(isinstance(r["ours"][k], torch.Tensor) for k in keys) > 20


def test_groups_passed_explicitly_give_the_same_results(run):
    world, results = run
    for rank, r in enumerate(results):
        keys, wrong = _differences(r["theirs"], r["ours"], lambda k: not _globals_run(k))
        assert not wrong, (rank, wrong)
        assert {k.split(".", 1)[0] for k in keys} == {f"{p}[pg]" for p in PIECES[world]} - {
            f"{p}[pg]" for p in NO_EXPLICIT_GROUPS}, (rank, keys)


def test_the_model_code_did_parallel_work(run):
    """Not a vacuous comparison: the layers match one process, the schedule fits, finalize reduced."""
    world, results = run
    for rank, r in enumerate(results):
        for side in ("theirs", "ours"):
            got = r[side]
            for key in ("tp_layers.one_process_diff", "tp_layers[pg].one_process_diff",
                        "cross_entropy.one_process_diff"):
                assert got[key] < 1e-5, (rank, side, key, got[key])
            assert got["schedules.schedule"] == got["schedules[pg].schedule"] == SCHEDULES[world]
            assert got["finalize_model_grads.changed"] and got["finalize_model_grads[pg].changed"], (rank, side)


def test_cpu_blockers_are_as_documented(run):
    """Each piece the module docstring lists as CUDA-only still fails there, on every rank."""
    world, results = run
    expected = {name: (why, path, fn) for name, (w, why, path, fn) in BLOCKERS.items() if w == world}
    for rank, r in enumerate(results):
        assert r["blockers"] == expected, rank
