"""cp's ring attention and Ulysses x ring (usp) on real gloo ranks: float64 equality with one process for the
output and the q, k and v gradients, point-to-point traffic only, errors."""

from __future__ import annotations

import datetime
import os

import torch

import cp
import cp.kernels
from cpgroups import data as _data
from cpgroups import raises as _raises
from cpgroups import spying

# ---------------------------------------------------------------- helpers run on every rank



def _shard(x, dim, n, i):
    """Shard i of n along dim, cut by torch itself (tensor_split), independently of cp."""
    return x.tensor_split(n, dim)[i].contiguous()


def _rel(got, want, whole):
    return ((got.double() - want.double()).abs().max() / whole.double().abs().max()).item()




def _reference(q, k, v, s, h, causal, scale):
    """Attention on the whole sequence in this one process (SDPA, K/V heads repeated for GQA), with grads."""
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    groups = q.shape[h] // k.shape[h]
    kk, vv = (t.repeat_interleave(groups, dim=h) for t in ins[1:])
    out = cp.sdpa_in_layout(ins[0], kk, vv, seq_dim=s, head_dim=h, is_causal=causal, scale=scale)
    w = _data(out.shape, 99, out.dtype)
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in ins], w


def _compare(name, run, q, k, v, s, h, causal, scale, n, i, tol, cast=None):
    """run(q, k, v shards) == one process on the whole sequence, for the output and q, k, v gradients."""
    ref, grads, w = _reference(q, k, v, s, h, causal, scale)
    mine = [_shard(t, s, n, i) if cast is None else _shard(t, s, n, i).to(cast) for t in (q, k, v)]
    mine = [t.requires_grad_(True) for t in mine]
    out = run(*mine)
    assert out.shape == mine[0].shape[:-1] + (mine[2].shape[-1],), (name, out.shape)  # q's layout, v's features
    assert out.dtype == mine[0].dtype, (name, out.dtype)
    out.backward(_shard(w, s, n, i).to(out.dtype))
    # Relative to the whole tensor's largest value: a shard's own may be ~0 (causal dq of the first token).
    errs = [_rel(out, _shard(ref, s, n, i), ref)]
    errs += [_rel(m.grad, _shard(g, s, n, i), g) for m, g in zip(mine, grads, strict=True)]
    assert max(errs) <= tol, (name, n, errs)
    return max(errs)


#: (name, batch, q heads, kv heads, feature, seq_dim, head_dim): layouts and head counts the ring must take.
SHAPES = [
    ("bshd", 2, 4, 4, 4, 1, 2),
    ("bhsd, gqa 4:2", 1, 4, 2, 3, 2, 1),
    ("sbhd negative dims, mqa 3:1", 2, 3, 1, 4, -4, -2),
]


def _ring_cases(n):
    """(name, q, k, v, s, h, causal, length or None, scale) for a ring of n ranks: even and uneven, causal or not."""
    cases = []
    # Even; uneven with one rank longer, with all but one longer; one token per rank.
    lengths = [(3 * n, 4 * n - 1), (3 * n + 1,), (n, 2 * n + 1)]
    for j, (name, b, hq, hkv, d, s, h) in enumerate(SHAPES):
        for length in lengths[j]:
            for causal in (False, True):
                def full(heads, seed, length=length, b=b, s=s, h=h, d=d):
                    shape = [b, length, heads, d]
                    x = _data(shape, seed)  # [B, S, H, D], moved to the layout's dims
                    return x.movedim((1, 2), (s % 4, h % 4)).contiguous()
                q, k, v = full(hq, 10 * j + 1), full(hkv, 10 * j + 2), full(hkv, 10 * j + 3)
                scale = 0.7 if length == n else None
                uneven = length % n != 0
                cases.append((f"{name}, L={length}, causal={causal}", q, k, v, s, h, causal,
                              length if uneven or length == n else None, scale))
    return cases


