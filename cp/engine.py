"""The one blockwise attention engine of cp: forward and backward over a schedule, the transport a choice.

Every context-parallel attention of cp runs here: ``ring_attention`` (plain, causal, masked),
the masked ring of ``usp_attention`` and, after their all-to-all, the masked attention of
``ulysses_attention`` / ``usp_attention`` on the whole sequence (a group of one). Group rank i holds
the global tokens of its layout; the schedule (``cp.mask_schedule``: built once per mask, layout
and rank, cached) says which block of K/V this rank computes at step t (group rank ``rank - t``'s
tokens that its queries see) and tiles it (full, causal and masked tiles; ``cp.kernels`` computes
each with a fused kernel that returns its log-sum-exp). Tiles merge by the online softmax,
accumulated in float32 (float64 inputs in float64); the output has the input dtype. The backward
recomputes every tile from the saved log-sum-exp.

How K/V reach the ranks that need them (``AttentionCall.transport``):

- ``"ring"``: at step t every rank passes the whole block it holds on to rank + 1, while a rank
  further down the ring still needs it (causal on the contiguous split: rank i computes i + 1
  blocks, and blocks wholly in a rank's future are neither sent nor computed). Backward: the K/V
  travel again and each block's dK/dV accumulator travels behind it, round the whole ring (every
  rank takes part in every step's exchange), back to the block's owner.
- ``"p2p"``: straight from the owner to each rank that needs a block, only the needed tokens (at
  step t to rank + t, from rank - t). On gloo every rank posts all its receives on entry and starts
  all its sends after its own block, once every rank has posted its receives (below), so that no
  rank waits for another to reach a step (on shared CPU cores each such wait is a wake-up of another
  process; the rank then holds every block it needs at once, as with "allgather"); NCCL orders a
  batch of sends and receives on one stream, where transfers started early would wait for ranks
  that wait for this one, so there each step starts its own.
  Backward: a received block's dK/dV goes straight back to its owner (one message per block; on gloo
  the owner posts all their receives on entry too).
- ``"allgather"``: one all-gather of every rank's K/V (shards padded to the longest), overlapped
  with the rank's own block; backward gathers again and returns every block's dK/dV to its owner
  in one all-to-all (a reduce-scatter). Fewest messages: best for short sequences and many clips.

Ring and p2p (p2p on gloo: all at once, above) start step t + 1's transfer before step t's compute,
so the two overlap; no rank then holds more than two other ranks' K/V at once. ``cp.count_attention`` sees every call.

The cross-rank check of a call's inputs (``AttentionCall.check``) is judged after the rank's own block
and before any K/V is sent. With p2p on gloo every pass posts all its receives first, then starts one
round (the forward's check; in the backward, or without a check, an empty row) whose table needs every
rank's row, each sent after that rank's receives: so every sender finds its receiver ready. A gloo
message that arrives before its receive costs the two sides' loop threads about 1.3 ms of CPU per
512 KiB on loopback; one whose receive is waiting about 0.3 ms in all (measured with 2 processes).
The check's row carries the bytes posted from each rank; a failed check completes those receives with
empty messages (``_Exchange.drain``) before it raises, so no receive stays posted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from cp import agree, counting, kernels, online_softmax
from cp.comm import backend_for, global_ranks
from cp.mask_schedule import Block, Schedule, Send, Tile

TRANSPORTS = ("ring", "p2p", "allgather")
#: Message tags of K/V and of their gradients, so that gloo never pairs one kind's send with the other's receive.
_TAG_KV, _TAG_DKV = 11, 12

#: A started cross-rank check (``cp.masked.start_agree``): waits for every rank's row and raises the same
#: ValueError on every rank on a mismatch, calling its argument first with every rank's posted bytes.
Confirm = Callable[[Callable[[list[list[int]]], None]], None]
#: Starts the check, given the bytes this rank has posted receives for from each group rank.
StartCheck = Callable[[Sequence[int]], Confirm]


@dataclass(frozen=True)
class AttentionCall:
    """The facts of one attention call that its internals need.

    q, k, v are laid out with the sequence at dim ``seq_dim`` and the heads at ``head_dim`` (the
    last remaining dim is the feature dim); ``groups`` query heads share one K/V head (GQA);
    ``scale`` multiplies the scores. ``group``: the ranks attending together (None: one process);
    ``schedule``: this rank's part; ``transport``: one of TRANSPORTS. ``check``: starts the cross-rank
    check of the call's inputs (``cp.masked.start_agree``); the forward starts it on entry and judges it
    once the rank's own block is computed and before any K/V is sent, so its round trip overlaps that
    compute and a mismatch raises on every rank before anything is sent.
    """

    seq_dim: int
    head_dim: int
    groups: int
    scale: float
    group: Any
    schedule: Schedule
    transport: str = "p2p"
    check: StartCheck | None = None


def starts_all_at_once(backend: str | None) -> bool:
    """Whether the p2p transport starts every step's transfer at step 0 on a group of ``backend`` (for the tensors'
    device): on gloo, whose sends and receives are independent works; not on NCCL, which runs a batch of them
    in order on one stream, where a transfer started early would wait for ranks that wait for this one."""
    return backend == "gloo"


def _p2p(ops: list[Any]) -> list[Any]:
    """Start a batch of point-to-point ops (none is fine); their works."""
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _rows(x: torch.Tensor, rows: Any, dim: int = -2) -> torch.Tensor:
    """The query rows ``rows`` (a slice or an index) of x along ``dim``."""
    if isinstance(rows, slice):
        return x.narrow(dim, rows.start, rows.stop - rows.start)
    return x.index_select(dim, rows)


def _merge(acc: torch.Tensor, lse: torch.Tensor, rows: Any, out: torch.Tensor, blse: torch.Tensor) -> None:
    """Merge a tile's normalized output and log-sum-exp into rows ``rows`` of the running ones (online softmax)."""
    a, lo = _rows(acc, rows), _rows(lse, rows, -1)  # views for a slice, copies for an index
    online_softmax.merge(a, lo, out, blse)
    if not isinstance(rows, slice):
        acc.index_copy_(-2, rows, a)
        lse.index_copy_(-1, rows, lo)


