"""Uneven sequence shards on real gloo ranks: the split/gather helpers, and Ulysses with uneven shards and GQA.

Shard i of a sequence of length L over n ranks holds ``cp.shard_sizes(L, n)[i]`` tokens (torch.tensor_split's
rule). Everything is float64 against one process holding the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

import cp
from cpgroups import cp_groups
from cpgroups import data as _data
from cpgroups import raises as _raises

# ---------------------------------------------------------------- helpers run on every rank

def _part(x, dim, g):
    """This rank's tensor_split shard: the oracle the helpers must agree with."""
    return x.tensor_split(g.size(), dim=dim)[g.rank()]




def _close(got, want, what):
    err = (got - want).abs().max().item()
    assert got.shape == want.shape and err <= 1e-12 * max(1.0, want.abs().max().item()), (what, got.shape, err)
    return err


# ---------------------------------------------------------------- split / gather cases

def _shapes(length, big):
    """(shape, seq_dim) with ``length`` along seq_dim: leading (received in place), behind a batch, a latent's
    T, negative dims; with ``big`` also tensors of 128 KiB or more (gloo then gathers by broadcasts)."""
    small = [((length, 4), 0), ((2, length, 3), 1), ((1, 2, length, 3, 2), 2), ((3, length), -1)]
    return small + ([((length, 2048), 0), ((2, length, 1024), -2)] if big else [])


def _lengths(n):
    return (n, n + 1, 2 * n - 1, 3 * n + 2)


def case_uneven_round_trips():
    """Every helper against tensor_split: split, gather (length= and uneven=, both gather strategies),
    gather with grad (local slice only), broadcast_split_tensor, the object lists."""
    import torch.distributed as dist

    from cp.shard import gather_cat_uneven

    me = dist.get_rank()
    checks = 0
    for g in cp_groups():
        n, r = g.size(), g.rank()
        src = min(dist.get_process_group_ranks(g))
        for length in _lengths(n):
            sizes = cp.shard_sizes(length, n)
            for shape, d in _shapes(length, big=length == _lengths(n)[-1]):
                x = _data(shape, seed=length)
                shard = cp.split_inputs_cp(x, d, g, uneven=True)
                want = _part(x, d, g)
                assert torch.equal(shard, want) and shard.is_contiguous(), (shape, d)
                assert shard.shape[d] == sizes[r]
                for kw in ({"length": length}, {"uneven": True}):
                    assert torch.equal(cp.cat_outputs_cp(shard, d, g, **kw), x), (shape, d, kw)
                if n > 1:
                    for strategy in ("broadcasts", "all_gather"):
                        got = gather_cat_uneven(shard, d % x.dim(), g, sizes, strategy=strategy)
                        assert torch.equal(got, x), (shape, d, strategy)
                inp = x if dist.get_rank() == src else (None if me % 2 else torch.zeros(3))
                out = cp.broadcast_split_tensor(inp, d, g, uneven=True)
                assert torch.equal(out, want) if n > 1 else out is inp
                # Autograd: the gradient reaches exactly this rank's slice of an upstream leaf.
                leaf = x.clone().requires_grad_(True)
                full = cp.cat_outputs_cp_with_grad(cp.split_inputs_cp(leaf * 1.0, d, g, uneven=True), d, g,
                                                   length=length)
                assert torch.equal(full.detach(), x)
                (full.sin() * x).sum().backward()
                start = sum(sizes[:r])
                expect = torch.zeros_like(x)
                expect.narrow(d, start, sizes[r]).copy_((x.cos() * x).narrow(d, start, sizes[r]))
                assert torch.equal(leaf.grad, expect) if n > 1 else torch.allclose(leaf.grad, x.cos() * x)
                checks += 1
            objs = [f"caption {i}" for i in range(length)]
            part = cp.split_inputs_cp_object_list(objs, g, uneven=True)
            assert part == objs[sum(sizes[:r]):sum(sizes[:r + 1])]
            assert cp.cat_outputs_cp_object_list(part, g, length=length) == objs
            checks += 1
    return checks


