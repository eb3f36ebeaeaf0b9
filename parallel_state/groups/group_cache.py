"""The group cache: long-lived workers switch topology without building their communicators again.

Off by default. While it is on, ``destroy_model_parallel`` resets the state and every accessor as
usual but hands the topology's groups to the cache instead of destroying them; the next
``initialize_model_parallel`` takes a whole cached topology back, or builds a new one reusing each
cached group whose key (kind, global ranks, backend, NCCL settings, SHARP, timeout) matches and
creating only the rest.

Every member of a group must take the same decision about it. Cached topologies enter and leave
the cache in the same order on every rank that builds them together, so the caches agree; each
initialize confirms it first (one store round over the ranks it involves, comparing the ordered
list of cached topologies). Where they differ (ranks that took part in different topologies since),
every rank involved empties its cache before building, so no rank reuses a group its peers dropped.

``max_groups`` bounds the groups a rank keeps: each cached topology counts as its number of kinds
(the same on every rank, so every rank evicts the same topologies), and the least recently used
topologies go first. A group is destroyed when no cached topology and no live state uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from parallel_state.groups.flavor import Flavor
from parallel_state.topology.arguments import optional_positive_int


@dataclass
class Entry:
    """One cached topology: this rank's groups by kind, and the key of each."""

    groups: dict[str, Any]
    gloo_groups: dict[str, Any]
    keys: dict[tuple[Flavor, str], Hashable]  # (flavor, kind) -> group key
    slots: int
    owned: list[Any] = field(default_factory=list)


_enabled = False
_max_groups: int | None = None
_entries: OrderedDict[str, Entry] = OrderedDict()
_stats = {"hits": 0, "misses": 0, "evicted": 0}


#: The live topology's groups, which the cache never destroys: ``groups.state`` installs its answer
#: when imported (this module must not import the state, which imports it).
live_groups: Callable[[], list[Any]] = list


def enable_group_cache(max_groups: int | None = None) -> None:
    """Keep the groups of destroyed topologies for the next initialize (at most ``max_groups`` per rank).

    Call it alike on every rank, before initialize_model_parallel or between topologies.
    """
    global _enabled, _max_groups
    _max_groups = optional_positive_int("max_groups", max_groups)
    _enabled = True
    _evict()


def clear_group_cache() -> None:
    """Destroy every group the cache holds (the live topology's stay) and turn the cache off.

    Call it alike on every rank.
    """
    global _enabled
    _enabled = False
    drop_all()


def group_cache_info() -> dict[str, Any]:
    """``enabled``, ``max_groups``, ``topologies`` and ``groups`` held on this rank, ``hits``, ``misses``, ``evicted``."""
    held = {id(g) for e in _entries.values() for g in e.owned if g is not None}
    return {"enabled": _enabled, "max_groups": _max_groups, "topologies": len(_entries), "groups": len(held),
            **_stats}


def enabled() -> bool:
    """Whether destroy keeps groups for the next initialize."""
    return _enabled


def fingerprint() -> str:
    """The cached topologies in cache order: equal on ranks whose caches hold the same groups."""
    return ",".join(_entries)


def take(key: str) -> Entry | None:
    """Remove and return the cached topology ``key`` (None when it is not cached)."""
    entry = _entries.pop(key, None)
    if entry is not None:
        _stats["hits"] += len(entry.keys)
    return entry


def find(group_key: Hashable) -> Any:
    """A cached group with ``group_key`` (None when there is none); counts the hit or miss."""
    for entry in _entries.values():
        for (flavor, kind), key in entry.keys.items():
            if key == group_key:
                _stats["hits"] += 1
                return flavor.of(entry)[kind]
    _stats["misses"] += 1
    return None


def keep(key: str, entry: Entry) -> None:
    """Cache a destroyed topology's groups under ``key`` (most recently used), then evict beyond the bound."""
    _entries[key] = entry
    _entries.move_to_end(key)
    _evict()


def in_use(extra: Sequence[Any] = ()) -> set[int]:
    """ids of the groups the cached topologies (and ``extra``) use."""
    return {id(g) for e in _entries.values() for g in e.owned if g is not None} | {id(g) for g in extra if g}


def _evict() -> None:
    if _max_groups is None:
        return
    while _entries and sum(e.slots for e in _entries.values()) > _max_groups:
        _, victim = _entries.popitem(last=False)
        _stats["evicted"] += 1
        _destroy_unused(victim.owned, live_groups())
        victim.groups.clear()
        victim.gloo_groups.clear()


def drop_all() -> None:
    """Destroy every cached group not used by the live state, and forget every cached topology."""
    owned = [g for e in _entries.values() for g in e.owned]
    for e in _entries.values():
        e.groups.clear()
        e.gloo_groups.clear()
        e.owned = []
    _entries.clear()
    _destroy_unused(owned, live_groups())


def _destroy_unused(groups: list[Any], live: list[Any]) -> None:
    from parallel_state.groups.create import destroy_groups

    keep_ids = in_use(live)
    doomed = [g for g in groups if g is not None and id(g) not in keep_ids]
    groups.clear()
    destroy_groups(doomed)
