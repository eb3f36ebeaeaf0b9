"""Masked attention (``mask=`` / ``plan=``) on a checked call's plan: its cached schedule and its engine call.

Shared by ``ring_attention``, ``ulysses_attention`` and ``usp_attention`` with a ``cp.Mask`` or a
``cp.DispatchPlan``: group rank i holds the global tokens ``positions[i]`` (in that order); the
schedule (``cp.mask_schedule``, built once per mask and layout and cached) says which of its K/V
each other rank needs, and ``cp.engine`` attends by it, K/V travelling as the plan's transport says
(``DispatchPlan.transport``; point to point from owner to the ranks that need them by default).

With one rank (``group=None``) this is plain masked attention over the whole sequence, the tokens
in any order: Ulysses uses it on the whole sequence it holds after its all-to-all. The plan comes
from the call's checked arguments (``cp.inputs.Masking``); the ranks' agreement on it is
``cp.call_check``'s.
"""

from __future__ import annotations

from typing import Any

import torch

import parallel_state as ps
from cp import engine, mask_schedule, transports
from cp.engine import AttentionCall, StartCheck
from cp.inputs import Tensors
from cp.mask_schedule import Schedule


def schedule(plan: Any, positions_key: Any, positions: Any, rank: int, device: torch.device) -> Schedule:
    """The cached schedule of group rank ``rank`` for ``plan``'s mask on the layout ``positions`` (a function
    of the plan and ``positions_key``, called only when the schedule is built), its indices on ``device``."""
    return mask_schedule.cached_on(plan, (positions_key, rank), device,
                                   lambda: mask_schedule.build(plan.mask, plan.length, positions(), rank))


def attend(t: Tensors, sched: Schedule, group: Any, scale: float, transport: ps.Transport = ps.Transport.P2P,
           check: StartCheck | None = None) -> torch.Tensor:
    """Masked attention for ``t``'s q, k, v (K/V heads dividing q's: GQA); this rank's output in q's layout, by
    cp.engine with ``transport`` (a plan's name for it). Every rank of ``group`` (None: one process) must call it.
    ``check``: starts the cross-rank check, which the engine judges once this rank's own block is computed."""
    chosen = transports.choose(transport if group is not None else ps.Transport.P2P, group, t.q.device)
    call = AttentionCall(t.s, t.h, t.groups, scale, group, sched, chosen, check)
    return engine.attend(call, t.q, t.k, t.v)
