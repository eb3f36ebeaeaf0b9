"""The cross-rank check of a masked attention call: in full once per distinct call, a cheap agreement every call.

A rank alone in a mistake (another plan or transport, a token count its plan does not give it,
another dtype or head count) would leave the others waiting in the K/V exchange until the group's
timeout, or compute garbage. So the ranks of every masked call (ring, Ulysses and usp with ``mask=``
or ``plan=``) check it together before any K/V moves, without making the CPU wait for the GPU each call:

- Every call, each rank adds a row of two ints to one round (``cp.agree``: one all-to-all on the
  group's metadata device): a digest of what the ranks must agree on (the plan's fingerprint and
  transport, the dtype, the layout and every size but the token counts) and a flag: ``CHECKED`` (the
  call, its shapes included, passed a full check on this rank before: ``_cache``, as the schedule is
  cached), ``NEW`` (it did not, or ``PARALLEL_STATE_DEBUG`` is on) or ``WRONG`` (its token counts are not
  the ones its plan gives this rank).
- Where reading the round costs no wait for a GPU (the group has a CPU backend: gloo, or
  "cpu:gloo,cuda:nccl"), every rank reads it. One digest and every flag ``CHECKED``: the call goes on.
  Otherwise every rank takes part in the full check: a second round of every rank's plan, transport,
  token counts, dtype and sizes, judged alike on every rank, which raises the same ValueError on every
  rank (naming ranks and sizes) or passes and remembers the call.
- Where it would (NCCL, the round on the GPU): a rank repeating a ``CHECKED`` call does not read; a
  device-side assertion (``torch._assert_async``, no host sync) stops it when another rank's digest
  differs or a flag says ``WRONG``. A rank with a ``NEW`` or ``WRONG`` call reads (once per distinct call):
  when every rank does, all take the full check as above; when some repeated a checked call (so no
  second round can run), it passes where the digests agree and no flag is ``WRONG`` (and remembers the
  call), and raises what it can name otherwise, while the others stop at their assertion.

So a rank changing its call while the others repeat theirs is an error on every rank, never a hang
(on gloo the same ValueError everywhere; on NCCL the changed rank's ValueError and the others' failed
device assertion, whose CUDA error names no ranks: ``PARALLEL_STATE_DEBUG=1`` checks every call in full).
The round also serves the engine's receives-first order (p2p on gloo): each rank's row leaves after
its receives are posted. A full check that fails first completes those receives (``drain``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from cp import agree, debug, meta, transports
from cp.comm import global_ranks, meta_device
from cp.engine import Confirm
from cp.inputs import Call, Tensors

#: The flags of a rank's row (see the module doc).
CHECKED, NEW, WRONG = 0, 1, 2
#: Distinct calls remembered by this process, the least recently used forgotten first.
CACHE_SIZE = 64
#: Tests set it to run, on gloo, the path of a group whose reads would make the CPU wait for a GPU (NCCL).
reads_wait_everywhere = False

#: One tensor's layout in the full check's row: dtype code, dims, seq dim, head dim, every size but the tokens.
_SIG = 4 + meta.MAX_NDIM


@dataclass
class _Checked:
    """A call that passed the full check: the objects its key names by identity (held, so their ids are not
    reused while it is remembered), its digest and its round's row, made once on the metadata device."""

    group: Any
    ring_group: Any
    plan: Any
    digest: int
    row: torch.Tensor


_cache: OrderedDict[tuple[Any, ...], _Checked] = OrderedDict()


def clear() -> None:
    """Forget every checked call (the next call of each checks in full again, on every rank)."""
    _cache.clear()


def _key(call: Call) -> tuple[Any, ...]:
    t, plan = call.tensors, call.masking.plan  # type: ignore[union-attr]
    return (id(call.group), id(call.ring_group), id(plan), call.what, t.s, t.h, t.q.dtype, t.q.device,
            tuple(t.q.shape), tuple(t.k.shape), tuple(t.v.shape))


def _lookup(call: Call, key: tuple[Any, ...]) -> _Checked | None:
    entry = _cache.get(key)
    if entry is None or entry.group is not call.group or entry.ring_group is not call.ring_group \
            or entry.plan is not call.masking.plan:  # type: ignore[union-attr]
        return None
    _cache.move_to_end(key)
    return entry


