"""cp.kernels: which kernel computes a tile (decided per device, dtype, shapes and tile kind, without the device),
the CUDA calls run on meta tensors through torch's own meta kernels, a clear error where CUDA is missing, and on
a CPU the fused kernel equal to the reference for every tile kind, GQA included, forward and backward."""

from __future__ import annotations

import pytest
import torch

from cp import kernels
from cp.kernels import TileKind, choose_kernel

FULL, CAUSAL, MASKED = TileKind.FULL, TileKind.CAUSAL, TileKind.MASKED

BF, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
Q, K = (2, 8, 64, 64), (2, 8, 64, 64)  # [B, H, R, D] against [B, Hkv, C, D]
GQA_K = (2, 2, 64, 64)


def test_cuda_choices_by_dtype_kind_and_shape():
    rows = [
        # (dtype, q, k, v, kind, kwargs) -> (name, layout, is_causal, bias)
        ((BF, Q, K, K, FULL, {}), ("cuda_flash", "heads", False, False)),
        ((F16, Q, K, K, CAUSAL, {}), ("cuda_flash", "heads", True, False)),
        ((BF, Q, GQA_K, GQA_K, CAUSAL, {}), ("cuda_flash", "heads", True, False)),  # flash takes GQA itself
        ((BF, Q, K, K, MASKED, {}), ("cuda_efficient", "heads", False, True)),       # flash takes no mask
        ((BF, Q, GQA_K, GQA_K, MASKED, {}), ("cuda_efficient", "expand", False, True)),
        ((F32, Q, K, K, CAUSAL, {}), ("cuda_efficient", "heads", True, False)),       # flash: half only
        ((BF, Q, K, (2, 8, 64, 32), FULL, {}), ("cuda_efficient", "heads", False, False)),  # dv != dk
        ((BF, Q, K, K, MASKED, {"cuda_kernels": frozenset({"cuda_cudnn"})}), ("cuda_cudnn", "heads", False, True)),
        ((BF, Q, K, K, FULL, {"cuda_kernels": frozenset({"cuda_cudnn"})}), ("cuda_cudnn", "heads", False, False)),
        ((BF, Q, GQA_K, GQA_K, MASKED, {"cuda_kernels": frozenset({"cuda_cudnn"})}),
         ("cuda_cudnn", "expand", False, True)),
        # Deterministic algorithms leave out efficient and cuDNN (as SDPA does): flash where it fits, else math.
        ((BF, Q, K, K, MASKED, {"deterministic": True}), ("math", "rows", False, False)),
        ((BF, Q, K, K, FULL, {"deterministic": True, "capability": (9, 0)}), ("cuda_flash", "heads", False, False)),
        ((F64, Q, K, K, FULL, {}), ("math", "rows", False, False)),
        ((F32, Q, K, K, MASKED, {"deterministic": True}), ("math", "rows", False, False)),
        ((BF, (1, 2, 4, 12), (1, 2, 4, 12), (1, 2, 4, 12), FULL, {}), ("math", "rows", False, False)),  # 12 % 8
        ((BF, (1, 2, 4, 264), (1, 2, 4, 264), (1, 2, 4, 264), FULL, {"cuda_kernels": frozenset({"cuda_flash"})}),
         ("math", "rows", False, False)),  # head dim above flash's 256
        ((BF, Q, K, K, FULL, {"fused": False}), ("math", "rows", False, False)),
    ]
    for (dtype, q, k, v, kind, kw), want in rows:
        c = choose_kernel("cuda", dtype, q, k, v, kind, **kw)
        assert (c.name, c.layout, c.is_causal, c.bias) == want, (dtype, q, k, v, kind, kw, c)
        # Half inputs run half kernels; the reference computes in float32 (float64 for float64).
        assert c.dtype == (dtype if c.name != "math" else (F64 if dtype == F64 else F32)), c
        assert bool(c.reason) == (c.name == "math"), c
    # The reasons name what stopped each kernel.
    assert "efficient takes float16 / bfloat16 / float32" in choose_kernel("cuda", F64, Q, K, K, FULL).reason
    assert "non-deterministic" in choose_kernel("cuda", F32, Q, K, K, MASKED, deterministic=True).reason