def _groups():
    """The rings to test on this world: every group of 2, 3 and 4 ranks shown below, in group-rank order."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out = [dist.group.WORLD]
    if world == 4:
        # A ring of 3 whose group ranks are not the global ranks, and two rings of 2 with a gap between members.
        for members in ([3, 1, 2],):
            g = dist.new_group(members)
            if dist.get_rank() in members:
                out.append(g)
        for pair in ([0, 2], [1, 3]):
            g = dist.new_group(pair)
            if dist.get_rank() in pair:
                out.append(g)
    return out


def case_ring_matches_one_process():
    import torch.distributed as dist

    worst, checks = 0.0, 0
    groups = _groups()
    try:
        checks, worst = _ring_checks(groups)
    finally:  # the pool's ranks outlive this case: leave torch's group registry as it was
        cp.kernels.use_fused = True
        for g in groups:
            if g is not dist.group.WORLD:
                dist.destroy_process_group(g)
    return checks, worst


def _ring_checks(groups):
    import torch.distributed as dist

    worst, checks = 0.0, 0
    for g in groups:
        n, i = g.size(), g.rank()
        cases = _ring_cases(n)
        if n < dist.get_world_size():
            cases = cases[n % 2::2]  # the smaller rings: every other case (alternating causal), for time
        # On CPU the blocks use torch's fused kernel; the smaller rings check the plain one (GPUs use it).
        cp.kernels.use_fused = n == dist.get_world_size()
        for name, q, k, v, s, h, causal, length, scale in cases:
            def run(qs, ks, vs, g=g, causal=causal, length=length, s=s, h=h, scale=scale):
                return cp.ring_attention(qs, ks, vs, g, causal=causal, length=length, seq_dim=s, head_dim=h,
                                         softmax_scale=scale)
            worst = max(worst, _compare(name, run, q, k, v, s, h, causal, scale, n, i, 1e-10))
            checks += 1
        # Lower precisions: the output keeps the input dtype, the sums are float32.
        q, k, v = (_data((1, 4 * n + 1, 2, 8), seed) for seed in (5, 6, 7))
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            def run(qs, ks, vs, g=g, n=n):
                return cp.ring_attention(qs, ks, vs, g, causal=True, length=4 * n + 1)
            _compare(f"{dtype}", run, q, k, v, 1, 2, True, None, n, i, tol, cast=dtype)
            checks += 1
        # A value dim other than the key dim.
        q, k = (_data((2, 2 * n, 2, 4), seed) for seed in (8, 9))
        v = _data((2, 2 * n, 2, 6), 10)
        _compare("dv != dk", lambda a, b, c, g=g: cp.ring_attention(a, b, c, g), q, k, v, 1, 2, False, None, n, i, 1e-10)
        checks += 1
    cp.kernels.use_fused = True
    return checks, worst


def case_ring_plain_without_group():
    """cp_group None: plain attention (SDPA), the same answer."""
    q, k, v = (_data((2, 7, 4, 4), seed) for seed in (1, 2, 3))
    kk, vv = k[:, :, :2], v[:, :, :2]
    for causal in (False, True):
        want = cp.sdpa_in_layout(q, kk.repeat_interleave(2, 2), vv.repeat_interleave(2, 2), is_causal=causal)
        assert torch.allclose(cp.ring_attention(q, kk, vv, causal=causal), want)
        assert torch.allclose(cp.ring_attention(q, kk, vv, causal=causal, length=7), want)
    return 1


# ---------------------------------------------------------------- the traffic: point to point only, one block at a time

def case_ring_traffic():
    """Record every communication call while ring attention runs (the real functions still run) and every
    tensor autograd saves: only batch_isend_irecv, only to the next rank and from the previous one, one
    block per message, and nothing saved bigger than this rank's own q, k, v."""
    import torch.distributed as dist

    g = dist.group.WORLD
    n, r = g.size(), g.rank()
    calls, p2p = [], []

    def record(name, args, kwargs):
        if name == "batch_isend_irecv":
            p2p.append([])
        if name in ("isend", "irecv"):  # as batch_isend_irecv calls them on gloo: tensor, group peer by keyword
            peer = kwargs.get("group_dst", kwargs.get("group_src", kwargs.get("dst", kwargs.get("src"))))
            p2p[-1].append((name, peer, args[0].numel()))
        calls.append(name)

    length, heads, d = 4 * n + 3, 4, 8  # uneven
    q, k, v = (_data((1, length, heads, d), seed) for seed in (1, 2, 3))
    mine = [_shard(t, 1, n, r).requires_grad_(True) for t in (q, k, v)]
    block = max(cp.shard_sizes(length, n)) * heads * d  # the largest rank's k (or v)
    saved = []
    results = {}
    for causal in (False, True):
        calls.clear()
        p2p.clear()
        saved.clear()
        with spying(record):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t):
                out = cp.ring_attention(*mine, g, causal=causal, length=length)
            forward = len(p2p)
            out.sum().backward()
        assert set(calls) == {"batch_isend_irecv", "isend", "irecv"}, calls  # no collective: no K/V gather anywhere
        assert all(batch for batch in p2p)
        nxt, prv = (r + 1) % n, (r - 1) % n
        ops = [op for batch in p2p for op in batch]
        assert all((kind == "isend" and peer == nxt) or (kind == "irecv" and peer == prv) for kind, peer, _ in ops), ops
        # One message carries one block's k and v (the backward's dK/dV the same size): never the whole sequence.
        assert max(numel for _, _, numel in ops) <= 2 * block, (ops, block)
        assert max(saved) <= max(t.numel() for t in mine) * 2, saved  # q, k, v, out, lse of this rank only
        sends_fwd = sum(kind == "isend" for batch in p2p[:forward] for kind, _, _ in batch)
        results[causal] = (sends_fwd, len([op for op in ops if op[0] == "isend"]))
    return results


