"""``cp.KVCache`` on real gloo ranks: a rollout chunk by chunk equals one process's attention over [the kept chunks'
K/V, the chunk's own K/V] in float64, on 1, 2, 3 and 4 ranks, uneven shards, GQA, windows and two layouts; every mistake is
an error on every rank; the autoregressive example matches recomputing the prefix at two cp sizes.
"""

from __future__ import annotations

import pytest
import torch

import cp
from cpgroups import cp_groups
from cpgroups import data as _data
from cpgroups import raises as _raises

# ---------------------------------------------------------------- helpers run on every rank


def _reference(q, ks, vs, s, h, scale=None):
    """One process: the chunk's queries over the concatenated K/V (heads repeated for GQA), float64."""
    k, v = torch.cat(ks, s), torch.cat(vs, s)
    g = q.shape[h] // k.shape[h]
    k, v = (x.repeat_interleave(g, h) for x in (k, v))
    qq, kk, vv = (x.movedim((h, s), (-3, -2)) for x in (q, k, v))
    w = (qq @ kk.transpose(-1, -2) * (scale or qq.shape[-1] ** -0.5)).softmax(-1)
    return (w @ vv).movedim((-3, -2), (h, s))


def _close(got, want, what, rel=1e-10):
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert got.shape == want.shape and got.dtype == want.dtype and err <= rel, (what, tuple(got.shape), err)


#: (name, q / kv heads, q / k / v feature sizes, layout (seq_dim, head_dim), chunk lengths as multiples of n plus
#: an offset, window, scale): uneven chunks, GQA and MQA, a v feature size of its own (the math kernel), heads
#: first, windows of 1, 2 and 3 chunks.
CONFIGS = [
    ("plain", 4, 4, 8, 8, (1, 2), (2, 1, 3, 0), None, None),
    ("gqa window 2", 4, 2, 8, 8, (1, 2), (1, 2, 0, 3), 2, None),
    ("mqa bhsd window 3", 6, 1, 4, 4, (2, 1), (3, 1, 2, 2), 3, 0.3),
    ("dv of its own", 2, 1, 8, 6, (1, 2), (0, 5, 1, 2), None, None),
    ("window 1", 2, 2, 4, 4, (1, 2), (2, 1, 0, 1), 1, None),
]


def _chunk(shape_sh, heads, dim, s, h, length, seed):
    shape = [2, 0, 0, dim]
    shape[s], shape[h] = length, heads
    return _data(shape, seed=seed)


def _rollout(g, config, steps=2, dtype=None, rel=1e-10):
    """Chunk by chunk: ``steps`` attends per chunk (new queries each) against the reference, then the append."""
    name, hq, hkv, d, dv, (s, h), offsets, window, scale = config
    n = 1 if g is None else g.size()
    cache = cp.KVCache(g, window_chunks=window, seq_dim=s, head_dim=h)
    kept_k, kept_v, local = [], [], []
    for c, off in enumerate(offsets):
        length = n + off if off else n  # offset 0: one token per rank
        length = length + 2 * n * (c % 2)
        k = _chunk(None, hkv, d, s, h, length, seed=100 * c + 1)
        v = _chunk(None, hkv, dv, s, h, length, seed=100 * c + 2)
        for step in range(steps):
            q = _chunk(None, hq, d, s, h, length, seed=100 * c + 10 + step)
            want = _reference(q, kept_k + [k], kept_v + [v], s, h, scale)
            shards = [cp.split_inputs_cp(x if dtype is None else x.to(dtype), s, g, uneven=True) for x in (q, k, v)]
            with torch.no_grad():
                got = cache.attend(*shards, softmax_scale=scale)
            mine = cp.split_inputs_cp(want, s, g, uneven=True)
            _close(got.double() if dtype is not None else got, mine, (name, n, c, step), rel)
            assert got.dtype == shards[0].dtype
        cache.append(*shards[1:])
        kept = 0 if window is None else window - 1
        kept_k, kept_v, local = ((xs + [x])[-kept:] if kept else (xs + [x] if window is None else [])
                                 for xs, x in ((kept_k, k), (kept_v, v), (local, shards[1].shape[s])))
        assert len(cache) == len(kept_k) and cache.local_tokens == sum(local), (name, len(cache), cache.local_tokens)
    return len(offsets) * steps


