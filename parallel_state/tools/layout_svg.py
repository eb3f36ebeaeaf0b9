"""The ``plan --svg`` picture: one box per rank, a row of boxes per pipeline stage, coloured by CP group.

Plain SVG text built with the standard library, so planning needs no plotting package. Within a
stage, each data-parallel replica is a block whose rows are tensor-parallel ranks and whose
columns are context-parallel ranks: a context-parallel group is one outlined, same-coloured row.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import escape

from parallel_state.topology.plan import TopologyPlan

if TYPE_CHECKING:
    from parallel_state.tools.plan_report import SplitReport

# Pastel fills with a darker edge of the same hue; neighbouring CP groups get different hues.
PALETTE: tuple[tuple[str, str], ...] = (
    ("#cfe3ff", "#2f6db5"), ("#ffd9b3", "#c0661a"), ("#d3f2d0", "#2e8a3a"), ("#f6d0e6", "#a8357a"),
    ("#fff1b0", "#a08400"), ("#dcd3f7", "#5b45a8"), ("#c9f0ee", "#1d8580"), ("#f5d3cf", "#b03a2e"),
    ("#e4ecc4", "#6b7f1f"), ("#e2e2e2", "#555555"),
)

CELL_W, CELL_H = 124, 50
GAP = 6            # between cells of one CP group
PAD = 5            # inside a CP group's outline
BLOCK_GAP = 22     # between data-parallel replicas
STAGE_GAP = 40     # between pipeline stages (room for the arrow)
LABEL_W = 96       # stage labels on the left
MARGIN = 20
MAX_CELLS_PER_LINE = 16


def _text(x: float, y: float, body: str, size: int = 12, weight: str = "normal", fill: str = "#222",
          anchor: str = "middle") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" font-weight="{weight}" fill="{fill}" '
            f'text-anchor="{anchor}">{escape(body)}</text>')


def render_svg(plan: TopologyPlan, split: SplitReport | None = None) -> str:
    """The layout of ``plan`` as an SVG document."""
    tp, cp, pp, dp = plan.tp, plan.cp, plan.pp, plan.dp
    per_line = max(1, min(dp, MAX_CELLS_PER_LINE // cp))
    block_w = cp * CELL_W + (cp - 1) * GAP + 2 * PAD
    row_h = CELL_H + 2 * PAD
    block_h = 16 + tp * row_h + (tp - 1) * GAP          # 16: the "dp i" caption
    lines_per_stage = math.ceil(dp / per_line)
    stage_h = lines_per_stage * block_h + (lines_per_stage - 1) * BLOCK_GAP
    content_w = LABEL_W + per_line * block_w + (per_line - 1) * BLOCK_GAP
    header_h = 62
    footer_h = 48 if split is not None else 8
    width = max(2 * MARGIN + content_w, 620)
    height = 2 * MARGIN + header_h + pp * stage_h + (pp - 1) * STAGE_GAP + footer_h

    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        _text(MARGIN, MARGIN + 16, f"{plan.world_size} rank{'s' * (plan.world_size != 1)} · tp {tp} · cp {cp} · "
              f"pp {pp} · dp {dp} · order {plan.order}", size=16, weight="bold", anchor="start"),
        _text(MARGIN, MARGIN + 36, "One box per rank · rows of blocks = pipeline stages (activations flow down)",
              size=12, fill="#444", anchor="start"),
        _text(MARGIN, MARGIN + 52, "Colour + outline = context-parallel group · block = data-parallel replica "
              "(rows tp, columns cp)", size=12, fill="#444", anchor="start"),
    ]
    top = MARGIN + header_h
    for stage in range(pp):
        y0 = top + stage * (stage_h + STAGE_GAP)
        out.append(_text(MARGIN, y0 + stage_h / 2 + 5, f"stage {stage}", size=15, weight="bold",
                         anchor="start"))
        if stage + 1 < pp:
            ax, ay = MARGIN + 28, y0 + stage_h + 6
            out.append(f'<path d="M {ax} {ay} L {ax} {ay + STAGE_GAP - 14}" stroke="#888" stroke-width="2"/>')
            out.append(f'<path d="M {ax - 6} {ay + STAGE_GAP - 18} L {ax} {ay + STAGE_GAP - 10} '
                       f'L {ax + 6} {ay + STAGE_GAP - 18} Z" fill="#888"/>')
        for d in range(dp):
            bx = MARGIN + LABEL_W + (d % per_line) * (block_w + BLOCK_GAP)
            by = y0 + (d // per_line) * (block_h + BLOCK_GAP)
            if dp > 1:
                out.append(_text(bx + 2, by + 11, f"dp {d}", size=11, fill="#666", anchor="start"))
            for t in range(tp):
                gy = by + 16 + t * (row_h + GAP)
                ranks = [_rank_at(plan, tp=t, cp=c, pp=stage, dp=d) for c in range(cp)]
                fill, edge = PALETTE[plan.group_index("cp", ranks[0]) % len(PALETTE)]
                out.append(f'<rect x="{bx}" y="{gy}" width="{block_w}" height="{row_h}" rx="9" '
                           f'fill="none" stroke="{edge}" stroke-width="2"/>')
                for c, rank in enumerate(ranks):
                    cx = bx + PAD + c * (CELL_W + GAP)
                    cy = gy + PAD
                    co = plan.coords(rank)
                    out.append(f'<rect x="{cx}" y="{cy}" width="{CELL_W}" height="{CELL_H}" rx="5" '
                               f'fill="{fill}" stroke="{edge}" stroke-width="1"/>')
                    out.append(_text(cx + CELL_W / 2, cy + 21, f"rank {rank}", size=15, weight="bold"))
                    out.append(_text(cx + CELL_W / 2, cy + 39,
                                     f"tp{co['tp']} cp{co['cp']} pp{co['pp']} dp{co['dp']}", size=11, fill="#333"))
    if split is not None:
        if split.ok:
            t_, h_, w_ = split.per_rank or (0, 0, 0)
            notes = [f"Latent {list(split.shape)} -> per rank [T', H', W] = [{t_}, {h_}, {w_}]",
                     f"cp_size_t = {split.cp_size_t} (temporal split {split.cp_size_t} x height split {split.cp_size_h})"]
        else:
            notes = [f"Latent {list(split.shape)} cannot be split with cp {split.cp_size}",
                     f"cp sizes that can: {', '.join(map(str, split.suggested_cp_sizes)) or 'none'}"]
        for i, note in enumerate(notes):
            out.append(_text(MARGIN, height - MARGIN - 22 + 18 * i, note, size=13, anchor="start"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _rank_at(plan: TopologyPlan, **coords: int) -> int:
    # Invert TopologyPlan.coords: the rank is the coordinates weighted by each dimension's stride.
    rank, stride = 0, 1
    for dim in plan.dims:
        rank += coords.get(dim, 0) * stride
        stride *= plan.size(dim)
    return rank


def write_svg(plan: TopologyPlan, path: str, split: Any = None) -> None:
    """Write the layout picture of ``plan`` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_svg(plan, split))
