"""The GPU check: ring, usp, masked attention and both faces in bfloat16 beside one process's SDPA and FlexAttention:
error, memory, host and device time, TFLOP/s against the card's ceiling.

For each shape (a small one and a realistic video DiT size, 24 heads x 128, 21 latent frames of 1,560
tokens = 32,760 tokens, batch 1), each call and each mask kind (full, causal, chunk-causal,
sliding-window, packed clips), on a world of one GPU (groups of one) and, when the machine has
several, on all of them (NCCL, one process per GPU): ``cp.ring_attention`` and ``cp.usp_attention``
(Ulysses 2 x ring n/2 on parallel_state's hierarchical cp groups), plain (no mask; ``causal=True``)
on the contiguous split and masked (``plan=cp.plan_dispatch(mask, length, n)``, the default plan),
Transformer Engine's face (``cp.transformer_engine.DotProductAttention``, built as Cosmos builds it,
bshd, p2p; no_mask on the contiguous split, causal on TE's DualChunkSwap layout) and megatron-core's
(``cp.megatron.DotProductAttention``, sbhd, p2p on the DualChunkSwap layout: causal, and chunk-causal as ``mask=``;
rows skipped without megatron-core), forward + backward in bfloat16. On a world of one, each mask also has a
FlexAttention row (``gpu_peers.flex``: compiled ``flex_attention`` with a block mask built from the same
``cp.Mask``'s key ranges; compiled at its first call, outside the timing; its failure is the row's status).
Against one process:

- error: out, dq, dk, dv against a float32 reference (one process's fused SDPA under the dense
  mask), max |diff| and max |diff| / max |ref|, beside the same figures of one process's bfloat16
  SDPA (the error a fused bfloat16 kernel has anyway);
- peak memory: ``torch.cuda.max_memory_allocated`` above what was allocated before the call, the
  busiest rank's, beside one process's SDPA and FlexAttention on the whole sequence;
- time: the slowest rank's, until the call's end on the device, beside one process's bfloat16 SDPA
  (torch's default kernel, the same mask, every token) and, on a world of one, FlexAttention on the whole
  sequence, timed in turns; the host's time per call (until it returns, before any synchronize) beside the
  device's (CUDA events); ours / SDPA's and ours / Flex's time; efficiency = t_sdpa / (ranks x t_ours), the
  fraction of the fused kernel's throughput reached (above 1 where the mask lets ours skip what SDPA computes);
- TFLOP/s per GPU on the mask's allowed pairs (14 x pairs x heads x dim for forward + backward, the same count
  for every kernel), beside the card's ceiling: a bfloat16 matmul's TFLOP/s measured in the same run.

On several GPUs, a second table: the cross-rank check's cost. ``CHECK_CALLS`` masked ring calls
(forward + backward, the default plan of the chunk-causal mask) launched back to back as a model's
layers are, one synchronize at the end, with the check as it runs (``cp.call_check``: in full once,
then a two-int round a call judged on the GPU, no host sync) and in full every call
(``PARALLEL_STATE_DEBUG=1``, whose host reads make the CPU wait for the GPU each call).

Without a CUDA GPU it prints that it needs one and exits 0. ``--device cpu --tiny`` runs the same
code on a CPU at a tiny size (gloo, a world of one): the test suite runs it so that this file works
before a GPU sees it. Cases past ``--budget`` seconds are listed as skipped, so the check ends in
about five minutes whatever the kernels do; a call that runs out of memory is a row saying so.

``python -m benchmarks gpu [-- --sizes small,video] [--reps 5] [--worlds 1,N] [--budget 270] [--device cpu --tiny]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks import gpu_peers
from benchmarks.bench_attention import time_in_turns
from benchmarks.harness import median, spawn_measure, table

NEEDS_GPU = ("bench_gpu needs a CUDA GPU (torch.cuda.is_available() is False here): nothing measured; "
             "`python -m benchmarks gpu -- --device cpu --tiny` runs its code path on this CPU")


@dataclass(frozen=True)
class Shape:
    """One workload: [batch, frames x frame_tokens, heads, dim], and the masks' chunk and clip sizes in frames."""

    name: str
    heads: int
    dim: int
    frames: int
    frame_tokens: int
    chunk_frames: int
    window_chunks: int
    clips: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.frames * self.frame_tokens

    def describe(self) -> str:
        return f"[1, {self.length}, {self.heads}, {self.dim}] ({self.frames} frames of {self.frame_tokens})"


