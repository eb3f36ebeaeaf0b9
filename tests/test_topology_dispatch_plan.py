"""plan_dispatch / DispatchPlan: positions are a permutation in ascending runs, token counts are the contiguous
split's (the clip plan's follow its clips), work is the count of dense pairs per rank, the balance figure is max /
mean of it, the balanced plan is never busier than the contiguous split nor than the fixed zigzag, and on real video
token counts it is within 1.05 of the mean; the cost model priced by hand, each candidate (contiguous, balanced,
clips, allgather) winning where it should, the choice never predicted slower than the contiguous split; plus
determinism, the transport in the value, the helpers (index, owner, pairs) and the errors."""

from __future__ import annotations

import pytest
import torch

import cp
import parallel_state as ps
from parallel_state import AttentionMask as Mask
from parallel_state import plan_dispatch

SMALL = [
    (Mask.full(), (7, 12)), (Mask.causal(), (5, 12, 17)), (Mask.chunk_causal(3), (7, 12, 13)),
    (Mask.chunk_causal(20), (9,)), (Mask.sliding_window(2, 2), (9, 16)), (Mask.sliding_window(3, 9), (10,)),
    (Mask.packed([5, 2, 9]), (16,)), (Mask.packed([4, 7, 3, 6], 2), (20,)), (Mask.packed([11, 6], 1), (17,)),
]


def check_plan(plan, mask, length, cp_size, method):
    """Everything a plan promises, counted from the dense matrix."""
    assert (plan.mask, plan.length, plan.cp_size, plan.method) == (mask, length, cp_size, method)
    flat = [p for rank in plan.positions for p in rank]
    assert sorted(flat) == list(range(length))  # a permutation
    assert plan.sizes == tuple(len(r) for r in plan.positions)
    assert method == "clips" or plan.sizes == ps.shard_sizes(length, cp_size)
    dense = mask.dense(length)
    for r in range(cp_size):
        pos = list(plan.positions[r])
        assert pos == sorted(pos)
        runs = plan.runs[r]
        assert [p for start, stop in runs for p in range(start, stop)] == pos
        assert all(a[1] < b[0] for a, b in zip(runs, runs[1:], strict=False))  # separate, ascending
        assert plan.work[r] == int(dense[pos].sum())
        assert torch.equal(plan.index(r), torch.tensor(pos, dtype=torch.int64))
    assert plan.balance == pytest.approx(max(plan.work) / (sum(plan.work) / cp_size), rel=1e-12)
    owner, offset = plan.owner()
    for r in range(cp_size):
        assert torch.equal(owner[plan.index(r)], torch.full((plan.sizes[r],), r))
        assert torch.equal(offset[plan.index(r)], torch.arange(plan.sizes[r]))
    pairs = torch.tensor(plan.pairs())
    want = torch.tensor([[int(dense[list(plan.positions[r])][:, list(plan.positions[s])].sum())
                          for s in range(cp_size)] for r in range(cp_size)])
    assert torch.equal(pairs, want) and tuple(pairs.sum(1).tolist()) == plan.work


def test_plans_against_dense_counting():
    for mask, lengths in SMALL:
        for length in lengths:
            for cp_size in (1, 2, 3, 4, 5):
                if cp_size > length:
                    continue
                contiguous = plan_dispatch(mask, length, cp_size, method="contiguous")
                check_plan(contiguous, mask, length, cp_size, "contiguous")
                cuts = torch.arange(length).tensor_split(cp_size)
                assert contiguous.positions == tuple(tuple(c.tolist()) for c in cuts)  # tensor_split's layout
                assert contiguous.is_contiguous
                balanced = plan_dispatch(mask, length, cp_size, method="balanced")
                check_plan(balanced, mask, length, cp_size, "balanced")
                assert max(balanced.work) <= max(contiguous.work), (mask, length, cp_size)
                if mask in (Mask.causal(), Mask.chunk_causal(3)) and cp_size > 1 and length >= 4 * cp_size:
                    assert max(balanced.work) < max(contiguous.work), (mask, length, cp_size)
                if mask.kind == "packed" and cp_size > 1:
                    check_plan(plan_dispatch(mask, length, cp_size, method="clips"), mask, length, cp_size, "clips")


def zigzag_work(mask, length, cp_size):
    """The fixed baseline: 2 cp equal chunks, rank r holds chunks r and 2cp-1-r."""
    dense = mask.dense(length)
    chunks = torch.arange(length).tensor_split(2 * cp_size)
    return [int(dense[torch.cat([chunks[r], chunks[2 * cp_size - 1 - r]])].sum()) for r in range(cp_size)]


