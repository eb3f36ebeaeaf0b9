"""Masked attention (``mask=`` / ``plan=``) of cp's ring, Ulysses and usp on real gloo ranks: float64 equality
with one process attending under the dense mask (output and q, k, v gradients) for every mask kind, balanced and
contiguous plans (and whole-clip plans for usp 2 x 2), even and uneven lengths, GQA; the work each rank counts
equals the plan's; K/V reach exactly the ranks whose queries see them; bad combinations raise on every rank."""

from __future__ import annotations

import torch

import cp
import cp.call_check
import cp.comm
import cp.kernels
import cp.mask_schedule
import cp.masked
import cp.transports
from cpgroups import data as _data
from cpgroups import raises as _raises
from cpgroups import spying

# ---------------------------------------------------------------- helpers run on every rank


def _masks(length):
    """Every mask kind, sized for a sequence of ``length`` tokens (16 < length)."""
    segments = (7, 9, length - 16)
    return [cp.Mask.full(), cp.Mask.causal(), cp.Mask.chunk_causal(4), cp.Mask.sliding_window(3, 2),
            cp.Mask.packed(segments), cp.Mask.packed(segments, chunk=3), cp.Mask.token_window(4, 2)]


#: (q heads, kv heads, seq_dim, head_dim): MHA in [B, S, H, D], GQA in [B, H, S, D], MQA in [B, S, H, D].
HEADS = [(4, 4, 1, 2), (4, 2, 2, 1), (4, 1, 1, 2)]


def _cases(n):
    """(mask, length, method, heads) for a group of n: every mask with both plan methods, once with an even length
    (a multiple of n) and once with an uneven one; the head layouts take turns."""
    even = 20 if n == 4 else 18
    out = []
    for i, (length, method) in enumerate([(even, "balanced"), (even + 1, "contiguous"), (even - 1, "contiguous"),
                                          (even, "balanced")]):
        for j, mask in enumerate(_masks(length)):
            if (i + j) % 2 == 0:  # each (mask, method) pair once per group, alternating lengths
                out.append((mask, length, method, HEADS[(i + j) % 3]))
    # megatron-core's and Transformer Engine's layout (2n equal chunks, rank r holding r and 2n-1-r), two masks
    out += [(cp.Mask.causal(), 6 * n, "dual_chunk_swap", HEADS[n % 3]),
            (cp.Mask.token_window(3, 2), 4 * n, "dual_chunk_swap", HEADS[(n + 1) % 3])]
    return out


def _plan(mask, length, n, method):
    if method == "dual_chunk_swap":
        return cp.plan_dual_chunk_swap(mask, length, n)
    return cp.plan_dispatch(mask, length, n, method=method)


def _qkvw(length, heads, s, h, seed):
    hq, hkv, _, _ = heads
    b = 2 if hq != hkv else 1

    def make(n_heads, k):
        return _data((b, length, n_heads, 4), seed + k).movedim((1, 2), (s, h)).contiguous()
    return make(hq, 0), make(hkv, 1), make(hkv, 2), make(hq, 3)


def _reference(q, k, v, w, mask, s, h):
    """One process: SDPA over the whole sequence with the dense mask (K/V heads repeated), and the gradients of
    sum(out * w)."""
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    groups = q.shape[h] // k.shape[h]
    kk, vv = (t.repeat_interleave(groups, dim=h) for t in ins[1:])
    out = cp.sdpa_in_layout(ins[0], kk, vv, seq_dim=s, head_dim=h, attn_mask=mask.dense(q.shape[s]))
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in ins]


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _compare(run, q, k, v, w, mask, s, h, index):
    """run(this rank's q, k, v) == one process at this rank's tokens ``index``; returns the worst relative error."""
    ref, grads = _reference(q, k, v, w, mask, s, h)
    mine = [t.index_select(s, index).requires_grad_(True) for t in (q, k, v)]
    with cp.count_attention() as count:
        out = run(*mine)
        (out * w.index_select(s, index)).sum().backward()
    errs = [_rel(out, ref.index_select(s, index))]
    errs += [_rel(m.grad, g.index_select(s, index)) for m, g in zip(mine, grads, strict=True)]
    assert max(errs) <= 1e-12, errs
    return max(errs), count


