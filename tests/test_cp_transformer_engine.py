"""``cp.transformer_engine.DotProductAttention`` through Transformer Engine's calling conventions, on real gloo ranks.

Cosmos-Predict2's attention block exactly as it builds and calls TE's class (its split: contiguous frames), and
TE's own CP test's conventions (``tests/pytorch/attention/run_attention_with_cp.py`` at TE v2.18: DualChunkSwap
shards, the global ``cu_seqlens`` / ``cu_seqlens_padded`` for thd, ``set_context_parallel_group(group, ranks,
stream, comm_type)``, ``[a2a group, p2p group]`` for a2a+p2p): forward and q, k, v gradients equal one process's
attention under the dense mask (float64 to 1e-10, float32 to 1e-5 relative) on 2 and 4 ranks, for sbhd / bshd /
thd, no_mask / causal / windows / padding, GQA, MLA, every comm type and CP switched off; bad inputs, and a rank
departing from a call the others repeat, raise on every rank in the engine call's one check (``cp.call_check``)
and before any K/V moves; a repeated call runs the engine call's collectives and nothing more; the signatures
equal TE's (extracted from its source by ``te_signatures.py``).
"""

from __future__ import annotations

import inspect
import json
import os

import torch

import cp
from cp.transformer_engine import EXTRA_PARAMETERS, TE_RELEASE, DotProductAttention
from cpgroups import data as _data
from cpgroups import raises, spying
from rankpool import scaled

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"te_dot_product_attention_{TE_RELEASE}.json")

# ---------------------------------------------------------------- the reference: one process, the dense mask


def _attend(q, k, v, allowed, scale):
    """Plain attention of q [T, H, D] to k, v [T, Hkv, D(v)] where ``allowed`` [T, T]; a row that sees nothing is 0."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _reference(fmt, q, k, v, allowed, scale, dout):
    """One process in float64: the output ``[.., h * dv]`` and the gradients of ``sum(out * dout)``."""
    ins = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    if fmt == "thd":
        out = _attend(*ins, allowed, scale)
    else:
        b = 1 if fmt == "sbhd" else 0
        out = torch.stack([_attend(*(t.select(b, i) for t in ins), allowed, scale) for i in range(q.shape[b])], b)
    out = out.flatten(-2)
    (out * dout.double()).sum().backward()
    return out.detach(), [t.grad for t in ins]


def _dual_chunk_swap(bounds, n, r):
    """TE's layout, written independently of cp: each sequence [a, b) in 2n chunks, rank r holding r and 2n-1-r."""
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        c = (b - a) // (2 * n)
        parts += [torch.arange(a + r * c, a + (r + 1) * c), torch.arange(a + (2 * n - 1 - r) * c, a + (2 * n - r) * c)]
    return torch.cat(parts)


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


#: The keywords TE's CP test passes to every forward (no bias, no FP8), beside cu_seqlens.
TE_TEST_KWARGS = {"core_attention_bias_type": "no_bias", "core_attention_bias": None, "fp8_output": False}


def _check(fmt, dpa, q, k, v, allowed, index, tol, kv_index=None, **kwargs):
    """dpa on this rank's tokens ``index`` of q (``kv_index`` of k and v, default the same; of the whole sequences)
    equals one process; the worst error."""
    s = 1 if fmt == "bshd" else 0
    indices = (index, index if kv_index is None else kv_index, index if kv_index is None else kv_index)
    dout = _data(q.shape[:-2] + (q.shape[-2] * v.shape[-1],), 99, q.dtype)
    want, grads = _reference(fmt, q, k, v, allowed, dpa.softmax_scale, dout)
    mine = [t.index_select(s, i).requires_grad_(True) for t, i in zip((q, k, v), indices, strict=True)]
    out = dpa(*mine, **kwargs)
    (out * dout.index_select(s, index)).sum().backward()
    assert out.dtype == q.dtype and out.shape == want.index_select(s, index).shape, (out.shape, want.shape)
    errs = [_rel(out, want.index_select(s, index))]
    errs += [_rel(m.grad, g.index_select(s, i)) for m, g, i in zip(mine, grads, indices, strict=True)]
    assert max(errs) <= tol, (fmt, dpa.attn_mask_type, dpa.window_size, dpa.cp_comm_type, errs)
    return max(errs), out, mine


# ---------------------------------------------------------------- sbhd / bshd: TE's CP test, every comm type


