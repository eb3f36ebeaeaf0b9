"""A KV cache for autoregressive chunk-by-chunk generation, sharded over a context-parallel group.

An autoregressive video model denoises chunk c in several steps; at each step the chunk's queries
attend to the clean K/V of the kept earlier chunks and to the chunk's own K/V (full attention inside
the chunk); after the last step the chunk's K/V join the cache. ``KVCache`` keeps, on every rank, its
own split of every kept chunk (``cp.split_inputs_cp(chunk, seq_dim, group, uneven=True)``'s), so each
rank holds about 1/n of the cache and of every later chunk's attention work.

Move the queries, not the cache: a chunk's queries are few and the cache is long. ``attend``
all-gathers the chunk's queries (every rank's shard), attends all of them to this rank's cached and
new K/V with ``cp.kernels``' fused kernel (a partial output and its log-sum-exp per query, no mask:
every kept key is visible to every query of the chunk), and sends each query's partials to the rank
that owns it in one all-to-all; the owner merges the n partials by the online softmax
(``cp.online_softmax``). The bytes moved are the chunk's (its queries, then its outputs and
log-sum-exps in float32, float64 for float64), never the cache's.

Before anything moves, every call (``attend``, ``append``) takes part in one agreement round
(``cp.agree``: a row of ints per rank, one all-to-all): which method each rank called, its token
counts, how many chunks its cache holds, a digest of its dtype, layout, sizes and scale, and a
problem code where its own arguments are wrong. Every rank judges the same table and raises the same
ValueError (a rank whose own arguments were wrong raises its own error), so a rank appending while
another attends, shards that are not ``shard_sizes``' split of one chunk, or K/V unlike the cache's
are an error on every rank, never a hang. The table also gives every rank the chunk's shard sizes.
Where reading the round makes the CPU wait for the GPU (NCCL), a call that repeats the last agreed
one on this rank (the later denoising steps of a chunk) is not read: a device-side assertion
(``torch._assert_async``) stops the rank if any row differs from that agreed table, and a rank whose
call changed reads, sees the others' repeat flag and raises naming them (as ``cp.call_check`` does);
so each chunk's first attend and each append read the round, the other steps do not.

Inference only: ``attend`` is not differentiable; with autograd recording and a tensor that requires
grad it raises (on every rank) and asks for ``torch.no_grad()`` / ``torch.inference_mode()``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cp import agree, call_check, debug, inputs, kernels, online_softmax
from cp.comm import global_ranks, meta_device
from cp.shard import gather_cat_uneven, shard_sizes


class Op(enum.IntEnum):
    """The method a rank called, as its row of the agreement round says."""

    ATTEND = 1
    APPEND = 2


class Problem(enum.IntEnum):
    """What was wrong with a rank's own arguments (its row says which; the rank raises its own error)."""

    NONE = 0
    ARGUMENTS = 1  # not one chunk's shards: wrong types, dims, lengths or shapes
    GRAD = 2       # autograd would record through attend, which is inference only
    CACHE = 3      # K/V unlike the cached ones (heads, feature sizes, dtype, device, batch)


_PROBLEMS = {
    Problem.ARGUMENTS: "its q, k and v are not shards of one chunk (its own error says what)",
    Problem.GRAD: "it records autograd through attend, which is inference only",
    Problem.CACHE: "its K/V differ from the cached ones in heads, feature sizes, dtype, device or batch",
}
#: The agreement row's columns: then the flag, ``call_check``'s CHECKED (a repeat of the last agreed call) or NEW.
_OP, _PROBLEM, _TOKENS, _CHUNKS, _DIGEST, _FLAG = range(6)
_ASSERTION = ("KVCache: the ranks' calls differ (another rank changed its call, or called another method, while this "
              "one repeated its last one); run with PARALLEL_STATE_DEBUG=1 to have every rank name the difference")


@dataclass(frozen=True)
class _Agreed:
    """The last call every rank agreed on, where reading a round waits for the GPU: this rank's row, its row as a
    repeat (flag CHECKED) and the whole table as repeats would send it, on the round's device; the shard sizes."""

    row: tuple[int, ...]
    repeat: torch.Tensor
    table: torch.Tensor
    sizes: tuple[int, ...]