def test_cpu_choices_and_bad_requests():
    # The CPU op takes half inputs as they are (accumulating in float32 inside), as SDPA runs it: no float32 copies.
    assert choose_kernel("cpu", BF, Q, K, K, CAUSAL) == kernels.KernelChoice("cpu_flash", BF, "heads", True, False)
    assert choose_kernel("cpu", F64, Q, GQA_K, GQA_K, MASKED) == kernels.KernelChoice("cpu_flash", F64, "heads",
                                                                                      False, True)
    assert choose_kernel("cpu", F32, Q, K, (2, 8, 64, 32), FULL).name == "math"
    assert choose_kernel("xpu", F32, Q, K, K, FULL).name == "math"
    with pytest.raises(ValueError, match="square"):
        choose_kernel("cpu", F32, (1, 1, 4, 8), (1, 1, 5, 8), (1, 1, 5, 8), CAUSAL)
    with pytest.raises(ValueError, match="tile_kind"):
        choose_kernel("cpu", F32, Q, K, K, "diagonal")
    with pytest.raises(ValueError, match="Hkv dividing H"):
        choose_kernel("cpu", F32, (1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), FULL)


def _tile(kind, dtype, device, hkv=2, g=3, r=6, c=6, d=8, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype).to(device)
    q, k, v = rnd(2, hkv * g, r, d), rnd(2, hkv, c, d), rnd(2, hkv, c, dv)
    lo = torch.tensor([0, 1, 0, 2, 3, 1][:r]) if kind == MASKED else None
    hi = torch.tensor([2, 4, 6, 5, 6, 2][:r]) if kind == MASKED else None
    masked = kernels.mask_of(lo, hi, r, c, kind, torch.device(device))
    return q, k, v, masked


def test_cuda_calls_run_on_meta_tensors():
    """Every CUDA choice, forward and backward, through torch's meta kernels: the arguments fit the ops' schemas and
    the results come back in the engine's layouts, the statistics in float32."""
    for kind in (FULL, CAUSAL, MASKED):
        for hkv, g in ((4, 1), (2, 2)):
            for name in kernels.CUDA_KERNELS:
                choice = choose_kernel("cuda", BF, (1, hkv * g, 64, 64), (1, hkv, 64, 64), (1, hkv, 64, 64), kind,
                                       cuda_kernels=frozenset({name}))
                if choice.name != name:  # flash takes no mask
                    assert (name, kind) == ("cuda_flash", MASKED), choice
                    continue
                q, k, v = (torch.empty(s, dtype=BF, device="meta") for s in
                           ((1, hkv * g, 64, 64), (1, hkv, 64, 64), (1, hkv, 64, 64)))
                masked = None if kind == FULL else torch.empty(64, 64, dtype=torch.bool, device="meta")
                out, lse = kernels.forward(choice, q, k, v, 0.125, masked)
                assert out.shape == q.shape and out.dtype == BF and lse.shape == q.shape[:-1] and lse.dtype == F32
                dq, dk, dv = kernels.backward(choice, q, q, k, v, out, lse, lse, 0.125, masked)
                assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape), (name, kind, hkv, g)


def test_cuda_kernels_fail_cleanly_on_cpu_tensors():
    q, k, v, masked = _tile(FULL, F32, "cpu")
    for name in kernels.CUDA_KERNELS:
        choice = kernels.KernelChoice(name, BF, "heads")
        with pytest.raises(RuntimeError, match=f"kernel {name} .* runs on CUDA tensors, got tensors on cpu"):
            kernels.forward(choice, q, k, v, 0.5, masked)


def test_cpu_flash_equals_the_reference_for_every_tile_kind():
    for kind in (FULL, CAUSAL, MASKED):
        for g in (1, 3):
            q, k, v, masked = _tile(kind, F64, "cpu", g=g, seed=g)
            fused = choose_kernel("cpu", F64, (2, 2 * g, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8), kind)
            ref = kernels.KernelChoice("math", F64, "rows")
            assert fused.name == "cpu_flash"
            (o1, l1), (o2, l2) = (kernels.forward(c, q, k, v, 0.3, masked) for c in (fused, ref))
            assert torch.allclose(o1, o2, atol=1e-12) and torch.allclose(l1, l2, atol=1e-12), kind
            do = torch.randn(o1.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
            delta = (do * o2).sum(-1)
            g1 = kernels.backward(fused, do, q, k, v, o2, l2, delta, 0.3, masked)
            g2 = kernels.backward(ref, do, q, k, v, o2, l2, delta, 0.3, masked)
            assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g1, g2, strict=True)), kind
            # The reference itself against autograd through SDPA with the dense mask.
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            allowed = None if masked is None else ~masked
            want = torch.nn.functional.scaled_dot_product_attention(
                qq, kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1), attn_mask=allowed, scale=0.3)
            want.backward(do)
            assert torch.allclose(o2, want, atol=1e-12)
            assert all(torch.allclose(a, b.grad, atol=1e-12) for a, b in zip(g2, (qq, kk, vv), strict=True)), kind