# ---------------------------------------------------------------- usp over megatron's hierarchical cp groups


def _usp_setups(world):
    """(cp size, [ulysses, ring]) to initialize on this world."""
    return {8: [(8, [2, 4]), (8, [4, 2]), (4, [2, 2])]}[world]  # cp 4 on 8 ranks: two cp groups side by side


def _usp_cases(c, u):
    """(length, causal, (q heads, kv heads, seq_dim, head_dim)) for cp size c = u * r: each length (even, one
    rank longer, all but one longer, ragged) with both masks, the three head layouts taking turns."""
    heads = [(2 * u, 2 * u, 1, 2), (u, u, 2, 1), (2 * u, 1, 1, 2)]  # MHA [B, S, H, D]; [B, H, S, D]; MQA
    lengths = [3 * c, 3 * c + 1, 4 * c - 1, c + u + 1]
    return [(length, causal, heads[(2 * i + causal) % 3]) for i, length in enumerate(lengths)
            for causal in (False, True)]


def case_usp_matches_one_process():
    import parallel_state as ps

    checks, worst = [], 0.0
    for c, (u, r) in _usp_setups(torch.distributed.get_world_size()):
        ps.initialize_model_parallel(context_parallel_size=c, hierarchical_context_parallel_sizes=[u, r],
                                     timeout=datetime.timedelta(seconds=30))
        ug, rg = ps.get_hierarchical_context_parallel_groups()
        assert (ug.size(), rg.size()) == (u, r)
        cp_rank = ps.get_context_parallel_rank()
        assert cp_rank == rg.rank() * u + ug.rank(), (cp_rank, rg.rank(), ug.rank())
        for length, causal, (hq, hkv, s, h) in _usp_cases(c, u):
            shape = [2, length, hq, 4]
            q = _data(shape, 1).movedim((1, 2), (s, h)).contiguous()
            k, v = (_data([2, length, hkv, 4], seed).movedim((1, 2), (s, h)).contiguous() for seed in (2, 3))
            even = length % c == 0

            def run(qs, ks, vs, causal=causal, length=length, s=s, h=h, even=even, ug=ug, rg=rg):
                return cp.usp_attention(qs, ks, vs, ulysses_group=ug, ring_group=rg, causal=causal,
                                        length=None if even else length, seq_dim=s, head_dim=h)
            name = f"usp {u}x{r} L={length} causal={causal} heads {hq}:{hkv}"
            worst = max(worst, _compare(name, run, q, k, v, s, h, causal, None, c, cp_rank, 1e-10))
            checks.append(name)
        ps.destroy_model_parallel()
    return len(checks), worst