def _needed_bytes(mask, plan, me, peer, k, v, s):
    """Bytes of K and V of rank ``me`` that rank ``peer``'s queries see, from the dense mask (independently of
    the schedule): tokens of ``me`` that any query of ``peer`` may attend, times a token's K and V bytes."""
    dense = mask.dense(plan.length)
    tokens = int(dense[plan.index(peer)][:, plan.index(me)].any(0).sum())
    per_token = (k.numel() // k.shape[s] + v.numel() // v.shape[s]) * k.element_size()
    return tokens * per_token


def _check_traffic(count, mask, plan, me, ranks, k, v, s):
    """K/V went to exactly the ranks that need them, exactly the tokens they need (forward and backward), and the
    gradients of exactly those came back."""
    pairs = plan.pairs()
    for peer in range(plan.cp_size):
        if peer == me:
            continue
        need = _needed_bytes(mask, plan, me, peer, k, v, s)
        assert (need == 0) == (pairs[peer][me] == 0), (peer, need, pairs)
        assert count.kv_sent.get(ranks[peer], 0) == 2 * need, (peer, count.kv_sent, need)  # forward + backward
        grad = count.grad_received.get(ranks[peer], 0)
        assert grad == need, (peer, grad, need)  # float64: the gradients travel in the input's dtype


def _with_transport(plan, transport):
    """The plan asking for ``transport`` (``DispatchPlan.transport``)."""
    import dataclasses

    return dataclasses.replace(plan, transport=transport)


def _check_transport(count, transport, mask, plan, me, ranks, k, v, s):
    """The bytes each transport sends: p2p exactly the needed tokens, the ring only to the next rank, the all-gather
    every rank's whole shard to every other rank (forward and backward) and the gradients back to every owner."""
    n = plan.cp_size
    if transport == "p2p":
        _check_traffic(count, mask, plan, me, ranks, k, v, s)
    elif transport == "ring":
        assert set(count.kv_sent) <= {ranks[(me + 1) % n]} and set(count.grad_sent) == {ranks[(me + 1) % n]}, count
    else:
        per_token = (k.numel() // k.shape[s] + v.numel() // v.shape[s]) * k.element_size()
        want = {ranks[p]: 2 * max(plan.sizes) * per_token for p in range(n) if p != me}
        assert count.kv_sent == count.kv_received == want, (count, want)
        assert set(count.grad_sent) == set(count.grad_received) == set(want), count


def _small_tiles():
    """Tiles of a few rows, so that these short sequences exercise every tile kind (full, masked, sliced, indexed)."""
    cp.mask_schedule.FULL_ROWS, cp.mask_schedule.TILE_ROWS = 2, 3


def _default_tiles():
    cp.mask_schedule.FULL_ROWS, cp.mask_schedule.TILE_ROWS = 16, 128
    cp.kernels.use_fused = True


# ---------------------------------------------------------------- the ring at cp 2, 3 and 4, Ulysses at cp 4


def _ring_groups():
    """The world (cp 4), ranks 3, 1, 2 (cp 3, group ranks not in global order; rank 0 sits out) and the pairs
    (0, 2) and (1, 3) (cp 2, side by side)."""
    import torch.distributed as dist

    out = [dist.group.WORLD]
    made = []
    for members in ([3, 1, 2], [0, 2], [1, 3]):
        g = dist.new_group(members)
        made.append(g)
        if dist.get_rank() in members:
            out.append(g)
    return out, made


def case_ring_and_ulysses():
    import torch.distributed as dist

    groups, made = _ring_groups()
    checks, worst, transports = [], 0.0, set()
    _small_tiles()
    try:
        for g in groups:
            n, me = g.size(), g.rank()
            ranks = dist.get_process_group_ranks(g)
            for c, (mask, length, method, heads) in enumerate(_cases(n)):
                _, _, s, h = heads
                cp.kernels.use_fused = c % 2 == 0  # the fused CPU kernel and the plain matmuls take turns
                # Every transport takes its turn (the layout by mask alone uses the plan's default).
                transport = cp.transports.NAMES[c % 3]
                plan = _with_transport(_plan(mask, length, n, method), transport)
                q, k, v, w = _qkvw(length, heads, s, h, 10 * c)
                # The contiguous layout also by mask alone (with length=), as the plan the ring makes for it.
                by_mask = method == "contiguous" and c % 4 == 1
                kwargs = {"mask": mask, "length": length} if by_mask else {"plan": plan}
                transport = cp.plan_dispatch(mask, length, n, method=method).transport if by_mask \
                    else transport

                def ring(a, b, x, g=g, s=s, h=h, kwargs=kwargs):
                    return cp.ring_attention(a, b, x, g, seq_dim=s, head_dim=h, **kwargs)
                err, count = _compare(ring, q, k, v, w, mask, s, h, plan.index(me))
                per = q.numel() // (length * q.shape[-1])  # batch x query heads
                assert count.pairs == count.backward_pairs == per * plan.work[me], (count, plan.work)
                assert count.calls == 1
                _check_transport(count, transport, mask, plan, me, ranks, k, v, s)
                transports.add(transport)
                worst = max(worst, err)
                checks.append(f"ring {n} {mask} {method} L={length}")
                if n == 4 and c % 2 == 0:  # Ulysses (at cp 2 it runs inside usp 2 x 2)
                    def uly(a, b, x, g=g, s=s, h=h, plan=plan):
                        return cp.ulysses_attention(a, b, x, g, plan=plan, seq_dim=s, head_dim=h)
                    err, count = _compare(uly, q, k, v, w, mask, s, h, plan.index(me))
                    # Every rank attends the whole sequence for 1/n of the heads: the mask's work, evenly.
                    assert count.pairs == count.backward_pairs == per // n * mask.work(length), count
                    assert not count.kv_sent  # the all-to-all moves K/V, no point-to-point transfer
                    worst = max(worst, err)
                    checks.append(f"ulysses {n} {mask} {method} L={length}")
        assert transports == set(cp.transports.NAMES), transports
    finally:  # the pool's ranks outlive this case
        _default_tiles()
        for g in made:
            dist.destroy_process_group(g)
    return len(checks), worst


# ---------------------------------------------------------------- usp 2 x 2 over megatron's hierarchical cp groups


def case_usp():
    import datetime

    import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                 timeout=datetime.timedelta(seconds=30))
    ug, rg = ps.get_hierarchical_context_parallel_groups()
    me, j = ps.get_context_parallel_rank(), rg.rank()
    checks, worst = 0, 0.0
    _small_tiles()
    # Besides every case: the packed masks with whole clips per rank (method="clips"), uneven shard sizes.
    clips = [(mask, 21, "clips", HEADS[i % 3]) for i, mask in enumerate(_masks(21)) if mask.kind == "packed"]
    try:
        for c, (mask, length, method, heads) in enumerate(_cases(4) + clips):
            _, _, s, h = heads
            cp.kernels.use_fused = c % 2 == 1
            plan = _with_transport(_plan(mask, length, 4, method), cp.transports.NAMES[c % 3])
            q, k, v, w = _qkvw(length, heads, s, h, 10 * c)
            kwargs = {"mask": mask, "length": length} if method == "contiguous" and c % 4 == 1 else {"plan": plan}

            def usp(a, b, x, s=s, h=h, kwargs=kwargs):
                return cp.usp_attention(a, b, x, ulysses_group=ug, ring_group=rg, seq_dim=s, head_dim=h, **kwargs)
            err, count = _compare(usp, q, k, v, w, mask, s, h, plan.index(me))
            # Ring rank j attends the queries of cp ranks 2j and 2j + 1 for half of the heads.
            per = q.numel() // (length * q.shape[-1]) // 2
            assert count.pairs == count.backward_pairs == per * (plan.work[2 * j] + plan.work[2 * j + 1]), count
            worst = max(worst, err)
            checks += 1
    finally:
        _default_tiles()
    return checks, worst


# ---------------------------------------------------------------- real traffic: point to point to the needy only


def case_traffic_is_point_to_point_to_the_needy():
    """Spy on torch.distributed while the masked ring runs (the real functions still run): per pass its rounds (the
    forward's check of every rank's plan and tokens, the backward's round saying every rank posted its receives)
    with only receives before them, and point-to-point messages only, each to a rank whose queries see the
    sender's keys; the counter saw the same bytes."""
    import torch.distributed as dist

    g = dist.group.WORLD
    me = g.rank()
    calls, sends = [], []
    cp.call_check.clear()  # a call new to every rank: checked in full

    def record(name, args, kwargs):
        calls.append(name)
        if name == "isend":
            sends.append((kwargs.get("group_dst", kwargs.get("dst")), args[0].numel() * args[0].element_size()))

    mask = cp.Mask.sliding_window(4, 2)  # rank r's queries see only the nearest chunks: not everyone needs everyone
    plan = cp.plan_dispatch(mask, 64, 4, method="contiguous")
    q, k, v, _ = _qkvw(64, (4, 2, 1, 2), 1, 2, 5)
    mine = [t.index_select(1, plan.index(me)).requires_grad_(True) for t in (q, k, v)]
    with spying(record), cp.count_attention() as count:
        out = cp.ring_attention(*mine, g, plan=plan)
        forward = len(calls)
        out.sum().backward()
    assert set(calls) <= {"all_to_all_single", "batch_isend_irecv", "isend", "irecv"}, calls
    # gloo: no message leaves before every receive is posted. The forward's rounds: the call's agreement and, as
    # the call is new, its full check (cp.call_check); the backward's: the round saying every rank posted.
    for part, rounds in ((calls[:forward], 2), (calls[forward:], 1)):
        last = len(part) - 1 - part[::-1].index("all_to_all_single")
        assert part.count("all_to_all_single") == rounds and "isend" not in part[:last], calls
    # gloo: every transfer of the pass starts at step 0; NCCL (one stream per batch) would deadlock on that.
    assert cp.transports.starts_all_at_once(cp.comm.backend_for(g, "cpu")) and not cp.transports.starts_all_at_once("nccl")
    pairs = plan.pairs()
    sent: dict[int, int] = {}
    for peer, nbytes in sends:
        sent[peer] = sent.get(peer, 0) + nbytes
    kv = {p: b for p, b in count.kv_sent.items()}
    for peer, b in count.grad_sent.items():
        kv[peer] = kv.get(peer, 0) + b
    assert sent == kv, (sent, kv)
    # K/V to the needy only (the gradients back to owners whose K/V this rank needed).
    assert all(pairs[p][me] > 0 for p in count.kv_sent) and all(pairs[me][p] > 0 for p in count.grad_sent)
    return sorted(count.kv_sent)


# ---------------------------------------------------------------- errors, on every rank alike


def case_errors():
    import datetime

    import torch.distributed as dist

    import parallel_state as ps

    g = dist.group.WORLD
    n, me = g.size(), g.rank()
    mask = cp.Mask.chunk_causal(3)
    plan = cp.plan_dispatch(mask, 22, n)
    x = _data((1, plan.sizes[me], 4, 4), 1)
    found = 0

    def both(exc, fragments, **kwargs):  # ring and Ulysses alike
        nonlocal found
        _raises(exc, fragments, cp.ring_attention, x, x, x, g, **kwargs)
        _raises(exc, fragments, cp.ulysses_attention, x, x, x, g, **kwargs)
        found += 1

    # Arguments every rank passes alike: each rank raises by itself, before any communication.
    both(ValueError, ["the plan is for 2 rank(s) but the group has 4", "cp.plan_dispatch(mask, 22, 4)"],
         plan=cp.plan_dispatch(mask, 22, 2))
    both(ValueError, ["differs from the plan's mask", "chunk_causal"], plan=plan, mask=cp.Mask.causal())
    both(TypeError, ["mask must be a cp.Mask", "str"], mask="causal")
    both(TypeError, ["plan must be a cp.DispatchPlan", "dict"], plan={})
    both(ValueError, ["length=23 but the plan is for 22 tokens"], plan=plan, length=23)
    both(ValueError, ["packed segments add up to 9 tokens but the sequence has 22"], mask=cp.Mask.packed((4, 5)),
         length=22)
    _raises(ValueError, ["causal=True cannot be combined with mask= or plan=", "cp.Mask.causal()"],
            cp.ring_attention, x, x, x, g, causal=True, mask=mask)
    _raises(ValueError, ["attn_fn cannot be combined with mask="], cp.ulysses_attention, x, x, x, g, plan=plan,
            attn_fn=cp.sdpa_in_layout)
    _raises(ValueError, ["only ['scale', 'enable_gqa']", "is_causal", "mask=cp.Mask.causal()"],
            cp.ulysses_attention, x, x, x, g, plan=plan, is_causal=True)
    found += 3
    # A rank holding the wrong number of tokens, or passing another plan: every rank raises, naming it.
    wrong = _data((1, plan.sizes[me] + (me == 1), 4, 4), 1)
    for fn in (cp.ring_attention, cp.ulysses_attention):
        _raises(ValueError, [f"group rank 1 (global 1) holds {plan.sizes[1] + 1} tokens of q, the plan gives it "
                             f"{plan.sizes[1]}", "cp.dispatch(x, plan, seq_dim"], fn, wrong, wrong, wrong, g, plan=plan)
        other = cp.plan_dispatch(cp.Mask.chunk_causal(2), 22, n) if me == 2 else plan
        y = _data((1, other.sizes[me], 4, 4), 1)
        _raises(ValueError, ["different masks or plans"], fn, y, y, y, g, plan=other)
        z = _data((1, 5 + (me == 3), 4, 4), 1)  # no plan, no length: every rank must hold as many
        _raises(ValueError, ["different numbers of tokens", "pass length="], fn, z, z, z, g, mask=mask)
        found += 1
    # With p2p on gloo every rank posts its K/V receives before the check: a failed check completes them (each
    # rank sends the empty bytes the others posted for), so the next call on the group is exact.
    ref = _data((1, 22, 4, 4), 2)
    for transport in ("p2p", "ring", "allgather"):
        tp = cp.plan_dispatch(mask, 22, n, transport=transport)
        wrong = _data((1, tp.sizes[me] + (me == 1), 4, 4), 1)
        _raises(ValueError, ["group rank 1 (global 1) holds"], cp.ring_attention, wrong, wrong, wrong, g, plan=tp)
        other = cp.plan_dispatch(cp.Mask.causal(), 22, n, transport=transport) if me == 2 else tp
        y = _data((1, other.sizes[me], 4, 4), 1)
        _raises(ValueError, ["different masks or plans"], cp.ring_attention, y, y, y, g, plan=other)
        mine = ref.index_select(1, tp.index(me))
        want = cp.sdpa_in_layout(ref, ref, ref, attn_mask=mask.dense(22)).index_select(1, tp.index(me))
        assert _rel(cp.ring_attention(mine, mine, mine, g, plan=tp), want) <= 1e-12, transport
        found += 1
    # usp: a wrong count in one Ulysses group reaches the ranks of the other one too.
    ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                 timeout=datetime.timedelta(seconds=30))
    ug, rg = ps.get_hierarchical_context_parallel_groups()
    cpr = ps.get_context_parallel_rank()
    bad = _data((1, plan.sizes[cpr] + (cpr == 3), 4, 4), 1)
    _raises(ValueError, [f"cp rank 3 holds {plan.sizes[3] + 1} tokens of q, the plan gives it {plan.sizes[3]}"],
            cp.usp_attention, bad, bad, bad, ulysses_group=ug, ring_group=rg, plan=plan)
    _raises(ValueError, ["causal=True cannot be combined"], cp.usp_attention, bad, bad, bad, ulysses_group=ug,
            ring_group=rg, plan=plan, causal=True)
    found += 1
    ps.destroy_model_parallel()
    # After all of that the masked ring still works: here with v's feature size other than k's (plain matmuls) and
    # in float32 and bfloat16 (sums in float32, the output in the input's dtype).
    q, k, _, _ = _qkvw(22, (4, 4, 1, 2), 1, 2, 3)
    v = _data((1, 22, 4, 6), 9)
    want = cp.sdpa_in_layout(q, k, v, attn_mask=mask.dense(22)).index_select(1, plan.index(me))
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = cp.ring_attention(*(t.index_select(1, plan.index(me)).to(dtype) for t in (q, k, v)), g, plan=plan)
        assert out.dtype == dtype and out.shape == want.shape
        assert _rel(out.double(), want) <= tol, (dtype, _rel(out.double(), want))
    return found


