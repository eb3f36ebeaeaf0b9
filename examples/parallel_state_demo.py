"""The rank program of ``python -m parallel_state demo``: the project's main job, on every rank.

It uses all three packages (``parallel_state``, ``cp``, ``scheduler``), so it lives outside them
(``parallel_state`` must never import ``cp`` or ``scheduler``), in the checkout's ``examples/``,
next to its model ``demo_dit.py``. ``python -m parallel_state demo`` starts it with
torch.distributed's elastic launcher; it also runs under torchrun directly, from the checkout::

    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 4 --master-addr 127.0.0.1 examples/parallel_state_demo.py

For each of two topologies (cp x pp, then another after a full teardown) every rank: builds the
groups with ``dist_init`` and checks them against the pure plan; plans the latent with
``find_split``; receives its shard with ``broadcast_split_tensor`` (stage 0); runs its pipeline
stage's part of a small video DiT (``demo_dit``: patchify, 3-D rotary embedding sharded like the
latent, a register token that makes the token count odd and the shards uneven, 6 heads, blocks of
context-parallel attention and MLP; the attention is ``cp.usp_attention``, Ulysses over gcd(6, cp)
ranks and a ring over the rest, on megatron's hierarchical cp groups: cp 4 is Ulysses 2 x ring 2),
passing activations with the scheduler (the last
stage sends its output back to stage 0, MAGI-1's ring); gathers with ``cat_outputs_cp`` and
compares with the same DiT run on the whole latent in this one process; runs one backward,
sending gradients back stage by stage and all-reducing the parameter gradients over the
data-parallel-with-CP group, and compares every gradient too (float32, max |diff| / max |ref|
<= 1e-5); tears down and checks that nothing is left. A failed check prints one line naming the rank and the step and
exits 1; the launcher then stops the other ranks.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import cp
import demo_dit
import parallel_state as ps
import scheduler
from parallel_state.groups.create import live_groups
from parallel_state.tools.cli import format_plan
from parallel_state.topology.plan import TopologyPlan

SEED = 1234
NUM_BLOCKS = 4   # the DiT's blocks, divided among the pipeline stages
HEADS = 6        # Ulysses over gcd(HEADS, cp) ranks, a ring over the rest: any cp size works
CP_DIM = 2       # the context-parallel shard dimension of the [B, C, cp, T', H', W] layout
ORDER = "tp-cp-pp-dp"  # dist_init's
TOLERANCE = 1e-5  # max |diff| / max |one-process value|, for the output and every gradient
STEPS = 7         # per topology


class CheckFailed(Exception):
    """A demo check did not hold."""


def check(condition: bool, message: str) -> None:
    """Raise CheckFailed(message) unless ``condition``."""
    if not condition:
        raise CheckFailed(message)


# ----------------------------------------------------------------------------- the model


@functools.cache
def latent(shape: tuple[int, ...]) -> torch.Tensor:
    """The input video latent: the same values in every process."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED))


@functools.cache
def target(shape: tuple[int, ...]) -> torch.Tensor:
    """The loss weights, latent-shaped: the loss is sum(output * target), so its gradient is ``target``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED + 1))


def stage_blocks(stage: int, pp: int) -> range:
    """The DiT blocks pipeline stage ``stage`` of ``pp`` runs."""
    return range(stage * NUM_BLOCKS // pp, (stage + 1) * NUM_BLOCKS // pp)


def token_grid(shape: Sequence[int], patch: Sequence[int]) -> tuple[int, int, int]:
    """The token grid (t, h, w) of a [B, C, T, H, W] latent (or shard) cut into ``patch``."""
    return shape[-3] // patch[0], shape[-2] // patch[1], shape[-1] // patch[2]


@functools.cache
def reference(shape: tuple[int, ...], cfg: demo_dit.DiTConfig,
              mask: cp.Mask | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole DiT on the whole latent in this one process: its output and every parameter's gradient.

    With ``mask`` (the autoregressive variant): no register token, attention under the mask's dense matrix.
    """
    model = demo_dit.build(cfg, SEED)
    grid = token_grid(shape, cfg.patch)
    cos, sin = demo_dit.rope_for_tokens(demo_dit.rope_table(grid))
    x = model["embed"](demo_dit.patchify(latent(shape), cfg.patch))
    attn = None
    if mask is None:
        x, (cos, sin) = demo_dit.with_register(x, model["register"].weight), demo_dit.register_rope(cos, sin)
    else:
        attn = demo_dit.dense_masked_attention(mask, x.shape[1])
    x = demo_dit.run_blocks(model, range(cfg.blocks), x, cos, sin, attn)
    out = demo_dit.unpatchify(model["head"](x if mask is not None else x[:, 1:]), cfg.patch, grid, cfg.channels)
    (out * target(shape)).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the demo's measure of agreement with the one-process run."""
    if got.shape != want.shape:
        return math.inf
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- CP layout


