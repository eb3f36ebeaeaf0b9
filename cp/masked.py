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

from typing import Any, Sequence

import torch

from cp import engine, mask_schedule
from cp.comm import all_gather_into, global_ranks, meta_device
from cp.engine import AttentionCall
from cp.mask_schedule import Schedule

# ----------------------------------------------------------------------------- arguments


def _ps() -> Any:
    import parallel_state

    return parallel_state


def resolve(what: str, mask: Any, plan: Any, causal: Any, n: int, local: int, length: int | None) -> Any:
    """The plan to attend by, from ``mask`` / ``plan`` / ``causal``: the plan itself, or with a mask alone the
    contiguous split of ``length`` (default: ``n * local``) tokens. Errors name what is wrong and what to pass."""
    ps = _ps()
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
          even: bool = False) -> None:
    """One small all-gather: raise the same ValueError on every rank unless every rank passed the same ``plan``
    and group rank i holds ``plan.sizes[i]`` tokens in each of ``named`` (name, this rank's count).

    ``even``: no plan and no length were given, so every rank must hold the same number of tokens.
    """
    n, want = group.size(), plan.sizes
    mine = torch.tensor([plan.fingerprint()] + [size for _, size in named], dtype=torch.int64,
                        device=meta_device(group))
    rows = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
    all_gather_into(rows, mine, group)
    table = rows.view(n, mine.numel()).tolist()
    ranks = global_ranks(group)
    counts = [row[1] for row in table]
    if even and len(set(counts)) > 1:
        raise ValueError(f"{what}: the ranks hold different numbers of tokens ({counts} by group rank); for uneven "
                         f"shards pass length= (the whole sequence's) or a plan")
    if len({row[0] for row in table}) > 1:
        raise ValueError(f"{what}: the ranks passed different masks or plans (checksums by group rank: "
                         f"{[row[0] for row in table]}); pass the same mask and plan on every rank")
    bad = [f"group rank {i} (global {ranks[i]}) holds {row[c]} tokens of {name}, the {layout} gives it {want[i]}"
           for i, row in enumerate(table) for c, (name, _) in enumerate(named, start=1) if row[c] != want[i]]
    if bad:
        raise ValueError(f"{what}: {'; '.join(bad)} (every rank's: {list(want)}); {fix}")


def agree_usp(what: str, ulysses_group: Any, ring_group: Any, plan: Any, named: Sequence[tuple[str, int]], fix: str,
              even: bool = False) -> None:
    """``agree`` over the cp group that the Ulysses and ring groups span (cp rank = ring rank * u + ulysses rank),
    with one small all-gather in each: the same ValueError on every rank for a wrong token count or plan."""
    u, j, fingerprint = ulysses_group.size(), ring_group.rank(), plan.fingerprint()
    device = meta_device(ulysses_group)
    mine = torch.tensor([fingerprint] + [size for _, size in named], dtype=torch.int64, device=device)
    rows = torch.empty(u * mine.numel(), dtype=torch.int64, device=device)
    all_gather_into(rows, mine, ulysses_group)
    table = rows.view(u, mine.numel()).tolist()
    # This Ulysses group's summary: [checksum, checksums differ, wrong counts, first wrong (cp rank, tensor, count),
    # fewest and most tokens of q].
    wrong = [(j * u + a, c, row[c]) for a, row in enumerate(table) for c in range(1, len(row))
             if row[c] != plan.sizes[j * u + a]]
    first = wrong[0] if wrong else (-1, 0, 0)
    counts = [row[1] for row in table]
    summary = torch.tensor([fingerprint, len({row[0] for row in table}) > 1, len(wrong), *first, min(counts),
                            max(counts)], dtype=torch.int64, device=device)
    r = ring_group.size()
    rows = torch.empty(r * summary.numel(), dtype=torch.int64, device=device)
    all_gather_into(rows, summary, ring_group)
    groups = rows.view(r, summary.numel()).tolist()
    if even and min(g[6] for g in groups) != max(g[7] for g in groups):
        raise ValueError(f"{what}: the cp ranks hold different numbers of tokens (from {min(g[6] for g in groups)} to "
                         f"{max(g[7] for g in groups)}); for uneven shards pass length= (the whole sequence's) or a plan")
    if any(g[1] for g in groups) or len({g[0] for g in groups}) > 1:
        raise ValueError(f"{what}: the ranks passed different masks or plans; pass the same mask and plan on every "
                         f"rank")
    bad = [f"cp rank {g[3]} holds {g[5]} tokens of {named[g[4] - 1][0]}, the plan gives it {plan.sizes[g[3]]}"
           + (f" ({g[2] - 1} more wrong in its Ulysses group)" if g[2] > 1 else "") for g in groups if g[2]]
    if bad:
        raise ValueError(f"{what}: {'; '.join(bad)} (every cp rank's: {list(plan.sizes)}); {fix}")


# ----------------------------------------------------------------------------- the call


def transport_of(plan: Any) -> str:
    """The transport a plan asks for (``DispatchPlan.transport``; "p2p" for plans that do not say)."""
    return getattr(plan, "transport", None) or "p2p"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sched: Schedule, group: Any, s: int, h: int,
           scale: float, transport: str = "p2p") -> torch.Tensor:
    """Masked attention for q, k, v in layout (seq dim ``s``, head dim ``h``), K/V heads dividing q's (GQA);
    this rank's output in q's layout, by cp.engine. Every rank of ``group`` (None: one process) must call it."""
    groups = q.shape[h] // k.shape[h]
    call = AttentionCall(s, h, groups, scale, group, sched, transport if group is not None else "p2p")
    return engine.attend(call, q, k, v)