# ---------------------------------------------------------------- tests


def test_masked_ring_and_ulysses_match_one_process_at_cp_2_3_4(pools):
    results = pools(4).run(case_ring_and_ulysses, timeout=180)
    # Every rank: the world (cp 4, ring and Ulysses) and its pair (cp 2); ranks 1, 2 and 3 also the ring of 3.
    full = {n: len(_cases(n)) + (len(_cases(n)) + 1) // 2 * (n == 4) for n in (2, 3, 4)}
    assert [c for c, _ in results] == [full[4] + full[2]] + [full[4] + full[3] + full[2]] * 3
    assert max(w for _, w in results) <= 1e-12


def test_masked_usp_2x2_matches_one_process_and_counts_the_plans_work(pools):
    results = pools(4).run(case_usp, timeout=120)
    assert [c for c, _ in results] == [len(_cases(4)) + 2] * 4  # every case, and two clips plans


def test_masked_ring_sends_only_to_ranks_that_need_the_keys(pools):
    needy = pools(4).run(case_traffic_is_point_to_point_to_the_needy)
    # A window of 2 chunks of 4 over 16-token shards: each rank's keys reach the next rank only.
    assert needy == [[1], [2], [3], []]


def test_masked_bad_combinations_raise_on_every_rank(pools):
    assert pools(4).run(case_errors) == [15] * 4


def test_one_process_masked_attention_is_the_dense_mask():
    """No group: ring, Ulysses and usp with a mask are one process attending under the mask, tokens in any
    order with a plan of one rank."""
    for mask in _masks(19):
        q, k, v, w = _qkvw(19, (4, 2, 1, 2), 1, 2, 7)
        want = _reference(q, k, v, w, mask, 1, 2)[0]
        for out in (cp.ring_attention(q, k, v, mask=mask), cp.ulysses_attention(q, k, v, mask=mask),
                    cp.usp_attention(q, k, v, ulysses_group=None, ring_group=None, mask=mask)):
            assert torch.allclose(out, want, atol=1e-12)
        assert torch.allclose(cp.ring_attention(q, k, v, plan=cp.plan_dispatch(mask, 19, 1)), want, atol=1e-12)


def test_schedule_tiles_cover_every_allowed_pair_once():
    """The tiles of a schedule hold every allowed pair of the rank's queries exactly once and nothing disallowed,
    and a fully allowed (causal) tile is one where every pair (of its lower triangle) is allowed: checked against
    the dense mask."""
    kinds = set()
    from cp import mask_schedule

    n = len(_masks(29))
    for mask, tiles in zip(_masks(29) * 2, [(16, 128)] * n + [(2, 3)] * n, strict=True):
        mask_schedule.FULL_ROWS, mask_schedule.TILE_ROWS = tiles  # default tiles, and small ones of every kind
        for method in ("balanced", "contiguous"):
            plan = cp.plan_dispatch(mask, 29, 3, method=method)
            dense = mask.dense(29)
            for rank in range(3):
                sched = mask_schedule.build(mask, 29, plan.positions, rank)
                seen = torch.zeros(29, 29, dtype=torch.int64)
                qpos = plan.index(rank)
                for block in sched.blocks:
                    if block is None:
                        continue
                    keys = plan.index(block.source)
                    keys = keys if block.index is None else keys[block.index]
                    assert bool((keys.diff() > 0).all())  # ascending positions
                    for tile in block.tiles:
                        rows = qpos[tile.rows]
                        cols = keys[tile.c0:tile.c1]
                        masked = tile.masked_out(torch.device("cpu"))
                        allowed = torch.ones(len(rows), len(cols), dtype=torch.bool) if masked is None else ~masked
                        kinds.add(tile.kind)
                        assert torch.equal(allowed, dense[rows][:, cols]), (mask, method, rank)
                        assert int(allowed.sum()) == tile.allowed
                        seen[rows[:, None], cols[None, :]] += allowed.long()
                assert torch.equal(seen[qpos], dense[qpos].long()), (mask, method, rank)
                assert sched.allowed == plan.work[rank]
    _default_tiles()
    assert kinds == {"full", "causal", "masked"}, kinds