def _groups(n):
    """TE's CP test's groups, made as it makes them: the world for p2p, all_gather and a2a, and for a2a+p2p this
    rank's [a2a group, p2p group] of the sub-groups (consecutive pairs, and every second rank)."""
    import torch.distributed as dist

    me = dist.get_rank()
    made, subs = [], []
    for ranks in [range(i * 2, (i + 1) * 2) for i in range(n // 2)] + [range(i, n, 2) for i in range(2)]:
        made.append(dist.new_group(ranks))  # every rank makes every group, as torch wants
        if me in ranks:
            subs.append(made[-1])
    return {"world": dist.group.WORLD, "a2a+p2p": subs, "made": made}


def _destroy(groups):
    """The pool's ranks outlive a case: free the groups it made."""
    import torch.distributed as dist

    for group in groups["made"]:
        dist.destroy_process_group(group)


#: (qkv_format, attn_mask_type, window_size, heads, kv heads, (dk, dv), dtype): GQA, MLA, windows, both dtypes.
SHAPED = [
    ("sbhd", "causal", None, 4, 4, (8, 8), torch.float64),
    ("bshd", "causal", None, 4, 2, (8, 8), torch.float64),
    ("bshd", "no_mask", None, 4, 1, (8, 8), torch.float32),
    ("sbhd", "no_mask", (2, 3), 4, 2, (8, 8), torch.float64),
    ("bshd", "causal", (3, 0), 4, 4, (8, 8), torch.float64),
    ("sbhd", "causal", None, 4, 2, (8, 6), torch.float64),     # MLA: kv_channels=(dk, dv)
    ("bshd", "causal_bottom_right", None, 4, 4, (8, 8), torch.float32),
    ("sbhd", "no_mask", None, 4, 4, (8, 6), torch.float32),
]
COMMS = ["p2p", "all_gather", "a2a", "a2a+p2p"]


def case_formats():
    """sbhd / bshd on TE's layout, every SHAPED case with every comm type the group size has."""
    import torch.distributed as dist

    n, me = dist.get_world_size(), dist.get_rank()
    groups = _groups(n)
    seq, batch = 4 * n, 2
    done, worst = [], {torch.float64: 0.0, torch.float32: 0.0}
    for c, (fmt, mask_type, window, heads, kv_heads, (dk, dv), dtype) in enumerate(SHAPED):
        for comm in COMMS:
            shape = (seq, batch) if fmt == "sbhd" else (batch, seq)
            q = _data(shape + (heads, dk), 10 * c, dtype)
            k = _data(shape + (kv_heads, dk), 10 * c + 1, dtype)
            v = _data(shape + (kv_heads, dv), 10 * c + 2, dtype)
            dpa = DotProductAttention(heads, (dk, dv), num_gqa_groups=kv_heads, qkv_format=fmt,
                                      attn_mask_type=mask_type, window_size=window)
            left, right = (None if w < 0 else w for w in dpa.window_size)
            allowed = cp.Mask.token_window(left, right).dense(seq)
            dpa.set_context_parallel_group(groups["a2a+p2p" if comm == "a2a+p2p" else "world"], range(n), None, comm)
            tol = 1e-10 if dtype == torch.float64 else 1e-5
            err, _, _ = _check(fmt, dpa, q, k, v, allowed, _dual_chunk_swap((0, seq), n, me), tol, **TE_TEST_KWARGS,
                               cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                               cu_seqlens_kv_padded=None, pad_between_seqs=None)
            worst[dtype] = max(worst[dtype], err)
            done.append((fmt, mask_type, window, comm))
    _destroy(groups)
    return len(done), worst[torch.float64], worst[torch.float32]


# ---------------------------------------------------------------- thd: packed sequences, padded and not


def _thd(lengths, rooms, heads, kv_heads, seed):
    """A packed batch: q, k, v [t, h, d] over the padded rooms, cu_seqlens (real) and cu_seqlens_padded (int32)."""
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    padded = torch.tensor([0] + [sum(rooms[:i + 1]) for i in range(len(rooms))], dtype=torch.int32)
    total = int(padded[-1])
    q, k, v = (_data((total, h, 8), seed + i) for i, h in enumerate((heads, kv_heads, kv_heads)))
    return q, k, v, cu, padded


def _thd_allowed(cu, padded, causal):
    """The dense mask: a real token sees the real tokens of its own sequence (causally); padding sees nothing."""
    total = int(padded[-1])
    seq = torch.full((total,), -1)
    for i in range(len(cu) - 1):
        start = int(padded[i])
        seq[start:start + int(cu[i + 1] - cu[i])] = i
    pos = torch.arange(total)
    allowed = (seq[:, None] == seq[None, :]) & (seq[:, None] >= 0)
    return allowed & (pos[None, :] <= pos[:, None]) if causal else allowed


def case_thd():
    """thd with the global cu_seqlens and cu_seqlens_padded, per-sequence DualChunkSwap, every comm type: output and
    gradients equal one process's and are exactly 0 at padding; unpadded packs (cu_seqlens == cu_seqlens_padded)."""
    import torch.distributed as dist

    n, me = dist.get_world_size(), dist.get_rank()
    groups = _groups(n)
    unit = 2 * n
    # (real lengths, padded rooms): padding inside sequences, a sequence of padding only, a pack without padding
    packs = [([3 * unit - 3, unit, 2 * unit - 1], [3 * unit, unit, 2 * unit]),
             ([unit, 0, 2 * unit - 2], [unit, unit, 2 * unit]),
             ([2 * unit, unit], [2 * unit, unit])]
    done, worst = 0, 0.0
    for c, (lengths, rooms) in enumerate(packs):
        for mask_type in ("padding_causal", "padding"):
            for comm in COMMS:
                q, k, v, cu, padded = _thd(lengths, rooms, 4, 2, 100 * c)
                dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type=mask_type)
                dpa.set_context_parallel_group(groups["a2a+p2p" if comm == "a2a+p2p" else "world"], range(n), None,
                                               comm)
                allowed = _thd_allowed(cu, padded, "causal" in mask_type)
                index = _dual_chunk_swap(padded.tolist(), n, me)
                err, out, mine = _check("thd", dpa, q, k, v, allowed, index, 1e-10, **TE_TEST_KWARGS, cu_seqlens_q=cu,
                                        cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                                        pad_between_seqs=lengths != rooms)
                pad = ~allowed.any(1)[index]  # this rank's padding tokens: output and every gradient exactly 0
                assert not out[pad].any() and not any(t.grad[pad].any() for t in mine)
                worst = max(worst, err)
                done += 1
    # A static-size batch: 3 tokens after the last sequence on every rank (TE's tail) attend nothing and are 0.
    q, k, v, cu, padded = _thd(*packs[0], 4, 2, 7)
    index = _dual_chunk_swap(padded.tolist(), n, me)
    mine = [torch.cat([t[index], _data((3,) + t.shape[1:], 5)]).requires_grad_(True) for t in (q, k, v)]
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal",
                              cp_group=groups["world"])
    out = dpa(*mine, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    out.sum().backward()
    want, _ = _reference("thd", q, k, v, _thd_allowed(cu, padded, True), dpa.softmax_scale, torch.zeros(1))
    assert _rel(out[:-3], want[index]) <= 1e-10 and not out[-3:].any() and not any(t.grad[-3:].any() for t in mine)
    _destroy(groups)
    return done, worst


# ---------------------------------------------------------------- cross attention: video queries to text keys


def _cross_allowed(cu_q, pad_q, cu_kv, pad_kv):
    """The dense [q tokens, k tokens] mask of a thd cross attention: a real query sees every real key of its sample."""
    def samples(cu, padded, dead):
        seq = torch.full((int(padded[-1]),), dead)
        for i in range(len(cu) - 1):
            seq[int(padded[i]):int(padded[i]) + int(cu[i + 1] - cu[i])] = i
        return seq
    return samples(cu_q, pad_q, -1)[:, None] == samples(cu_kv, pad_kv, -2)[None, :]


def case_cross():
    """Cross attention as DFM's Wan / DiT layers call TE's class: thd packs whose text (k, v) has its own cu_seqlens,
    each side split by DualChunkSwap over its own padded cu_seqlens, and bshd / sbhd whose text is split
    contiguously (q DualChunkSwap), every comm type and GQA; each query sees every key of its sample, output and
    gradients (q's and the text's) equal one process's, 0 at padding. On a group of one and with cp_group None,
    the plain path on whole sequences."""
    import torch.distributed as dist

    n, me = dist.get_world_size(), dist.get_rank()
    groups = _groups(n)
    unit = 2 * n
    # video (real, padded) and text (real, padded) lengths per sample: a sample with padded text, one without
    video = ([3 * unit - 1, 2 * unit], [3 * unit, 2 * unit])
    text = ([unit - 1, 2], [unit, unit])
    q, _, _, cu_q, pad_q = _thd(*video, 4, 2, 200)
    _, k, v, cu_kv, pad_kv = _thd(*text, 4, 2, 300)
    allowed = _cross_allowed(cu_q, pad_q, cu_kv, pad_kv)
    thd = {"cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_kv, "cu_seqlens_q_padded": pad_q, "cu_seqlens_kv_padded": pad_kv}
    iq, ikv = _dual_chunk_swap(pad_q.tolist(), n, me), _dual_chunk_swap(pad_kv.tolist(), n, me)
    done, worst = 0, 0.0
    for comm in COMMS:
        for fmt in ("thd", "bshd", "sbhd"):
            dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format=fmt, attention_type="cross",
                                      attn_mask_type="padding" if fmt == "thd" else "no_mask")
            dpa.set_context_parallel_group(groups["a2a+p2p" if comm == "a2a+p2p" else "world"], range(n), None, comm)
            if fmt == "thd":
                err, out, mine = _check("thd", dpa, q, k, v, allowed, iq, 1e-10, ikv, **TE_TEST_KWARGS, **thd)
                pad = ~allowed.any(1)[iq]
                assert not out[pad].any() and not mine[0].grad[pad].any()
                assert not any(t.grad[~allowed.any(0)[ikv]].any() for t in mine[1:])  # the text's padding
            else:
                seq, ctx = 4 * n, 3 * n
                shape = (2, seq) if fmt == "bshd" else (seq, 2)
                text_shape = (2, ctx) if fmt == "bshd" else (ctx, 2)
                xq = _data(shape + (4, 8), 400)
                xk, xv = (_data(text_shape + (2, 8), 401 + i) for i in range(2))
                err, _, _ = _check(fmt, dpa, xq, xk, xv, torch.ones(seq, ctx, dtype=torch.bool),
                                   _dual_chunk_swap((0, seq), n, me), 1e-10,
                                   torch.arange(me * ctx // n, (me + 1) * ctx // n), **TE_TEST_KWARGS)
            worst, done = max(worst, err), done + 1
    # context parallelism off (cp_group None, and a group of one): whole sequences, the plain path
    one = dist.new_group([me], use_local_synchronization=True)
    for group in (None, one):
        dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding", cp_group=group)
        err, _, _ = _check("thd", dpa, q, k, v, allowed, torch.arange(len(q)), 1e-10, torch.arange(len(k)), **thd)
        worst, done = max(worst, err), done + 1
    dist.destroy_process_group(one)
    _destroy(groups)
    return done, worst


# ---------------------------------------------------------------- CP switched off; a mask of ours


def case_cp_off_and_masks():
    """(None, None, None) and a group of one are plain attention, on any length (thd without padded cu_seqlens
    too); ``mask=`` (any cp.Mask) beyond TE's mask types, under CP."""
    import torch.distributed as dist

    n, me = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(n)]
    one = singles[me]
    worst = 0.0
    for group in (None, one):
        for fmt, mask_type, seq in (("sbhd", "causal", 7), ("bshd", "no_mask", 5), ("bshd", "causal", 9)):
            shape = (seq, 2) if fmt == "sbhd" else (2, seq)
            q, k, v = (_data(shape + (4, 8), i) for i in range(3))
            dpa = DotProductAttention(4, 8, qkv_format=fmt, attn_mask_type=mask_type)
            dpa.set_context_parallel_group(group, None if group is None else [me], None)
            allowed = (cp.Mask.causal() if mask_type == "causal" else cp.Mask.full()).dense(seq)
            worst = max(worst, _check(fmt, dpa, q, k, v, allowed, torch.arange(seq), 1e-10)[0])
        q, k, v, cu, padded = _thd([3, 5], [4, 5], 4, 4, 7)  # odd rooms: fine without CP
        dpa = DotProductAttention(4, 8, qkv_format="thd", attn_mask_type="padding_causal", cp_group=group)
        allowed = _thd_allowed(cu, padded, True)
        worst = max(worst, _check("thd", dpa, q, k, v, allowed, torch.arange(9), 1e-10, cu_seqlens_q=cu,
                                  cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)[0])
    # Beyond TE: a chunk-causal mask (MAGI-1's) through mask=, on TE's layout, p2p and a2a.
    seq = 6 * n
    mask = cp.Mask.chunk_causal(3)
    for comm in ("p2p", "a2a"):
        q, k, v = (_data((2, seq, 4, 8), 20 + i) for i in range(3))
        dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal", cp_group=dist.group.WORLD,
                                  cp_global_ranks=list(range(n)), cp_comm_type=comm, mask=mask)
        worst = max(worst, _check("bshd", dpa, q, k, v, mask.dense(seq), _dual_chunk_swap((0, seq), n, me), 1e-10)[0])
    for g in singles:
        dist.destroy_process_group(g)
    return worst


# ---------------------------------------------------------------- Cosmos-Predict2's attention block


class _CosmosAttention(torch.nn.Module):
    """Cosmos-Predict2's ``Attention`` (cosmos_predict2/models/text2image_dit.py) as it uses TE: projections,
    ``b s (h d) -> b s h d``, ``DotProductAttention(n_heads, head_dim, num_gqa_groups=n_heads, attention_dropout=0,
    qkv_format="bshd", attn_mask_type="no_mask")``, the output projection; self attention when context_dim is None."""

    def __init__(self, query_dim, context_dim, n_heads, head_dim):
        super().__init__()
        context_dim = query_dim if context_dim is None else context_dim
        inner = n_heads * head_dim
        self.n_heads, self.head_dim = n_heads, head_dim
        self.q_proj = torch.nn.Linear(query_dim, inner, bias=False, dtype=torch.float64)
        self.k_proj = torch.nn.Linear(context_dim, inner, bias=False, dtype=torch.float64)
        self.v_proj = torch.nn.Linear(context_dim, inner, bias=False, dtype=torch.float64)
        self.output_proj = torch.nn.Linear(inner, query_dim, bias=False, dtype=torch.float64)
        self.attn_op = DotProductAttention(self.n_heads, self.head_dim, num_gqa_groups=self.n_heads,
                                           attention_dropout=0, qkv_format="bshd", attn_mask_type="no_mask")

    def forward(self, x, context=None):
        context = x if context is None else context
        q, k, v = (p(t).unflatten(-1, (self.n_heads, self.head_dim))
                   for p, t in ((self.q_proj, x), (self.k_proj, context), (self.v_proj, context)))
        return self.output_proj(self.attn_op(q, k, v))

    def set_context_parallel_group(self, process_group, ranks, stream):
        self.attn_op.set_context_parallel_group(process_group, ranks, stream)


class _CosmosBlock(torch.nn.Module):
    """Self attention (context-parallel) then cross attention to the text (not), as Cosmos's ``Block``."""

    def __init__(self, channels, dim, text_dim, heads):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.x_embedder = torch.nn.Linear(channels, dim, bias=False, dtype=torch.float64)
        self.self_attn = _CosmosAttention(dim, None, heads, dim // heads)
        self.cross_attn = _CosmosAttention(dim, text_dim, heads, dim // heads)

    def forward(self, x_b_c_t_h_w, text):
        x_b_t_h_w_d = self.x_embedder(x_b_c_t_h_w.permute(0, 2, 3, 4, 1))  # the patch embedding, 1x1x1 patches
        b, t, h, w, d = x_b_t_h_w_d.shape
        x = x_b_t_h_w_d.reshape(b, t * h * w, d)  # "b t h w d -> b (t h w) d"
        x = x + self.self_attn(x)
        x = x + self.cross_attn(x, text)
        return x.reshape(b, t, h, w, d).permute(0, 4, 1, 2, 3)


def case_cosmos():
    """Cosmos's own calls: enable_context_parallel sets the group on every block's self attention
    (``set_context_parallel_group(process_group, ranks, stream)``, here stream=None on a CPU), the video is split
    contiguously along T (``split_inputs_cp(x, seq_dim=2)``), cross attention keeps no group; the output and every
    gradient (input and, summed over the group, weights) equal one process's."""
    import torch.distributed as dist

    group, n = dist.group.WORLD, dist.get_world_size()
    block = _CosmosBlock(16, 32, 12, 4)
    video = _data((1, 16, 2 * n, 2, 3), 1)  # the latent [B, C, T, H, W]: 2 frames per rank
    text = _data((1, 7, 12), 2)
    whole = video.clone().requires_grad_(True)
    want = block(whole, text)
    want.sum().backward()
    ref = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad()
    block.self_attn.set_context_parallel_group(group, dist.get_process_group_ranks(group), None)
    mine = cp.split_inputs_cp(video, 2, group).clone().requires_grad_(True)
    out = block(mine, text)
    out.sum().backward()
    errs = [_rel(out, cp.split_inputs_cp(want.detach(), 2, group)),
            _rel(mine.grad, cp.split_inputs_cp(whole.grad, 2, group))]
    for name, p in block.named_parameters():
        dist.all_reduce(p.grad, group=group)  # the data x context-parallel gradient all-reduce
        errs.append(_rel(p.grad, ref[name]))
    assert max(errs) <= 1e-10, errs
    block.self_attn.set_context_parallel_group(None, None, None)  # Cosmos's disable_context_parallel
    assert _rel(block(whole.detach(), text), want.detach()) <= 1e-12
    return max(errs)


# ---------------------------------------------------------------- errors: on every rank, before any collective


def case_errors():
    """Every bad input raises the same ValueError on every rank, naming what to change, in the engine call's check
    (its round, then the full check's: cp.call_check) and before any K/V moves; ranks that disagree all raise;
    nothing is left half-built (the next good call is exact)."""
    import torch.distributed as dist

    g, me = dist.group.WORLD, dist.get_rank()
    ranks = list(range(dist.get_world_size()))

    def dpa(**kwargs):
        module = DotProductAttention(4, 8, **{"qkv_format": "bshd", **kwargs})
        module.set_context_parallel_group(g, ranks, None, kwargs.pop("cp_comm_type", "p2p"))
        return module

    x = _data((1, 8, 4, 8), 1)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    thd = _data((8, 4, 8), 2)
    cases = [  # (fragments, module, q, k, v, forward keywords): every rank passes the same
        (["has 6 tokens, not a multiple of 2 * cp_size = 4", "pad every sequence"], dpa(), x[:, :3], x[:, :3],
         x[:, :3], {}),
        (["needs cu_seqlens_q_padded and cu_seqlens_kv_padded"], dpa(qkv_format="thd", attn_mask_type="padding"),
         thd, thd, thd, {"cu_seqlens_q": cu, "cu_seqlens_kv": cu}),
        (["scatters heads over 2 ranks, but q has 3 heads", "cp_comm_type='p2p'"],
         DotProductAttention(3, 8, qkv_format="bshd", cp_group=g, cp_comm_type="a2a"), x[:, :, :3], x[:, :, :3],
         x[:, :, :3], {}),
        (["attention_dropout=0.1", "or call .eval()"], dpa(attention_dropout=0.1), x, x, x, {}),
        (["core_attention_bias_type='post_scale_bias'", "core_attention_bias="], dpa(), x, x, x,
         {"core_attention_bias_type": "post_scale_bias", "core_attention_bias": torch.zeros(1, 4, 16, 16)}),
        (["window_size=(2, 0) with qkv_format='thd' is not supported"],
         dpa(qkv_format="thd", attn_mask_type="padding_causal", window_size=(2, 0)), thd, thd, thd,
         {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu}),
        (["attn_mask_type='padding' with qkv_format='bshd'", "qkv_format='thd'"], dpa(attn_mask_type="padding"), x,
         x, x, {}),
        (["attn_mask_type='arbitrary'", "mask=cp.Mask"], dpa(attn_mask_type="arbitrary"), x, x, x, {}),
        # cross attention: a mask it cannot take, a mask of ours, k and v that disagree, text cu_seqlens that do not
        # cover k's tokens
        (["cross attention here lets every query see every key of its sample", "attn_mask_type='no_mask'",
          "got 'causal'"], dpa(), x, x[:, :4], x[:, :4], {}),
        (["applies to self attention only", "build the cross attention without mask="],
         dpa(mask=cp.Mask.causal(), attention_type="cross"), x, x[:, :4], x[:, :4], {}),
        (["keys (1, 4, 4, 8) and values (1, 2, 4, 8) must have the same"], dpa(attention_type="cross"), x, x[:, :4],
         x[:, :2], {}),
        (["k holds 4 tokens but the padded sequences hold 16 over 2 rank(s), 8 each"],
         dpa(qkv_format="thd", attn_mask_type="padding", attention_type="cross"), thd, thd[:4], thd[:4],
         {"cu_seqlens_q": cu, "cu_seqlens_kv": cu // 2, "cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu}),
        (["must have num_gqa_groups / tp_size = 4 heads, found 2"], dpa(), x, x[:, :, :2], x[:, :, :2], {}),
    ]
    found = 0
    for fragments, module, q, k, v, kwargs in cases:
        calls = []
        with spying(lambda name, args, kw, calls=calls: calls.append(name)):
            msg = raises(ValueError, ["on every rank of the cp group", *fragments], module, q, k, v, **kwargs)
        # The call's check (cp.call_check): its round of two ints a rank, then the full check's; nothing else.
        assert calls == ["all_to_all_single"] * 2, (msg, calls)
        found += 1
    # Set-up mistakes raise at once, where they are made (no communication).
    raises(ValueError, ["unsupported communication type cp_comm_type='ring'", "'a2a+p2p'"],
           DotProductAttention(4, 8).set_context_parallel_group, g, ranks, None, "ring")
    raises(ValueError, ["a list of groups is for cp_comm_type='a2a+p2p'"], DotProductAttention, 4, 8,
           cp_group=[g, g])
    raises(ValueError, ["cp_comm_type='a2a+p2p' needs cp_group=[a2a group, p2p group]"], DotProductAttention, 4, 8,
           cp_group=g, cp_comm_type="a2a+p2p")
    raises(ValueError, ["num_attention_heads=6 must be divisible by num_gqa_groups=4"], DotProductAttention, 6, 8,
           num_gqa_groups=4)
    raises(ValueError, ["softmax_type='off-by-one'", "'vanilla'"], DotProductAttention, 4, 8,
           softmax_type="off-by-one")
    found += 5
    # Ranks that disagree: another comm type, another mask, a bad shape on one rank only.
    for fragments, kwargs, shape in (
            (["ranks call attention differently", "cp_comm_type"], {"cp_comm_type": "a2a" if me else "p2p"}, 8),
            (["ranks call attention differently", "attention mask"], {"attn_mask_type": "causal" if me else
                                                                       "no_mask"}, 8),
            ([f"group rank 1 (global {ranks[1]}): ", "not a multiple of 2 * cp_size"], {}, 7 if me == 1 else 8)):
        y = _data((1, shape, 4, 8), 3)
        raises(ValueError, fragments, dpa(**kwargs), y, y, y)
        found += 1
    # A text laid out otherwise on one rank (cross attention): every rank raises before the keys are gathered.
    for fragments, text, kw in (
            (["ranks call attention differently", "k shape"], x[:, :2 if me else 4], {}),
            (["ranks call attention differently", "cu_seqlens"], thd[:4],
             {"cu_seqlens_kv": torch.tensor([0, 3, 7] if me else [0, 4, 8])})):
        calls = []
        fmt = "thd" if kw else "bshd"
        module = dpa(qkv_format=fmt, attn_mask_type="padding" if kw else "no_mask", attention_type="cross")
        q = thd if kw else x
        thd_kw = {"cu_seqlens_q": cu, "cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu // 2, **kw} if kw else {}
        with spying(lambda name, args, kw, calls=calls: calls.append(name)):
            raises(ValueError, fragments, module, q, text, text, **thd_kw)
        assert calls == ["all_to_all_single"] * 2, calls
        found += 1
    # Nothing half-built: the same modules' next good calls are exact; dropout is fine outside training.
    module = dpa(attention_dropout=0.1).eval()
    seq = 4 * len(ranks)
    q, k, v = (_data((1, seq, 4, 8), 10 + i) for i in range(3))
    _check("bshd", module, q, k, v, cp.Mask.causal().dense(seq), _dual_chunk_swap((0, seq), len(ranks), me), 1e-10)
    return found


# ---------------------------------------------------------------- one check per call: a rank departing from a cached call


def case_a_rank_departing_from_a_cached_call(group_timeout_s):
    """After a warm-up call resolved by the face and checked on every rank, one rank (cp rank 2) departs while the
    others repeat that call: another shape, comm type, mask, scale or cu_seqlens, or a bad input only it sees (a
    length not divisible by 2 cp, thd without cu_seqlens_padded, heads a2a cannot scatter, an unsupported option);
    on one cp group and on a2a+p2p's [a2a, p2p] groups.
    Every rank raises in the one round of the engine call's check (a group with a short timeout: no hang) and the
    warm-up call is exact again after each. gloo's path (every rank reads the round): every rank the same
    ValueError, naming what differs, or the rank and its reason (naming the fix). NCCL's path (forced on gloo): the
    departing rank names its own mistake, the others stop at the device-side assertion."""
    import datetime

    import torch.distributed as dist

    import cp.call_check

    n, me = dist.get_world_size(), dist.get_rank()
    assert n == 4
    odd = 2
    ranks = list(range(n))
    timeout = datetime.timedelta(seconds=group_timeout_s)
    g = dist.new_group(ranks, timeout=timeout)
    # a2a+p2p: [a2a group, p2p group] as TE's CP test makes them (cp rank = p2p rank x 2 + a2a rank: global rank)
    made = [dist.new_group(members, timeout=timeout) for members in ([0, 1], [2, 3], [0, 2], [1, 3])]
    hierarchical = [made[me // 2], made[2 + me % 2]]
    seq = 4 * n
    bshd = _data((1, 2 * seq, 4, 8), 1)
    mine, longer = (bshd[:, :length].index_select(1, _dual_chunk_swap((0, length), n, me)) for length in (seq, 2 * seq))
    odd_heads = _data((1, seq, 6, 8), 2).index_select(1, _dual_chunk_swap((0, seq), n, me))
    # thd: two packs of the same padded total (every rank the same token count), other sequence boundaries
    unit = 2 * n
    packs = [(torch.tensor(real, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32))
             for real, padded in (([0, unit, 2 * unit - 3], [0, unit, 2 * unit]), ([0, 2 * unit - 3], [0, 2 * unit]))]
    thd = _data((2 * unit, 4, 8), 3)
    packed = [thd.index_select(0, _dual_chunk_swap(padded.tolist(), n, me)) for _, padded in packs]

    def cu(i, padded=True):
        real, pad = packs[i]
        return {"cu_seqlens_q": real, "cu_seqlens_kv": real, **({"cu_seqlens_q_padded": pad,
                                                                  "cu_seqlens_kv_padded": pad} if padded else {})}

    def departing(nccl_path, comm):
        """Every departure on one path (NCCL's p2p posts no receive before the round, only gloo's does: its path
        runs all_gather); how many."""
        def dpa(heads=4, comm=comm, **kwargs):
            return DotProductAttention(heads, 8, **{"qkv_format": "bshd", **kwargs}, cp_group=g,
                                       cp_global_ranks=ranks, cp_comm_type=comm)

        base = dpa()
        packs_dpa = dpa(qkv_format="thd", attn_mask_type="padding_causal")
        usp = DotProductAttention(4, 8, qkv_format="bshd", cp_group=hierarchical, cp_global_ranks=ranks,
                                  cp_comm_type="a2a+p2p")
        repeat = {"bshd": lambda: base(mine, mine, mine), "thd": lambda: packs_dpa(*[packed[0]] * 3, **cu(0)),
                  "usp": lambda: usp(mine, mine, mine)}
        warm = {kind: call() for kind, call in repeat.items()}
        departures = [  # (the call the others repeat, what cp rank 2 calls instead, the message's fragments)
            ("bshd", lambda: base(longer, longer, longer), ["their q shape, k shape, v shape differ"]),
            ("bshd", lambda: dpa(comm="a2a")(mine, mine, mine), ["their cp_comm_type differ", "'a2a'"]),
            ("bshd", lambda: dpa(attn_mask_type="no_mask")(mine, mine, mine), ["their attention mask differ"]),
            ("bshd", lambda: dpa(softmax_scale=0.5)(mine, mine, mine), ["their softmax_scale differ", "0.5"]),
            ("thd", lambda: packs_dpa(*[packed[1]] * 3, **cu(1)), ["attention mask, cu_seqlens differ"]),
            ("usp", lambda: usp(longer, longer, longer), ["their q shape, k shape, v shape differ"]),
        ]
        refusals = [  # (the call the others repeat, cp rank 2's bad call, its reason's fragments, fix included)
            ("bshd", lambda: base(mine[:, :3], mine[:, :3], mine[:, :3]),
             ["has 12 tokens, not a multiple of 2 * cp_size = 8", "pad every sequence"]),
            ("thd", lambda: packs_dpa(*[packed[0]] * 3, **cu(0, padded=False)),
             ["needs cu_seqlens_q_padded and cu_seqlens_kv_padded", "pass cu_seqlens_q as cu_seqlens_q_padded"]),
            ("bshd", lambda: dpa(6, comm="a2a")(odd_heads, odd_heads, odd_heads),
             ["scatters heads over 4 ranks, but q has 6 heads", "or cp_comm_type='p2p'"]),
            ("bshd", lambda: base(mine, mine, mine, core_attention_bias_type="post_scale_bias",
                                  core_attention_bias=torch.zeros(2, 2)),
             ["core_attention_bias_type='post_scale_bias'", "core_attention_bias=<a tensor of shape (2, 2)>"]),
            ("usp", lambda: usp(mine[:, :3], mine[:, :3], mine[:, :3]),
             ["has 12 tokens, not a multiple of 2 * cp_size = 8", "pad every sequence"]),
        ]
        for kind, departure, fragments in departures + refusals:
            refused = (kind, departure, fragments) in refusals
            named = [f"cp rank {odd}: " if kind == "usp" else f"group rank {odd} (global {odd}): "] * refused
            if me == odd:  # on NCCL's path a departure names the ranks that repeated (it cannot say more)
                said = ["repeated a call checked before", "passed another"] if nccl_path and not refused else \
                    named * (not nccl_path) + fragments
                raises(ValueError, [WHAT_FORWARD] + said, departure)
            elif nccl_path:
                raises(RuntimeError, ["the ranks' calls differ", "PARALLEL_STATE_DEBUG=1"], repeat[kind])
            else:
                raises(ValueError, [WHAT_FORWARD] + named + fragments[:1], repeat[kind])
            # Nothing half done: the cached call is exact again, on every rank.
            assert torch.equal(repeat[kind](), warm[kind]), (kind, fragments)
        return len(departures + refusals)

    found = 0
    try:
        for nccl_path, comm in ((False, "p2p"), (True, "all_gather")):
            cp.call_check.reads_wait_everywhere = nccl_path
            found += departing(nccl_path, comm)
    finally:
        cp.call_check.reads_wait_everywhere = False
    for group in [g, *made]:
        dist.destroy_process_group(group)
    return found


WHAT_FORWARD = "DotProductAttention.forward: "


def case_rounds_of_a_repeated_call():
    """A repeated face call runs exactly the collectives of the engine call it makes with the same plan (a masked
    ring call: one round of two ints a rank before the K/V, and the backward's; Ulysses: that round and its
    all-to-alls), forward and backward; on NCCL's path (forced on gloo) it reads no round to the host; with
    PARALLEL_STATE_DEBUG=1 every call is checked in full."""
    import torch.distributed as dist

    import cp.agree
    import cp.call_check

    g = dist.group.WORLD
    n, me = g.size(), g.rank()
    seq = 4 * n
    x = _data((1, seq, 4, 8), 4)
    plan = cp.plan_dual_chunk_swap(cp.Mask.causal(), seq, n)
    mine = x.index_select(1, plan.index(me)).requires_grad_(True)
    seen: list = []

    def record(name, args, kwargs):
        seen.append((name, args[1].numel() // n) if name == "all_to_all_single" else name)

    def collectives(fn):
        fn()  # warm: resolved and checked in full once
        seen.clear()
        with spying(record):
            fn()
        return list(seen)

    face, engine = {}, {}
    scale = 8 ** -0.5  # the face's default: 1 / sqrt(kv_channels)
    plain = {"p2p": lambda: cp.ring_attention(mine, mine, mine, g, plan=plan, softmax_scale=scale),
             "a2a": lambda: cp.ulysses_attention(mine, mine, mine, g, plan=plan, scale=scale)}
    for comm in ("p2p", "a2a"):
        dpa = DotProductAttention(4, 8, qkv_format="bshd", cp_group=g, cp_global_ranks=list(range(n)),
                                  cp_comm_type=comm)
        face[comm] = collectives(lambda dpa=dpa: dpa(mine, mine, mine).sum().backward())
        engine[comm] = collectives(lambda comm=comm: plain[comm]().sum().backward())
        assert face[comm] == engine[comm], (comm, face[comm], engine[comm])
        assert face[comm].count(("all_to_all_single", 2)) == 1, face  # the check's one round (two ints a rank)
    # NCCL's path: the first call reads its rounds to the host (the check's and the full check's), a repeat none.
    reads = []
    real_table = cp.agree.Pending.table
    cp.agree.Pending.table = lambda self: (reads.append(1), real_table(self))[1]
    dpa = DotProductAttention(4, 8, qkv_format="bshd", cp_group=g, cp_comm_type="all_gather")
    try:
        cp.call_check.reads_wait_everywhere = True
        cp.call_check.clear()
        dpa(mine, mine, mine)
        first = len(reads)
        dpa(mine, mine, mine)
        assert first == 2 and len(reads) == first, (first, reads)
    finally:
        cp.call_check.reads_wait_everywhere = False
        cp.agree.Pending.table = real_table
    # Debug mode: every call checked in full (the round, then the full check's wider one).
    os.environ["PARALLEL_STATE_DEBUG"] = "1"
    try:
        for _ in range(2):
            seen.clear()
            with spying(record):
                dpa(mine, mine, mine)
            assert seen[0] == ("all_to_all_single", 2) and seen[1][0] == "all_to_all_single" and seen[1][1] > 2, seen
    finally:
        os.environ.pop("PARALLEL_STATE_DEBUG")
    return face


# ---------------------------------------------------------------- tests


def test_formats_and_comm_types_match_one_process_on_2_and_4_ranks(pools):
    for n in (2, 4):
        results = pools(n).run(case_formats, timeout=240)
        count = len(SHAPED) * len(COMMS)
        assert [r[0] for r in results] == [count] * n
        assert max(r[1] for r in results) <= 1e-10 and max(r[2] for r in results) <= 1e-5


def test_thd_padded_and_unpadded_match_one_process_with_zeros_at_padding(pools):
    for n in (2, 4):
        results = pools(n).run(case_thd, timeout=240)
        assert [r[0] for r in results] == [3 * 2 * len(COMMS)] * n
        assert max(r[1] for r in results) <= 1e-10


def test_cross_attention_to_text_split_over_the_ranks_equals_one_process(pools):
    for n in (2, 4):
        results = pools(n).run(case_cross, timeout=240)
        assert all(done == 14 and worst <= 1e-10 for done, worst in results), results


def test_cp_off_and_a_mask_of_ours(pools):
    assert max(pools(2).run(case_cp_off_and_masks, timeout=120)) <= 1e-10


def test_cosmos_predict2_block_with_context_parallel_equals_one_process(pools):
    for n in (2, 4):
        assert max(pools(n).run(case_cosmos, timeout=120)) <= 1e-10


def test_bad_inputs_raise_on_every_rank_before_any_transfer(pools):
    assert pools(2).run(case_errors, timeout=120) == [23, 23]


def test_a_rank_departing_from_a_cached_call_raises_on_every_rank_in_the_one_round(pools):
    assert pools(4).run(case_a_rank_departing_from_a_cached_call, scaled(20).total_seconds(), timeout=180) == [22] * 4


def test_a_repeated_call_runs_the_engine_calls_collectives_only(pools):
    results = pools(4).run(case_rounds_of_a_repeated_call, timeout=120)
    assert all(r == results[0] for r in results)  # every rank the same collectives


def test_signatures_equal_transformer_engines():
    """Constructor, set_context_parallel_group and forward: TE's names, kinds, order and defaults (from its source
    at TE_RELEASE, tests/data, made by tests/te_signatures.py), and after them only our keyword-only extras."""
    with open(DATA) as f:
        te = json.load(f)
    assert te["release"] == TE_RELEASE
    for method, want in te["methods"].items():
        params = list(inspect.signature(getattr(DotProductAttention, method)).parameters.values())[1:]  # self
        extras = [p for p in params if p.name in EXTRA_PARAMETERS]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras) and params[len(params) - len(extras):] \
            == extras, method
        got = [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
               for p in params if p.name not in EXTRA_PARAMETERS]
        assert got == want, (method, got, want)