def _three():
    """On 4 ranks, a group of 3 (ranks 0-2; None on rank 3): uneven shards of another kind."""
    import torch.distributed as dist

    if dist.get_world_size() != 4:
        return []
    group = dist.new_group([0, 1, 2])
    return [group] if dist.get_rank() < 3 else []


def case_rollouts_match_one_process():
    import torch.distributed as dist

    checks = 0
    for g in cp_groups() + _three():
        for config in CONFIGS:
            checks += _rollout(g, config)
        checks += _rollout(g, CONFIGS[1], steps=1, dtype=torch.float32, rel=1e-5)  # the fused float32 kernel
        if g.size() == 3:
            dist.destroy_process_group(g)
    return checks


def _expect(exc_type, mine_bad, fragments, others, fn, *args, **kwargs):
    """This rank's own error where it is the one at fault, else the others' ValueError naming it."""
    if mine_bad:
        return _raises(exc_type, fragments + ["every rank of the cp group raises"], fn, *args, **kwargs)
    return _raises(ValueError, others, fn, *args, **kwargs)


def case_errors_on_every_rank():
    """Each mistake raises on every rank before any data moves; the group attends correctly afterwards."""
    import torch.distributed as dist

    found = 0
    for g in cp_groups():
        n, r = g.size(), g.rank()
        ranks = dist.get_process_group_ranks(g)
        last = f"group rank {n - 1} (global {ranks[-1]})"
        first = f"group rank 0 (global {ranks[0]})"
        length = 2 * n + 1
        sizes = cp.shard_sizes(length, n)
        q, k, v = (_data((1, sizes[r], 4, 8), seed=i) for i in range(3))
        cache = cp.KVCache(g)
        cache.append(k[:, :, :2], v[:, :, :2])
        # q and k of different lengths on the last rank only
        k_short = k[:, :-1] if r == n - 1 and sizes[r] > 1 else k
        bad = r == n - 1 and sizes[r] > 1
        if sizes[-1] > 1:
            _expect(ValueError, bad, ["KVCache.attend", "sequence lengths differ"],
                    ["KVCache.attend", last, "not shards of one chunk"], cache.attend, q, k_short[:, :, :2],
                    v[:, :, :2])
            found += 1
        # k and v of different shapes (heads) on rank 0, appending
        _expect(ValueError, r == 0, ["KVCache.append", "not one chunk's K/V"], [first, "not shards of one chunk"],
                cache.append, k[:, :, :2], v[:, :, :2 if r else 1])
        # K/V heads unlike the cache's, on every rank and on rank 0 only
        _raises(ValueError, ["differ from the cached K/V", "clear()", "every rank of the cp group raises"],
                cache.attend, q, k[:, :, :1], v[:, :, :1])
        _expect(ValueError, r == 0, ["differ from the cached K/V"], [first, "differ from the cached ones"],
                cache.attend, q, k[:, :, :1 if r == 0 else 2], v[:, :, :1 if r == 0 else 2])
        # a head dim unlike the cache's
        _raises(ValueError, ["differ from the cached K/V"], cache.attend, q[..., :4], k[:, :, :2, :4], v[:, :, :2, :4])
        found += 4
        # one rank appends while the others attend
        if r == 0:
            fn, args = cache.append, (k[:, :, :2], v[:, :, :2])
        else:
            fn, args = cache.attend, (q, k[:, :, :2], v[:, :, :2])
        _raises(ValueError, [f"{first} called KVCache.append", "called KVCache.attend", "same order"], fn, *args)
        # shards that are not shard_sizes' split: the last rank holds one token more than the first
        odd = [_data((1, sizes[0] + 1 if r == n - 1 else sizes[r], 4 if i == 0 else 2, 8), seed=i) for i in range(3)]
        _raises(ValueError, ["shard_sizes(", f"{last} holds {sizes[0] + 1}", "split_inputs_cp"], cache.attend, *odd)
        # a softmax scale of its own on rank 0
        _raises(ValueError, ["differ beyond their token counts", "softmax_scale"], cache.attend, q, k[:, :, :2],
                v[:, :, :2], softmax_scale=0.5 if r == 0 else None)
        found += 3
        # autograd recording through attend on rank 0 only
        qg = q.clone().requires_grad_(r == 0)
        _expect(RuntimeError, r == 0, ["inference", "torch.no_grad()"], [first, "inference only"],
                cache.attend, qg, k[:, :, :2], v[:, :, :2])
        # a cache cleared on rank 0 alone
        if r == 0:
            cache.clear()
        _raises(ValueError, ["different numbers of chunks", "clears"], cache.attend, q, k[:, :, :2], v[:, :, :2])
        found += 2
        # still in step: every rank clears, then a correct attend
        cache.clear()
        whole = [_data((1, length, 4 if i == 0 else 2, 8), seed=20 + i) for i in range(3)]
        with torch.no_grad():
            got = cache.attend(*(cp.split_inputs_cp(x, 1, g, uneven=True) for x in whole))
        _close(got, cp.split_inputs_cp(_reference(whole[0], [whole[1]], [whole[2]], 1, 2), 1, g, uneven=True), "after")
        found += 1
    return found