SHAPES = {
    "small": Shape("small", 8, 64, 8, 256, 2, 2, (3, 2, 3)),
    "video": Shape("video", 24, 128, 21, 1560, 3, 2, (9, 5, 7)),
    "tiny": Shape("tiny", 4, 8, 4, 8, 1, 2, (2, 1, 1)),
}


def masks(shape: Shape) -> dict[str, Any]:
    """Every mask kind on ``shape``'s frames, by name."""
    import cp

    chunk = shape.chunk_frames * shape.frame_tokens
    return {"full": cp.Mask.full(), "causal": cp.Mask.causal(), "chunk_causal": cp.Mask.chunk_causal(chunk),
            "sliding_window": cp.Mask.sliding_window(chunk, shape.window_chunks),
            "packed": cp.Mask.packed([c * shape.frame_tokens for c in shape.clips])}


def usp_split(world: int) -> tuple[int, int]:
    """usp's [ulysses, ring] sizes on ``world`` ranks: 2 x world/2 where that divides, else a ring alone."""
    return (2, world // 2) if world % 2 == 0 else (1, world)


#: The masks Transformer Engine's face runs in this check, by TE's attn_mask_type.
TE_MASK_TYPES = {"full": "no_mask", "causal": "causal"}
#: The masks megatron-core's face runs: the local spec's causal attn_mask_type, and chunk-causal as ``mask=``.
MEGATRON_MASKS = ("causal", "chunk_causal")


def cases(shape: Shape, world: int) -> list[tuple[str, str, str]]:
    """(method, call, mask name) of every row for ``shape`` on ``world`` ranks, mask by mask (one reference each):
    FlexAttention on the mask (one process's peer, on a world of one), the plain calls (no mask; ``causal=True``)
    for full and causal, the default plan for every kind, Transformer Engine's face
    (``cp.transformer_engine.DotProductAttention``, bshd, p2p) for no_mask and causal, and megatron-core's
    (``cp.megatron.DotProductAttention``, sbhd, p2p) for causal and chunk-causal."""
    rows = []
    for name in masks(shape):
        if world == 1:
            rows.append(("flex", "peer", name))
        for method in ("ring", "usp"):
            rows += [(method, call, name) for call in (("plain", "plan") if name in ("full", "causal") else ("plan",))]
        if name in TE_MASK_TYPES:
            rows.append(("te", "face", name))
        if name in MEGATRON_MASKS:
            rows.append(("megatron", "face", name))
    return rows


# ---------------------------------------------------------------- one rank

def _measure(rank: int, world: int, store: str, opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch
    import torch.distributed as dist

    import parallel_state as ps

    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(opts["threads"])
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=opts["pg_timeout"]))
    u, r = usp_split(world)
    ps.initialize_model_parallel(context_parallel_size=world, hierarchical_context_parallel_sizes=[u, r])
    groups = {"ring": dist.group.WORLD, "usp": ps.get_hierarchical_context_parallel_groups()}
    deadline = opts["deadline"]
    rows: list[dict[str, Any]] = []
    try:
        rows.append({"table": "ceiling", "ranks": world, **gpu_peers.matmul_ceiling(device)})
        for shape in (SHAPES[s] for s in opts["sizes"]):
            rows += _shape_rows(shape, rank, world, groups, device, deadline, opts)
        if world > 1:
            rows += [_check_row(SHAPES[s], rank, world, groups["ring"], device, deadline, opts) for s in opts["sizes"]]
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return rows if rank == 0 else None


def _any_rank(flag: bool, device: Any) -> bool:
    """Whether ``flag`` holds on any rank (every rank learns it, so none waits in a collective the others skipped)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _worst(values: dict[str, float | None], device: Any) -> dict[str, float | None]:
    """Each figure's maximum over the ranks (None stays None: it is the same on every rank)."""
    import torch
    import torch.distributed as dist

    keys = [k for k, v in values.items() if v is not None]
    if not keys:
        return values
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)  # type: ignore[arg-type]
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {**values, **dict(zip(keys, t.tolist(), strict=True))}