def test_cpu_causal_tiles_of_512_rows_or_more_are_cut_into_diagonal_blocks():
    """The CPU op skips masked work only in whole key blocks of 512, so a large causal tile runs as diagonal blocks
    and full tiles below them (cp.diagonal), equal to the reference forward and backward (GQA, a batch of 2, rows
    a view of a longer q as the engine passes them); CUDA takes the causal flag whole."""
    from cp import diagonal

    assert [diagonal.blocks_for(r) for r in (256, 511, 512, 513, 768, 1024, 600)] == [1, 1, 4, 1, 8, 8, 8]
    assert choose_kernel("cpu", F32, (1, 8, 512, 16), (1, 8, 512, 16), (1, 8, 512, 16), CAUSAL).diagonal_blocks == 4
    assert choose_kernel("cpu", F32, (1, 8, 512, 16), (1, 8, 512, 16), (1, 8, 512, 16), FULL).diagonal_blocks == 1
    for dtype in (BF, F32):
        c = choose_kernel("cuda", dtype, (1, 8, 512, 64), (1, 8, 512, 64), (1, 8, 512, 64), CAUSAL)
        assert c.is_causal and c.diagonal_blocks == 1, c
    gen = torch.Generator().manual_seed(3)
    r, g = 768, 2
    q = torch.randn(2, 2 * g, r + 7, 8, generator=gen, dtype=F64)[..., 4:r + 4, :]
    k, v, do = (torch.randn(*shape, generator=gen, dtype=F64) for shape in ((2, 2, r, 8), (2, 2, r, 8), q.shape))
    fused = choose_kernel("cpu", F64, (2, 2 * g, r, 8), (2, 2, r, 8), (2, 2, r, 8), CAUSAL)
    ref = kernels.KernelChoice("math", F64, "rows")
    assert fused.diagonal_blocks == 8
    masked = kernels.mask_of(None, None, r, r, CAUSAL, torch.device("cpu"))
    (o1, l1), (o2, l2) = (kernels.forward(c, q, k, v, 0.3, masked) for c in (fused, ref))
    assert torch.allclose(o1, o2, atol=1e-12) and torch.allclose(l1, l2, atol=1e-12)
    delta = (do * o2).sum(-1)
    g1, g2 = (kernels.backward(c, do, q, k, v, o2, l2, delta, 0.3, masked) for c in (fused, ref))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g1, g2, strict=True))


# ------------------------------------------------------------------ the card decides, torch's switches allow

VIDEO = (1, 24, 256, 128), (1, 24, 256, 128)  # the GPU check's heads and head dim, one tile


def test_kernel_order_by_card():
    """Full and causal half tiles run cuDNN's fused attention on Hopper and later, FlashAttention-2 on Ampere / Ada,
    memory-efficient before 8.0; masked tiles memory-efficient first everywhere; torch's switches still decide what
    is allowed, and a kernel a tile does not fit falls through to the next of the card's order."""
    q, k = VIDEO
    rows = {
        # capability: (full/causal bf16, masked bf16, full float32)
        (7, 5): ("cuda_efficient", "cuda_efficient", "cuda_efficient"),
        (8, 0): ("cuda_flash", "cuda_efficient", "cuda_efficient"),
        (8, 9): ("cuda_flash", "cuda_efficient", "cuda_efficient"),
        (9, 0): ("cuda_cudnn", "cuda_efficient", "cuda_efficient"),
        (10, 0): ("cuda_cudnn", "cuda_efficient", "cuda_efficient"),
        (12, 0): ("cuda_cudnn", "cuda_efficient", "cuda_efficient"),
    }
    for cap, (half, masked, single) in rows.items():
        for kind in (FULL, CAUSAL):
            assert choose_kernel("cuda", BF, q, k, k, kind, capability=cap).name == half, (cap, kind)
        assert choose_kernel("cuda", BF, q, k, k, MASKED, capability=cap).name == masked, cap
        assert choose_kernel("cuda", F32, q, k, k, FULL, capability=cap).name == single, cap
        assert kernels.cuda_order(cap, FULL)[0] == half
    hopper = {"capability": (9, 0)}
    # Switched off, cuDNN gives way to flash on Hopper; flash off too, memory-efficient.
    assert choose_kernel("cuda", BF, q, k, k, FULL, cuda_kernels=frozenset({"cuda_flash", "cuda_efficient"}),
                         **hopper).name == "cuda_flash"
    assert choose_kernel("cuda", BF, q, k, k, FULL, cuda_kernels=frozenset({"cuda_efficient"}), **hopper).name \
        == "cuda_efficient"
    # A head dim cuDNN does not take (above 128) runs flash on Hopper; GQA runs flash first there (its own heads,
    # no repeated K/V), cuDNN (with repeated K/V heads) where flash is off.
    big = (1, 8, 256, 256)
    assert choose_kernel("cuda", BF, big, big, big, CAUSAL, **hopper).name == "cuda_flash"
    gqa_kv = (1, 4, 256, 128)
    c = choose_kernel("cuda", BF, q, gqa_kv, gqa_kv, FULL, **hopper)
    assert (c.name, c.layout) == ("cuda_flash", "heads")
    c = choose_kernel("cuda", BF, q, gqa_kv, gqa_kv, FULL, cuda_kernels=frozenset({"cuda_cudnn"}), **hopper)
    assert (c.name, c.layout) == ("cuda_cudnn", "expand")
    # Deterministic algorithms: cuDNN is out on Hopper too (SDPA's own rule), flash runs.
    c = choose_kernel("cuda", BF, q, k, k, CAUSAL, deterministic=True, **hopper)
    assert c.name == "cuda_flash"
    # Before 8.0 nothing but memory-efficient, and the reason says why when it cannot run either.
    old = choose_kernel("cuda", BF, q, k, k, FULL, deterministic=True, capability=(7, 0))
    assert old.name == "math" and "compute capability 8.0" in old.reason and "non-deterministic" in old.reason
    # The default is Ampere's order (the tests above that pass no card).
    assert kernels.AMPERE == (8, 0) and choose_kernel("cuda", BF, q, k, k, FULL).name == "cuda_flash"


