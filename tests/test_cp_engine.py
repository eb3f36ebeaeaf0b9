"""The engine's one process path: exact wherever its tiles' results are written rather than merged (one tile, runs,
rows in any order) or summed (keys meeting several tiles), and within the op and memory budgets of issue 41
beside SDPA."""

from __future__ import annotations

import pytest
import torch

import cp
from benchmarks import dispatch_count as dc
from cp import engine, mask_schedule, transports
from cp.mask_schedule import Cover

L = 23


def _masks() -> dict[str, cp.Mask]:
    return {"full": cp.Mask.full(), "causal": cp.Mask.causal(), "chunk": cp.Mask.chunk_causal(5),
            "window": cp.Mask.sliding_window(4, 2), "packed": cp.Mask.packed([9, 5, 9])}


@pytest.fixture
def small_tiles():
    saved = mask_schedule.FULL_ROWS, mask_schedule.TILE_ROWS
    yield
    mask_schedule.FULL_ROWS, mask_schedule.TILE_ROWS = saved
    mask_schedule.clear()


def test_written_and_merged_results_equal_the_dense_mask_forward_and_backward(small_tiles):
    """Every mask, default and tiny tiles, tokens in order and shuffled, GQA: out, dq, dk, dv equal autograd through
    SDPA under the dense mask in float64; between them the cases reach every way rows and keys meet tiles."""
    gen = torch.Generator().manual_seed(0)
    covers = set()
    for tiles in ((16, 128), (2, 3), (1, 4)):
        mask_schedule.FULL_ROWS, mask_schedule.TILE_ROWS = tiles
        mask_schedule.clear()
        for name, mask in _masks().items():
            for order in (torch.arange(L), torch.randperm(L, generator=gen)):
                sched = mask_schedule.build(mask, L, [order.tolist()], 0)
                covers |= {("rows", sched.row_cover)} | {("keys", b.column_cover) for b in sched.blocks if b}
                q, k, v, do = (torch.randn(2, L, h, 6, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
                ins = [t.clone().requires_grad_() for t in (q, k, v)]
                call = engine.AttentionCall(1, 2, 2, 0.4, None, sched, transports.PointToPoint)
                got = engine.attend(call, *ins)
                got.backward(do)
                ref = [t.clone().requires_grad_() for t in (q, k, v)]
                allowed = mask.dense(L)[order][:, order]
                want = torch.nn.functional.scaled_dot_product_attention(
                    ref[0].transpose(1, 2), ref[1].repeat_interleave(2, 2).transpose(1, 2),
                    ref[2].repeat_interleave(2, 2).transpose(1, 2), attn_mask=allowed, scale=0.4).transpose(1, 2)
                want.backward(do)
                assert torch.allclose(got, want, atol=1e-12), (tiles, name)
                for a, b in zip(ins, ref, strict=True):
                    assert torch.allclose(a.grad, b.grad, atol=1e-12), (tiles, name)
    # (a rank's rows merge across the blocks of several ranks: the ring tests' cases)
    want = {("rows", c) for c in (Cover.ONE_TILE, Cover.RUNS, Cover.ONCE)}
    want |= {("keys", c) for c in (Cover.ONE_TILE, Cover.RUNS, Cover.MERGED)}
    assert want <= covers, want - covers


def test_one_process_calls_stay_within_the_op_and_memory_budgets():
    """bfloat16, forward + backward, a world of one: aten ops at most 3x unmasked SDPA's for full and 8x for
    chunk-causal and packed clips of up to 8 runs; peak bytes above the inputs at most 1.5x SDPA's for every mask
    (the budgets of issue 41; python -m benchmarks ops prints the figures)."""
    shape = (1, 2048, 8, 64)
    base = dc.count(dc.sdpa, shape)
    budget = {"full": 3, "chunk_causal_8": 8, "packed_4": 8, "packed_8": 8}
    for name, mask in dc.masks(shape[1]).items():
        cost = dc.count(dc.planned(mask, shape[1]), shape)
        if name in budget:
            assert cost.ops <= budget[name] * base.ops, (name, cost.ops, base.ops, cost.by_op)
        assert cost.peak <= 1.5 * base.peak, (name, cost.peak, base.peak)


def test_the_engine_runs_every_cuda_kernel_on_meta_tensors(monkeypatch):
    """The engine's calls as a GPU runs them, through torch's meta kernels: schedules cached on another device than
    the CPU (moved there once), every CUDA kernel's forward and backward for one tile, runs of rows, keys summed over
    runs, masked tiles and GQA, in the inputs' layout, the gradients where and as the inputs are."""
    from cp import kernels, masked

    bf16, meta = torch.bfloat16, torch.device("meta")
    for name in kernels.CUDA_KERNELS:
        def choose(q, k, v, kind, name=name):
            return kernels.choose_kernel("cuda", q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), kind,
                                         cuda_kernels=frozenset({name}), capability=(9, 0))

        monkeypatch.setattr(kernels, "choose_for", choose)
        for mask in (cp.Mask.full(), cp.Mask.chunk_causal(64), cp.Mask.packed([96, 64, 96]),
                     cp.Mask.sliding_window(16, 2)):
            for kv_heads in (4, 2):
                plan = cp.plan_dispatch(mask, 256, 1)
                sched = masked.schedule(plan, "meta-test", lambda plan=plan: plan.positions, 0, meta)
                assert all(b is None or b.index is None or b.index.device == meta for b in sched.blocks)
                q = torch.empty(1, 256, 4, 64, dtype=bf16, device=meta, requires_grad=True)
                k, v = (torch.empty(1, 256, kv_heads, 64, dtype=bf16, device=meta, requires_grad=True) for _ in "kv")
                call = engine.AttentionCall(1, 2, 4 // kv_heads, 0.125, None, sched, transports.PointToPoint)
                out = engine.attend(call, q, k, v)
                assert (out.shape, out.dtype, out.device) == (q.shape, bf16, meta), (name, mask)
                out.backward(torch.empty_like(out))
                for t in (q, k, v):
                    assert (t.grad.shape, t.grad.dtype, t.grad.device) == (t.shape, bf16, meta), (name, mask)
                    t.grad = None


def test_features_that_are_not_contiguous_are_read_right():
    """q, k or v whose feature dim is strided (a transposed view): the fused kernels read features as contiguous,
    so the engine (and the KV cache) hand them a contiguous copy; equal to the dense mask's attention in float64."""
    gen = torch.Generator().manual_seed(1)
    mask = cp.Mask.chunk_causal(8)
    plan = cp.plan_dispatch(mask, 32, 1)
    base = [torch.randn(1, 32, 6, 2, generator=gen, dtype=torch.float64) for _ in range(3)]
    dense = [t.contiguous() for t in (x.transpose(-1, -2) for x in base)]   # [1, 32, 2, 6]
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in dense), attn_mask=mask.dense(32)).transpose(1, 2)
    for which in range(3):
        ins = [x.transpose(-1, -2) if i == which else d for i, (x, d) in enumerate(zip(base, dense, strict=True))]
        assert ins[which].stride(-1) != 1
        got = cp.ring_attention(*ins, plan=plan)
        assert torch.allclose(got, want, atol=1e-12), which
    cache = cp.KVCache(None)
    strided_k = base[1].transpose(-1, -2)
    got = cache.attend(dense[0], strided_k, dense[2])
    full = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in dense)).transpose(1, 2)
    assert torch.allclose(got, full, atol=1e-12)