def test_balanced_is_at_least_as_even_as_the_fixed_zigzag():
    for mask in (Mask.causal(), Mask.chunk_causal(3), Mask.chunk_causal(5), Mask.sliding_window(2, 3)):
        for length, cp_size in ((48, 2), (48, 3), (48, 4), (60, 5), (64, 8)):
            plan = plan_dispatch(mask, length, cp_size, method="balanced")
            assert max(plan.work) <= max(zigzag_work(mask, length, cp_size)), (mask, length, cp_size)
            if mask == Mask.causal():
                assert max(len(r) for r in plan.runs) <= 2


FRAME = 1560  # tokens per latent frame (e.g. Wan2.1 480p: 30 x 52)
VIDEO = [
    Mask.full(), Mask.causal(), Mask.chunk_causal(3 * FRAME), Mask.sliding_window(3 * FRAME, 2),
    Mask.sliding_window(FRAME, 4), Mask.packed([7 * FRAME, 5 * FRAME, 9 * FRAME]),
    Mask.packed([9 * FRAME, 6 * FRAME, 6 * FRAME], 3 * FRAME), Mask.packed([7 * FRAME, 5 * FRAME, 9 * FRAME], 1),
]


def test_video_token_counts_balance_within_five_percent():
    """21 latent frames of 1,560 tokens (32,760) at cp 2, 4, 8, 16; works from the plan checked by closed forms."""
    length = 21 * FRAME
    for mask in VIDEO:
        total = mask.work(length)
        for cp_size in (2, 4, 8, 16):
            plan = plan_dispatch(mask, length, cp_size, method="balanced")
            assert sum(plan.work) == total and plan.sizes == ps.shard_sizes(length, cp_size)
            assert plan.balance <= 1.05, (mask, cp_size, plan.balance)
            assert max(len(r) for r in plan.runs) <= (2 if mask.kind != "packed" else 6), (mask, plan.runs)
    # the causal contiguous split is 2 - 1/n in pairs (plus a hair for the diagonal)
    assert plan_dispatch(Mask.causal(), length, 8, method="contiguous").balance == pytest.approx(1.875, abs=1e-3)


def test_deterministic_cached_and_a_value():
    mask = Mask.packed([9, 14, 7], 3)
    a = plan_dispatch(mask, 30, 4, method="balanced")
    assert plan_dispatch(mask, 30, 4, method="balanced") is a  # cached
    ps.topology.dispatch_plan._plan.cache_clear()
    b = plan_dispatch(Mask.packed((9, 14, 7), 3), 30, 4, method="balanced")
    assert b is not a and b == a and hash(b) == hash(a) and b.positions == a.positions
    assert plan_dispatch(mask, 30, 4, method="contiguous") != a
    assert cp.plan_dispatch is plan_dispatch and cp.DispatchPlan is ps.DispatchPlan
    assert "balanced plan of 30 tokens" in a.describe() and "p2p transport" in a.describe()


@pytest.mark.parametrize("args, kwargs, exc, fragment", [
    (("causal", 8, 2), {}, TypeError, "mask must be an AttentionMask"),
    ((Mask.causal(), 8, 0), {}, ValueError, "cp_size=0 must be between 1 and the length 8"),
    ((Mask.causal(), 3, 4), {}, ValueError, "cp_size=4 must be between 1 and the length 3"),
    ((Mask.causal(), 8, 2.0), {}, TypeError, "cp_size must be an int"),
    ((Mask.causal(), 8, True), {}, TypeError, "cp_size must be an int"),
    ((Mask.causal(), 0, 1), {}, ValueError, "length must be >= 1"),
    ((Mask.packed([3, 4]), 8, 2), {}, ValueError, "segments add up to 7 tokens but the sequence has 8"),
    ((Mask.causal(), 8, 2), {"method": "zigzag"}, ValueError, "method='zigzag' is not one of"),
    ((Mask.causal(), 8, 2), {"transport": "nccl"}, ValueError, "transport='nccl' is not one of"),
    ((Mask.causal(), 8, 2), {"method": "clips"}, ValueError, "method='clips' keeps packed clips whole, but the mask"),
    ((Mask.causal(), 8, 2), {"rates": (1e9, 1e6)}, TypeError, "rates must be a CostRates"),
    ((Mask.causal(), 8, 2), {"shape": 8}, TypeError, "shape must be an AttentionShape"),
    ((Mask.causal(), 8, 4), {"ulysses_size": 3}, ValueError, "ulysses_size=3 must be >= 1 and divide cp_size=4"),
])
def test_bad_arguments(args, kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment) as info:
        plan_dispatch(*args, **kwargs)
    assert isinstance(info.value, ps.ParallelStateError)


