"""The cross-rank check of a masked attention call: in full once per distinct call, a cheap agreement every call.

A rank alone in a mistake (another plan, transport or method, a token count its plan does not give it,
another dtype, head count or scale) would leave the others waiting in the K/V exchange until the group's
timeout, or compute garbage. So the ranks of every masked call (ring, Ulysses and usp with ``mask=``
or ``plan=``, and so every context-parallel call of ``cp.transformer_engine``'s face) check it together
before any K/V moves, in one round per call, without making the CPU wait for the GPU each call:

- Every call, each rank adds a row of two ints to one round (``cp.agree``: one all-to-all on the
  group's metadata device): a digest of what the ranks must agree on (the ``Method``: ring, Ulysses or
  usp, whose collectives differ; the plan's fingerprint and transport, the scale, the dtype, the layout
  and every size but the token counts; a face's own arguments, ``cp.inputs.Facts``) and a flag:
  ``CHECKED`` (the call, its shapes included, passed a full check on this rank before: ``_cache``, as
  the schedule is cached), ``NEW`` (it did not, or ``PARALLEL_STATE_DEBUG`` is on), ``WRONG`` (its token
  counts are not the ones its plan gives this rank) or ``REFUSED`` (the rank cannot make the call at all:
  a face's input only it sees is wrong; ``refuse`` takes its part in the round instead, so that no rank
  waits for it).
- Where reading the round costs no wait for a GPU (the group has a CPU backend: gloo, or
  "cpu:gloo,cuda:nccl"), every rank reads it. One digest and every flag ``CHECKED``: the call goes on.
  Otherwise every rank takes part in the full check: a second round of one row per rank, as wide on
  every rank whatever its call (so that ranks whose calls differ still meet): its method, plan,
  transport, scale, token count, dtype and sizes, a face's arguments, a refusing rank's reason, judged
  alike on every rank, which raises the same ValueError on every rank (naming ranks, sizes, or a
  refusing rank and its reason) or passes and remembers the call.
- Where it would (NCCL, the round on the GPU): a rank repeating a ``CHECKED`` call does not read; a
  device-side assertion (``torch._assert_async``, no host sync) stops it when another rank's digest
  differs or a flag is ``WRONG`` or ``REFUSED``. A rank with a ``NEW``, ``WRONG`` or ``REFUSED`` call reads (once
  per distinct call): when every rank does, all take the full check as above; when some repeated a
  checked call (so no second round can run), it passes where the digests agree and no flag is
  ``WRONG`` or ``REFUSED`` (and remembers the call), and raises what it can name otherwise, while the
  others stop at their assertion.

So a rank changing its call while the others repeat theirs is an error on every rank, never a hang
(on gloo the same ValueError everywhere; on NCCL the changed rank's ValueError and the others' failed
device assertion, whose CUDA error names no ranks: ``PARALLEL_STATE_DEBUG=1`` checks every call in full).
The round also serves the engine's receives-first order (p2p on gloo): each rank's row leaves after
its receives are posted. A full check that fails first completes those receives (``drain``; a rank
that posted none, Ulysses' or a refusing one, still sends the others what they posted for from it).
"""

from __future__ import annotations

import enum
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

import torch

import parallel_state
from cp import agree, debug, meta, transports
from cp.comm import global_ranks, meta_device
from cp.engine import Confirm
from cp.inputs import Call, Facts, Tensors


class Flag(enum.IntEnum):
    """A rank's flag in the round (see the module doc); ordered, as the checks compare ``>= WRONG``."""

    CHECKED = 0
    NEW = 1
    WRONG = 2
    REFUSED = 3


CHECKED, NEW, WRONG, REFUSED = Flag
#: Distinct calls remembered by this process, the least recently used forgotten first.
CACHE_SIZE = 64
#: Tests set it to run, on gloo, the path of a group whose reads would make the CPU wait for a GPU (NCCL).
reads_wait_everywhere = False
#: A face's arguments (``Facts``) the full check's row has room for, and the bytes of a refusing rank's reason.
MAX_FACTS = 12
REASON_BYTES = 512


