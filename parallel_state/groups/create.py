"""Creating and destroying process groups on the members only, with names that never repeat.

torch's members-only path (``new_group(..., use_local_synchronization=True)``) names a group
from its ranks and the number of live groups, so a group destroyed and rebuilt with the same
ranks gets the same name, finds its previous incarnation's rendezvous keys in the store and
hangs. The default path names groups from a process-wide counter that only grows, but every
rank must call it for every group in the world to keep the counter in step.

We take the default path on the members only and advance the counter arithmetically: a
batch of ``n`` world-wide groups owns the counter values ``[base, base + n)``; each member
creates its group under ``base + <index of the group in the batch>`` and every rank then moves
the counter to ``base + n``. Names stay unique per process and identical across a group's
members, and no rank does work for groups it is not in. A batch reserves its whole span up
front, so a batch that fails part-way (on some ranks only, at different groups) still leaves
every rank's counter at the same value, and a retry names its groups alike everywhere.

Two things the default path assumes of all ranks are made members-only too: torch's optional
barrier after each group (``TORCH_DIST_INIT_BARRIER=1``) waits for the whole world, so it is
replaced by one barrier per group among its members (:meth:`GroupBatch.wait_for_members`),
which also keeps a fast rank from destroying a gloo group a peer is still connecting.

torch internals this package still uses, each because no public API does the job (everything
else goes through ``torch.distributed``'s public functions and ``dist.group.WORLD``):
- ``_world.group_count`` (here and in ``process_groups``): the only way to name a members-only
  group alike on its members without every rank calling ``new_group`` for every group.
- ``_world.pg_map`` (here, ``process_groups``, ``consistency``): whether a group is still alive,
  and a group's store (the members-only barrier, the cross-rank checks through the default store).
- ``_world.pg_to_tag`` / ``tags_to_pg``: torch leaves an empty tag list behind per destroyed group.
- ``_set_pg_timeout`` (``process_groups.update_pg_timeout``): torch has no public way to change a
  live group's timeout.
- ``ProcessGroup._get_backend(device).options._timeout`` (``process_groups.group_timeout``): torch
  has no public way to read a group's timeout either.
- ``ProcessGroup.bound_device_id`` (here, ``process_groups``, ``resolve``, ``mesh``): whether the
  default NCCL group was initialised eagerly, where sub-groups are split collectively.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from parallel_state.errors import ParallelStateError


def live_groups() -> set[Any]:
    """The process groups torch currently knows about in this process."""
    return set(c10d._world.pg_map)


#: Keys of the members-only barrier, under each group's own store prefix (its unique name).
_ARRIVED_KEY = "parallel_state/arrived"
_ALL_ARRIVED_KEY = "parallel_state/all_arrived"


@contextmanager
def _without_world_barrier() -> Iterator[None]:
    """Turn off torch's TORCH_DIST_INIT_BARRIER barrier, which non-members would never join."""
    saved = os.environ.get("TORCH_DIST_INIT_BARRIER")
    if saved in (None, "0"):
        yield
        return
    os.environ["TORCH_DIST_INIT_BARRIER"] = "0"
    try:
        yield
    finally:
        os.environ["TORCH_DIST_INIT_BARRIER"] = saved


def _default_backend() -> str:
    return str(dist.get_backend())


def eager_nccl() -> bool:
    """Whether new NCCL groups would be split from an eagerly initialised default group.

    ``ncclCommSplit`` is collective over the whole default group, so members-only creation
    would hang there; such runs take the all-ranks path.
    """
    default = dist.group.WORLD
    return getattr(default, "bound_device_id", None) is not None and "nccl" in _default_backend()