def test_bad_rank():
    plan = plan_dispatch(Mask.causal(), 8, 2)
    with pytest.raises(ps.ParallelStateValueError, match="rank 2 is out of range for a plan of cp_size 2"):
        plan.index(2)
    with pytest.raises(ps.ParallelStateTypeError, match="rank must be an int"):
        plan.index("0")


def test_hand_built_plans_are_checked():
    mask = Mask.causal()
    good = plan_dispatch(mask, 8, 2, method="balanced")
    assert ps.DispatchPlan(mask, 8, 2, "balanced", good.runs, good.work) == good
    for runs, fragment in ((((0, 4),), "needs that many runs"), ((((0, 4),), ((3, 8),)), "cover every token"),
                           ((((0, 4),), ((5, 8),)), "cover every token"), ((((0, 2), (2, 4)), ((4, 8),)), "separate"),
                           ((((4, 0),), ((4, 8),)), "ascending"), (((), ((0, 8),)), "non-empty")):
        with pytest.raises(ps.ParallelStateValueError, match=fragment):
            ps.DispatchPlan(mask, 8, 2, "balanced", runs, (1,) * len(runs))
    with pytest.raises(ps.ParallelStateValueError, match="method='zigzag'"):
        ps.DispatchPlan(mask, 8, 2, "zigzag", good.runs, good.work)
    with pytest.raises(ps.ParallelStateTypeError, match="mask must be an AttentionMask"):
        ps.DispatchPlan("causal", 8, 2, "balanced", good.runs, good.work)


# ---------------------------------------------------------------- the cost model and the choice

GPU = ps.CostRates()  # the defaults: a GPU node
CPU_SHARED = ps.CostRates(flops_per_ms=2e7, bytes_per_ms=5e5, latency_ms=0.05, overlap=0.0, parallel=2)
SHAPE = ps.AttentionShape(heads=8, head_dim=16, dtype="float32")


def by(plan, method, transport="p2p"):
    return next(c for c in plan.candidates if (c.method, c.transport) == (method, transport))


def test_the_model_priced_by_hand():
    """Contiguous causal over 2 ranks, p2p: rank 1 computes 3/4 of the pairs and receives rank 0's whole half."""
    rates = ps.CostRates(flops_per_ms=1e6, bytes_per_ms=1e4, latency_ms=0.5, overlap=0.25)
    shape = ps.AttentionShape(heads=2, head_dim=4, kv_heads=1, dtype="float16", batch=3, backward=False)
    plan = plan_dispatch(Mask.causal(), 8, 2, method="contiguous", rates=rates, shape=shape)
    assert plan.work == (10, 26)
    compute = 3 * 2 * 26 * 4 * 4 / 1e6                 # batch * heads * pairs * 4 * head_dim FLOPs
    xfer = 4 * (2 * 1 * 4 * 2 * 3) / 1e4               # 4 tokens of K and V (1 head of 4, 2 bytes, batch 3)
    want = 0.5 + compute + xfer - 0.25 * min(compute, xfer)
    assert plan.predicted_ms == pytest.approx(want, rel=1e-12)
    assert plan.candidates == (by(plan, "contiguous"),) and "as asked" in plan.why
    # allgather: one collective, every other token, no overlap; with backward 3 passes and 14 D FLOPs a pair
    gather = plan_dispatch(Mask.causal(), 8, 2, method="contiguous", transport="allgather", rates=rates, shape=shape)
    assert gather.predicted_ms == pytest.approx(0.5 + compute + xfer, rel=1e-12)
    train = ps.AttentionShape(heads=2, head_dim=4, kv_heads=1, dtype="float16", batch=3)
    ring = plan_dispatch(Mask.causal(), 8, 2, method="contiguous", transport="ring", rates=rates, shape=train)
    c3, x3 = compute * 14 / 4, 3 * xfer
    assert ring.predicted_ms == pytest.approx(3 * 0.5 + c3 + x3 - 0.25 * min(c3, x3), rel=1e-12)
    # four ranks that share two cores: the compute stretches to the whole work over two
    shared = ps.CostRates(flops_per_ms=1e6, bytes_per_ms=1e4, latency_ms=0.0, overlap=1.0, parallel=2)
    four = plan_dispatch(Mask.full(), 8, 4, method="contiguous", rates=shared, shape=shape)
    assert four.predicted_ms == pytest.approx(max(4 * 3 * 2 * 16 * 16 / 1e6 / 2, 6 * 48 / 1e4), rel=1e-12)