def _oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _shape_rows(shape: Shape, rank: int, world: int, groups: dict[str, Any], device: Any, deadline: float,
                opts: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    length = shape.length
    g = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, length, shape.heads, shape.dim, device=device, generator=g) for _ in range(4)]
    rows: list[dict[str, Any]] = []
    refs: dict[str, Any] = {}
    for method, call, mask_name in cases(shape, world):
        row: dict[str, Any] = {"shape": shape.name, "ranks": world, "method": method, "call": call,
                               "mask": mask_name}
        rows.append(row)
        if _any_rank(time.time() > deadline, device):
            row["status"] = "skipped: past the time budget"
            continue
        if call == "face" and mask_name != "full" and length % (2 * world):
            row["status"] = f"skipped: {length} tokens are no multiple of 2 x {world} ranks (the faces' layout needs it)"
            continue
        if method == "megatron" and importlib.util.find_spec("megatron") is None:
            row["status"] = "skipped: megatron-core is not installed"
            continue
        mask = masks(shape)[mask_name]
        try:
            if mask_name not in refs:  # the float32 reference, SDPA and FlexAttention, once per mask
                refs.clear()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                refs[mask_name] = gpu_peers.reference(full, mask_name, mask, length, device, with_flex=world == 1)
            case = _flex_case if method == "flex" else _case
            measured = case(method, call, mask_name, mask, refs[mask_name], full, rank, world, groups, device, opts)
            failed = None
        except Exception as exc:  # one case's failure (out of memory, no kernel) is its row, not the end of the run
            failed = exc
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if _any_rank(failed is not None, device):
            row["status"] = ("out of memory" if failed is not None and _oom(failed)
                             else f"failed: {type(failed).__name__}: {failed}" if failed is not None
                             else "failed on another rank")
            row["status"] = row["status"].splitlines()[0][:160]
            continue
        row.update(_figures(world, refs[mask_name], *measured, device))
    return rows


def _figures(world: int, ref: dict[str, Any], plan: dict[str, Any], err: dict[str, float | None], peak: int | None,
             clocks: dict[str, dict[str, float]], flops: float, device: Any) -> dict[str, Any]:
    """A measured row's figures: its own (errors, peak and host / device ms the worst over the ranks), SDPA's and
    FlexAttention's where it ran beside it, TFLOP/s on the mask's allowed pairs per GPU, and the time ratios."""
    mine, sdpa, flex = clocks["row"], clocks["sdpa"], clocks.get("flex")
    worst = _worst({**err, "peak": peak, "host_ms": mine["host_ms"], "device_ms": mine["device_ms"],
                    "sdpa_host_ms": sdpa["host_ms"], "sdpa_device_ms": sdpa["device_ms"]}, device)
    row = {**plan, **worst, "status": "ok", "sdpa_err": ref["sdpa_err"], "sdpa_peak": ref["sdpa_peak"],
           "ms": mine["ms"], "sdpa_ms": sdpa["ms"], "tflops": gpu_peers.tflops(flops, world * mine["ms"] / 1e3),
           "sdpa_tflops": gpu_peers.tflops(ref["flops"], sdpa["ms"] / 1e3), "vs_sdpa": mine["ms"] / sdpa["ms"],
           "efficiency": sdpa["ms"] / (world * mine["ms"]),
           "flex_ms": None, "flex_peak": None, "flex_tflops": None, "vs_flex": None}
    if flex is not None:
        row.update(flex_ms=flex["ms"], flex_peak=ref["flex_peak"], vs_flex=mine["ms"] / flex["ms"],
                   flex_tflops=gpu_peers.tflops(ref["flex"].flops(ref["flops"]), flex["ms"] / 1e3))
    return row


def _sdpa_way(ref: dict[str, Any]) -> Callable[[], Any]:
    return lambda: gpu_peers.forward_backward(ref["sdpa"], *ref["bf16"])


def _flex_way(ref: dict[str, Any]) -> Callable[[], Any]:
    return lambda: ref["flex"].step(ref["flex_ins"], ref["bf16"][1])


def _flex_case(method: str, call: str, mask_name: str, mask: Any, ref: dict[str, Any], full: list[Any], rank: int,
               world: int, groups: dict[str, Any], device: Any, opts: dict[str, Any]) -> tuple[Any, ...]:
    """A FlexAttention row's figures (one process, built and compiled with the reference): how it ran, its errors
    and peak memory, its time in turns with SDPA's, and the flops it did on the allowed pairs."""
    peer = ref["flex"]
    if isinstance(peer, Exception):  # building or compiling it failed: that is this row's status
        raise peer
    clocks = gpu_peers.clocked_turns({"row": _flex_way(ref), "sdpa": _sdpa_way(ref)}, groups["ring"], opts, device)
    return {"plan": peer.how}, ref["flex_err"], ref["flex_peak"], clocks, peer.flops(ref["flops"])


