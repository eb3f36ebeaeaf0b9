"""``cp.megatron.DotProductAttention`` in megatron-core's GPTModel, trained by megatron-core's own step.

One pool call on 4 gloo ranks runs every case (benchmarks/megatron_gpt.py: ``get_batch_on_this_cp_rank``,
``get_forward_backward_func``'s schedule with a per-token loss, ``finalize_model_grads``): first the references,
megatron-core's own local attention at cp 1 (every rank data parallel), then the same float64 GPTModel from
``get_gpt_layer_local_spec()`` with cp's core attention swapped in, on every topology and ``cp_comm_type``.
Each case's loss and every parameter's whole gradient are compared with the reference's:

- causal: cp 2 (dp 2), cp 4, tp 2 x cp 2 and cp 4 as a2a x p2p = [2, 2]; p2p, all_gather, a2a and a2a+p2p,
  None (p2p) and a list per layer; GQA (2 query groups; at cp 4 a2a replicates them; 1 group at tp 2, where
  megatron-core hands the core attention a config copy with ``num_query_groups = tp``);
- ``mask=cp.Mask.chunk_causal(n)`` against megatron-core's attention given the dense chunk-causal mask;
- packed sequences (thd, padded): each pack against its sequences run one by one;
- hybrid context parallelism: each sample's group through ``packed_seq_params.cp_group`` (megatron-core's own
  slicing of the installed release), against every sample at cp 1.

Each case also reports which core attention every layer built, with which comm type and groups, and the
attention pairs cp's engine computed (so a case cannot pass by running megatron-core's attention). Then the
errors, each raised alike on every rank before any communication, and, on one attention layer, the per-call
override ``local_cp_size=1``. In the driver: the spec swap and the signatures against megatron-core's source
(that ``import cp`` loads no megatron-core is test_groups_scale.py's import test). Last, the example.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import parallel_state as ps
from benchmarks.megatron_gpt import Model, difference, dp_share, global_batch, release, train_step

#: Loss (relative) and gradient (relative to each gradient's largest entry) agreement of a float64 model whose
#: cross entropy runs in float32.
TOLERANCE = 1e-6
CHUNK = 4  # tokens per chunk of the chunk-causal mask

# name -> (initialize_model_parallel keywords, TransformerConfig keywords)
TOPOLOGIES = {
    "cp2-dp2": (dict(context_parallel_size=2), dict(context_parallel_size=2)),
    "cp4": (dict(context_parallel_size=4), dict(context_parallel_size=4)),
    "tp2-cp2": (dict(tensor_model_parallel_size=2, context_parallel_size=2),
                dict(tensor_model_parallel_size=2, context_parallel_size=2)),
    "cp4-hcp2x2": (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]),
                   dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])),
    "hybrid": (dict(hybrid_context_parallel=True), {}),  # cp 1, dp 4: per-sample groups of the dp x cp ranks
}
# (topology, cp_comm_type, data): "causal" the local spec's causal attention on the global batch, "mqa" the same
# with one query group, "chunk" the chunk-causal mask, "thd" a pack of padded sequences per data-parallel rank,
# "hybrid" per-sample groups
CASES = [
    ("cp2-dp2", "p2p", "causal"), ("cp2-dp2", "all_gather", "chunk"), ("cp2-dp2", "a2a", "causal"),
    ("cp2-dp2", None, "causal"), ("cp2-dp2", "p2p", "thd"),
    ("cp4", "p2p", "chunk"), ("cp4", "all_gather", "causal"), ("cp4", "a2a", "causal"),
    ("tp2-cp2", "p2p", "causal"), ("tp2-cp2", "all_gather", "causal"), ("tp2-cp2", "a2a", "chunk"),
    ("tp2-cp2", "a2a", "mqa"),
    ("cp4-hcp2x2", "a2a+p2p", "causal"), ("cp4-hcp2x2", "a2a+p2p", "chunk"),
    ("cp4-hcp2x2", ["a2a+p2p", "p2p"], "causal"),
    ("hybrid", None, "hybrid"),
]
# name -> (topology, cp_comm_type, data, what every rank's error must say)
ERRORS = {
    "no hierarchical groups": ("cp4", "a2a+p2p", "causal", "ValueError: cp.megatron.DotProductAttention: "
                               "cp_comm_type='a2a+p2p' needs the hierarchical context-parallel groups"),
    "unknown comm type": ("cp2-dp2", "ring", "causal", "ValueError: DotProductAttention.set_context_parallel_group: "
                          "unsupported communication type cp_comm_type='ring'"),
    "heads for a2a": ("cp4", "a2a", "heads2", "scatters heads over 4 ranks, but q has 2 heads"),
    "dropout": ("cp2-dp2", "p2p", "dropout", "attention_dropout=0.1 (set attention_dropout=0.0"),
    "thd with a mask": ("cp2-dp2", "p2p", "thd-mask", "with packed sequences (qkv_format='thd') is not supported"),
    "qk_clip": ("cp2-dp2", "p2p", "qk_clip", "qk_clip and log_max_attention_logit need the attention's largest"),
}
PACKS = ([5, 9], [7, 3])  # real sequence lengths of each data-parallel rank's thd pack
HYBRID = ([16, 16], [8, 8, 8, 8])  # the samples of the two micro-batches: over 2 ranks each, then 1 each


def _dense_mask(data: str, model: Model, samples: int) -> torch.Tensor:
    """megatron-core's dense attention mask, [b, 1, s, s], True where masked out: causal as pretrain_gpt.py's
    ``get_ltor_masks_and_position_ids`` makes it (the face must ignore it), or chunk-causal (for the reference)."""
    import cp

    mask = cp.Mask.chunk_causal(CHUNK) if data == "chunk" else cp.Mask.causal()
    return (~mask.dense(model.seq)).expand(samples, 1, -1, -1).contiguous()


def _model(data) -> Model:
    # hybrid: learned positions, because megatron-core 0.18+ passes hybrid samples as thd, and its attention
    # rotates thd by pg_collection.cp (size 1 here), not by the sample's group
    return {"mqa": Model(query_groups=1), "heads2": Model(heads=2, query_groups=2),
            "hybrid": Model(position_embedding="learned_absolute"),
            "dropout": Model(config={"attention_dropout": 0.1}), "qk_clip": Model(config={"qk_clip": True})
            }.get(data, Model())


def _spec(data):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import cp
    import cp.megatron

    mask = cp.Mask.chunk_causal(CHUNK) if data in ("chunk", "thd-mask") else None
    return cp.megatron.swap_core_attention(get_gpt_layer_local_spec(), mask=mask)


def _workload(data, model, cp_size):
    """This rank's micro-batches and their cut for a case's data."""
    import megatron.core.parallel_state as mps
    import torch.distributed as dist

    from benchmarks import megatron_gpt as mg

    if data.startswith("thd"):
        dp = mps.get_data_parallel_rank()
        packed, cu, padded = mg.pack(mg.sequences(PACKS[dp], seed=10 + dp), 2 * cp_size)
        return [packed], mg.thd_slice(cu, padded)
    if data == "hybrid":
        rank = dist.get_rank()
        pairs, singles = (mg.sequences(lengths, seed=20 + i) for i, lengths in enumerate(HYBRID))
        cuts = iter([mg.hybrid_slice(2), mg.hybrid_slice(1)])
        return [pairs[rank // 2], singles[rank]], lambda batch: next(cuts)(batch)
    batch = dict(global_batch(model, 4), attention_mask=_dense_mask(data, model, 4))
    return dp_share(batch), mg.cp_slice


def _references():
    """megatron-core's own attention at cp 1 (dp 4, every rank the whole work): the global batch causal,
    with one query group and chunk-causal, every thd pack's sequences one by one, every hybrid sample one by one."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from benchmarks import megatron_gpt as mg

    spec, model = get_gpt_layer_local_spec(), Model()
    batch = dict(global_batch(model, 4), attention_mask=_dense_mask("causal", model, 4))
    chunked = dict(batch, attention_mask=_dense_mask("chunk", model, 4))
    thd = [seq for dp, lengths in enumerate(PACKS) for seq in mg.sequences(lengths, seed=10 + dp)]
    hybrid = [seq for i, lengths in enumerate(HYBRID) for seq in mg.sequences(lengths, seed=20 + i)]
    # every rank runs all of it: the gradients' all-reduce over dp 4 then averages four equal copies
    return {"causal": train_step(model, spec, {}, [batch]), "chunk": train_step(model, spec, {}, [chunked]),
            "mqa": train_step(_model("mqa"), spec, {}, [batch]), "thd": train_step(model, spec, {}, thd),
            "hybrid": train_step(_model("hybrid"), spec, {}, hybrid)}


