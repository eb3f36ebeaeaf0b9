"""``python -m parallel_state demo``: the whole job end to end on real ranks, its failure path, its input checks."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import pytest

from parallel_state.tools import cli
from parallel_state.tools.demo import config_from_args, default_topologies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_LATENT = "1,4,8,16,16"


def _demo(*args):
    # PYTHONPATH names this checkout so the launcher and the ranks import the code under test; the
    # launch's timeout only turns a hang into a failure. A fresh directory: the demo runs where a user would.
    env = dict(os.environ, PYTHONPATH=ROOT)
    return lambda: [dict(args=[sys.executable, "-m", "parallel_state", "demo", *args], cwd=tempfile.mkdtemp(),
                         env=env)]


@pytest.mark.launch(_demo("--nproc", "4", "--latent", SMALL_LATENT, "--timeout", "200"), timeout=240)
def test_demo_end_to_end_on_four_ranks(launched):
    (proc,) = launched
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    steps = re.findall(r"^\[\s*(\d+)/14\] (cp \d x pp \d)  (.+?)\s+ok\s+[\d.]+ s", out, flags=re.M)
    assert [int(i) for i, _, _ in steps] == list(range(1, 15))
    assert [t for _, t, _ in steps] == ["cp 2 x pp 2"] * 7 + ["cp 4 x pp 1"] * 7
    assert [n for _, _, n in steps[:7]] == [
        "dist_init, groups == plan", "find_split", "broadcast + split latent", "DiT forward via scheduler",
        "cat_outputs_cp == 1 process", "backward, grads == 1 process", "destroy_model_parallel"]
    # The layout is printed once, for the first topology.
    assert out.count("Topology: 4 ranks") == 1
    assert "cp groups [[0, 1], [2, 3]], pp groups [[0, 2], [1, 3]]" in out
    assert "cp groups [[0, 1, 2, 3]], pp groups [[0], [1], [2], [3]]; cp 4 as ulysses 2 x ring 2" in out
    assert "cp groups [[0, 1], [2, 3]], pp groups [[0, 2], [1, 3]]; cp 2 as ulysses 2 x ring 1" in out
    assert "[1, 4, 8, 16, 16] -> per-rank [4, 16, 16], cp_size_t 2" in out
    assert "[1, 4, 8, 16, 16] -> per-rank [2, 16, 16], cp_size_t 4" in out
    # A register token makes the count odd: cp rank 0 holds one token more (uneven shards through usp).
    assert out.count("513 tokens (512 of patch 1x2x2 and a register), 6 heads, 4 blocks") == 2
    assert "4 blocks over 2 stages, last stage -> stage 0" in out and "4 blocks on one stage" in out
    # The DiT's output and every gradient agree with one process within 1e-5 of the largest value.
    errors = re.findall(r"\[1, 4, 8, 16, 16\], max \|diff\| / max \|ref\| ([\d.e+-]+) \(<= 1e-05\)", out)
    grads = re.findall(r"(\d+) parameter gradients, summed over dp-cp, max \|diff\| / max \|ref\| ([\d.e+-]+)", out)
    assert len(errors) == 2 and all(float(e) <= 1e-5 for e in errors), errors
    assert len(grads) == 2 and all(n == "55" and float(e) <= 1e-5 for n, e in grads), grads
    assert re.search(r"^    of which usp_attention\s+[\d.]+ s\s+[\d.]+ s$", out, re.M)
    assert out.count("0 process groups alive besides the default group (all ranks)") == 2
    assert "Summary: 14/14 steps passed on 4 ranks" in out
    assert "all ranks exited cleanly" in out
    assert "FAILED" not in out + proc.stderr and "Traceback" not in proc.stderr
    assert "warn" not in (out + proc.stderr).lower()


# Rank 1 perturbs its shard before the pipeline: the one-process comparison must catch it.
@pytest.mark.launch(_demo("--nproc", "2", "--latent", SMALL_LATENT, "--corrupt-rank", "1", "--timeout", "200"),
                    timeout=240)
def test_demo_failing_check_exits_nonzero_with_one_line_per_rank(launched):
    (proc,) = launched
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "[ 4/14] cp 2 x pp 1  DiT forward via scheduler" in proc.stdout
    assert "Summary" not in proc.stdout
    assert re.search(r"^rank [01]: step 5/14 'cp 2 x pp 1  cat_outputs_cp == 1 process' FAILED: the gathered "
                     r"output differs from the one-process result: max \|diff\| / max \|ref\| = [\d.]+ > 1e-05 "
                     r"\(\d+ of 8192 elements differ", proc.stderr, re.M)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m parallel_state: error: demo FAILED: rank ")


def _autoregressive_variant(mask: str, latent: tuple[int, ...]) -> list[str]:
    """The demo's rank program, on this pool rank: both topologies of the autoregressive variant, every check."""
    import datetime

    examples = os.path.join(ROOT, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import parallel_state_demo as demo

    steps = demo.Steps(total=demo.STEPS * 2)
    balance = []
    for cp_size, pp_size in ((2, 2), (4, 1)):
        topology = demo.Topology(steps, cp_size, pp_size, latent, (1, 2, 2), datetime.timedelta(seconds=60),
                                 corrupt_rank=None, print_layout=False, heads=demo.HEADS, mask_spec=mask)
        topology.run()  # a failed check ends this rank (the pool reports it)
        balance.append(round(topology.dispatch_plan.balance, 3))
    return [name for name, _ in steps.done] + [f"balance {balance}"]


def test_demo_autoregressive_variant_matches_one_process_under_cp_x_pp(pools):
    """``demo --mask chunk_causal:2f``: the DiT attends chunk-causally over frames on a balanced dispatch plan
    (cp.dispatch, masked usp, cp.undispatch) under cp 2 x pp 2 and cp 4 x pp 1; output and every gradient equal
    one process attending under the dense mask (the rank program's own checks, run on the test's rank pool)."""
    results = pools(4).run(_autoregressive_variant, "chunk_causal:2f", (1, 4, 8, 16, 16), timeout=240)
    names = [f"cp {c} x pp {p}  {step}" for c, p in ((2, 2), (4, 1)) for step in (
        "dist_init, groups == plan", "find_split", "broadcast + dispatch latent", "DiT forward via scheduler",
        "undispatch == 1 process", "backward, grads == 1 process", "destroy_model_parallel")]
    # 8 frames of 64 tokens in chunks of 2 frames: the balanced plan evens the work the contiguous split does not.
    assert results == [names + ["balance [1.0, 1.0]"]] * 4


@pytest.mark.parametrize("nproc,expected", [(4, ((2, 2), (4, 1))), (2, ((2, 1), (1, 2))), (8, ((2, 4), (8, 1))),
                                            (3, ((3, 1), (1, 3))), (1, ((1, 1), (1, 1)))])
def test_default_topologies(nproc, expected):
    assert default_topologies(nproc) == expected
    args = cli.build_parser().parse_args(["demo", "--nproc", str(nproc)])
    assert config_from_args(args).topologies == expected


def test_demo_explicit_topologies():
    args = cli.build_parser().parse_args(["demo", "--nproc", "8", "--pp", "2", "--rebuild-pp", "4"])
    assert config_from_args(args).topologies == ((4, 2), (2, 4))
    args = cli.build_parser().parse_args(["demo", "--nproc", "4", "--cp", "1", "--rebuild-cp", "2"])
    assert config_from_args(args).topologies == ((1, 4), (2, 2))


BAD = [
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--nproc", "4", "--cp", "3"], "--cp 3 x --pp 1 = 3 ranks, but --nproc is 4"),
    (["--nproc", "4", "--rebuild-cp", "2", "--rebuild-pp", "1"], "--rebuild-cp 2 x --rebuild-pp 1 = 2 ranks"),
    (["--latent", "1,4,8,16"], "--latent needs 5 comma-separated integers B,C,T,H,W"),
    (["--patch", "1,2"], "--patch needs 3 comma-separated integers"),
    (["--nproc", "4", "--latent", "1,4,3,6,16"], "--latent 1,4,3,6,16 cannot be split with cp 2"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["--corrupt-rank", "9"], "--corrupt-rank must name one of the 4 ranks, got 9"),
    (["--mask", "chunk_causal"], "--mask: mask 'chunk_causal': chunk_causal takes 1 value(s), got 0"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_demo_bad_input_is_one_line_before_any_process_starts(capsys, argv, message):
    code = cli.main(["demo", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_demo_unsplittable_latent_names_the_cp_sizes_that_work(capsys):
    assert cli.main(["demo", "--nproc", "4", "--latent", "1,4,3,6,16"]) == 2
    err = capsys.readouterr().err
    assert "(cp sizes that can, for 4 ranks: 1)" in err


def test_plain_imports_stay_light_and_one_way():
    code = ("import sys, parallel_state, parallel_state.tools.cli, parallel_state.tools.demo,"
            " parallel_state.tools.layout_svg\n"
            "bad = [m for m in ('cp', 'scheduler', 'parallel_state_demo', 'torch.distributed.launcher', 'loguru',"
            " 'megatron') if m in sys.modules]\n"
            "assert not bad, bad\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_demo_namespace_defaults_match_the_issue():
    args = cli.build_parser().parse_args(["demo"])
    assert isinstance(args, argparse.Namespace)
    config = config_from_args(args)
    assert config.nproc == 4 and config.topologies == ((2, 2), (4, 1))
    assert config.latent == (1, 16, 24, 88, 160) and config.patch == (1, 2, 2)
    assert config.mask == "full" and "--mask" not in config.rank_args()  # the main command runs as it always did
    args = cli.build_parser().parse_args(["demo", "--mask", "chunk_causal:2f"])
    assert config_from_args(args).rank_args()[-2:] == ["--mask", "chunk_causal:2f"]


def test_the_rank_program_is_found_in_the_checkout_and_missing_it_is_explained(tmp_path):
    from parallel_state.tools import demo
    from parallel_state.tools.plan_report import CliError

    assert demo._rank_program(ROOT) == os.path.join(ROOT, "examples", "parallel_state_demo.py")
    with pytest.raises(CliError, match=r"examples/parallel_state_demo.py is not in .*: it ships with the source"):
        demo._rank_program(str(tmp_path))  # what a wheel install has: no examples next to the package
