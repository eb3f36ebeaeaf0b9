"""The arguments of cp's attention calls, checked once where the public function is called, as one value.

``ring_attention`` / ``ring_attention_blocks``, ``ulysses_attention``, ``usp_attention`` and
``seq_to_heads`` / ``heads_to_seq`` turn what they were given into a ``Call`` (its ``Tensors``, layout,
group, scale and, for ``mask=`` / ``plan=``, its ``Masking``) before anything runs; the code after
them takes that value and checks nothing again. Every message starts with the public function's name
(``Call.what``) and says what to pass instead; ranks that passed the same arguments raise the same
error, before any communication. What only the ranks together can see (a rank's token count against
the others', the plan every rank passed) is ``cp.call_check``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import parallel_state as ps
from cp.comm import check_group
from cp.shard import check_tensor, normalize_dim


def group_size(what: str, group: Any, name: str = "cp_group") -> tuple[int, int]:
    """(size, this rank's index) of ``group`` (None: one process), after checking it is a group of this rank."""
    if group is None:
        return 1, 0
    check_group(group, what, name)
    return group.size(), group.rank()


def check_length(what: str, length: Any, n: int, group: str | None = None) -> int | None:
    """``length`` (None passes) as an int of at least ``n``; ``group`` names the ranks in the message (default
    "the group of size n")."""
    if length is None:
        return None
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"{what}: length must be an int (the whole sequence's length over the group) or None, "
                        f"got {type(length).__name__} {length!r}")
    if length < n:
        raise ValueError(f"{what}: length={length} is shorter than {group or f'the group of size {n}'}: every rank "
                         f"needs at least one token; use a group of at most {length} ranks or a longer sequence")
    return length


def check_causal(what: str, causal: Any) -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"{what}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    return causal


def check_scale(what: str, softmax_scale: Any, feature: int) -> float:
    """The scores' scale: ``softmax_scale``, or 1/sqrt(feature dim) for None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(feature)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"{what}: softmax_scale must be a positive number or None (1/sqrt(feature dim)), got "
                         f"{softmax_scale!r}")
    return float(softmax_scale)


def dims(what: str, x: Any, name: str, seq_dim: Any, head_dim: Any, n: int) -> tuple[int, int]:
    """Type- and range-check one tensor's dims; the normalized (seq_dim, head_dim)."""
    check_tensor(what, x, name)
    label = what if name == "x" else f"{what}, {name}"
    s = normalize_dim(label, x.shape, seq_dim, n, "seq_dim")
    h = normalize_dim(label, x.shape, head_dim, n, "head_dim")
    if s == h:
        raise ValueError(f"{what}: seq_dim={seq_dim} and head_dim={head_dim} both name dim {s} of {name}'s shape "
                         f"{tuple(x.shape)}; pass the sequence dimension and the head dimension, which must differ")
    return s, h


def split(what: str, x: torch.Tensor, name: str, dim: int, arg: str, value: int, n: int, kind: str) -> None:
    """ValueError unless ``x``'s dim ``dim`` (``arg=value``, its ``kind``) splits into n equal blocks."""
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: {name} has shape {tuple(x.shape)}: its {kind} ({arg}={value}, size {x.shape[dim]}) cannot be "
            f"split into {n} equal blocks for a group of size {n}; use a {kind} size divisible by {n} or a "
            f"context-parallel group whose size divides {x.shape[dim]}"
        )