def test_each_candidate_wins_where_it_should():
    length = 21 * 96
    chunks, clips = Mask.chunk_causal(3 * 96), Mask.packed([9 * 96, 5 * 96, 7 * 96])
    # a GPU node, a long causal sequence: the balanced plan halves the busiest rank's work
    zig = plan_dispatch(Mask.chunk_causal(3 * FRAME), 21 * FRAME, 8)
    assert (zig.method, zig.transport) == ("balanced", "p2p") and zig.balance <= 1.05
    assert zig.predicted_ms < by(zig, "contiguous").predicted_ms / 1.5 and "the fastest" in zig.why
    # ranks sharing cores and copying bytes themselves: balancing buys nothing, bytes cost: contiguous
    cont = plan_dispatch(chunks, length, 4, rates=CPU_SHARED, shape=SHAPE)
    assert cont.method == "contiguous" and cont.is_contiguous
    assert by(cont, "balanced").predicted_ms > cont.predicted_ms
    # packed clips on two ranks that each have a core: whole clips on one rank, no bytes at all
    packed = plan_dispatch(clips, length, 2, rates=ps.CostRates(2e7, 5e5, 0.05, overlap=0.0), shape=SHAPE)
    assert packed.method == "clips" and packed.balance <= 1.05 and packed.transport in ("p2p", "ring")
    assert by(packed, "clips").recv_tokens == 0 < by(packed, "balanced").recv_tokens
    assert sorted(map(len, packed.positions)) == [9 * 96, 12 * 96]  # the 9-frame clip, and the 5 + 7
    # a short sequence over 8 ranks, where a message costs more than its bytes: one all-gather, not 7 messages
    small = plan_dispatch(Mask.chunk_causal(16), 512, 8, rates=ps.CostRates(latency_ms=0.05), shape=SHAPE)
    assert small.transport == "allgather" and small.predicted_ms < by(small, "contiguous").predicted_ms


RATES = [GPU, CPU_SHARED, ps.CostRates(1e8, 1e9, 0.0), ps.CostRates(1e12, 1e5, 0.1, overlap=0.5, parallel=1)]


def test_never_predicted_slower_than_the_contiguous_split():
    """Over masks, lengths, cp and Ulysses sizes and rates: the choice is a valid plan, no slower than the fastest
    contiguous candidate, within MARGIN of the fastest, and its balanced layouts within 1.05 where the mask allows."""
    masks = [Mask.full(), Mask.causal(), Mask.chunk_causal(96), Mask.sliding_window(48, 3),
             Mask.packed([700, 300, 1016]), Mask.packed([96] * 21, 48), Mask.packed([1500, 200, 316], 1)]
    for mask in masks:
        for cp_size, u in ((2, 1), (3, 1), (4, 1), (4, 2), (8, 2), (8, 1), (16, 4)):
            for rates in RATES:
                plan = plan_dispatch(mask, 2016, cp_size, rates=rates, shape=SHAPE, ulysses_size=u)
                flat = sorted(p for rank in plan.positions for p in rank)
                assert flat == list(range(2016)) and sum(plan.work) == mask.work(2016)
                fastest = min(c.predicted_ms for c in plan.candidates)
                contiguous = min(c.predicted_ms for c in plan.candidates if c.method == "contiguous")
                assert plan.predicted_ms <= contiguous and plan.predicted_ms <= fastest * (1 + ps.topology.
                                                                                            dispatch_plan.MARGIN)
                assert (plan.method, plan.transport) in {(c.method, c.transport) for c in plan.candidates}
                for c in plan.candidates:
                    if c.method != "contiguous" and mask.kind != "full" and cp_size <= 8:
                        assert c.balance <= 1.05, (mask, cp_size, c)