class Method(parallel_state.StrEnum):
    """How a masked call attends, which fixes the collectives it runs once checked (so the ranks must agree)."""

    RING = "the ring"    # ring_attention: K/V by the plan's transport
    ULYSSES = "Ulysses"  # ulysses_attention (usp without a ring): one all-to-all, then every token on each rank
    USP = "usp"          # usp_attention: Ulysses' all-to-all, then the ring over the ring group
    CROSS = "the cross attention's gather"  # cp.cross: K/V gathered whole, each query to its sample's keys


_METHODS = list(Method)
#: One tensor's layout in the full check's row: dtype code, dims, seq dim, head dim, every size but the tokens.
_SIG = 4 + meta.MAX_NDIM
#: The full check's row, column by column (then the bytes posted from each rank): as wide on every rank.
_METHOD, _FINGERPRINT, _TRANSPORT, _SCALE, _TOKENS, _SIGS = range(6)
_FACTS = _SIGS + 3 * _SIG
_REASON = _FACTS + MAX_FACTS
_POSTED = _REASON + REASON_BYTES // 8


@dataclass
class _Checked:
    """A call that passed the full check: the objects its key names by identity (held, so their ids are not
    reused while it is remembered), its digest and its round's row, made once on the metadata device."""

    group: Any
    ring_group: Any
    plan: Any
    facts: Facts | None
    digest: int
    row: torch.Tensor


_cache: OrderedDict[tuple[Any, ...], _Checked] = OrderedDict()


def clear() -> None:
    """Forget every checked call (the next call of each checks in full again, on every rank)."""
    _cache.clear()


def _key(call: Call, method: Method) -> tuple[Any, ...]:
    t, plan = call.tensors, call.masking.plan  # type: ignore[union-attr]
    return (method, id(call.group), id(call.ring_group), id(plan), id(call.facts), call.what, call.scale, t.s, t.h,
            t.q.dtype, t.q.device, tuple(t.q.shape), tuple(t.k.shape), tuple(t.v.shape))


def _lookup(call: Call, key: tuple[Any, ...]) -> _Checked | None:
    entry = _cache.get(key)
    if entry is None or entry.group is not call.group or entry.ring_group is not call.ring_group \
            or entry.plan is not call.masking.plan or entry.facts is not call.facts:  # type: ignore[union-attr]
        return None
    _cache.move_to_end(key)
    return entry


def _sig(x: torch.Tensor, s: int, h: int) -> list[int]:
    """x's layout: dtype code, dims, s, h and its sizes but the sequence's (padded), as the full check compares."""
    rest = [size for d, size in enumerate(x.shape) if d != s]
    return [meta.DTYPE_CODES.get(x.dtype, -1), x.dim(), s, h] + rest + [-1] * (_SIG - 4 - len(rest))


def _sigs(t: Tensors) -> list[int]:
    return [v for x in (t.q, t.k, t.v) for v in _sig(x, t.s, t.h)]


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


def _fact_digests(facts: Facts | None) -> list[int]:
    """A face's arguments as the full check's columns: one digest each, 0 for the columns it leaves empty."""
    fields = () if facts is None else facts.fields
    assert len(fields) <= MAX_FACTS, f"a call's Facts hold at most {MAX_FACTS} fields"
    return [agree.digest(value) for _, value in fields] + [0] * (MAX_FACTS - len(fields))


def _digest(call: Call, method: Method) -> int:
    """A 63-bit digest of what every rank of the call must agree on, the same in every process."""
    plan = call.masking.plan  # type: ignore[union-attr]
    return agree.digest((method.value, plan.fingerprint(), plan.transport, call.scale, _sigs(call.tensors),
                         _fact_digests(call.facts)))


