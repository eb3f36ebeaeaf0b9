"""Cross attention to a text context in megatron-core TransformerLayers, as NeMo DFM's Wan and DiT layers use it.

A layer of the shape of DFM's ``WanLayerWithAdaLN`` (written here): adaptive layer norm from a timestep
embedding, a self attention with RoPE over the video tokens, a cross attention from the video tokens to the
text context (megatron-core's ``CrossAttention``, ``key_value_states=context``), an MLP; two of them, with
``cp.megatron.swap_core_attention`` on the spec, in float64 on megatron-core 0.16.1's own ``SelfAttention`` /
``CrossAttention`` / ``TransformerLayer``. The video tokens and the text are both split across the cp ranks as
DFM splits them (thd: per sample by DualChunkSwap over each side's padded cu_seqlens, ``thd_split_inputs_cp``;
sbhd: the video by megatron-core's DualChunkSwap, the text contiguously). At cp 4, sbhd and thd, p2p, all_gather,
a2a and a2a+p2p over [2, 2] (at cp 2 a sample of them), the loss, the output and every gradient (every
parameter's, the video's and the text context's) equal the same layers at cp 1 (float64, 1e-10 relative); at
cp 1, sbhd, the swapped layers equal megatron-core's own local core attention. One 4-rank pool call runs every case.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import parallel_state as ps
from benchmarks.megatron_gpt import cpu_as_cuda

HIDDEN, HEADS, LAYERS = 32, 4, 2  # no GQA: megatron-core's CrossAttention refuses it
SBHD = dict(seq=16, text=8, batch=2)
#: thd: each sample's (real, padded) video and text lengths; padded to multiples of 2 * 4 (cp 4's rule)
THD_VIDEO = ([13, 8], [16, 8])
THD_TEXT = ([5, 8], [8, 8])
# (topology, cp_comm_type, format); every one against cp 1
TOPOLOGIES = {"cp2": dict(context_parallel_size=2), "cp4": dict(context_parallel_size=4),
              "cp4-hcp2x2": dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])}
CASES = [("cp2", "p2p", "sbhd"), ("cp2", "all_gather", "thd"), ("cp2", "a2a", "thd")]
CASES += [("cp4", comm, fmt) for comm in ("p2p", "all_gather", "a2a") for fmt in ("sbhd", "thd")]
CASES += [("cp4-hcp2x2", "a2a+p2p", "thd"), ("cp4-hcp2x2", "a2a+p2p", "sbhd")]
TOLERANCE = 1e-10


def _layer_class():
    """DFM's Wan layer, in outline: adaLN (shift, scale, gate from a timestep embedding) around the self attention
    and the MLP, a plain norm before the cross attention to the context."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class AdaLNLayer(TransformerLayer):
        def __init__(self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None,
                     vp_stage=None):
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             hidden_dropout=hidden_dropout)
            self.modulation = torch.nn.Parameter(torch.randn(1, 6, config.hidden_size, dtype=config.params_dtype)
                                                 / config.hidden_size ** 0.5)

        def forward(self, hidden_states, attention_mask=None, context=None, rotary_pos_emb=None,
                    packed_seq_params=None, **kwargs):
            timestep = attention_mask  # as DFM: the timestep embedding rides in attention_mask
            shift, scale, gate, shift2, scale2, gate2 = (self.modulation + timestep).transpose(0, 1).chunk(6)
            x = self.input_layernorm(hidden_states) * (1 + scale) + shift
            out, bias = self.self_attention(x, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
                                            packed_seq_params=packed_seq_params["self_attention"])
            hidden_states = hidden_states + gate * (out + bias)
            out, bias = self.cross_attention(self.pre_cross_attn_layernorm(hidden_states), attention_mask=None,
                                             key_value_states=context,
                                             packed_seq_params=packed_seq_params["cross_attention"])
            hidden_states = hidden_states + out + bias
            out, bias = self.mlp(self.pre_mlp_layernorm(hidden_states) * (1 + scale2) + shift2)
            return hidden_states + gate2 * (out + bias), context

    return AdaLNLayer