def test_layout_and_transport_are_closed_sets_given_as_strings_or_members():
    import json
    import pickle

    from cp import transports

    assert cp.Layout is ps.Layout and cp.Transport is ps.Transport and set(transports.CLASSES) == set(ps.Transport)
    mask = Mask.causal()
    plan = plan_dispatch(mask, 64, 4, method="contiguous", transport="allgather")
    assert plan.method is ps.Layout.CONTIGUOUS and plan.transport is ps.Transport.ALLGATHER
    assert all(type(c.method) is ps.Layout and type(c.transport) is ps.Transport for c in plan.candidates)
    same = plan_dispatch(mask, 64, 4, method=ps.Layout.CONTIGUOUS, transport=ps.Transport.ALLGATHER)
    assert same == plan and hash(same) == hash(plan) and plan.method == "contiguous"
    assert plan.fingerprint() == 499366947455672227  # the digest of the plan when these were plain strings
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and back.method is ps.Layout.CONTIGUOUS and back.transport is ps.Transport.ALLGATHER
    assert json.loads(json.dumps({"method": plan.method, plan.transport: 1})) == {"method": "contiguous", "allgather": 1}
    assert f"{plan.method}/{plan.transport}" == "contiguous/allgather" and "allgather transport" in plan.describe()
    hand = ps.DispatchPlan(mask, 64, 4, "balanced", plan.runs, plan.work, "ring")
    assert hand.method is ps.Layout.BALANCED and hand.transport is ps.Transport.RING
    assert ps.plan_dual_chunk_swap(mask, 64, 4, transport="ring").method is ps.Layout.DUAL_CHUNK_SWAP
    with pytest.raises(AttributeError):
        ps.Layout.ZIGZAG  # noqa: B018  (a misspelt member fails where it is named)
    with pytest.raises(ps.ParallelStateValueError,
                       match=r"method='zigzag' is not one of \('auto', 'balanced', 'contiguous', 'clips'\)$"):
        plan_dispatch(mask, 64, 4, method="zigzag")
    with pytest.raises(ps.ParallelStateValueError, match=r"method='dual_chunk_swap' is not one of \('auto', "):
        plan_dispatch(mask, 64, 4, method=ps.Layout.DUAL_CHUNK_SWAP)  # a layout plan_dispatch does not make
    with pytest.raises(ValueError, match=r"transport='nccl' is not one of \('p2p', 'allgather', 'ring'\)$"):
        transports.choose("nccl", None, torch.device("cpu"))


def test_transport_is_part_of_the_plan():
    mask = Mask.chunk_causal(4)
    p2p = plan_dispatch(mask, 32, 4, method="balanced")
    ring = plan_dispatch(mask, 32, 4, method="balanced", transport="ring")
    assert p2p.transport == "p2p" and ring.transport == "ring" and p2p.runs == ring.runs
    assert p2p != ring and p2p.fingerprint() != ring.fingerprint() and "ring transport" in ring.describe()
    slow = plan_dispatch(mask, 32, 4, method="balanced", rates=ps.CostRates(1e3, 1e3))
    assert slow == p2p and slow.predicted_ms > p2p.predicted_ms  # the prices are not part of the value
    assert ps.DispatchPlan(mask, 32, 4, "balanced", p2p.runs, p2p.work).transport == "p2p"
    with pytest.raises(ps.ParallelStateValueError, match="transport='tcp' is not one of"):
        ps.DispatchPlan(mask, 32, 4, "balanced", p2p.runs, p2p.work, "tcp")
    only = plan_dispatch(mask, 32, 4, transport="allgather")
    assert only.transport == "allgather" and {c.transport for c in only.candidates} == {"allgather"}


@pytest.mark.parametrize("kwargs, exc, fragment", [
    ({"flops_per_ms": 0}, ValueError, "flops_per_ms=0.0 must be finite and > 0"),
    ({"bytes_per_ms": -1.0}, ValueError, "bytes_per_ms=-1.0 must be finite and > 0"),
    ({"bytes_per_ms": float("nan")}, ValueError, "bytes_per_ms=nan must be finite"),
    ({"latency_ms": float("inf")}, ValueError, "latency_ms=inf must be finite and >= 0"),
    ({"overlap": 1.5}, ValueError, "overlap=1.5 must be finite and >= 0 and <= 1"),
    ({"parallel": 0}, ValueError, "parallel (ranks computing at once)=0.0 must be finite and > 0"),
    ({"flops_per_ms": "fast"}, TypeError, "flops_per_ms must be a number, got str"),
    ({"latency_ms": True}, TypeError, "latency_ms must be a number, got bool"),
])
def test_bad_rates(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment.replace("(", r"\(").replace(")", r"\)")) as info:
        ps.CostRates(**kwargs)
    assert isinstance(info.value, ps.ParallelStateError)


