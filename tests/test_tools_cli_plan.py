"""``python -m parallel_state plan``: JSON against the planning layer, tables, the SVG, every error path."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import parallel_state as ps
from parallel_state import TopologyPlan
from parallel_state.tools import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("tp", "cp", "pp", "dp", "dp-cp", "tp-pp", "tp-cp")

TOPOLOGIES = [  # world_size, tp, cp, pp, order
    (1, 1, 1, 1, None),
    (4, 1, 2, 2, None),
    (8, 2, 2, 2, None),
    (8, 1, 2, 2, "tp-cp-pp-dp"),
    (12, 1, 3, 2, "pp-dp-tp-cp"),
    (16, 2, 2, 2, "cp-tp-dp-pp"),
    (64, 2, 4, 2, None),
]


def _argv(ws, tp, cp, pp, order, *extra):
    argv = ["plan", "--world-size", str(ws), "--tp", str(tp), "--cp", str(cp), "--pp", str(pp)]
    if order is not None:
        argv += ["--order", order]
    return argv + list(extra)


def _run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("ws,tp,cp,pp,order", TOPOLOGIES)
def test_plan_json_matches_planning_layer(capsys, ws, tp, cp, pp, order):
    code, out, err = _run(capsys, _argv(ws, tp, cp, pp, order, "--json"))
    assert code == 0 and err == ""
    got = json.loads(out)
    plan = TopologyPlan(ws, tp=tp, cp=cp, pp=pp, order=order or ps.DEFAULT_ORDER)
    assert got["world_size"] == ws
    assert got["order"] == plan.order
    assert got["sizes"] == {"tp": tp, "cp": cp, "pp": pp, "dp": ws // (tp * cp * pp)}
    assert set(got["groups"]) == set(KINDS)
    assert got["split"] is None and "split_error" not in got
    for kind in KINDS:
        assert got["groups"][kind] == [list(g) for g in plan.groups(kind)], kind
        # Each rank is in exactly one group of a kind, the one the plan names for it.
        members = sorted(r for g in got["groups"][kind] for r in g)
        assert members == list(range(ws)), kind
        for rank in range(ws):
            [mine] = [g for g in got["groups"][kind] if rank in g]
            assert tuple(mine) == plan.group_ranks(kind, rank)
    assert [r["rank"] for r in got["ranks"]] == list(range(ws))
    for row in got["ranks"]:
        coords = plan.coords(row["rank"])
        assert row == {"rank": row["rank"], **{k: coords[k] for k in ("tp", "cp", "pp", "dp")}}
        # The coordinates agree with the groups: a cp group holds the ranks that differ only in cp.
        cp_group = got["groups"]["cp"][[i for i, g in enumerate(got["groups"]["cp"]) if row["rank"] in g][0]]
        assert [got["ranks"][r]["cp"] for r in cp_group] == list(range(cp))


def test_plan_tables(capsys):
    code, out, err = _run(capsys, _argv(8, 1, 2, 2, None))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "Topology: 8 ranks, order tp-cp-ep-dp-pp"
    assert lines[1].split() == ["tp", "cp", "pp", "dp"] and lines[2].split() == ["1", "2", "2", "2"]
    expected = {
        "cp": "[0, 1]  [2, 3]  [4, 5]  [6, 7]", "pp": "[0, 4]  [1, 5]  [2, 6]  [3, 7]",
        "dp": "[0, 2]  [1, 3]  [4, 6]  [5, 7]", "dp-cp": "[0, 1, 2, 3]  [4, 5, 6, 7]",
        "tp-pp": "[0, 4]  [1, 5]  [2, 6]  [3, 7]", "tp-cp": "[0, 1]  [2, 3]  [4, 5]  [6, 7]",
        "tp": "[0]  [1]  [2]  [3]  [4]  [5]  [6]  [7]",
    }
    for kind, ranks in expected.items():
        i = next(i for i, line in enumerate(lines) if i > 3 and line.split()[:1] == [kind])
        assert lines[i + 1].strip() == ranks, kind
    start = lines.index("Ranks (coordinates; pp is the pipeline stage)")
    assert lines[start + 1].split() == ["rank", "tp", "cp", "pp", "dp"]
    assert [line.split() for line in lines[start + 2:start + 10]] == [
        [str(r), "0", str(r % 2), str(r // 4), str(r // 2 % 2)] for r in range(8)]


def test_plan_wraps_long_rank_lists_between_groups(capsys):
    code, out, _ = _run(capsys, _argv(64, 2, 4, 2, None))
    assert code == 0
    tp_lines = out.split("  tp     tensor-model-parallel: 32 groups of 2\n")[1].split("\n  cp ")[0].splitlines()
    assert len(tp_lines) > 1 and all(len(line) <= 100 for line in tp_lines)
    groups = [g for line in tp_lines for g in line.strip().split("  ")]
    assert groups == [f"[{2 * i}, {2 * i + 1}]" for i in range(32)]


def _svg_cells(path):
    ns = {"s": "http://www.w3.org/2000/svg"}
    root = ET.parse(path).getroot()
    texts = root.findall(".//s:text", ns)
    rects = root.findall(".//s:rect", ns)
    cells = {}
    for t in texts:
        if t.text and t.text.startswith("rank "):
            x, y = float(t.get("x")), float(t.get("y"))
            # The cell is the filled rect that contains the label.
            [rect] = [r for r in rects if r.get("fill") not in ("none", "white")
                      and float(r.get("x")) <= x <= float(r.get("x")) + float(r.get("width"))
                      and float(r.get("y")) <= y <= float(r.get("y")) + float(r.get("height"))]
            cells[int(t.text.split()[1])] = (float(rect.get("x")), float(rect.get("y")), rect.get("fill"))
    labels = [t.text for t in texts if t.text]
    return cells, labels


@pytest.mark.parametrize("ws,tp,cp,pp,order", [(4, 1, 2, 2, None), (16, 2, 2, 2, None), (24, 1, 3, 2, "tp-cp-pp-dp")])
def test_plan_svg_one_cell_per_rank_grouped_by_stage_coloured_by_cp_group(capsys, tmp_path, ws, tp, cp, pp, order):
    path = tmp_path / "layout.svg"
    code, out, _ = _run(capsys, _argv(ws, tp, cp, pp, order, "--svg", str(path)))
    assert code == 0 and f"Layout picture written to {path}" in out
    plan = TopologyPlan(ws, tp=tp, cp=cp, pp=pp, order=order or ps.DEFAULT_ORDER)
    cells, labels = _svg_cells(path)
    assert sorted(cells) == list(range(ws))
    for r in range(ws):
        c = plan.coords(r)
        assert f"tp{c['tp']} cp{c['cp']} pp{c['pp']} dp{c['dp']}" in labels
    # Every stage is its own band of rows, in stage order.
    for a in range(ws):
        for b in range(ws):
            if plan.coords(a)["pp"] < plan.coords(b)["pp"]:
                assert cells[a][1] < cells[b][1], (a, b)
    # One colour per CP group, and neighbouring groups of a stage differ.
    for group in plan.groups("cp"):
        assert len({cells[r][2] for r in group}) == 1
        assert [cells[r][1] for r in group] == [cells[group[0]][1]] * cp  # one row
    fills = [cells[g[0]][2] for g in plan.groups("cp")]
    assert all(a != b for a, b in itertools.pairwise(fills))
    assert f"stage {pp - 1}" in labels


def test_plan_json_with_svg_prints_only_json(capsys, tmp_path):
    path = tmp_path / "x.svg"
    code, out, _ = _run(capsys, _argv(4, 1, 2, 2, None, "--json", "--svg", str(path)))
    assert code == 0 and json.loads(out)["world_size"] == 4 and path.exists()


BAD = [
    (_argv(6, 1, 4, 1, None), "world size 6 is not divisible by tp*cp*pp = 1*4*1 = 4"),
    (_argv(4, 0, 2, 1, None), "tp size must be >= 1, got 0"),
    (_argv(4, 1, 2, 2, "tp-cp-xx"), "unknown token(s) ['xx']"),
    (_argv(4, 1, 2, 1, "tp-dp"), "cp size is 2 but order 'tp-dp' does not name 'cp'"),
    (["plan", "--cp", "2"], "the following arguments are required: --world-size"),
    (["plan", "--world-size", "four"], "argument --world-size: invalid int value: 'four'"),
    (_argv(4, 1, 2, 2, None, "--video-shape", "1,16,24"), "--video-shape needs 5 comma-separated integers"),
    (_argv(4, 1, 2, 2, None, "--video-shape", "1,16,a,88,160"), "--video-shape needs 5 comma-separated integers"),
    (_argv(4, 1, 2, 2, None, "--video-shape", "1,16,0,88,160"), "--video-shape values must all be >= 1"),
    (_argv(4, 1, 2, 2, None, "--patch", "1,2,2"), "give --video-shape B,C,T,H,W too"),
    (_argv(4, 1, 2, 2, None, "--video-shape", "1,16,24,88,160", "--patch", "1,2"), "--patch needs 3"),
    (_argv(4, 1, 2, 2, None, "--svg", "/nonexistent-dir/x.svg"), "cannot write --svg /nonexistent-dir/x.svg"),
    (_argv(4, 1, 2, 1, None, "--ranks", "4-6"), "--ranks 4-6 names 3 ranks but --world-size is 4"),
    (_argv(4, 1, 2, 1, None, "--ranks", "4-x"), "--ranks takes global ranks such as 4-7"),
    (_argv(2, 1, 2, 1, None, "--ranks", "3,3"), "names a rank twice"),
    (_argv(8, 1, 8, 1, None, "--heads", "12"), "--heads plans context parallelism for a video latent"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--kv-heads", "2"), "--kv-heads needs --heads"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--kv-heads", "5"),
     "num_kv_heads=5 must be >= 1 and divide num_heads=12"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,1,4,4", "--heads", "12"), "4 tokens per view"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--mask", "causal"), "--mask plans a masked"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--head-dim", "64"),
     "--head-dim and --dtype size the masked attention's bytes per rank: give --mask too"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--mask", "chunk_causal:0"),
     "--mask: AttentionMask('chunk_causal'): chunk must be >= 1, got 0"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--mask", "diagonal"),
     "use full, causal, chunk_causal:CHUNK"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--mask", "packed:7f+7f"),
     "the packed segments add up to 21840 tokens but the sequence has 32760"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--mask", "causal", "--head-dim",
           "0"), "--head-dim must be >= 1, got 0"),
    (_argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--mask", "causal", "--dtype",
           "int3"), "argument --dtype: invalid choice: 'int3'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: {plan,demo}"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_plan_errors_are_one_line(capsys, argv, message):
    code, out, err = _run(capsys, argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("python -m parallel_state: error: ")
    assert message in err
    assert "Traceback" not in err


def test_help_exits_zero(capsys):
    code, out, _ = _run(capsys, ["plan", "--help"])
    assert code == 0 and "--video-shape" in out and "--svg" in out


def _subprocess(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "parallel_state", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)


def test_real_process_error_is_one_line_without_traceback():
    proc = _subprocess("plan", "--world-size", "6", "--cp", "4")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "python -m parallel_state: error: world size 6 is not divisible by tp*cp*pp = 1*4*1 = 4; "
        "choose sizes whose product divides the world size"]


def test_real_process_plan_json():
    proc = _subprocess("plan", "--world-size", "4", "--cp", "2", "--pp", "2", "--json")
    assert proc.returncode == 0 and proc.stderr == ""
    assert json.loads(proc.stdout)["groups"]["cp"] == [[0, 1], [2, 3]]


SPLITS = [  # world size, cp, --video-shape, extra flags, per-rank [T', H', W], cp_size_t
    (4, 2, "1,16,24,88,160", [], [12, 88, 160], 2),
    (8, 8, "1,16,4,88,160", [], [1, 44, 160], 4),                       # temporal 4 x height 2
    (8, 8, "1,16,24,88,160", ["--patch", "2,2,2"], [6, 44, 160], 4),    # gcd(24 // 2, 8) = 4
    (4, 4, "1,16,8,88,160", ["--view-factor", "2"], [1, 88, 160], 4),  # (8 // 2) / 4
]


@pytest.mark.parametrize("ws,cp,shape,extra,per_rank,cp_t", SPLITS)
def test_plan_video_split(capsys, ws, cp, shape, extra, per_rank, cp_t):
    argv = _argv(ws, 1, cp, 1, None, "--video-shape", shape, *extra)
    code, out, err = _run(capsys, argv + ["--json"])
    assert code == 0 and err == ""
    assert json.loads(out)["split"] == {"shape": per_rank, "cp_size_t": cp_t}
    assert "cp_size_t" not in vars(ps)  # planning leaves nothing behind
    code, out, _ = _run(capsys, argv)
    assert code == 0
    assert f"find_split -> per-rank shape [T', H', W] = {per_rank}" in out
    assert f"cp_size_t = {cp_t} (temporal split {cp_t} x height split {cp // cp_t}" in out


def test_plan_unsplittable_latent_reports_reason_and_working_cp_sizes(capsys):
    # T = 3 and H / 2 = 45 are odd: cp 2 would have to split the width; cp 3 splits T.
    argv = _argv(6, 1, 2, 1, None, "--video-shape", "1,16,3,90,160")
    code, out, err = _run(capsys, argv + ["--json"])
    assert code == 1 and err == ""
    got = json.loads(out)
    assert got["split"] is None
    assert got["split_error"]["suggested_cp_sizes"] == [1, 3]
    assert "width" in got["split_error"]["message"]
    code, out, _ = _run(capsys, argv)
    assert code == 1
    assert "cannot be split: " in out
    assert "cp sizes that split this latent and fit this world size, tp and pp: 1, 3" in out
    assert "cp_size_t" not in vars(ps)


def test_plan_latent_invalid_for_every_cp_is_a_usage_error(capsys):
    code, out, err = _run(capsys, _argv(4, 1, 2, 2, None, "--video-shape", "1,16,24,88,160", "--view-factor", "5"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--video-shape 1,16,24,88,160: " in err and "5" in err


def test_plan_keeps_an_existing_cp_size_t(capsys):
    ps.cp_size_t = 7  # as if a model in this process had planned already
    try:
        assert cli.main(_argv(4, 1, 2, 2, None, "--video-shape", "1,16,24,88,160", "--json")) == 0
        assert ps.cp_size_t == 7
    finally:
        del ps.cp_size_t


def test_plan_leaves_megatron_cp_size_t_alone(capsys):
    import megatron.core.parallel_state as mpu  # loaded: find_split mirrors cp_size_t into it

    assert "cp_size_t" not in vars(mpu)
    assert cli.main(_argv(4, 1, 2, 2, None, "--video-shape", "1,16,24,88,160", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["split"]["cp_size_t"] == 2
    assert "cp_size_t" not in vars(mpu) and "cp_size_t" not in vars(ps)


def test_plan_over_a_subset_of_ranks_names_global_ranks(capsys):
    import json

    code, out, _ = _run(capsys, _argv(4, 1, 2, 1, None, "--ranks", "4-7", "--json"))
    whole = json.loads(_run(capsys, _argv(4, 1, 2, 1, None, "--json"))[1])
    got = json.loads(out)
    assert code == 0 and got["groups"]["cp"] == [[4, 5], [6, 7]] and got["groups"]["dp"] == [[4, 6], [5, 7]]
    # The same layout as over ranks 0-3, shifted to the subset's global ranks.
    assert got["groups"] == {k: [[r + 4 for r in g] for g in v] for k, v in whole["groups"].items()}
    assert [r["rank"] for r in got["ranks"]] == [4, 5, 6, 7]


def test_plan_heads_prints_the_context_parallel_plan(capsys):
    # Wan2.1-1.3B at 480p on cp 8: find_split refuses (T = 21, 30 rows), the plan covers it (exit 0).
    argv = _argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12")
    code, out, err = _run(capsys, argv + ["--json"])
    assert code == 0 and err == ""
    got = json.loads(out)
    assert got["split"] is None and "width" in got["split_error"]["message"]  # find_split's report as before
    want = ps.plan_context_parallel((1, 16, 21, 60, 104), 8, 12)
    assert got["cp_plan"] == {
        "cp_size": 8, "num_heads": 12, "num_kv_heads": 12, "token_grid": [21, 30, 52], "tokens": 32760,
        "ulysses_size": 4, "ring_size": 2, "hierarchical_context_parallel_sizes": [4, 2],
        "tokens_per_rank": [4095] * 8, "uneven": False, "find_split": None, "cp_size_t": None,
        "description": want.describe(),
    }
    code, out, err = _run(capsys, argv)
    assert code == 0 and err == ""
    assert "Context-parallel plan (plan_context_parallel)" in out and "ring over 2" in out
    assert " ".join(out.split()).count("hierarchical_context_parallel_sizes=[4, 2]") == 1
    # GQA and an uneven split: CogVideoX-5B's latent, 48 heads, 8 K/V heads, cp 16.
    code, out, _ = _run(capsys, _argv(16, 1, 16, 1, None, "--video-shape", "1,16,13,60,90", "--heads", "48",
                                      "--kv-heads", "8", "--json"))
    plan = json.loads(out)["cp_plan"]
    assert code == 0 and plan["num_kv_heads"] == 8 and plan["uneven"] is True
    assert plan["tokens_per_rank"] == [1097] * 14 + [1096] * 2 and "replicated to 16" in plan["description"]
    assert "cp_size_t" not in vars(ps)


def test_plan_mask_reports_work_and_bytes_balanced_beside_contiguous(capsys):
    # Wan2.1-1.3B at 480p on cp 8, chunk-causal in chunks of 3 frames (1,560 tokens each), given in frames.
    argv = _argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--mask", "chunk_causal:3f")
    code, out, err = _run(capsys, argv + ["--json", "--head-dim", "64", "--dtype", "float32"])
    assert code == 0 and err == ""
    got = json.loads(out)["cp_plan"]
    mask = ps.AttentionMask.chunk_causal(4680)
    want = ps.plan_context_parallel((1, 16, 21, 60, 104), 8, 12, mask=mask, head_dim=64, dtype="float32")
    assert got["description"] == want.describe()
    assert {k: got["mask"][k] for k in ("spec", "description", "dtype", "head_dim")} == {
        "spec": "chunk_causal:4680", "description": mask.describe(), "dtype": "float32", "head_dim": 64}
    for method, key in (("balanced", "balanced"), ("contiguous", "contiguous"), ("auto", "chosen")):
        plan = want.dispatch_plan(method)
        assert {k: v for k, v in got["mask"][key].items() if k != "why"} == {
            "method": plan.method, "transport": plan.transport, "predicted_ms": plan.predicted_ms,
            "work": list(plan.work), "balance": plan.balance, "runs": [[list(r) for r in runs] for runs in plan.runs],
            "bytes": list(want.masked_bytes_per_rank("float32", 64, method=method))}
    chosen = want.chosen
    assert got["mask"]["chosen"]["why"] == chosen.why and chosen.predicted_ms <= want.contiguous.predicted_ms
    assert [(c["method"], c["transport"], c["predicted_ms"]) for c in got["mask"]["candidates"]] == [
        (c.method, c.transport, c.predicted_ms) for c in chosen.candidates]
    assert got["mask"]["contiguous"]["runs"] == [[[4095 * r, 4095 * (r + 1)]] for r in range(8)]
    code, out, err = _run(capsys, argv)
    assert code == 0 and err == ""
    assert "Masked attention chunk_causal:4680 (chunk-causal, chunks of 4680 tokens)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split()[:1] in (["0"], ["7"], ["max/mean"])]
    table = {r[0]: r for r in rows if len(r) >= 5}
    b, c = want.balanced, want.contiguous
    assert table["7"][1:5] == ["4095", str(len(b.runs[7])), str(b.work[7]), str(c.work[7])]
    assert table["max/mean"][1:3] == [f"{b.balance:.4f}", f"{c.balance:.4f}"] and c.balance > 1.7
    # the cost model's choice: layout, transport, predicted time, every candidate and why
    a = ps.plan_context_parallel((1, 16, 21, 60, 104), 8, 12, mask=mask).chosen  # head dim 128, bfloat16
    assert (f"chosen (cp.plan_dispatch's cost model): the {a.method} layout, {a.transport} transport, predicted "
            f"{a.predicted_ms:.3g} ms a step") in out
    picked = [line.split() for line in out.splitlines() if line.endswith("<- chosen")]
    assert len(picked) == 1 and picked[0][:3] == [a.method, a.transport, f"{a.predicted_ms:.3g}"]
    rows = [line.split() for line in out.splitlines() if line.split()[1:2] in (["p2p"], ["allgather"], ["ring"])]
    assert [r[:2] for r in rows] == [[c.method, c.transport] for c in a.candidates] and len(rows) == 6
    assert "why: " + a.why[:40] in " ".join(out.split())
    # without --mask the report is what it was: no mask member, no masked table
    code, out, _ = _run(capsys, _argv(8, 1, 8, 1, None, "--video-shape", "1,16,21,60,104", "--heads", "12", "--json"))
    assert code == 0 and "mask" not in json.loads(out)["cp_plan"]
