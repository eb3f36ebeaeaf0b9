"""``dispatch`` / ``undispatch``: a whole sequence to this rank's tokens of a ``DispatchPlan``, and back.

``dispatch(x, plan, seq_dim, group)`` takes this rank's tokens ``plan.positions[rank]`` (its runs,
in order) of a sequence every rank holds whole: no communication. ``undispatch(y, plan, seq_dim,
group)`` gathers every rank's tokens (cp.shard's uneven gather, after its header round has checked
every rank's size against the plan on every rank) and puts each run back at its global place.

Gradients follow ``split_inputs_cp`` / ``cat_outputs_cp_with_grad``: ``dispatch``'s backward puts
this rank's token gradients at their places in a zero tensor of ``x``'s shape (summing it over the
cp group, as the data x context parallel gradient all-reduce does, gives the whole gradient);
``undispatch``'s backward hands this rank's tokens their slice of the whole sequence's gradient
(every rank computes the same thing from the whole sequence). So ``undispatch(dispatch(x))``
passes gradients through unchanged, summed over the group.
"""

from __future__ import annotations

from typing import Any

import torch

import parallel_state
from cp import debug
from cp.agree import gather
from cp.comm import check_group, global_ranks
from cp.shard import agree_shards, check_tensor, gather_cat, gather_cat_uneven, normalize_dim


def check_plan(what: str, plan: Any, cp_group: Any) -> tuple[int, int]:
    """``(group size, this rank's index)`` after checking that ``plan`` is a DispatchPlan for a group of this size.

    ``cp_group=None`` counts as a group of one. Raises alike on every rank that passed the same plan
    and a group of the same size: TypeError for a non-plan or non-group, ValueError for a size mismatch.
    """
    if not isinstance(plan, parallel_state.DispatchPlan):
        raise TypeError(f"{what}: plan must be a DispatchPlan (cp.plan_dispatch(mask, length, cp_size)), "
                        f"got {type(plan).__name__}")
    if cp_group is None:
        n, rank = 1, 0
    else:
        check_group(cp_group, what)
        n, rank = cp_group.size(), cp_group.rank()
    if plan.cp_size != n:
        group = "cp_group=None (context parallelism off)" if cp_group is None else f"a group of {n} ranks"
        raise ValueError(f"{what}: the plan is for cp_size={plan.cp_size} but got {group}; plan with the group's "
                         f"size: cp.plan_dispatch(mask, length, {n})")
    return n, rank


def agree_plan(what: str, plan: Any, cp_group: Any) -> None:
    """Raise the same ValueError on every rank unless every rank of ``cp_group`` passed the same plan (one all-gather)."""
    prints = [row[0] for row in gather([plan.fingerprint()], cp_group)]
    if len(set(prints)) > 1:
        ranks = global_ranks(cp_group)
        groups: dict[int, list[str]] = {}
        for i, f in enumerate(prints):
            groups.setdefault(f, []).append(f"{i} (global {ranks[i]})")
        got = "; ".join(f"group ranks {', '.join(who)}: plan {f:x}" for f, who in groups.items())
        raise ValueError(f"{what}: the ranks hold different plans ({got}); build the plan from the same mask, "
                         f"length and cp_size on every rank")


def _seq_dim(what: str, t: torch.Tensor, plan: Any, seq_dim: Any, n: int) -> int:
    return normalize_dim(what, tuple(t.shape), seq_dim, n)


