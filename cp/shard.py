"""Split a tensor into this rank's sequence shard, and gather shards back into the whole sequence.

Shard i of a sequence is the i-th contiguous block along ``seq_dim`` and belongs to the rank whose
index in the group is i. ``cat_outputs_cp(split_inputs_cp(x, d, g), d, g)`` equals ``x`` bit for bit.

How the gather stays cheap: view the result as ``[pre, n, shard]`` (``pre`` = product of the dims
before ``seq_dim``). The n shards land in n contiguous slots; when ``pre == 1`` (``seq_dim`` is the
leading non-trivial dim) those slots are the result itself and only the transfer writes it, else
one strided copy puts them in place. With gloo and results of 128 KiB or more, each slot is filled
by its owner's broadcast straight into the slot (gloo's all-gather receives into a fresh flat buffer
and copies out of it), and this rank's own slot is copied while the others are in flight. Otherwise
(NCCL, or small tensors where n round trips cost more than copies) one all-gather fills one buffer.
On CPU the receive buffer is reused across calls; the result is always a new tensor.

Uneven shards (``uneven=True`` / ``length=``): shard i holds ``shard_sizes(length, n)[i]`` elements
(torch.tensor_split's rule). The gather first all-gathers every rank's small shape header, so a
shard of the wrong size, dtype or other dims is a ValueError naming the ranks on every rank, never
a hang or an abort inside the collective; then the broadcasts path receives each shard at its own
size, and the all-gather path pads every shard to the largest (at most one row more). The even
default runs no extra collective.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from cp import debug, meta
from cp.agree import gather
from cp.comm import all_gather_into, as_bytes, backend_for, check_group, global_ranks
from cp.workspace import discard, workspace
from parallel_state import shard_sizes  # noqa: F401  (the rule lives with the planner; cp.shard_sizes is it)


def check_tensor(what: str, x: Any, name: str = "x") -> None:
    """Raise TypeError unless ``x`` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")


def normalize_dim(what: str, shape: tuple[int, ...], seq_dim: Any, group_size: int,
                  name: str = "seq_dim") -> int:
    """``seq_dim`` as a non-negative dimension of ``shape``; ValueError/TypeError when it is not one.

    ``name`` is the argument's name in the messages.
    """
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"{what}: {name} must be an int, got {type(seq_dim).__name__} {seq_dim!r}")
    ndim = len(shape)
    if not -ndim <= seq_dim < ndim:
        kind = {"seq_dim": "sequence", "head_dim": "head"}.get(name, name)
        valid = f"{-ndim}..{ndim - 1}" if ndim else f"none: a 0-dim tensor has no {kind} dimension"
        raise ValueError(
            f"{what}: {name}={seq_dim} is out of range for shape {tuple(shape)} with a group of size "
            f"{group_size} (valid dims: {valid})"
        )
    return seq_dim % ndim


def check_divisible(what: str, shape: tuple[int, ...], seq_dim: int, dim: int, group_size: int) -> None:
    """ValueError unless ``shape[dim]`` splits into ``group_size`` equal shards."""
    if shape[dim] % group_size:
        raise ValueError(
            f"{what}: cannot split shape {tuple(shape)} along seq_dim={seq_dim} (size {shape[dim]}) into "
            f"{group_size} equal shards for a group of size {group_size}: pass uneven=True (shards differing "
            f"by at most one), pad dim {dim} to a multiple of {group_size} or use a group whose size divides "
            f"{shape[dim]}"
        )


def uneven_sizes(what: str, shape: tuple[int, ...], seq_dim: int, dim: int, group_size: int) -> tuple[int, ...]:
    """``shard_sizes(shape[dim], group_size)``; ValueError naming the shape when it is shorter than the group."""
    if shape[dim] < group_size:
        raise ValueError(
            f"{what}: cannot split shape {tuple(shape)} along seq_dim={seq_dim} (size {shape[dim]}) into "
            f"{group_size} shards of at least one element for a group of size {group_size}: use a group of "
            f"at most {shape[dim]} ranks or a longer sequence"
        )
    return shard_sizes(shape[dim], group_size)


def check_uneven(what: str, uneven: Any) -> None:
    """TypeError unless ``uneven`` is a bool."""
    if not isinstance(uneven, bool):
        raise TypeError(f"{what}: uneven must be True or False, got {type(uneven).__name__} {uneven!r}")


def _check_length(what: str, length: Any) -> None:
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise TypeError(f"{what}: length must be an int (the full length along seq_dim) or None, "
                        f"got {type(length).__name__} {length!r}")


