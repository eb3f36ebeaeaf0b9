"""Per-sample context parallelism: plan a variable-length batch over the dp x cp ranks, and run the plan.

``plan_samples`` is ``parallel_state.plan_samples`` (pure: see its module doc for the cost model) with
``world`` given as the dp x cp process group or its size; the same plan either way. ``sample_groups``
turns a plan into what this rank runs: per step, its samples in order, each with its group from the
live state (``parallel_state.get_hybrid_data_context_parallel_groups(group_size=c)``, the dp x cp
group itself at full size, None for a sample alone on this rank), checked to hold exactly the
placement's ranks. ``run_samples`` runs one training step on it: each sample's loss summed over this
rank's tokens, scaled by ``1 / plan.total_tokens``, backward; then the gradients and the loss summed
over the dp x cp group, so that every rank ends with the loss and gradients of the whole batch (the sum
over every token / the batch's tokens), as one process computing each sample alone would.

Samples move by index: every rank of a sample's group loads the whole sample (``plan.samples_for(rank)``
lists them) and keeps its tokens with ``cp.dispatch(x, plan.dispatch_plan(i), seq_dim, group)``; no
tensor crosses ranks to place a sample.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
import torch.distributed as dist

import parallel_state
from cp.agree import gather
from cp.comm import check_group, global_ranks, meta_device


class SampleGroup(NamedTuple):
    """One sample this rank runs: its index in the batch and its group (None: this rank alone)."""

    index: int
    group: Any


def plan_samples(lengths: Sequence[int], world: int | dist.ProcessGroup, *, mask: Any = None,
                 shape: parallel_state.AttentionShape | None = None, rates: parallel_state.CostRates | None = None,
                 max_tokens_per_rank: int | None = None) -> parallel_state.SamplePlan:
    """``parallel_state.plan_samples`` with ``world`` the dp x cp ranks as a process group or as their number
    (the same plan either way): which group of those ranks runs each sample of the batch ``lengths``."""
    if isinstance(world, dist.ProcessGroup):
        world = world.size()
    elif not isinstance(world, int) or isinstance(world, bool):
        check_group(world, "plan_samples", "world")  # raises, naming what was passed
    return parallel_state.plan_samples(lengths, world, mask=mask, shape=shape, rates=rates,
                                       max_tokens_per_rank=max_tokens_per_rank)


def _dp_cp(what: str) -> Any:
    try:
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    except parallel_state.ParallelStateError as exc:
        raise parallel_state.ParallelStateError(
            f"{what}: a sample plan runs on the dp x cp group of parallel_state; call "
            f"parallel_state.initialize_model_parallel(..., hybrid_context_parallel=True) first ({exc})") from None


def _group(what: str, c: int, want: list[int]) -> Any:
    """The state's group of ``c`` ranks holding this rank, checked to be exactly ``want`` (global ranks)."""
    group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=c)
    if group is None:
        raise ValueError(f"{what}: the plan places a sample on {c} ranks, but no hybrid group of that size is built; "
                         f"initialize with hybrid_context_parallel=True")
    have = global_ranks(group)
    if have != want:
        raise ValueError(f"{what}: the state's group of {c} ranks holding this rank is ranks {have}, but the plan "
                         f"places the sample on ranks {want}; plan over this dp x cp group's ranks in its rank order")
    return group


def sample_groups(plan: parallel_state.SamplePlan) -> tuple[tuple[SampleGroup, ...], ...]:
    """Per step of ``plan`` (a ``cp.SamplePlan``), the samples this rank runs, in order, each with its group.

    Every rank of the dp x cp group must call it with the same plan: one small gather checks that they do
    and that every rank found its groups, so a mistake raises the same ValueError on every rank before any
    sample runs. ValueError where the plan is for another number of ranks, a group size the state did not
    build (initialize with ``hybrid_context_parallel=True``) or a group whose ranks are not the placement's.
    """
    what = "sample_groups"
    if not isinstance(plan, parallel_state.SamplePlan):
        raise TypeError(f"{what}: plan must be a SamplePlan (cp.plan_samples(lengths, group)), got "
                        f"{type(plan).__name__}")
    dp_cp = _dp_cp(what)
    n, me = dp_cp.size(), dp_cp.rank()
    problem = ""
    steps: list[tuple[SampleGroup, ...]] = []
    if plan.world != n:
        problem = (f"the plan is for {plan.world} dp x cp ranks but this dp x cp group has {n}; plan with "
                   f"cp.plan_samples(lengths, parallel_state.get_data_parallel_group(with_context_parallel=True))")
    else:
        members = global_ranks(dp_cp)
        found: dict[int, Any] = {1: None}
        try:
            for step in plan.placements_for(me):
                mine = []
                for p in step:
                    c = len(p.ranks)
                    if c not in found:  # a rank is in one block of each size: one lookup per size
                        found[c] = _group(what, c, [members[q] for q in p.ranks])
                    mine.append(SampleGroup(p.sample, found[c]))
                steps.append(tuple(mine))
        except (ValueError, parallel_state.ParallelStateError) as exc:
            problem = f"rank {me} of the dp x cp group: {exc}"
    table = gather([plan.fingerprint(), 1 if problem else 0], dp_cp)
    if len({row[0] for row in table}) > 1:
        raise ValueError(f"{what}: the dp x cp ranks hold different plans; build it from the same lengths, masks, "
                         f"rates and shape on every rank")
    failed = [r for r, row in enumerate(table) if row[1]]
    if failed:
        raise ValueError(f"{what}: " + (problem or f"ranks {failed} of the dp x cp group could not run the plan "
                                                   f"(their error names why)"))
    return tuple(steps)


def run_samples(plan: parallel_state.SamplePlan, loss_fn: Callable[[int, Any, parallel_state.DispatchPlan], torch.Tensor],
                parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """One training step of ``plan`` on this rank: the batch's loss (sum over every token / ``plan.total_tokens``),
    the same on every rank, with the gradients of ``parameters`` summed over the dp x cp group.

    ``loss_fn(index, group, dispatch_plan)`` runs sample ``index`` on this rank's part of it (``group``:
    its group or None; ``dispatch_plan``: ``plan.dispatch_plan(index)``, whose tokens ``cp.dispatch`` takes)
    and returns the loss summed over this rank's tokens, a scalar. Each is scaled and taken backward at
    once (activations of one sample at a time); a parameter no sample reached gets a zero gradient.
    """
    params = list(parameters)
    dp_cp = _dp_cp("run_samples")
    total: torch.Tensor | None = None  # summed where the losses are: no host sync per sample
    for step in sample_groups(plan):
        for index, group in step:
            loss = loss_fn(index, group, plan.dispatch_plan(index))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"run_samples: loss_fn must return the loss summed over this rank's tokens as a "
                                f"one-element tensor, got {type(loss).__name__} for sample {index}")
            (loss / plan.total_tokens).backward()
            part = loss.detach().double().reshape(())
            total = part if total is None else total + part
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # One all-reduce per dtype and device (a flat bucket each), the loss with its own on the group's device.
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_cp)
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()
    total = torch.zeros((), dtype=torch.float64) if total is None else total
    total = total.to(meta_device(dp_cp))
    dist.all_reduce(total, group=dp_cp)
    return total.cpu() / plan.total_tokens


__all__ = ["SampleGroup", "plan_samples", "run_samples", "sample_groups"]
