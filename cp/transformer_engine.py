"""Transformer Engine's ``DotProductAttention`` on cp's attention engine: the class Cosmos and megatron-core call.

``cp.transformer_engine.DotProductAttention`` takes Transformer Engine's constructor, defaults,
``set_context_parallel_group`` and ``forward`` (those of TE 2.18,
``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``), never imports TE,
and runs wherever torch.distributed runs (gloo on a CPU, NCCL on GPUs). Under context parallelism
its tokens are in TE's layout: every sequence in ``2 * cp`` equal chunks, cp rank r holding chunks
r and ``2 cp - 1 - r`` (DualChunkSwap; for ``thd`` per sequence over ``cu_seqlens_padded``), which
``cp.plan_dual_chunk_swap`` states as a plan; the engine attends by that plan, over the transport
``cp_comm_type`` names. A mask that does not depend on positions (``no_mask``) takes any even split. A cross
attention (keys from another sequence: a prompt's text) gathers its short keys instead (``cp.cross``).

Each distinct call is resolved once on each rank alone (checks, mask, plan, engine path: ``_CALLS``, no
communication); under context parallelism its cross-rank check is the engine call's own, one round per call
(``cp.call_check``), which the face's arguments join (``cp.inputs.Facts``). A rank whose inputs are wrong joins
that round instead of making the call (``cp.call_check.refuse``), so every rank raises before any K/V moves.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, NoReturn, Optional, Tuple, Union

import torch
import torch.distributed as dist

import cp
import parallel_state
from cp import call_check, cross, inputs
from cp.attention import masked_ulysses
from cp.comm import backend_for
from cp.ring import masked_ring
from cp.usp import masked_usp

#: Transformer Engine's release whose signatures and semantics this class follows.
TE_RELEASE = "v2.18"


class QKVFormat(parallel_state.StrEnum):
    """TE's ``qkv_format``: where the sequence and head dims of q, k and v are."""

    SBHD = "sbhd"
    BSHD = "bshd"
    THD = "thd"

    @property
    def seq_dim(self) -> int:
        return 1 if self is QKVFormat.BSHD else 0

    @property
    def head_dim(self) -> int:
        return 1 if self is QKVFormat.THD else 2

    @property
    def ndim(self) -> int:
        return 3 if self is QKVFormat.THD else 4


class CommType(parallel_state.StrEnum):
    """TE's ``cp_comm_type``, and the engine call each one becomes."""

    P2P = "p2p"              # cp.ring_attention, K/V point to point from owner to reader (cp.Transport.P2P)
    ALL_GATHER = "all_gather"  # cp.ring_attention, K/V gathered once (cp.Transport.ALLGATHER)
    A2A = "a2a"              # cp.ulysses_attention: heads scattered, the whole sequence gathered
    A2A_P2P = "a2a+p2p"      # cp.usp_attention over [a2a group, p2p group]

    @property
    def transport(self) -> cp.Transport:
        """The plan's transport this comm type runs (Ulysses' and usp's ring part: point to point)."""
        return cp.Transport.ALLGATHER if self is CommType.ALL_GATHER else cp.Transport.P2P


#: TE's mask types (``transformer_engine.pytorch.constants.AttnMaskTypes``), after its normalisation.
MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right",
              "arbitrary")
ATTENTION_TYPES = ("self", "cross")
#: What our own keyword arguments are, after TE's: the signature test allows exactly these beyond TE's.
EXTRA_PARAMETERS = ("mask",)
#: What forward's messages name.
WHAT = "DotProductAttention.forward"


def _comm_type(what: str, value: Any) -> CommType:
    try:
        return CommType(value)
    except ValueError:
        raise ValueError(f"{what}: unsupported communication type cp_comm_type={value!r}; use one of "
                         f"{[c.value for c in CommType]}") from None


def _mask_type(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what}: attn_mask_type must be a str (one of {MASK_TYPES}), got {type(value).__name__}")
    value = value.replace(",", "_")
    value = "padding_causal" if value == "causal_padding" else value
    if value not in MASK_TYPES:
        raise ValueError(f"{what}: attn_mask_type={value!r} is not one of {MASK_TYPES}")
    return value


def _qkv_format(what: str, value: Any) -> QKVFormat:
    try:
        return QKVFormat(value)
    except ValueError:
        raise ValueError(f"{what}: qkv_format={value!r} is not one of {[f.value for f in QKVFormat]}") from None