def case_uneven_errors():
    """Too short a sequence, a wrong-size shard, other dims that differ, different lengths: the same
    ValueError on every rank (no hang, no abort), naming ranks and sizes; the group stays in step."""
    import torch.distributed as dist

    me = dist.get_rank()
    found = 0
    for g in cp_groups():
        n, r = g.size(), g.rank()
        ranks = dist.get_process_group_ranks(g)
        src = min(ranks)
        short = torch.zeros(2, n - 1, 3)
        _raises(ValueError, [f"shape (2, {n - 1}, 3)", f"size {n - 1}", f"group of size {n}", "at least one"],
                cp.split_inputs_cp, short, 1, g, uneven=True)
        _raises(ValueError, [f"shape (2, {n - 1}, 3)", f"group of size {n}"], cp.broadcast_split_tensor,
                short if me == src else None, 1, g, uneven=True)
        _raises(ValueError, [f"length {n - 1}", f"group of size {n}"], cp.split_inputs_cp_object_list,
                list(range(n - 1)), g, uneven=True)
        # The even default still refuses, and says what to do.
        _raises(ValueError, ["equal shards", "uneven=True"], cp.split_inputs_cp, torch.zeros(2, n + 1, 3), 1, g)
        found += 4
        length = 2 * n + 1
        sizes = cp.shard_sizes(length, n)
        # The last rank holds one row too many.
        bad = torch.zeros(2, sizes[r] + (r == n - 1), 3)
        who = f"group rank {n - 1} (global {ranks[-1]}) holds {sizes[-1] + 1}, expected {sizes[-1]}"
        for fn in (cp.cat_outputs_cp, cp.cat_outputs_cp_with_grad):
            _raises(ValueError, [fn.__name__, "shard sizes along seq_dim=1", who, f"shard_sizes({length}, {n})"],
                    fn, bad, 1, g, length=length)
            found += 1
        # Sizes that are no tensor_split of their sum: the last rank holds one more than the first.
        odd = torch.zeros(2, sizes[0] + 1 if r == n - 1 else sizes[r], 3)
        total = length - sizes[-1] + sizes[0] + 1
        _raises(ValueError, ["cat_outputs_cp", "shard sizes along seq_dim=1", f"shard_sizes({total}, {n})",
                             f"group rank {n - 1} (global {ranks[-1]}) holds {sizes[0] + 1}"],
                cp.cat_outputs_cp, odd, 1, g, uneven=True)
        found += 1
        # Other dims differ: named, with shapes.
        wide = torch.zeros(2, sizes[r], 3 + (r == 0))
        _raises(ValueError, ["differ only in their size", f"group rank 0 (global {ranks[0]}): shape (2, {sizes[0]}, 4)"],
                cp.cat_outputs_cp, wide, 1, g, uneven=True)
        good = torch.zeros(2, sizes[r], 3)
        _raises(ValueError, ["different lengths", f"group rank 0 (global {ranks[0]}): {length}"],
                cp.cat_outputs_cp, good, 1, g, length=length + (r > 0))
        _raises(ValueError, [f"sequence of length {n - 1}", f"group of size {n}"], cp.cat_outputs_cp, good, 1, g,
                length=n - 1)
        _raises(TypeError, ["length must be an int", "str"], cp.cat_outputs_cp, good, 1, g, length="9")
        _raises(TypeError, ["uneven must be True or False"], cp.split_inputs_cp, good, 1, g, uneven=1)
        objs = [r] * (sizes[r] + (r == n - 1))
        _raises(ValueError, ["cat_outputs_cp_object_list", who], cp.cat_outputs_cp_object_list, objs, g,
                length=length)
        found += 6
        # Still in step: an uneven round trip.
        x = _data((2, length, 3), seed=5)
        assert torch.equal(cp.cat_outputs_cp(cp.split_inputs_cp(x, 1, g, uneven=True), 1, g, length=length), x)
    return found


# ---------------------------------------------------------------- ulysses cases

def _ulysses_cases(n):
    """(name, q, k, v, seq_dim, head_dim, length, attn kwargs): uneven lengths (below, at and above a
    multiple of n), K/V with fewer heads than n, both at once, and layouts with the heads first."""
    rows = []
    for length in (n, 2 * n + 3):
        for kv in (2 * n, 1, 2, 6 if n == 4 else 3):    # 6 heads on 4 ranks: lcm 12, not a multiple of 4
            q_heads = 24 if n == 4 else 12                # divisible by n and by every kv count above
            q = _data((2, length, q_heads, 3), seed=length)
            k, v = (_data((2, length, kv, 3), seed=length + s) for s in (1, 2))
            kw = {"enable_gqa": True} if kv != q_heads else {}
            rows.append((f"L={length} kv={kv}", q, k, v, 1, 2, length, kw))
    # [B, H, S, D], causal, uneven, MQA.
    q, k, v = _data((1, 2 * n, 2 * n + 1, 4), 7), _data((1, 1, 2 * n + 1, 4), 8), _data((1, 1, 2 * n + 1, 4), 9)
    rows.append(("bhsd causal mqa", q, k, v, 2, 1, 2 * n + 1, {"is_causal": True, "enable_gqa": True}))
    # Even shards with K/V heads below n and no length: no size exchange, replication only.
    q, k, v = _data((2, 4 * n, n, 3), 10), _data((2, 4 * n, 1, 3), 11), _data((2, 4 * n, 1, 3), 12)
    rows.append(("even mqa", q, k, v, 1, 2, None, {"enable_gqa": True}))
    # Cross-attention: K/V longer than q, each split by its own length.
    q, k, v = _data((1, n + 1, n, 2), 13), _data((1, 3 * n + 2, n, 2), 14), _data((1, 3 * n + 2, n, 2), 15)
    rows.append(("cross, kv longer", q, k, v, 1, 2, n + 1, {}))
    return rows


