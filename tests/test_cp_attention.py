"""cp's all-to-all attention on real gloo ranks: exact round trips, one-process equality, gradients, errors."""

from __future__ import annotations

import os

import pytest
import torch

import cp
from cpgroups import cp_groups
from cpgroups import raises as _raises

ENV = "PARALLEL_STATE_DEBUG"


# ---------------------------------------------------------------- helpers run on every rank

def _data(shape, dtype=torch.float32, seed=0):
    """The same tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _shard(x, dim, g):
    return cp.split_inputs_cp(x, dim, g).clone()


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()




#: (full shape with the sequence at its whole length, seq_dim, head_dim, dtype); sequences and heads are
#: multiples of 4, so every layout splits on groups of 2 and 4.
LAYOUTS = [
    ((2, 8, 4, 3), 1, 2, torch.float32),      # [B, S, H, D], the default
    ((2, 4, 8, 3), 2, 1, torch.float64),      # [B, H, S, D], SDPA's own
    ((8, 2, 4, 5), -4, -2, torch.bfloat16),   # [S, B, H, D] with negative dims
    ((8, 4, 6), -3, 1, torch.int64),          # [S, H, D], no batch
    ((3, 4, 2, 8, 2), 3, 1, torch.float16),   # heads before the sequence, extra dims around
]


# ---------------------------------------------------------------- cases (module level: pickled to the ranks)

def case_round_trip():
    checks = 0
    for g in cp_groups():
        n, r = g.size(), g.rank()
        for i, (shape, s, h, dtype) in enumerate(LAYOUTS):
            full = _data(shape, dtype, seed=i)
            x = _shard(full, s, g)
            heads = cp.seq_to_heads(x, s, h, g)
            # The whole sequence (shards in group-rank order) with head block r only.
            width = shape[h] // n
            assert torch.equal(heads, full.narrow(h, r * width, width)), (shape, s, h)
            back = cp.heads_to_seq(heads, s, h, g)
            assert back.dtype == x.dtype and torch.equal(back, x), (shape, s, h)
            # A non-contiguous input moves like its contiguous copy.
            xt = x.transpose(0, -1)
            st, ht = [(d % x.dim()) for d in (s, h)]
            swap = {0: x.dim() - 1, x.dim() - 1: 0}
            st, ht = swap.get(st, st), swap.get(ht, ht)
            assert torch.equal(cp.heads_to_seq(cp.seq_to_heads(xt, st, ht, g), st, ht, g), xt)
            checks += 1
    return checks


class _SplitSumGrad(torch.autograd.Function):
    """This rank's shard of a tensor every rank holds; the backward sums every rank's gradient for the whole
    tensor, so each rank's autograd sees the whole distributed function (what gradcheck needs)."""

    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g, ctx.shape = dim, g, x.shape
        return cp.split_inputs_cp(x, dim, g).clone()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        n, r = ctx.g.size(), ctx.g.rank()
        full = grad.new_zeros(ctx.shape)
        length = ctx.shape[ctx.dim] // n
        full.narrow(ctx.dim, r * length, length).copy_(grad)
        dist.all_reduce(full, group=ctx.g)
        return full, None, None


def case_gradcheck():
    """float64 gradcheck of the whole distributed attention: whole q, k, v in, whole output out.

    Every rank holds the same whole inputs and perturbs them alike, so the collectives stay in step.
    Groups of 2 get the full Jacobian, the group of 4 the fast (random projection) check.
    """
    checks = 0
    for g in cp_groups():
        n = g.size()

        def whole(q, k, v, g=g):
            parts = [_SplitSumGrad.apply(t, 1, g) for t in (q, k, v)]
            return cp.cat_outputs_cp_with_grad(cp.ulysses_attention(*parts, g), 1, g)

        q, k, v = (_data((1, n, n, 2), torch.float64, seed=s).requires_grad_(True) for s in (1, 2, 3))
        torch.manual_seed(0)  # fast mode's random directions: the same on every rank
        assert torch.autograd.gradcheck(whole, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=n > 2)
        checks += 1
    return checks