@dataclass(frozen=True)
class Tensors:
    """q, k and v of one call: tensors of one number of dims, dtype and device, the sequence at dim ``s`` and the
    heads at dim ``h`` (normalized; the last remaining dim is the feature dim); ``seq_dim`` / ``head_dim`` as
    the caller passed them, for messages."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    s: int
    h: int
    seq_dim: Any
    head_dim: Any

    @property
    def feature(self) -> int:
        """q's feature dim: the last dim once the sequence and head dims are taken."""
        return self.q.movedim((self.h, self.s), (-3, -2)).shape[-1]

    @property
    def groups(self) -> int:
        """Query heads per K/V head (GQA)."""
        return self.q.shape[self.h] // self.k.shape[self.h]

    @property
    def local(self) -> int:
        """This rank's tokens of q."""
        return self.q.shape[self.s]

    def tokens(self) -> list[tuple[str, int]]:
        """(name, this rank's tokens) of q, k and v."""
        return [("q", self.q.shape[self.s]), ("k", self.k.shape[self.s]), ("v", self.v.shape[self.s])]

    def kv_repeats(self, what: str, n: int) -> list[int]:
        """How many times each head of K and of V is repeated so that n ranks get whole head blocks (Ulysses)."""
        return [_kv_repeats(what, self.q, t, name, self.h, n) for name, t in (("k", self.k), ("v", self.v))]


def _kv_repeats(what: str, q: torch.Tensor, t: torch.Tensor, name: str, h: int, n: int) -> int:
    heads, q_heads = t.shape[h], q.shape[h]
    if heads % n == 0:
        return 1
    if heads and q_heads % heads == 0:
        # lcm(heads, n) divides q's heads (both heads and n do): the fewest copies giving n whole blocks.
        return n // math.gcd(heads, n)
    raise ValueError(
        f"{what}: {name} has shape {tuple(t.shape)}: its number of heads ({heads}) cannot be split into {n} equal "
        f"blocks for a group of size {n}, nor does it divide q's {q_heads} heads (grouped-query "
        f"attention); use such a head count or a group size that divides {heads}")


def tensors(what: str, q: Any, k: Any, v: Any, seq_dim: Any, head_dim: Any, n: int, *,
            computed: bool = True) -> Tensors:
    """q, k and v checked as one ``Tensors`` for a group of n.

    ``computed``: cp computes the attention itself (not the caller's ``attn_fn``), so the tensors must also
    make one attention: at least 3 dims, a floating dtype, the same batch dims and sequence length, K and V
    with one head count dividing q's, q's and k's feature dims equal.
    """
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        check_tensor(what, t, name)
    s, h = [dims(what, t, name, seq_dim, head_dim, n) for name, t in named][0]
    if len({t.dim() for t in (q, k, v)}) != 1 or len({(t.dtype, t.device) for t in (q, k, v)}) != 1:
        raise ValueError(
            f"{what}: q, k and v must have the same number of dims, dtype and device; got "
            + ", ".join(f"{nm} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"
                        for nm, t in named) + "; convert them to one dtype and device")
    out = Tensors(q, k, v, s, h, seq_dim, head_dim)
    if not computed:
        return out
    if q.dim() < 3:
        raise ValueError(f"{what}: q has shape {tuple(q.shape)}; attention needs at least 3 dims (sequence, heads "
                         f"and the feature dim, which is the last dim left once seq_dim and head_dim are taken)")
    if not q.dtype.is_floating_point:
        raise TypeError(f"{what}: q, k and v have dtype {q.dtype}; attention needs a floating-point dtype")
    qs, ks, vs = (tuple(t.movedim((h, s), (-3, -2)).shape) for t in (q, k, v))
    problems = []
    if not qs[:-3] == ks[:-3] == vs[:-3]:
        problems.append("their batch dims differ")
    if not qs[-2] == ks[-2] == vs[-2]:
        problems.append(f"their sequence lengths differ ({qs[-2]}, {ks[-2]}, {vs[-2]}): each rank's q, k and v "
                        f"must be the same tokens")
    if ks[-3] != vs[-3] or qs[-3] % ks[-3]:
        problems.append(f"k and v must have the same number of heads, and it must divide q's ({qs[-3]}); got k "
                        f"{ks[-3]}, v {vs[-3]}")
    if qs[-1] != ks[-1]:
        problems.append(f"q's and k's feature dims differ ({qs[-1]} and {ks[-1]})")
    if problems:
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"(seq_dim={seq_dim}, head_dim={head_dim}): " + "; ".join(problems))
    return out