class KVCache:
    """K/V of the kept earlier chunks of an autoregressive rollout, this rank's split of each.

    ``cp_group``: the context-parallel group (None or a group of one: a plain single-process cache, the
    same calls). ``window_chunks``: None keeps every chunk; W keeps the last W - 1, so chunk c sees
    chunks c - W + 1 .. c (``cp.Mask.sliding_window(chunk, W)`` for chunks of one length). ``seq_dim`` /
    ``head_dim``: the layout of q, k, v (default [B, S, H, D]; the feature dim is the last remaining).
    Every rank of the group makes the same calls in the same order.
    """

    def __init__(self, cp_group: Any = None, *, window_chunks: int | None = None, seq_dim: int = 1,
                 head_dim: int = 2) -> None:
        what = "KVCache"
        n, rank = inputs.group_size(what, cp_group)
        if window_chunks is not None and (isinstance(window_chunks, bool) or not isinstance(window_chunks, int)):
            raise TypeError(f"{what}: window_chunks must be an int (chunks a query sees, its own included) or None "
                            f"(every earlier chunk), got {type(window_chunks).__name__} {window_chunks!r}")
        if window_chunks is not None and window_chunks < 1:
            raise ValueError(f"{what}: window_chunks={window_chunks}; a chunk sees at least itself: pass 1 or more, "
                             f"or None to keep every chunk")
        for name, value in (("seq_dim", seq_dim), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__} {value!r}")
        self._group = cp_group if n > 1 else None
        self._n, self._rank = n, rank
        self._window = window_chunks
        self._seq_dim, self._head_dim = seq_dim, head_dim
        self._k: torch.Tensor | None = None  # [..., Hkv, tokens, D]: the kept chunks, oldest first
        self._v: torch.Tensor | None = None
        self._chunks: list[int] = []         # this rank's tokens of each kept chunk
        self._agreed: _Agreed | None = None

    # ------------------------------------------------------------------ state

    def __len__(self) -> int:
        """Chunks kept."""
        return len(self._chunks)

    @property
    def local_tokens(self) -> int:
        """This rank's cached tokens (its split of every kept chunk)."""
        return sum(self._chunks)

    @property
    def local_bytes(self) -> int:
        """Bytes of this rank's cached K and V."""
        return 0 if self._k is None or self._v is None else self._k.nbytes + self._v.nbytes

    @property
    def window_chunks(self) -> int | None:
        return self._window

    def clear(self) -> None:
        """Drop every cached chunk (on every rank: the next call's round compares the ranks' chunk counts)."""
        self._k = self._v = None
        self._chunks = []

    def __repr__(self) -> str:
        return (f"KVCache(chunks={len(self)}, local_tokens={self.local_tokens}, window_chunks={self._window}, "
                f"ranks={self._n})")

    # ------------------------------------------------------------------ calls

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               softmax_scale: float | None = None) -> torch.Tensor:
        """This rank's shard of the new chunk's attention output, in q's layout and dtype.

        q, k, v: this rank's shard of the chunk (``cp.split_inputs_cp(chunk, seq_dim, group, uneven=True)``);
        K/V heads may divide q's (GQA). Every query of the chunk sees every kept cached chunk and the whole
        chunk. ``softmax_scale`` defaults to 1/sqrt(feature dim). The cache does not change.
        """
        what = "KVCache.attend"
        error: Exception | None = None
        problem = Problem.NONE
        t, scale = None, 0.0
        try:
            t = inputs.tensors(what, q, k, v, self._seq_dim, self._head_dim, self._n)
            _some_tokens(what, t.local, self._seq_dim)
            scale = inputs.check_scale(what, softmax_scale, t.feature)
            problem, error = self._fits_cache(what, t.k, t.v, t.s, t.h)
            if error is None and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
                problem, error = Problem.GRAD, RuntimeError(
                    f"{what}: q, k or v requires grad with autograd recording; the cache is for inference: call "
                    f"it under torch.no_grad() or torch.inference_mode()")
        except (TypeError, ValueError) as exc:
            problem, error = Problem.ARGUMENTS, exc
        sizes = self._agree(what, Op.ATTEND, problem, error, t, scale)
        assert t is not None
        with torch.no_grad():
            return self._attend(t, scale, sizes)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The chunk's K/V (this rank's shard, cut as ``attend``'s) join the cache; with ``window_chunks=W``
        the oldest chunks beyond the last W - 1 are dropped."""
        what = "KVCache.append"
        error: Exception | None = None
        problem = Problem.NONE
        t = None
        try:
            t = self._chunk_kv(what, k, v)
            problem, error = self._fits_cache(what, t.k, t.v, t.s, t.h)
        except (TypeError, ValueError) as exc:
            problem, error = Problem.ARGUMENTS, exc
        self._agree(what, Op.APPEND, problem, error, t, 0.0)
        assert t is not None
        if self._window == 1:
            return  # a chunk sees only itself: nothing is kept
        kc, vc = (x.detach().movedim((t.h, t.s), (-3, -2)) for x in (t.k, t.v))
        keep = len(self._chunks) if self._window is None else min(len(self._chunks), self._window - 2)
        drop = sum(self._chunks[:len(self._chunks) - keep])
        if self._k is None or self._v is None:
            # a copy even where the layout is the cache's: the caller's tensors stay theirs to change
            self._k, self._v = (x.clone(memory_format=torch.contiguous_format) for x in (kc, vc))
        else:  # one copy per chunk; the dropped chunks' memory goes with the old buffers
            self._k = torch.cat([self._k[..., drop:, :], kc], dim=-2)
            self._v = torch.cat([self._v[..., drop:, :], vc], dim=-2)
        self._chunks = self._chunks[len(self._chunks) - keep:] + [kc.shape[-2]]

    # ------------------------------------------------------------------ internals

    def _chunk_kv(self, what: str, k: Any, v: Any) -> inputs.Tensors:
        """k and v checked as one chunk's K/V shard: one dtype, device and shape but for the feature dim (the
        last remaining), at least one token; as ``Tensors`` with k standing in for q."""
        s, h = [inputs.dims(what, x, name, self._seq_dim, self._head_dim, self._n) for name, x in (("k", k), ("v", v))][0]
        kc, vc = (x.movedim((h, s), (-3, -2)) if x.dim() == k.dim() else x for x in (k, v))
        if k.dim() != v.dim() or kc.shape[:-1] != vc.shape[:-1] or (k.dtype, k.device) != (v.dtype, v.device) \
                or k.dim() < 3 or not k.dtype.is_floating_point:
            raise ValueError(
                f"{what}: k {tuple(k.shape)} {k.dtype} on {k.device} and v {tuple(v.shape)} {v.dtype} on {v.device} "
                f"(seq_dim={self._seq_dim}, head_dim={self._head_dim}) are not one chunk's K/V: pass floating tensors "
                f"of at least 3 dims, one dtype and device, and one shape but for the feature dim (the last remaining)")
        _some_tokens(what, k.shape[s], self._seq_dim)
        return inputs.Tensors(k, k, v, s, h, self._seq_dim, self._head_dim)

    def _fits_cache(self, what: str, k: torch.Tensor, v: torch.Tensor, s: int, h: int
                    ) -> tuple[Problem, Exception | None]:
        """Whether k and v are laid out as the cached K/V (every size but the tokens, dtype, device)."""
        if self._k is None or self._v is None:
            return Problem.NONE, None
        kc, vc = (x.movedim((h, s), (-3, -2)) for x in (k, v))
        mine = [(tuple(x.shape[:-2]) + tuple(x.shape[-1:]), x.dtype, x.device) for x in (kc, vc)]
        cached = [(tuple(x.shape[:-2]) + tuple(x.shape[-1:]), x.dtype, x.device) for x in (self._k, self._v)]
        if mine == cached:
            return Problem.NONE, None
        got = ", ".join(f"{nm} [..., H, D] = {m[0]} {m[1]} on {m[2]}" for nm, m in zip("kv", mine, strict=True))
        want = ", ".join(f"{nm} {c[0]} {c[1]} on {c[2]}" for nm, c in zip("kv", cached, strict=True))
        return Problem.CACHE, ValueError(
            f"{what}: k and v ({got}, the token dim left out) differ from the cached K/V ({want}); pass K/V of the "
            f"cache's batch, heads, feature sizes, dtype and device, or clear() the cache on every rank first")

    def _agree(self, what: str, op: Op, problem: Problem, error: Exception | None, t: inputs.Tensors | None,
               scale: float) -> tuple[int, ...]:
        """The round (see the module doc): every rank's shard sizes of the chunk, or the same error on every rank."""
        if self._group is None:
            if error is not None:
                raise error
            assert t is not None
            return (t.local,)
        tokens, digest = _tokens_and_digest(op, problem, t, scale)
        row = (int(op), int(problem), tokens, len(self._chunks), digest)
        device = meta_device(self._group)
        waits = call_check._reads_wait(device)
        last = self._agreed
        if waits and last is not None and last.row == row and not debug.enabled():
            # A repeat of the last agreed call (the steps of one chunk): judged on the device, no wait for the GPU.
            rows = agree.start(last.repeat, self._group).rows()
            torch._assert_async((rows == last.table).all(), _ASSERTION)
            return last.sizes
        table = agree.gather([*row, int(call_check.NEW)], self._group)
        ranks = global_ranks(self._group)
        if error is not None:
            raise type(error)(f"{error} (every rank of the cp group raises)")
        got = _judge(what, table, ranks)
        if waits:
            repeats = torch.tensor([[*r[:_FLAG], int(call_check.CHECKED)] for r in table], dtype=torch.int64,
                                   device=device)
            self._agreed = _Agreed(row, repeats[self._rank].clone(), repeats, got)
        return got

    def _attend(self, t: inputs.Tensors, scale: float, sizes: tuple[int, ...]) -> torch.Tensor:
        """Every query of the chunk against this rank's K/V, the partials merged by each query's owner."""
        s, h, group = t.s, t.h, self._group
        whole = t.q if group is None else gather_cat_uneven(t.q, s, group, sizes)
        qc = whole.movedim((h, s), (-3, -2))
        kc, vc = (x.movedim((h, s), (-3, -2)) for x in (t.k, t.v))
        lead = qc.shape[:-3]
        q4, k4, v4 = (kernels.as_input(x) for x in (qc, kc, vc))  # the kernels' [B, H, L, D]
        out, lse = _partial(q4, k4, v4, scale)
        if self._k is not None and self._v is not None:
            cached, clse = _partial(q4, kernels.as_input(self._k), kernels.as_input(self._v), scale)
            online_softmax.merge(out, lse, cached, clse)
        if group is not None:
            out = _merge_at_owners(out, lse, group, sizes)
        out = out.reshape(*lead, *out.shape[-3:]).to(t.q.dtype)
        return out.movedim((-3, -2), (h, s))


