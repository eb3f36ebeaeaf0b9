"""Layer 1, topology: pure arithmetic, no ``torch.distributed``.

The rank grid and its group kinds (``grid``, ``rank_map``, ``kinds``, ``plan``), the answers' keys (``answer_keys``),
the base of every closed set of names (``str_enum``), megatron-core's ``RankGenerator``
(``rank_generator``), ``find_split``'s divisibility rule (``split``), the context-parallel
planner and the uneven-shard rule (``cp_plan``), a topology's sizes named once (``sizes``) and
their rules (``validation``), ``initialize_model_parallel``'s arguments as one value
(``init_arguments``), attention masks as values (``attention_mask``), the load-balanced assignment
of a masked sequence's tokens to cp ranks (``dispatch_layout``, ``dispatch_cost``, ``dispatch_plan``) and
argument checks (``arguments``).
Imports nothing of ``parallel_state`` but ``parallel_state.errors``.
"""