def case_ulysses_uneven():
    """Uneven ulysses and GQA == attention on the whole sequence in one process, output and q/k/v grads."""
    checks = 0
    for g in cp_groups():
        n = g.size()
        for name, q, k, v, s, h, length, kw in _ulysses_cases(n):
            w = _data(q.shape, seed=99)
            ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
            ref = cp.sdpa_in_layout(*ref_in, seq_dim=s, head_dim=h, **kw)
            (ref * w).sum().backward()
            mine = [_part(t, s, g).clone().requires_grad_(True) for t in (q, k, v)]
            out = cp.ulysses_attention(*mine, g, seq_dim=s, head_dim=h, length=length, **kw)
            out.backward(_part(w, s, g))
            _close(out, _part(ref.detach(), s, g), (name, n, "out"))
            for nm, m, r in zip("qkv", mine, ref_in, strict=True):
                _close(m.grad, _part(r.grad, s, g), (name, n, nm))
            checks += 1
        # seq_to_heads / heads_to_seq with length: the whole sequence with head block r, and back.
        for length in (n, 3 * n + 1):
            full = _data((2, length, 2 * n, 3), seed=length)
            heads = cp.seq_to_heads(_part(full, 1, g), 1, 2, g, length=length)
            assert torch.equal(heads, full.narrow(2, 2 * g.rank(), 2))
            assert torch.equal(cp.heads_to_seq(heads, 1, 2, g, length=length), _part(full, 1, g))
            checks += 1
    return checks


def case_ulysses_uneven_errors():
    """A wrong shard size, different lengths, too short a sequence: the same error on every rank, no hang."""
    import torch.distributed as dist

    found = 0
    for g in cp_groups():
        n, r = g.size(), g.rank()
        ranks = dist.get_process_group_ranks(g)
        length = 2 * n + 1
        good = cp.shard_sizes(length, n)
        # The last group rank holds one token too many: every rank names it.
        q = torch.zeros(1, good[r] + (r == n - 1), n, 2)
        for fn, args in ((cp.ulysses_attention, (q, q, q, g)), (cp.seq_to_heads, (q, 1, 2, g))):
            _raises(ValueError, ["sequence lengths over the group", f"group rank {n - 1} (global {ranks[-1]}) "
                                 f"has {good[-1] + 1}, expected {good[-1]}", f"shard_sizes({length}, {n})"],
                    fn, *args, length=length)
            found += 1
        # heads_to_seq wants the whole sequence on every rank.
        whole = torch.zeros(1, length + (r == 0), 1, 2)
        _raises(ValueError, ["the whole sequence", f"group rank 0 (global {ranks[0]}) has {length + 1}",
                             "pass every rank the whole sequence"],
                cp.heads_to_seq, whole, 1, 2, g, length=length)
        # Ranks disagree on length.
        q = torch.zeros(1, good[r], n, 2)
        _raises(ValueError, ["different length= values", f"group rank 0 (global {ranks[0]}): {length}"],
                cp.ulysses_attention, q, q, q, g, length=length + (r > 0))
        _raises(ValueError, [f"length={n - 1} is shorter than the group of size {n}"],
                cp.ulysses_attention, q, q, q, g, length=n - 1)
        _raises(TypeError, ["length must be an int", "float"], cp.seq_to_heads, q, 1, 2, g, length=5.0)
        # K/V heads neither divisible by n nor dividing q's heads.
        kv = torch.zeros(1, good[r], 3, 2)
        q6 = torch.zeros(1, good[r], 4 * n, 2)
        _raises(ValueError, ["k has shape", "number of heads (3)", f"q's {4 * n} heads"],
                cp.ulysses_attention, q6, kv, kv, g, length=length)
        found += 4
        # Still in step afterwards.
        x = _data((1, length, n, 2), seed=3)
        assert torch.equal(cp.heads_to_seq(cp.seq_to_heads(_part(x, 1, g), 1, 2, g, length=length), 1, 2, g,
                                           length=length), _part(x, 1, g))
    return found


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("world", [2, 4])
def test_uneven_round_trips_every_helper(pools, world):
    per_group = 4 * 5 + 2  # 4 lengths x (4 small shapes + the object lists), 2 big shapes at the longest
    assert pools(world).run(case_uneven_round_trips) == [per_group * (1 if world == 2 else 2)] * world


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_mismatch_is_an_error_on_every_rank(pools, world):
    assert pools(world).run(case_uneven_errors) == [13 * (1 if world == 2 else 2)] * world


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_uneven_and_gqa_match_one_process(pools, world):
    per_group = len(_ulysses_cases(2)) + 2
    assert pools(world).run(case_ulysses_uneven) == [per_group * (1 if world == 2 else 2)] * world


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_uneven_errors_on_every_rank(pools, world):
    assert pools(world).run(case_ulysses_uneven_errors) == [6 * (1 if world == 2 else 2)] * world


def test_ulysses_length_without_group_is_plain_attention():
    q = _data((1, 5, 2, 3), seed=1)
    assert torch.equal(cp.ulysses_attention(q, q, q, length=5), cp.sdpa_in_layout(q, q, q))
