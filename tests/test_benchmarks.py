"""The GPU check's command: without a GPU it says so and exits 0; its code path runs on a CPU at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import bench_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_command_without_a_gpu_says_it_needs_one() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}   # no GPU, even on a machine with one
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "gpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("(")]
    assert lines == ["## bench_gpu", bench_gpu.NEEDS_GPU], proc.stdout


def test_gpu_check_runs_every_case_on_a_cpu_at_a_tiny_size(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert bench_gpu.main(["--device", "cpu", "--tiny", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    shape = bench_gpu.SHAPES["tiny"]
    assert [(r["method"], r["call"], r["mask"]) for r in rows] == bench_gpu.cases(shape)
    assert {r["mask"] for r in rows} == {"full", "causal", "chunk_causal", "sliding_window", "packed"}
    for r in rows:
        assert r["status"] == "ok", r
        # bfloat16 against the float32 reference: about the error of one process's bfloat16 SDPA, never far above
        assert r["out_rel"] <= 2 * r["sdpa_err"]["out_rel"] + 0.01, r
        assert r["grad_rel"] <= 2 * r["sdpa_err"]["grad_rel"] + 0.01, r
        assert r["ms"] > 0 and r["sdpa_ms"] > 0 and r["efficiency"] == r["sdpa_ms"] / r["ms"], r
        # a plan row runs the default plan (the cost model's choice of layout); a plain call the contiguous split;
        # the faces their own layout (DualChunkSwap where the mask depends on positions)
        assert r["peak"] is None
        layouts = {"plan": ("contiguous", "balanced", "clips"), "plain": ("contiguous (plain call)",),
                   "face": ("contiguous",) if r["mask"] == "full" else ("dual_chunk_swap",)}
        assert r["plan"] in layouts[r["call"]], r
    assert {r["method"] for r in rows if r["call"] == "face"} == {"te", "megatron"}
    printed = capsys.readouterr().out
    assert printed.count("| tiny ") == len(rows) and "efficiency" in printed