def check_window_size(attn_mask_type: str, window_size: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """TE's rule for ``window_size`` under a mask type: ``(-1, 0)`` / ``(w >= 0, 0)`` for causal masks,
    ``(-1, -1)`` / ``(l >= 0, r >= 0)`` for the others; what TE corrects with a warning is corrected so here."""
    what = "DotProductAttention"
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size)):
            raise TypeError(f"{what}: window_size must be None or a pair of ints (left, right), -1 meaning "
                            f"unbounded; got {window_size!r}")
        window_size = (window_size[0], window_size[1])
    if "causal" in attn_mask_type:
        if window_size is None:
            return (-1, 0)
        if window_size == (-1, -1) or (window_size[0] >= 0 and window_size[1] != 0):
            warnings.warn(f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={attn_mask_type}",
                          stacklevel=3)
            return (window_size[0], 0)
        if window_size != (-1, 0) and (window_size[0] < 0 or window_size[1] != 0):
            raise ValueError(f"{what}: window_size={window_size} does not fit attn_mask_type={attn_mask_type}: "
                             f"use (-1, 0) or (w >= 0, 0)")
        return window_size
    if window_size is None:
        return (-1, -1)
    if window_size == (-1, 0):
        warnings.warn(f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={attn_mask_type}",
                      stacklevel=3)
        return (-1, -1)
    if window_size != (-1, -1) and (window_size[0] < 0 or window_size[1] < 0):
        raise ValueError(f"{what}: window_size={window_size} does not fit attn_mask_type={attn_mask_type}: use "
                         f"(-1, -1) or (left >= 0, right >= 0)")
    return window_size


def _window_mask(window_size: Tuple[int, int]) -> Any:
    """TE's window as a ``cp.Mask`` (``-1``: unbounded): ``(-1, -1)`` full, ``(-1, 0)`` causal, else a token window."""
    left, right = (None if w < 0 else w for w in window_size)
    return cp.Mask.token_window(left, right)


# ----------------------------------------------------------------------------- one distinct call, resolved once


@dataclass(frozen=True)
class _Call:
    """Everything a forward needs that depends only on its key: resolved and checked once, on this rank."""

    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    used: int | None          # thd: the tokens before the tail (None: all)
    padding: torch.Tensor | None  # thd: True at this rank's padding tokens ([t, 1, 1]), None when there are none

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The attention of this rank's q, k, v, heads flattened: 0 at padding and after the last sequence."""
        q, k, v = query, key, value
        if self.used is not None:  # thd: the tail after the last sequence attends nothing (its output is 0)
            q, k, v = q[:self.used], k[:self.used], v[:self.used]
        out = self.attend(q, k, v)
        if self.padding is not None:
            out = out.masked_fill(self.padding, 0)
        if self.used is not None:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, query.shape[0] - self.used))
        return out.flatten(-2)


#: Calls resolved so far by this process, shared by every layer (a model's layers make the same few calls). Only
#: this rank's own work: a rank that resolves a call again (forgotten, or in another process) makes the same one.
_CALLS: dict[tuple[Any, ...], _Call] = {}
_MAX_CALLS = 256
#: The last ``cu_seqlens`` read to the host: the layers of one step pass the same tensors (one copy per step).
_LAST_CU: list[Any] = []


def _shown(value: Any) -> str:
    """An argument as a message shows it: a tensor by its shape (its values would crowd out the fix), else repr."""
    return f"<a tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)


def _int_tuple(t: Any, name: str) -> tuple[int, ...]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"DotProductAttention: {name} must be a 1-D integer tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"DotProductAttention: {name} must be a 1-D integer tensor ([batch_size + 1], int32), got "
                         f"shape {tuple(t.shape)} {t.dtype}")
    return tuple(t.tolist())


def _cu_values(tensors: tuple[Any, ...], names: tuple[str, ...]) -> tuple[Any, ...]:
    """The cu_seqlens tensors' values (None stays None), read to the host once for the same unchanged tensors."""
    stamp = tuple((id(t), getattr(t, "_version", None)) for t in tensors)
    if _LAST_CU and _LAST_CU[0] == stamp:
        return _LAST_CU[2]
    values = tuple(None if t is None else _int_tuple(t, n) for t, n in zip(tensors, names, strict=True))
    _LAST_CU[:] = [stamp, tensors, values]  # the tensors are held so that their ids stay theirs
    return values


#: The face's arguments every rank's call is compared by in the cross-rank check, as ``cp.inputs.Facts``.
_FIELDS = ("qkv_format", "attention mask", "cp_comm_type", "q shape", "k shape", "v shape", "dtype", "cu_seqlens",
           "softmax_scale")


@dataclass(frozen=True)
class _Route:
    """Where a context-parallel call runs: the engine's path for its checked call (``cp.inputs.Call``), the call's
    group and usp's ring group (those of its check's round, which a rank that cannot make the call joins
    instead), its ranks and this rank's cp rank."""

    attend: Callable[[inputs.Call], torch.Tensor]
    group: Any
    ring_group: Any
    n: int
    rank: int


def _route(comm: CommType, group: Any) -> _Route | None:
    """The route of a call under ``cp_comm_type`` over ``cp_group`` (``(a2a, p2p)`` for a2a+p2p: cp rank = p2p rank x
    a2a size + a2a rank, as usp_attention takes it); None where context parallelism is off."""
    if isinstance(group, tuple):
        a2a, p2p = group
        u, r = a2a.size(), p2p.size()
        if u * r == 1:
            return None
        rank = p2p.rank() * u + a2a.rank()
        if u == 1:  # usp_attention's own reductions: the ring alone, or Ulysses alone
            return _Route(masked_ring, p2p, None, r, rank)
        return _Route(masked_usp, a2a, None if r == 1 else p2p, u * r, rank)
    if group is None or group.size() == 1:
        return None
    return _Route(masked_ulysses if comm is CommType.A2A else masked_ring, group, None, group.size(), group.rank())


