"""Layer 3, megatron: megatron-core 0.16's names over the groups layer.

``initialize_model_parallel`` / ``destroy_model_parallel`` (``initialize``; the per-release defs generated in
``generated_initialize``), the precomputed answers and Megatron's getters (``answers``; ``accessor_keys``, each
getter's rule; ``accessors``, with those generated from the rules in ``generated_accessors``), megatron-core's private
globals (``megatron_globals``), the bridge that lets megatron-core read our groups (``bridge``),
its memory buffers (``memory``) and ``cp_size_t`` (``cp_size_t``).
"""
