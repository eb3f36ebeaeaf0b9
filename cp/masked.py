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

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from cp import engine, mask_schedule, transports
from cp.agree import start
from cp.comm import global_ranks
from cp.engine import AttentionCall, Confirm, StartCheck
from cp.mask_schedule import Schedule
from cp.transports import NAMES as TRANSPORTS

# ----------------------------------------------------------------------------- arguments


def _ps() -> Any:
    import parallel_state

    return parallel_state


@dataclass(frozen=True)
class MaskedArgs:
    """A masked call's arguments as its caller passed them (``mask``, ``plan``, ``causal``, ``length``, the layout
    and ``scale``), so that they travel to the checks as one value."""

    mask: Any
    plan: Any
    causal: Any = False
    length: Any = None
    seq_dim: Any = 1
    head_dim: Any = 2
    scale: Any = None


def resolve(what: str, args: MaskedArgs, n: int, local: int) -> Any:
    """The plan to attend by, from ``args.mask`` / ``plan`` / ``causal``: the plan itself, or with a mask alone the
    contiguous split of ``args.length`` (default: ``n * local``) tokens. Errors name what is wrong and what to pass."""
    ps = _ps()
    mask, plan, causal, length = args.mask, args.plan, args.causal, args.length
    if causal:
        raise ValueError(f"{what}: causal=True cannot be combined with mask= or plan=; pass mask=cp.Mask.causal() "
                         f"(and a plan made for it) instead")
    if mask is not None and not isinstance(mask, ps.AttentionMask):
        raise TypeError(f"{what}: mask must be a cp.Mask (parallel_state.AttentionMask) or None, got "
                        f"{type(mask).__name__}; build one with cp.Mask.causal(), cp.Mask.chunk_causal(chunk), ...")
    if plan is not None:
        if not isinstance(plan, ps.DispatchPlan):
            raise TypeError(f"{what}: plan must be a cp.DispatchPlan (from cp.plan_dispatch) or None, got "
                            f"{type(plan).__name__}")
        if mask is not None and mask != plan.mask:
            raise ValueError(f"{what}: mask={mask!r} differs from the plan's mask {plan.mask!r}; pass the plan alone "
                             f"(its mask is used), or make the plan for this mask with cp.plan_dispatch")
        if plan.cp_size != n:
            raise ValueError(f"{what}: the plan is for {plan.cp_size} rank(s) but the group has {n}; make the plan "
                             f"for this group with cp.plan_dispatch(mask, {plan.length}, {n})")
        if length is not None and length != plan.length:
            raise ValueError(f"{what}: length={length} but the plan is for {plan.length} tokens; leave length out "
                             f"(the plan knows it) or make the plan for {length} tokens")
        return plan
    total = n * local if length is None else length
    try:  # the plain contiguous split (plans are cached by plan_dispatch)
        return ps.plan_dispatch(mask, total, n, method="contiguous")
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


def layout_words(given: Any, plan: Any, n: int) -> tuple[str, str]:
    """How errors name the layout and how to fix a wrong token count: a plan given, or the contiguous split."""
    if given is not None:
        return "plan", "give each rank the tokens cp.dispatch(x, plan, seq_dim, group) gives it"
    return (f"contiguous split of {plan.length} tokens (cp.shard_sizes({plan.length}, {n}))",
            "shard the sequence with cp.split_inputs_cp(x, seq_dim, group, uneven=True) and pass length=")


def schedule(plan: Any, positions_key: Any, positions: Any, rank: int, device: torch.device) -> Schedule:
    """The cached schedule of group rank ``rank`` for ``plan``'s mask on the layout ``positions`` (a function
    of the plan and ``positions_key``, called only when the schedule is built), its indices on ``device``."""
    def make() -> Schedule:
        if device.type == "cpu":
            return mask_schedule.build(plan.mask, plan.length, positions(), rank)
        return schedule(plan, positions_key, positions, rank, torch.device("cpu")).to(device)

    return mask_schedule.cached(plan, (positions_key, rank, str(device)), make)


