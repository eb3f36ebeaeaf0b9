"""Layer 2, groups: creating, checking and destroying torch process groups.

The one live state object and its lifecycle (``state``), a build's options (``options``), a kind's main group
or gloo twin (``flavor``),
the group cache that keeps a destroyed topology's groups for the next one (``group_cache``),
members-only group creation and teardown (``create``), megatron-core's ``create_group`` / ``update_pg_timeout`` and the
hierarchical groups (``process_groups``, ``hierarchical``), NCCL options (``nccl``) and the
cross-rank argument check (``consistency``). Uses the topology layer only.
"""