def case_repeats_judged_on_the_device():
    """Where reading a round waits for the GPU (NCCL; here gloo made to act so): the later steps of a chunk read no
    round and stay exact; a rank that changes its call while the others repeat theirs raises naming them, and the
    repeating ranks stop at their device-side assertion (on a CPU it raises at once)."""
    import torch.distributed as dist

    from cp import agree, call_check

    reads = []
    table = agree.Pending.table

    def counted(self):
        reads.append(1)
        return table(self)

    call_check.reads_wait_everywhere, agree.Pending.table = True, counted
    try:
        found = 0
        for g in cp_groups():
            n, r = g.size(), g.rank()
            first = f"group rank 0 (global {dist.get_process_group_ranks(g)[0]})"
            cache = cp.KVCache(g)
            whole = [_data((1, 2 * n + 1, heads, 8), seed=30 + i) for i, heads in enumerate((4, 2, 2))]
            mine = [cp.split_inputs_cp(x, 1, g, uneven=True) for x in whole]
            want = cp.split_inputs_cp(_reference(whole[0], [whole[1]], [whole[2]], 1, 2), 1, g, uneven=True)
            with torch.no_grad():
                for step in range(3):
                    before = len(reads)
                    _close(cache.attend(*mine), want, ("step", step))
                    assert len(reads) - before == (1 if step == 0 else 0), (step, len(reads) - before)
                    found += 1
                cache.append(*mine[1:])  # an append reads (its row is new), so does the next chunk's first attend
                before = len(reads)
                cache.attend(*mine)
                cache.attend(*mine)
                assert len(reads) - before == 1
                # rank 0 changes its shard (one token fewer on every rank would be another chunk), the others repeat
                changed = [x[:, :-1] for x in mine] if r == 0 else mine
                if r == 0:
                    _raises(ValueError, ["repeated their last call", f"while {first} made another"], cache.attend, *changed)
                else:
                    _raises(RuntimeError, ["KVCache: the ranks' calls differ"], cache.attend, *changed)
                found += 1
                _close(cache.attend(*mine), cp.split_inputs_cp(
                    _reference(whole[0], [whole[1], whole[1]], [whole[2], whole[2]], 1, 2), 1, g, uneven=True),
                    "still in step")
                found += 1
        return found
    finally:
        call_check.reads_wait_everywhere, agree.Pending.table = False, table


