"""megatron-core's core attention on cp's engine: ``TEDotProductAttention``'s contract, without Transformer Engine.

megatron-core's ``TEDotProductAttention`` subclasses Transformer Engine's ``DotProductAttention`` and translates
megatron's config, process-group collection and ``PackedSeqParams`` into TE's arguments; this class does the
same on ``cp.transformer_engine.DotProductAttention``. Everything about attention itself (layouts, masks,
comm types, checks, the engine) is that class's; what is here is the translation.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from cp import transformer_engine as te

#: The fields of megatron-core's ``PackedSeqParams`` that are arguments of TE's forward (the installed release's;
#: megatron-core 0.19 adds Mamba's and MoE's, which TEDotProductAttention drops too).
PACKED_FIELDS = tuple(f.name for f in dataclasses.fields(PackedSeqParams)
                      if f.name in inspect.signature(te.DotProductAttention.forward).parameters)
#: thd runs on TE's padding mask types: megatron-core's TEDotProductAttention renames these two for it.
THD_MASK_TYPES = {"causal": "padding_causal", "no_mask": "padding"}


#: megatron-core's mask types by TE's names (a lookup per call instead of the enum's ``name`` property).
MASK_TYPE_NAMES = {t: t.name for t in AttnMaskType}


def _mask_type_name(value: Any, what: str) -> str:
    name = MASK_TYPE_NAMES.get(value) if isinstance(value, AttnMaskType) else value
    if isinstance(name, str):
        return name
    raise TypeError(f"{what}: attn_mask_type must be megatron-core's AttnMaskType (or its name), got "
                    f"{type(value).__name__}")


def _check_supported(what: str, config: Any, attention_type: str, mask: Any) -> None:
    """ValueError for what cp's engine cannot do: the largest logit (qk_clip), a mask on a cross attention."""
    if config.qk_clip or config.log_max_attention_logit:
        raise ValueError(f"{what}: qk_clip and log_max_attention_logit need the attention's largest logit, which "
                         f"cp's engine does not return; set both False in the TransformerConfig")
    if attention_type == "cross" and mask is not None:
        raise ValueError(f"{what}: mask={mask} applies to self attention only, and this is a cross attention; "
                         f"build it without mask= (swap_core_attention(spec, mask=) gives the mask to the self "
                         f"attentions only)")


def _groups(what: str, config: Any, cp_comm_type: Optional[str], pg_collection: Any) -> tuple[Any, dict[str, Any]]:
    """The tensor-parallel group and the TE constructor's context-parallel kwargs, from ``pg_collection`` (None:
    megatron-core's global state) as TEDotProductAttention takes them."""
    if pg_collection is None:
        tp_group = mps.get_tensor_model_parallel_group(check_initialized=False)
        cp_group = mps.get_context_parallel_group(check_initialized=False)
        hcp = mps.get_hierarchical_context_parallel_groups(check_initialized=False)
    else:
        tp_group, cp_group = pg_collection.tp, pg_collection.cp
        hcp = getattr(pg_collection, "hcp", None)
    cp_comm_type = "p2p" if cp_comm_type is None else cp_comm_type
    cp_kwargs: dict[str, Any] = {"cp_comm_type": cp_comm_type}
    # As TEDotProductAttention: the config decides whether this attention is context-parallel at all (an
    # encoder may run without it while the decoder's group exists).
    if config.context_parallel_size > 1:
        ranks = None if cp_group is None else dist.get_process_group_ranks(cp_group)
        if cp_comm_type == "a2a+p2p":
            if cp_group is not None and not hcp:
                raise ValueError(f"{what}: cp_comm_type='a2a+p2p' needs the hierarchical context-parallel groups: "
                                 f"initialize_model_parallel(..., hierarchical_context_parallel_sizes=[a2a, p2p]) "
                                 f"(or pg_collection.hcp)")
            cp_group = list(hcp) if hcp else None
        cp_kwargs.update(cp_group=cp_group, cp_global_ranks=ranks)
    return tp_group, cp_kwargs