def _encode(reason: str) -> list[int]:
    """A refusing rank's reason as ints (utf-8, cut to REASON_BYTES, 8 bytes an int; all 0 for none)."""
    raw = reason.encode()
    if len(raw) > REASON_BYTES:
        raw = raw[:REASON_BYTES - 3].decode(errors="ignore").encode() + b"..."
    raw = raw.ljust(REASON_BYTES, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, REASON_BYTES, 8)]


def _decode(ints: Sequence[int]) -> str:
    return b"".join(i.to_bytes(8, "little", signed=True) for i in ints).rstrip(b"\0").decode(errors="replace")


def _reads_wait(device: torch.device) -> bool:
    """Whether the host reading a round on ``device`` waits for the device's queued work."""
    return device.type != "cpu" or reads_wait_everywhere


def _everyone_reads(flags: Sequence[int], waits: bool) -> bool:
    """Whether every rank read the round (so all can take the second round of the full check)."""
    return not waits or min(flags) > CHECKED


def _row(digest: int, flag: Flag, group: Any) -> torch.Tensor:
    return torch.tensor([digest, int(flag)], dtype=torch.int64, device=meta_device(group))


def start(call: Call, method: Method, posted: Sequence[int] = ()) -> Confirm:
    """Start the check of a masked ``call`` that attends by ``method``; the round runs while the caller computes.
    Calling the result with a ``drain`` judges it, on every rank before anything else crosses the group: it
    returns, or raises (having called ``drain`` with every rank's ``posted`` where the full check ran).

    ``posted``: the bytes this rank has posted receives for, from each group rank (as many entries on every
    rank; none: nothing posted), so that a failed check can complete them (``cp.engine``)."""
    plan = call.masking.plan  # type: ignore[union-attr]
    key = _key(call, method)
    entry = _lookup(call, key)
    fits = call.tensors.local == plan.sizes[call.rank]
    if entry is not None and fits and not debug.enabled():
        flag, digest, row = CHECKED, entry.digest, entry.row
    else:
        flag = NEW if fits else WRONG
        digest = entry.digest if entry is not None else _digest(call, method)
        row = _row(digest, flag, call.group)
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
        if _everyone_reads(flags, waits):  # all check in full
            _full(call, method, posted, drain, len(digests) > 1)
        elif len(digests) > 1 or max(flags) >= WRONG:  # the others went on and stop at their assertion
            raise ValueError(f"{call.what}: {_partial(call, table, digest)}")
        _remember(key, call, digest)

    return confirm


def check(call: Call, method: Method) -> None:
    """``start`` and judge at once, before anything is posted (Ulysses and usp check before their all-to-all)."""
    def drain(posted: list[list[int]]) -> None:  # this rank posted nothing; a ring rank may have, from it
        if call.ring_group is None:
            transports.wait(transports.send_empty(call.group, call.rank, posted, call.tensors.q.device))

    start(call, method)(drain)


def refuse(what: str, reason: str, group: Any, ring_group: Any = None) -> NoReturn:
    """Take this rank's part in the check of a call it cannot make, so that every rank raises before any K/V moves.

    ``reason``: what is wrong with this rank's inputs and what to change (a face's own check of them);
    ``group`` / ``ring_group``: those of the call the other ranks make (usp: its Ulysses and ring groups).
    The others raise naming this rank and its reason (cut to REASON_BYTES); this rank the same ValueError or,
    where the others repeated a checked call on NCCL (they stop at their device-side assertion), ``reason``."""
    row = _row(0, REFUSED, group)
    table = agree.start(row, group, ring_group).table()
    if not _everyone_reads([r[1] for r in table], _reads_wait(row.device)):
        raise ValueError(f"{what}: {reason}")
    full = [-1] * _FACTS + [0] * MAX_FACTS + _encode(reason or "its inputs are wrong") + [0] * len(table)
    table = agree.gather(full, group, ring_group)
    if ring_group is None:  # a ring rank may have posted receives from this one: complete them
        transports.wait(transports.send_empty(group, group.rank(), [r[_POSTED:] for r in table], row.device))
    cut = len(reason.encode()) > REASON_BYTES
    raise ValueError(f"{what}: {_refusals(table, _names(group, ring_group)[0])}"
                     + (f" (this rank's reason in full: {reason})" if cut else ""))