@dataclass(frozen=True)
class Masking:
    """A masked call's ``mask`` / ``plan``, resolved: the plan to attend by (``DispatchPlan``), whether the caller
    gave it (else the contiguous split of the mask), and ``even``: neither a plan nor a length was given, so every
    rank must hold as many tokens."""

    plan: Any
    given: bool
    even: bool

    def layout(self, n: int) -> tuple[str, str]:
        """How errors name the layout and how to fix a wrong token count (n: the ranks the plan is for)."""
        if self.given:
            return "plan", "give each rank the tokens cp.dispatch(x, plan, seq_dim, group) gives it"
        length = self.plan.length
        return (f"contiguous split of {length} tokens (cp.shard_sizes({length}, {n}))",
                "shard the sequence with cp.split_inputs_cp(x, seq_dim, group, uneven=True) and pass length=")


def masking(what: str, mask: Any, plan: Any, causal: Any, length: int | None, n: int, local: int) -> Masking:
    """The plan to attend by, from ``mask`` / ``plan`` / ``causal``: the plan itself, or with a mask alone the
    contiguous split of ``length`` (default: ``n * local``) tokens. Errors name what is wrong and what to pass."""
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
        return Masking(plan, True, False)
    total = n * local if length is None else length
    try:  # the plain contiguous split (plans are cached by plan_dispatch)
        resolved = ps.plan_dispatch(mask, total, n, method=ps.Layout.CONTIGUOUS)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None
    return Masking(resolved, False, length is None)


@dataclass(frozen=True, eq=False)
class Facts:
    """What a caller above the attention functions (a face: ``cp.transformer_engine``) adds to a masked call's
    cross-rank check (``cp.call_check``): its own arguments, named, which every rank must pass alike (compared by
    digest, shown by value in the message). Made once per distinct call and reused: the check knows it by identity."""

    fields: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Call:
    """One attention call's arguments, checked: what every method computes from.

    ``what``: the public function (or the face) that every later message names. ``group``: the ranks
    attending together (None: one process), ``n`` of them, this rank ``rank`` among them; usp: its Ulysses
    group, with ``ring_group`` (n = both sizes' product, ``rank`` the cp rank). ``scale``: the scores' scale
    (None where the caller's ``attn_fn`` applies its own). ``masking``: the plan of a masked call;
    ``facts``: its caller's arguments for the cross-rank check (a face's).
    """

    what: str
    tensors: Tensors
    group: Any
    n: int
    rank: int
    scale: float | None
    length: int | None = None
    causal: bool = False
    masking: Masking | None = None
    ring_group: Any = None
    facts: Facts | None = None

    def on(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Call:
        """This checked call on other tensors of the same shapes, dtypes and devices (the checks depend on
        nothing else, so a caller that keys its calls by them checks once)."""
        t = self.tensors
        return Call(self.what, Tensors(q, k, v, t.s, t.h, t.seq_dim, t.head_dim), self.group, self.n, self.rank,
                    self.scale, self.length, self.causal, self.masking, self.ring_group, self.facts)


def masked_call(what: str, q: Any, k: Any, v: Any, group: Any, *, causal: Any, mask: Any, plan: Any, length: Any,
                seq_dim: Any, head_dim: Any, softmax_scale: Any, n: int, rank: int, ring_group: Any = None,
                length_group: str | None = None, facts: Facts | None = None) -> Call:
    """The ``Call`` of ring / Ulysses / usp attention with ``mask`` or ``plan`` over ``n`` ranks (``facts``: a
    face's arguments, checked across the ranks with the call's own)."""
    t = tensors(what, q, k, v, seq_dim, head_dim, n)
    causal = check_causal(what, causal)
    total = check_length(what, length, n, length_group)
    softmax_scale = check_scale(what, softmax_scale, t.feature)
    m = masking(what, mask, plan, causal, total, n, t.local)
    return Call(what, t, group, n, rank, softmax_scale, total, causal, m, ring_group, facts)


__all__ = ["Call", "Facts", "Masking", "Tensors", "check_causal", "check_length", "check_scale", "dims", "group_size",
           "masked_call", "masking", "split", "tensors"]