def _example():
    import importlib.util
    import os
    import sys

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)  # the example imports its model, demo_dit, as a script next to it does
    spec = importlib.util.spec_from_file_location("autoregressive_dit", os.path.join(examples, "autoregressive_dit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_example(window_chunks):
    """The example's worker: the rollout at cp 2 (dp 2) then cp 4 with the cache and by recomputation, and in one
    process; every video the same (rel 1e-10, float64)."""
    import parallel_state as ps

    example = _example()
    log = example.serve((2, 4), chunks=3, steps=2, window_chunks=window_chunks)
    alone = example.rollout(None, chunks=3, steps=2, window_chunks=window_chunks)
    for r in log:
        _close(r["video"], alone, ("cached", r["cp"]))
        _close(r["recomputed"], alone, ("recomputed", r["cp"]))
    assert not ps.model_parallel_is_initialized()
    return [(r["cp"], r["freed"], r["cache_bytes"]) for r in log]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_rollouts_match_one_process(pools, world):
    per_group = sum(len(c[6]) * 2 for c in CONFIGS) + len(CONFIGS[1][6])
    want = [per_group] * 2 if world == 2 else [3 * per_group] * 3 + [2 * per_group]  # 4 ranks: also a group of 3
    assert pools(world).run(case_rollouts_match_one_process) == want


@pytest.mark.parametrize("world", [2, 4])
def test_mistakes_raise_on_every_rank(pools, world):
    assert pools(world).run(case_errors_on_every_rank) == [11 * (1 if world == 2 else 2)] * world


@pytest.mark.parametrize("world", [2, 4])
def test_repeated_steps_read_no_round_where_reading_waits_for_the_gpu(pools, world):
    assert pools(world).run(case_repeats_judged_on_the_device) == [5 * (1 if world == 2 else 2)] * world


def test_one_process_is_a_plain_cache():
    for config in CONFIGS:
        assert _rollout(None, config) == 8


def test_the_window_is_sliding_window_masks_for_equal_chunks():
    """For chunks of one length the kept chunks are exactly the keys ``cp.Mask.sliding_window(chunk, W)`` (and,
    without a window, ``cp.Mask.chunk_causal(chunk)``) lets a chunk's queries see."""
    chunk, chunks = 5, 5
    q, k, v = (_data((1, chunk * chunks, 2, 4), seed=i) for i in range(3))
    for window in (None, 1, 2, 3):
        mask = cp.Mask.chunk_causal(chunk) if window is None else cp.Mask.sliding_window(chunk, window)
        whole = cp.sdpa_in_layout(q, k, v, attn_mask=mask.dense(chunk * chunks))
        cache = cp.KVCache(window_chunks=window)
        for c in range(chunks):
            part = [x[:, c * chunk:(c + 1) * chunk] for x in (q, k, v)]
            _close(cache.attend(*part), whole[:, c * chunk:(c + 1) * chunk], (window, c))
            cache.append(*part[1:])


def test_the_cache_holds_copies():
    """K/V in the cache's own layout ([B, H, S, D]) are copied in: changing them afterwards changes nothing."""
    q, k, v = (_data((1, 2, 3, 4), seed=i) for i in range(3))
    cache = cp.KVCache(seq_dim=2, head_dim=1)
    cache.append(k, v)
    want = cache.attend(q, k, v)
    k.zero_()
    v.zero_()
    k2, v2 = (_data((1, 2, 3, 4), seed=i) for i in (1, 2))
    _close(cache.attend(q, k2, v2), want, "copied")


def test_bad_arguments_are_errors():
    _raises(ValueError, ["window_chunks=0", "None"], cp.KVCache, window_chunks=0)
    _raises(TypeError, ["window_chunks must be an int"], cp.KVCache, window_chunks=2.0)
    _raises(TypeError, ["seq_dim must be an int"], cp.KVCache, seq_dim=True)
    _raises(TypeError, ["cp_group must be"], cp.KVCache, "world")
    cache = cp.KVCache()
    x = torch.zeros(1, 3, 2, 4)
    _raises(TypeError, ["q must be a torch.Tensor"], cache.attend, None, x, x)
    _raises(ValueError, ["holds no tokens"], cache.attend, x[:, :0], x[:, :0], x[:, :0])
    _raises(RuntimeError, ["inference", "torch.no_grad()"], cache.attend, x.requires_grad_(), x, x)
    _raises(ValueError, ["not one chunk's K/V"], cache.append, x, torch.zeros(1, 4, 2, 4))
    assert len(cache) == 0 and cache.local_tokens == 0 and cache.local_bytes == 0


@pytest.mark.parametrize("window_chunks", [None, 2])
def test_the_example_rolls_out_as_recomputing_the_prefix_at_two_cp_sizes(pools, window_chunks):
    rows = pools(4).run(case_example, window_chunks, timeout=120)
    example = _example()
    chunk_bytes = 2 * 2 * example._chunk_tokens() * example.CFG.dim * 8  # K and V of both blocks, float64
    kept = 3 if window_chunks is None else window_chunks - 1
    for rank_rows in rows:
        assert [cp_size for cp_size, _, _ in rank_rows] == [2, 4]
        for cp_size, freed, cache_bytes in rank_rows:
            assert freed, rank_rows  # nothing of a rollout outlives it
            # about 1/cp of the kept chunks' K/V on each rank (uneven shards: within one token a chunk)
            assert abs(cache_bytes - kept * chunk_bytes / cp_size) <= kept * chunk_bytes / example._chunk_tokens()