class DotProductAttention(torch.nn.Module):
    """Transformer Engine's ``DotProductAttention`` (its constructor, ``set_context_parallel_group`` and
    ``forward``, TE 2.18), computed by cp's attention engine on any device torch.distributed serves.

    Beyond TE: float32 and float64, every window with every ``cp_comm_type``, ``thd`` with ``a2a+p2p``,
    and ``mask=`` (keyword only, after TE's parameters): any ``cp.Mask`` over the whole sequence (for
    ``thd`` the whole packed batch), used instead of ``attn_mask_type`` and ``window_size``.
    Not supported (each a ValueError naming it): dropout while training, attention bias and ALiBi,
    softmax types other than ``vanilla``, ``return_max_logit``, FP8, KV caching (``inference_params``),
    ``score_mod``, the ``arbitrary`` mask (pass a ``cp.Mask``) and ``padding`` masks on ``sbhd`` / ``bshd``
    (use ``thd``). Cross attention (k / v another sequence than q; thd: ``cu_seqlens_kv`` of their own), with and
    without context parallelism: every query sees every key of its sample (``cp.cross``; under context
    parallelism the keys are gathered over the cp group whatever ``cp_comm_type``).
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group: Optional[Union[dist.ProcessGroup, List[dist.ProcessGroup]]] = None,
        cp_global_ranks: List[int] = None,
        cp_stream: torch.cuda.Stream = None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: Optional[bool] = False,
        name: Optional[str] = None,
        *,
        mask: Any = None,
    ) -> None:
        super().__init__()
        what = "DotProductAttention"
        channels = _check_sizes(what, num_attention_heads, kv_channels, num_gqa_groups, tp_size)
        _check_options(what, attention_type, attention_dropout, softmax_type, return_max_logit, mask)
        self.qkv_format = _qkv_format(what, qkv_format).value
        self.attn_mask_type = _mask_type(what, attn_mask_type)
        self.window_size = check_window_size(self.attn_mask_type, window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.tp_group = tp_group
        self.tp_size = tp_size if tp_group is None else dist.get_world_size(tp_group)
        self.sequence_parallel = sequence_parallel
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = channels
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        self.attention_type = attention_type
        self.attention_dropout = attention_dropout
        self.softmax_type, self.softmax_offset = softmax_type, None
        self.return_max_logit = False
        self.softmax_scale = _softmax_scale(what, softmax_scale, channels[0])
        self.name = name
        self.mask = mask
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(
        self,
        cp_group: Union[dist.ProcessGroup, List[dist.ProcessGroup], None],
        cp_global_ranks: List[int],
        cp_stream: torch.cuda.Stream,
        cp_comm_type: str = "p2p",
    ) -> None:
        """Set the context-parallel group (for ``"a2a+p2p"`` the list ``[a2a group, p2p group]``), its global ranks,
        the stream (kept, unused: the engine overlaps on its own) and the communication type. ``None`` or a
        group of one turns context parallelism off. An unknown ``cp_comm_type`` is a ValueError, as in TE."""
        what = "DotProductAttention.set_context_parallel_group"
        comm = _comm_type(what, cp_comm_type)
        if isinstance(cp_group, (list, tuple)):
            if comm is not CommType.A2A_P2P or len(cp_group) != 2:
                raise ValueError(f"{what}: a list of groups is for cp_comm_type='a2a+p2p' and holds two, [a2a group, "
                                 f"p2p group]; got {len(cp_group)} group(s) with cp_comm_type={comm.value!r}")
            for g, role in zip(cp_group, ("a2a", "p2p"), strict=True):
                if not isinstance(g, dist.ProcessGroup):
                    raise TypeError(f"{what}: the {role} group must be a torch.distributed ProcessGroup, got "
                                    f"{type(g).__name__}")
            cp_group = list(cp_group)
        elif cp_group is not None:
            if not isinstance(cp_group, dist.ProcessGroup):
                raise TypeError(f"{what}: cp_group must be a torch.distributed ProcessGroup, a list [a2a group, p2p "
                                f"group] or None, got {type(cp_group).__name__}")
            if comm is CommType.A2A_P2P and cp_group.size() > 1:
                raise ValueError(f"{what}: cp_comm_type='a2a+p2p' needs cp_group=[a2a group, p2p group] (megatron's "
                                 f"parallel_state.get_hierarchical_context_parallel_groups()), got one group")
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_stream = cp_stream
        self.cp_comm_type = comm.value

    # ------------------------------------------------------------------------- forward

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
        qkv_format: str = None,
        cu_seqlens_q: torch.Tensor = None,
        cu_seqlens_kv: torch.Tensor = None,
        cu_seqlens_q_padded: torch.Tensor = None,
        cu_seqlens_kv_padded: torch.Tensor = None,
        max_seqlen_q: int = None,
        max_seqlen_kv: int = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params: Optional[Any] = None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        num_splits: Optional[int] = 1,
        score_mod: Optional[Callable] = None,
        score_mod_bprop: Optional[Callable] = None,
        score_mod_tensors: Optional[Dict[str, torch.Tensor]] = None,
        score_mod_bprop_tensors: Optional[Dict[str, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Attention of this rank's q, k, v (TE's layouts: sbhd ``[s, b, h, d]``, bshd ``[b, s, h, d]``, thd
        ``[t, h, d]``); returns ``[s, b, h * dv]``, ``[b, s, h * dv]`` or ``[t, h * dv]``. Under context parallelism
        each rank holds its DualChunkSwap chunks; thd takes the global ``cu_seqlens_q`` and ``cu_seqlens_q_padded``,
        and the output (and every gradient) is 0 at padding tokens. ``max_seqlen_*``, ``bottom_right_diagonal`` (the
        same for self attention), ``checkpoint_core_attention`` (the backward recomputes anyway), ``fast_zero_fill``,
        ``pad_between_seqs`` and ``num_splits`` are accepted and need nothing."""
        unsupported = _unsupported((core_attention_bias_type, core_attention_bias, alibi_slopes, inference_params,
                                    score_mod, score_mod_bprop, score_mod_tensors, score_mod_bprop_tensors, fp8_output,
                                    self.attention_dropout if self.training else 0.0))
        fmt = self.qkv_format if qkv_format is None else qkv_format
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        window = self.window_size if window_size is None else window_size
        settings = self._settings()
        cu: tuple[Any, ...] = ()
        if fmt == "thd":
            try:
                cu = _cu_values((cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded),
                                ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"))
            except (TypeError, ValueError) as exc:
                _refuse(settings, exc)
        call = _cached_call(settings, fmt, mask_type, window, unsupported, cu, query_layer, key_layer, value_layer)
        return call.run(query_layer, key_layer, value_layer)

    def _settings(self) -> Settings:
        """What a call reads of this module's settings, as they are now."""
        group = tuple(self.cp_group) if isinstance(self.cp_group, list) else self.cp_group
        return Settings(self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v,
                        self.num_gqa_groups_per_partition, self.softmax_scale, self.attention_type, self.mask,
                        self.cp_comm_type, group, None if self.cp_global_ranks is None else tuple(self.cp_global_ranks))


# ----------------------------------------------------------------------------- the constructor's checks


def _check_sizes(what: str, heads: Any, kv_channels: Any, gqa_groups: Any, tp_size: Any) -> tuple[int, int]:
    """The head counts and sizes, checked: the (k, v) head sizes."""
    for arg, value in (("num_attention_heads", heads), ("num_gqa_groups", gqa_groups), ("tp_size", tp_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{what}: {arg} must be a positive int, got {value!r}")
    channels = (kv_channels, kv_channels) if isinstance(kv_channels, int) else kv_channels
    if (not isinstance(channels, (tuple, list)) or len(channels) != 2
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in channels)):
        raise ValueError(f"{what}: kv_channels must be a positive int or a pair (k head size, v head size), got "
                         f"{kv_channels!r}")
    groups = heads if gqa_groups is None else gqa_groups
    if heads % groups:
        raise ValueError(f"{what}: num_attention_heads={heads} must be divisible by num_gqa_groups={groups}")
    return channels[0], channels[1]


def _check_options(what: str, attention_type: Any, dropout: Any, softmax_type: Any, return_max_logit: Any,
                   mask: Any) -> None:
    """The attention's kind and the options cp's engine does not take."""
    if attention_type not in ATTENTION_TYPES:
        raise ValueError(f"{what}: attention_type={attention_type!r} is not one of {ATTENTION_TYPES}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise ValueError(f"{what}: attention_dropout must be a probability in [0, 1], got {dropout!r}")
    if softmax_type != "vanilla":
        raise ValueError(f"{what}: softmax_type={softmax_type!r} (sink attention) is not supported by cp's "
                         f"engine; use softmax_type='vanilla'")
    if return_max_logit:
        raise ValueError(f"{what}: return_max_logit=True is not supported by cp's engine; leave it False")
    if mask is not None and not isinstance(mask, cp.Mask):
        raise TypeError(f"{what}: mask must be a cp.Mask or None, got {type(mask).__name__}; build one with "
                        f"cp.Mask.chunk_causal(chunk), cp.Mask.token_window(left, right), ...")


def _softmax_scale(what: str, softmax_scale: Any, k_size: int) -> float:
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(k_size)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"{what}: softmax_scale must be a positive number or None (1/sqrt(k head size)), got "
                         f"{softmax_scale!r}")
    return float(softmax_scale)


# ----------------------------------------------------------------------------- a call, resolved (pure) and run


class Settings(NamedTuple):
    """What a call reads of the face's settings: head sizes, K/V heads per tensor-parallel rank, the scale, the
    attention type, ``mask=``, the comm type, the cp group (a tuple for ``[a2a, p2p]``) and ``cp_global_ranks``."""

    k_size: int
    v_size: int
    kv_heads: int
    scale: float
    attention_type: str
    mask: Any
    comm: str
    group: Any
    global_ranks: tuple[int, ...] | None


@dataclass(frozen=True)
class PlanArgs:
    """A self attention's layout: the whole length, the padded sequence boundaries and the real tokens' (start,
    length) of each sequence (thd; None otherwise)."""

    length: int
    bounds: tuple[int, ...] | None = None
    real: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class Resolved:
    """One distinct call, resolved by ``resolve``: its format, comm type, route (None: one process) and the face's
    arguments for the cross-rank check; a self attention's mask and plan arguments, or a cross attention's call."""

    fmt: QKVFormat
    comm: CommType
    route: _Route | None
    facts: inputs.Facts | None
    mask: Any = None
    plan: PlanArgs | None = None
    cross: cross.CrossCall | None = None


def resolve(settings: Settings, fmt_name: Any, mask_type: Any, window: Any, unsupported: tuple[Any, ...],
            cu: tuple[Any, ...], q: Any, k: Any, v: Any) -> Resolved:
    """A call of the face with ``settings`` on q, k, v (and thd's ``cu_seqlens`` values), resolved on this rank alone:
    every check (a TypeError / ValueError naming what to change), the mask and plan arguments or the cross call.
    No communication and no state: the same arguments give the same value on any rank."""
    comm = CommType(settings.comm)
    route = _route(comm, settings.group)
    fmt = _qkv_format(WHAT, fmt_name)
    _check_unsupported(unsupported)
    mask_type = _mask_type(WHAT, mask_type)
    window = check_window_size(mask_type, window)
    _check_tensors(settings, fmt, q, k, v)
    _check_route(q, route, settings.group, settings.global_ranks)
    if _is_cross(fmt, q, k, cu, route, settings.attention_type):
        facts = _facts(settings, fmt, f"cross {mask_type}", comm, q, k, v, cu, route)
        return Resolved(fmt, comm, route, facts,
                        cross=_cross(settings, fmt, mask_type, window, cu, q, k, v, route, facts))
    mask, plan = _self_attention(settings, fmt, mask_type, window, q, k, cu, route, comm)
    return Resolved(fmt, comm, route, _facts(settings, fmt, str(mask), comm, q, k, v, cu, route), mask, plan)


def _cached_call(settings: Settings, fmt: Any, mask_type: Any, window: Any, unsupported: tuple[Any, ...],
                 cu: tuple[Any, ...], q: Any, k: Any, v: Any) -> _Call:
    """The call for these arguments: ``_CALLS``' entry, else resolved (and remembered)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        _resolve_call(settings, fmt, mask_type, window, unsupported, cu, q, k, v)  # raises
    key = (settings, fmt, mask_type, window, unsupported, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, cu)
    call = _CALLS.get(key)
    if call is None:
        call = _resolve_call(settings, fmt, mask_type, window, unsupported, cu, q, k, v)
        if len(_CALLS) >= _MAX_CALLS:
            _CALLS.clear()
        _CALLS[key] = call
    return call


def _resolve_call(settings: Settings, fmt: Any, mask_type: Any, window: Any, unsupported: tuple[Any, ...],
                  cu: tuple[Any, ...], q: Any, k: Any, v: Any) -> _Call:
    """``resolve`` and the engine's path for it. Under context parallelism a bad input becomes this rank's part of
    the check the other ranks' engine calls run (``cp.call_check.refuse``): every rank raises, naming this rank and
    what to change."""
    try:
        resolved = resolve(settings, fmt, mask_type, window, unsupported, cu, q, k, v)
        if resolved.cross is not None:
            return _Call(resolved.cross.run, None, None)
        return _engine_call(resolved, settings.scale, q)
    except (TypeError, ValueError) as exc:
        _refuse(settings, exc)


def _refuse(settings: Settings, error: Exception) -> NoReturn:
    """Raise ``error``, a bad input found on this rank alone: as it is without context parallelism, else through
    this rank's part in the call's cross-rank check (``cp.call_check.refuse``), so that every rank raises (the
    others naming this rank and the reason) before any K/V moves."""
    route = _route(CommType(settings.comm), settings.group)
    if route is None:
        raise error
    reason = str(error).removeprefix(f"{WHAT}: ").removeprefix("DotProductAttention: ")
    call_check.refuse(WHAT, reason, route.group, route.ring_group)


#: TE's forward arguments cp's engine does not take, in forward's order: each with the test of its neutral value
#: and the fix a message names (None: leave it None). attention_dropout: its value while training, else 0.
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str | None], ...] = (
    ("core_attention_bias_type", lambda x: x == "no_bias", "use core_attention_bias_type='no_bias'"),
    *((name, lambda x: x is None, None) for name in ("core_attention_bias", "alibi_slopes", "inference_params",
                                                     "score_mod", "score_mod_bprop", "score_mod_tensors",
                                                     "score_mod_bprop_tensors")),
    ("fp8_output", lambda x: not x, "leave fp8_output False"),
    ("attention_dropout", lambda x: not x > 0, "set attention_dropout=0.0 (or call .eval())"),
)


def _unsupported(values: tuple[Any, ...]) -> tuple[tuple[str, Any], ...]:
    """(name, value) of each argument in ``_UNSUPPORTED``'s order whose value the engine does not take."""
    return tuple((name, x) for (name, neutral, _), x in zip(_UNSUPPORTED, values, strict=True) if not neutral(x))


def _check_unsupported(unsupported: tuple[Any, ...]) -> None:
    """A ValueError naming every argument the engine does not support and what to pass instead."""
    if unsupported:
        fixes = {name: fix for name, _, fix in _UNSUPPORTED}
        raise ValueError(f"{WHAT}: cp's engine does not support "
                         + "; ".join(f"{n}={_shown(val)} ({fixes[n] or 'leave it None'})" for n, val in unsupported))


def _facts(settings: Settings, fmt: QKVFormat, mask: str, comm: CommType, q: Any, k: Any, v: Any,
           cu: tuple[Any, ...], route: _Route | None) -> inputs.Facts | None:
    """The face's arguments every rank's call is compared by (None without context parallelism)."""
    if route is None:
        return None
    return inputs.Facts(tuple(zip(_FIELDS, (fmt.value, mask, comm.value, tuple(q.shape), tuple(k.shape),
                                            tuple(v.shape), str(q.dtype), cu, settings.scale), strict=True)))


def _check_tensors(settings: Settings, fmt: QKVFormat, q: Any, k: Any, v: Any) -> None:
    """q, k and v against the format and the face's head counts and sizes."""
    what = WHAT
    tensors = (("query_layer", q), ("key_layer", k), ("value_layer", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != fmt.ndim:
            raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}; qkv_format={fmt.value!r} needs "
                             f"{fmt.ndim} dims ({fmt.value})")
    if len({t.dtype for _, t in tensors}) != 1 or len({t.device for _, t in tensors}) != 1:
        raise ValueError(f"{what}: queries, keys and values must have the same dtype and device; got "
                         + ", ".join(f"{n} {t.dtype} on {t.device}" for n, t in tensors))
    if not q.dtype.is_floating_point:
        raise TypeError(f"{what}: q, k and v have dtype {q.dtype}; attention needs a floating-point dtype")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{what}: keys {tuple(k.shape)} and values {tuple(v.shape)} must have the same batch "
                         f"size, sequence length and number of heads")
    dk, dv = settings.k_size, settings.v_size
    if q.shape[-1] != dk or k.shape[-1] != dk or v.shape[-1] != dv:
        raise ValueError(f"{what}: head sizes q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]} differ from "
                         f"kv_channels=({dk}, {dv})")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads != settings.kv_heads:
        raise ValueError(f"{what}: keys and values must have num_gqa_groups / tp_size = {settings.kv_heads} heads, "
                         f"found {kv_heads}")
    if heads % kv_heads:
        raise ValueError(f"{what}: q's {heads} heads are not divisible by the {kv_heads} K/V heads (GQA groups)")
    s = fmt.seq_dim
    if fmt is not QKVFormat.THD and q.shape[1 - s] != k.shape[1 - s]:
        raise ValueError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} have different batch sizes")


