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