def _case(method: str, call: str, mask_name: str, mask: Any, ref: dict[str, Any], full: list[Any], rank: int,
          world: int, groups: dict[str, Any], device: Any, opts: dict[str, Any]) -> tuple[Any, ...]:
    """One row's figures on this rank: the plan, the errors, the peak memory, the times of ours, SDPA's and (on
    one process, where it runs) FlexAttention's in turns, and the flops done on the allowed pairs."""
    import torch

    import cp

    length, bf16 = full[0].shape[1], torch.bfloat16
    if call == "face":  # the face's layout: TE's DualChunkSwap, where the mask depends on positions
        plan = (cp.plan_dispatch(mask, length, world, method="contiguous") if mask_name == "full"
                else cp.plan_dual_chunk_swap(mask, length, world))
    else:
        plan = (cp.plan_dispatch(mask, length, world) if call == "plan"
                else cp.plan_dispatch(cp.Mask.full(), length, world, method="contiguous"))
    mine = plan.index(rank).to(device)
    ins = [t[:, mine].to(bf16).requires_grad_(True) for t in full[:3]]
    grad = full[3][:, mine].to(bf16)
    fn = _ours(method, call, mask_name, plan, groups["ring"], *groups["usp"], shape=full[0].shape)
    step = gpu_peers.forward_backward
    err = gpu_peers.errors(step(fn, ins, grad), tuple(t[:, mine] for t in ref["fp32"]), ref["scale"])
    peak = gpu_peers.peak_bytes(lambda: step(fn, ins, grad), device)
    ways = {"row": lambda: step(fn, ins, grad), "sdpa": _sdpa_way(ref)}
    if isinstance(ref.get("flex"), gpu_peers.Flex):
        ways["flex"] = _flex_way(ref)
    about = {"plan": plan.method if call in ("plan", "face") else "contiguous (plain call)",
             "transport": plan.transport, "predicted_ms": plan.predicted_ms}
    return about, err, peak, gpu_peers.clocked_turns(ways, groups["ring"], opts, device), ref["flops"]


#: Masked ring calls per timing of the check's cost: a model's layers, launched back to back.
CHECK_CALLS = 8


def _check_row(shape: Shape, rank: int, world: int, group: Any, device: Any, deadline: float,
               opts: dict[str, Any]) -> dict[str, Any]:
    """The check's cost on ``shape``: CHECK_CALLS masked ring calls (forward + backward) then one synchronize, with
    the check as it runs and in full every call (PARALLEL_STATE_DEBUG=1), timed in turns."""
    import os

    import torch

    import cp

    row: dict[str, Any] = {"table": "check", "shape": shape.name, "ranks": world, "calls": CHECK_CALLS}
    if _any_rank(time.time() > deadline, device):
        row["status"] = "skipped: past the time budget"
        return row
    plan = cp.plan_dispatch(masks(shape)["chunk_causal"], shape.length, world)
    g = torch.Generator(device=device).manual_seed(1)
    mine = plan.index(rank).to(device)
    ins = [torch.randn(1, shape.length, shape.heads, shape.dim, device=device, generator=g)[:, mine]
           .to(torch.bfloat16).requires_grad_(True) for _ in range(3)]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def layers() -> None:
        for _ in range(CHECK_CALLS):
            cp.ring_attention(*ins, group, plan=plan).sum().backward()
        sync()

    def every_call() -> None:
        os.environ["PARALLEL_STATE_DEBUG"] = "1"
        try:
            layers()
        finally:
            os.environ.pop("PARALLEL_STATE_DEBUG")

    try:
        times = time_in_turns({"once": layers, "every": every_call}, group, {"reps": opts["reps"], "warmup": 1},
                              device=device)
        failed = None
    except Exception as exc:  # out of memory: the row says so
        failed = exc
    if _any_rank(failed is not None, device):
        row["status"] = ("out of memory" if failed is not None and _oom(failed) else
                         f"failed: {type(failed).__name__}: {failed}".splitlines()[0][:160] if failed is not None
                         else "failed on another rank")
        return row
    row.update(status="ok", once_ms=median(times["once"]) * 1e3, every_ms=median(times["every"]) * 1e3)
    return row


def check_table_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """The check table's cells: ms for the calls with the check once, in full every call, and their ratio."""
    out = []
    for r in rows:
        head = [r["shape"], r["ranks"], r["calls"]]
        if r.get("status") != "ok":
            out.append(head + [r.get("status", "-"), "-", "-"])
            continue
        out.append(head + [f"{r['once_ms']:.2f}", f"{r['every_ms']:.2f}", f"{r['every_ms'] / r['once_ms']:.2f}x"])
    return out