def _cross(settings: Settings, fmt: QKVFormat, mask_type: str, window: Any, cu: tuple[Any, ...], q: Any, k: Any,
           v: Any, route: _Route | None, facts: inputs.Facts | None) -> cross.CrossCall:
    """A cross call (``cp.cross``): each query to every key of its sample; under context parallelism the keys
    gathered over the cp group, whatever ``cp_comm_type``."""
    what = WHAT
    n = 1 if route is None else route.n
    if settings.mask is not None:
        raise ValueError(f"{what}: mask={settings.mask} applies to self attention only, and this call is cross "
                         f"attention (q {tuple(q.shape)}, k {tuple(k.shape)}, attention_type="
                         f"{settings.attention_type!r}); build the cross attention without mask=")
    want = "padding" if fmt is QKVFormat.THD else "no_mask"
    if mask_type != want or window != (-1, -1):
        raise ValueError(f"{what}: cross attention here lets every query see every key of its sample: with "
                         f"qkv_format={fmt.value!r} it takes attn_mask_type={want!r} and window_size (-1, -1); "
                         f"got {mask_type!r}, window_size={window}")
    layout = cross.Placement(fmt.seq_dim, fmt.head_dim)
    if fmt is QKVFormat.THD:
        cu_q, cu_kv, pad_q, pad_kv = _thd_boundaries(cu, n)
        if len(cu_q) != len(cu_kv):
            raise ValueError(f"{what}: cu_seqlens_q {list(cu_q)} and cu_seqlens_kv {list(cu_kv)} hold different "
                             f"numbers of samples; a cross attention's queries and keys come from the same samples")
        layout = cross.Placement(0, 1, cross.packed(what, "q", cu_q, pad_q, q.shape[0], n),
                              cross.packed(what, "kv", cu_kv, pad_kv, k.shape[0], n))
    groups = () if route is None else (route.group,) + (() if route.ring_group is None else (route.ring_group,))
    return cross.resolve(what, layout, q, k, v, settings.scale, groups=groups, n=n,
                         rank=0 if route is None else route.rank, facts=facts)


