"""How K/V reach the ranks that need them: one class per transport, one instance per pass.

``cp.engine`` runs every pass (forward, backward) the same way and names no transport: it takes the
class ``choose(name, group, device)`` returns, once per call, and per pass calls, in this order,
``post_receives`` (what the pass receives before anyone sends: p2p on gloo), ``start(t)`` (start what
step t sends and receives: ring and p2p the transfer for step t + 1, overlapping step t's compute),
``kv(t, block)`` (block t's K and V), ``finish(t)`` (wait for step t's transfers) and, after a failed
cross-rank check, ``drain``. The backward's dK/dV go through the pass's ``gradients(dtype)``: the
transport's own ``Gradients``, which ``add``s each step's block and returns this rank's own ``result()``.
A new transport is one member of ``parallel_state.Transport`` (``cp.Transport``: the plans' closed set) and one
subclass of ``Exchange`` here (with its ``Gradients``) whose ``name`` is that member, listed in ``CLASSES``.

- ``"ring"`` (``Ring``): at step t every rank passes the whole block it holds on to rank + 1, while a rank
  further down the ring still needs it (causal on the contiguous split: rank i computes i + 1
  blocks, and blocks wholly in a rank's future are neither sent nor computed). Backward: the K/V
  travel again and each block's dK/dV accumulator travels behind it, round the whole ring (every
  rank takes part in every step's exchange), back to the block's owner.
- ``"p2p"`` (``PointToPoint``): straight from the owner to each rank that needs a block, only the needed
  tokens (at step t to rank + t, from rank - t). NCCL orders a batch of sends and receives on one stream,
  where transfers started early would wait for ranks that wait for this one, so there each step starts its
  own. On gloo (``PointToPointAtOnce``) every rank posts all its receives on entry and starts all its sends
  after its own block, once every rank has posted its receives (``posts_first``: the engine's round), so
  that no rank waits for another to reach a step (on shared CPU cores each such wait is a wake-up of
  another process; the rank then holds every block it needs at once, as with "allgather").
  Backward: a received block's dK/dV goes straight back to its owner (one message per block; on gloo
  the owner posts all their receives on entry too).
- ``"allgather"`` (``AllGather``): one all-gather of every rank's K/V (shards padded to the longest),
  overlapped with the rank's own block; backward gathers again and returns every block's dK/dV to its
  owner in one all-to-all (a reduce-scatter). Fewest messages: best for short sequences and many clips.

No rank of the ring or p2p holds more than two other ranks' K/V at once (p2p on gloo: every block it
needs, as the all-gather). ``cp.count_attention`` sees every byte each pass hands to torch.distributed.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import torch
import torch.distributed as dist

import parallel_state as ps
from cp.comm import backend_for, global_ranks
from cp.mask_schedule import Block, Schedule, Send

#: Message tags of K/V and of their gradients, so that gloo never pairs one kind's send with the other's receive.
TAG_KV, TAG_DKV = 11, 12


def start_ops(ops: list[Any]) -> list[Any]:
    """Start a batch of point-to-point ops (none is fine); their works."""
    return dist.batch_isend_irecv(ops) if ops else []


def wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def add_tokens(dk: torch.Tensor, dv: torch.Tensor, index: torch.Tensor | None, gk: torch.Tensor,
               gv: torch.Tensor) -> None:
    """Add the gradients of the tokens ``index`` (None: all, in order) into dK and dV."""
    if index is None:
        dk += gk
        dv += gv
    else:
        dk.index_add_(-2, index, gk)
        dv.index_add_(-2, index, gv)


def send_empty(group: Any, rank: int, posted: Sequence[Sequence[int]], device: torch.device) -> list[Any]:
    """After a failed check, from group rank ``rank``: start sending every rank of ``group`` the empty bytes it
    posted a receive for from this one (``posted[i][j]``: group rank i's from group rank j); the works. A rank
    that posted nothing itself (Ulysses, a rank that could not make its call) still sends the others theirs."""
    peers = [(i, row[rank]) for i, row in enumerate(posted) if i != rank and row[rank]]
    if not peers:
        return []
    ranks = global_ranks(group)
    return start_ops([dist.P2POp(dist.isend, torch.zeros(size, dtype=torch.uint8, device=device), ranks[i], group,
                                 TAG_KV) for i, size in peers])


class Exchange:
    """This rank's side of the K/V traffic of one pass, on ``schedule`` over ``group`` (see the module doc).

    ``counts``: the open ``cp.count_attention`` counts, told every byte sent and received.
    """

    #: The name a plan asks for it by (``DispatchPlan.transport``).
    name: ClassVar[ps.Transport]
    #: Whether the pass posts its receives before a round after which every rank has posted (p2p on gloo).
    posts_first: ClassVar[bool] = False

    def __init__(self, schedule: Schedule, group: Any, k: torch.Tensor, v: torch.Tensor, counts: Sequence[Any]):
        self.sched, self.group, self.k, self.v, self.counts = schedule, group, k, v, counts
        self.ranks = global_ranks(group) if group is not None else [0]
        self.per_token = k[..., :1, :].numel() + v[..., :1, :].numel()  # K and V elements per token
        self.rank, self.n = schedule.rank, schedule.n
        self.works: list[Any] = []  # the transfers of the step under way

    @classmethod
    def on(cls, backend: str | None) -> type[Exchange]:
        """The class that runs this transport where the K/V travel by ``backend`` (None: one process)."""
        return cls

    # ---------------------------------------------------------------- what every transport shares

    def tell(self, table: str, peer: int, tensor: torch.Tensor, times: int = 1) -> None:
        for c in self.counts:
            c.add(getattr(c, table), self.ranks[peer], times * tensor.numel() * tensor.element_size())

    def pack(self, index: torch.Tensor | None) -> torch.Tensor:
        """This rank's K and V of the tokens ``index`` (None: all), in one flat buffer."""
        if index is None:
            return torch.cat([self.k.reshape(-1), self.v.reshape(-1)])
        return torch.cat([self.k.index_select(-2, index).reshape(-1), self.v.index_select(-2, index).reshape(-1)])

    def unpack(self, packed: torch.Tensor, size: int, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a flat buffer laid out for ``tokens`` tokens (default ``size``), the first ``size`` of them."""
        tokens = size if tokens is None else tokens
        k_shape = (*self.k.shape[:-2], tokens, self.k.shape[-1])
        v_shape = (*self.v.shape[:-2], tokens, self.v.shape[-1])
        nk = math.prod(k_shape)
        kb, vb = packed[:nk].view(k_shape), packed[nk:nk + math.prod(v_shape)].view(v_shape)
        if size != tokens:
            kb, vb = kb[..., :size, :], vb[..., :size, :]
        return kb, vb

    def buffer(self, tokens: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An empty flat buffer for the K and V (or their gradients, in ``dtype``) of ``tokens`` tokens."""
        return self.k.new_empty(tokens * self.per_token, dtype=dtype)

    @staticmethod
    def select(kb: torch.Tensor, vb: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        if block.index is None:
            return kb, vb
        return kb.index_select(-2, block.index), vb.index_select(-2, block.index)

    def send_op(self, tensor: torch.Tensor, peer: int, tag: int = TAG_KV) -> Any:
        return dist.P2POp(dist.isend, tensor, self.ranks[peer], self.group, tag)

    def recv_op(self, tensor: torch.Tensor, peer: int, tag: int = TAG_KV) -> Any:
        return dist.P2POp(dist.irecv, tensor, self.ranks[peer], self.group, tag)

    # ---------------------------------------------------------------- the pass

    def post_receives(self) -> list[int]:
        """Post what this pass receives before any rank sends (``posts_first``); the bytes posted from each
        group rank (none by default)."""
        return [0] * self.n

    def start(self, t: int) -> None:
        """Start what step t sends and receives."""
        raise NotImplementedError

    def kv(self, t: int, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """Block t's K and V (the tokens its tiles' columns index), in the input dtype."""
        if t == 0:
            return self.select(self.k, self.v, block)
        return self.received(t, block)

    def received(self, t: int, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """Block t's K and V, for t > 0: another rank's."""
        raise NotImplementedError

    def finish(self, t: int) -> None:
        """Wait for step t's transfers."""
        wait(self.works)
        self.works = []

    def drain(self, posted: list[list[int]]) -> None:
        """After a failed check: send every rank the empty bytes it posted a receive for from this one
        (``send_empty``) and complete this rank's own, so that no receive stays posted."""
        works = send_empty(self.group, self.rank, posted, self.k.device)
        self.complete_posted()
        wait(works)

    def complete_posted(self) -> None:
        """Wait for the receives ``post_receives`` posted (after ``drain``'s empty messages)."""

    def gradients(self, dtype: torch.dtype) -> Gradients:
        """The backward's dK/dV traffic of this pass, summed in ``dtype``."""
        return self.Gradients(self, dtype)

    class Gradients:
        """dK/dV of the blocks a backward pass computed, back to their owners: ``add`` each step's (t = 0: this
        rank's own block), then ``result()``, this rank's own dK and dV once every rank's share has arrived."""

        def __init__(self, kv: Exchange, dtype: torch.dtype):
            self.kv, self.dtype = kv, dtype
            self.dk: Any = None  # this rank's own dK / dV, from its own block (``add`` at t = 0)
            self.dv: Any = None

        def post_receives(self) -> None:
            """Post the gradients' receives with the K/V's (``posts_first``)."""

        def add(self, t: int, block: Block | None, dkb: torch.Tensor | None, dvb: torch.Tensor | None) -> None:
            """Hand over step t's dK/dV of block t (None when this rank computed nothing at step t)."""
            if t == 0:
                self.own(block, dkb, dvb)
            self.step(t, block, dkb, dvb)

        def own(self, block: Block | None, dkb: Any, dvb: Any) -> None:
            """This rank's own block's dK/dV start its dK/dV: as they are where they hold every token in order and
            are summed in the pass's dtype or nothing else arrives (one rank); else added into zeros."""
            kv = self.kv
            if block is not None and block.index is None and (kv.n == 1 or dkb.dtype == self.dtype):
                self.dk, self.dv = dkb, dvb
                return
            dtype = self.dtype if kv.n > 1 or dkb is None else dkb.dtype
            self.dk, self.dv = kv.k.new_zeros(kv.k.shape, dtype=dtype), kv.v.new_zeros(kv.v.shape, dtype=dtype)
            if block is not None:
                add_tokens(self.dk, self.dv, block.index, dkb, dvb)

        def step(self, t: int, block: Block | None, dkb: Any, dvb: Any) -> None:
            """What the transport does with step t's dK/dV (t = 0: this rank's own, already added)."""

        def result(self) -> tuple[torch.Tensor, torch.Tensor]:
            return self.dk, self.dv


class Ring(Exchange):
    """Whole blocks passed on to rank + 1 while a rank further down the ring needs them."""

    name = ps.Transport.RING

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.held: torch.Tensor | None = None  # the block held now (whole)
        self.recv: torch.Tensor | None = None  # step t + 1's, arriving

    def start(self, t: int) -> None:
        # Pass the block held at step t on, receive the one of step t + 1.
        if t == 0:
            self.held = self.pack(None)
        ops, self.recv = [], None
        if t < self.n - 1:
            nxt, prv = (self.rank + 1) % self.n, (self.rank - 1) % self.n
            if self.sched.ring_forwards(self.rank, t):
                assert self.held is not None
                ops.append(self.send_op(self.held, nxt))
                self.tell("kv_sent", nxt, self.held)
            if self.sched.ring_forwards(prv, t):
                self.recv = self.buffer(self.sched.sizes[(self.rank - t - 1) % self.n])
                ops.append(self.recv_op(self.recv, prv))
                self.tell("kv_received", prv, self.recv)
        self.works = start_ops(ops)

    def received(self, t: int, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.held is not None
        return self.select(*self.unpack(self.held, self.sched.sizes[block.source]), block)

    def finish(self, t: int) -> None:
        super().finish(t)
        self.held = self.recv

    class Gradients(Exchange.Gradients):
        """Each block's dK/dV accumulator travels behind it round the whole ring, back to its owner."""

        def __init__(self, kv: Exchange, dtype: torch.dtype):
            super().__init__(kv, dtype)
            self.works: list[Any] = []
            self.incoming: torch.Tensor | None = None  # the accumulator of the block held now
            self.sending: torch.Tensor | None = None

        def step(self, t: int, block: Block | None, dkb: Any, dvb: Any) -> None:
            kv = self.kv
            if kv.n == 1:
                return
            size = kv.sched.sizes[(kv.rank - t) % kv.n]
            wait(self.works)  # the accumulator sent by the previous rank after its step t - 1
            mine = None
            if block is not None and t > 0:
                if block.index is None:
                    mine = torch.cat([dkb.reshape(-1), dvb.reshape(-1)])
                else:
                    whole = kv.k.new_zeros(size * kv.per_token, dtype=self.dtype)
                    gk, gv = kv.unpack(whole, size)
                    add_tokens(gk, gv, block.index, dkb, dvb)
                    mine = whole
            if t == 0:  # this rank's own block starts its accumulator (its own share is already in dk / dv)
                dkv = kv.k.new_zeros(size * kv.per_token, dtype=self.dtype)
            else:
                assert self.incoming is not None
                dkv = self.incoming if mine is None else mine.add_(self.incoming)
            # Pass it on (after the last step that is to the block's owner); receive the next block's, or after
            # the last step this rank's own, complete.
            nxt, prv = (kv.rank + 1) % kv.n, (kv.rank - 1) % kv.n
            self.sending = dkv
            self.incoming = kv.buffer(kv.sched.sizes[(kv.rank - t - 1) % kv.n], self.dtype)
            self.works = start_ops([kv.send_op(self.sending, nxt, TAG_DKV), kv.recv_op(self.incoming, prv, TAG_DKV)])
            kv.tell("grad_sent", nxt, self.sending)
            kv.tell("grad_received", prv, self.incoming)

        def result(self) -> tuple[torch.Tensor, torch.Tensor]:
            if self.kv.n > 1:
                wait(self.works)
                assert self.incoming is not None
                gk, gv = self.kv.unpack(self.incoming, self.kv.sched.local)
                self.dk += gk
                self.dv += gv
            return self.dk, self.dv


class PointToPoint(Exchange):
    """Only the needed tokens, straight from their owner, step by step (at step t to rank + t, from rank - t)."""

    name = ps.Transport.P2P

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.held: torch.Tensor | None = None  # the block received for step t
        self.recv: torch.Tensor | None = None  # step t + 1's, arriving

    @classmethod
    def on(cls, backend: str | None) -> type[Exchange]:
        return PointToPointAtOnce if starts_all_at_once(backend) else cls

    def receive_op(self, t: int) -> tuple[Any, torch.Tensor] | None:
        """Step t's K/V receive (from rank - t) and its buffer; None when this rank needs nothing then."""
        block = self.sched.blocks[t]
        if block is None:
            return None
        buf = self.buffer(block.size)
        self.tell("kv_received", block.source, buf)
        return self.recv_op(buf, block.source), buf

    def start(self, t: int) -> None:
        """Start step t + 1's K/V transfer (send to rank + t + 1, receive from rank - t - 1)."""
        step = t + 1
        self.works, self.recv = [], None
        if step >= self.n:
            return
        ops = []
        send = self.sched.sends[step]
        if send is not None:
            packed = self.pack(send.index)
            ops.append(self.send_op(packed, send.dest))
            self.tell("kv_sent", send.dest, packed)
        recv = self.receive_op(step)
        if recv is not None:
            ops.append(recv[0])
            self.recv = recv[1]
        self.works = start_ops(ops)

    def received(self, t: int, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.held is not None
        return self.unpack(self.held, block.size)

    def finish(self, t: int) -> None:
        super().finish(t)
        self.held = self.recv  # step t + 1's block (None when there is none)

    class Gradients(Exchange.Gradients):
        """A received block's dK/dV straight back to its owner; the ones this rank's sends earned, step by step."""

        def __init__(self, kv: Exchange, dtype: torch.dtype):
            super().__init__(kv, dtype)
            self.works: list[Any] = []
            self.arriving: list[tuple[torch.Tensor, Send]] = []  # dK/dV received while this step computes

        def send_back(self, block: Block | None, dkb: Any, dvb: Any) -> list[Any]:
            """The op sending block's dK/dV to its owner (none without a block)."""
            if block is None:
                return []
            kv = self.kv
            packed = torch.cat([dkb.reshape(-1), dvb.reshape(-1)])
            kv.tell("grad_sent", block.source, packed)
            return [kv.send_op(packed, block.source, TAG_DKV)]

        def receive(self, send: Send) -> Any:
            """The op receiving the dK/dV of the tokens this rank sent by ``send``."""
            kv = self.kv
            incoming = kv.buffer(send.size, self.dtype)
            kv.tell("grad_received", send.dest, incoming)
            self.arriving.append((incoming, send))
            return kv.recv_op(incoming, send.dest, TAG_DKV)

        def step(self, t: int, block: Block | None, dkb: Any, dvb: Any) -> None:
            if t == 0:
                return
            ops = self.send_back(block, dkb, dvb)
            send = self.kv.sched.sends[t]
            self.settle()  # the previous step's, received while this step computed
            if send is not None:  # the dK/dV of the tokens this rank sent rank + t at this step
                ops.append(self.receive(send))
            self.works = start_ops(ops)

        def settle(self) -> None:
            """Wait for the gradient messages started so far and add the received ones."""
            wait(self.works)
            self.works = []
            for packed, send in self.arriving:
                gk, gv = self.kv.unpack(packed, send.size)
                add_tokens(self.dk, self.dv, send.index, gk, gv)
            self.arriving = []

        def result(self) -> tuple[torch.Tensor, torch.Tensor]:
            self.settle()
            return self.dk, self.dv


class PointToPointAtOnce(PointToPoint):
    """p2p where sends and receives are independent works (gloo): every step's transfer starts at step 0.

    Every receive is posted on entry (``post_receives``, before the engine's round), every send once this
    rank's own block is computed; a receive posted before its data arrives is read straight into its
    buffer, so no rank waits for another to reach a step.
    """

    posts_first = True

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.early: dict[int, tuple[list[Any], torch.Tensor | None]] = {}  # every step's receive, by step
        self.sends: list[Any] = []  # every step's send of this rank's K/V

    def post_receives(self) -> list[int]:
        posted = [0] * self.n
        for t in range(1, self.n):
            recv = self.receive_op(t)
            self.early[t] = ([], None) if recv is None else (start_ops([recv[0]]), recv[1])
            if recv is not None:
                posted[self.sched.blocks[t].source] += recv[1].numel() * recv[1].element_size()  # type: ignore[union-attr]
        return posted

    def start(self, t: int) -> None:
        if t == 0:
            self.send_all()
        self.works, self.recv = self.early.pop(t + 1) if t + 1 < self.n else ([], None)

    def send_all(self) -> None:
        """Start every step's send: this rank's sends are all ready now."""
        ops, whole = [], None
        for send in self.sched.sends[1:]:
            if send is None:
                continue
            if send.index is None:  # the whole block: one buffer serves every rank that needs it all
                whole = self.pack(None) if whole is None else whole
            packed = whole if send.index is None else self.pack(send.index)
            ops.append(self.send_op(packed, send.dest))
            self.tell("kv_sent", send.dest, packed)
        self.sends = start_ops(ops)

    def finish(self, t: int) -> None:
        super().finish(t)
        if t == self.n - 1:  # the pass's last step: every send has been received
            wait(self.sends)
            self.sends = []

    def complete_posted(self) -> None:
        for received, _ in self.early.values():
            wait(received)
        self.early = {}

    class Gradients(PointToPoint.Gradients):
        """Every dK/dV receive posted with the K/V's; every send waited for at the end."""

        def post_receives(self) -> None:
            self.works = start_ops([self.receive(send) for send in self.kv.sched.sends[1:] if send is not None])

        def step(self, t: int, block: Block | None, dkb: Any, dvb: Any) -> None:
            if t:
                self.works += start_ops(self.send_back(block, dkb, dvb))


class AllGather(Exchange):
    """One all-gather of every rank's K/V (each shard padded to the longest); dK/dV back in one all-to-all."""

    name = ps.Transport.ALLGATHER

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.gathered: torch.Tensor | None = None
        self.padded = max(self.sched.sizes)

    def start(self, t: int) -> None:
        if t or self.n == 1:
            return
        most, mine = self.padded, self.sched.local
        if mine == most:
            packet = self.pack(None)
        else:
            kp = self.k.new_zeros((*self.k.shape[:-2], most, self.k.shape[-1]))
            vp = self.v.new_zeros((*self.v.shape[:-2], most, self.v.shape[-1]))
            kp[..., :mine, :], vp[..., :mine, :] = self.k, self.v
            packet = torch.cat([kp.reshape(-1), vp.reshape(-1)])
        self.gathered = packet.new_empty(self.n, packet.numel())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.works = [gather(self.gathered.view(-1), packet, group=self.group, async_op=True)]
        for peer in range(self.n):
            if peer != self.rank:
                self.tell("kv_sent", peer, packet)
                self.tell("kv_received", peer, packet)

    def received(self, t: int, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.gathered is not None
        whole = self.unpack(self.gathered[block.source], self.sched.sizes[block.source], self.padded)
        return self.select(*whole, block)

    class Gradients(Exchange.Gradients):
        """Every block's dK/dV in a row per owner, returned in one all-to-all at the end."""

        def __init__(self, kv: Exchange, dtype: torch.dtype):
            super().__init__(kv, dtype)
            self.rows: torch.Tensor | None = None  # every source's dK/dV from this rank

        def step(self, t: int, block: Block | None, dkb: Any, dvb: Any) -> None:
            if t == 0 or block is None:
                return
            kv, most = self.kv, self.kv.padded  # type: ignore[attr-defined]
            if self.rows is None:
                self.rows = kv.k.new_zeros(kv.n, most * kv.per_token, dtype=self.dtype)
            gk, gv = kv.unpack(self.rows[block.source], kv.sched.sizes[block.source], most)
            add_tokens(gk, gv, block.index, dkb, dvb)

        def result(self) -> tuple[torch.Tensor, torch.Tensor]:
            kv = self.kv
            if kv.n == 1:
                return self.dk, self.dv
            most = kv.padded  # type: ignore[attr-defined]
            send = self.rows if self.rows is not None else kv.k.new_zeros(kv.n, most * kv.per_token, dtype=self.dtype)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=kv.group)  # row j to rank j: a reduce-scatter
            for peer in range(kv.n):
                if peer != kv.rank:
                    kv.tell("grad_sent", peer, send[peer])
                    kv.tell("grad_received", peer, recv[peer])
                    gk, gv = kv.unpack(recv[peer], kv.sched.local, most)
                    self.dk += gk
                    self.dv += gv
            return self.dk, self.dv


#: Every transport's class, by the member a plan asks for it by (a member's string finds it too).
CLASSES: dict[ps.Transport, type[Exchange]] = {cls.name: cls for cls in (Ring, PointToPoint, AllGather)}
#: The transports, in ``parallel_state.Transport``'s order (tests check that CLASSES has each).
NAMES = tuple(ps.Transport)


def starts_all_at_once(backend: str | None) -> bool:
    """Whether the p2p transport starts every step's transfer at step 0 on a group of ``backend`` (for the tensors'
    device): on gloo, whose sends and receives are independent works; not on NCCL, which runs a batch of them
    in order on one stream, where a transfer started early would wait for ranks that wait for this one."""
    return backend == "gloo"


def choose(name: ps.Transport | str, group: Any, device: torch.device) -> type[Exchange]:
    """The class that runs transport ``name`` (a member or its string) over ``group`` (None: one process) for
    tensors on ``device``."""
    cls = CLASSES.get(name)
    if cls is None:
        raise ValueError(f"cp attention: transport={name!r} is not one of {tuple(map(str, NAMES))}")
    return cls.on(None if group is None else backend_for(group, device.type))


__all__ = ["CLASSES", "NAMES", "AllGather", "Exchange", "PointToPoint", "PointToPointAtOnce", "Ring", "choose",
           "send_empty", "starts_all_at_once"]