def _some_tokens(what: str, tokens: int, seq_dim: int) -> None:
    if tokens < 1:
        raise ValueError(f"{what}: this rank's shard holds no tokens (seq_dim={seq_dim}); every rank holds at least "
                         f"one token of the chunk: a chunk of at least as many tokens as the group has ranks")


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, L, D] against every key of k / v [B, Hkv, C, D]: the normalized output (compute dtype) and
    log-sum-exp [B, Hq, L] by the fused kernel of a full tile."""
    choice = kernels.choose_for(q, k, v, kernels.TileKind.FULL)
    out, lse = kernels.forward(choice, q, k, v, scale, None)
    return out.to(kernels.compute_dtype(q.dtype)), lse


def _merge_at_owners(out: torch.Tensor, lse: torch.Tensor, group: Any, sizes: tuple[int, ...]) -> torch.Tensor:
    """Each rank's partials of the chunk's queries [..., L, Dv] / [..., L] sent to the queries' owners (one
    all-to-all of rows), merged there by the online softmax: this rank's rows of the whole attention."""
    n, rank = len(sizes), group.rank()
    lead, dv = out.shape[:-2], out.shape[-1]
    # Rows first, each row its output and log-sum-exp side by side, so the all-to-all splits by query.
    send = torch.cat([out.movedim(-2, 0).reshape(sum(sizes), -1), lse.movedim(-1, 0).reshape(sum(sizes), -1)], 1)
    mine = sizes[rank]
    recv = send.new_empty(n * mine, send.shape[1])
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=[mine] * n, input_split_sizes=list(sizes),
                           group=group)
    width = out[..., 0, :].numel()
    parts = recv.view(n, mine, -1)
    outs = parts[..., :width].reshape(n, mine, *lead, dv).movedim(1, -2)   # [n, ..., mine, Dv]
    lses = parts[..., width:].reshape(n, mine, *lead).movedim(1, -1)       # [n, ..., mine]
    acc, total = outs[0].clone(), lses[0].clone()
    for i in range(1, n):
        online_softmax.merge(acc, total, outs[i].clone(), lses[i])
    return acc