CHECK_HEADER = ["shape", "ranks", "calls", "ms: checked once (two ints a call)", "ms: checked in full every call",
                "every call / once"]


def _ours(method: str, call: str, mask_name: str, plan: Any, group: Any, ug: Any, rg: Any,
          shape: Any = None) -> Callable[..., Any]:
    """The call a row measures: ring or usp, plain (``causal=True`` for causal) or on ``plan``; Transformer
    Engine's face as Cosmos builds it (bshd, p2p on ``group``), its [b, s, h * d] output viewed as [b, s, h, d]; or
    megatron-core's face as its attention layer calls it (sbhd, p2p on ``group``, the plan's mask as ``mask=``
    past causal)."""
    import cp

    if method == "megatron":
        from types import SimpleNamespace

        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.enums import AttnMaskType

        import cp.megatron

        heads, dim = shape[2], shape[3]
        config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                                   context_parallel_size=group.size(), attention_dropout=0.0)
        core = cp.megatron.DotProductAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type="p2p",
                                               pg_collection=SimpleNamespace(tp=None, cp=group, hcp=None),
                                               mask=None if mask_name == "causal" else plan.mask)
        return lambda q, k, v: core(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None,
                                    attn_mask_type=AttnMaskType.causal).transpose(0, 1).unflatten(-1, (heads, dim))

    if method == "te":
        from cp.transformer_engine import DotProductAttention

        heads, dim = shape[2], shape[3]
        face = DotProductAttention(heads, dim, num_gqa_groups=heads, attention_dropout=0, qkv_format="bshd",
                                   attn_mask_type=TE_MASK_TYPES[mask_name])
        face.set_context_parallel_group(group, None, None, "p2p")
        return lambda q, k, v: face(q, k, v).unflatten(-1, (heads, dim))
    if call == "plain":
        causal = mask_name == "causal"
        if method == "ring":
            return lambda q, k, v: cp.ring_attention(q, k, v, group, causal=causal)
        return lambda q, k, v: cp.usp_attention(q, k, v, ulysses_group=ug, ring_group=rg, causal=causal)
    if method == "ring":
        return lambda q, k, v: cp.ring_attention(q, k, v, group, plan=plan)
    return lambda q, k, v: cp.usp_attention(q, k, v, ulysses_group=ug, ring_group=rg, plan=plan)


# ---------------------------------------------------------------- the table

def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """The printed table's cells of the rows the ranks measured (the peers' figures in brackets: SDPA's, then
    FlexAttention's where it ran beside the row)."""
    out = []
    for r in rows:
        head = [r["shape"], r["ranks"], r["method"], r["call"], r["mask"]]
        if r.get("status") != "ok":
            out.append(head + [r.get("status", "-")] + ["-"] * (len(HEADER) - len(head) - 1))
            continue
        sdpa = r["sdpa_err"]
        out.append(head + [
            r["plan"] + (f", {r['transport']}" if r.get("transport") else ""),
            f"{r['out_abs']:.2g} ({sdpa['out_abs']:.2g})", f"{r['out_rel']:.2g} ({sdpa['out_rel']:.2g})",
            f"{_num(r['grad_rel'], '.2g')} ({sdpa['grad_rel']:.2g})",
            f"{_mib(r['peak'])} ({_mib(r['sdpa_peak'])}, {_mib(r['flex_peak'])})",
            f"{r['ms']:.2f} ({r['sdpa_ms']:.2f}, {_num(r['flex_ms'], '.2f')})",
            f"{r['host_ms']:.2f} / {r['device_ms']:.2f} ({r['sdpa_host_ms']:.2f} / {r['sdpa_device_ms']:.2f})",
            f"{r['tflops']:.3g} ({r['sdpa_tflops']:.3g}, {_num(r['flex_tflops'], '.3g')})",
            f"{r['vs_sdpa']:.2f}x", "-" if r["vs_flex"] is None else f"{r['vs_flex']:.2f}x",
            _num(r.get("predicted_ms"), ".2f"), f"{r['efficiency']:.2f}",
        ])
    return out


