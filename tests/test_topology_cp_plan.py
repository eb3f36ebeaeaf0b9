"""plan_context_parallel on six open video models at cp 2, 4, 8 and 16, checked by arithmetic against independent
oracles (gcd, torch.tensor_split, find_split itself) and, for cp up to 8, by splitting and attending for real on
8 gloo ranks (cut-down width and sequence, the plan's heads and remainder)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import cp
import parallel_state as ps
from parallel_state import plan_context_parallel

# name: (latent [B, C, T, H, W], patch (pT, pH, pW), q heads, hand-checked (tokens grid, ulysses x ring at cp 8)).
# Where each number comes from:
# - Wan2.1 1.3B / 14B: Wan-Video configs (mirrored in ml-explore/mlx-examples video/Wan2.1/wan/configs/
#   wan_t2v_1_3B.py and wan_t2v_14B.py): vae_stride (4, 8, 8), patch_size (1, 2, 2), num_heads 12 and 40; the
#   16-channel VAE at 480p, 832 x 480 x 81 frames -> latent 21 x 60 x 104 (1 + 80 / 4 frames, 480 / 8, 832 / 8).
# - HunyuanVideo: hidden_size 3072, heads_num 24, patch_size [1, 2, 2], 16 latent channels (the model config, e.g.
#   as in diffusers' HunyuanVideoTransformer3DModel); its VAE compresses 4x in time and 8x in space, so the
#   720p default 1280 x 720 x 129 frames -> latent 33 x 90 x 160.
# - CogVideoX-5B: diffusers CogVideoXTransformer3DModel defaults sample_frames 49, sample_height 60,
#   sample_width 90, patch_size 2, temporal_compression_ratio 4 (-> latent 13 x 60 x 90); the 5B checkpoint
#   has 48 heads of 64 (the 2B default is 30).
# - Cosmos-Predict2-2B (Video2World): diffusers scripts/convert_cosmos_to_diffusers.py,
#   "Cosmos-2.0-Diffusion-2B-Video2World": num_attention_heads 16, patch_size (1, 2, 2), the Wan2.1 VAE (4x8x8);
#   its 720p default 1280 x 704 x 93 frames -> latent 24 x 88 x 160.
# - LTX-Video (2B): diffusers LTXVideoTransformer3DModel defaults num_attention_heads 32, attention_head_dim 64,
#   patch_size 1, patch_size_t 1, 128 latent channels; its VAE compresses 8x in time and 32x in space, so
#   768 x 512 x 121 frames -> latent 16 x 16 x 24.
MODELS = {
    "Wan2.1-1.3B 480p": ((1, 16, 21, 60, 104), (1, 2, 2), 12, ((21, 30, 52), (4, 2))),
    "Wan2.1-14B 480p": ((1, 16, 21, 60, 104), (1, 2, 2), 40, ((21, 30, 52), (8, 1))),
    "HunyuanVideo 720p": ((1, 16, 33, 90, 160), (1, 2, 2), 24, ((33, 45, 80), (8, 1))),
    "CogVideoX-5B": ((1, 16, 13, 60, 90), (1, 2, 2), 48, ((13, 30, 45), (8, 1))),
    "Cosmos-Predict2-2B 720p": ((1, 16, 24, 88, 160), (1, 2, 2), 16, ((24, 44, 80), (8, 1))),
    "LTX-Video 2B": ((1, 128, 16, 16, 24), (1, 1, 1), 32, ((16, 16, 24), (8, 1))),
}
CP_SIZES = (2, 4, 8, 16)


def _find_split_quietly(shape, cp_size, patch):
    """find_split's answer, or None when it refuses; its recorded cp_size_t is put back as it was."""
    had = "cp_size_t" in vars(ps)
    saved = vars(ps).get("cp_size_t")
    try:
        return tuple(ps.find_split(shape, cp_size, patch_values=patch)), ps.cp_size_t
    except ValueError:
        return None, None
    finally:
        if had:
            ps.cp_size_t = saved
        else:
            vars(ps).pop("cp_size_t", None)