def test_bad_shapes():
    for kwargs, fragment in (({"heads": 0}, "heads must be >= 1"), ({"heads": 6, "kv_heads": 4}, "kv_heads=4 must"),
                             ({"dtype": "int4"}, "unknown dtype name 'int4'"),
                             ({"head_dim": 2.5}, "head_dim must be an int"),
                             ({"backward": 1}, "backward must be a bool")):
        with pytest.raises(ps.ParallelStateError, match=fragment):
            ps.AttentionShape(**kwargs)
    assert ps.AttentionShape(heads=8, kv_heads=2, dtype=4).itemsize == 4


def test_dual_chunk_swap_is_megatron_cores_layout_on_one_sequence_and_per_packed_sequence():
    """Rank r holds chunk r then chunk 2cp-1-r of every sequence (megatron-core's get_batch_on_this_cp_rank), the
    tokens ascending; with cu_seqlens each sequence separately; the work is the mask's pairs of those queries."""
    for cp_size in (1, 2, 3, 4):
        for bounds in ((0, 8 * cp_size), (0, 2 * cp_size, 2 * cp_size, 8 * cp_size, 12 * cp_size)):
            length = bounds[-1]
            mask = Mask.packed([b - a for a, b in zip(bounds, bounds[1:], strict=False) if b > a], chunk=1)
            plan = ps.plan_dual_chunk_swap(mask, length, cp_size, cu_seqlens=list(bounds))
            assert cp.plan_dual_chunk_swap is ps.plan_dual_chunk_swap and plan.method == "dual_chunk_swap"
            dense = mask.dense(length)
            for r in range(cp_size):
                want = []
                for a, b in zip(bounds, bounds[1:], strict=False):
                    chunk = (b - a) // (2 * cp_size)
                    want += list(range(a + r * chunk, a + (r + 1) * chunk))
                    want += list(range(b - (r + 1) * chunk, b - r * chunk))
                assert list(plan.positions[r]) == want, (cp_size, bounds, r)
                assert plan.work[r] == int(dense[want].sum())
            assert plan.predicted_ms > 0 and plan.transport == "p2p"
    causal = ps.plan_dual_chunk_swap(Mask.causal(), 64, 4, transport="ring")
    assert causal.balance == 1.0 and causal.transport == "ring"  # one early and one late chunk each: even work
    assert ps.plan_dual_chunk_swap(Mask.causal(), 64, 4, transport="ring") is causal  # cached
    assert ps.plan_dual_chunk_swap(Mask.causal(), 64, 4, cu_seqlens=torch.tensor([0, 64])) == \
        ps.plan_dual_chunk_swap(Mask.causal(), 64, 4, transport="p2p")


@pytest.mark.parametrize("args, kwargs, exc, fragment", [
    ((Mask.causal(), 18, 2), {}, ValueError, "the sequence has 18 tokens, not a multiple of 2 * cp_size = 4; pad"),
    ((Mask.causal(), 24, 2), {"cu_seqlens": [0, 6, 24]}, ValueError, "sequence 0 (tokens 0 to 6) has 6 tokens"),
    ((Mask.causal(), 24, 2), {"cu_seqlens": [0, 8, 20]}, ValueError, "must rise from 0 to the total length 24"),
    ((Mask.causal(), 24, 2), {"cu_seqlens": [0, 16, 8, 24]}, ValueError, "must rise from 0"),
    ((Mask.causal(), 24, 2), {"cu_seqlens": "0,24"}, TypeError, "cu_seqlens must be a 1-D sequence"),
    ((Mask.causal(), 24, 2), {"transport": "a2a"}, ValueError, "transport='a2a' is not one of"),
    ((Mask.causal(), 24, 0), {}, ValueError, "cp_size=0 must be >= 1"),
    (("causal", 24, 2), {}, TypeError, "mask must be an AttentionMask"),
    ((Mask.packed([8, 8]), 24, 2), {}, ValueError, "segments add up to 16 tokens but the sequence has 24"),
])
def test_dual_chunk_swap_bad_arguments(args, kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        ps.plan_dual_chunk_swap(*args, **kwargs)
    assert isinstance(info.value, ps.ParallelStateError) and fragment in str(info.value)
