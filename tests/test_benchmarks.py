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
    measured = json.loads(out.read_text())
    [ceiling] = [r for r in measured if r.get("table") == "ceiling"]   # the card's ceiling: a bf16 matmul, this run
    assert ceiling["ranks"] == 1 and ceiling["n"] == 256 and ceiling["tflops"] > 0, ceiling
    rows = [r for r in measured if "table" not in r]
    shape = bench_gpu.SHAPES["tiny"]
    assert [(r["method"], r["call"], r["mask"]) for r in rows] == bench_gpu.cases(shape, 1)
    assert {r["mask"] for r in rows} == {"full", "causal", "chunk_causal", "sliding_window", "packed"}
    assert {r["mask"] for r in rows if r["method"] == "flex"} == {r["mask"] for r in rows}   # Flex on every mask
    masks = bench_gpu.masks(shape)
    for r in rows:
        assert r["status"] == "ok", r
        # bfloat16 against the float32 reference: about the error of one process's bfloat16 SDPA, never far above
        # (FlexAttention's too: its block mask, built from the mask's key ranges, is the mask)
        assert r["out_rel"] <= 2 * r["sdpa_err"]["out_rel"] + 0.01, r
        assert r["ms"] > 0 and r["sdpa_ms"] > 0 and r["efficiency"] == r["sdpa_ms"] / r["ms"], r
        assert r["vs_sdpa"] == r["ms"] / r["sdpa_ms"], r
        # host and device time per call: on a CPU both are the call's wall time
        assert 0 < r["host_ms"] == r["device_ms"] and 0 < r["sdpa_host_ms"] == r["sdpa_device_ms"], r
        # TFLOP/s count the mask's allowed pairs for every kernel, SDPA's dense call too: 14 x pairs x heads x dim
        allowed = 14 * int(masks[r["mask"]].dense(shape.length).sum()) * shape.heads * shape.dim
        assert abs(r["sdpa_tflops"] * r["sdpa_ms"] * 1e9 / allowed - 1) < 1e-9, r
        assert r["peak"] is None and r["sdpa_peak"] is None and r["flex_peak"] is None
        if r["method"] == "flex":  # torch has no FlexAttention backward on a CPU: the forward alone, eager
            assert r["plan"] == "eager, forward only" and r["grad_rel"] is None and r["flex_ms"] is None, r
            assert abs(r["tflops"] * r["ms"] * 1e9 / allowed - 4 / 14) < 1e-9, r
            continue
        assert r["grad_rel"] <= 2 * r["sdpa_err"]["grad_rel"] + 0.01, r
        assert abs(r["tflops"] * r["ms"] * 1e9 / allowed - 1) < 1e-9, r
        # beside FlexAttention in the same turns (a world of one)
        assert r["flex_ms"] > 0 and r["vs_flex"] == r["ms"] / r["flex_ms"], r
        assert abs(r["flex_tflops"] * r["flex_ms"] * 1e9 / allowed - 4 / 14) < 1e-9, r
        # a plan row runs the default plan (the cost model's choice of layout); a plain call the contiguous split;
        # the faces their own layout (DualChunkSwap where the mask depends on positions)
        layouts = {"plan": ("contiguous", "balanced", "clips"), "plain": ("contiguous (plain call)",),
                   "face": ("contiguous",) if r["mask"] == "full" else ("dual_chunk_swap",)}
        assert r["plan"] in layouts[r["call"]], r
    assert {r["method"] for r in rows if r["call"] == "face"} == {"te", "megatron"}
    printed = capsys.readouterr().out
    assert printed.count("| tiny ") == len(rows) and "efficiency" in printed
    for column in ("ms (SDPA's, Flex's)", "host / device ms (SDPA's)", "TFLOP/s per GPU (SDPA's, Flex's)",
                   "ms / SDPA's", "ms / Flex's", "peak MiB (SDPA's, Flex's)"):
        assert column in printed
    assert "the card's ceiling, a bfloat16 matmul measured in this run: 256^3 at " in printed