def _self_attention(settings: Settings, fmt: QKVFormat, mask_type: str, window: Any, q: Any, k: Any,
                    cu: tuple[Any, ...], route: _Route | None, comm: CommType) -> tuple[Any, PlanArgs]:
    """A self attention's mask over the whole sequence and its plan arguments."""
    what = WHAT
    cp_size = 1 if route is None else route.n
    if cp_size > 1:
        heads = q.shape[-2]
        a2a = cp_size if comm is CommType.A2A else settings.group[0].size() if comm is CommType.A2A_P2P else 1
        if heads % a2a:
            raise ValueError(f"{what}: cp_comm_type={comm.value!r} scatters heads over {a2a} ranks, but q has "
                             f"{heads} heads; use a head count divisible by {a2a}, or cp_comm_type='p2p'")
    if fmt is QKVFormat.THD:
        return _packed_self_attention(settings, mask_type, window, q, cu, cp_size)
    if "padding" in mask_type or mask_type == "arbitrary":
        raise ValueError(f"{what}: attn_mask_type={mask_type!r} with qkv_format={fmt.value!r} is not supported; "
                         f"for padded sequences use qkv_format='thd' with cu_seqlens, for any other mask pass "
                         f"mask=cp.Mask... to the constructor")
    user_mask, s = settings.mask, fmt.seq_dim
    mask = user_mask if user_mask is not None else _window_mask(window)
    if q.shape[s] != k.shape[s] and not (mask == cp.Mask.full() or (
            mask == cp.Mask.causal() and user_mask is None and "bottom_right" not in mask_type)):
        raise ValueError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in length (cross attention): "
                         f"here it takes attn_mask_type 'no_mask' or 'causal' (top-left) only, got "
                         f"{mask_type!r} with window_size={window}" + ("" if user_mask is None else " and mask="))
    return mask, PlanArgs(q.shape[s] * cp_size)