def to_cp_layout(x: torch.Tensor, cp_t: int, cp_h: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, C, cp_t * cp_h, T', H', W]: shard i is T block i // cp_h, H block i % cp_h."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, cp_t, t // cp_t, cp_h, h // cp_h, w).permute(0, 1, 2, 4, 3, 5, 6)
    return x.reshape(b, c, cp_t * cp_h, t // cp_t, h // cp_h, w)


def from_cp_layout(x: torch.Tensor, cp_t: int, cp_h: int) -> torch.Tensor:
    """The inverse of to_cp_layout."""
    b, c, _, t_, h_, w = x.shape
    x = x.reshape(b, c, cp_t, cp_h, t_, h_, w).permute(0, 1, 2, 4, 3, 5, 6)
    return x.reshape(b, c, cp_t * t_, cp_h * h_, w)


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {list(got.shape)} != expected {list(want.shape)}"
    bad = (got != want).sum().item()
    return f"{bad} of {want.numel()} elements differ (max |diff| {(got - want).abs().max().item():.3g})"


def _far(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {list(got.shape)} != expected {list(want.shape)}"
    bad = ((got - want).abs() > TOLERANCE * want.abs().max()).sum().item()
    return f"{bad} of {want.numel()} elements differ by more than {TOLERANCE:g} * max |ref|"


# ----------------------------------------------------------------------------- steps


class Steps:
    """Runs named steps in lock step on every rank; rank 0 reports each once all ranks passed it."""

    def __init__(self, total: int):
        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        self.total = total
        self.done: list[tuple[str, float]] = []

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def run(self, name: str, fn: Callable[[], str]) -> None:
        index = len(self.done) + 1
        start = time.perf_counter()
        try:
            detail = fn() or ""
        except Exception as exc:  # one line, then let the launcher stop everyone
            kind = "" if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: "
            message = " ".join(f"{kind}{exc}".split())
            print(f"rank {self.rank}: step {index}/{self.total} '{name}' FAILED: {message}", file=sys.stderr,
                  flush=True)
            sys.stdout.flush()
            os._exit(1)  # skip interpreter teardown: peers may be blocked in a collective with us
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # every rank got here: the step passed everywhere
        self.done.append((name, elapsed.item()))
        self.say(f"[{index:>2}/{self.total}] {name:<42} ok {elapsed.item():6.2f} s  {detail}".rstrip())


class Topology:
    """One build of the demo: cp x pp groups, the latent's split, the pipeline and the checks."""

    def __init__(self, steps: Steps, cp_size: int, pp_size: int, shape: tuple[int, ...],
                 patch: tuple[int, int, int], timeout: datetime.timedelta, corrupt_rank: int | None,
                 print_layout: bool, heads: int, mask_spec: str = "full"):
        self.steps, self.cp_size, self.pp_size, self.heads = steps, cp_size, pp_size, heads
        # "full": the DiT as it always was; any other mask: the autoregressive variant (balanced plan, dispatch).
        self.mask_spec = mask_spec
        self.mask: cp.Mask | None = None
        self.shape, self.patch, self.timeout = shape, patch, timeout
        self.corrupt_rank, self.print_layout = corrupt_rank, print_layout
        self.label = f"cp {cp_size} x pp {pp_size}"
        # Ulysses splits the heads, so it takes as many cp ranks as divide them; the ring takes the rest.
        self.ulysses = math.gcd(heads, cp_size)
        self.ring = cp_size // self.ulysses
        self.shard: torch.Tensor | None = None
        self.output: torch.Tensor | None = None  # this rank's shard of the model's output, if it has one
        self.attention_seconds = 0.0

    def run(self) -> None:
        s = self.steps
        s.run(f"{self.label}  dist_init, groups == plan", self.init)
        if self.print_layout:
            s.say(_indent(format_plan(self.plan)))
        s.run(f"{self.label}  find_split", self.split)
        masked = self.mask_spec != "full"
        s.run(f"{self.label}  broadcast + {'dispatch' if masked else 'split'} latent", self.scatter)
        s.run(f"{self.label}  DiT forward via scheduler", self.pipeline)
        s.run(f"{self.label}  {'undispatch' if masked else 'cat_outputs_cp'} == 1 process", self.gather)
        s.run(f"{self.label}  backward, grads == 1 process", self.backward)
        s.run(f"{self.label}  destroy_model_parallel", self.teardown)

    # -- steps (each returns a detail for rank 0's progress line)

    def init(self) -> str:
        if self.ring > 1:
            # dist_init builds no hierarchical cp groups: build the same groups with them first, and dist_init
            # checks them and runs its hooks. It also starts torch.distributed, so on the first build it runs once
            # before, and its groups make way for these.
            if not dist.is_initialized():
                ps.dist_init(distributed_backend="gloo", cp_size=self.cp_size, pp_size=self.pp_size,
                             timeout=self.timeout)
                ps.destroy_model_parallel()
            ps.initialize_model_parallel(context_parallel_size=self.cp_size, pipeline_model_parallel_size=self.pp_size,
                                         order=ORDER, hierarchical_context_parallel_sizes=[self.ulysses, self.ring],
                                         timeout=self.timeout)
        ps.dist_init(distributed_backend="gloo", cp_size=self.cp_size, pp_size=self.pp_size, timeout=self.timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.plan = plan = TopologyPlan(world, cp=self.cp_size, pp=self.pp_size, order=ORDER)
        coords = plan.coords(rank)
        for kind, group in (("cp", ps.get_context_parallel_group()), ("pp", ps.get_pipeline_model_parallel_group()),
                            ("dp", ps.get_data_parallel_group()), ("tp-cp", ps.get_tensor_and_context_parallel_group())):
            got = list(dist.get_process_group_ranks(group))
            check(got == list(plan.group_ranks(kind, rank)),
                  f"{kind} group holds ranks {got}, the plan says {list(plan.group_ranks(kind, rank))}")
        check(ps.get_context_parallel_rank() == coords["cp"], f"cp rank {ps.get_context_parallel_rank()} "
              f"!= plan's {coords['cp']}")
        check(ps.get_pipeline_model_parallel_rank() == coords["pp"], f"pp rank "
              f"{ps.get_pipeline_model_parallel_rank()} != plan's {coords['pp']}")
        # A real collective on the CP group proves it connects exactly its members.
        total = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(total, group=ps.get_context_parallel_group())
        check(total.item() == sum(plan.group_ranks("cp", rank)), f"all_reduce over the cp group gave {total.item()}")
        if self.pp_size > 1:
            scheduler.pp_scheduler()  # raises unless dist_init created it
        self.stage = coords["pp"]
        cp_ranks, i, u = list(plan.group_ranks("cp", rank)), coords["cp"], self.ulysses
        if self.ring > 1:
            self.ulysses_group, self.ring_group = ps.get_hierarchical_context_parallel_groups()
        else:
            self.ulysses_group, self.ring_group = ps.get_context_parallel_group(), None
        # Megatron's hierarchical cp groups: Ulysses over u consecutive cp ranks, the ring over every u-th one.
        want = {"ulysses": cp_ranks[i - i % u:i - i % u + u], "ring": cp_ranks[i % u::u]}
        for kind, group in (("ulysses", self.ulysses_group), ("ring", self.ring_group)):
            got = [rank] if group is None else list(dist.get_process_group_ranks(group))
            check(got == want[kind], f"the {kind} group holds ranks {got}, expected {want[kind]}")
        return (f"cp groups {[list(g) for g in plan.groups('cp')]}, "
                f"pp groups {[list(g) for g in plan.groups('pp')]}; cp {self.cp_size} as ulysses {u} x ring "
                f"{self.ring}")

    def split(self) -> str:
        per_rank = tuple(ps.find_split(list(self.shape), self.cp_size, patch_values=self.patch))
        check(hasattr(ps, "cp_size_t"), "find_split did not set parallel_state.cp_size_t")
        self.cp_t = ps.cp_size_t
        self.cp_h = self.cp_size // self.cp_t
        _, _, t, h, w = self.shape
        check(per_rank == (t // self.cp_t, h // self.cp_h, w) and self.cp_t * self.cp_h == self.cp_size,
              f"find_split gave {list(per_rank)} with cp_size_t {self.cp_t} for {list(self.shape)}, cp {self.cp_size}")
        self.shard_shape = (self.shape[0], self.shape[1], *per_rank)
        # The model is built for this split: its token patch must tile every rank's shard.
        patch = demo_dit.token_patch(per_rank, (t, h, w), self.patch)
        self.cfg = demo_dit.DiTConfig(channels=self.shape[1], patch=patch, heads=self.heads, blocks=NUM_BLOCKS)
        detail = f"{list(self.shape)} -> per-rank {list(per_rank)}, cp_size_t {self.cp_t}"
        if self.mask_spec != "full":
            # The autoregressive variant: the mask over the token sequence (frames of the token grid in time order),
            # and a balanced plan of its tokens over the cp ranks.
            gt, gh, gw = token_grid(self.shape, patch)
            self.mask = cp.Mask.parse(self.mask_spec, frame_tokens=gh * gw)
            # method="balanced": the demo shows the even work (at 512 tokens the cost model would keep the
            # contiguous split, one message cheaper than any balance it buys).
            self.dispatch_plan = cp.plan_dispatch(self.mask, gt * gh * gw, self.cp_size, method="balanced")
            contiguous = cp.plan_dispatch(self.mask, gt * gh * gw, self.cp_size, method="contiguous")
            detail += (f"; {self.mask.describe()} over {gt * gh * gw} tokens ({gt} frames of {gh * gw}): work max/mean "
                       f"{self.dispatch_plan.balance:.3f} balanced, {contiguous.balance:.3f} contiguous")
        return detail

    def scatter(self) -> str:
        if self.stage != 0:
            return ""
        group = ps.get_context_parallel_group()
        source = min(dist.get_process_group_ranks(group))
        if self.mask is not None:  # every rank of stage 0 takes the whole latent, then its plan's tokens of it
            whole = cp.broadcast(latent(self.shape) if dist.get_rank() == source else None, process_group=group)
            check(torch.equal(whole, latent(self.shape)), f"the broadcast latent differs from the source's: "
                  f"{_mismatch(whole, latent(self.shape))}")
            self.shard = cp.dispatch(demo_dit.patchify(whole, self.cfg.patch), self.dispatch_plan, 1, group)
            want = demo_dit.patchify(latent(self.shape), self.cfg.patch)[:, self.dispatch_plan.index(self._cp_rank())]
            check(torch.equal(self.shard, want), f"this rank's dispatched tokens are not its plan's tokens of the "
                  f"latent: {_mismatch(self.shard, want)}")
            return (f"source: global rank {source}; this rank's {self.shard.shape[1]} tokens in "
                    f"{len(self.dispatch_plan.runs[self._cp_rank()])} run(s) of the sequence")
        # Only the source holds the latent (it would load it from disk); the others pass None.
        full = to_cp_layout(latent(self.shape), self.cp_t, self.cp_h) if dist.get_rank() == source else None
        shard = cp.broadcast_split_tensor(full, CP_DIM, process_group=group)
        check(shard is not None and tuple(shard.shape) == self.shard_shape[:2] + (1,) + self.shard_shape[2:],
              f"broadcast_split_tensor gave shape {None if shard is None else list(shard.shape)}")
        self.shard = shard.squeeze(CP_DIM)
        want = to_cp_layout(latent(self.shape), self.cp_t, self.cp_h)[:, :, ps.get_context_parallel_rank()]
        check(torch.equal(self.shard, want), f"this rank's shard is not its slice of the latent: "
              f"{_mismatch(self.shard, want)}")
        return f"source: global rank {source} (lowest of its cp group)"

    def _cp_rank(self) -> int:
        return ps.get_context_parallel_rank()

    def pipeline(self) -> str:
        if self.mask is not None:
            return self._pipeline_masked()
        pp, stage, rank, cfg = self.pp_size, self.stage, dist.get_rank(), self.cfg
        group = ps.get_context_parallel_group()
        self.model = model = demo_dit.build(cfg, SEED)  # every rank builds the same weights, runs its part
        # The rotary table is built for the whole token grid and sharded exactly like the latent, so each
        # token keeps its true (t, h, w) position whatever order the sequence is in.
        table = to_cp_layout(demo_dit.rope_table(token_grid(self.shape, cfg.patch)), self.cp_t, self.cp_h)
        cos, sin = demo_dit.rope_for_tokens(cp.split_inputs_cp(table, CP_DIM, group).squeeze(CP_DIM))
        grid = token_grid(self.shard_shape, cfg.patch)
        # The register token goes first in the sequence: cp rank 0 holds it, one token more than the others.
        first = ps.get_context_parallel_rank() == 0
        length = self.cp_size * math.prod(grid) + 1
        attn = demo_dit.usp(self.ulysses_group, self.ring_group, length)
        if first:
            cos, sin = demo_dit.register_rope(cos, sin)
        tokens = (self.shard_shape[0], math.prod(grid) + first, cfg.dim)
        sched = scheduler.pp_scheduler() if pp > 1 else None
        demo_dit.attention_seconds[0] = 0.0
        if stage == 0:
            if self.corrupt_rank == rank:
                self.shard = self.shard + 1.0  # --corrupt-rank: the gather check must catch this
            if sched is not None:
                sched.queue_irecv_prev(self.shard_shape, torch.float32)  # the ring: the output comes back
            x = model["embed"](demo_dit.patchify(self.shard, cfg.patch))
            if first:
                x = demo_dit.with_register(x, model["register"].weight)
        else:
            self.received = x = sched.recv_prev_data(tokens, torch.float32).requires_grad_(True)
        x = demo_dit.run_blocks(model, stage_blocks(stage, pp), x, cos, sin, attn)
        if stage == pp - 1:
            x = x[:, 1:] if first else x  # the register token has no place in the video
        where = self._pass_on(x, sched, lambda y: demo_dit.unpatchify(model["head"](y), cfg.patch, grid, cfg.channels))
        return (f"{length} tokens ({length - 1} of patch {'x'.join(map(str, cfg.patch))} and a register), "
                f"{cfg.heads} heads, {where}")

    def _pass_on(self, x: torch.Tensor, sched: scheduler.PPScheduler | None,
                 head: Callable[[torch.Tensor], torch.Tensor]) -> str:
        """The end of this stage's forward: the last stage makes the output (``head(x)``) and sends it back to
        stage 0 (the ring), the others send ``x`` on; the slowest rank's attention time; the stages in words."""
        pp, stage = self.pp_size, self.stage
        if stage == pp - 1:
            self.output = head(x)
            if sched is not None:
                sched.send_next_data(self.output.detach())  # the last stage's next is stage 0
        else:
            self.sent = x
            sched.send_next_data(x.detach())
            if stage == 0:
                self.output = sched.queue_irecv_prev_data()
        slowest = torch.tensor([demo_dit.attention_seconds[0]], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        self.attention_seconds = slowest.item()
        return f"{NUM_BLOCKS} blocks on one stage" if pp == 1 else \
            f"{NUM_BLOCKS} blocks over {pp} stages, last stage -> stage 0"

    def _pipeline_masked(self) -> str:
        """The autoregressive variant's forward: this rank's plan tokens through its stage's blocks."""
        pp, stage, rank, cfg, plan = self.pp_size, self.stage, dist.get_rank(), self.cfg, self.dispatch_plan
        self.model = model = demo_dit.build(cfg, SEED)
        grid = token_grid(self.shape, cfg.patch)
        mine = plan.index(self._cp_rank())
        # The rotary angles of the whole grid, taken at this rank's positions: each token keeps its (t, h, w).
        cos, sin = (t[mine] for t in demo_dit.rope_for_tokens(demo_dit.rope_table(grid)))
        attn = demo_dit.usp(self.ulysses_group, self.ring_group, None, plan=plan)
        tokens = (self.shape[0], mine.numel(), cfg.dim)
        sched = scheduler.pp_scheduler() if pp > 1 else None
        demo_dit.attention_seconds[0] = 0.0
        if stage == 0:
            x = self.shard + 1.0 if self.corrupt_rank == rank else self.shard
            if sched is not None:  # the ring: the output comes back, as this rank's tokens
                sched.queue_irecv_prev((self.shape[0], mine.numel(), cfg.patch_dim), torch.float32)
            x = model["embed"](x)
        else:
            self.received = x = sched.recv_prev_data(tokens, torch.float32).requires_grad_(True)
        x = demo_dit.run_blocks(model, stage_blocks(stage, pp), x, cos, sin, attn)
        where = self._pass_on(x, sched, model["head"])  # the output stays this rank's tokens until undispatch
        return (f"{plan.length} tokens of patch {'x'.join(map(str, cfg.patch))}, {self.mask} ({plan.method} plan: "
                f"{min(plan.sizes)}-{max(plan.sizes)} tokens per rank), {cfg.heads} heads, {where}")

    def gather(self) -> str:
        err, far = -1.0, ""
        if self.output is not None and self.mask is not None:  # the plan's tokens back in order, unpatchified
            group = ps.get_context_parallel_group()
            whole = cp.undispatch(self.output.detach(), self.dispatch_plan, 1, group)
            full = demo_dit.unpatchify(whole, self.cfg.patch, token_grid(self.shape, self.cfg.patch), self.cfg.channels)
            want = reference(self.shape, self.cfg, self.mask)[0]
            err, far = relative_error(full, want), _far(full, want)
        elif self.output is not None:  # a middle stage holds no output
            group = ps.get_context_parallel_group()
            gathered = cp.cat_outputs_cp(self.output.detach().unsqueeze(CP_DIM), CP_DIM, cp_group=group)
            full = from_cp_layout(gathered, self.cp_t, self.cp_h)
            want = reference(self.shape, self.cfg)[0]
            err, far = relative_error(full, want), _far(full, want)
        worst = torch.tensor([err], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank learns the worst before any check can fail
        check(err <= TOLERANCE, f"the gathered output differs from the one-process result: max |diff| / max |ref| = "
              f"{err:.3g} > {TOLERANCE:g} ({far})")
        return f"{list(self.shape)}, max |diff| / max |ref| {worst.item():.1e} (<= {TOLERANCE:g})"

    def backward(self) -> str:
        pp, stage = self.pp_size, self.stage
        if stage == pp - 1 and self.mask is not None:
            # The output is a permutation of the unpatchified tokens: d(sum(output * target)) / d(this rank's
            # tokens) is the target's patches at this rank's positions.
            mine = self.dispatch_plan.index(self._cp_rank())
            self.output.backward(demo_dit.patchify(target(self.shape), self.cfg.patch)[:, mine])
        elif stage == pp - 1:
            # d(sum(output * target)) / d output is this rank's shard of the target.
            want = to_cp_layout(target(self.shape), self.cp_t, self.cp_h)[:, :, ps.get_context_parallel_rank()]
            self.output.backward(want)
        else:  # the scheduler only sends forward: gradients go to the previous stage point to point
            sched = scheduler.pp_scheduler()
            grad = torch.empty_like(self.sent)
            dist.recv(grad, src=sched.next_rank, group=sched.group)
            self.sent.backward(grad)
        if stage > 0:
            sched = scheduler.pp_scheduler()
            dist.send(self.received.grad.contiguous(), dst=sched.prev_rank, group=sched.group)
        # Every rank of the data-parallel-with-CP group holds this stage: sum their gradients in one collective.
        # Only cp rank 0 holds the register token, so only there has it a gradient; the others add zeros. The
        # autoregressive variant has no register token.
        named = [(n, p) for n, p in self.model.named_parameters() if self._owns(n)]
        has = {n for n, p in named if p.grad is not None}
        first = ps.get_context_parallel_rank() == 0
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in named])
        dist.all_reduce(flat, group=ps.get_data_parallel_group(with_context_parallel=True))
        ref = reference(self.shape, self.cfg, self.mask)[1]
        errs, offset = {}, 0
        for n, p in named:
            if n in ref:  # not the register token in the autoregressive variant: it has no gradient anywhere
                errs[n] = relative_error(flat[offset:offset + p.numel()].view_as(p), ref[n])
            offset += p.numel()
        expected = {n for n, _ in self.model.named_parameters() if self._owns(n)}
        expected -= set() if first and self.mask is None else {"register.weight"}
        grads = {n for n, p in self.model.named_parameters() if p.grad is not None}
        check(has == expected == grads, f"parameters {sorted((grads | has) ^ expected)} have gradients where this "
              f"rank does not use them, or lack them where it does")
        name, err = max(errs.items(), key=lambda kv: kv[1])
        worst = torch.tensor([err], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        check(err <= TOLERANCE, f"the gradient of {name} differs from the one-process one: max |diff| / max |ref| = "
              f"{err:.3g} > {TOLERANCE:g}")
        return (f"{len(ref)} parameter gradients, summed over dp-cp, "
                f"max |diff| / max |ref| {worst.item():.1e}")

    def _owns(self, name: str) -> bool:
        """Whether this rank's pipeline stage holds parameter ``name``."""
        part = name.split(".")
        if part[0] == "blocks":
            return int(part[1]) in stage_blocks(self.stage, self.pp_size)
        return self.stage == (0 if part[0] in ("embed", "register") else self.pp_size - 1)

    def teardown(self) -> str:
        ps.destroy_model_parallel()
        check(not ps.model_parallel_is_initialized(), "model_parallel_is_initialized() is still true")
        check(not hasattr(ps, "cp_size_t"), "parallel_state.cp_size_t survived destroy_model_parallel()")
        try:
            scheduler.pp_scheduler()
        except ps.ParallelStateError:
            pass
        else:
            raise CheckFailed("pp_scheduler() still answers after destroy_model_parallel()")
        world = dist.group.WORLD
        alive = torch.tensor([sum(1 for g in live_groups() if g is not world)], dtype=torch.int64)
        dist.all_reduce(alive)
        check(alive.item() == 0, f"{alive.item()} process group(s) besides the default group are still alive")
        return "0 process groups alive besides the default group (all ranks)"


def _indent(text: str) -> str:
    return "\n".join("       " + line if line else "" for line in text.splitlines())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description="The demo's rank program.")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--rebuild-cp", type=int, default=4)
    p.add_argument("--rebuild-pp", type=int, default=1)
    p.add_argument("--latent", default="1,16,24,88,160")
    p.add_argument("--patch", default="1,2,2")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--corrupt-rank", type=int, default=None)
    p.add_argument("--mask", default="full", help="the DiT's attention mask (cp.Mask.parse; a trailing f counts frames "
                   "of the token grid, e.g. chunk_causal:2f); anything but full runs the autoregressive variant")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = tuple(int(v) for v in args.latent.split(","))
    patch = tuple(int(v) for v in args.patch.split(","))
    timeout = datetime.timedelta(seconds=args.timeout)
    topologies = [(args.cp, args.pp), (args.rebuild_cp, args.rebuild_pp)]
    steps = Steps(total=STEPS * len(topologies))
    start = time.perf_counter()
    attention = []
    for i, (cp_size, pp_size) in enumerate(topologies):
        topology = Topology(steps, cp_size, pp_size, shape, patch, timeout,  # type: ignore[arg-type]
                            corrupt_rank=args.corrupt_rank if i == 0 else None, print_layout=i == 0, heads=HEADS,
                            mask_spec=args.mask)
        topology.run()
        attention.append(topology.attention_seconds)
    world = dist.get_world_size()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    left = len(live_groups())
    if left:
        print(f"rank {steps.rank}: {left} process group(s) still alive after destroy_process_group()",
              file=sys.stderr, flush=True)
        return 1
    if steps.rank == 0:
        print(f"\nSummary: {len(steps.done)}/{steps.total} steps passed on {world} ranks in {elapsed:.1f} s "
              f"({' then '.join(f'cp {c} x pp {p}' for c, p in topologies)})", flush=True)
        names = [name.split("  ", 1)[1] for name, _ in steps.done[:STEPS]]
        labels = [f"cp {c} x pp {p}" for c, p in topologies]
        rows = [[n] + [f"{steps.done[STEPS * t + i][1]:.2f} s" for t in range(len(topologies))]
                for i, n in enumerate(names)]
        # Inside the forward step: the attention itself, its all-to-alls and ring transfers included.
        rows.insert(names.index("DiT forward via scheduler") + 1,
                    ["  of which usp_attention"] + [f"{a:.2f} s" for a in attention])
        width = max(len(row[0]) for row in rows + [["time per step (slowest rank)"]])
        print(f"  {'time per step (slowest rank)':<{width}}  " + "  ".join(f"{lab:>12}" for lab in labels))
        for row in rows:
            print(f"  {row[0]:<{width}}  " + "  ".join(f"{v:>12}" for v in row[1:]))
        print("  process groups alive after teardown: 0 on every rank after each destroy_model_parallel "
              "(besides the default group), 0 after destroy_process_group", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # outside a step (argument parsing, final teardown): still one line
        print(f"rank {os.environ.get('RANK', '?')}: {type(exc).__name__}: {' '.join(str(exc).split())}",
              file=sys.stderr, flush=True)
        os._exit(1)