def split_inputs_cp(x: torch.Tensor, seq_dim: int, cp_group: Any = None, *, uneven: bool = False) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along ``seq_dim`` (shard i for the group's rank i).

    ``cp_group=None`` (or a group of one) returns ``x`` itself. The shard is copied at most once: when
    it is already contiguous in memory (``seq_dim`` leading, or all dims before it of size 1) it is a
    view that shares ``x``'s memory, as ``x`` itself does when CP is off; clone it before writing to it
    in place if ``x`` must stay untouched. The length along ``seq_dim`` must divide by the group size,
    unless ``uneven``: then shard i holds ``shard_sizes(length, n)[i]`` elements (the first
    ``length % n`` shards one more), and only a length below the group size is an error.
    """
    if cp_group is None:
        return x
    what = "split_inputs_cp"
    check_tensor(what, x)
    check_group(cp_group, what)
    check_uneven(what, uneven)
    n = cp_group.size()
    dim = normalize_dim(what, x.shape, seq_dim, n)
    if uneven:
        sizes = uneven_sizes(what, x.shape, seq_dim, dim, n)
    else:
        check_divisible(what, x.shape, seq_dim, dim, n)
    if n == 1:
        return x
    rank = cp_group.rank()
    if uneven:
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()
    length = x.shape[dim] // n
    return x.narrow(dim, rank * length, length).contiguous()


def _gather_dim(what: str, x: torch.Tensor, seq_dim: int, cp_group: Any, length: Any = None,
                uneven: bool = False) -> tuple[int | None, tuple[int, ...] | None]:
    """Check a gather's arguments: the normalized dim (None when there is nothing to gather) and, for an
    uneven gather whose shards differ, every rank's shard size, agreed on every rank (else None)."""
    if cp_group is None:
        return None, None
    check_tensor(what, x)
    check_group(cp_group, what)
    check_uneven(what, uneven)
    _check_length(what, length)
    n = cp_group.size()
    dim = normalize_dim(what, x.shape, seq_dim, n)
    if n == 1:
        if length is not None and x.shape[dim] != length:
            raise ValueError(f"{what}: x has {x.shape[dim]} elements along seq_dim={seq_dim} but length={length}; "
                             f"in a group of one the shard is the whole sequence")
        return None, None
    if length is not None or uneven:
        sizes = agree_shards(what, x, seq_dim, dim, cp_group, length)
        # Shards that came out equal take the even gather (the check above is all the uneven path adds).
        return dim, None if len(set(sizes)) == 1 else sizes
    if debug.enabled():
        debug.check_same(what, x, cp_group)
    return dim, None


def agree_shards(what: str, x: torch.Tensor, seq_dim: int, dim: int, group: Any, length: int | None, *,
                 sizes: tuple[int, ...] | None = None, fix: str | None = None) -> tuple[int, ...]:
    """Every rank's shard size along ``dim``, after checking on every rank alike that the shards fit together.

    One all-gather of a small header per rank (shape, dtype, device and ``length``). Raises the same
    ValueError on every rank when the ranks passed different lengths, shards differing in anything but
    their size along ``dim``, or sizes other than ``sizes`` (default ``shard_sizes(total, n)``, ``total`` =
    ``length``, or the sum of the sizes when it is None): nobody is left waiting in the data collective.
    ``fix`` replaces the message's advice for a wrong size.
    """
    n = group.size()
    table = gather(meta.encode(x) + [-1 if length is None else length], group)
    metas = [meta.decode(row[:-1]) for row in table]
    lengths = [row[-1] for row in table]
    ranks = global_ranks(group)

    def who(i: int) -> str:
        return f"group rank {i} (global {ranks[i]})"

    if len(set(lengths)) > 1:
        got = "; ".join(f"{who(i)}: {'None' if v < 0 else v}" for i, v in enumerate(lengths))
        raise ValueError(f"{what}: the ranks passed different lengths ({got}); pass the full length along "
                         f"seq_dim={seq_dim}, the same on every rank")

    def rest(m: meta.Meta) -> tuple[Any, ...]:
        shape = m.shape[:dim] + m.shape[dim + 1:] if m.kind == meta.TENSOR else ()
        return (m.kind, m.ndim, shape, m.dtype, m.device_type)

    if any(rest(m) != rest(metas[0]) for m in metas) or metas[0].kind != meta.TENSOR:
        got = "; ".join(f"{who(i)}: {m.describe()}" for i, m in enumerate(metas))
        raise ValueError(f"{what}: the shards must differ only in their size along seq_dim={seq_dim}, but the "
                         f"ranks hold: {got}; pass every rank a shard of the same tensor")
    got_sizes = tuple(m.shape[dim] for m in metas)
    total = sum(got_sizes) if length is None else length
    if total < n:
        raise ValueError(f"{what}: a sequence of length {total} along seq_dim={seq_dim} cannot be split over a "
                         f"group of size {n} with at least one element per rank (shard sizes {got_sizes}); use "
                         f"a group of at most {total} ranks or a longer sequence")
    want = shard_sizes(total, n) if sizes is None else tuple(sizes)
    if got_sizes != want:
        bad = "; ".join(f"{who(i)} holds {g}, expected {w}"
                        for i, (g, w) in enumerate(zip(got_sizes, want, strict=True)) if g != w)
        source = f"length={length}" if length is not None else f"the sizes' sum, {total}"
        rule = f"shard_sizes({total}, {n}) = {want}" if sizes is None else f"{want}"
        fix = fix or "give rank i the shard split_inputs_cp(x, seq_dim, group, uneven=True) gives it"
        raise ValueError(
            f"{what}: the shard sizes along seq_dim={seq_dim} are {got_sizes}, but a length of {total} ({source}) "
            f"splits over {n} ranks as {rule}: {bad}; {fix}")
    return want


def cat_outputs_cp(x: torch.Tensor, seq_dim: int, cp_group: Any = None, *, length: int | None = None,
                   uneven: bool = False) -> torch.Tensor:
    """Gather every rank's equal-shaped ``x`` and concatenate them in group-rank order along ``seq_dim``.

    ``cp_group=None`` (or a group of one) returns ``x`` itself. Otherwise the result is a new tensor the
    caller owns, outside the autograd graph (see cat_outputs_cp_with_grad). With PARALLEL_STATE_DEBUG=1
    every rank first checks that all shards have the same shape, dtype and device.

    Uneven shards: pass ``length`` (the full length along ``seq_dim``; rank i must hold
    ``shard_sizes(length, n)[i]``), or ``uneven=True`` to learn it from the shards. Either way one small
    all-gather of shapes first makes any mismatch a ValueError naming ranks and sizes on every rank.
    """
    dim, sizes = _gather_dim("cat_outputs_cp", x, seq_dim, cp_group, length, uneven)
    if dim is None:
        return x
    with torch.no_grad():
        if sizes is not None:
            return gather_cat_uneven(x, dim, cp_group, sizes)
        return gather_cat(x, dim, cp_group, cp_group.size())


class _GatherKeepLocalGrad(torch.autograd.Function):
    """The gather, with the local shard's slice of the result wired back to ``x`` for autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, n: int, sizes: Any) -> torch.Tensor:
        rank = group.rank()
        if sizes is None:
            ctx.dim, ctx.length, ctx.start = dim, x.shape[dim], rank * x.shape[dim]
            return gather_cat(x, dim, group, n)
        ctx.dim, ctx.length, ctx.start = dim, sizes[rank], sum(sizes[:rank])
        return gather_cat_uneven(x, dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Only the local slice's gradient comes back: the other slices belong to other ranks' graphs.
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None, None


def cat_outputs_cp_with_grad(x: torch.Tensor, seq_dim: int, cp_group: Any = None, *, length: int | None = None,
                             uneven: bool = False) -> torch.Tensor:
    """cat_outputs_cp whose local slice stays ``x`` in the autograd graph (``length`` / ``uneven`` as there).

    The gradient of the result's slice that came from this rank flows back into ``x``; the slices
    gathered from other ranks are constants here (their gradients are not sent back to their owners).
    """
    dim, sizes = _gather_dim("cat_outputs_cp_with_grad", x, seq_dim, cp_group, length, uneven)
    if dim is None:
        return x
    return _GatherKeepLocalGrad.apply(x, dim, cp_group, cp_group.size(), sizes)


#: Below this many bytes of result, gloo gathers with one all-gather: n broadcasts cost n round trips,
#: which small tensors feel more than gloo's extra copies (measured crossover on 2 ranks: 64-256 KiB).
GLOO_BROADCAST_MIN_BYTES = 128 * 1024
STRATEGIES = ("broadcasts", "all_gather")


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Scratch bytes for receiving: the reused workspace on CPU, a fresh (cached-allocator) block elsewhere."""
    if device.type == "cpu":
        return workspace(nbytes, device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _strategy(strategy: str | None, out: torch.Tensor, x: torch.Tensor, group: Any) -> str:
    """The gather's path: ``strategy`` when given (one of STRATEGIES), else chosen by backend and result size."""
    if strategy is None:
        big = out.numel() * out.element_size() >= GLOO_BROADCAST_MIN_BYTES
        strategy = "broadcasts" if big and backend_for(group, x.device.type) == "gloo" else "all_gather"
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown gather strategy {strategy!r}; expected one of {STRATEGIES}")
    return strategy


def pad_rows(x3: torch.Tensor, rows: int) -> torch.Tensor:
    """``x3`` ([pre, size, row]) copied into a new [pre, rows, row] tensor; the rows past ``size`` are left
    unwritten (collectives that want equal sizes carry them, nobody reads them)."""
    padded = torch.empty(x3.shape[0], rows, x3.shape[2], dtype=x3.dtype, device=x3.device)
    padded[:, :x3.shape[1]].copy_(x3)
    return padded


def gather_cat(x: torch.Tensor, dim: int, group: Any, n: int, strategy: str | None = None) -> torch.Tensor:
    """The gather itself; call without autograd recording.

    ``strategy`` (one of STRATEGIES) overrides the choice by backend and size, for tests.
    """
    shape = tuple(x.shape)
    out = torch.empty(shape[:dim] + (n * shape[dim],) + shape[dim + 1:], dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x = x.contiguous()
    pre = math.prod(shape[:dim])
    shard = x.numel() // pre
    out_slots = out.view(pre, n, shard)  # [:, i] is rank i's shard in place
    strategy = _strategy(strategy, out, x, group)
    try:
        if strategy == "broadcasts":
            _gather_by_broadcasts(x, out.view(pre, n * shape[dim], shard // shape[dim]), (shape[dim],) * n, group)
            return out
        # One all-gather into n contiguous slots: the result itself when pre == 1, else a scratch buffer.
        slots = out_slots[0] if pre == 1 else _buffer(out.numel() * out.element_size(), x.device).view(
            x.dtype).view(n, pre * shard)
        all_gather_into(as_bytes(slots), as_bytes(x), group)
    except BaseException:
        # A failed or interrupted collective may still write into the buffer later: never reuse it.
        discard(x.device)
        raise
    if pre != 1:
        out_slots.copy_(slots.view(n, pre, shard).transpose(0, 1))
    return out


def _gather_by_broadcasts(x: torch.Tensor, out3: torch.Tensor, sizes: tuple[int, ...], group: Any) -> None:
    """Fill ``out3`` ([pre, total, row]) with one async broadcast per rank, rank i's ``sizes[i]`` rows into their
    own run of it (in place when ``pre == 1``, else through scratch); ``x`` is this rank's contiguous shard."""
    n, rank = len(sizes), group.rank()
    pre, row = out3.shape[0], out3.shape[2]
    starts = [sum(sizes[:i]) for i in range(n)]
    if pre == 1:  # rank i's shard is one contiguous run of the result: receive in place
        recv = {i: out3[0, starts[i]:starts[i] + sizes[i]] for i in range(n) if i != rank}
    else:
        scratch = _buffer((sum(sizes) - sizes[rank]) * pre * row * x.element_size(), x.device).view(x.dtype)
        recv, at = {}, 0
        for i in range(n):
            if i != rank:
                recv[i] = scratch[at:at + pre * sizes[i] * row].view(pre, sizes[i], row)
                at += pre * sizes[i] * row
    ranks = global_ranks(group)
    # Same order on every rank, so the k-th broadcast of each rank is the same collective.
    works = [dist.broadcast(as_bytes(x if i == rank else recv[i]), ranks[i], group=group, async_op=True)
             for i in range(n)]
    out3[:, starts[rank]:starts[rank] + sizes[rank]].copy_(x.view(pre, sizes[rank], row))  # overlaps the transfers
    for i, work in enumerate(works):
        work.wait()
        if pre != 1 and i != rank:
            out3[:, starts[i]:starts[i] + sizes[i]].copy_(recv[i])


def gather_cat_uneven(x: torch.Tensor, dim: int, group: Any, sizes: tuple[int, ...],
                       strategy: str | None = None) -> torch.Tensor:
    """The gather for shards of ``sizes`` along ``dim`` (agreed by every rank); call without autograd recording.

    Broadcasts receive each shard at its own size (in place in the result when ``pre == 1``); the
    all-gather pads every shard to the largest size, at most one row of ``dim`` more than its own.
    """
    n, rank = group.size(), group.rank()
    shape = tuple(x.shape)
    total = sum(sizes)
    out = torch.empty(shape[:dim] + (total,) + shape[dim + 1:], dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    pre = math.prod(shape[:dim])
    row = x.numel() // (pre * shape[dim])  # elements per index along dim
    starts = [sum(sizes[:i]) for i in range(n)]
    out3 = out.view(pre, total, row)
    strategy = _strategy(strategy, out, x, group)
    mine = x.view(pre, sizes[rank], row)
    try:
        if strategy == "broadcasts":
            _gather_by_broadcasts(x, out3, sizes, group)
            return out
        big_size = max(sizes)
        # Pad with one unread row per leading index: gloo's all-gather wants equal sizes.
        send = x if sizes[rank] == big_size else pad_rows(mine, big_size)
        slots = _buffer(n * pre * big_size * row * x.element_size(), x.device).view(x.dtype)
        all_gather_into(as_bytes(slots), as_bytes(send), group)
    except BaseException:
        # A failed or interrupted collective may still write into the buffer later: never reuse it.
        discard(x.device)
        raise
    slots = slots.view(n, pre, big_size, row)
    for i in range(n):
        out3[:, starts[i]:starts[i] + sizes[i]].copy_(slots[i, :, :sizes[i]])
    return out