def _packed_self_attention(settings: Settings, mask_type: str, window: Any, q: Any, cu: tuple[Any, ...],
                           cp_size: int) -> tuple[Any, PlanArgs]:
    """thd: the mask of the packed sequences (each attending only to itself) and their plan arguments."""
    what = WHAT
    if "padding" not in mask_type:
        raise ValueError(f"{what}: qkv_format='thd' needs attn_mask_type 'padding' or 'padding_causal' (each "
                         f"packed sequence attends only to itself), got {mask_type!r}")
    cu_q, _, pad_q, _ = _thd_boundaries(cu, cp_size)
    side = cross.packed(what, "q", cu_q, pad_q, q.shape[0], cp_size)
    segments = [part for n, room in zip(side.lengths, _rooms(pad_q), strict=True) for part in (n, room - n)
                if part > 0]
    if settings.mask is not None:
        mask = settings.mask
    elif window not in ((-1, -1), (-1, 0)):
        raise ValueError(f"{what}: window_size={window} with qkv_format='thd' is not supported (a window inside "
                         f"each packed sequence is no cp.Mask yet); use sbhd / bshd, or pass mask=")
    else:
        mask = cp.Mask.packed(segments, chunk=1 if "causal" in mask_type else None)
    return mask, PlanArgs(side.total, tuple(pad_q), tuple(zip(side.starts, side.lengths, strict=True)))