def case_usp_degrades():
    """A group of one (or None) drops that method: ring alone, Ulysses alone, plain attention."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    solo = None  # a group of one
    q, k, v = (_data((1, 3 * world, world, 4), seed) for seed in (1, 2, 3))
    for causal in (False, True):
        for ug, rg in ((dist.group.WORLD, solo), (solo, dist.group.WORLD), (solo, solo)):
            n = 1 if ug is None and rg is None else world

            def run(a, b, c, ug=ug, rg=rg, causal=causal):
                return cp.usp_attention(a, b, c, ulysses_group=ug, ring_group=rg, causal=causal)
            _compare(f"degrade {ug is None} {rg is None}", run, q, k, v, 1, 2, causal, None, n,
                     rank if n > 1 else 0, 1e-10)
    return 1


# ---------------------------------------------------------------- errors


def case_errors():
    import torch.distributed as dist

    g = dist.group.WORLD
    n, r = g.size(), g.rank()
    q = torch.zeros(1, 3, 4, 8)
    rows = [
        ((q, None, q), {}, TypeError, ["ring_attention", "k must be a torch.Tensor"]),
        ((q, q.double(), q), {}, ValueError, ["same number of dims, dtype and device", "float64"]),
        ((q, q[:, :2], q), {}, ValueError, ["sequence lengths differ (3, 2, 3)"]),
        ((q, q[:, :, :3], q[:, :, :3]), {}, ValueError, ["must divide q's (4)", "k 3, v 3"]),
        ((q, q[:, :, :2], q), {}, ValueError, ["same number of heads", "k 2, v 4"]),
        ((q, q[..., :4], q), {}, ValueError, ["feature dims differ (8 and 4)"]),
        ((q[0, 0], q[0, 0], q[0, 0]), {"seq_dim": 0, "head_dim": 1}, ValueError, ["at least 3 dims"]),
        ((q.long(),) * 3, {}, TypeError, ["floating-point"]),
        ((q, q, q), {"seq_dim": 2, "head_dim": 2}, ValueError, ["both name dim 2"]),
        ((q, q, q), {"head_dim": 7}, ValueError, ["head_dim=7 is out of range"]),
        ((q, q, q), {"causal": 1}, TypeError, ["causal must be a bool"]),
        ((q, q, q), {"softmax_scale": -1.0}, ValueError, ["softmax_scale must be a positive number"]),
        ((q, q, q), {"length": 3.0}, TypeError, ["length must be an int"]),
        ((q, q, q), {"length": n - 1}, ValueError, [f"length={n - 1} is shorter than the group"]),
        # Every rank holds 3 tokens where length gives it 2 (a rank alone in its mistake would leave the
        # others waiting in the ring until the group's timeout; PARALLEL_STATE_DEBUG=1 checks across ranks).
        ((q, q, q), {"length": 2 * n}, ValueError,
         [f"group rank {r} (global {r}) holds 3 tokens", f"length={2 * n}", "gives it 2", "uneven=True"]),
    ]
    found = 0
    for args, kwargs, exc, fragments in rows:
        _raises(exc, fragments, cp.ring_attention, *args, g, **kwargs)
        found += 1
    _raises(TypeError, ["ProcessGroup", "str"], cp.ring_attention, q, q, q, "world")
    _raises(TypeError, ["ulysses_group", "ProcessGroup"], cp.usp_attention, q, q, q, ulysses_group=3, ring_group=None)
    # usp: a rank whose shard is not the one length gives it, named with its cp, ring and ulysses ranks.
    if n == 4:
        import parallel_state as ps

        ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
        ug, rg = ps.get_hierarchical_context_parallel_groups()
        sizes = cp.shard_sizes(13, 4)
        x = torch.zeros(1, sizes[ps.get_context_parallel_rank()] + (r == 3), 4, 8)
        if r == 3:
            _raises(ValueError, ["cp rank 3 (ring rank 1, ulysses rank 1", "holds 4 tokens", "length=13"],
                    cp.usp_attention, x, x, x, ulysses_group=ug, ring_group=rg, length=13)
        _raises(ValueError, ["length=3 is shorter than the cp group (2 x 2 = 4 ranks)"], cp.usp_attention, x, x, x,
                ulysses_group=ug, ring_group=rg, length=3)
        found += 1
        ps.destroy_model_parallel()
    # PARALLEL_STATE_DEBUG=1: one rank with a shard of the wrong length makes every rank raise, naming it.
    os.environ["PARALLEL_STATE_DEBUG"] = "1"
    try:
        x = torch.zeros(1, cp.shard_sizes(3 * n + 1, n)[r] + (r == 1), 4, 8)
        _raises(ValueError, ["PARALLEL_STATE_DEBUG", "group rank 1 (global 1)", "3 tokens expected"],
                cp.ring_attention, x, x, x, g, length=3 * n + 1)
        found += 1
    finally:
        os.environ.pop("PARALLEL_STATE_DEBUG", None)
    # After all of that the ring still works.
    x = _data((1, 2 * n, 2, 4), 3)
    mine = _shard(x, 1, n, r)
    assert torch.allclose(cp.ring_attention(mine, mine, mine, g), _shard(cp.sdpa_in_layout(x, x, x), 1, n, r))
    return found


# ---------------------------------------------------------------- tests


def test_ring_matches_one_process_at_2_3_4_ranks_even_uneven_causal_gqa(pools):
    results = pools(4).run(case_ring_matches_one_process, timeout=120)
    full, part = len(_ring_cases(2)) + 3, len(_ring_cases(2)) // 2 + 3
    # The world (4) on every rank, the ring of 3 (ranks 3, 1, 2: rank 0 is not in it) and a pair (2).
    assert [c for c, _ in results] == [full + part, full + 2 * part, full + 2 * part, full + 2 * part]
    assert max(w for _, w in results) <= 1e-10


def test_ring_without_group_is_plain_attention():
    assert case_ring_plain_without_group() == 1


def test_ring_sends_point_to_point_only_and_never_gathers(pools):
    results = pools(4).run(case_ring_traffic)
    for rank, res in enumerate(results):
        # Not causal: n - 1 K/V sends forward; backward n - 1 more and n dK/dV accumulators.
        assert res[False] == (3, 3 + 3 + 4), res
        # Causal: rank r passes its blocks on only while rank r + 1 needs them (none from the last rank).
        kv = min(rank + 1, 3) if rank < 3 else 0
        assert res[True] == (kv, 2 * kv + 4), (rank, res)


def test_usp_over_megatron_hierarchical_groups_2x2_2x4_4x2(pools):
    results = pools(8).run(case_usp_matches_one_process, timeout=180)
    want = sum(len(_usp_cases(c, u)) for c, (u, _) in _usp_setups(8))
    assert [c for c, _ in results] == [want] * 8
    assert max(w for _, w in results) <= 1e-10


def test_usp_degrades_to_ring_ulysses_or_plain(pools):
    assert pools(4).run(case_usp_degrades) == [1] * 4


def test_bad_inputs_are_explained(pools):
    found = pools(4).run(case_errors)
    assert found == [17] * 4


def test_shard_sizes_sum_of_consecutive_shards_splits_again():
    """usp's premise: u consecutive tensor_split shards of L over c are tensor_split's shards of their sum over u."""
    for length in range(1, 80):
        for u in (1, 2, 3, 4):
            for r in (1, 2, 3, 4):
                c = u * r
                if length < c:
                    continue
                sizes = cp.shard_sizes(length, c)
                for j in range(r):
                    part = sizes[j * u:(j + 1) * u]
                    assert cp.shard_sizes(sum(part), u) == part, (length, u, r, j)
