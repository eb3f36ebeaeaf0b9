"""The cross-rank check of masked attention (``cp.call_check``) on 4 real gloo ranks: a call is checked in full once,
then agreed by one small round per call; a changed call is checked again; a rank changing its call while the others
repeat theirs is an error on every rank (never a hang), on gloo's path and on NCCL's (run here on gloo); debug mode
checks every call in full. Rounds are seen by spying on torch.distributed (the real functions still run)."""

from __future__ import annotations

import os

import torch

import cp
import cp.call_check
from cpgroups import data as _data
from cpgroups import raises, spying

LENGTH = 32


def _want(x, mask, plan, me):
    """One process attending over the whole sequence ``x`` under ``mask``: rank ``me``'s tokens of the output."""
    return cp.sdpa_in_layout(x, x, x, attn_mask=mask.dense(LENGTH)).index_select(1, plan.index(me))


def case_checked_once_then_agreed():
    import torch.distributed as dist

    g = dist.group.WORLD
    me, n = g.rank(), g.size()
    widths: list[int] = []

    def record(name, args, kwargs):
        if name == "all_to_all_single":  # a round: every rank's row, sent to every rank
            widths.append(args[1].numel() // n)

    def rounds(fn):
        """The rounds (their row widths) that ``fn()`` starts, and its result."""
        widths.clear()
        with spying(record):
            out = fn()
        return list(widths), out

    cp.call_check.clear()
    mask = cp.Mask.chunk_causal(4)
    x = _data((1, LENGTH, 2, 4), 1)
    seen = {}
    for transport in ("ring", "p2p", "allgather"):
        plan = cp.plan_dispatch(mask, LENGTH, n, transport=transport)
        mine = x.index_select(1, plan.index(me))
        first, out = rounds(lambda plan=plan, mine=mine: cp.ring_attention(mine, mine, mine, g, plan=plan))
        again, _ = rounds(lambda plan=plan, mine=mine: cp.ring_attention(mine, mine, mine, g, plan=plan))
        other, _ = rounds(lambda plan=plan, mine=mine: cp.ring_attention(mine + 1, mine, mine, g, plan=plan))
        assert (out - _want(x, mask, plan, me)).abs().max() < 1e-12
        # First call: the agreement round (2 ints a rank) and the full check; the same call (other data alike):
        # the agreement round only.
        assert len(first) == 2 and first[0] == 2 and first[1] > 2 and again == other == [2], (first, again, other)
        seen[transport] = first[1]
    # A changed call (another plan) is checked in full again; so is every call in debug mode.
    changed = cp.plan_dispatch(cp.Mask.causal(), LENGTH, n, transport="ring")
    mine = x.index_select(1, changed.index(me))
    assert rounds(lambda: cp.ring_attention(mine, mine, mine, g, plan=changed))[0] == [2, seen["ring"]]
    os.environ["PARALLEL_STATE_DEBUG"] = "1"
    try:
        for _ in range(2):
            assert rounds(lambda: cp.ring_attention(mine, mine, mine, g, plan=changed))[0] == [2, seen["ring"]]
    finally:
        os.environ.pop("PARALLEL_STATE_DEBUG")
    assert rounds(lambda: cp.ring_attention(mine, mine, mine, g, plan=changed))[0] == [2]
    # p2p on gloo: the backward's round (every rank has posted its receives) stays, one int a rank.
    plan = cp.plan_dispatch(mask, LENGTH, n, transport="p2p")
    mine = x.index_select(1, plan.index(me)).requires_grad_(True)
    assert rounds(lambda: cp.ring_attention(mine, mine, mine, g, plan=plan).sum().backward())[0] == [2, 1]
    # Ulysses with a plan: checked before its all-to-alls (3 ints: the exchange's rounds are wider).
    plan = cp.plan_dispatch(mask, LENGTH, n)
    mine = x.index_select(1, plan.index(me)).repeat(1, 1, 2, 1)  # 4 heads for 4 ranks
    first = rounds(lambda: cp.ulysses_attention(mine, mine, mine, g, plan=plan))[0]
    again = rounds(lambda: cp.ulysses_attention(mine, mine, mine, g, plan=plan))[0]
    assert first[:2] == [2, first[1]] and first[1] > 2 and again[0] == 2 and len(again) == len(first) - 1, (first,
                                                                                                           again)
    return sorted(seen.values())


def _changes(g, plan, mine, wrong_rank):
    """The calls by which rank ``wrong_rank`` departs from the checked ring call while the others repeat it: (its
    call, the fragments of the full check's message, whether it refuses: its own checks fail before the round)."""
    other = cp.plan_dispatch(cp.Mask.causal(), LENGTH, g.size(), transport=plan.transport)
    extra = torch.cat([mine, mine[:, :1]], 1)
    narrow = mine[:, :, :2]  # 2 heads, which Ulysses cannot split over 4 ranks
    return [
        (lambda: cp.ring_attention(extra, extra, extra, g, plan=plan),
         [f"group rank {wrong_rank} (global {wrong_rank}) holds {mine.shape[1] + 1} tokens of q, the plan gives it "
          f"{mine.shape[1]}"], False),
        (lambda: cp.ring_attention(mine, mine, mine, g, plan=other), ["different masks or plans"], False),
        (lambda: cp.ring_attention(mine.float(), mine.float(), mine.float(), g, plan=plan),
         ["differ beyond their token counts", "float32", "float64"], False),
        # Another method, all else alike: its collectives differ from the ring's, so the digest names it.
        (lambda: cp.ulysses_attention(mine, mine, mine, g, plan=plan),
         ["attend by different methods", "'Ulysses'", "'the ring'"], False),
        (lambda: cp.ring_attention(mine, mine, mine, g, plan=plan, softmax_scale=0.25),
         ["different softmax scales", "0.25"], False),
        # Ulysses cannot split 2 heads over 4 ranks: that rank takes part in the round with its reason (refuses).
        (lambda: cp.ulysses_attention(narrow, narrow, narrow, g, plan=plan),
         ["its number of heads (head_dim=2, size 2)", "cannot be split into 4 equal blocks"], True),
    ]


def case_a_rank_departing_from_a_checked_call():
    """Every rank repeats a checked ring call but one, which changes its token count, its plan, its dtype, its
    method (Ulysses) or scale, or cannot make its call (refuses): gloo reads every round, so every rank takes the
    full check and raises the same ValueError (naming a refusing rank and its reason); then the checked call is
    exact again. With NCCL's path (the rounds read on the device, run here on gloo), the changed rank raises a
    ValueError and the others stop at the device-side assertion (a RuntimeError here, on the CPU); a rank whose
    cache forgot a call that the others remember re-checks without an error."""
    import torch.distributed as dist

    g = dist.group.WORLD
    me, n = g.rank(), g.size()
    mask = cp.Mask.chunk_causal(4)
    x = _data((1, LENGTH, 4, 4), 2)
    found = 0
    try:
        for nccl_path in (False, True):
            cp.call_check.reads_wait_everywhere = nccl_path
            # NCCL's p2p posts no receive before the round (only gloo's does): its path runs ring and allgather.
            for c, transport in enumerate(("ring", "allgather") if nccl_path else ("p2p", "ring", "allgather")):
                cp.call_check.clear()
                plan = cp.plan_dispatch(mask, LENGTH, n, transport=transport)
                mine = x.index_select(1, plan.index(me))
                want = _want(x, mask, plan, me)

                def repeat(mine=mine, plan=plan):
                    return cp.ring_attention(mine, mine, mine, g, plan=plan)

                assert (repeat() - want).abs().max() < 1e-12
                wrong = 1 + c  # a different rank departs each time
                for change, fragments, refuses in _changes(g, plan, mine, wrong):
                    if me != wrong and nccl_path:
                        raises(RuntimeError, ["the ranks' calls differ", "PARALLEL_STATE_DEBUG=1"], repeat)
                    elif me != wrong or not nccl_path:
                        named = [f"group rank {wrong} (global {wrong}): "] if refuses else []
                        raises(ValueError, [*named, *fragments], change if me == wrong else repeat)
                    elif refuses:  # on NCCL's path the refusing rank says its own reason
                        raises(ValueError, ["ulysses_attention", *fragments], change)
                    else:
                        raises(ValueError, ["repeated a call checked before", "by group rank"], change)
                    # Nothing was left half done: the checked call is exact again, on every rank.
                    assert (repeat() - want).abs().max() < 1e-12
                    found += 1
                # One rank forgot the call (its cache is full of others): it checks again, the others go on.
                if me == wrong:
                    cp.call_check.clear()
                assert (repeat() - want).abs().max() < 1e-12
    finally:
        cp.call_check.reads_wait_everywhere = False
        cp.call_check.clear()
    return found


def test_a_call_is_checked_once_then_agreed_every_call(pools):
    widths = pools(4).run(case_checked_once_then_agreed)
    assert len({tuple(w) for w in widths}) == 1  # every rank saw the same rounds


def test_a_rank_departing_from_a_checked_call_raises_on_every_rank(pools):
    assert pools(4).run(case_a_rank_departing_from_a_checked_call, timeout=180) == [30] * 4