class _TakeRuns(torch.autograd.Function):
    """This rank's runs of ``x`` along ``dim``, in order; backward puts the gradient back at the runs' places."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, runs: Any) -> torch.Tensor:
        ctx.dim, ctx.runs, ctx.shape = dim, runs, tuple(x.shape)
        return torch.cat([x.narrow(dim, start, stop - start) for start, stop in runs], dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.new_zeros(ctx.shape)
        at = 0
        for start, stop in ctx.runs:
            out.narrow(ctx.dim, start, stop - start).copy_(grad.narrow(ctx.dim, at, stop - start))
            at += stop - start
        return out, None, None


def dispatch(x: torch.Tensor, plan: Any, seq_dim: int, cp_group: Any = None) -> torch.Tensor:
    """This rank's tokens of the whole sequence ``x`` (the same on every rank): ``plan.positions[rank]`` along ``seq_dim``.

    ``cp_group=None`` or a group of one (with a plan for cp_size 1) returns ``x`` itself. The result is a
    new tensor; its gradient reaches ``x`` at this rank's positions (zeros elsewhere). No communication,
    except with PARALLEL_STATE_DEBUG=1, where every rank first checks that all hold the same plan and
    the same shape. TypeError / ValueError for a non-tensor, a non-plan, a plan for another group size,
    a bad ``seq_dim`` or a length along it other than ``plan.length``.
    """
    what = "dispatch"
    check_tensor(what, x)
    n, rank = check_plan(what, plan, cp_group)
    dim = _seq_dim(what, x, plan, seq_dim, n)
    if x.shape[dim] != plan.length:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, {x.shape[dim]} tokens along seq_dim={seq_dim}, but "
                         f"the plan is for {plan.length}; pass the whole sequence, or plan for its length")
    if n > 1 and debug.enabled():
        agree_plan(what, plan, cp_group)
        debug.check_same(what, x, cp_group)
    if n == 1:
        return x
    return _TakeRuns.apply(x, dim, plan.runs[rank])


class _Undispatch(torch.autograd.Function):
    """Gather every rank's tokens and put each run at its global place; backward takes this rank's runs."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, dim: int, group: Any, plan: Any, sizes: tuple[int, ...]) -> torch.Tensor:
        rank = group.rank()
        ctx.dim, ctx.runs = dim, plan.runs[rank]
        if len(set(sizes)) == 1:
            gathered = gather_cat(y, dim, group, len(sizes))
        else:
            gathered = gather_cat_uneven(y, dim, group, sizes)
        if plan.is_contiguous:
            return gathered  # rank order is global order
        out = torch.empty_like(gathered)
        at = 0  # where each rank's tokens start in the gathered rank-order sequence
        for runs in plan.runs:
            for start, stop in runs:
                out.narrow(dim, start, stop - start).copy_(gathered.narrow(dim, at, stop - start))
                at += stop - start
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # This rank's slice only: the other ranks' tokens belong to their graphs.
        parts = [grad.narrow(ctx.dim, start, stop - start) for start, stop in ctx.runs]
        return torch.cat(parts, ctx.dim), None, None, None, None


def undispatch(y: torch.Tensor, plan: Any, seq_dim: int, cp_group: Any = None) -> torch.Tensor:
    """The whole sequence, in global order, on every rank, from each rank's tokens ``y`` (``plan.positions[rank]``).

    ``cp_group=None`` or a group of one returns ``y`` itself. Otherwise a new tensor whose slice at this
    rank's positions stays ``y`` in the autograd graph. One small all-gather of every rank's shape
    comes first, so a rank holding the wrong number of tokens (or other dims, dtype or device that
    differ) raises the same ValueError on every rank before any data moves; with PARALLEL_STATE_DEBUG=1
    the ranks also check that they hold the same plan.
    """
    what = "undispatch"
    check_tensor(what, y, "y")
    n, rank = check_plan(what, plan, cp_group)
    dim = _seq_dim(what, y, plan, seq_dim, n)
    if n == 1:
        if y.shape[dim] != plan.length:
            raise ValueError(f"{what}: y has {y.shape[dim]} tokens along seq_dim={seq_dim} but the plan is for "
                             f"{plan.length}; in a group of one the rank holds the whole sequence")
        return y
    if debug.enabled():
        agree_plan(what, plan, cp_group)
    sizes = agree_shards(what, y, seq_dim, dim, cp_group, plan.length, sizes=plan.sizes,
                         fix="give rank r the tokens cp.dispatch(x, plan, seq_dim, group) gives it "
                             "(plan.sizes[r] of them)")
    return _Undispatch.apply(y, dim, cp_group, plan, sizes)


__all__ = ["agree_plan", "check_plan", "dispatch", "undispatch"]
