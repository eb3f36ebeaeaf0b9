"""AttentionMask (cp.Mask): every kind's dense matrix against a brute-force reading of its definition, key_range /
widths / work / allowed against the dense matrix, value semantics, the text form, and the errors of bad masks."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import cp
import parallel_state as ps
from parallel_state import AttentionMask as Mask


def brute(mask: Mask, length: int) -> torch.Tensor:
    """The mask's definition, one (query, key) pair at a time (nothing shared with the implementation)."""
    out = torch.zeros(length, length, dtype=torch.bool)
    seg_of, start_of = [], []
    if mask.kind == "packed":
        at = 0
        for s, n in enumerate(mask.lengths):
            seg_of += [s] * n
            start_of += [at] * n
            at += n
    for i in range(length):
        for j in range(length):
            if mask.kind == "full":
                ok = True
            elif mask.kind == "causal":
                ok = j <= i
            elif mask.kind == "chunk_causal":
                ok = j // mask.chunk <= i // mask.chunk
            elif mask.kind == "sliding_window":
                ci, cj = i // mask.chunk, j // mask.chunk
                ok = ci - mask.window < cj <= ci
            elif mask.kind == "token_window":
                ok = (mask.left is None or j >= i - mask.left) and (mask.right is None or j <= i + mask.right)
            else:
                ok = seg_of[i] == seg_of[j]
                if ok and mask.chunk is not None:
                    ok = (j - start_of[j]) // mask.chunk <= (i - start_of[i]) // mask.chunk
            out[i, j] = ok
    return out


def cases():
    """(mask, length) for every kind: chunks of 1, dividing or not, larger than the length; windows larger
    than the number of chunks; packed with and without chunk, one segment and several, segments of 1."""
    out = []
    for n in (1, 2, 7, 12):
        out += [(Mask.full(), n), (Mask.causal(), n)]
    for n in (1, 5, 12, 13):
        for chunk in (1, 2, 3, 5, 20):
            out.append((Mask.chunk_causal(chunk), n))
            for window in (1, 2, 3, 9):
                out.append((Mask.sliding_window(chunk, window), n))
    for lengths in ((6,), (2, 5, 1), (4, 4, 4), (1, 1, 3), (7, 2)):
        for chunk in (None, 1, 2, 3, 10):
            out.append((Mask.packed(lengths, chunk), sum(lengths)))
    for n in (1, 6, 13):
        for left, right in ((0, 0), (2, 0), (3, 1), (1, 4), (None, 2), (5, None), (20, 20)):
            out.append((Mask.token_window(left, right), n))
    return out


def test_dense_is_the_definition_and_key_range_widths_work_allowed_agree():
    g = torch.Generator().manual_seed(0)
    for mask, length in cases():
        want = brute(mask, length)
        dense = mask.dense(length)
        assert dense.dtype == torch.bool and torch.equal(dense, want), (mask, length)
        pos = torch.arange(length)
        lo, hi = mask.key_range(pos, length)
        assert lo.dtype == hi.dtype == torch.int64
        # one contiguous interval per query: exactly the keys lo <= j < hi are allowed
        interval = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
        assert torch.equal(interval, want), (mask, length)
        assert torch.equal(mask.widths(length), want.sum(1)), (mask, length)
        assert mask.work(length) == int(want.sum()) and isinstance(mask.work(length), int)
        # any query and key positions, in any order, repeats allowed
        q = torch.randint(0, length, (5,), generator=g)
        k = torch.randperm(length, generator=g)
        assert torch.equal(mask.allowed(q, k, length), want[q][:, k]), (mask, length)
        assert torch.equal(mask.allowed(q.tolist(), k.int(), length), want[q][:, k])  # lists and int32 too
        qlo, qhi = mask.key_range(q, length)
        assert torch.equal(qlo, lo[q]) and torch.equal(qhi, hi[q])