def _engine_call(resolved: Resolved, scale: float, q: Any) -> _Call:
    """The engine's path for a resolved self attention, with its plan (under context parallelism the checked call's,
    its facts joining the call's cross-rank check)."""
    fmt, route, mask, args = resolved.fmt, resolved.route, resolved.mask, resolved.plan
    assert args is not None
    s, h = fmt.seq_dim, fmt.head_dim
    cp_size = 1 if route is None else route.n
    used = None if fmt is not QKVFormat.THD or q.shape[0] * cp_size == args.length else args.length // cp_size
    if route is None:  # one process: the whole sequence in order, any length
        mine = torch.arange(args.length)
        if mask == cp.Mask.full() or (mask == cp.Mask.causal() and fmt is not QKVFormat.THD):
            causal = mask == cp.Mask.causal()

            def attend(q: Any, k: Any, v: Any) -> torch.Tensor:
                return cross.attend(q, k, v, s, h, scale, causal=causal)
        else:
            def attend(q: Any, k: Any, v: Any) -> torch.Tensor:
                return cp.ring_attention(q, k, v, None, mask=mask, seq_dim=s, head_dim=h, softmax_scale=scale)
        return _Call(attend, used, _padding(args, mine, q.device))
    transport = resolved.comm.transport
    if mask == cp.Mask.full() and args.bounds is None:  # no position matters: any even split, no 2 * cp rule
        plan = cp.plan_dispatch(mask, args.length, cp_size, method=cp.Layout.CONTIGUOUS, transport=transport)
    else:
        plan = cp.plan_dual_chunk_swap(mask, args.length, cp_size, cu_seqlens=args.bounds, transport=transport)
    # The engine's masked path, as ring / ulysses / usp_attention(plan=) take it. The first call is checked in
    # full; later ones share its key (shapes, dtypes, devices), so its checks.
    checked: list[inputs.Call] = []

    def attend_cp(q: Any, k: Any, v: Any) -> torch.Tensor:
        if not checked:
            checked.append(inputs.masked_call(WHAT, q, k, v, route.group, causal=False, mask=None, plan=plan,
                                              length=None, seq_dim=s, head_dim=h, softmax_scale=scale, n=route.n,
                                              rank=route.rank, ring_group=route.ring_group, facts=resolved.facts))
            return route.attend(checked[0])
        return route.attend(checked[0].on(q, k, v))
    return _Call(attend_cp, used, _padding(args, plan.index(route.rank), q.device))