def agree(what: str, group: Any, plan: Any, named: Sequence[tuple[str, int]], layout: str, fix: str,
          even: bool = False, ring_group: Any = None) -> None:
    """One agreement check (``cp.agree``): raise the same ValueError on every rank unless every rank passed the same
    ``plan`` (and transport) and rank i holds ``plan.sizes[i]`` tokens in each of ``named`` (name, this rank's count).

    ``even``: no plan and no length were given, so every rank must hold the same number of tokens.
    ``ring_group``: ``group`` is the Ulysses group of usp and the ranks are the cp ranks the two span.
    """
    start_agree(what, group, plan, named, layout, fix, even, ring_group)(_nothing_posted)


def _nothing_posted(posted: list[list[int]]) -> None:
    """The drain of a check made before any receive is posted: nothing to complete."""


def start_agree(what: str, group: Any, plan: Any, named: Sequence[tuple[str, int]], layout: str, fix: str,
                even: bool = False, ring_group: Any = None, posted: Sequence[int] = ()) -> Confirm:
    """``agree``, started: the gather runs while the caller computes; calling the result waits for it and raises
    as ``agree`` does (call it on every rank before anything else crosses the group).

    ``posted``: the bytes this rank has already posted receives for, from each group rank (as many entries on
    every rank; not judged). On a failed check the result calls its ``drain`` argument with every rank's
    ``posted`` before it raises, so that the caller can complete those receives (``cp.engine``)."""
    want = plan.sizes
    ranks = None if ring_group is not None else global_ranks(group)
    unit = "cp" if ring_group is not None else "group"

    def who(i: int) -> str:
        return f"cp rank {i}" if ranks is None else f"group rank {i} (global {ranks[i]})"

    def judge(table: list[list[int]]) -> str | None:
        counts = [row[2] for row in table]
        if even and len(set(counts)) > 1:
            return (f"the ranks hold different numbers of tokens ({counts} by {unit} rank); for uneven shards pass "
                    f"length= (the whole sequence's) or a plan")
        if len({row[0] for row in table}) > 1:
            return (f"the ranks passed different masks or plans (checksums by {unit} rank: {[row[0] for row in table]}); "
                    f"pass the same mask and plan on every rank")
        if len({row[1] for row in table}) > 1:
            return (f"the ranks' plans ask for different transports ({[TRANSPORTS[row[1]] for row in table]} by {unit} "
                    f"rank); pass the same plan on every rank")
        bad = [f"{who(i)} holds {row[c]} tokens of {name}, the {layout} gives it {want[i]}"
               for i, row in enumerate(table) for c, (name, _) in enumerate(named, start=2) if row[c] != want[i]]
        return f"{'; '.join(bad)} (every {unit} rank's: {list(want)}); {fix}" if bad else None

    width = 2 + len(named)
    row = [plan.fingerprint(), TRANSPORTS.index(plan.transport), *(size for _, size in named), *posted]
    pending = start(row, group, ring_group)

    def confirm(drain: Callable[[list[list[int]]], None]) -> None:
        table = pending.table()
        problem = judge(table)
        if problem:
            drain([r[width:] for r in table])
            raise ValueError(f"{what}: {problem}")

    return confirm


# ----------------------------------------------------------------------------- the call


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sched: Schedule, group: Any, s: int, h: int,
           scale: float, transport: str = "p2p", check: StartCheck | None = None) -> torch.Tensor:
    """Masked attention for q, k, v in layout (seq dim ``s``, head dim ``h``), K/V heads dividing q's (GQA);
    this rank's output in q's layout, by cp.engine. Every rank of ``group`` (None: one process) must call it.
    ``check``: starts the cross-rank check (``start_agree`` given every argument but ``posted``), which the
    engine judges once this rank's own block is computed."""
    groups = q.shape[h] // k.shape[h]
    chosen = transports.choose(transport if group is not None else "p2p", group, q.device)
    call = AttentionCall(s, h, groups, scale, group, sched, chosen, check)
    return engine.attend(call, q, k, v)