def refuse_call(call: Call, error: Exception) -> NoReturn:
    """``refuse`` for ``call``, whose own checks on this rank (made before its round) raised ``error``: a rank alone
    in that mistake then does not leave the others waiting in the round."""
    refuse(call.what, str(error).removeprefix(f"{call.what}: "), call.group, call.ring_group)


_ASSERTION = ("cp attention: the ranks' calls differ (another rank changed its plan, transport, token counts, dtype, "
              "sizes or a face's arguments, or cannot make the call, while this one repeated a call checked before); "
              "run with PARALLEL_STATE_DEBUG=1 to have every rank name the difference")


def _remember(key: tuple[Any, ...], call: Call, digest: int) -> None:
    _cache[key] = _Checked(call.group, call.ring_group, call.masking.plan,  # type: ignore[union-attr]
                           call.facts, digest, _row(digest, CHECKED, call.group))
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)


def _names(group: Any, ring_group: Any) -> tuple[Callable[[int], str], str]:
    """How messages name row i of a round, and the unit of rank ("cp" for usp's two groups)."""
    if ring_group is not None:
        return (lambda i: f"cp rank {i}"), "cp"
    ranks = global_ranks(group)
    return (lambda i: f"group rank {i} (global {ranks[i]})"), "group"


def _refusals(table: list[list[int]], who: Callable[[int], str]) -> str | None:
    """The refusing ranks of a full check and their reasons; None when no rank refused."""
    reasons: dict[str, list[int]] = {}
    for i, r in enumerate(table):
        text = _decode(r[_REASON:_POSTED])
        if text:
            reasons.setdefault(text, []).append(i)
    if not reasons:
        return None
    return "; ".join(f"on every rank of the cp group: {text}" if len(ranks) == len(table)
                     else f"{', '.join(who(i) for i in ranks)}: {text}" for text, ranks in reasons.items())


def _full(call: Call, method: Method, posted: Sequence[int], drain: Callable[[list[list[int]]], None],
          digests_differ: bool) -> None:
    """The full check: every rank's facts gathered and judged alike; the same ValueError on every rank, or none."""
    m, t = call.masking, call.tensors
    assert m is not None and call.scale is not None
    plan = m.plan
    posted = list(posted) or [0] * call.n
    assert len(posted) == call.n
    row = [_METHODS.index(method), plan.fingerprint(), transports.NAMES.index(plan.transport),
           _float_bits(call.scale), t.local, *_sigs(t), *_fact_digests(call.facts), *_encode(""), *posted]
    table = agree.gather(row, call.group, call.ring_group)
    who, unit = _names(call.group, call.ring_group)
    problem = _refusals(table, who) or _facts_differ(call, table) or _judge(call, table, who, unit, digests_differ)
    if problem:
        drain([r[_POSTED:] for r in table])
        raise ValueError(f"{call.what}: {problem}")


def _facts_differ(call: Call, table: list[list[int]]) -> str | None:
    """Which of a face's arguments differ across the ranks, with this rank's values; None when none does."""
    columns = [c for c in range(MAX_FACTS) if len({r[_FACTS + c] for r in table}) > 1]
    if not columns:
        return None
    fields = () if call.facts is None else call.facts.fields
    named = [fields[c] for c in columns if c < len(fields)]
    names = ", ".join(name for name, _ in named) or "a face's arguments"
    mine = ", ".join(f"{name}={value!r}" for name, value in named) or "called without a face"
    return (f"the ranks call attention differently: their {names} differ (this rank: {mine}); every rank of the "
            f"group must pass the same settings and shapes")