def _sig(x: torch.Tensor, s: int, h: int) -> list[int]:
    """x's layout: dtype code, dims, s, h and its sizes but the sequence's (padded), as the full check compares."""
    rest = [size for d, size in enumerate(x.shape) if d != s]
    return [meta.DTYPE_CODES.get(x.dtype, -1), x.dim(), s, h] + rest + [-1] * (_SIG - 4 - len(rest))


def _sigs(t: Tensors) -> list[int]:
    return [v for x in (t.q, t.k, t.v) for v in _sig(x, t.s, t.h)]


def _digest(call: Call) -> int:
    """A 63-bit digest of what every rank of the call must agree on, the same in every process."""
    plan = call.masking.plan  # type: ignore[union-attr]
    text = repr((plan.fingerprint(), plan.transport, _sigs(call.tensors)))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def _reads_wait(device: torch.device) -> bool:
    """Whether the host reading a round on ``device`` waits for the device's queued work."""
    return device.type != "cpu" or reads_wait_everywhere


def start(call: Call, named: Sequence[tuple[str, int]], posted: Sequence[int] = ()) -> Confirm:
    """Start the check of a masked ``call`` (``named``: (name, this rank's token count) of the tensors whose
    counts the plan fixes); the round runs while the caller computes. Calling the result with a ``drain``
    judges it, on every rank before anything else crosses the group: it returns, or raises (having called
    ``drain`` with every rank's ``posted`` where the full check ran).

    ``posted``: the bytes this rank has posted receives for, from each group rank (as many entries on every
    rank), so that a failed check can complete them (``cp.engine``)."""
    plan = call.masking.plan  # type: ignore[union-attr]
    key = _key(call)
    entry = _lookup(call, key)
    want = plan.sizes[call.rank]
    fits = all(size == want for _, size in named)
    if entry is not None and fits and not debug.enabled():
        flag, digest, row = CHECKED, entry.digest, entry.row
    else:
        flag = NEW if fits else WRONG
        digest = entry.digest if entry is not None else _digest(call)
        row = torch.tensor([digest, flag], dtype=torch.int64, device=meta_device(call.group))
    pending = agree.start(row, call.group, call.ring_group)
    waits = _reads_wait(row.device)

    def confirm(drain: Callable[[list[list[int]]], None]) -> None:
        if flag == CHECKED and waits:  # judged on the device: the CPU does not wait for the GPU
            rows = pending.rows()
            torch._assert_async(((rows[:, 0] == row[0]) & (rows[:, 1] < WRONG)).all(), _ASSERTION)
            return
        table = pending.table()
        digests, flags = {r[0] for r in table}, [r[1] for r in table]
        if len(digests) == 1 and max(flags) == CHECKED:
            return  # every rank repeats a call checked before
        if not waits or min(flags) > CHECKED:  # every rank read the round: all check in full
            _full(call, named, posted, drain, len(digests) > 1)
        elif len(digests) > 1 or max(flags) == WRONG:  # the others went on and stop at their assertion
            raise ValueError(f"{call.what}: {_partial(call, named, table, digest)}")
        _remember(key, call, digest)

    return confirm


def check(call: Call, named: Sequence[tuple[str, int]]) -> None:
    """``start`` and judge at once, before anything is posted (Ulysses and usp check before their all-to-all)."""
    start(call, named)(_nothing_posted)


def _nothing_posted(posted: list[list[int]]) -> None:
    """The drain of a check made before any receive is posted: nothing to complete."""


_ASSERTION = ("cp attention: the ranks' calls differ (another rank changed its plan, transport, token counts, dtype "
              "or sizes while this one repeated a call checked before); run with PARALLEL_STATE_DEBUG=1 to have "
              "every rank name the difference")


def _remember(key: tuple[Any, ...], call: Call, digest: int) -> None:
    row = torch.tensor([digest, CHECKED], dtype=torch.int64, device=meta_device(call.group))
    _cache[key] = _Checked(call.group, call.ring_group, call.masking.plan, digest, row)  # type: ignore[union-attr]
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)


def _names(call: Call) -> tuple[Callable[[int], str], str]:
    """How messages name group rank i, and the unit of rank ("cp" for usp's two groups)."""
    if call.ring_group is not None:
        return (lambda i: f"cp rank {i}"), "cp"
    ranks = global_ranks(call.group)
    return (lambda i: f"group rank {i} (global {ranks[i]})"), "group"