#: What each CUDA op's tensor arguments must be, as torch's own forward returns them to its backward: on the
#: inputs' device unless named here (efficient's dropout seed and offset stay on the host outside graph capture).
_ON_HOST = {("cuda_efficient", "backward"): {"philox_seed", "philox_offset"}}
_DTYPES = {("cuda_flash", "philox_seed"): torch.uint64, ("cuda_flash", "philox_offset"): torch.uint64,
           ("cuda_cudnn", "philox_seed"): torch.int64, ("cuda_cudnn", "philox_offset"): torch.int64,
           ("cuda_efficient", "philox_seed"): torch.int64, ("cuda_efficient", "philox_offset"): torch.int64}


def test_every_cuda_call_passes_its_tensors_where_the_op_runs(monkeypatch):
    """Each CUDA kernel's forward and backward wrapper, the aten op replaced by a recorder that checks every tensor
    argument (by the op's schema name) against where torch's op reads it and its dtype, then runs torch's meta
    kernel: a seed left on the host where the op wants it on the device (cuDNN's backward crashed so on an H200)
    fails here without a GPU."""
    real_op = kernels._op
    seen: list[tuple[str, str, str]] = []

    def recording(choice, backward, device):
        op = real_op(choice, backward, device)
        way = "backward" if backward else "forward"
        names = [a.name for a in op.default._schema.arguments]

        def record(*args, **kwargs):
            bound = dict(zip(names, args, strict=False)) | kwargs
            for name, value in bound.items():
                for t in (value if isinstance(value, (list, tuple)) else [value]):
                    if not isinstance(t, torch.Tensor):
                        continue
                    host = name in _ON_HOST.get((choice.name, way), set())
                    assert t.device == (torch.device("cpu") if host else device), (choice.name, way, name, t.device)
                    want = _DTYPES.get((choice.name, name))
                    if name in ("logsumexp",):
                        want = F32
                    elif name in ("query", "key", "value", "grad_out", "out", "attn_bias"):
                        want = BF
                    assert want is None or t.dtype == want, (choice.name, way, name, t.dtype, want)
                    seen.append((choice.name, way, name))
            return op(*args, **kwargs)

        return record

    monkeypatch.setattr(kernels, "_op", recording)
    for name in kernels.CUDA_KERNELS:
        for kind in (FULL, CAUSAL, MASKED):
            choice = choose_kernel("cuda", BF, (1, 4, 64, 64), (1, 2, 64, 64), (1, 2, 64, 64), kind,
                                   cuda_kernels=frozenset({name}))
            if choice.name != name:
                continue
            q, k, v = (torch.empty(s, dtype=BF, device="meta") for s in ((1, 4, 64, 64), (1, 2, 64, 64), (1, 2, 64, 64)))
            masked = None if kind == FULL else torch.empty(64, 64, dtype=torch.bool, device="meta")
            out, lse = kernels.forward(choice, q, k, v, 0.125, masked)
            kernels.backward(choice, out, q, k, v, out, lse, None, 0.125, masked)
    for name in kernels.CUDA_KERNELS:
        for way in ("forward", "backward"):
            assert (name, way, "query") in seen, (name, way)
    for name in ("cuda_flash", "cuda_cudnn", "cuda_efficient"):
        assert (name, "backward", "philox_seed") in seen and (name, "backward", "philox_offset") in seen, name