@dataclass
class GroupBatch:
    """Allocates counter-named groups for one ``initialize_model_parallel`` call.

    ``reserve`` is the number of counter values the batch may use; it must be the same on
    every rank (a function of the plan only). ``base`` (a subset's build, see :func:`subset_base`)
    names the groups from an agreed range instead, and leaves this process's counter as it was,
    so that ranks of disjoint subsets still name later whole-world groups alike.
    """

    timeout: datetime.timedelta
    reserve: int = 0
    base: int | None = None
    created: list[Any] = field(default_factory=list)
    #: id(group) -> (description, ranks): formatted only for an error (a rank list can be the whole world).
    _labels: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    _base: int = field(default=-1)
    _restore: int | None = None
    _next_slot: int = 0

    def __post_init__(self) -> None:
        if self.base is None:
            self._base = c10d._world.group_count
        else:
            self._base, self._restore = self.base, c10d._world.group_count

    def create(
        self,
        ranks: tuple[int, ...],
        *,
        index: int,
        count: int,
        all_groups: Any = None,
        backend: str | None = None,
        pg_options: Any = None,
        desc: str,
    ) -> Any:
        """Create this rank's group: the ``index``-th of ``count`` same-kind groups in the world.

        Empty ``ranks`` mean this rank is in no group of the kind: it only moves past the
        kind's slots and gets None. ``all_groups`` (a callable giving every group of the kind)
        is used only on the eager-NCCL fallback, where every rank must take part in every creation.
        """
        slot = self._next_slot
        self._next_slot += count
        eager = eager_nccl()
        if not ranks and not eager:
            return None
        if eager and all_groups is not None:
            mine = None
            for i, group_ranks in enumerate(all_groups()):
                c10d._world.group_count = self._base + slot + i
                pg = dist.new_group(
                    list(group_ranks), timeout=self.timeout, backend=backend,
                    pg_options=pg_options, group_desc=desc,
                )
                if group_ranks == ranks:
                    mine = pg
            self.created.append(mine)
            return mine
        c10d._world.group_count = self._base + slot + index
        try:
            with _without_world_barrier():
                pg = dist.new_group(
                    list(ranks), timeout=self.timeout, backend=backend,
                    pg_options=pg_options, group_desc=desc,
                )
        except Exception as exc:
            raise ParallelStateError(
                f"rank {dist.get_rank()} could not create its {desc} process group with ranks {list(ranks)} "
                f"(timeout {self.timeout}): {exc}. Usually a member rank died, or did not call "
                f"initialize_model_parallel with the same arguments; the groups built so far were destroyed, "
                f"so initialize_model_parallel can be called again"
            ) from exc
        finally:
            c10d._world.group_count = self._base + self._next_slot if self._restore is None else self._restore
        if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            raise ParallelStateError(f"rank {dist.get_rank()} was not made a member of {desc} {ranks}")
        self.created.append(pg)
        self._labels[id(pg)] = (desc, ranks)
        return pg

    def skip(self, count: int) -> None:
        """Move past ``count`` slots without creating anything (a kind served by another kind's group)."""
        self._next_slot += count

    def wait_for_members(self) -> None:
        """Return once every member has finished creating each gloo group this batch created.

        gloo connects a group inside ``new_group``, pair by pair; a rank whose own pairs are up
        returns while a peer may still be connecting the rest, and if that rank then destroys
        the group (initialize at once followed by destroy), the peer fails with "Connection
        closed by peer". Every rank first arrives at all its groups, then waits on each, so the
        waits overlap; the keys live under the group's never-repeating name.
        """
        pending = []
        for pg in self.created:
            if pg is None:
                continue  # eager NCCL: this rank was in none of the kind's groups
            backend, store = c10d._world.pg_map[pg]
            if pg.size() == 1 or "gloo" not in str(backend):
                continue  # nothing to wait for; other backends connect lazily or collectively
            if store.add(_ARRIVED_KEY, 1) == pg.size():
                store.set(_ALL_ARRIVED_KEY, "1")
            pending.append((pg, store))
        for pg, store in pending:
            try:
                store.wait([_ALL_ARRIVED_KEY], self.timeout)
            except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
                desc, ranks = self._labels.get(id(pg), ("process", ()))
                raise ParallelStateError(
                    f"rank {dist.get_rank()}: not every member of the {desc} group {list(ranks)} "
                    f"finished creating it within {self.timeout} ({exc}); some rank of that group did not call "
                    f"initialize_model_parallel with the same arguments, or failed: check its log"
                ) from exc

    def close(self) -> None:
        """Leave the counter past every name this batch could have used, on every rank alike."""
        if self._restore is not None:
            c10d._world.group_count = self._restore
            return
        c10d._world.group_count = max(c10d._world.group_count, self._base + max(self.reserve, self._next_slot))


