"""The cp helpers on real gloo ranks: round trips, identity, errors, gradients, broadcasts, debug mode."""

from __future__ import annotations

import os

import pytest
import torch

import cp
import parallel_state as ps
from cp import debug, meta
from cp.comm import parse_backend
from cpgroups import cp_groups
from cpgroups import raises as _raises

ENV = "PARALLEL_STATE_DEBUG"


# ---------------------------------------------------------------- helpers run on every rank

def _data(shape, dtype=torch.float32, seed=0):
    """The same tensor on every rank; floats carry NaN, -0.0 and inf so that bit-exactness is tested."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        flat = x.view(-1)
        for i, v in enumerate((float("nan"), -0.0, float("inf"))):
            if flat.numel() > i:
                flat[i] = v
        return x
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a, b):
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))




def _cases(n):
    """(tensor, seq_dim) pairs: video latents, token sequences, odd dtypes, empty and non-contiguous."""
    latent = _data((2, 3, 8, 4, 12), seed=1)                      # [B, C, T, H, W]
    batch1 = _data((1, 4, 8, 6, 10), torch.bfloat16, seed=2)       # B=1: dim 1 is the leading non-trivial dim
    tokens = _data((3, 16, 8), torch.float16, seed=3)              # [B, L, D]
    big = _data((2, 8, 32, 64), seed=8)                            # 512 KiB: gloo takes the broadcasts path
    tensors = [latent, batch1, tokens, big, _data((8,), torch.int64, seed=4), _data((4, 8), torch.bool, seed=5),
               _data((2, 4, 4), torch.complex64, seed=6), torch.zeros(2, 0, 4),
               _data((4, 6, 8), seed=7).transpose(0, 2)]           # non-contiguous input
    out = []
    for x in tensors:
        for d in range(-x.dim(), x.dim()):
            if x.shape[d] % n == 0:
                out.append((x, d))
    return out


# ---------------------------------------------------------------- cases (module level: pickled to the ranks)

def case_round_trip():
    import torch.distributed as dist

    from cp.shard import gather_cat

    checks = 0
    kept = []  # every result, re-checked at the end: a later call must never overwrite an earlier result
    for g in cp_groups():
        n, r = g.size(), g.rank()
        for x, d in _cases(n):
            shard = cp.split_inputs_cp(x, d, g)
            if n == 1:
                assert shard is x and cp.cat_outputs_cp(x, d, g) is x
                assert cp.cat_outputs_cp_with_grad(x, d, g) is x
                checks += 1
                continue
            length = x.shape[d] // n
            assert _same_bits(shard, x.narrow(d, r * length, length)), (x.shape, d)
            assert shard.is_contiguous()
            full = cp.cat_outputs_cp(shard, d, g)
            assert _same_bits(full, x), (x.shape, d, n)
            assert full is not x and full.is_contiguous() and not full.requires_grad
            # The all-gather path (NCCL's) runs here on gloo too, through the same real group.
            dd = d % x.dim()
            assert _same_bits(gather_cat(shard, dd, g, n, strategy="all_gather"), x), (x.shape, d)
            assert _same_bits(gather_cat(shard, dd, g, n, strategy="broadcasts"), x), (x.shape, d)
            assert _same_bits(cp.cat_outputs_cp_with_grad(shard, d, g), x)
            kept.append((full, x))
            checks += 1
        # A non-contiguous shard gathers like its contiguous copy.
        x = _data((2, 4 * n, 6), seed=9)
        shard = cp.split_inputs_cp(x, 1, g).transpose(0, 2)
        assert not shard.is_contiguous() or n == 1
        assert _same_bits(cp.cat_outputs_cp(shard, 1, g), x.transpose(0, 2))
    for full, x in kept:
        assert _same_bits(full, x)
    return checks, dist.get_world_size()


def case_split_copies():
    """The shard is a view when it is contiguous in x already, else exactly one contiguous copy."""
    import torch.distributed as dist

    g = dist.group.WORLD
    n, r = g.size(), g.rank()
    x = _data((4 * n, 3, 5))
    lead = cp.split_inputs_cp(x, 0, g)
    assert lead.data_ptr() == x.data_ptr() + r * 4 * 15 * x.element_size() or n == 1
    batch1 = _data((1, 2 * n, 3))
    assert cp.split_inputs_cp(batch1, 1, g).untyped_storage().data_ptr() == batch1.untyped_storage().data_ptr()
    whole = _data((2, 2 * n, 3))
    mid = cp.split_inputs_cp(whole, 1, g)
    assert mid.is_contiguous() and (mid._base is None if n > 1 else mid is whole)  # a fresh copy, not a view
    return True


def case_grad():
    import torch.distributed as dist

    checks = 0
    for g in cp_groups():
        n, r = g.size(), g.rank()
        for shape, d in (((2, 3, 4 * n, 4, 6), 2), ((3, 8 * n, 5), -2), ((4 * n, 3), 0)):
            x = _data(shape, torch.float64, seed=11).nan_to_num(0.0, 1.0, -1.0)
            w = _data(shape, torch.float64, seed=12).nan_to_num(0.0, 1.0, -1.0)
            # Single process: the whole sequence, a nonlinear loss.
            ref = x.clone().requires_grad_(True)
            (ref.sin() * w).sum().backward()
            # Distributed: a leaf upstream of the shard, so "only the local slice" is visible in its gradient.
            leaf = x.clone().requires_grad_(True)
            shard = cp.split_inputs_cp(leaf * 1.0, d, g)
            out = cp.cat_outputs_cp_with_grad(shard, d, g)
            assert out.requires_grad and _same_bits(out.detach(), x)
            (out.sin() * w).sum().backward()
            length = shape[d] // n
            local = ref.grad.narrow(d, r * length, length)
            assert torch.equal(leaf.grad.narrow(d, r * length, length), local)
            rest = leaf.grad.clone()
            rest.narrow(d, r * length, length).zero_()
            assert torch.count_nonzero(rest) == 0  # nothing flowed into the other ranks' slices
            # The plain gather is outside the graph; with_grad of a tensor without grad has none either.
            assert not cp.cat_outputs_cp(shard, d, g).requires_grad
            assert not cp.cat_outputs_cp_with_grad(shard.detach(), d, g).requires_grad
            checks += 1
    return checks, dist.get_world_size()


PLACEHOLDERS = (None, torch.zeros(7, dtype=torch.int32), "not a tensor", torch.ones(1, dtype=torch.bfloat16))


def case_robust_broadcast():
    import torch.distributed as dist

    me = dist.get_rank()
    checks = 0
    for g in cp_groups():
        ranks = dist.get_process_group_ranks(g)
        src = ranks[-1]  # the highest member: src is a global rank, not the group's first
        base = _data((3, 5), torch.float64, seed=src)
        payloads = [base, _data((), seed=21), torch.zeros(0, 4), _data((4, 3), torch.bool, seed=22),
                    _data((2, 3), torch.complex128, seed=23), _data((2, 2, 2, 2), torch.bfloat16, seed=24),
                    _data((4, 6), torch.int16, seed=25).t()]
        for p in payloads:
            inp = p if me == src else PLACEHOLDERS[me % len(PLACEHOLDERS)]
            out = cp.robust_broadcast(inp, src, g)
            assert _same_bits(out, p), (p.shape, p.dtype)
            assert (out is p) if me == src else (out is not inp and out.device.type == "cpu")
            checks += 1
        # cp.broadcast: from the group's lowest global rank, every kind of item.
        low = min(ranks)
        items = [_data((2, 3), seed=low), None, f"hello from {low}", {"rank": low, "caption": "a cat"},
                 [1, 2.5, "x"]]
        for item in items:
            inp = item if me == low else PLACEHOLDERS[(me + 1) % len(PLACEHOLDERS)]
            out = cp.broadcast(inp, g)
            if isinstance(item, torch.Tensor):
                assert _same_bits(out, item)
            else:
                assert out == item, (out, item)
            checks += 1
    return checks


def case_broadcast_split():
    import torch.distributed as dist

    me = dist.get_rank()
    checks = 0
    for g in cp_groups():
        n, r = g.size(), g.rank()
        src = min(dist.get_process_group_ranks(g))
        for x, d in _cases(n):
            inp = x if me == src else PLACEHOLDERS[me % 2]  # None or a tensor of another shape and dtype
            out = cp.broadcast_split_tensor(inp, d, g)
            if n == 1:
                assert out is inp
            else:
                length = x.shape[d] // n
                assert _same_bits(out, x.narrow(d, r * length, length)), (x.shape, d)
                assert out.is_contiguous()
            checks += 1
        assert cp.broadcast_split_tensor(None if me == src else torch.ones(2), 0, g) is None
    return checks


def case_object_lists():
    import torch.distributed as dist

    me = dist.get_rank()
    out = []
    for g in cp_groups():
        n, r = g.size(), g.rank()
        ranks = dist.get_process_group_ranks(g)
        objs = [f"caption {i}" for i in range(3 * n)]
        part = cp.split_inputs_cp_object_list(objs, g)
        assert part == objs[3 * r:3 * r + 3]
        assert cp.split_inputs_cp_object_list(tuple(objs), g) == tuple(objs[3 * r:3 * r + 3])
        # Gather order is group-rank order, and ranks may hold different numbers of objects.
        mine = [(me, j) for j in range(r + 1)]
        gathered = cp.cat_outputs_cp_object_list(mine, g)
        assert gathered == [(ranks[i], j) for i in range(n) for j in range(i + 1)], gathered
        assert cp.cat_outputs_cp_object_list(part, g) == objs
        out.append(gathered)
    return out


def case_errors():
    import torch.distributed as dist

    me = dist.get_rank()
    found = 0
    for g in cp_groups():
        n = g.size()
        src = min(dist.get_process_group_ranks(g))
        x3 = torch.zeros(2, 4 * n, 3)
        for fn in (cp.split_inputs_cp, cp.cat_outputs_cp, cp.cat_outputs_cp_with_grad):
            for bad in (3, -4, 10):
                _raises(ValueError, ["(2, ", f"seq_dim={bad}", f"group of size {n}", "out of range"], fn, x3, bad, g)
            _raises(ValueError, ["0-dim"], fn, torch.tensor(1.0), 0, g)
            _raises(TypeError, ["seq_dim must be an int"], fn, x3, 1.0, g)
            _raises(TypeError, ["seq_dim must be an int"], fn, x3, True, g)
            _raises(TypeError, ["must be a torch.Tensor", "list"], fn, [1, 2], 0, g)
            _raises(TypeError, ["ProcessGroup", "str"], fn, x3, 0, "world")
            _raises(TypeError, ["not a member"], fn, x3, 0, dist.GroupMember.NON_GROUP_MEMBER)
            found += 1
        if n > 1:
            odd = torch.zeros(2, 2 * n + 1, 3)
            _raises(ValueError, [f"shape (2, {2 * n + 1}, 3)", "seq_dim=-2", f"size {2 * n + 1}",
                                 f"group of size {n}"], cp.split_inputs_cp, odd, -2, g)
            _raises(ValueError, [f"length {2 * n + 1}", f"group of size {n}"],
                    cp.split_inputs_cp_object_list, list(range(2 * n + 1)), g)
            # Bad source input: every rank raises (none is left waiting), receivers passing None.
            inp = odd if me == src else None
            _raises(ValueError, [f"shape (2, {2 * n + 1}, 3)", "seq_dim=1", f"group of size {n}"],
                    cp.broadcast_split_tensor, inp, 1, g)
            _raises(ValueError, ["seq_dim=5", "(2, ", f"group of size {n}"], cp.broadcast_split_tensor, inp, 5, g)
            _raises(TypeError, ["passed None"], cp.robust_broadcast, None if me == src else x3, src, g)
            _raises(TypeError, ["passed no tensor"], cp.robust_broadcast, "text" if me == src else None, src, g)
            _raises(TypeError, ["passed no tensor"], cp.broadcast_split_tensor, "t" if me == src else None, 0, g)
            deep = torch.zeros([1] * (meta.MAX_NDIM + 1))
            _raises(ValueError, [f"{meta.MAX_NDIM + 1} dimensions"], cp.robust_broadcast,
                    deep if me == src else None, src, g)
            found += 1
        for fn in (cp.split_inputs_cp_object_list, cp.cat_outputs_cp_object_list):
            _raises(TypeError, ["list or tuple", "str"], fn, "abc", g)
        _raises(ValueError, ["src=99", "not a member"], cp.robust_broadcast, x3, 99, g)
        _raises(TypeError, ["src must be an int"], cp.robust_broadcast, x3, "0", g)
        _raises(TypeError, ["process_group", "ProcessGroup"], cp.broadcast, x3, object())
        _raises(TypeError, ["group", "ProcessGroup"], cp.robust_broadcast, x3, 0, 3)
        # After all of that the group is still in step: a broadcast and a gather give the right data.
        y = _data((2, 2 * n), seed=31)
        assert _same_bits(cp.robust_broadcast(y if me == src else None, src, g), y)
        assert _same_bits(cp.cat_outputs_cp(cp.split_inputs_cp(y, 1, g), 1, g), y)
    return found


def case_debug_mode():
    import torch.distributed as dist

    me = dist.get_rank()
    os.environ[ENV] = "1"
    try:
        assert debug.enabled()
        for g in cp_groups():
            n, r = g.size(), g.rank()
            src = min(dist.get_process_group_ranks(g))
            x = _data((2, 4 * n, 6))
            assert _same_bits(cp.cat_outputs_cp(cp.split_inputs_cp(x, 1, g), 1, g), x)  # agreeing shards pass
            other = min(1, n - 1)
            shard = torch.zeros(2, 4 + (r == other), 6)
            for fn in (cp.cat_outputs_cp, cp.cat_outputs_cp_with_grad):
                _raises(ValueError, [ENV, f"group rank {other} ", "(2, 5, 6)", "(2, 4, 6)"], fn, shard, 1, g)
            wrong_dtype = torch.zeros(2, 4, 6, dtype=torch.float64 if r == other else torch.float32)
            _raises(ValueError, [ENV, "float64", "float32", f"group rank {other} "],
                    cp.cat_outputs_cp, wrong_dtype, 1, g)
            # broadcast_split_tensor: None on receivers is fine, a tensor of another shape is not.
            assert _same_bits(cp.broadcast_split_tensor(x if me == src else None, 1, g),
                              cp.split_inputs_cp(x, 1, g))
            inp = x if me == src else (torch.zeros(3, 3) if r == other else None)
            _raises(ValueError, [ENV, f"group rank {other} ", "(3, 3)", f"(2, {4 * n}, 6)"],
                    cp.broadcast_split_tensor, inp, 1, g)
        os.environ[ENV] = "0"
        assert not debug.enabled()
    finally:
        os.environ.pop(ENV, None)
    return n


def case_workspace_freed_on_teardown():
    import torch.distributed as dist

    from cp import workspace

    g = dist.group.WORLD
    x = _data((2, 4, 6))
    first = cp.cat_outputs_cp(x, 1, g)  # non-leading dim: gathers through the workspace
    assert workspace._buffers, "the gather workspace should be cached"
    second = cp.cat_outputs_cp(x * 2, 1, g)
    assert first.data_ptr() != second.data_ptr() and _same_bits(first * 2, second)
    ps.destroy_model_parallel()
    assert not workspace._buffers, "destroy_model_parallel should free the gather workspace"
    cp.cat_outputs_cp(x, 1, g)
    cp.release_gather_workspace()
    return not workspace._buffers


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("world", [1, 2, 4])
def test_round_trip_is_bit_exact(pools, world):
    results = pools(world).run(case_round_trip)
    checks = {c for c, _ in results}
    assert len(checks) == 1 and checks.pop() >= 20


@pytest.mark.parametrize("world", [1, 2])
def test_split_copies_at_most_once(pools, world):
    pools(world).run(case_split_copies)


@pytest.mark.parametrize("world", [2, 4])
def test_grad_flows_to_local_shard_only(pools, world):
    results = pools(world).run(case_grad)
    assert all(c == (3 if world == 2 else 6) for c, _ in results)


@pytest.mark.parametrize("world", [2, 4])
def test_robust_broadcast_and_broadcast(pools, world):
    assert len(set(pools(world).run(case_robust_broadcast))) == 1


@pytest.mark.parametrize("world", [1, 2, 4])
def test_broadcast_split_tensor(pools, world):
    assert min(pools(world).run(case_broadcast_split)) >= 10


@pytest.mark.parametrize("world", [1, 2, 4])
def test_object_lists_split_and_gather_in_rank_order(pools, world):
    results = pools(world).run(case_object_lists)
    if world == 4:  # the CP groups (0, 2) and (1, 3) gather in group-rank order
        assert results[0][1] == [(0, 0), (2, 0), (2, 1)] and results[3][1] == [(1, 0), (3, 0), (3, 1)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bad_inputs_are_explained_on_every_rank(pools, world):
    found = pools(world).run(case_errors)
    assert all(f == found[0] for f in found) and found[0] >= 3


@pytest.mark.parametrize("world", [2, 4])
def test_debug_mode_names_the_rank_that_differs(pools, world):
    pools(world).run(case_debug_mode)


def test_workspace_is_freed_by_destroy_model_parallel(pools):
    assert pools(2).run(case_workspace_freed_on_teardown) == [True, True]


def test_none_group_returns_the_input_itself():
    x = torch.zeros(2, 3)
    objs = ["a", "b"]
    assert cp.split_inputs_cp(x, 1, None) is x
    assert cp.cat_outputs_cp(x, 1) is x
    assert cp.cat_outputs_cp_with_grad(x, 0, None) is x
    assert cp.robust_broadcast(x, 0, None) is x
    assert cp.broadcast(x) is x and cp.broadcast("text", None) == "text"
    assert cp.broadcast_split_tensor(x, 1, None) is x
    assert cp.split_inputs_cp_object_list(objs, None) is objs
    assert cp.cat_outputs_cp_object_list(objs) is objs


def test_header_round_trip():
    for t in (torch.zeros(2, 3, dtype=torch.bfloat16), torch.tensor(1.0), torch.zeros(0, 5, dtype=torch.bool)):
        m = meta.decode(meta.encode(t))
        assert (m.kind, m.shape, m.dtype, m.device_type) == (meta.TENSOR, tuple(t.shape), t.dtype, "cpu")
    assert meta.decode(meta.encode(None)).kind == meta.NONE
    assert meta.decode(meta.encode("x")).kind == meta.ERR_NOT_TENSOR
    assert meta.decode(meta.encode("x", objects=True)).kind == meta.OBJECT
    deep = meta.decode(meta.encode(torch.zeros([1] * (meta.MAX_NDIM + 1))))
    assert deep.kind == meta.ERR_NDIM and deep.ndim == meta.MAX_NDIM + 1


def test_backend_names_map_to_devices():
    assert parse_backend("nccl") == {"cuda": "nccl"}
    assert parse_backend("gloo")["cpu"] == "gloo"
    assert parse_backend("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend("something-else") is None


def test_debug_flag_parsing(monkeypatch):
    for value, on in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv(ENV, value)
        assert debug.enabled() is on
    monkeypatch.delenv(ENV)
    assert not debug.enabled()
