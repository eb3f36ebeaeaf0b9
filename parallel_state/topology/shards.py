"""``shard_sizes``: the uneven-shard rule every cp helper and plan uses (``cp.shard_sizes`` is this function)."""

from __future__ import annotations


def shard_sizes(length: int, n: int) -> tuple[int, ...]:
    """Each rank's shard length when ``length`` elements split into ``n`` contiguous shards.

    Follows ``torch.tensor_split``: the first ``length % n`` shards hold one element more than
    the rest, so the sizes sum to ``length`` and differ by at most one.
    """
    for name, value in (("length", length), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"shard_sizes: {name} must be an int, got {type(value).__name__} {value!r}")
    if n < 1:
        raise ValueError(f"shard_sizes: n={n} must be at least 1 (the number of ranks in the group)")
    if length < n:
        raise ValueError(
            f"shard_sizes: cannot split {length} elements into {n} shards of at least one element each; "
            f"use a group of at most {length} ranks or a longer sequence"
        )
    base, extra = divmod(length, n)
    return tuple(base + 1 if i < extra else base for i in range(n))


__all__ = ["shard_sizes"]