def _full(call: Call, named: Sequence[tuple[str, int]], posted: Sequence[int],
          drain: Callable[[list[list[int]]], None], digests_differ: bool) -> None:
    """The full check: every rank's facts gathered and judged alike; the same ValueError on every rank, or none."""
    m, t = call.masking, call.tensors
    assert m is not None
    plan = m.plan
    layout, fix = m.layout(call.n)
    want = plan.sizes
    who, unit = _names(call)
    sigs_at = 2 + len(named)
    width = sigs_at + 3 * _SIG
    row = [plan.fingerprint(), transports.NAMES.index(plan.transport), *(size for _, size in named), *_sigs(t),
           *posted]
    table = agree.gather(row, call.group, call.ring_group)

    def judge() -> str | None:
        counts = [r[2] for r in table]
        if m.even and len(set(counts)) > 1:
            return (f"the ranks hold different numbers of tokens ({counts} by {unit} rank); for uneven shards pass "
                    f"length= (the whole sequence's) or a plan")
        if len({r[0] for r in table}) > 1:
            return (f"the ranks passed different masks or plans (checksums by {unit} rank: {[r[0] for r in table]}); "
                    f"pass the same mask and plan on every rank")
        if len({r[1] for r in table}) > 1:
            return (f"the ranks' plans ask for different transports ({[transports.NAMES[r[1]] for r in table]} by "
                    f"{unit} rank); pass the same plan on every rank")
        bad = [f"{who(i)} holds {r[c]} tokens of {name}, the {layout} gives it {want[i]}"
               for i, r in enumerate(table) for c, (name, _) in enumerate(named, start=2) if r[c] != want[i]]
        if bad:
            return f"{'; '.join(bad)} (every {unit} rank's: {list(want)}); {fix}"
        layouts: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(table):
            layouts.setdefault(tuple(r[sigs_at:width]), []).append(i)
        if len(layouts) > 1:
            got = "; ".join(f"{', '.join(who(i) for i in ranks)}: {_describe(list(sig))}" for sig, ranks in layouts.items())
            return (f"the ranks' q, k and v differ beyond their token counts ({got}); pass every rank tensors of one "
                    f"dtype and layout, with the same batch, head and feature sizes")
        if digests_differ:
            return "the ranks' calls differ; pass every rank the same plan, transport, dtype and sizes"
        return None

    problem = judge()
    if problem:
        drain([r[width:] for r in table])
        raise ValueError(f"{call.what}: {problem}")


def _describe(sig: list[int]) -> str:
    """q, k and v as one rank's full-check row has them: sizes with the sequence as ``S``, dtype, layout."""
    parts = []
    for name, at in (("q", 0), ("k", _SIG), ("v", 2 * _SIG)):
        code, ndim, s, h = sig[at:at + 4]
        rest = iter(sig[at + 4:at + 3 + ndim])
        shape = ", ".join("S" if d == s else str(next(rest)) for d in range(ndim))
        dtype = str(meta.DTYPES.get(code, "an unknown dtype")).replace("torch.", "")
        parts.append(f"{name} [{shape}] {dtype}")
    return ", ".join(parts) + f" (seq_dim {sig[2]}, head_dim {sig[3]})"


def _partial(call: Call, named: Sequence[tuple[str, int]], table: list[list[int]], digest: int) -> str:
    """What a rank that read the round can say when some others repeated a checked call (and so did not read)."""
    who, unit = _names(call)
    want = call.masking.plan.sizes[call.rank]  # type: ignore[union-attr]
    repeated = [who(i) for i, r in enumerate(table) if r[1] == CHECKED]
    differ = [who(i) for i, r in enumerate(table) if r[0] != digest]
    wrong = [who(i) for i, r in enumerate(table) if r[1] == WRONG]
    said = [f"{', '.join(repeated)} repeated a call checked before while this rank's call is new to it"]
    if differ:
        said.append(f"{', '.join(differ)} passed another plan, transport, dtype or sizes than this rank")
    if wrong:
        mine = ", ".join(f"{size} tokens of {name}" for name, size in named)
        said.append(f"{', '.join(wrong)} hold token counts their plan does not give them (this rank: {mine}; its "
                    f"plan gives it {want})")
    return (f"{'; '.join(said)} (by {unit} rank); pass every rank the same plan, transport, dtype and sizes "
            f"(PARALLEL_STATE_DEBUG=1 has every rank check every call in full and name the difference)")


__all__ = ["CACHE_SIZE", "CHECKED", "NEW", "WRONG", "check", "clear", "start"]
