"""The rules a topology's sizes must follow, written once, with the error each breach raises.

``sizes`` holds the rules that need no world size (each size's own check, the order's tokens,
the hierarchical context-parallel sizes, gtp_remat with optimizer instances); ``layout`` those
that do (divisibility, megatron-core's two assertions on the expert layout, the optimizer
instances, hybrid context parallelism) and returns the decoder and expert grids. ``TopologyPlan``
runs both under its own names for the sizes (``sizes.TITLES``: "tp size"); ``InitArguments`` runs
``sizes`` under ``initialize_model_parallel``'s parameter names (``tensor_model_parallel_size``, or
the alias the caller wrote), so a bad value is named as the caller spelled it.
"""

from __future__ import annotations

import math
from typing import Mapping

from parallel_state.errors import ParallelStateAssertionError, ParallelStateError, ParallelStateTypeError
from parallel_state.topology.arguments import positive_int
from parallel_state.topology.grid import Grid, normalize_order
from parallel_state.topology.sizes import FIELDS, TITLES, Sizes


def sizes(given: Sizes, names: Mapping[str, str] = TITLES) -> Sizes:
    """``given`` checked by every rule that needs no world size; errors name each size as ``names`` does."""
    checked = {}
    for f in FIELDS:  # each size's own check, under the caller's name for it
        check, value = f.metadata["check"], getattr(given, f.name)
        checked[f.name] = value if check is None else check(names[f.name], value)
    cp, gtp, egtp, instances = checked["cp"], checked["gtp"], checked["egtp"], checked["dist_opt_instances"]
    if (gtp > 1 or egtp > 1) and instances > 1:
        raise ParallelStateAssertionError(
            f"gtp_remat_size={gtp} / expert_gtp_remat_size={egtp} with num_distributed_optimizer_instances="
            f"{instances}: megatron-core 0.19 supports generalized tensor parallelism with one optimizer "
            f"instance only; pass num_distributed_optimizer_instances=1 or gtp sizes of 1"
        )
    normalize_order(checked["order"], {d: checked[d] for d in ("tp", "cp", "pp", "ep")})  # names every size > 1
    hierarchical = checked["hierarchical_cp"]
    if hierarchical is not None:
        if not isinstance(hierarchical, (list, tuple)):
            raise ParallelStateTypeError(
                f"{names['hierarchical_cp']} must be a list of ints or None, got {hierarchical!r}"
            )
        hierarchical = tuple(positive_int("a hierarchical context-parallel size", s) for s in hierarchical)
        if hierarchical and math.prod(hierarchical) != cp:
            raise ParallelStateAssertionError(
                f"hierarchical_context_parallel_sizes {list(hierarchical)} multiply to {math.prod(hierarchical)}, "
                f"not context_parallel_size={cp}; give sizes whose product is {cp}"
            )
    return Sizes(**{**checked, "hierarchical_cp": hierarchical})


def layout(world: int, s: Sizes, hybrid_cp: bool = False) -> tuple[Grid, Grid]:
    """The decoder and expert grids of ``s`` over ``world`` ranks, by every rule that needs the world size.

    Where megatron-core refuses an order because the expert layout's pipelines would differ from
    the decoder's, but nothing is laid out apart (no expert parallelism: ep 1, expert tp = tp, the
    same gtp_remat), the expert grid is the decoder's (expert dp = dp x cp): a deliberate difference.
    """
    tp, cp, pp, ep, etp, gtp, egtp = s.tp, s.cp, s.pp, s.ep, s.expert_tp, s.gtp, s.egtp
    if world % (tp * cp * pp * gtp):
        gtp_part = ("*gtp_remat", f"*{gtp}") if gtp > 1 else ("", "")
        raise ParallelStateError(
            f"world size {world} is not divisible by tp*cp*pp{gtp_part[0]} = {tp}*{cp}*{pp}{gtp_part[1]} = "
            f"{tp * cp * pp * gtp}; choose sizes whose product divides the world size"
        )
    if world % (etp * ep * pp * egtp):
        egtp_part = ("*expert gtp_remat", f"*{egtp}") if egtp > 1 else ("", "")
        raise ParallelStateError(
            f"world size {world} is not divisible by expert tp*ep*pp{egtp_part[0]} = {etp}*{ep}*{pp}{egtp_part[1]} "
            f"= {etp * ep * pp * egtp}; choose expert_tensor_parallel_size and expert_model_parallel_size whose "
            f"product with pp divides it"
        )
    decoder_order, expert_order = s.orders()
    decoder = Grid(world, tp=tp, cp=cp, pp=pp, gtp_remat=gtp, order=decoder_order)
    expert = Grid(world, tp=etp, ep=ep, pp=pp, gtp_remat=egtp, order=expert_order)
    apart = ep > 1 or etp != tp or egtp != gtp  # the expert layout differs from the decoder's
    # megatron-core's two assertions on the expert layout, in its order; the first tests the order as
    # written (so 'PP' is not 'pp' there).
    unequal_dp = not s.order.endswith("pp") and pp > 1 and expert.dp != decoder.dp
    other_pipelines = decoder.signature("pp") != expert.signature("pp")
    with_gtp = gtp > 1 or egtp > 1
    if not apart and (unequal_dp or other_pipelines):
        # megatron-core refuses this order (with cp, its expert layout has another data-parallel size
        # and maybe other pipelines); with nothing to lay out apart, the expert groups are the decoder's.
        expert = decoder
    elif unequal_dp:
        raise ParallelStateAssertionError(
            f"order {s.order!r} does not end with 'pp' and pp is {pp}, so megatron-core needs the attention and MoE "
            f"layers' data-parallel sizes equal (\"When not using pp-last rank ordering, the data parallel size of "
            f"the attention and moe layers must be the same\"), but dp is {decoder.dp} and expert dp is {expert.dp}: "
            f"end the order with 'pp' (lower case, as megatron-core compares it), or make expert_tensor_parallel_size "
            f"* expert_model_parallel_size{' * expert_gtp_remat_size' if with_gtp else ''} equal tp * cp"
            f"{' * gtp_remat_size' if with_gtp else ''} ({tp * cp * gtp})"
        )
    elif other_pipelines:
        raise ParallelStateAssertionError(
            f"order {s.order!r} puts pp after dp, so the expert layout (expert tp {etp} x ep {ep}"
            f"{f' x expert gtp_remat {egtp}' if with_gtp else ''}) must have the decoder's data-parallel size "
            f"({decoder.dp}), but it has {expert.dp}: make expert_tensor_parallel_size * expert_model_parallel_size"
            f"{' * expert_gtp_remat_size' if with_gtp else ''} equal tp * cp{' * gtp_remat_size' if with_gtp else ''} "
            f"({tp * cp * gtp}), or end the order with 'pp'"
        )
    instances = s.dist_opt_instances
    edp = expert.dp * (cp if expert is decoder else 1)
    if (decoder.dp * cp) % instances or edp % instances:
        raise ParallelStateAssertionError(
            f"num_distributed_optimizer_instances={instances} must divide the data-parallel sizes: dp x cp = "
            f"{decoder.dp * cp} and expert dp = {edp}; pick a divisor of both"
        )
    if hybrid_cp and (decoder.dp * cp) % 2:
        raise ParallelStateAssertionError(
            f"hybrid_context_parallel needs an even number of dp x cp ranks, got {decoder.dp * cp}; "
            f"change the sizes or turn hybrid context parallelism off"
        )
    return decoder, expert
