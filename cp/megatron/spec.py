"""Putting cp's core attention into an existing megatron-core layer spec, so a model changes one line."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import cp


def swap_core_attention(spec: Any, *, mask: Any = None) -> Any:
    """A copy of ``spec`` with every attention's ``core_attention`` replaced by ``cp.megatron.DotProductAttention``.

    ``spec`` is any megatron-core spec tree: a ``ModuleSpec`` (``get_gpt_layer_local_spec()``,
    ``get_gpt_layer_with_transformer_engine_spec()``), a ``TransformerBlockSubmodules`` (``get_gpt_decoder_block_spec``)
    or a submodules dataclass, with ``functools.partial`` builders, lists and dicts inside (megatron-core 0.19's
    MLP builders). Every dataclass field named ``core_attention`` (self-, cross- and multi-latent attention)
    gets the class, or with ``mask`` (a ``cp.Mask``) ``ModuleSpec(module=DotProductAttention, params={"mask":
    mask})``; the mask is for self attention, so every core attention below a ``cross_attention`` field gets the
    class alone. ``spec`` itself is left as it was. ValueError when the tree holds no core attention; TypeError
    for a mask that is not a ``cp.Mask``.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    from cp.megatron.core_attention import DotProductAttention

    if mask is not None and not isinstance(mask, cp.Mask):
        raise TypeError(f"swap_core_attention: mask must be a cp.Mask or None, got {type(mask).__name__}; build one "
                        f"with cp.Mask.chunk_causal(chunk), cp.Mask.token_window(left, right), ...")
    core = DotProductAttention if mask is None else ModuleSpec(module=DotProductAttention, params={"mask": mask})
    swapped, count = _swap(spec, core, DotProductAttention)
    if not count:
        raise ValueError(f"swap_core_attention: no core_attention in this spec ({type(spec).__name__}); pass a layer or "
                         f"block spec whose attention has submodules with a core_attention, such as "
                         f"get_gpt_layer_local_spec()")
    return swapped


def _swap(node: Any, core: Any, plain: Any) -> tuple[Any, int]:
    """``node`` with every ``core_attention`` field below it set to ``core``, and to ``plain`` (no mask) below a
    ``cross_attention`` field (new objects only where something changed), and how many were set."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes, count = {}, 0
        for f in dataclasses.fields(node):
            if not f.init:
                continue
            value = getattr(node, f.name)
            if f.name == "core_attention":
                changes[f.name], n = core, 1
            else:
                new, n = _swap(value, plain if f.name == "cross_attention" else core, plain)
                if n:
                    changes[f.name] = new
            count += n
        return (dataclasses.replace(node, **changes) if changes else node), count
    if isinstance(node, functools.partial):
        args, n_args = _swap(list(node.args), core, plain)
        keywords, n_kw = _swap(dict(node.keywords), core, plain)
        if n_args + n_kw:
            return functools.partial(node.func, *args, **keywords), n_args + n_kw
        return node, 0
    if isinstance(node, (list, tuple)):
        items = [_swap(item, core, plain) for item in node]
        count = sum(n for _, n in items)
        return (type(node)(new for new, _ in items) if count else node), count
    if isinstance(node, dict):
        items = {key: _swap(value, core, plain) for key, value in node.items()}
        count = sum(n for _, n in items.values())
        return ({key: new for key, (new, _) in items.items()} if count else node), count
    return node, 0