HEADER = ["shape", "ranks", "method", "call", "mask", "plan", "out max abs err (SDPA's)", "out rel err (SDPA's)",
          "grad rel err (SDPA's)", "peak MiB (SDPA's, Flex's)", "ms (SDPA's, Flex's)", "host / device ms (SDPA's)",
          "TFLOP/s per GPU (SDPA's, Flex's)", "ms / SDPA's", "ms / Flex's", "predicted ms", "efficiency"]


def run(opts: dict[str, Any], worlds: list[int]) -> list[dict[str, Any]]:
    """Measure on every world size in turn (spawned ranks, one per device); every rank-0 row."""
    rows: list[dict[str, Any]] = []
    for world in worlds:
        if time.time() > opts["deadline"]:
            break
        timeout = max(60.0, opts["deadline"] - time.time()) + opts["pg_timeout"] + 60
        rows += spawn_measure(_measure, world, opts, timeout=timeout, prefix="bench_gpu")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; without a CUDA GPU (and without ``--device cpu``) say so and return 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape only (for --device cpu: the test's run)")
    parser.add_argument("--sizes", default="small,video", help=f"shapes, of {sorted(SHAPES)}")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--worlds", default=None, help="rank counts (default: 1 and every GPU, when several)")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds of measuring before skipping the rest")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (--device cpu)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every row, as measured, to PATH")
    args = parser.parse_args(argv)
    sizes = ["tiny"] if args.tiny else args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SHAPES]:
        parser.error(f"unknown size(s) {unknown}; choose from {sorted(SHAPES)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(NEEDS_GPU)
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 1
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else sorted({1, min(gpus, 8)})
    if args.device == "cuda" and max(worlds) > gpus:
        parser.error(f"--worlds {args.worlds}: this machine has {gpus} GPU(s), one rank per GPU")
    start = time.time()
    opts = {"device": args.device, "sizes": sizes, "reps": args.reps, "threads": args.threads,
            "deadline": start + args.budget, "pg_timeout": 120}
    try:
        rows = run(opts, worlds)
    except Exception as exc:
        print(f"bench_gpu failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    checks = [r for r in rows if r.get("table") == "check"]
    ceilings = [r for r in rows if r.get("table") == "ceiling"]
    rows = [r for r in rows if "table" not in r]
    flex_how = "compiled with torch.compile" if args.device == "cuda" else \
        "eager, forward only (torch has no FlexAttention backward on a CPU; its figures and ms / Flex's are the forward's)"
    print(table(
        f"cp attention in bfloat16 on {name}: ours beside one process's SDPA and FlexAttention, forward + backward",
        HEADER, table_rows(rows),
        [", ".join(f"{s}: {SHAPES[s].describe()}" for s in sizes),
         "the card's ceiling, a bfloat16 matmul measured in this run: " + "; ".join(
             f"{c['n']}^3 at {c['tflops']:.3g} TFLOP/s (run of {c['ranks']} rank(s))" for c in ceilings),
         f"flex / peer: FlexAttention on the same cp.Mask (create_block_mask from its key ranges), one process on the "
         f"whole sequence, {flex_how}; SDPA: torch's default kernel (the dense mask past full and causal)",
         f"error against a float32 one-process SDPA (abs: max of the difference; rel: divided by the reference's "
         f"max; grad: the worst of dq, dk, dv), in brackets one process's bfloat16 SDPA's; peak: "
         f"max_memory_allocated above the inputs, the busiest rank's, beside SDPA's and Flex's on the whole sequence; "
         f"ms: median of {args.reps}, slowest rank, until the call's end on the device, in turns with one process's "
         f"SDPA (and, on one rank, Flex) on the whole sequence; host: until the call returns, before any "
         f"synchronize; device: CUDA events around it (off CUDA, the host's); TFLOP/s: 14 x allowed (query, key) "
         f"pairs x heads x dim / (ranks x ms), the same count for every kernel (SDPA computes every pair its "
         f"call covers); predicted: the plan's own estimate, where it has one; efficiency = SDPA ms / (ranks x ms)"],
    ))
    if checks:
        print(table(
            f"the cross-rank check of masked attention on {name}: {CHECK_CALLS} masked ring calls back to back",
            CHECK_HEADER, check_table_rows(checks),
            [f"forward + backward of the chunk-causal mask's default plan per call, one synchronize after the "
             f"{CHECK_CALLS}; checked once: cp.call_check as it runs (in full on the first call, then two ints a call "
             f"judged on the device); every call: PARALLEL_STATE_DEBUG=1 (the full check each call, read on the "
             f"host); median of {args.reps}, slowest rank, in turns"],
        ))
    print(f"(bench_gpu took {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
