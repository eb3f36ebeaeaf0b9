"""Context-parallel attention: Ulysses, ring, Ulysses x ring (usp) and gathering K and V, side by side in one run.

A [1, 16, 8, 32, 32] latent patchified 1x2x2 is 2,048 tokens of 64 values; fixed projections make
q, k and v of [1, 2048, 8 heads, 8], split along the sequence over 2 and 4 gloo ranks.
"ulysses": one all-to-all moves q, k and v to head shards, attention over the whole sequence, one
all-to-all back. "ring": cp.ring_attention, K/V blocks passed around the ranks point to point.
"usp 2xR": cp.usp_attention, Ulysses over 2 ranks and a ring over R = n/2, on parallel_state's
hierarchical cp groups. "gather K/V": every rank gathers the whole K and V (one all-gather of both)
and attends with its own queries. All are checked against attention in one process before timing.
Bytes sent per rank (forward, exact) are the payload each rank hands to the network, with s the
bytes of one rank's shard of q: all-to-all sends (n-1)/n of each of q, k, v and the output
(4 (n-1)/n s); the ring sends its K and V block on n-1 times (2 (n-1) s); usp u x r sends
4 (u-1)/u s in its all-to-alls and 2 (r-1) s around its ring (its ring blocks have u times the
tokens and 1/u of the heads); the all-gather sends the K and V shards to n-1 ranks (2 (n-1) s).
The ring sends what the all-gather does, but never holds the whole K and V. Each repetition times
every method, in rotating order, after a barrier; a call's time is the slowest rank's.

Masked attention (second table): a cut-down real video, 21 latent frames of 96 tokens (2,016 tokens;
a Wan-style 480p clip has 21 frames of 1,560), q, k, v [1, 2016, 8 heads, 16] float32, under a
chunk-causal mask (chunks of 3 frames) and a packed mask (clips of 9, 5 and 7 frames, full attention
inside each), on 2 and 4 gloo ranks: ``ring_attention(plan=)`` and ``usp_attention(plan=)`` (Ulysses 2
x ring n/2) on the default plan (``cp.plan_dispatch(mask, length, n, ulysses_size=u)``, u = 1 for the ring
and 2 for usp, as each call would be planned: its method, and its transport
and predicted time where the planner gives them) and on the contiguous split, forward + backward. A
step is faster only where every rank has a core of its own: 4 ranks on 2 cores share them, and the
step takes the whole work's time whatever the plan. Bytes are those
``cp.count_attention`` counts (K/V and their gradients sent point to point, forward and backward,
the busiest rank's; usp's all-to-alls come on top, the same for both plans); work is the counted
(query, key) pairs, max over ranks / mean. All are checked against one process under the dense
mask before timing. Efficiency: one process's fused SDPA on the same tokens (causal: its causal flag;
other masks: full attention's time times the allowed share of the pairs) / (ranks x our time).

PyTorch's own context parallelism (third table), on the same tokens and ranks: q, k, v [1, 8 heads,
2048, 16] float32 (16 frames of 128 tokens; torch's CP needs the length to divide by 2 cp for its
head-tail balancer and by 128 cp for its flex BlockMask), in torch's [B, H, S, D] layout for both:
its ring with its head-tail balancer, causal, forward + backward and forward; its flex_attention CP
(K/V all-gathered, one compiled flex_attention call with the rank's BlockMask), forward, for a
chunk-causal mask (chunks of 4 frames) and packed clips (7, 4 and 5 frames); beside
``ring_attention(plan=)`` on the default plan and on the contiguous split. How torch's code is
called on a CPU, and why not through ``context_parallel()``: benchmarks/torch_cp.py.

``python -m benchmarks.bench_attention [--reps N] [--worlds 2,4] [--masked-worlds 2,4] [--peer-worlds 2,4]
[--threads 1] [--tables plain,masked,peers]``
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from typing import Any

from benchmarks.harness import spawn_measure, table

LATENT = (1, 16, 8, 32, 32)
PATCH = (1, 2, 2)
HEADS = 8
SEED = 0


def make_qkv() -> tuple[Any, Any, Any]:
    """q, k, v for the whole sequence, [1, tokens, HEADS, dim / HEADS]: the same in every process."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    b, c, t, h, w = LATENT
    pt, ph, pw = PATCH
    x = torch.randn(LATENT, generator=g)
    tokens = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    tokens = tokens.reshape(b, -1, c * pt * ph * pw)
    dim = tokens.shape[-1]
    proj = [torch.randn(dim, dim, generator=g) / dim ** 0.5 for _ in range(3)]
    return tuple((tokens @ m).reshape(b, -1, HEADS, dim // HEADS) for m in proj)  # type: ignore[return-value]


def gather_kv_attention(q: Any, k: Any, v: Any, group: Any) -> Any:
    """The alternative: gather the whole K and V on every rank (one all-gather for both), attend with local q."""
    import torch

    import cp
    from cp.comm import all_gather_into

    n = group.size()
    kv = torch.stack([k, v]).contiguous()                       # [2, B, S/n, H, D]
    out = torch.empty((n,) + tuple(kv.shape), dtype=kv.dtype)
    all_gather_into(out.view(-1), kv.view(-1), group)
    full = out.permute(1, 2, 0, 3, 4, 5).reshape(2, kv.shape[1], n * kv.shape[2], *kv.shape[3:])
    return cp.sdpa_in_layout(q, full[0], full[1])


def time_in_turns(ways: dict[Any, Any], group: Any, opts: dict[str, Any], device: Any = "cpu") -> dict[Any, list[float]]:
    """Each way's times (the slowest rank's), ``opts["reps"]`` rounds after ``opts["warmup"]``, every round
    calling every way once after a barrier, in an order that rotates by one each round. ``device``: where the
    group's backend reduces (a CUDA device for NCCL; a way on a GPU synchronizes before it returns)."""
    import torch
    import torch.distributed as dist

    slowest = torch.zeros(1, dtype=torch.float64, device=device)
    times: dict[Any, list[float]] = {key: [] for key in ways}
    order = list(ways.items())
    for rep in range(opts["reps"] + opts["warmup"]):
        for key, fn in order[rep % len(order):] + order[:rep % len(order)]:
            dist.barrier(group=group)
            start = time.perf_counter()
            fn()
            slowest.fill_(time.perf_counter() - start)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            if rep >= opts["warmup"]:
                times[key].append(slowest.item())
    return times


def join(rank: int, world: int, store: str, opts: dict[str, Any], timeout: float = 120) -> None:
    """This spawned rank joins the gloo world at ``store``, on ``opts["threads"]`` torch threads."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def _measure(rank: int, world: int, store: str, opts: dict[str, Any]) -> dict[str, Any] | None:
    import torch.distributed as dist

    import cp

    join(rank, world, store, opts)
    import parallel_state as ps

    group = dist.group.WORLD
    q, k, v = make_qkv()
    ref = cp.sdpa_in_layout(q, k, v)
    mine = [cp.split_inputs_cp(t, 1, group).contiguous() for t in (q, k, v)]
    want = cp.split_inputs_cp(ref, 1, group)
    ways = {"ulysses": lambda: cp.ulysses_attention(*mine, group),
            "ring": lambda: cp.ring_attention(*mine, group)}
    u, r = usp_sizes(world)
    if u > 1:
        ps.initialize_model_parallel(context_parallel_size=world, hierarchical_context_parallel_sizes=[u, r])
        ug, rg = ps.get_hierarchical_context_parallel_groups()
        ways[f"usp {u}x{r}"] = lambda: cp.usp_attention(*mine, ulysses_group=ug, ring_group=rg)
    ways["gather K/V"] = lambda: gather_kv_attention(*mine, group)
    for name, fn in ways.items():  # same answer as one process, checked before timing anything
        err = ((fn() - want).abs().max() / want.abs().max()).item()
        if err > 1e-5:
            raise AssertionError(f"{name} differs from one-process attention: max |diff| / max |ref| = {err:.3g}")
    times = time_in_turns(ways, group, opts)
    shard = mine[0].numel() * mine[0].element_size()
    sent = {"ulysses": 4 * (world - 1) * shard // world, "ring": 2 * (world - 1) * shard,
            f"usp {u}x{r}": 4 * (u - 1) * shard // u + 2 * (r - 1) * shard, "gather K/V": 2 * (world - 1) * shard}
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    if rank:
        return None
    return {name: {"ms": statistics.median(t) * 1e3, "bytes": sent[name]} for name, t in times.items()}


FRAMES, FRAME_TOKENS, CHUNK_FRAMES, CLIPS = 21, 96, 3, (9, 5, 7)
MASKED_HEADS, MASKED_DIM = 8, 16


def masked_cases() -> dict[str, Any]:
    """The masks of the masked table, by name."""
    import cp

    return {f"chunk-causal ({CHUNK_FRAMES} frames)": cp.Mask.chunk_causal(CHUNK_FRAMES * FRAME_TOKENS),
            f"packed clips {'+'.join(map(str, CLIPS))} frames": cp.Mask.packed([c * FRAME_TOKENS for c in CLIPS])}


def _measure_masked(rank: int, world: int, store: str, opts: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    import cp
    import parallel_state as ps

    join(rank, world, store, opts)
    ps.initialize_model_parallel(context_parallel_size=world, hierarchical_context_parallel_sizes=[2, world // 2])
    ug, rg = ps.get_hierarchical_context_parallel_groups()
    group = dist.group.WORLD
    length = FRAMES * FRAME_TOKENS
    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, length, MASKED_HEADS, MASKED_DIM, generator=g) for _ in range(3))
    grad = torch.randn(1, length, MASKED_HEADS, MASKED_DIM, generator=g)
    ways: dict[tuple[str, str, str], Any] = {}
    plans: dict[tuple[str, str], Any] = {}
    for mask_name, mask in masked_cases().items():
        want = cp.sdpa_in_layout(q, k, v, attn_mask=mask.dense(length))
        for method in ("default", "contiguous"):
            for how in ("ring", f"usp 2x{world // 2}"):
                # The default plan is the one planned for the call: usp's with its Ulysses size.
                ulysses = 1 if how == "ring" else 2
                plan = cp.plan_dispatch(mask, length, world, ulysses_size=ulysses,
                                        **({} if method == "default" else {"method": method}))
                plans[mask_name, how, method] = plan
                mine = plan.index(rank)
                ins = [t[:, mine].requires_grad_(True) for t in (q, k, v)]

                def step(ins=ins, plan=plan, how=how, g_out=grad[:, mine]) -> Any:
                    if how == "ring":
                        out = cp.ring_attention(*ins, group, plan=plan)
                    else:
                        out = cp.usp_attention(*ins, ulysses_group=ug, ring_group=rg, plan=plan)
                    out.backward(g_out)
                    return out
                out = step()  # checked against one process before any timing
                err = ((out.detach() - want[:, mine]).abs().max() / want.abs().max()).item()
                if err > 1e-5:
                    raise AssertionError(f"{how} {mask_name} {method}: max |diff| / max |ref| = {err:.3g}")
                ways[(mask_name, how, method)] = step
    counted = count_ways(ways, group)
    times = time_in_turns(ways, group, opts)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    if rank:
        return None
    return {" | ".join(key): {"ms": statistics.median(times[key]) * 1e3, "bytes": counted[key][0],
                              "balance": counted[key][1], **plan_facts(plans[key])} for key in ways}


def plan_facts(plan: Any) -> dict[str, Any]:
    """What a plan says of itself: its method, and where the planner has them, its transport and predicted time."""
    return {"method": plan.method, "transport": plan.transport, "predicted_ms": plan.predicted_ms}


def count_ways(ways: dict[Any, Any], group: Any) -> dict[Any, tuple[float, float]]:
    """What each way sends and computes, counted by ``cp.count_attention`` on every rank: (bytes sent point to
    point forward and backward, the busiest rank's; work max / mean over the ranks)."""
    import torch

    import cp
    from cp.comm import all_gather_into

    world = group.size()
    counted = {}
    for key, fn in ways.items():
        with cp.count_attention() as count:
            fn()
        sent = sum(count.kv_sent.values()) + sum(count.grad_sent.values())
        every = torch.empty(2 * world, dtype=torch.float64)
        all_gather_into(every, torch.tensor([sent, count.pairs], dtype=torch.float64), group)
        rows = every.view(world, 2)
        counted[key] = (rows[:, 0].max().item(), (rows[:, 1].max() / rows[:, 1].mean().clamp(min=1)).item())
    return counted


def fused_ms(mask: Any, ins: list[Any], grad: Any, backward: bool, opts: dict[str, Any], **layout: Any) -> float:
    """One process's fused SDPA on the whole sequence for the work of ``mask``: full attention, torch's causal
    flag for causal, else full attention's time times the mask's share of allowed pairs (SDPA under a dense mask
    computes every pair, and on a CPU its backward under a mask is not fused: no yardstick for a kernel)."""
    import cp

    causal = mask == cp.Mask.causal()
    ins = [t.detach().requires_grad_(backward) for t in ins]
    full = one_process_ms(lambda: _call(lambda *x: cp.sdpa_in_layout(*x, is_causal=causal, **layout), ins, grad,
                                        backward), opts["reps"], opts["threads"])
    length = ins[0].shape[layout.get("seq_dim", 1)]
    return full if causal else full * mask.work(length) / length ** 2


def masked_one_process_ms(opts: dict[str, Any]) -> dict[str, float]:
    """:func:`fused_ms` of the masked table, forward + backward, per mask."""
    import torch

    length = FRAMES * FRAME_TOKENS
    g = torch.Generator().manual_seed(SEED)
    *ins, grad = (torch.randn(1, length, MASKED_HEADS, MASKED_DIM, generator=g) for _ in range(4))
    return {name: fused_ms(mask, ins, grad, True, opts) for name, mask in masked_cases().items()}


def _plan_cells(p: dict[str, Any]) -> list[str]:
    pred = p["predicted_ms"]
    return [p["method"] + (f", {p['transport']}" if p["transport"] else ""), "-" if pred is None else f"{pred:.1f}"]


def masked_rows(world: int, opts: dict[str, Any]) -> list[list[Any]]:
    """The masked table's rows: each mask and method, the default plan beside the contiguous split, and the
    efficiency of the default plan (one process's fused SDPA / (ranks x its time))."""
    r = spawn_measure(_measure_masked, world, opts, timeout=600, prefix="bench_attention_masked")
    one = masked_one_process_ms(opts)
    rows = []
    for mask_name in masked_cases():
        for how in ("ring", f"usp 2x{world // 2}"):
            b, c = (r[f"{mask_name} | {how} | {m}"] for m in ("default", "contiguous"))
            rows.append([world, mask_name, how, *_plan_cells(b), f"{b['balance']:.3f} / {c['balance']:.3f}",
                         f"{b['bytes'] / 2**20:.2f} / {c['bytes'] / 2**20:.2f}", f"{b['ms']:.1f} / {c['ms']:.1f}",
                         f"{c['ms'] / b['ms']:.2f}x", f"{one[mask_name]:.1f}", f"{one[mask_name] / (world * b['ms']):.2f}"])
    return rows


PEER_FRAMES, PEER_FRAME_TOKENS, PEER_CHUNK_FRAMES, PEER_CLIPS = 16, 128, 4, (7, 4, 5)
PEER_HEADS, PEER_DIM = 8, 16


def peer_cases() -> list[tuple[str, Any, str, bool]]:
    """The peer table's rows: (mask name, mask, torch's method, with backward)."""
    import cp

    chunk = PEER_CHUNK_FRAMES * PEER_FRAME_TOKENS
    return [("causal", cp.Mask.causal(), "ring", True), ("causal", cp.Mask.causal(), "ring", False),
            (f"chunk-causal ({PEER_CHUNK_FRAMES} frames)", cp.Mask.chunk_causal(chunk), "flex", False),
            (f"packed clips {'+'.join(map(str, PEER_CLIPS))} frames",
             cp.Mask.packed([c * PEER_FRAME_TOKENS for c in PEER_CLIPS]), "flex", False)]


def peer_inputs() -> list[Any]:
    """q, k, v and the output's gradient of the peer table, whole, [1, heads, tokens, dim] (torch CP's layout)."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    return [torch.randn(1, PEER_HEADS, PEER_FRAMES * PEER_FRAME_TOKENS, PEER_DIM, generator=g) for _ in range(4)]


def _call(fn: Any, ins: list[Any], grad: Any, backward: bool) -> Any:
    """One step: forward (without autograd) or forward + backward; the output."""
    import torch

    if not backward:
        with torch.no_grad():
            return fn(*ins)
    out = fn(*ins)
    torch.autograd.grad(out, ins, grad)
    return out


def _measure_peers(rank: int, world: int, store: str, opts: dict[str, Any]) -> dict[str, Any] | None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cp
    from benchmarks import torch_cp

    join(rank, world, store, opts, timeout=300)
    mesh = init_device_mesh("cpu", (world,))
    group = dist.group.WORLD
    q, k, v, grad = peer_inputs()
    length = q.shape[2]
    ways: dict[tuple[int, str], Any] = {}
    plans, theirs_bytes = {}, {}
    shard_bytes = k.numel() * k.element_size() // world
    for i, (_, mask, method, backward) in enumerate(peer_cases()):
        want = cp.sdpa_in_layout(q, k, v, seq_dim=2, head_dim=1, attn_mask=mask.dense(length))
        if method == "ring":
            index = torch_cp.head_tail_index(length, world).chunk(world)[rank]
            ring = torch_cp.ring_attention(group)
            ins = [t[:, :, index].requires_grad_(backward) for t in (q, k, v)]
            theirs = functools.partial(_call, ring, ins, grad[:, :, index], backward)
            theirs_bytes[i] = torch_cp.ring_bytes(shard_bytes, world, backward)
        else:
            flex, index = torch_cp.flex_attention(mesh, mask, q, k, v)
            theirs = flex
            theirs_bytes[i] = torch_cp.flex_bytes(shard_bytes, world)
        check(f"torch's {method} CP, {mask}", theirs(), want[:, :, index])
        ways[(i, "torch")] = theirs
        for how in ("plan", "contiguous"):
            plan = cp.plan_dispatch(mask, length, world, **({"method": "contiguous"} if how == "contiguous" else {}))
            plans[(i, how)] = plan
            mine = plan.index(rank)
            ins = [t[:, :, mine].requires_grad_(backward) for t in (q, k, v)]

            def ours(plan: Any = plan, ins: list[Any] = ins, g: Any = grad[:, :, mine], b: bool = backward) -> Any:
                return _call(lambda *x: cp.ring_attention(*x, group, plan=plan, seq_dim=2, head_dim=1), ins, g, b)

            check(f"ours ({how}), {mask}", ours(), want[:, :, mine])
            ways[(i, how)] = ours
    counted = count_ways({key: fn for key, fn in ways.items() if key[1] != "torch"}, group)
    times = time_in_turns(ways, group, opts)
    dist.destroy_process_group()
    if rank:
        return None
    out: dict[str, Any] = {}
    for i in range(len(peer_cases())):
        out[str(i)] = {"torch": {"ms": statistics.median(times[(i, "torch")]) * 1e3, "bytes": theirs_bytes[i]}}
        for how in ("plan", "contiguous"):
            plan = plans[(i, how)]
            out[str(i)][how] = {"ms": statistics.median(times[(i, how)]) * 1e3, "bytes": counted[(i, how)][0],
                                "balance": counted[(i, how)][1], **plan_facts(plan)}
    return out


FUSED_NOTE = ("one process's fused SDPA on the same tokens (causal: its causal flag; other masks: full attention's "
              "time x the allowed share of the pairs)")


def check(what: str, got: Any, want: Any) -> None:
    """Raise unless ``got`` is ``want`` within 1e-5 of its largest value (checked before any timing)."""
    err = ((got.detach() - want).abs().max() / want.abs().max()).item()
    if err > 1e-5:
        raise AssertionError(f"{what} differs from one-process attention: max |diff| / max |ref| = {err:.3g}")


def one_process_ms(fn: Any, reps: int, threads: int) -> float:
    """Median time of ``fn()`` in this one process, on ``threads`` torch threads (as many as a rank has)."""
    import torch

    torch.set_num_threads(threads)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def peer_rows(world: int, opts: dict[str, Any]) -> list[list[Any]]:
    """The peer table's rows on ``world`` ranks, each with the efficiency of ours (one process's fused SDPA on the
    same tokens / (ranks x our time))."""
    r = spawn_measure(_measure_peers, world, opts, timeout=900, prefix="bench_attention_peers")
    *ins, grad = peer_inputs()
    rows = []
    for i, (name, mask, method, backward) in enumerate(peer_cases()):
        one = fused_ms(mask, ins, grad, backward, opts, seq_dim=2, head_dim=1)
        t, b, c = (r[str(i)][w] for w in ("torch", "plan", "contiguous"))
        rows.append([world, name, "forward + backward" if backward else "forward",
                     f"{'ring (head-tail)' if method == 'ring' else 'flex_attention CP (head-tail)'}",
                     f"{t['ms']:.1f} / {b['ms']:.1f} / {c['ms']:.1f}", f"{b['ms'] / t['ms']:.2f}x",
                     f"{c['ms'] / t['ms']:.2f}x", f"{c['ms'] / b['ms']:.2f}x",
                     f"{t['bytes'] / 2**20:.2f} / {b['bytes'] / 2**20:.2f} / {c['bytes'] / 2**20:.2f}",
                     *_plan_cells(b), f"{one:.1f}", f"{one / (world * b['ms']):.2f}"])
    return rows


def usp_sizes(world: int) -> tuple[int, int]:
    """usp's [ulysses, ring] sizes for ``world`` ranks: 2 x world/2, or (1, world) when that is not two levels."""
    return (2, world // 2) if world % 2 == 0 and world >= 4 else (1, world)


def run(world: int, opts: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """Start ``world`` ranks, measure, and return rank 0's figures."""
    return spawn_measure(_measure, world, opts, timeout=timeout, prefix="bench_attention")


def single_process_ms(reps: int, threads: int) -> float:
    """Median time of attention over the whole sequence in this one process."""
    import torch

    import cp

    torch.set_num_threads(threads)
    q, k, v = make_qkv()
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        cp.sdpa_in_layout(q, k, v)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; the exit status is 1 when the run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", default="2,4", help="numbers of gloo ranks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--masked-worlds", default="2,4", help="numbers of gloo ranks of the masked table (even)")
    parser.add_argument("--peer-worlds", default="2,4", help="numbers of gloo ranks of the PyTorch CP table")
    parser.add_argument("--tables", default="plain,masked,peers", help="which tables: plain (every method), masked "
                        "(default plan vs contiguous split), peers (PyTorch's own context parallelism beside ours)")
    args = parser.parse_args(argv)
    tables = set(args.tables.split(","))
    if not tables or tables - {"plain", "masked", "peers"}:
        parser.error(f"--tables takes plain, masked and/or peers, got {args.tables!r}")
    opts = {"reps": args.reps, "warmup": args.warmup, "threads": args.threads}
    start = time.perf_counter()
    rows, masked, peers = [], [], []
    try:
        if "plain" in tables:
            one = single_process_ms(args.reps, args.threads)
            for world in (int(w) for w in args.worlds.split(",")):
                r = run(world, opts)
                g = r["gather K/V"]
                for name, m in r.items():
                    rows.append([world, name, f"{m['bytes'] / 2**20:.2f}", f"{m['ms']:.2f}",
                                 f"{g['ms'] / m['ms']:.2f}x", f"{one:.2f}"])
        if "masked" in tables:
            for world in (int(w) for w in args.masked_worlds.split(",")):
                masked += masked_rows(world, opts)
        if "peers" in tables:
            for world in (int(w) for w in args.peer_worlds.split(",")):
                peers += peer_rows(world, opts)
    except Exception as exc:
        print(f"bench_attention failed: {exc}", file=sys.stderr)
        return 1
    timing = f"median of {args.reps} repetitions in rotating order (slowest rank), {args.threads} thread(s) per rank"
    if masked:
        print(table(
            f"masked attention, default plan / contiguous split: q, k, v [1, {FRAMES * FRAME_TOKENS}, {MASKED_HEADS}, "
            f"{MASKED_DIM}] float32 ({FRAMES} frames of {FRAME_TOKENS} tokens), gloo ranks, forward + backward",
            ["ranks", "mask", "method", "default plan", "predicted ms", "work max/mean", "MiB sent/rank (max)", "ms",
             "speed-up of default", "1 process ms", "efficiency"],
            masked,
            [f"{timing}; bytes and work counted by cp.count_attention (usp: its ring's K/V; the all-to-alls add the "
             f"same for both plans); all match one-process attention under the dense mask within 1e-5 before timing; "
             f"1 process ms: {FUSED_NOTE}; efficiency: 1 process ms / (ranks x the default plan's ms)"],
        ))
    if peers:
        print(table(
            f"PyTorch's context parallelism beside ours: q, k, v [1, {PEER_HEADS}, {PEER_FRAMES * PEER_FRAME_TOKENS}, "
            f"{PEER_DIM}] float32 ({PEER_FRAMES} frames of {PEER_FRAME_TOKENS} tokens, torch's [B, H, S, D]), gloo ranks",
            ["ranks", "mask", "pass", "torch's CP", "ms: torch / ours / contiguous", "ours / torch",
             "contiguous / torch", "speed-up of default", "MiB sent/rank: torch / ours / contiguous", "default plan",
             "predicted ms", "1 process ms", "efficiency"],
            peers,
            [f"{timing}; ours: cp.ring_attention(plan=) on cp.plan_dispatch's default plan and on the contiguous "
             f"split; torch's: its ring (_templated_ring_attention, alltoall rotation, head-tail balancer) and its "
             f"flex_attention CP (torch.compile'd flex_attention, K/V all-gathered), on the CPU's fused op "
             f"(benchmarks/torch_cp.py says why not through context_parallel()); bytes: ours counted by "
             f"cp.count_attention (busiest rank), torch's from its algorithm; all match one-process attention within "
             f"1e-5 before timing; 1 process ms: {FUSED_NOTE}; efficiency: 1 process ms / (ranks x ours)"],
        ))
    if not rows:
        print(f"(bench_attention took {time.perf_counter() - start:.0f} s)")
        return 0
    q = make_qkv()[0]
    print(table(
        f"context-parallel attention: q, k, v {list(q.shape)} float32 ({LATENT} patchified "
        f"{'x'.join(map(str, PATCH))}, {HEADS} heads), gloo ranks",
        ["ranks", "method", "MiB sent/rank", "ms", "speed-up vs gather K/V", "1 process ms"],
        rows,
        [f"median of {args.reps} repetitions in rotating order (slowest rank), {args.threads} thread(s) per rank; "
         f"all match one-process attention within 1e-5 before timing"],
    ))
    print(f"(bench_attention took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