def _add_rows(total: torch.Tensor, rows: Any, part: torch.Tensor) -> None:
    if isinstance(rows, slice):
        total[..., rows, :] += part
    else:
        total.index_add_(-2, rows, part)


def _add_tokens(dk: torch.Tensor, dv: torch.Tensor, index: torch.Tensor | None, gk: torch.Tensor,
                gv: torch.Tensor) -> None:
    """Add the gradients of the tokens ``index`` (None: all, in order) into dK and dV."""
    if index is None:
        dk += gk
        dv += gv
    else:
        dk.index_add_(-2, index, gk)
        dv.index_add_(-2, index, gv)


class _Exchange:
    """This rank's side of the K/V traffic of one pass (forward or backward), for any transport.

    ``start(t)`` starts what step t sends and receives (ring and p2p: the transfer for step t + 1),
    ``kv(t, block, dtype)`` is block t's K and V, ``finish(t)`` waits for step t's transfers;
    ``grad(t, block, dk, dv)`` hands over a computed block's dK/dV and ``grads()`` returns this
    rank's own, complete.
    """

    def __init__(self, call: AttentionCall, k: torch.Tensor, v: torch.Tensor, counts: list[Any], grad_dtype: Any):
        self.call, self.sched, self.k, self.v, self.counts = call, call.schedule, k, v, counts
        self.group = call.group
        self.ranks = global_ranks(self.group) if self.group is not None else [0]
        self.per_k, self.per_v = k[..., :1, :].numel(), v[..., :1, :].numel()  # elements per token
        self.rank, self.n = self.sched.rank, self.sched.n
        self.works: list[Any] = []
        self.send_works: list[Any] = []  # p2p on gloo: every step's send of this rank's K/V, started at step 0
        self.early: dict[int, tuple[list[Any], torch.Tensor | None]] = {}  # and every step's receive, by step
        self.eager = self.group is not None and starts_all_at_once(backend_for(self.group, k.device.type))
        self.recv: torch.Tensor | None = None
        self.held: torch.Tensor | None = None  # the ring's block held now (whole), or p2p's received one
        self.gathered: torch.Tensor | None = None
        if grad_dtype is not None:  # backward: this rank's own dK/dV
            self.dk = k.new_zeros(k.shape, dtype=grad_dtype)
            self.dv = v.new_zeros(v.shape, dtype=grad_dtype)
            self.grad_works: list[Any] = []
            self.pending: Any = None
            self.early_grads: list[tuple[torch.Tensor, Send]] = []  # eager p2p: every sent block's dK/dV
            self.grads_posted = False
            self.incoming: torch.Tensor | None = None  # the ring's dK/dV accumulator of the block held now
            self.sending: torch.Tensor | None = None
            self.grad_rows: torch.Tensor | None = None  # allgather: every source's dK/dV from this rank

    # ---------------------------------------------------------------- bookkeeping

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

    def _select(self, kb: torch.Tensor, vb: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        if block.index is None:
            return kb, vb
        return kb.index_select(-2, block.index), vb.index_select(-2, block.index)

    # ---------------------------------------------------------------- K/V

    def start(self, t: int) -> None:
        transport = self.call.transport
        if transport == "allgather":
            if t == 0 and self.n > 1:
                self._start_gather()
            return
        if transport == "p2p":
            if t == 0 and self.eager:
                self._post_all()
            self._post_p2p(t + 1)
            return
        # The ring: pass the block held at step t on, receive the one of step t + 1.
        if t == 0:
            self.held = self.pack(None)
        ops, self.recv = [], None
        if t < self.n - 1:
            nxt, prv = (self.rank + 1) % self.n, (self.rank - 1) % self.n
            if self.sched.ring_forwards(self.rank, t):
                assert self.held is not None
                ops.append(dist.P2POp(dist.isend, self.held, self.ranks[nxt], self.group, _TAG_KV))
                self.tell("kv_sent", nxt, self.held)
            if self.sched.ring_forwards(prv, t):
                source = (self.rank - t - 1) % self.n
                self.recv = self.k.new_empty(self.sched.sizes[source] * (self.per_k + self.per_v))
                ops.append(dist.P2POp(dist.irecv, self.recv, self.ranks[prv], self.group, _TAG_KV))
                self.tell("kv_received", prv, self.recv)
        self.works = _p2p(ops)

    def _post_all(self) -> None:
        """Start every step's K/V transfer at once (p2p on gloo, whose sends and receives are independent works):
        this rank's sends are all ready now, and a receive posted before its data arrives is read straight
        into its buffer, so no rank waits for another to reach a step."""
        if not self.early:
            self.post_receives()
        ops, whole = [], None
        for send in self.sched.sends[1:]:
            if send is None:
                continue
            if send.index is None:  # the whole block: one buffer serves every rank that needs it all
                whole = self.pack(None) if whole is None else whole
            packed = whole if send.index is None else self.pack(send.index)
            ops.append(dist.P2POp(dist.isend, packed, self.ranks[send.dest], self.group, _TAG_KV))
            self.tell("kv_sent", send.dest, packed)
        self.send_works = _p2p(ops)

    def post_receives(self) -> list[int]:
        """Post every step's K/V receive (p2p on gloo); the bytes posted from each group rank."""
        posted = [0] * self.n
        for t in range(1, self.n):
            recv = self._recv_op(t)
            self.early[t] = ([], None) if recv is None else (_p2p([recv[0]]), recv[1])
            if recv is not None:
                posted[self.sched.blocks[t].source] += recv[1].numel() * recv[1].element_size()  # type: ignore[union-attr]
        return posted

    def drain(self, posted: list[list[int]]) -> None:
        """After a failed check: send every rank the empty bytes it posted a receive for from this one
        (``posted[i][j]``: rank i's from rank j) and complete this rank's own, so that no receive stays posted."""
        ops = [dist.P2POp(dist.isend, self.k.new_zeros(row[self.rank], dtype=torch.uint8), self.ranks[i],
                          self.group, _TAG_KV) for i, row in enumerate(posted) if i != self.rank and row[self.rank]]
        works = _p2p(ops)
        for received, _ in self.early.values():
            _wait(received)
        self.early = {}
        _wait(works)

    def _recv_op(self, t: int) -> tuple[Any, torch.Tensor] | None:
        """Step t's K/V receive (from rank - t) and its buffer; None when this rank needs nothing then."""
        block = self.sched.blocks[t]
        if block is None:
            return None
        buf = self.k.new_empty(block.size * (self.per_k + self.per_v))
        self.tell("kv_received", block.source, buf)
        return dist.P2POp(dist.irecv, buf, self.ranks[block.source], self.group, _TAG_KV), buf

    def _post_p2p(self, t: int) -> None:
        """Start step t's K/V transfer (send to rank + t, receive from rank - t)."""
        sched = self.sched
        self.works, self.recv = [], None
        if t == 0 or t >= sched.n:
            return
        if self.eager:  # started at step 0
            self.works, self.recv = self.early.pop(t)
            return
        ops = []
        send = sched.sends[t]
        if send is not None:
            packed = self.pack(send.index)
            ops.append(dist.P2POp(dist.isend, packed, self.ranks[send.dest], self.group, _TAG_KV))
            self.tell("kv_sent", send.dest, packed)
        recv = self._recv_op(t)
        if recv is not None:
            ops.append(recv[0])
            self.recv = recv[1]
        self.works = _p2p(ops)

    def _padded(self) -> int:
        return max(self.sched.sizes)

    def _start_gather(self) -> None:
        """One all-gather of every rank's K and V, each shard padded to the longest."""
        most, mine = self._padded(), self.sched.local
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

    def kv(self, t: int, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """Block t's K and V (the tokens its tiles' columns index), in the input dtype."""
        if t == 0:
            return self._select(self.k, self.v, block)
        transport = self.call.transport
        if transport == "p2p":
            assert self.held is not None
            return self.unpack(self.held, block.size)
        if transport == "ring":
            assert self.held is not None
            return self._select(*self.unpack(self.held, self.sched.sizes[block.source]), block)
        assert self.gathered is not None
        whole = self.unpack(self.gathered[block.source], self.sched.sizes[block.source], self._padded())
        return self._select(*whole, block)

    def finish(self, t: int) -> None:
        _wait(self.works)
        self.works = []
        if t == self.n - 1:  # the pass's last step: every send has been received
            _wait(self.send_works)
            self.send_works = []
        if self.call.transport != "allgather":
            self.held = self.recv  # step t + 1's block (p2p: None when there is none)

    # ---------------------------------------------------------------- dK/dV

    def grad(self, t: int, block: Block | None, dkb: torch.Tensor | None, dvb: torch.Tensor | None) -> None:
        """Hand over step t's dK/dV of block t (None when this rank computed nothing at step t)."""
        transport = self.call.transport
        if t == 0:
            if block is not None:
                _add_tokens(self.dk, self.dv, block.index, dkb, dvb)  # type: ignore[arg-type]
            if transport == "p2p" and self.eager and not self.grads_posted:
                self.post_grad_receives()
            if transport != "ring" or self.n == 1:
                return
        if transport == "p2p":
            self._grad_p2p(t, block, dkb, dvb)
        elif transport == "ring":
            self._grad_ring(t, block, dkb, dvb)
        elif block is not None:
            self._grad_row(block, dkb, dvb)

    def post_grad_receives(self) -> None:
        """Start receiving, at step 0 (p2p on gloo, as the K/V), the dK/dV of every block this rank sends."""
        self.grads_posted = True
        ops = []
        for send in self.sched.sends[1:]:
            if send is not None:
                incoming = self.dk.new_empty(send.size * (self.per_k + self.per_v))
                ops.append(dist.P2POp(dist.irecv, incoming, self.ranks[send.dest], self.group, _TAG_DKV))
                self.tell("grad_received", send.dest, incoming)
                self.early_grads.append((incoming, send))
        self.grad_works = _p2p(ops)

    def _grad_p2p(self, t: int, block: Block | None, dkb: Any, dvb: Any) -> None:
        ops = []
        if block is not None:  # straight back to the owner
            packed = torch.cat([dkb.reshape(-1), dvb.reshape(-1)])
            ops.append(dist.P2POp(dist.isend, packed, self.ranks[block.source], self.group, _TAG_DKV))
            self.tell("grad_sent", block.source, packed)
        if self.eager:  # the receives started at step 0; the sends are waited for with them
            self.grad_works += _p2p(ops)
            return
        send = self.sched.sends[t]
        incoming = None
        if send is not None:  # the dK/dV of the tokens this rank sent rank + t at this step
            incoming = self.dk.new_empty(send.size * (self.per_k + self.per_v))
            ops.append(dist.P2POp(dist.irecv, incoming, self.ranks[send.dest], self.group, _TAG_DKV))
            self.tell("grad_received", send.dest, incoming)
        self._settle()
        self.grad_works = _p2p(ops)
        self.pending = None if send is None else (incoming, send)

    def _settle(self) -> None:
        """Wait for the previous step's gradient messages (received while this step computed) and add them
        (eager: every step's, at the end)."""
        _wait(self.grad_works)
        self.grad_works = []
        for packed, send in self.early_grads:
            gk, gv = self.unpack(packed, send.size)
            _add_tokens(self.dk, self.dv, send.index, gk, gv)
        self.early_grads = []
        if self.pending is not None:
            packed, send = self.pending
            gk, gv = self.unpack(packed, send.size)
            _add_tokens(self.dk, self.dv, send.index, gk, gv)
            self.pending = None

    def _grad_ring(self, t: int, block: Block | None, dkb: Any, dvb: Any) -> None:
        source = (self.rank - t) % self.n
        size = self.sched.sizes[source]
        _wait(self.grad_works)  # the accumulator sent by the previous rank after its step t - 1
        mine = None
        if block is not None and t > 0:
            if block.index is None:
                mine = torch.cat([dkb.reshape(-1), dvb.reshape(-1)])
            else:
                whole = self.dk.new_zeros(size * (self.per_k + self.per_v))
                gk, gv = self.unpack(whole, size)
                _add_tokens(gk, gv, block.index, dkb, dvb)
                mine = whole
        if t == 0:  # this rank's own block starts its accumulator (its own share is already in dk / dv)
            dkv = self.dk.new_zeros(size * (self.per_k + self.per_v))
        else:
            assert self.incoming is not None
            dkv = self.incoming if mine is None else mine.add_(self.incoming)
        # Pass it on (after the last step that is to the block's owner); receive the next block's, or after
        # the last step this rank's own, complete.
        nxt, prv = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        self.sending = dkv
        self.incoming = dkv.new_empty(self.sched.sizes[(self.rank - t - 1) % self.n] * (self.per_k + self.per_v))
        self.grad_works = _p2p([dist.P2POp(dist.isend, self.sending, self.ranks[nxt], self.group, _TAG_DKV),
                                dist.P2POp(dist.irecv, self.incoming, self.ranks[prv], self.group, _TAG_DKV)])
        self.tell("grad_sent", nxt, self.sending)
        self.tell("grad_received", prv, self.incoming)

    def _grad_row(self, block: Block, dkb: Any, dvb: Any) -> None:
        most = self._padded()
        if self.grad_rows is None:
            self.grad_rows = self.dk.new_zeros(self.n, most * (self.per_k + self.per_v))
        gk, gv = self.unpack(self.grad_rows[block.source], self.sched.sizes[block.source], most)
        _add_tokens(gk, gv, block.index, dkb, dvb)

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's own dK and dV, once every rank's share has arrived."""
        transport = self.call.transport
        if transport == "p2p":
            self._settle()
        elif transport == "ring" and self.n > 1:
            _wait(self.grad_works)
            assert self.incoming is not None
            gk, gv = self.unpack(self.incoming, self.sched.local)
            self.dk += gk
            self.dv += gv
        elif transport == "allgather" and self.n > 1:
            most = self._padded()
            send = self.grad_rows if self.grad_rows is not None else \
                self.dk.new_zeros(self.n, most * (self.per_k + self.per_v))
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)  # row j to rank j: a reduce-scatter
            for peer in range(self.n):
                if peer != self.rank:
                    self.tell("grad_sent", peer, send[peer])
                    self.tell("grad_received", peer, recv[peer])
                    gk, gv = self.unpack(recv[peer], self.sched.local, most)
                    self.dk += gk
                    self.dv += gv
        return self.dk, self.dv


def _tile_kv(kb: torch.Tensor, vb: torch.Tensor, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    if tile.c0 == 0 and tile.c1 == kb.shape[-2]:
        return kb, vb
    return kb[..., tile.c0:tile.c1, :], vb[..., tile.c0:tile.c1, :]


def _mask(choice: kernels.KernelChoice, tile: Tile, device: torch.device) -> torch.Tensor | None:
    """The tile's bool mask, only where the kernel needs one (the reference, or a bias)."""
    return tile.masked_out(device) if choice.name == "math" or choice.bias else None


def _receives_first(ex: _Exchange, check: StartCheck | None, grads: bool) -> Confirm | None:
    """Post the pass's receives (p2p on gloo: K/V, and with ``grads`` the dK/dV of the blocks this rank sends),
    then start the round after which every rank has posted its own: the call's ``check`` (its row carries the
    bytes posted) or, without one, an empty row. The pass judges it after its own block, then sends. None where
    nothing is to be waited for (no check, and receives posted step by step)."""
    eager = ex.eager and ex.call.transport == "p2p"
    posted = ex.post_receives() if eager else [0] * ex.n
    if eager and grads:
        ex.post_grad_receives()
    if check is not None:
        return check(posted)
    if not eager:
        return None
    pending = agree.start([0], ex.group)

    def everyone_posted(drain: Callable[[list[list[int]]], None]) -> None:
        pending.table()  # an empty row: nothing to judge, nothing to drain

    return everyone_posted


class _Engine(torch.autograd.Function):
    """Attention on [..., Hkv, G, S, D] queries and [..., Hkv, S, D] keys and values of this rank."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        counts = list(counting.active())
        sched = call.schedule
        cd = kernels.compute_dtype(q.dtype)
        per_row = math.prod(q.shape[:-2])  # batch x query heads
        ex = _Exchange(call, k, v, counts, None)
        acc = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=cd)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=cd)
        fresh = True  # nothing merged yet: a first tile of every row is the result so far
        confirm = _receives_first(ex, call.check, grads=False)
        if confirm is not None and call.check is not None and q.shape[-2] != sched.local:
            confirm(ex.drain)  # this rank's own block does not fit its tokens: the check's table says so
        for t in range(sched.n):
            if t or confirm is None:
                ex.start(t)  # overlaps this step's compute
            block = sched.blocks[t]
            if block is not None:
                kb, vb = ex.kv(t, block)
                for tile in block.tiles:
                    qt = _rows(q, tile.rows)
                    kt, vt = _tile_kv(kb, vb, tile)
                    choice = kernels.choose_for(qt, kt, vt, tile.kind)
                    out, blse = kernels.forward(choice, qt, kt, vt, call.scale, _mask(choice, tile, q.device))
                    if fresh and tile.num_rows == q.shape[-2] and isinstance(tile.rows, slice):
                        acc.copy_(out)
                        lse.copy_(blse)
                    else:
                        _merge(acc, lse, tile.rows, out.to(cd), blse)
                    fresh = False
                    for c in counts:
                        c.pairs += per_row * tile.allowed
                        c.scores += per_row * tile.num_rows * (tile.c1 - tile.c0)
            if t == 0 and confirm is not None:
                confirm(ex.drain)  # every rank's inputs agree: now the K/V may move
                ex.start(0)
            ex.finish(t)
        for c in counts:
            c.calls += 1
        result = acc.to(q.dtype)
        ctx.call, ctx.counts = call, counts
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        call, counts = ctx.call, ctx.counts
        sched = call.schedule
        q, k, v, out, lse = ctx.saved_tensors
        cd = kernels.compute_dtype(q.dtype)
        per_row = math.prod(q.shape[:-2])
        ex = _Exchange(call, k, v, counts, cd)
        do = grad.contiguous()
        delta = (do.to(cd) * out.to(cd)).sum(-1)
        dq = q.new_zeros(q.shape, dtype=cd)
        ready = _receives_first(ex, None, grads=True)
        for t in range(sched.n):
            if t or ready is None:
                ex.start(t)
            block = sched.blocks[t]
            dkb = dvb = None
            if block is not None:
                kb, vb = ex.kv(t, block)
                for tile in block.tiles:
                    rows = tile.rows
                    kt, vt = _tile_kv(kb, vb, tile)
                    qt = _rows(q, rows)
                    choice = kernels.choose_for(qt, kt, vt, tile.kind)
                    bq, bk, bv = kernels.backward(choice, _rows(do, rows), qt, kt, vt, _rows(out, rows),
                                                  _rows(lse, rows, -1), _rows(delta, rows, -1), call.scale,
                                                  _mask(choice, tile, q.device))
                    _add_rows(dq, rows, bq.to(cd))
                    if dkb is None and tile.c0 == 0 and tile.c1 == block.size:
                        dkb, dvb = bk.to(cd), bv.to(cd)
                    else:
                        if dkb is None or dvb is None:
                            dkb = kb.new_zeros(kb.shape, dtype=cd)
                            dvb = vb.new_zeros(vb.shape, dtype=cd)
                        dkb[..., tile.c0:tile.c1, :] += bk
                        dvb[..., tile.c0:tile.c1, :] += bv
                    for c in counts:
                        c.backward_pairs += per_row * tile.allowed
                if dkb is None or dvb is None:  # a block without tiles (no query sees it) adds nothing
                    dkb, dvb = kb.new_zeros(kb.shape, dtype=cd), vb.new_zeros(vb.shape, dtype=cd)
            if t == 0 and ready is not None:
                ready(ex.drain)  # every rank has posted its receives
                ex.start(0)
            ex.grad(t, block, dkb, dvb)
            ex.finish(t)
        dk, dv = ex.grads()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def attend(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention for q, k, v in the call's layout, K/V heads dividing q's (GQA); this rank's output in q's layout.
    Every rank of ``call.group`` (None: one process) must call it with the same schedule's plan and transport."""
    if call.transport not in TRANSPORTS:
        raise ValueError(f"cp attention: transport={call.transport!r} is not one of {TRANSPORTS}")
    s, h = call.seq_dim, call.head_dim
    qc, kc, vc = (t.movedim((h, s), (-3, -2)) for t in (q, k, v))
    hkv, length = kc.shape[-3], qc.shape[-2]
    qg = qc.reshape(*qc.shape[:-3], hkv, call.groups, length, qc.shape[-1])
    out = _Engine.apply(qg, kc.contiguous(), vc.contiguous(), call)
    out = out.reshape(*qc.shape[:-3], hkv * call.groups, length, vc.shape[-1])
    return out.movedim((-3, -2), (h, s))


__all__ = ["TRANSPORTS", "AttentionCall", "attend"]
