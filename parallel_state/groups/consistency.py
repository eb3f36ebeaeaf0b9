"""Cross-rank agreement in one round through the default store: every rank asked for the same
thing (``check_same_everywhere``), every rank succeeded (``confirm_everywhere``).

Why the store and not a collective: store operations take their own timeout (the caller's,
not the default group's), need no device (NCCL collectives need a CUDA tensor), cost each rank
a constant number of small messages whatever the world size, and leave behind which ranks
arrived, so a rank that never comes is named on every backend. The happy path is: announce
this rank's value, compare it with the first value announced, count in; the rank that
completes the count publishes the outcome, which says whether any rank differed. Details
(every rank's value) are read only when something is wrong.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Mapping, Sequence

from parallel_state.errors import ParallelStateError, ParallelStateTypeError

_PREFIX = "parallel_state/same_everywhere"
#: Published instead of the count by a rank that stopped waiting, so late ranks learn it.
_ABANDONED = b"abandoned"
#: Megatron's default distributed_timeout_minutes.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def check_same_everywhere(what: str, config: Mapping[str, Any], *,
                          timeout: datetime.timedelta | None = None, members: Sequence[int] | None = None,
                          tolerate: Sequence[str] = ()) -> bool:
    """Return when every rank of the default group (or of ``members``, sorted global ranks) passed an
    equal ``config`` for ``what``.

    Otherwise raise ParallelStateError on every rank: naming the ranks that disagree and
    their values, or, when some ranks did not arrive within ``timeout``, naming those. Every
    rank must call it the same number of times for the same ``what``. Values are compared as
    JSON (``repr`` for anything else), so pass plain data. Keys in ``tolerate`` may differ:
    then it returns False on every rank instead of raising (True when everything agreed).
    """
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise ParallelStateTypeError(f"config must be a dict of argument name (str) -> value, got {config!r}")
    values = values_if_different(what, json.dumps(dict(config), sort_keys=True, default=repr), timeout, members)
    if values is None:
        return True
    if tolerate:
        strict = {json.dumps({k: v for k, v in json.loads(value).items() if k not in tolerate}, sort_keys=True)
                  for value in values}
        if len(strict) == 1:
            return False
    raise ParallelStateError(_mismatch_message(what, values, members))


def confirm_everywhere(what: str, error: BaseException | None, *, timeout: datetime.timedelta | None = None,
                       members: Sequence[int] | None = None) -> None:
    """Tell every rank whether ``what`` succeeded here (``error`` is None) and learn the same of them.

    Returns on a rank that failed (its caller raises its own error; the others have been
    told), and on a rank that succeeded when every rank did. A rank that succeeded while
    another failed or never came gets a ParallelStateError naming those ranks, so that
    every rank can undo its part: all ranks succeed or none does.
    """
    mine = "ok" if error is None else f"{type(error).__name__}: {error}"[:2000]
    try:
        values = values_if_different(what, mine, timeout, members)
    except ParallelStateError:
        if error is not None:
            return  # this rank's own error is the one to report
        raise
    if error is not None or values is None:
        return
    ranks_of = list(members) if members is not None else list(range(len(values)))
    failed = [ranks_of[i] for i, v in enumerate(values) if v != "ok"]
    by_reason: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        if v != "ok":
            by_reason.setdefault(v, []).append(ranks_of[i])
    shown = "; ".join(f"{_rank_word(ranks)} {_ranges(ranks)}: {reason[:300]}"
                      for reason, ranks in list(by_reason.items())[:3])
    raise ParallelStateError(
        f"{what} failed on {_rank_word(failed)} {_ranges(failed)} ({shown}{'; ...' if len(by_reason) > 3 else ''}); "
        f"this rank undid its part too, so that no rank keeps a partial topology. Fix the error of "
        f"{_rank_word(failed)} {_ranges(failed)} and try again"
    )


def values_if_different(what: str, mine: str, timeout: datetime.timedelta | None,
                        members: Sequence[int] | None = None) -> list[str] | None:
    """None when every rank (of ``members``) announced ``mine``; else every rank's value, in rank order."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not isinstance(what, str):
        raise ParallelStateTypeError(f"what must be a str naming the checked call, got {what!r}")
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ParallelStateTypeError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelStateError(
            f"{what} compares values across ranks and needs torch.distributed: call "
            f"torch.distributed.init_process_group(...) first"
        )
    world = dist.get_world_size() if members is None else len(members)
    # torch's fake backend carries no data between ranks: there is nothing to compare.
    if world == 1 or dist.get_backend() == "fake":
        return None
    store = c10d._world.pg_map[dist.group.WORLD][1]
    if store is None:  # MPI has no store: a plain collective, with the default group's timeout
        if members is not None:
            raise ParallelStateError(f"{what} over a subset of ranks needs a backend with a store (not MPI)")
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        return None if all(g == mine for g in gathered) else gathered
    # A subset's rounds live under their own keys, so disjoint subsets check side by side.
    space = what if members is None else f"{what}@{_ranges(list(members))}"
    index = dist.get_rank() if members is None else list(members).index(dist.get_rank())
    try:
        return _check_with_store(store, space, mine, index, world, timeout, members)
    except ParallelStateError:
        raise
    except Exception as exc:  # the store itself failed (its server died, say)
        raise ParallelStateError(
            f"{what} could not compare values across ranks: the torch.distributed store failed "
            f"({type(exc).__name__}: {exc}); the job's rendezvous is broken, restart it"
        ) from exc