@pytest.mark.parametrize("name", MODELS)
def test_six_models_planned_at_cp_2_4_8_16(name):
    shape, patch, heads, (grid, at8) = MODELS[name]
    for cp_size in CP_SIZES:
        plan = plan_context_parallel(shape, cp_size, heads, patch_values=patch)
        assert plan.token_grid == grid and plan.tokens == math.prod(grid)
        # The largest divisor of cp that divides the heads is gcd(heads, cp).
        assert plan.ulysses_size == math.gcd(heads, cp_size)
        assert plan.ulysses_size * plan.ring_size == cp_size
        assert plan.hierarchical_context_parallel_sizes == [plan.ulysses_size, plan.ring_size]
        want = tuple(t.numel() for t in torch.arange(plan.tokens).tensor_split(cp_size))
        assert plan.tokens_per_rank == want and sum(want) == plan.tokens
        assert plan.uneven == (plan.tokens % cp_size != 0)
        assert (plan.find_split, plan.cp_size_t) == _find_split_quietly(shape, cp_size, patch)
        text = plan.describe()
        assert f"{plan.tokens} tokens" in text and f"{plan.hierarchical_context_parallel_sizes}" in text
        assert ("find_split splits the grid evenly" in text) == (plan.find_split is not None)
        assert ("uneven=True" in text) == (plan.find_split is None)
        assert ("length=" in text) == plan.uneven
        if cp_size == 8:
            assert (plan.ulysses_size, plan.ring_size) == at8
    assert "cp_size_t" not in vars(ps)  # planning records nothing


