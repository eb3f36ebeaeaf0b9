"""cp's attention inside megatron-core models (0.16 to 0.19): a core attention for their layer specs.

``DotProductAttention`` takes the place of megatron-core's ``TEDotProductAttention`` (or its local
``DotProductAttention``) in a layer spec; ``swap_core_attention(spec)`` puts it into every attention of an
existing spec. Importing this module imports megatron-core; ``import cp`` alone never does.
"""

from cp.megatron.core_attention import DotProductAttention
from cp.megatron.spec import swap_core_attention

__all__ = ["DotProductAttention", "swap_core_attention"]