def _attention_cases(n):
    """(name, full q, k, v, seq_dim, head_dim, kwargs) in float32, bigger than gradcheck's."""
    q, k, v = (_data((2, 32, 8, 16), seed=s) for s in (11, 12, 13))
    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    sbhd = [t.transpose(0, 1).contiguous() for t in (q, k, v)]
    gqa_kv = [_data((2, 32, 4, 16), seed=s) for s in (14, 15)]

    def rope_like(q, k, v, **kw):  # a custom attn_fn: sees the whole sequence, this rank's heads
        return cp.sdpa_in_layout(q * 0.5, k, v.flip(-1), seq_dim=1, head_dim=2, **kw)

    return [
        ("bshd", q, k, v, 1, 2, {}),
        ("bhsd causal", *bhsd, 2, 1, {"is_causal": True}),
        ("sbhd negative dims", *sbhd, -4, -2, {"scale": 0.3}),
        ("gqa: k, v with fewer heads, one buffer", q, *gqa_kv, 1, 2, {"enable_gqa": True}),
        ("custom attn_fn", q, k, v, 1, 2, {"attn_fn": rope_like}),
    ]


def case_matches_one_process():
    """ulysses_attention == attention on the gathered inputs, forward and gradients into q, k and v."""
    worst = 0.0
    checks = 0
    for g in cp_groups():
        for name, q, k, v, s, h, kw in _attention_cases(g.size()):
            kw = dict(kw)
            attn_fn = kw.pop("attn_fn", None)
            w = _data(q.shape, seed=99)
            # One process: the whole sequence.
            ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
            if attn_fn is None:
                ref = cp.sdpa_in_layout(*ref_in, seq_dim=s, head_dim=h, **kw)
            else:
                ref = attn_fn(*ref_in, **kw)
            (ref * w).sum().backward()
            # Distributed: this rank's shards.
            mine = [_shard(t, s, g).requires_grad_(True) for t in (q, k, v)]
            out = cp.ulysses_attention(*mine, g, attn_fn=attn_fn, seq_dim=s, head_dim=h, **kw)
            assert out.shape == mine[0].shape, (name, out.shape)
            out.backward(_shard(w, s, g))
            errs = [_rel(out, _shard(ref.detach(), s, g))]
            errs += [_rel(m.grad, _shard(r.grad, s, g)) for m, r in zip(mine, ref_in, strict=True)]
            assert max(errs) <= 1e-5, (name, g.size(), errs)
            worst = max(worst, *errs)
            checks += 1
        # A group of None is plain attention, and the helpers return their input itself.
        q, k, v = _attention_cases(1)[0][1:4]
        assert torch.equal(cp.ulysses_attention(q, k, v), cp.sdpa_in_layout(q, k, v))
        assert cp.seq_to_heads(q, 1, 2) is q and cp.heads_to_seq(q, 1, 2, None) is q
    return checks, worst


def _bad_attn(q, k, v):
    return q.sum(1)


def _error_rows(n):
    """(function, args, kwargs, exception type, message fragments): every bad input and what it must say."""
    x = torch.zeros(2, 4, 4 * n, 3)            # [B, S, H, D] with H divisible by n
    odd = torch.zeros(2, 4, 4 * n + 1, 3)       # heads not divisible
    q = torch.zeros(1, 4, 4 * n, 8)
    return [
        (cp.seq_to_heads, ("x", 1, 2), {}, TypeError, ["seq_to_heads", "x must be a torch.Tensor", "str"]),
        (cp.seq_to_heads, (odd, 1, 2), {}, ValueError,
         [f"shape (2, 4, {4 * n + 1}, 3)", "number of heads", "head_dim=2", f"group of size {n}"]),
        (cp.seq_to_heads, (x, 4, 2), {}, ValueError, ["seq_dim=4 is out of range", "(2, 4, ", "valid dims: -4..3"]),
        (cp.seq_to_heads, (x, 1, -5), {}, ValueError, ["head_dim=-5 is out of range"]),
        (cp.seq_to_heads, (x, 1, -3), {}, ValueError, ["seq_dim=1 and head_dim=-3 both name dim 1", "must differ"]),
        (cp.seq_to_heads, (x, 1.0, 2), {}, TypeError, ["seq_dim must be an int", "float"]),
        (cp.heads_to_seq, (x, 1, True), {}, TypeError, ["head_dim must be an int", "bool"]),
        (cp.seq_to_heads, (torch.tensor(1.0), 0, 0), {}, ValueError, ["0-dim", "no sequence dimension"]),
        (cp.heads_to_seq, (torch.zeros(2, 4 * n + 1, 4, 3), 1, 2), {}, ValueError,
         ["heads_to_seq", "sequence length", f"size {4 * n + 1}", f"{n} equal blocks"]),
        (cp.ulysses_attention, (q, None, q), {}, TypeError, ["ulysses_attention", "k must be a torch.Tensor"]),
        (cp.ulysses_attention, (q, q.double(), q), {}, ValueError, ["same number of dims, dtype and device",
                                                                    "k (1, 4, ", "float64",
                                                                    "convert them to one dtype"]),
        (cp.ulysses_attention, (q, q, torch.zeros(1, 4, 4 * n + 1, 8)), {}, ValueError,
         ["v has shape", "number of heads", f"{n} equal blocks"]),
        (cp.ulysses_attention, (q, q, q), {"seq_dim": 2, "head_dim": 2}, ValueError, ["both name dim 2"]),
        (cp.ulysses_attention, (q, q, q), {"head_dim": 7}, ValueError, ["ulysses_attention, q: head_dim=7 is out of range"]),
        (cp.ulysses_attention, (torch.zeros(4, 4 * n),) * 3, {"seq_dim": 0, "head_dim": 1}, ValueError,
         ["at least 3 dims", "pass attn_fn"]),
    ]