#: Subsets name their groups from this value up, far above any count of whole-world groups.
_SUBSET_NAMES = 1 << 40
_SUBSET_KEY = "parallel_state/subset_names"


def subset_base(members: tuple[int, ...], reserve: int, timeout: datetime.timedelta) -> int:
    """The first of ``reserve`` group names the ranks ``members`` agree on, unique in the whole job.

    The subset's first rank takes the range from a counter in the default store and publishes it;
    the others read it. Names drawn this way never meet the names of another subset building at
    the same time, nor those of whole-world builds.
    """
    store = c10d._world.pg_map[dist.group.WORLD][1]
    space = f"{_SUBSET_KEY}@{','.join(map(str, members))}"
    me = dist.get_rank()
    call = store.add(f"{space}/calls/{me}", 1)  # the same on every member: they build together
    key = f"{space}/{call}"
    if me == members[0]:
        end = store.add(_SUBSET_KEY, max(reserve, 1))
        store.set(key, str(end - max(reserve, 1)))
    else:
        try:
            store.wait([key], timeout)
        except Exception as exc:
            raise ParallelStateError(
                f"rank {me}: rank {members[0]}, the first of ranks {list(members)}, did not start building the "
                f"subset's groups within {timeout} ({exc}); every rank of the subset must call "
                f"initialize_model_parallel with the same ranks"
            ) from exc
    return _SUBSET_NAMES + int(store.get(key))


@contextmanager
def sharp_enabled(wanted: bool) -> Iterator[Any]:
    """Create the group made inside with SHARP (NCCL only; on other backends it has no effect).

    NCCL gives SHARP to the first communicator created while ``NCCL_COLLNET_ENABLE=1``, and
    creates communicators lazily: the variable is set, the group made, a barrier on it creates
    the communicator, and the variable is removed. Yields a function to pass the new group through.
    """
    if not wanted or "nccl" not in _default_backend():
        yield lambda pg: pg
        return
    import torch

    os.environ["NCCL_COLLNET_ENABLE"] = "1"

    def enable(pg: Any) -> Any:
        if pg is not None:
            dist.barrier(group=pg, device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
        return pg

    try:
        yield enable
    finally:
        os.environ.pop("NCCL_COLLNET_ENABLE", None)


def destroy_groups(groups: list[Any]) -> None:
    """Destroy each group once, skipping those torch has already forgotten; empties ``groups``.

    Every group is attempted even when one fails (a dead peer must not leave the rest
    alive); the first error is raised afterwards. The caller hands over its references: the
    groups are freed here, in parallel, when no one else holds them.
    """
    seen: set[int] = set()
    unique: list[Any] = []
    first_error: BaseException | None = None
    for pg in groups:
        if pg is None or id(pg) in seen:
            continue
        seen.add(id(pg))
        unique.append(pg)
        if pg in c10d._world.pg_map:
            tag = c10d._world.pg_to_tag.get(pg)
            try:
                dist.destroy_process_group(pg)
            except Exception as exc:
                first_error = first_error or exc
            # torch leaves each destroyed group's tag behind with an empty list: a leak per group.
            if tag is not None and c10d._world.tags_to_pg.get(tag) == []:
                del c10d._world.tags_to_pg[tag]
    groups.clear()
    pg = None
    _free_in_parallel(unique)
    if first_error is not None:
        raise first_error


def _free_in_parallel(groups: list[Any]) -> None:
    """Drop the last references to ``groups``, each in its own thread, and wait for all.

    Freeing a gloo group closes each of its connections and waits up to 10 ms for its event
    loop to notice, one connection after another; freeing the groups side by side overlaps
    those waits (8 ranks, a group per kind: about 350 ms one by one, 40 ms side by side). The
    caller must hold the last references (teardown clears the answers first).
    """
    import threading

    if len(groups) < 2:
        groups.clear()
        return
    boxes = [[g] for g in groups]
    groups.clear()
    threads = []
    box: list[Any] = []
    while boxes:
        box = boxes.pop()
        thread = threading.Thread(target=box.clear, name="parallel_state-free-group", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new threads (interpreter shutdown): free it here
            box.clear()
            continue
        threads.append(thread)
    del box
    for thread in threads:
        thread.join()