class DotProductAttention(te.DotProductAttention):
    """A core attention for megatron-core layer specs (0.16 to 0.19), context-parallel on cp's engine.

    ``SelfAttentionSubmodules(core_attention=cp.megatron.DotProductAttention)``, or with a world-model mask
    ``ModuleSpec(module=cp.megatron.DotProductAttention, params={"mask": cp.Mask.chunk_causal(n)})``
    (``cp.megatron.swap_core_attention(spec, mask=...)`` does either to an existing spec). The constructor and
    ``forward`` are megatron-core's ``TEDotProductAttention``'s, plus ``mask=``:

    - q ``[s, b, np, hn]``, k / v ``[s, b, ng, hn]`` (this tensor-parallel rank's heads; GQA not repeated) ->
      ``[s, b, np * hn]``; with ``packed_seq_params.qkv_format == "thd"`` q ``[t, np, hn]`` -> ``[t, np * hn]``.
    - Under context parallelism (``config.context_parallel_size > 1``) each rank holds megatron-core's layout
      (``get_batch_on_this_cp_rank``: 2 cp chunks, rank r chunks r and 2 cp - 1 - r; thd: the same per sequence),
      RoPE already applied: nothing is reordered or rotated again.
    - The group: ``pg_collection.cp`` (None: megatron-core's global state); for ``cp_comm_type="a2a+p2p"``
      ``pg_collection.hcp``, the hierarchical groups. ``packed_seq_params.cp_group`` (hybrid context
      parallelism's per-batch group) replaces it for that call, and ``local_cp_size=1`` without a group turns
      it off for that call (megatron-core's TEDotProductAttention keeps the last one instead).
    - ``cp_comm_type``: None or ``"p2p"``, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``.
    - ``attention_type="cross"`` (megatron-core's ``CrossAttention``): every query sees every key of its sample; under
      context parallelism the text is split over the cp ranks as the video is, and gathered (``cp.cross``).
      ``mask`` is for self attention only.
    - ``attention_mask``: ignored for causal and no_mask, as Transformer Engine does (megatron-core's loop passes
      the dense mask ``get_batch_on_this_cp_rank`` cut along queries only); ``mask`` (a ``cp.Mask`` over the
      whole sequence) replaces ``attn_mask_type`` and the window.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        num_splits: Optional[int] = None,
        cp_comm_type: Optional[str] = "p2p",
        pg_collection: Any = None,
        *,
        mask: Any = None,
    ) -> None:
        what = "cp.megatron.DotProductAttention"
        _check_supported(what, config, attention_type, mask)
        tp_group, cp_kwargs = _groups(what, config, cp_comm_type, pg_collection)
        window = config.window_size if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                                 layer_number) else None
        super().__init__(
            num_attention_heads=config.num_attention_heads,
            kv_channels=(k_channels, v_channels) if k_channels is not None and v_channels is not None
            else config.kv_channels,
            num_gqa_groups=config.num_query_groups,
            attention_dropout=config.attention_dropout if attention_dropout is None else attention_dropout,
            attn_mask_type=_mask_type_name(attn_mask_type, what),
            window_size=None if window is None else tuple(window),
            sequence_parallel=config.sequence_parallel,
            tp_size=config.tensor_model_parallel_size,
            get_rng_state_tracker=get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized() else None,
            tp_group=tp_group,
            layer_number=layer_number,
            attention_type=attention_type,
            softmax_scale=softmax_scale,
            softmax_type=config.softmax_type,
            mask=mask,
            **cp_kwargs,
        )
        self.config = config
        self.num_splits = num_splits

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        num_splits: Optional[int] = None,
    ) -> torch.Tensor:
        """Attention of this rank's q, k, v as megatron-core's attention layer passes them (see the class)."""
        what = "cp.megatron.DotProductAttention.forward"
        kwargs: dict[str, Any] = {}
        group: Any = self.cp_group
        if packed_seq_params is not None:
            for name in PACKED_FIELDS:
                value_ = getattr(packed_seq_params, name)
                if value_ is not None:
                    kwargs[name] = value_
            if packed_seq_params.cp_group is not None:
                group = packed_seq_params.cp_group
            elif packed_seq_params.local_cp_size is not None:
                if packed_seq_params.local_cp_size != 1:
                    raise ValueError(f"{what}: packed_seq_params.local_cp_size={packed_seq_params.local_cp_size} "
                                     f"without a cp_group; pass the sample's group as packed_seq_params.cp_group "
                                     f"(local_cp_size alone may only be 1, context parallelism off)")
                group = None
        mask_type = self.attn_mask_type if attn_mask_type is None else _mask_type_name(attn_mask_type, what)
        if kwargs.get("qkv_format", self.qkv_format) == "thd":
            if self.mask is not None:
                raise ValueError(f"{what}: mask={self.mask} with packed sequences (qkv_format='thd') is not supported; "
                                 f"pass the sequences as sbhd batches, or drop mask= for causal attention within "
                                 f"each sequence")
            mask_type = THD_MASK_TYPES.get(mask_type, mask_type)
        if attention_bias is not None:
            kwargs.update(core_attention_bias_type="post_scale_bias", core_attention_bias=attention_bias)
        num_splits = self.num_splits if num_splits is None else num_splits
        if num_splits is not None:
            kwargs["num_splits"] = num_splits
        if group is self.cp_group:
            return super().forward(query, key, value, attention_mask, attn_mask_type=mask_type, **kwargs)
        return self._with_group(group, query, key, value, attention_mask, mask_type, kwargs)

    def _with_group(self, group: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, mask_type: str, kwargs: dict[str, Any]) -> torch.Tensor:
        """One call over ``group`` (hybrid context parallelism's per-batch group; None: off), then the module's own."""
        own = (self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type)
        self.set_context_parallel_group(group, None if group is None else dist.get_process_group_ranks(group),
                                        self.cp_stream, self.cp_comm_type)
        try:
            return super().forward(query, key, value, attention_mask, attn_mask_type=mask_type, **kwargs)
        finally:
            self.set_context_parallel_group(*own)


__all__ = ["DotProductAttention", "MASK_TYPE_NAMES", "PACKED_FIELDS", "THD_MASK_TYPES"]