def _spec(fmt, swap=True):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import (
        CrossAttention,
        CrossAttentionSubmodules,
        SelfAttention,
        SelfAttentionSubmodules,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    import cp.megatron

    params = {"attn_mask_type": AttnMaskType.padding if fmt == "thd" else AttnMaskType.no_mask}  # DFM: padding
    spec = ModuleSpec(module=_layer_class(), submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SelfAttention, params=params, submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention, linear_proj=RowParallelLinear)),
        pre_cross_attn_layernorm=WrappedTorchNorm,
        cross_attention=ModuleSpec(module=CrossAttention, params=params, submodules=CrossAttentionSubmodules(
            linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear, core_attention=DotProductAttention,
            linear_proj=RowParallelLinear)),
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear))))
    return cp.megatron.swap_core_attention(spec) if swap else spec


def _data(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cumulative(lengths):
    return torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)


def _workload(fmt, n, rank):
    """The whole inputs (video, text, timestep, output gradient), this rank's index of the video and of the text,
    and the packed_seq_params per attention (DFM's dict)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    import cp

    if fmt == "sbhd":
        s, c, b = SBHD["seq"], SBHD["text"], SBHD["batch"]
        video, text = _data((s, b, HIDDEN), 1), _data((c, b, HIDDEN), 2)
        timestep, dout = _data((b, 6, HIDDEN), 3), _data((s, b, HIDDEN), 4)
        iv = cp.plan_dual_chunk_swap(cp.Mask.full(), s, n).index(rank)
        it = torch.arange(rank * c // n, (rank + 1) * c // n)
        return video, text, timestep, dout, iv, it, {"self_attention": None, "cross_attention": None}
    (vreal, vroom), (treal, troom) = THD_VIDEO, THD_TEXT
    cu_v, pad_v, cu_t, pad_t = (_cumulative(x) for x in (vreal, vroom, treal, troom))
    video, text = _data((sum(vroom), 1, HIDDEN), 1), _data((sum(troom), 1, HIDDEN), 2)
    timestep, dout = _data((1, 6, HIDDEN), 3), _data((sum(vroom), 1, HIDDEN), 4)
    iv = cp.plan_dual_chunk_swap(cp.Mask.full(), sum(vroom), n, cu_seqlens=pad_v.tolist()).index(rank)
    it = cp.plan_dual_chunk_swap(cp.Mask.full(), sum(troom), n, cu_seqlens=pad_t.tolist()).index(rank)
    real = torch.zeros(sum(vroom), 1, 1, dtype=torch.bool)
    for start, length in zip(pad_v.tolist(), vreal, strict=False):
        real[start:start + length] = True
    dout = dout * real  # the loss reads real video tokens only
    packed = {"self_attention": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_v, cu_seqlens_kv=cu_v,
                                                cu_seqlens_q_padded=pad_v, cu_seqlens_kv_padded=pad_v,
                                                max_seqlen_q=max(vroom), max_seqlen_kv=max(vroom)),
              "cross_attention": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_v, cu_seqlens_kv=cu_t,
                                                 cu_seqlens_q_padded=pad_v, cu_seqlens_kv_padded=pad_t,
                                                 max_seqlen_q=max(vroom), max_seqlen_kv=max(troom))}
    return video, text, timestep, dout, iv, it, packed


def _run(fmt, parallel, comm, swap=True):
    """Two layers on this rank's video and text tokens, one backward: the loss, the whole output, the whole
    gradients of the video and the text, and every parameter's gradient summed over the cp group."""
    import megatron.core.parallel_state as mps
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    import cp

    group = mps.get_context_parallel_group()
    n, rank = group.size(), group.rank()
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # as benchmarks/megatron_gpt.py
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               ffn_hidden_size=2 * HIDDEN, attention_dropout=0.0,
                               hidden_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True,
                               init_method_std=0.3, cp_comm_type=comm, **parallel)
    torch.manual_seed(7)
    layers = torch.nn.ModuleList(build_module(_spec(fmt, swap), config=config, layer_number=i + 1)
                                 for i in range(LAYERS)).to(torch.float64)
    video, text, timestep, dout, iv, it, packed = _workload(fmt, n, rank)
    rope = RotaryEmbedding(HIDDEN // HEADS, 1.0, use_cpu_initialization=True, cp_group=group)
    x = video.index_select(0, iv).requires_grad_(True)
    ctx = text.index_select(0, it).requires_grad_(True)
    h = x
    with cpu_as_cuda(), cp.count_attention() as count:
        emb = rope(max(THD_VIDEO[1]), packed_seq=True) if fmt == "thd" else rope(SBHD["seq"])
        for layer in layers:
            h, _ = layer(h, attention_mask=timestep, context=ctx, rotary_pos_emb=emb, packed_seq_params=packed)
        loss = (h * dout.index_select(0, iv)).sum()
        loss.backward()

    def whole(local, index, like):
        out = torch.zeros_like(like)
        out.index_copy_(0, index, local.detach())
        dist.all_reduce(out, group=group)
        return out

    got = {"loss": loss.detach().clone(), "output": whole(h, iv, video), "video grad": whole(x.grad, iv, video),
           "text grad": whole(ctx.grad, it, text)}
    dist.all_reduce(got["loss"], group=group)
    for name, p in layers.named_parameters():
        assert p.grad is not None, name
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        got[name] = g
    cores = [(type(c).__module__, getattr(c, "cp_comm_type", None))
             for layer in layers for c in (layer.self_attention.core_attention, layer.cross_attention.core_attention)]
    return got, cores, count.calls


def _difference(got, want):
    """The largest difference of any compared tensor, relative to that tensor's largest entry."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-300)).item() for k in want)


def case_dfm(cases):
    """cp 1 (the reference, and megatron-core's own core attention on sbhd), then every case by topology."""
    warnings.simplefilter("ignore")  # megatron-core's deprecation notices
    ps.initialize_model_parallel()
    try:
        refs = {fmt: _run(fmt, {}, None)[0] for fmt in ("sbhd", "thd")}
        out = {"megatron's own": _difference(_run("sbhd", {}, None, swap=False)[0], refs["sbhd"])}
    finally:
        ps.destroy_model_parallel()
    by_topology: dict[str, list] = {}
    for topology, comm, fmt in cases:
        by_topology.setdefault(topology, []).append((comm, fmt))
    for topology, group in by_topology.items():
        ps.initialize_model_parallel(**TOPOLOGIES[topology])
        try:
            for comm, fmt in group:
                got, cores, calls = _run(fmt, TOPOLOGIES[topology], comm)
                out[(topology, comm, fmt)] = (_difference(got, refs[fmt]), cores, calls)
        finally:
            ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results(pools):
    return pools(4).run(case_dfm, CASES, timeout=300)


def test_swapped_layers_at_cp1_equal_megatron_cores_own_core_attention(results):
    for rank, r in enumerate(results):
        assert r["megatron's own"] <= TOLERANCE, (rank, r["megatron's own"])


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_dfm_layers_with_text_split_over_the_cp_ranks_equal_cp1(results, case):
    for rank, r in enumerate(results):
        difference, cores, calls = r[case]
        assert difference <= TOLERANCE, (rank, case, difference)
        assert cores == [("cp.megatron.core_attention", case[1])] * 2 * LAYERS, (rank, cores)
        assert calls == 2 * LAYERS, (rank, calls)  # self and cross attention of each layer ran on cp's engine


# --- in the driver: a mask is for self attention ------------------------------------------------------------


def test_a_mask_goes_to_the_self_attentions_only_and_a_cross_attention_given_one_says_so():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import cp
    import cp.megatron

    mask = cp.Mask.chunk_causal(4)
    swapped = cp.megatron.swap_core_attention(_spec("sbhd", swap=False), mask=mask).submodules
    assert swapped.self_attention.submodules.core_attention == ModuleSpec(module=cp.megatron.DotProductAttention,
                                                                         params={"mask": mask})
    assert swapped.cross_attention.submodules.core_attention is cp.megatron.DotProductAttention
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS)
    with pytest.raises(ValueError, match="applies to self attention only, and this is a cross attention; build it "
                                         "without mask="):
        cp.megatron.DotProductAttention(config, 1, AttnMaskType.no_mask, "cross", mask=mask)