def _padding(args: PlanArgs, mine: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """True at this rank's padding tokens (``mine``: their whole-sequence positions), ``[t, 1, 1]`` on ``device``;
    None when there are none."""
    if args.real is None:
        return None
    pad = torch.ones(args.length, dtype=torch.bool)
    for start, n in args.real:
        pad[start:start + n] = False
    return pad[mine].view(-1, 1, 1).to(device) if bool(pad.any()) else None


def _check_route(q: Any, route: _Route | None, group: Any, global_ranks: Any) -> None:
    """Under context parallelism: the group's backend carries q's device, and cp_global_ranks names its ranks."""
    if route is None:
        return
    for g in group if isinstance(group, tuple) else (group,):
        if backend_for(g, q.device.type) is None:
            raise ValueError(f"{WHAT}: the cp group's backend ({dist.get_backend(g)}) cannot carry tensors on "
                             f"{q.device.type}; move q, k and v to {'a GPU' if q.device.type == 'cpu' else 'the CPU'} "
                             f"or use a group of another backend")
    if global_ranks is not None and len(global_ranks) != route.n:
        raise ValueError(f"{WHAT}: cp_global_ranks={list(global_ranks)} names {len(global_ranks)} ranks but the cp "
                         f"group has {route.n}")


def _rooms(pad: tuple[int, ...]) -> list[int]:
    return [y - x for x, y in zip(pad[:-1], pad[1:], strict=True)]


def _thd_boundaries(cu: tuple[Any, ...], cp_size: int) -> tuple[Any, Any, Any, Any]:
    """thd's ``cu_seqlens_q``, ``cu_seqlens_kv`` and their padded forms (each the unpadded one when not given; under
    context parallelism they must be given)."""
    cu_q, cu_kv, pad_q, pad_kv = cu
    if cu_q is None or cu_kv is None:
        raise ValueError(f"{WHAT}: qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
    if cp_size > 1 and (pad_q is None or pad_kv is None):
        raise ValueError(f"{WHAT}: context parallelism with qkv_format='thd' needs cu_seqlens_q_padded and "
                         f"cu_seqlens_kv_padded (each sequence padded to a multiple of 2 * cp = {2 * cp_size}; "
                         f"pass cu_seqlens_q as cu_seqlens_q_padded when there is no padding)")
    return cu_q, cu_kv, cu_q if pad_q is None else pad_q, cu_kv if pad_kv is None else pad_kv


def _is_cross(fmt: QKVFormat, q: Any, k: Any, cu: tuple[Any, ...], route: _Route | None, attention_type: str) -> bool:
    """Whether a call is cross attention for ``cp.cross``: thd whose k/v samples are bounded otherwise than q's, or
    under context parallelism a cross attention or k/v of another length than q (one process attends sbhd / bshd
    cross calls on the plain path)."""
    if fmt is QKVFormat.THD and cu[0] is not None and cu[1] is not None:
        cu_q, cu_kv, pad_q, pad_kv = cu
        if cu_q != cu_kv or (cu_q if pad_q is None else pad_q) != (cu_kv if pad_kv is None else pad_kv):
            return True
    if route is None:
        return False
    return attention_type == "cross" or (fmt is not QKVFormat.THD and q.shape[fmt.seq_dim] != k.shape[fmt.seq_dim])


__all__ = ["ATTENTION_TYPES", "CommType", "DotProductAttention", "EXTRA_PARAMETERS", "MASK_TYPES", "PlanArgs",
           "QKVFormat", "Resolved", "Settings", "TE_RELEASE", "check_window_size", "resolve"]
