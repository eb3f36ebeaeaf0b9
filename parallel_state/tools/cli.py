"""The command line: ``python -m parallel_state plan`` and ``python -m parallel_state demo``.

``plan`` sizes a job without starting a process: the groups every rank will be in, each rank's
coordinates and, for a video latent, how context parallelism splits it. ``demo`` runs the whole
lifecycle on local CPU ranks (see ``parallel_state.tools.demo``).

With ``--heads`` (and ``--kv-heads``) ``plan`` also prints the context-parallel plan of the latent
(``plan_context_parallel``: Ulysses x ring sizes, tokens per rank, uneven or not); with ``--mask``
also each rank's attention work and K/V bytes under the balanced plan and the contiguous split, and
the plan the cost model chooses (layout, transport, predicted step time, why, every candidate).

Exit codes: 0 success; 1 a check failed (``plan``: the latent cannot be split with this cp size and
no ``--heads`` plan covers it with an uneven split; ``demo``: a rank's check failed); 2 invalid
input. Every error is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from typing import Any, Sequence

from parallel_state.tools.plan_report import (  # noqa: F401  (re-exported: the demo's launcher and tests use them)
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    SplitReport,
    find_split_quietly,
    int_list,
    make_plan,
    parse_mask,
    rank_list,
    split_report,
)
from parallel_state.topology.cp_plan import ContextParallelPlan, plan_context_parallel
from parallel_state.topology.dispatch_cost import CostRates
from parallel_state.topology.dispatch_layout import Layout
from parallel_state.topology.kinds import BY_NAME
from parallel_state.topology.plan import DEFAULT_ORDER, TopologyPlan

PROG = "python -m parallel_state"

#: The group kinds ``plan`` reports (each named by its kind row's title).
PLAN_KINDS: tuple[str, ...] = ("tp", "cp", "pp", "dp", "dp-cp", "tp-pp", "tp-cp")
SIZE_KEYS: tuple[str, ...] = ("tp", "cp", "pp", "dp")
#: The element types --dtype takes (the names ContextParallelPlan's byte counts know).
_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")

class _Parser(argparse.ArgumentParser):
    # argparse prints the usage block and exits; we want one line and our exit code.
    def error(self, message: str) -> Any:
        raise CliError(f"{message} (see {self.prog} --help)")


# ----------------------------------------------------------------------------- plan output


def plan_dict(plan: TopologyPlan, split: SplitReport | None = None, cp_plan: ContextParallelPlan | None = None,
              dtype: str = "bfloat16", head_dim: int = 128) -> dict[str, Any]:
    """The ``plan --json`` object (``cp_plan`` only when ``--heads`` was given)."""
    out: dict[str, Any] = {
        "world_size": plan.world_size,
        "order": plan.order,
        "sizes": {k: plan.size(k) for k in SIZE_KEYS},
        "groups": {kind: [list(g) for g in plan.groups(kind)] for kind in PLAN_KINDS},
        "ranks": [{"rank": r, **{k: plan.coords(r)[k] for k in SIZE_KEYS}} for r in plan.all_ranks],
        "split": None,
    }
    if split is not None:
        if split.ok:
            out["split"] = {"shape": list(split.per_rank or ()), "cp_size_t": split.cp_size_t}
        else:
            out["split_error"] = {"message": split.error, "suggested_cp_sizes": split.suggested_cp_sizes}
    if cp_plan is not None:
        out["cp_plan"] = cp_plan_dict(cp_plan, dtype, head_dim)
    return out


def cp_plan_dict(cp_plan: ContextParallelPlan, dtype: str = "bfloat16", head_dim: int = 128) -> dict[str, Any]:
    """The ``cp_plan`` member of ``plan --json`` (with ``"mask"`` when the plan has one; bytes in ``dtype``)."""
    out = {
        "cp_size": cp_plan.cp_size, "num_heads": cp_plan.num_heads, "num_kv_heads": cp_plan.num_kv_heads,
        "token_grid": list(cp_plan.token_grid), "tokens": cp_plan.tokens,
        "ulysses_size": cp_plan.ulysses_size, "ring_size": cp_plan.ring_size,
        "hierarchical_context_parallel_sizes": cp_plan.hierarchical_context_parallel_sizes,
        "tokens_per_rank": list(cp_plan.tokens_per_rank), "uneven": cp_plan.uneven,
        "find_split": None if cp_plan.find_split is None else list(cp_plan.find_split),
        "cp_size_t": cp_plan.cp_size_t, "description": cp_plan.describe(),
    }
    if cp_plan.mask is not None:
        out["mask"] = {"spec": str(cp_plan.mask), "description": cp_plan.mask.describe(), "dtype": dtype,
                       "head_dim": head_dim}
        for key, method in (("balanced", Layout.BALANCED), ("contiguous", Layout.CONTIGUOUS), ("chosen", "auto")):
            plan = cp_plan.dispatch_plan(method)
            out["mask"][key] = {
                "method": plan.method, "transport": plan.transport, "predicted_ms": plan.predicted_ms,
                "work": list(plan.work), "balance": plan.balance,
                "runs": [[list(run) for run in runs] for runs in plan.runs],
                "bytes": list(cp_plan.masked_bytes_per_rank(dtype, head_dim, method=method)),
            }
        out["mask"]["chosen"]["why"] = cp_plan.dispatch_plan("auto").why
        out["mask"]["candidates"] = [dataclasses.asdict(c) for c in cp_plan.dispatch_plan("auto").candidates]
    return out


def format_cp_plan(cp_plan: ContextParallelPlan) -> str:
    """The context-parallel plan: the sizes in one table, then describe()'s paragraph."""
    lo, hi = min(cp_plan.tokens_per_rank), max(cp_plan.tokens_per_rank)
    tokens = str(hi) if lo == hi else f"{lo}-{hi}"
    lines = ["Context-parallel plan (plan_context_parallel)"]
    lines += _table(("cp", "heads", "kv heads", "ulysses", "ring", "tokens", "tokens/rank"),
                    [[cp_plan.cp_size, cp_plan.num_heads, cp_plan.num_kv_heads, cp_plan.ulysses_size,
                      cp_plan.ring_size, cp_plan.tokens, tokens]])
    lines += textwrap.wrap(cp_plan.describe(), 100, initial_indent="  ", subsequent_indent="  ",
                           break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def format_masked(cp_plan: ContextParallelPlan, dtype: str = "bfloat16", head_dim: int = 128) -> str:
    """Each rank's tokens, runs, attention work and K/V bytes received, balanced plan beside contiguous split."""
    b, c = cp_plan.dispatch_plan(Layout.BALANCED), cp_plan.dispatch_plan(Layout.CONTIGUOUS)
    b_bytes = cp_plan.masked_bytes_per_rank(dtype, head_dim, method=Layout.BALANCED)
    c_bytes = cp_plan.masked_bytes_per_rank(dtype, head_dim, method=Layout.CONTIGUOUS)
    mib = 1 << 20
    lines = [f"Masked attention {cp_plan.mask} ({cp_plan.mask.describe()})",
             "  balanced plan (cp.plan_dispatch) beside the contiguous split"]
    rows = [[r, b.sizes[r], len(b.runs[r]), b.work[r], c.work[r], f"{b_bytes[r] / mib:.1f}", f"{c_bytes[r] / mib:.1f}"]
            for r in range(cp_plan.cp_size)]
    rows.append(["max/mean", "", "", f"{b.balance:.4f}", f"{c.balance:.4f}",
                 f"{max(b_bytes) * cp_plan.cp_size / max(1, sum(b_bytes)):.4f}",
                 f"{max(c_bytes) * cp_plan.cp_size / max(1, sum(c_bytes)):.4f}"])
    lines += _table(("rank", "tokens", "runs", "work balanced", "work contiguous", "recv MiB balanced",
                     "recv MiB contiguous"), rows)
    lines += textwrap.wrap(
        f"work: allowed (query, key) pairs of the rank's queries; runs: contiguous runs of tokens the balanced "
        f"plan gives the rank; recv MiB: what the rank receives per forward call in {dtype} with head dim "
        f"{head_dim} (its Ulysses all-to-all share and, sent point to point, the K/V its ring block's queries may "
        f"see). The step waits for the busiest rank: {b.balance:.4f}x the mean work balanced, {c.balance:.4f}x "
        f"contiguous.", 100, initial_indent="  ", subsequent_indent="  ", break_long_words=False,
        break_on_hyphens=False)
    a = cp_plan.dispatch_plan("auto")
    lines += ["", f"  chosen (cp.plan_dispatch's cost model): the {a.method} layout, {a.transport} transport, "
                  f"predicted {a.predicted_ms:.3g} ms a step"]
    lines += _table(("layout", "transport", "predicted ms", "compute ms", "comm ms", "work max/mean",
                     "recv tokens", ""),
                    [[x.method, x.transport, f"{x.predicted_ms:.3g}", f"{x.compute_ms:.3g}", f"{x.comm_ms:.3g}",
                      f"{x.balance:.4f}", x.recv_tokens, "<- chosen" if (x.method, x.transport) == (a.method, a.transport)
                      else ""] for x in a.candidates])
    lines += textwrap.wrap(
        f"why: {a.why}. Priced for {cp_plan.num_heads} heads ({cp_plan.num_kv_heads} K/V) of {head_dim} in {dtype}, "
        f"forward and backward, as {cp_plan.ulysses_size} x {cp_plan.ring_size} (Ulysses x ring), with a GPU "
        f"node's rates (CostRates(): {CostRates().describe()}); cp.measure_rates(group) measures a group's.",
        100, initial_indent="  ", subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return indent + "  ".join(v.rjust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return [line(list(headers))] + [line(r) for r in cells]


def _wrap(items: Sequence[str], indent: str, width: int = 100) -> list[str]:
    # Wrap between items only, so a rank list is never cut in two.
    lines, cur = [], ""
    for item in items:
        if cur and len(indent) + len(cur) + 2 + len(item) > width:
            lines.append(indent + cur)
            cur = ""
        cur = f"{cur}  {item}" if cur else item
    return lines + [indent + cur] if cur else lines


def format_plan(plan: TopologyPlan) -> str:
    """Readable tables: the sizes, every group kind with its rank lists, each rank's coordinates."""
    lines = [f"Topology: {plan.world_size} ranks, order {plan.order}"]
    lines += _table(SIZE_KEYS, [[plan.size(k) for k in SIZE_KEYS]])
    lines += ["", "Groups (global ranks of every group, in Megatron's order)"]
    name_w = max(len(k) for k in PLAN_KINDS)
    for kind in PLAN_KINDS:
        n, size = plan.num_groups(kind), plan.group_size(kind)
        lines.append(f"  {kind.ljust(name_w)}  {BY_NAME[kind].title}: {n} group{'s' * (n != 1)} of {size}")
        lines += _wrap(["[" + ", ".join(map(str, g)) + "]" for g in plan.groups(kind)], " " * (name_w + 4))
    lines += ["", "Ranks (coordinates; pp is the pipeline stage)"]
    lines += _table(("rank",) + SIZE_KEYS, [[r] + [plan.coords(r)[k] for k in SIZE_KEYS]
                                            for r in plan.all_ranks])
    return "\n".join(lines)


def format_split(split: SplitReport) -> str:
    """The find_split result, or why the latent cannot be split and which cp sizes can."""
    head = (f"Video latent {list(split.shape)} (B, C, T, H, W), patch {list(split.patch)}, "
            f"view factor {split.view_factor}, cp {split.cp_size}")
    if split.ok:
        t, h, w = split.per_rank or (0, 0, 0)
        return "\n".join([
            head,
            f"  find_split -> per-rank shape [T', H', W] = [{t}, {h}, {w}]",
            f"  cp_size_t = {split.cp_size_t} (temporal split {split.cp_size_t} x height split {split.cp_size_h}; "
            f"width is never split)",
        ])
    sizes = ", ".join(map(str, split.suggested_cp_sizes)) or "none"
    return "\n".join([
        head,
        f"  cannot be split: {split.error}",
        f"  cp sizes that split this latent and fit this world size, tp and pp: {sizes}",
    ])


# ----------------------------------------------------------------------------- commands


def _cmd_plan(args: argparse.Namespace) -> int:
    ranks = None if args.ranks is None else rank_list("--ranks", args.ranks)
    if ranks is not None and len(ranks) != args.world_size:
        raise CliError(f"--ranks {args.ranks} names {len(ranks)} ranks but --world-size is {args.world_size}; "
                       f"give as many ranks as the topology has")
    plan = make_plan(args.world_size, args.tp, args.cp, args.pp, args.order, ranks)
    split = cp_plan = None
    if args.kv_heads is not None and args.heads is None:
        raise CliError("--kv-heads needs --heads (the number of q heads)")
    if args.mask is not None and args.heads is None:
        raise CliError("--mask plans a masked attention's work per rank: give --video-shape B,C,T,H,W and --heads too")
    if (args.head_dim is not None or args.dtype is not None) and args.mask is None:
        raise CliError("--head-dim and --dtype size the masked attention's bytes per rank: give --mask too")
    head_dim = 128 if args.head_dim is None else args.head_dim
    dtype = "bfloat16" if args.dtype is None else args.dtype
    if head_dim < 1:
        raise CliError(f"--head-dim must be >= 1, got {head_dim}")
    if args.video_shape is None:
        if args.patch is not None or args.view_factor is not None:
            raise CliError("--patch and --view-factor describe a video latent: give --video-shape B,C,T,H,W too")
        if args.heads is not None:
            raise CliError("--heads plans context parallelism for a video latent: give --video-shape B,C,T,H,W too")
    else:
        shape = int_list("--video-shape", args.video_shape, 5, "B,C,T,H,W")
        patch = int_list("--patch", args.patch or "1,2,2", 3, "pT,pH,pW")
        view_factor = 1 if args.view_factor is None else args.view_factor
        if view_factor < 1:
            raise CliError(f"--view-factor must be >= 1, got {view_factor}")
        split = split_report(plan, shape, patch, view_factor)  # type: ignore[arg-type]
        if args.heads is not None:
            try:
                cp_plan = plan_context_parallel(shape, plan.cp, args.heads, patch_values=patch,
                                                num_kv_heads=args.kv_heads, view_factor=view_factor)
                if args.mask is not None:
                    frame = cp_plan.token_grid[1] * cp_plan.token_grid[2]
                    cp_plan = plan_context_parallel(shape, plan.cp, args.heads, patch_values=patch,
                                                    num_kv_heads=args.kv_heads, view_factor=view_factor,
                                                    mask=parse_mask("--mask", args.mask, frame), head_dim=head_dim,
                                                    dtype=dtype)
            except (ValueError, TypeError) as exc:
                raise CliError(str(exc)) from None
    if args.svg:
        from parallel_state.tools.layout_svg import write_svg

        try:
            write_svg(plan, args.svg, split=split)
        except OSError as exc:
            raise CliError(f"cannot write --svg {args.svg}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps(plan_dict(plan, split, cp_plan, dtype, head_dim)))
    else:
        print(format_plan(plan))
        if split is not None:
            print()
            print(format_split(split))
        if cp_plan is not None:
            print()
            print(format_cp_plan(cp_plan))
            if cp_plan.mask is not None:
                print()
                print(format_masked(cp_plan, dtype, head_dim))
        if args.svg:
            print(f"\nLayout picture written to {args.svg}")
    # A --heads plan covers a grid find_split cannot split evenly (the uneven flattened split).
    return EXIT_OK if split is None or split.ok or cp_plan is not None else EXIT_CHECK_FAILED


def _cmd_demo(args: argparse.Namespace) -> int:
    from parallel_state.tools.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m parallel_state``."""
    parser = _Parser(prog=PROG, description="Plan context/pipeline-parallel topologies and run the local demo.")
    sub = parser.add_subparsers(dest="command", metavar="{plan,demo}", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("plan", help="show the process groups and latent split of a topology (starts nothing)",
                       description="Show every process group, each rank's coordinates and, for a video "
                       "latent, how context parallelism splits it. No process is started.")
    p.add_argument("--world-size", type=int, required=True, metavar="N", help="number of ranks (GPUs)")
    p.add_argument("--tp", type=int, default=1, metavar="A", help="tensor-parallel size (default 1)")
    p.add_argument("--cp", type=int, default=1, metavar="B", help="context-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, metavar="C", help="pipeline-parallel size (default 1)")
    p.add_argument("--order", default=DEFAULT_ORDER, help=f"rank order (default Megatron's {DEFAULT_ORDER})")
    p.add_argument("--ranks", metavar="LIST", help="lay the topology out over these global ranks (e.g. 4-7), as "
                   "initialize_model_parallel(ranks=...) does (default 0 .. N-1)")
    p.add_argument("--video-shape", metavar="B,C,T,H,W", help="a video latent shape to plan with find_split")
    p.add_argument("--patch", metavar="pT,pH,pW", help="patch sizes for find_split (default 1,2,2)")
    p.add_argument("--view-factor", type=int, metavar="V", help="views folded into T (default 1)")
    p.add_argument("--heads", type=int, metavar="H",
                   help="attention heads: also plan Ulysses x ring and tokens per rank for --video-shape at --cp")
    p.add_argument("--kv-heads", type=int, metavar="K", help="K/V heads for GQA/MQA (default: --heads)")
    p.add_argument("--mask", metavar="SPEC",
                   help="attention mask over one view's tokens, with --heads: full, causal, chunk_causal:CHUNK, "
                   "sliding_window:CHUNK,WINDOW (WINDOW in chunks), packed:L1+L2+..., packed:L1+L2+...,CHUNK or "
                   "token_window:LEFT,RIGHT (-1: unbounded); "
                   "token counts, or frames with a trailing f (chunk_causal:3f); also prints each rank's "
                   "attention work and K/V bytes, balanced plan vs contiguous split")
    p.add_argument("--head-dim", type=int, metavar="D", help="head dim for --mask's bytes (default 128)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="element type for --mask's bytes (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--svg", metavar="FILE", help="also draw the layout as an SVG picture")
    p.set_defaults(func=_cmd_plan)

    d = sub.add_parser("demo", help="run the whole lifecycle on local CPU ranks (gloo, 127.0.0.1)",
                       description="Start CPU ranks with torch.distributed's elastic launcher (gloo, 127.0.0.1 "
                       "only) and on each: initialize a topology, split a video latent, run it through the "
                       "pipeline stages, gather and check it, then tear down, rebuild another topology and "
                       "check again.")
    d.add_argument("--nproc", type=int, default=4, metavar="N", help="number of ranks (default 4)")
    d.add_argument("--cp", type=int, metavar="B", help="context-parallel size (default 2 for an even --nproc)")
    d.add_argument("--pp", type=int, metavar="C", help="pipeline-parallel size (default nproc / cp)")
    d.add_argument("--rebuild-cp", type=int, metavar="B", help="cp size of the rebuilt topology (default nproc)")
    d.add_argument("--rebuild-pp", type=int, metavar="C", help="pp size of the rebuilt topology (default 1)")
    d.add_argument("--latent", default="1,16,24,88,160", metavar="B,C,T,H,W",
                   help="video latent shape (default 1,16,24,88,160)")
    d.add_argument("--patch", default="1,2,2", metavar="pT,pH,pW", help="patch sizes for find_split (default 1,2,2)")
    d.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="stop the ranks after this long (default 300)")
    d.add_argument("--mask", default="full", metavar="SPEC",
                   help="the DiT's attention mask (as plan --mask; frames with a trailing f count frames of the DiT's "
                   "token grid): anything but full (the default) runs the autoregressive variant, e.g. "
                   "chunk_causal:2f, on a balanced dispatch plan")
    d.add_argument("--corrupt-rank", type=int, default=None, help=argparse.SUPPRESS)  # proves the checks can fail
    d.set_defaults(func=_cmd_demo)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (never raises, never prints a traceback)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args))
    except CliError as exc:
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.code
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, with what it was
        print(f"{PROG}: internal error: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_CHECK_FAILED