def _check_with_store(store: Any, what: str, mine: str, rank: int, world: int,
                      timeout: datetime.timedelta, members: Sequence[int] | None = None) -> list[str] | None:
    """One round among ``world`` ranks; ``rank`` is this rank's index among them (``members`` names them)."""
    # Calls are numbered per rank in the store itself, so a re-initialized world starts afresh.
    call = store.add(f"{_PREFIX}/{what}/calls/{rank}", 1)
    key = f"{_PREFIX}/{what}/{call}"
    done = f"{key}/done"
    store.set(f"{key}/value/{rank}", mine)
    first = store.compare_set(f"{key}/first", "", mine)
    differs = first != mine.encode()
    # A rank that differs counts world+1 instead of 1: total % world == arrivals % world, and
    # (total - world) // world == number of differing ranks once everyone is in.
    total = store.add(f"{key}/count", 1 + world * differs)
    if total % world == 0:
        outcome = store.compare_set(done, "", str(total))
    else:
        try:
            store.wait([done], timeout)
            outcome = store.get(done)
        except Exception:
            # Publish that we stopped waiting, unless the last rank made it meanwhile.
            outcome = store.compare_set(done, "", _ABANDONED)
    if outcome == _ABANDONED:
        missing = [r if members is None else members[r] for r in range(world)
                   if not store.check([f"{key}/value/{r}"])]
        if missing and members is not None and store.add(f"{key}/rolled", 1) == 1:
            # A rank missing from a subset's round may never come (it passed another subset, or
            # failed first): count the round for it, so the subset's next call lines up again.
            for r in range(world):
                if not store.check([f"{key}/value/{r}"]):
                    store.add(f"{_PREFIX}/{what}/calls/{r}", 1)
        if missing:
            raise ParallelStateError(
                f"{what}: rank(s) {_ranges(missing)} of {world} did not arrive within the timeout "
                f"({timeout}); every rank must call {what} with the same arguments. Look at those ranks' "
                f"logs: they died, hang, or failed before this call"
            )
        raise ParallelStateError(
            f"{what}: the ranks arrived too far apart: some stopped waiting after the timeout ({timeout}) "
            f"before the last one arrived (rank {rank} was {'the last' if total % world == 0 else 'not the last'}). "
            f"The ranks that gave up have failed, so restart the job, or raise the timeout if ranks "
            f"reach {what} far apart"
        )
    if call > 1 and rank == 0:
        # Everyone has arrived here, so everyone is done with the previous round: drop it.
        prev = f"{_PREFIX}/{what}/{call - 1}"
        for k in ("first", "count", "done", *(f"value/{r}" for r in range(world))):
            store.delete_key(f"{prev}/{k}")
    if int(outcome) != world:  # some rank's value differed from the first one announced
        return [v.decode() for v in store.multi_get([f"{key}/value/{r}" for r in range(world)])]
    return None


def _mismatch_message(what: str, values: list[str], members: Sequence[int] | None = None) -> str:
    by_value: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r if members is None else members[r])
    parsed = {v: json.loads(v) for v in by_value}
    keys = sorted({k for d in parsed.values() for k in d})
    differing = [k for k in keys if len({json.dumps(d.get(k, "<missing>")) for d in parsed.values()}) > 1]
    # The largest group first; the others are the ranks to fix.
    groups = sorted(by_value.items(), key=lambda item: (-len(item[1]), item[1][0]))
    parts = []
    for value, ranks in groups:
        d = parsed[value]
        shown = ", ".join(f"{k}={d.get(k, '<missing>')!r}" for k in differing)
        parts.append(f"{_rank_word(ranks)} {_ranges(ranks)} passed {shown}")
    odd = sorted(r for _, ranks in groups[1:] for r in ranks)
    return (
        f"{what} was called with different arguments on different ranks: {'; '.join(parts)}. Every rank "
        f"must pass the same {', '.join(differing)}; fix the command line or config of "
        f"{_rank_word(odd)} {_ranges(odd)}"
    )


def _rank_word(ranks: list[int]) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``'0-2, 5, 7-8'``, so a message stays short on a large world."""
    if not ranks:
        return "none"
    out, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)
