"""The rank program of ``python -m parallel_state demo``: the project's main job, on every rank.

It uses all three packages (``parallel_state``, ``cp``, ``scheduler``), so it lives outside them:
``parallel_state`` must never import ``cp`` or ``scheduler``. ``python -m parallel_state demo``
starts it with torch.distributed's elastic launcher; it also runs under torchrun directly::

    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 4 --master-addr 127.0.0.1 -m parallel_state_demo

For each of two topologies (cp x pp, then another after a full teardown) every rank: builds the
groups with ``dist_init`` and checks them against the pure plan; plans the latent with
``find_split``; receives its shard with ``broadcast_split_tensor`` (stage 0); runs the model's
layers for its pipeline stage, passing activations with the scheduler (the last stage sends its
output back to stage 0, MAGI-1's ring); gathers with ``cat_outputs_cp`` and checks the result
bit for bit against the same layers run on the whole latent in this one process; tears down and
checks that nothing is left. A failed check prints one line naming the rank and the step and
exits 1; the launcher then stops the other ranks.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import cp
import parallel_state as ps
import scheduler
from parallel_state.cli import format_plan
from parallel_state.groups import live_groups
from parallel_state.plan import TopologyPlan

SEED = 1234
NUM_LAYERS = 4   # the model's layers, divided among the pipeline stages
CP_DIM = 2       # the context-parallel shard dimension of the [B, C, cp, T', H', W] layout
ORDER = "tp-cp-pp-dp"  # dist_init's


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
def _weights(layer: int, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + layer)
    return tuple(torch.randn(channels, generator=g) for _ in range(3))  # type: ignore[return-value]


def layer_forward(layer: int, x: torch.Tensor) -> torch.Tensor:
    """One deterministic layer: each channel mixed with its neighbour, plus a bias, then a ReLU.

    Only elementwise multiplies and adds, in the same order for every element, so a shard and
    the whole latent go through identical float operations: shard results and the one-process
    result must match bit for bit (a matmul could reorder its sums with the shape).
    """
    channels = x.shape[1]
    a, b, bias = (v.reshape((1, channels) + (1,) * (x.dim() - 2)) for v in _weights(layer, channels))
    return torch.relu(a * x + b * torch.roll(x, 1, dims=1) + bias)


def stage_layers(stage: int, pp: int) -> range:
    """The layers pipeline stage ``stage`` of ``pp`` runs."""
    return range(stage * NUM_LAYERS // pp, (stage + 1) * NUM_LAYERS // pp)


def run_layers(layers: Sequence[int], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer_forward(layer, x)
    return x


@functools.cache
def reference(shape: tuple[int, ...]) -> torch.Tensor:
    """The whole model on the whole latent, in this one process."""
    return run_layers(range(NUM_LAYERS), latent(shape))


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
                 print_layout: bool):
        self.steps, self.cp_size, self.pp_size = steps, cp_size, pp_size
        self.shape, self.patch, self.timeout = shape, patch, timeout
        self.corrupt_rank, self.print_layout = corrupt_rank, print_layout
        self.label = f"cp {cp_size} x pp {pp_size}"
        self.shard: torch.Tensor | None = None
        self.output: torch.Tensor | None = None  # this rank's shard of the model's output, if it has one

    def run(self) -> None:
        s = self.steps
        s.run(f"{self.label}  dist_init, groups == plan", self.init)
        if self.print_layout:
            s.say(_indent(format_plan(self.plan)))
        s.run(f"{self.label}  find_split", self.split)
        s.run(f"{self.label}  broadcast + split latent", self.scatter)
        s.run(f"{self.label}  pipeline via scheduler", self.pipeline)
        s.run(f"{self.label}  cat_outputs_cp == 1 process", self.gather)
        s.run(f"{self.label}  destroy_model_parallel", self.teardown)

    # -- steps (each returns a detail for rank 0's progress line)

    def init(self) -> str:
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
        return (f"cp groups {[list(g) for g in plan.groups('cp')]}, "
                f"pp groups {[list(g) for g in plan.groups('pp')]}")

    def split(self) -> str:
        per_rank = tuple(ps.find_split(list(self.shape), self.cp_size, patch_values=self.patch))
        check(hasattr(ps, "cp_size_t"), "find_split did not set parallel_state.cp_size_t")
        self.cp_t = ps.cp_size_t
        self.cp_h = self.cp_size // self.cp_t
        _, _, t, h, w = self.shape
        check(per_rank == (t // self.cp_t, h // self.cp_h, w) and self.cp_t * self.cp_h == self.cp_size,
              f"find_split gave {list(per_rank)} with cp_size_t {self.cp_t} for {list(self.shape)}, cp {self.cp_size}")
        self.shard_shape = (self.shape[0], self.shape[1], *per_rank)
        return f"{list(self.shape)} -> per-rank {list(per_rank)}, cp_size_t {self.cp_t}"

    def scatter(self) -> str:
        if self.stage != 0:
            return ""
        group = ps.get_context_parallel_group()
        source = min(dist.get_process_group_ranks(group))
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

    def pipeline(self) -> str:
        pp, stage, rank = self.pp_size, self.stage, dist.get_rank()
        mine = stage_layers(stage, pp)
        if stage == 0 and self.corrupt_rank == rank:
            self.shard = self.shard + 1.0  # --corrupt-rank: the gather check must catch this
        if pp == 1:
            self.output = run_layers(mine, self.shard)
            return f"{NUM_LAYERS} layers on one stage"
        sched = scheduler.pp_scheduler()
        dtype = torch.float32
        if stage == 0:
            sched.queue_irecv_prev(self.shard_shape, dtype)  # the ring: the last stage's output comes back
            sched.send_next_data(run_layers(mine, self.shard))
            self.output = sched.queue_irecv_prev_data()
            want = run_layers(range(NUM_LAYERS), self.shard)
            check(torch.equal(self.output, want), "the output that came back around the pipeline ring differs "
                  f"from this shard run through all layers here: {_mismatch(self.output, want)}")
        else:
            out = run_layers(mine, sched.recv_prev_data(self.shard_shape, dtype))
            sched.send_next_data(out)  # the last stage's next is stage 0
            if stage == pp - 1:
                self.output = out
        return f"{NUM_LAYERS} layers over {pp} stages, last stage -> stage 0"

    def gather(self) -> str:
        if self.output is None:  # a middle stage holds no output
            return ""
        group = ps.get_context_parallel_group()
        gathered = cp.cat_outputs_cp(self.output.unsqueeze(CP_DIM), CP_DIM, cp_group=group)
        full = from_cp_layout(gathered, self.cp_t, self.cp_h)
        want = reference(self.shape)
        check(torch.equal(full, want), f"the gathered output differs from the one-process result: "
              f"{_mismatch(full, want)}")
        return f"{list(full.shape)}, bit for bit"

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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = tuple(int(v) for v in args.latent.split(","))
    patch = tuple(int(v) for v in args.patch.split(","))
    timeout = datetime.timedelta(seconds=args.timeout)
    topologies = [(args.cp, args.pp), (args.rebuild_cp, args.rebuild_pp)]
    steps = Steps(total=6 * len(topologies))
    start = time.perf_counter()
    for i, (cp_size, pp_size) in enumerate(topologies):
        Topology(steps, cp_size, pp_size, shape, patch, timeout,  # type: ignore[arg-type]
                 corrupt_rank=args.corrupt_rank if i == 0 else None, print_layout=i == 0).run()
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
        names = [name.split("  ", 1)[1] for name, _ in steps.done[:6]]
        labels = [f"cp {c} x pp {p}" for c, p in topologies]
        rows = [[n] + [f"{steps.done[6 * t + i][1]:.2f} s" for t in range(len(topologies))]
                for i, n in enumerate(names)]
        width = max(len(n) for n in names + ["time per step (slowest rank)"])
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