def test_video_shapes_work_closed_form():
    """21 frames of 1,560 tokens in chunks of 3 frames: 7 chunks, chunk c sees c + 1 chunks."""
    chunk, length = 3 * 1560, 21 * 1560
    assert Mask.chunk_causal(chunk).work(length) == chunk * chunk * sum(range(1, 8))
    assert Mask.causal().work(length) == length * (length + 1) // 2
    assert Mask.full().work(length) == length * length
    assert Mask.sliding_window(chunk, 2).work(length) == chunk * chunk * (1 + 2 * 6)
    assert Mask.packed([9360, 23400]).work(length) == 9360 ** 2 + 23400 ** 2


def test_value_semantics_and_one_class():
    assert cp.Mask is ps.AttentionMask
    assert Mask.packed([2, 3]) == Mask.packed((2, 3)) and hash(Mask.packed([2, 3])) == hash(Mask.packed((2, 3)))
    assert Mask.packed([2, 3]).lengths == (2, 3)
    assert Mask.chunk_causal(4) == Mask("chunk_causal", chunk=4) != Mask.chunk_causal(5)
    assert Mask.sliding_window(4, 2) != Mask.chunk_causal(4) and Mask.full() != Mask.causal()
    assert len({Mask.causal(), Mask.causal(), Mask.full()}) == 2
    assert pickle.loads(pickle.dumps(Mask.packed([2, 3], 2))) == Mask.packed([2, 3], 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Mask.causal().kind = "full"
    assert Mask.causal().is_causal_like and Mask.packed([3], 1).is_causal_like
    assert not Mask.full().is_causal_like and not Mask.packed([3]).is_causal_like
    assert Mask.packed([2, 3]).segment_bounds(5) == (0, 2, 5) and Mask.causal().segment_bounds(5) == (0, 5)
    # Transformer Engine's window_size=(left, right), -1 as None: one value per mask
    assert Mask.token_window(None, 0) == Mask.causal() and Mask.token_window(None, None) == Mask.full()
    assert Mask.token_window(3, 0).is_causal_like and not Mask.token_window(3, 1).is_causal_like
    assert Mask.token_window(2, 1) == Mask("token_window", left=2, right=1) != Mask.token_window(1, 2)


def test_text_form_round_trips():
    masks = [Mask.full(), Mask.causal(), Mask.chunk_causal(4680), Mask.sliding_window(1560, 4),
             Mask.packed([9360, 23400]), Mask.packed([3, 4, 5], 2), Mask.token_window(128, 0),
             Mask.token_window(None, 4), Mask.token_window(3, None)]
    for mask in masks:
        assert Mask.parse(str(mask)) == mask
    assert str(Mask.packed([3, 4], 2)) == "packed:3+4,2"
    assert str(Mask.token_window(None, 4)) == "token_window:-1,4"
    assert Mask.parse("token_window:-1,0") == Mask.causal()
    assert Mask.parse("chunk_causal:3f", frame_tokens=1560) == Mask.chunk_causal(4680)
    assert Mask.parse("sliding_window:1f,4", frame_tokens=1560) == Mask.sliding_window(1560, 4)
    assert Mask.parse(" packed: 7f + 14f , 3f", frame_tokens=1560) == Mask.packed([10920, 21840], 4680)
    for bad, fragment in (("chunk_causal", "takes 1 value"), ("causal:3", "takes 0 value"), ("banded:3", "use full"),
                          ("chunk_causal:x", "'x' is not an integer"), ("chunk_causal:3f", "counts frames"),
                          ("sliding_window:4,2f", "'2f' is not an integer"), ("packed:", "use full"),
                          ("chunk_causal:0", "chunk must be >= 1")):
        with pytest.raises(ps.ParallelStateValueError, match=fragment):
            Mask.parse(bad)
    with pytest.raises(ps.ParallelStateTypeError):
        Mask.parse(3)


@pytest.mark.parametrize("make, exc, fragments", [
    (lambda: Mask.chunk_causal(0), ValueError, ["chunk must be >= 1, got 0"]),
    (lambda: Mask.chunk_causal(-3), ValueError, ["chunk must be >= 1, got -3"]),
    (lambda: Mask.chunk_causal(2.5), TypeError, ["chunk must be an int", "2.5"]),
    (lambda: Mask.chunk_causal(True), TypeError, ["chunk must be an int", "True"]),
    (lambda: Mask.chunk_causal(None), TypeError, ["chunk must be an int"]),
    (lambda: Mask.sliding_window(4, 0), ValueError, ["window must be >= 1, got 0"]),
    (lambda: Mask.sliding_window(0, 2), ValueError, ["chunk must be >= 1, got 0"]),
    (lambda: Mask.sliding_window(4, "2"), TypeError, ["window must be an int"]),
    (lambda: Mask.packed([]), ValueError, ["lengths is empty", "pass the length of every segment"]),
    (lambda: Mask.packed([3, 0, 2]), ValueError, ["lengths[1] must be >= 1, got 0"]),
    (lambda: Mask.packed([3, 2.0]), TypeError, ["lengths[1] must be an int"]),
    (lambda: Mask.packed(5), TypeError, ["lengths must be a sequence"]),
    (lambda: Mask.packed("34"), TypeError, ["lengths must be a sequence"]),
    (lambda: Mask.packed([3], chunk=0), ValueError, ["chunk must be >= 1"]),
    (lambda: Mask.token_window(-2, 0), ValueError, ["left must be >= 0 tokens or None (unbounded), got -2"]),
    (lambda: Mask.token_window(2, 1.5), TypeError, ["right must be an int"]),
    (lambda: Mask("token_window", right=0), ValueError, ["is AttentionMask.causal()", "token_window(left, right)"]),
    (lambda: Mask("token_window", left=2, chunk=4), ValueError, ["a token_window mask takes no chunk"]),
    (lambda: Mask("banded"), ValueError, ["unknown kind 'banded'"]),
    (lambda: Mask("causal", chunk=3), ValueError, ["a causal mask takes no chunk"]),
    (lambda: Mask("full", lengths=(3,)), ValueError, ["a full mask takes no lengths"]),
])
def test_bad_masks_raise_clear_errors(make, exc, fragments):
    with pytest.raises(exc) as info:
        make()
    assert isinstance(info.value, ps.ParallelStateError)  # ParallelStateValueError / ParallelStateTypeError
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_lengths_and_positions_raise():
    packed = Mask.packed([3, 4])
    with pytest.raises(ps.ParallelStateValueError, match="segments add up to 7 tokens but the sequence has 8"):
        packed.dense(8)
    with pytest.raises(ps.ParallelStateValueError, match="segments add up to 7"):
        packed.work(6)
    with pytest.raises(ps.ParallelStateValueError, match="length must be >= 1"):
        Mask.causal().check_length(0)
    with pytest.raises(ps.ParallelStateTypeError, match="length must be an int"):
        Mask.causal().work(4.0)
    with pytest.raises(ps.ParallelStateTypeError, match="length must be an int"):
        Mask.causal().work(True)
    assert Mask.causal().check_length(torch.tensor(5)) == 5
    with pytest.raises(ps.ParallelStateValueError, match=r"positions must lie in \[0, 5\), got values from 0 to 5"):
        Mask.causal().key_range(torch.arange(6), 5)
    with pytest.raises(ps.ParallelStateValueError, match=r"k_positions must lie in \[0, 5\)"):
        Mask.causal().allowed(torch.arange(5), torch.tensor([-1]), 5)
    with pytest.raises(ps.ParallelStateTypeError, match="1-D integer tensor, got 2-D"):
        Mask.causal().key_range(torch.zeros(2, 2, dtype=torch.int64), 5)
    with pytest.raises(ps.ParallelStateTypeError, match="1-D integer tensor, got 1-D torch.float32"):
        Mask.causal().key_range(torch.zeros(2), 5)
    lo, hi = Mask.causal().key_range(torch.tensor([], dtype=torch.int64), 5)
    assert lo.numel() == hi.numel() == 0