def _groups(group):
    sizes = [g.size() for g in group] if isinstance(group, list) else None if group is None else group.size()
    return sizes


def _run(topology, comm, data):
    """One case on the live topology: its step's differences from nothing yet, its layers and its engine count."""
    import cp

    _, parallel = TOPOLOGIES[topology]
    model = _model(data)
    micro_batches, cut = _workload(data, model, parallel.get("context_parallel_size", 1))
    with cp.count_attention() as count:
        got = train_step(model, _spec(data), dict(parallel, cp_comm_type=comm), micro_batches, cut=cut)
    cores = [layer.self_attention.core_attention for layer in got.pop("model").decoder.layers]
    got["cores"] = [(type(c).__module__ + "." + type(c).__name__, c.cp_comm_type, _groups(c.cp_group),
                     c.num_gqa_groups, c.mask is not None) for c in cores]
    got["pairs"], got["calls"] = count.pairs, count.calls
    return got


def _layer_checks():
    """On cp 2: one SelfAttention of the swapped local spec, called with whole sequences, with and without
    ``packed_seq_params.local_cp_size=1``, beside the same layer whose config turns context parallelism off."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.spec_utils import build_module

    import cp.megatron
    from benchmarks import megatron_gpt as mg

    spec = cp.megatron.swap_core_attention(get_gpt_layer_local_spec()).submodules.self_attention
    hidden = torch.randn(16, 2, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = {}
    for name, size in (("cp1", 1), ("cp2", 2)):
        torch.manual_seed(5)
        layer = build_module(spec, config=mg.build_config(Model(), context_parallel_size=size),
                             layer_number=1).to(torch.float64)
        out[name] = layer(hidden, attention_mask=None)[0].detach()
        if size == 2:
            off = PackedSeqParams(qkv_format="sbhd", local_cp_size=1)
            out["cp2 off"] = layer(hidden, attention_mask=None, packed_seq_params=off)[0].detach()
            out["group after"] = _groups(layer.core_attention.cp_group)
            cu = torch.tensor([0, 5, 16], dtype=torch.int32)  # thd under cp without the padded boundaries
            unpadded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11,
                                       max_seqlen_kv=11)
            for what, x, extra in (("short", hidden[:3], {}),
                                   ("bias", hidden, {"attention_bias": torch.zeros(2, 4, 8, 16)}),
                                   ("unpadded", hidden[:8, :1], {"packed_seq_params": unpadded})):
                try:
                    layer(x, attention_mask=None, **extra)
                    out[what] = "no error"
                except Exception as exc:  # noqa: BLE001
                    out[what] = f"{type(exc).__name__}: {exc}"
    return out


def _global_state_checks(topology):
    """The face built without ``pg_collection`` takes megatron-core's global groups (and none when the config
    turns context parallelism off); what it holds, per topology."""
    import megatron.core.parallel_state as mps
    from megatron.core.transformer.enums import AttnMaskType

    import cp.megatron
    from benchmarks import megatron_gpt as mg

    _, parallel = TOPOLOGIES[topology]
    comm = "a2a+p2p" if "hcp" in topology else None
    core = cp.megatron.DotProductAttention(mg.build_config(Model(), **parallel), 1, AttnMaskType.causal, "self",
                                           cp_comm_type=comm)
    off = cp.megatron.DotProductAttention(mg.build_config(Model()), 1, AttnMaskType.causal, "self")
    want = list(mps.get_hierarchical_context_parallel_groups()) if comm else mps.get_context_parallel_group()
    return {"groups": core.cp_group == want and core.tp_group is mps.get_tensor_model_parallel_group(),
            "comm": core.cp_comm_type, "off": off.cp_group is None}


def case_gpt(cases, errors):
    """The references, then every case and every error case by topology; per case its differences from the
    reference (or the error it raised)."""
    warnings.simplefilter("ignore")  # megatron-core's deprecation notices
    ps.initialize_model_parallel()
    try:
        refs = _references()
    finally:
        ps.destroy_model_parallel()
    out, failed = {}, {}
    by_topology: dict[str, list] = {}
    for case in list(cases) + list(errors.values()):
        by_topology.setdefault(case[0], []).append(case[:3])
    for topology, group in by_topology.items():
        ps.initialize_model_parallel(**TOPOLOGIES[topology][0])
        try:
            for _, comm, data in group:
                key = (topology, str(comm), data)
                try:
                    got = _run(topology, comm, data)
                except Exception as exc:  # noqa: BLE001  (reported per case, judged by the test)
                    failed[key] = f"{type(exc).__name__}: {exc}"
                else:
                    out[key] = dict(difference(got, refs[data]), cores=got["cores"], pairs=got["pairs"],
                                    calls=got["calls"])
            if topology == "cp2-dp2":
                out["layer"] = _layer_checks()
            if topology in ("cp2-dp2", "cp4-hcp2x2"):
                out[f"global state {topology}"] = _global_state_checks(topology)
        finally:
            ps.destroy_model_parallel()
    return {"release": release(), "cases": out, "failed": failed}


@pytest.fixture(scope="module")
def results(pools):
    return pools(4).run(case_gpt, CASES, ERRORS, timeout=600)


def _list_fails(release, comm):
    """megatron-core 0.16 indexes a per-layer cp_comm_type list by the 1-based layer number (fixed in 0.17,
    Megatron-LM #3389), so its last layer fails with IndexError before any attention is built."""
    return isinstance(comm, list) and release < (0, 17)


def _work(data, model: Model) -> int:
    """Allowed query-key pairs of the whole global batch, every layer and query head: what cp's engine must
    have computed, summed over the ranks."""
    import cp

    mask = cp.Mask.chunk_causal(CHUNK) if data == "chunk" else cp.Mask.causal()
    return 4 * model.heads * model.layers * mask.work(model.seq)


@pytest.mark.parametrize("case", CASES, ids=[f"{t}-{c}-{d}" for t, c, d in CASES])
def test_gpt_model_trains_as_at_cp1(results, case):
    topology, comm, data = case
    key = (topology, str(comm), data)
    init, parallel = TOPOLOGIES[topology]
    if _list_fails(results[0]["release"], comm):
        for rank, r in enumerate(results):
            assert r["failed"][key].startswith("IndexError: list index out of range"), (rank, r["failed"][key])
        return
    pairs = 0
    for rank, r in enumerate(results):
        assert key not in r["failed"], (rank, r["failed"][key])
        got = r["cases"][key]
        assert got["loss"] < TOLERANCE and got["grads"] < TOLERANCE, (rank, got)
        comms = comm if isinstance(comm, list) else [comm or "p2p"] * Model().layers
        cp_size = parallel.get("context_parallel_size", 1)
        groups = [init.get("hierarchical_context_parallel_sizes") if c == "a2a+p2p" else None if cp_size == 1
                  else cp_size for c in comms]
        gqa = 2 if data == "mqa" else Model().query_groups  # tp 2 > 1 group: megatron-core's config copy
        assert got["cores"] == [("cp.megatron.core_attention.DotProductAttention", c, g, gqa, data == "chunk")
                                for c, g in zip(comms, groups, strict=True)], (rank, got["cores"])
        assert got["calls"] > 0
        pairs += got["pairs"]
    if data in ("causal", "chunk"):
        assert pairs == _work(data, Model())


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_are_raised_on_every_rank_before_communication(results, name):
    topology, comm, data, message = ERRORS[name]
    # every rank raises (agreed before any transfer: no rank waits in a collective for another that failed)
    for rank, r in enumerate(results):
        text = r["failed"].get((topology, str(comm), data))
        assert text is not None and text.startswith("ValueError") and message in text, (rank, text)


def test_without_pg_collection_the_groups_are_megatron_cores_global_state(results):
    for rank, r in enumerate(results):
        assert r["cases"]["global state cp2-dp2"] == {"groups": True, "comm": "p2p", "off": True}, rank
        assert r["cases"]["global state cp4-hcp2x2"] == {"groups": True, "comm": "a2a+p2p", "off": True}, rank


def test_local_cp_size_one_turns_context_parallelism_off_for_that_call(results):
    for rank, r in enumerate(results):
        layer = r["cases"]["layer"]
        torch.testing.assert_close(layer["cp2 off"], layer["cp1"], rtol=1e-12, atol=1e-12)
        assert not torch.allclose(layer["cp2"], layer["cp1"])  # whole sequences taken as cp 2's halves
        assert layer["group after"] == 2, rank  # the module's own group again
        assert "not a multiple of 2 * cp_size = 4" in layer["short"] and layer["short"].startswith("ValueError")
        assert "core_attention_bias_type='post_scale_bias'" in layer["bias"], layer["bias"]
        assert "needs cu_seqlens_q_padded and cu_seqlens_kv_padded" in layer["unpadded"], layer["unpadded"]


# --- in the driver: the spec swap and the signatures ------------------------------------------------------


def test_swap_puts_the_core_attention_in_every_attention_and_leaves_the_spec_alone():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention as MegatronAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    import cp
    import cp.megatron

    local = get_gpt_layer_local_spec()
    swapped = cp.megatron.swap_core_attention(local)
    attention, original = swapped.submodules.self_attention.submodules, local.submodules.self_attention.submodules
    assert attention.core_attention is cp.megatron.DotProductAttention
    assert original.core_attention is MegatronAttention  # a copy: the spec passed in is unchanged
    assert attention.linear_qkv is original.linear_qkv and swapped.submodules.mlp is local.submodules.mlp

    mask = cp.Mask.chunk_causal(CHUNK)
    masked = cp.megatron.swap_core_attention(local, mask=mask).submodules.self_attention.submodules.core_attention
    assert masked == ModuleSpec(module=cp.megatron.DotProductAttention, params={"mask": mask})

    block = TransformerBlockSubmodules(layer_specs=[local] * 3, layer_norm=local.submodules.input_layernorm)
    layers = cp.megatron.swap_core_attention(block).layer_specs
    assert [s.submodules.self_attention.submodules.core_attention for s in layers] == [
        cp.megatron.DotProductAttention] * 3
    mla = cp.megatron.swap_core_attention(get_gpt_layer_local_spec(multi_latent_attention=True))
    assert mla.submodules.self_attention.submodules.core_attention is cp.megatron.DotProductAttention

    with pytest.raises(ValueError, match="no core_attention in this spec"):
        cp.megatron.swap_core_attention(local.submodules.mlp)
    with pytest.raises(TypeError, match="mask must be a cp.Mask or None, got str"):
        cp.megatron.swap_core_attention(local, mask="chunk_causal:4")


def test_signatures_are_megatron_cores_te_core_attention():
    """``__init__`` and ``forward``: TEDotProductAttention's names, kinds, order and defaults, read from the installed
    megatron-core's source (its class subclasses Transformer Engine's and cannot be imported here); ``mask``
    keyword-only after them; ``attn_mask_type`` defaults to None, as in megatron-core's own DotProductAttention."""
    import importlib.util
    import inspect
    import os

    from te_signatures import signatures

    import cp.megatron

    root = importlib.util.find_spec("megatron.core").submodule_search_locations[0]
    with open(os.path.join(root, "extensions", "transformer_engine.py")) as f:
        want = signatures(f.read(), "TEDotProductAttention", ("__init__", "forward"))
    want["forward"] = [[n, k, "None" if n == "attn_mask_type" else d] for n, k, d in want["forward"]]
    want["__init__"].append(["mask", "KEYWORD_ONLY", "None"])
    for method, rows in want.items():
        params = list(inspect.signature(getattr(cp.megatron.DotProductAttention, method)).parameters.values())[1:]
        got = [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
               for p in params]
        assert got == rows, (method, got, rows)


# --- the example ----------------------------------------------------------------------------------------------


def case_example():
    import importlib.util
    import os

    warnings.simplefilter("ignore")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "megatron_gpt_cp.py")
    spec = importlib.util.spec_from_file_location("megatron_gpt_cp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return {cp_size: example.train(steps=3, cp_size=cp_size) for cp_size in (2, 1)}


def test_the_example_trains_at_cp2_as_at_cp1(pools):
    """The example's own loop at cp 2 (dp 2) and at cp 1 (dp 4): the same losses step by step, falling (its
    chunk-causal option runs the same face as the chunk-causal model cases above)."""
    for rank, losses in enumerate(pools(4).run(case_example, timeout=300)):
        assert losses[2] == pytest.approx(losses[1], rel=1e-5), (rank, losses)
        assert losses[2][-1] < losses[2][0], (rank, losses)