def test_hand_checked_answers():
    """A few answers worked out by hand, so the oracles above are not the only witness."""
    wan = plan_context_parallel((1, 16, 21, 60, 104), 8, 12)
    assert (wan.tokens, wan.ulysses_size, wan.ring_size, wan.tokens_per_rank) == (32760, 4, 2, (4095,) * 8)
    assert wan.find_split is None  # T = 21 takes no factor of 8 and 30 rows take only 2
    wan16 = plan_context_parallel((1, 16, 21, 60, 104), 16, 12)
    assert wan16.tokens_per_rank == (2048,) * 8 + (2047,) * 8 and wan16.uneven  # 32760 = 16 * 2047 + 8
    cog = plan_context_parallel((1, 16, 13, 60, 90), 16, 48, num_kv_heads=8)
    assert (cog.ulysses_size, cog.ring_size, cog.kv_heads_sent) == (16, 1, 16)  # 8 kv heads replicated to 16
    assert cog.tokens_per_rank == (1097,) * 14 + (1096,) * 2
    cosmos = plan_context_parallel((1, 16, 24, 88, 160), 16, 16)
    assert (cosmos.find_split, cosmos.cp_size_t) == ((3, 44, 160), 8)
    # Traffic: Ulysses u=4 sends 3/4 of q, k, v, out; the ring (r=2) passes K and V once.
    s, d = 4095, 64
    assert wan.bytes_per_rank(torch.bfloat16, d) == 2 * (s * 4 * 12 * d * 3 // 4 + 2 * s * 12 * d)
    assert wan.bytes_per_rank("bfloat16", d) == wan.bytes_per_rank(2, d) == wan.bytes_per_rank(torch.float16, d)
    one = plan_context_parallel((1, 1, 1, 2, 2), 1, 3, patch_values=(1, 1, 1))
    assert (one.ulysses_size, one.ring_size, one.tokens_per_rank, one.bytes_per_rank(4, 8)) == (1, 1, (4,), 0)
    assert "no context parallelism" in one.describe()
    view = plan_context_parallel((2, 16, 42, 60, 104), 2, 12, view_factor=2)
    assert view.token_grid == (21, 30, 52)  # tokens of one view
    mqa = plan_context_parallel((1, 16, 21, 60, 104), 4, 12, num_kv_heads=1)
    assert (mqa.ulysses_size, mqa.kv_heads_sent) == (4, 4)


def test_bad_inputs_are_explained():
    rows = [
        (((1, 16, 21, 60, 104), 0, 12), {}, ValueError, "cp_size must be >= 1"),
        (((1, 16, 2, 2, 2), 9, 12), {"patch_values": (1, 1, 1)}, ValueError, "8 tokens per view (2 x 2 x 2), fewer "
                                                                               "than cp_size=9"),
        (((1, 16, 21, 60, 104), 4, 0), {}, ValueError, "num_heads must be >= 1"),
        (((1, 16, 21, 60, 104), 4, 12), {"num_kv_heads": 5}, ValueError, "num_kv_heads=5 must be >= 1 and divide"),
        (((1, 16, 21, 60, 103), 4, 12), {}, ValueError, "W=103 by pW=2"),
        (((1, 16, 21, 61, 104), 4, 12), {}, ValueError, "H=61 by pH=2"),
        (((1, 16, 21, 60), 4, 12), {}, ValueError, "shape must be 5-D"),
        (((1, 16, 21, 60, 104), 4, 12), {"view_factor": 2}, ValueError, "view_factor=2"),
        (((1, 16, 21, 60, 104), 4.0, 12), {}, TypeError, "cp_size must be an int"),
        (((1, 16, 21, 60, 104), 4, True), {}, TypeError, "num_heads must be an int"),
    ]
    for args, kwargs, exc, fragment in rows:
        with pytest.raises(exc) as info:
            plan_context_parallel(*args, **kwargs)
        assert fragment in str(info.value) and str(info.value).startswith("plan_context_parallel: "), info.value
    # As many tokens as ranks is the smallest latent a cp size takes: one token each.
    assert plan_context_parallel((1, 16, 2, 2, 2), 8, 12, patch_values=(1, 1, 1)).tokens_per_rank == (1,) * 8
    plan = plan_context_parallel((1, 16, 21, 60, 104), 4, 12)
    with pytest.raises(ValueError, match="unknown dtype name 'int3'"):
        plan.bytes_per_rank("int3", 64)
    with pytest.raises(ValueError, match="head_dim and batch must be >= 1"):
        plan.bytes_per_rank(2, 0)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        plan.bytes_per_rank(object(), 64)
    with pytest.raises(AttributeError):  # frozen
        plan.ring_size = 3  # type: ignore[misc]


def test_masked_plans_and_bytes():
    """Wan2.1 480p (32,760 tokens, 12 heads) at cp 8 (Ulysses 4 x ring 2) with a mask: the plans are plan_dispatch's,
    the bytes are worked out by hand (Ulysses share + K/V of the ring blocks a rank's queries may see)."""
    shape, d = (1, 16, 21, 60, 104), 64
    mask = ps.AttentionMask.chunk_causal(3 * 1560)
    plan = plan_context_parallel(shape, 8, 12, mask=mask, head_dim=d)
    assert plan.mask == mask and plan.balanced == ps.plan_dispatch(mask, 32760, 8, method="balanced")
    assert plan.contiguous == ps.plan_dispatch(mask, 32760, 8, method="contiguous")
    assert plan.dispatch_plan() is plan.balanced and plan.dispatch_plan("contiguous") is plan.contiguous
    assert plan.balanced.balance <= 1.001 and plan.contiguous.balance == pytest.approx(1.75, abs=1e-3)
    text = plan.describe()
    assert "Mask chunk_causal:4680" in text and f"{plan.balanced.balance:.4f}x" in text and "1.7500x" in text
    ulysses = 4095 * (2 * 12 + 2 * 12) * d * 3 // 4
    ring = 2 * 16380 * (12 // 4) * d  # the other ring block's K and V, 3 heads per Ulysses rank
    # chunk 3 straddles the two ring blocks, so both blocks see the other's keys under either plan: the ring
    # passes each whole block on; p2p sends only the keys seen (the contiguous split's block 0 sees 2,340 of 16,380)
    assert plan.masked_bytes_per_rank(2, d, transport="ring") == (2 * (ulysses + ring),) * 8
    assert plan.masked_bytes_per_rank("bfloat16", d, method="contiguous", transport="ring") == (
        2 * (ulysses + ring),) * 8
    assert plan.masked_bytes_per_rank("bfloat16", d, method="contiguous") == (
        (2 * (ulysses + ring * 2340 // 16380),) * 4 + (2 * (ulysses + ring),) * 4)
    # token-causal, contiguous: ring block 0 (ranks 0-3) sees nothing of block 1; balanced: everyone sees both
    causal = plan_context_parallel(shape, 8, 12, mask=ps.AttentionMask.causal())
    assert causal.masked_bytes_per_rank(2, d, method="contiguous") == (2 * ulysses,) * 4 + (2 * (ulysses + ring),) * 4
    assert causal.masked_bytes_per_rank(torch.bfloat16, d, batch=3, transport="ring") == (6 * (ulysses + ring),) * 8
    # against the dense matrix on a small latent: 4 frames of 4 tokens, each frame sees only itself, cp 4 = 2 x 2;
    # p2p receives the keys its block's queries see, ring the whole blocks passed on, allgather every other token
    small = plan_context_parallel((1, 1, 4, 2, 2), 4, 2, patch_values=(1, 1, 1),
                                  mask=ps.AttentionMask.sliding_window(4, 1))
    dense = small.mask.dense(16)
    for method in ("balanced", "contiguous", "auto"):
        dp = small.dispatch_plan(method)
        blocks = [sum(dp.positions[2 * j:2 * j + 2], ()) for j in range(2)]
        for transport in ("p2p", "ring", "allgather"):
            got = small.masked_bytes_per_rank(1, 1, method=method, transport=transport)
            for c in range(4):
                i = c // 2
                seen = dense[list(blocks[i])].any(0)
                if transport == "p2p":
                    recv = sum(int(seen[list(blocks[j])].sum()) for j in range(2) if j != i)
                elif transport == "ring":
                    recv = sum(len(blocks[j]) for j in range(2) if j != i and bool(seen[list(blocks[j])].any()))
                else:
                    recv = 16 - len(blocks[i])
                assert got[c] == dp.sizes[c] * 8 * 1 // 2 + 2 * recv, (method, transport, c)
        assert small.masked_bytes_per_rank(1, 1, method=method) == small.masked_bytes_per_rank(
            1, 1, method=method, transport=dp.transport)
    # the cost model's choice for this attention: 12 heads of 64 in bfloat16 as Ulysses 4 x ring 2
    shape_cost = ps.AttentionShape(heads=12, head_dim=d, dtype="bfloat16")
    assert plan.chosen == ps.plan_dispatch(mask, 32760, 8, shape=shape_cost, ulysses_size=4)
    assert plan.dispatch_plan("auto") is plan.chosen and plan.chosen.predicted_ms <= plan.contiguous.predicted_ms
    assert f"the {plan.chosen.method} layout with the {plan.chosen.transport} transport" in text
    assert f"predicted {plan.chosen.predicted_ms:.3g} ms" in text and plan.chosen.why in text
    assert plan_context_parallel(shape, 8, 12).mask is None


def test_masked_plan_errors():
    shape = (1, 16, 21, 60, 104)
    with pytest.raises(TypeError, match="plan_context_parallel: mask must be an AttentionMask"):
        plan_context_parallel(shape, 8, 12, mask="causal")
    with pytest.raises(ValueError, match="plan_context_parallel: one view has 32760 tokens .21 frames of 1560.: "
                                         ".*segments add up to 3120 tokens"):
        plan_context_parallel(shape, 8, 12, mask=ps.AttentionMask.packed([1560, 1560]))
    plain = plan_context_parallel(shape, 8, 12)
    with pytest.raises(ValueError, match="this plan has no attention mask"):
        plain.masked_bytes_per_rank(2, 64)
    masked = plan_context_parallel(shape, 8, 12, mask=ps.AttentionMask.causal())
    with pytest.raises(ValueError, match="method='zigzag' is not 'auto', 'balanced' or 'contiguous'"):
        masked.dispatch_plan("zigzag")
    with pytest.raises(ValueError, match="head_dim and batch must be >= 1"):
        masked.masked_bytes_per_rank(2, 0)
    with pytest.raises(ValueError, match=r"masked_bytes_per_rank: transport='nccl' is not one of \('p2p', "):
        masked.masked_bytes_per_rank(2, 64, transport="nccl")  # once priced as the ring, silently
    assert masked.masked_bytes_per_rank(2, 64, transport="ring") == masked.masked_bytes_per_rank(
        2, 64, transport=ps.Transport.RING) != masked.masked_bytes_per_rank(2, 64, transport="p2p")
    with pytest.raises(ValueError, match="AttentionShape: head_dim must be >= 1, got 0"):
        plan_context_parallel(shape, 8, 12, mask=ps.AttentionMask.causal(), head_dim=0)
    with pytest.raises(TypeError, match="rates must be a CostRates"):
        plan_context_parallel(shape, 8, 12, mask=ps.AttentionMask.causal(), rates={"bytes_per_ms": 1})


def test_planner_module_is_pure():
    """No torch.distributed, no torch at all: the planner imports and runs in a bare interpreter."""
    import subprocess

    code = ("import sys; from parallel_state import plan_context_parallel as p; "
            "x = p((1, 16, 21, 60, 104), 16, 12); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(x.ulysses_size, x.ring_size)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["4", "4"], out.stderr


# ---------------------------------------------------------------- the plans, run for real on 8 gloo ranks

def _attend(q, k, v):
    return cp.sdpa_in_layout(q, k, v, seq_dim=1, head_dim=2)


def case_plans_run():
    """For every model at cp 2, 4 and 8 (groups of consecutive ranks): the whole token sequence splits into
    the planned tokens_per_rank and gathers back; Ulysses with the model's heads attends exactly on a cut-down
    sequence with the same remainder (when the ring size is 1); a usp plan's Ulysses stage splits each ring
    block as shard_sizes(block, u)."""
    import datetime

    import torch.distributed as dist

    checks = 0
    rank = dist.get_rank()
    for cp_size in (2, 4, 8):
        # Consecutive blocks of cp_size ranks (every rank creates every group, in the same order).
        blocks = [dist.new_group(list(range(s, s + cp_size))) for s in range(0, 8, cp_size)] if cp_size < 8 else None
        g = dist.group.WORLD if blocks is None else blocks[rank // cp_size]
        r = g.rank()
        for name, (shape, patch, heads, _) in MODELS.items():
            plan = plan_context_parallel(shape, cp_size, heads, patch_values=patch)
            seq = torch.arange(plan.tokens, dtype=torch.float64).view(1, plan.tokens, 1)
            mine = cp.split_inputs_cp(seq, 1, g, uneven=True)
            assert mine.shape[1] == plan.tokens_per_rank[r], (name, cp_size)
            assert torch.equal(cp.cat_outputs_cp(mine, 1, g, length=plan.tokens), seq)
            if plan.ring_size == 1:
                length = 2 * cp_size + plan.tokens % cp_size
                gen = torch.Generator().manual_seed(cp_size)
                q, k, v = (torch.randn(1, length, heads, 2, generator=gen, dtype=torch.float64) for _ in range(3))
                ref = _attend(q, k, v)
                parts = [cp.split_inputs_cp(t, 1, g, uneven=True).requires_grad_(True) for t in (q, k, v)]
                out = cp.ulysses_attention(*parts, g, length=length)
                assert torch.allclose(out, cp.split_inputs_cp(ref, 1, g, uneven=True), rtol=0, atol=1e-12), name
            checks += 1
    # Wan2.1-1.3B at cp 8 is Ulysses 4 x ring 2 over megatron's hierarchical groups.
    shape, patch, heads, _ = MODELS["Wan2.1-1.3B 480p"]
    plan = plan_context_parallel(shape, 8, heads, patch_values=patch)
    ps.initialize_model_parallel(context_parallel_size=8,
                                 hierarchical_context_parallel_sizes=plan.hierarchical_context_parallel_sizes,
                                 timeout=datetime.timedelta(seconds=60))
    ulysses, ring = ps.get_hierarchical_context_parallel_groups()
    assert (ulysses.size(), ring.size()) == (plan.ulysses_size, plan.ring_size)
    cp_rank = ps.get_context_parallel_rank()
    assert cp_rank == ring.rank() * ulysses.size() + ulysses.rank()
    u = plan.ulysses_size
    block = sum(plan.tokens_per_rank[ring.rank() * u:(ring.rank() + 1) * u])
    assert cp.shard_sizes(block, u)[ulysses.rank()] == plan.tokens_per_rank[cp_rank]
    # Ulysses over the block (attention within the block, as usp's first stage sees it) is exact.
    length = 2 * u + 1
    gen = torch.Generator().manual_seed(ring.rank())
    q, k, v = (torch.randn(1, length, heads, 2, generator=gen, dtype=torch.float64) for _ in range(3))
    out = cp.ulysses_attention(*(cp.split_inputs_cp(t, 1, ulysses, uneven=True) for t in (q, k, v)), ulysses,
                               length=length)
    assert torch.allclose(out, cp.split_inputs_cp(_attend(q, k, v), 1, ulysses, uneven=True), rtol=0, atol=1e-12)
    return checks + 1


def test_plans_run_on_8_gloo_ranks(pools):
    assert pools(8).run(case_plans_run, timeout=180) == [3 * len(MODELS) + 1] * 8