def _judge(call: Call, table: list[list[int]], who: Callable[[int], str], unit: str, digests_differ: bool
           ) -> str | None:
    """What the full check finds wrong with a call every rank makes (none refused, a face's arguments alike)."""
    m = call.masking
    assert m is not None
    layout, fix = m.layout(call.n)
    want = m.plan.sizes
    methods = [r[_METHOD] for r in table]
    if len(set(methods)) > 1:
        return (f"the ranks attend by different methods ({[_METHODS[k].value for k in methods]} by {unit} rank); "
                f"call the same attention function (or cp_comm_type) on every rank")
    counts = [r[_TOKENS] for r in table]
    if m.even and len(set(counts)) > 1:
        return (f"the ranks hold different numbers of tokens ({counts} by {unit} rank); for uneven shards pass "
                f"length= (the whole sequence's) or a plan")
    if len({r[_FINGERPRINT] for r in table}) > 1:
        return (f"the ranks passed different masks or plans (checksums by {unit} rank: "
                f"{[r[_FINGERPRINT] for r in table]}); pass the same mask and plan on every rank")
    if len({r[_TRANSPORT] for r in table}) > 1:
        asked = [str(transports.NAMES[r[_TRANSPORT]]) for r in table]  # the strings: a list shows members' reprs
        return (f"the ranks' plans ask for different transports ({asked} by {unit} rank); pass the same plan on "
                f"every rank")
    bad = [f"{who(i)} holds {r[_TOKENS]} tokens of q, the {layout} gives it {want[i]}"
           for i, r in enumerate(table) if r[_TOKENS] != want[i]]
    if bad:
        return f"{'; '.join(bad)} (every {unit} rank's: {list(want)}); {fix}"
    layouts: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(table):
        layouts.setdefault(tuple(r[_SIGS:_FACTS]), []).append(i)
    if len(layouts) > 1:
        got = "; ".join(f"{', '.join(who(i) for i in ranks)}: {_describe(list(sig))}" for sig, ranks in layouts.items())
        return (f"the ranks' q, k and v differ beyond their token counts ({got}); pass every rank tensors of one "
                f"dtype and layout, with the same batch, head and feature sizes")
    if len({r[_SCALE] for r in table}) > 1:
        return (f"the ranks pass different softmax scales ({[_bits_float(r[_SCALE]) for r in table]} by {unit} "
                f"rank); pass the same scale on every rank")
    if digests_differ:
        return "the ranks' calls differ; pass every rank the same plan, transport, dtype and sizes"
    return None


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


def _partial(call: Call, table: list[list[int]], digest: int) -> str:
    """What a rank that read the round can say when some others repeated a checked call (and so did not read)."""
    who, unit = _names(call.group, call.ring_group)
    want = call.masking.plan.sizes[call.rank]  # type: ignore[union-attr]
    repeated = [who(i) for i, r in enumerate(table) if r[1] == CHECKED]
    refused = [who(i) for i, r in enumerate(table) if r[1] == REFUSED]
    differ = [who(i) for i, r in enumerate(table) if r[0] != digest and r[1] != REFUSED]
    wrong = [who(i) for i, r in enumerate(table) if r[1] == WRONG]
    said = [f"{', '.join(repeated)} repeated a call checked before while this rank's call is new to it"]
    if refused:
        said.append(f"{', '.join(refused)} cannot make this call (their own error says what to change)")
    if differ:
        said.append(f"{', '.join(differ)} passed another method, plan, transport, scale, dtype, sizes or face "
                    f"arguments than this rank")
    if wrong:
        said.append(f"{', '.join(wrong)} hold token counts their plan does not give them (this rank: "
                    f"{call.tensors.local} tokens of q; its plan gives it {want})")
    return (f"{'; '.join(said)} (by {unit} rank); pass every rank the same plan, transport, dtype and sizes "
            f"(PARALLEL_STATE_DEBUG=1 has every rank check every call in full and name the difference)")


__all__ = ["CACHE_SIZE", "CHECKED", "Flag", "MAX_FACTS", "Method", "NEW", "REASON_BYTES", "REFUSED", "WRONG", "check",
           "clear", "refuse", "refuse_call", "start"]