def case_errors():
    import torch.distributed as dist

    found = 0
    for g in cp_groups():
        n = g.size()
        for fn, args, kwargs, exc, fragments in _error_rows(n):
            _raises(exc, fragments, fn, *args, cp_group=g, **kwargs)
            found += 1
        q = torch.zeros(1, 4, 4 * n, 8)
        for fn in (cp.seq_to_heads, cp.heads_to_seq):
            _raises(TypeError, ["ProcessGroup", "str"], fn, q, 1, 2, "world")
            _raises(TypeError, ["not a member"], fn, q, 1, 2, dist.GroupMember.NON_GROUP_MEMBER)
        _raises(TypeError, ["ProcessGroup", "int"], cp.ulysses_attention, q, q, q, 3)
        if n > 1:  # attn_fn's mistake is found after the first exchange, on every rank alike
            _raises(ValueError, ["attn_fn returned (1, ", "q's layout"], cp.ulysses_attention, q, q, q, g,
                    attn_fn=_bad_attn)
        # Shards of different shapes across ranks: named on every rank in debug mode.
        other = min(1, n - 1)
        mine = torch.zeros(1, 4 + (g.rank() == other), 4 * n, 8)
        os.environ[ENV] = "1"
        try:
            if n > 1:
                _raises(ValueError, [ENV, f"group rank {other} ", f"(1, 5, {4 * n}, 8)", f"(1, 4, {4 * n}, 8)"],
                        cp.seq_to_heads, mine, 1, 2, g)
                heads = torch.zeros(1, 4 * n, 2 + (g.rank() == other), 8)  # only the heads differ
                _raises(ValueError, [ENV, f"group rank {other} ", f"(1, {4 * n}, 3, 8)"], cp.heads_to_seq, heads, 1, 2, g)
                _raises(ValueError, ["ulysses_attention q", ENV, f"group rank {other} "], cp.ulysses_attention,
                        mine, mine, mine, g)
                wide = q.double() if g.rank() == other else q
                _raises(ValueError, ["ulysses_attention q", ENV, "float64", "float32"], cp.ulysses_attention,
                        wide, wide, wide, g)
        finally:
            os.environ.pop(ENV, None)
        # After all of that the group is still in step.
        y = _data((2, 4, 4 * n, 3), seed=5)
        assert torch.equal(cp.heads_to_seq(cp.seq_to_heads(y, 1, 2, g), 1, 2, g), y)
    return found


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("world", [2, 4])
def test_heads_to_seq_inverts_seq_to_heads_bit_for_bit(pools, world):
    checks = pools(world).run(case_round_trip)
    assert checks == [len(LAYOUTS) * (1 if world == 2 else 2)] * world


@pytest.mark.parametrize("world", [2, 4])
def test_gradcheck_float64(pools, world):
    assert pools(world).run(case_gradcheck) == [1 if world == 2 else 2] * world


@pytest.mark.parametrize("world", [2, 4])
def test_matches_one_process_forward_and_gradients(pools, world):
    results = pools(world).run(case_matches_one_process)
    assert all(c == (5 if world == 2 else 10) for c, _ in results)
    assert max(w for _, w in results) <= 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_bad_inputs_are_explained(pools, world):
    found = pools(world).run(case_errors)
    assert len(set(found)) == 1 and found[0] >= len(_error_rows(2))


def test_none_group_needs_no_process_group():
    q = _data((1, 6, 3, 4), seed=1)
    assert torch.equal(cp.ulysses_attention(q, q, q), cp.sdpa_in_layout(q, q, q))
    assert cp.seq_to_heads(q, 1, 2) is q
    _raises(ValueError, ["both name dim 1"], cp.ulysses_attention, q, q, q, seq_dim=1, head_dim=-3)
