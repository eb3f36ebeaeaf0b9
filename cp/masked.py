"""The arguments of masked attention (``mask=`` / ``plan=``): the plan, its schedule, the checks across ranks.

Shared by ``ring_attention``, ``ulysses_attention`` and ``usp_attention`` with a ``cp.Mask`` or a
``cp.DispatchPlan``: group rank i holds the global tokens ``positions[i]`` (in that order); the
schedule (``cp.mask_schedule``, built once per mask and layout and cached) says which of its K/V
each other rank needs, and ``cp.engine`` attends by it, K/V travelling as the plan's transport says
(``DispatchPlan.transport``; point to point from owner to the ranks that need them by default).

With one rank (``group=None``) this is plain masked attention over the whole sequence, the tokens
in any order: Ulysses uses it on the whole sequence it holds after its all-to-all.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from cp import engine, mask_schedule, transports
from cp.agree import start
from cp.comm import global_ranks
from cp.engine import AttentionCall, Confirm, StartCheck
from cp.inputs import Call, Tensors
from cp.mask_schedule import Schedule


def schedule(plan: Any, positions_key: Any, positions: Any, rank: int, device: torch.device) -> Schedule:
    """The cached schedule of group rank ``rank`` for ``plan``'s mask on the layout ``positions`` (a function
    of the plan and ``positions_key``, called only when the schedule is built), its indices on ``device``."""
    def make() -> Schedule:
        if device.type == "cpu":
            return mask_schedule.build(plan.mask, plan.length, positions(), rank)
        return schedule(plan, positions_key, positions, rank, torch.device("cpu")).to(device)

    return mask_schedule.cached(plan, (positions_key, rank, str(device)), make)


def agree(call: Call, named: Sequence[tuple[str, int]]) -> None:
    """One agreement check (``cp.agree``): raise the same ValueError on every rank unless every rank passed the same
    plan (and transport) and rank i holds ``plan.sizes[i]`` tokens in each of ``named`` (name, this rank's count)."""
    start_agree(call, named)(_nothing_posted)


def _nothing_posted(posted: list[list[int]]) -> None:
    """The drain of a check made before any receive is posted: nothing to complete."""


def start_agree(call: Call, named: Sequence[tuple[str, int]], posted: Sequence[int] = ()) -> Confirm:
    """``agree``, started: the gather runs while the caller computes; calling the result waits for it and raises
    as ``agree`` does (call it on every rank before anything else crosses the group).

    ``posted``: the bytes this rank has already posted receives for, from each group rank (as many entries on
    every rank; not judged). On a failed check the result calls its ``drain`` argument with every rank's
    ``posted`` before it raises, so that the caller can complete those receives (``cp.engine``)."""
    m, group, ring_group = call.masking, call.group, call.ring_group
    assert m is not None
    plan = m.plan
    layout, fix = m.layout(call.n)
    want = plan.sizes
    ranks = None if ring_group is not None else global_ranks(group)
    unit = "cp" if ring_group is not None else "group"

    def who(i: int) -> str:
        return f"cp rank {i}" if ranks is None else f"group rank {i} (global {ranks[i]})"

    def judge(table: list[list[int]]) -> str | None:
        counts = [row[2] for row in table]
        if m.even and len(set(counts)) > 1:
            return (f"the ranks hold different numbers of tokens ({counts} by {unit} rank); for uneven shards pass "
                    f"length= (the whole sequence's) or a plan")
        if len({row[0] for row in table}) > 1:
            return (f"the ranks passed different masks or plans (checksums by {unit} rank: {[row[0] for row in table]}); "
                    f"pass the same mask and plan on every rank")
        if len({row[1] for row in table}) > 1:
            return (f"the ranks' plans ask for different transports ({[transports.NAMES[row[1]] for row in table]} by "
                    f"{unit} rank); pass the same plan on every rank")
        bad = [f"{who(i)} holds {row[c]} tokens of {name}, the {layout} gives it {want[i]}"
               for i, row in enumerate(table) for c, (name, _) in enumerate(named, start=2) if row[c] != want[i]]
        return f"{'; '.join(bad)} (every {unit} rank's: {list(want)}); {fix}" if bad else None

    width = 2 + len(named)
    row = [plan.fingerprint(), transports.NAMES.index(plan.transport), *(size for _, size in named), *posted]
    pending = start(row, group, ring_group)

    def confirm(drain: Callable[[list[list[int]]], None]) -> None:
        table = pending.table()
        problem = judge(table)
        if problem:
            drain([r[width:] for r in table])
            raise ValueError(f"{call.what}: {problem}")

    return confirm


def attend(t: Tensors, sched: Schedule, group: Any, scale: float, transport: str = "p2p",
           check: StartCheck | None = None) -> torch.Tensor:
    """Masked attention for ``t``'s q, k, v (K/V heads dividing q's: GQA); this rank's output in q's layout, by
    cp.engine with ``transport`` (a plan's name for it). Every rank of ``group`` (None: one process) must call it.
    ``check``: starts the cross-rank check, which the engine judges once this rank's own block is computed."""
    chosen = transports.choose(transport if group is not None else "p2p", group, t.q.device)
    call = AttentionCall(t.s, t.h, t.groups, scale, group, sched, chosen, check)
    return engine.attend(call, t.q, t.k, t.v)