__all__ = ["KVCache"]


def _tokens_and_digest(op: Op, problem: Problem, t: inputs.Tensors | None, scale: float) -> tuple[int, int]:
    """This rank's token count and call digest for its agreement row (zeros where its arguments are wrong)."""
    if t is None or problem is not Problem.NONE:
        return 0, 0
    tokens = t.local if op is Op.ATTEND else t.k.shape[t.s]
    digest = agree.digest((t.q.dtype, t.q.device.type, t.s, t.h, scale,
                           [[size for d, size in enumerate(x.shape) if d != t.s] for x in (t.q, t.k, t.v)]))
    return tokens, digest


def _judge(what: str, table: list[list[int]], ranks: list[int]) -> tuple[int, ...]:
    """The shard sizes of the chunk the agreement ``table`` (a row per group rank) gives, or the ValueError every
    rank raises alike for what its rows say differs (``ranks``: the group's global ranks)."""

    def who(i: int) -> str:
        return f"group rank {i} (global {ranks[i]})"

    def ranks_where(keep: Any) -> str:
        return ", ".join(who(i) for i, r in enumerate(table) if keep(r))

    if any(r[_FLAG] == call_check.CHECKED for r in table):  # they went on: their device assertion stops them
        raise ValueError(
            f"{what}: {ranks_where(lambda r: r[_FLAG] == call_check.CHECKED)} repeated their last call while "
            f"{ranks_where(lambda r: r[_FLAG] != call_check.CHECKED)} made another; every rank of the cp group makes "
            f"the same calls (PARALLEL_STATE_DEBUG=1 has every rank check every call in full and name the difference)")
    bad = [r[_PROBLEM] for r in table if r[_PROBLEM]]
    if bad:
        said = "; ".join(f"{ranks_where(lambda r, c=code: r[_PROBLEM] == c)}: {_PROBLEMS[Problem(code)]}"
                         for code in sorted(set(bad)))
        raise ValueError(f"{what}: another rank of the cp group cannot make this call ({said})")
    if len({r[_OP] for r in table}) > 1:
        raise ValueError(
            f"{what}: {ranks_where(lambda r: r[_OP] == Op.APPEND)} called KVCache.append while "
            f"{ranks_where(lambda r: r[_OP] == Op.ATTEND)} called KVCache.attend; every rank of the cp group "
            f"calls attend and append on its cache in the same order")
    if len({r[_CHUNKS] for r in table}) > 1:
        raise ValueError(
            f"{what}: the ranks' caches hold different numbers of chunks ({[r[_CHUNKS] for r in table]} by group "
            f"rank); every rank appends each chunk, and clears, together")
    if len({r[_DIGEST] for r in table}) > 1:
        raise ValueError(
            f"{what}: the ranks' shards differ beyond their token counts (dtype, device, layout, batch, head or "
            f"feature sizes, or softmax_scale); pass every rank its shard of one chunk, with the same scale")
    got = tuple(r[_TOKENS] for r in table)
    n = len(table)
    want = shard_sizes(sum(got), n)
    if got != want:
        wrong = "; ".join(f"{who(i)} holds {g}, expected {w}"
                          for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
        raise ValueError(
            f"{what}: the ranks hold {list(got)} tokens of the chunk, but a chunk of {sum(got)} tokens splits over "
            f"{n} ranks as shard_sizes({sum(got)}, {n}) = {list(want)} ({wrong}); cut the chunk with "
            f"cp.split_inputs_cp(chunk, seq_dim, group, uneven=True)")
    return got
