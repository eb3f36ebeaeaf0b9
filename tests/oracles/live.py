"""``python -m tests.oracles test``: the differential tests and megatron-core's own test file against a live release.

Three parts per release, each in the release's environment (its megatron-core first on the path, this checkout
after it):

- ``suite``: the project's tests that run megatron-core itself beside ``parallel_state`` on real gloo ranks
  (``SUITE``): its ``initialize_model_parallel``, getters and ``ProcessGroupCollection``, its model code through
  ``pg_collection=`` compared with ``torch.equal``, its helper functions, the data's facts of that release,
  writes of its private globals (TeleTron's initialization) and its GPTModel trained through its own training
  step with ``cp.megatron.DotProductAttention`` as core attention, and its TransformerLayers with a cross attention
  to a text context split over the cp ranks (NeMo DFM's layers);
- ``ours``: the release's own ``tests/unit_tests/test_parallel_state.py`` with ``import parallel_state as ps``
  in place of its ``import megatron.core.parallel_state as ps``;
- ``theirs``: the same file on the release's own module, the yardstick for ``ours``.

megatron-core's file runs on ``WORLD`` real processes, each a pytest session on gloo ranks joined over
loopback; ``tests.unit_tests.test_utilities.Utils`` is a stand-in written here (megatron-core's own needs CUDA
and NCCL and its training package), and the file's own NCCL groups and device count are served on the CPU
(``CONFTEST``). A test passes when it passes on every rank.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from . import RELEASES, environments

SUITE = ["tests/test_megatron_parity.py", "tests/test_megatron_model_code.py", "tests/test_megatron_compat_utils.py",
         "tests/test_megatron_bridge.py", "tests/test_megatron_release_data.py", "tests/test_megatron_private_globals.py",
         "tests/test_megatron_cp_attention.py", "tests/test_megatron_cross_attention.py"]
WORLD = 8
#: Seconds for one part on a loaded 2-core machine.
TIMEOUT = 1800
IMPORT = "import megatron.core.parallel_state as ps"

UTILITIES = '''"""Stand-in for Megatron-LM's tests/unit_tests/test_utilities.py: gloo ranks over loopback, no CUDA."""

import datetime
import os

import torch

{import_ps}


class Utils:
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    inited = False

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{{os.environ['MASTER_PORT']}}", rank=Utils.rank,
                world_size=Utils.world_size, timeout=datetime.timedelta(minutes=5))
            torch.distributed.barrier()
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        torch.distributed.barrier()
        Utils._destroy()
        Utils.inited = False

    @staticmethod
    def _destroy():
        ps.destroy_model_parallel()
        if not torch.distributed.is_initialized():
            return
        # megatron-core's destroy leaves its groups alive (gloo threads pile up by the thousand over the file):
        # free every group but the world's, so each test starts as in a fresh process.
        from torch.distributed import distributed_c10d as c10d

        for group in [g for g in c10d._world.pg_map if g is not c10d.GroupMember.WORLD]:
            torch.distributed.destroy_process_group(group)

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, **kwargs):
        Utils._destroy()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size, **kwargs)
        Utils.inited = True
'''

#: The file is written for one GPU per rank: here each rank counts as one device and NCCL groups it asks
#: for directly are gloo groups, so its hybrid-DPxCP and all-gather tests run instead of skipping or failing.
CONFTEST = '''import os

import torch
import torch.distributed as dist

_new_group = dist.new_group


def _new_group_on_cpu(*args, **kwargs):
    if kwargs.get("backend") == "nccl":
        # An NCCL communicator is made lazily by its members only; a gloo group is too when local.
        kwargs.update(backend="gloo", use_local_synchronization=True)
    return _new_group(*args, **kwargs)


dist.new_group = _new_group_on_cpu
torch.cuda.device_count = lambda: int(os.environ["WORLD_SIZE"])


def pytest_configure(config):
    for marker in ("flaky", "flaky_in_dev", "internal"):
        config.addinivalue_line("markers", marker)


def pytest_collection_modifyitems(items):
    # Each test's markers go to the junit file: megatron-core's CI deselects some of them.
    for item in items:
        item.user_properties.append(("markers", " ".join(sorted({m.name for m in item.iter_markers()}))))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(name: str, mode: str, where: str) -> None:
    """megatron-core's test file, its package folders and the stand-ins, under ``where``."""
    with open(environments.test_file(name), encoding="utf-8") as f:
        text = f.read()
    if mode == "ours":
        if text.count(IMPORT + "\n") != 1:
            raise SystemExit(f"{environments.test_file(name)} does not import `{IMPORT}` once: "
                             "tests/oracles/live.py must learn its spelling")
        text = text.replace(IMPORT + "\n", "import parallel_state as ps\n")
    unit = os.path.join(where, "tests", "unit_tests")
    os.makedirs(unit)
    files = {"tests/__init__.py": "", "tests/unit_tests/__init__.py": "", "conftest.py": CONFTEST,
             "tests/unit_tests/test_parallel_state.py": text,
             "tests/unit_tests/test_utilities.py": UTILITIES.format(
                 import_ps="import parallel_state as ps" if mode == "ours" else IMPORT)}
    for rel, content in files.items():
        with open(os.path.join(where, rel), "w", encoding="utf-8") as f:
            f.write(content)


#: The markers for which megatron-core's own CI deselects a test (its unit-test job runs
#: ``-m "not flaky"`` on its LTS image and ``-m "not flaky_in_dev"`` on its dev image).
UPSTREAM_DESELECTS = {"flaky", "flaky_in_dev"}


def _outcomes(xml: str) -> tuple[dict[str, tuple[str, str]], dict[str, set[str]]]:
    """Each test's outcome on one rank, with the first line of its failure's or skip's message; and its markers."""
    out, markers = {}, {}
    for case in ET.parse(xml).iter("testcase"):
        found = {child.tag: (child.get("message") or "").strip().splitlines()[:1] for child in case}
        kind = next((k for k in ("failure", "error", "skipped") if k in found), None)
        outcome = {"failure": "failed", "error": "failed", "skipped": "skipped", None: "passed"}[kind]
        out[case.get("name")] = (outcome, (found.get(kind) or [""])[0][:300] if kind else "")
        markers[case.get("name")] = {m for p in case.iter("property") if p.get("name") == "markers"
                                     for m in (p.get("value") or "").split()}
    return out, markers


def megatron_test_file(name: str, mode: str) -> dict[str, dict[str, str]]:
    """megatron-core's own test file of release ``name`` on ``WORLD`` ranks: the tests by outcome (a test fails
    when it fails on any rank, is skipped when skipped on every rank), each with what to print about it."""
    if not os.path.exists(environments.test_file(name)):
        raise SystemExit(f"no {environments.TEST_FILE} for {name} at {environments.test_file(name)}: "
                         "run `python -m tests.oracles build --megatron-lm PATH`")
    where = tempfile.mkdtemp(prefix=f"oracle-{name}-{mode}-")
    try:
        _layout(name, mode, where)
        port, procs = _free_port(), []
        for rank in range(WORLD):
            env = {**environments.env(name), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
                   "OMP_NUM_THREADS": "1"}
            env["PYTHONPATH"] = os.pathsep.join([where, env["PYTHONPATH"]])
            log = open(os.path.join(where, f"rank{rank}.log"), "w")
            procs.append((subprocess.Popen(
                [environments.python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                 f"--junitxml={where}/rank{rank}.xml", "tests/unit_tests/test_parallel_state.py"],
                cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        try:
            for proc, _log in procs:
                proc.wait(timeout=TIMEOUT)
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        read = [_outcomes(os.path.join(where, f"rank{r}.xml")) for r in range(WORLD)
                if os.path.exists(os.path.join(where, f"rank{r}.xml"))]
        per_rank = [outcomes for outcomes, _ in read]
        if len(per_rank) < WORLD:
            with open(os.path.join(where, "rank0.log"), encoding="utf-8") as f:
                raise SystemExit(f"{WORLD - len(per_rank)} rank(s) wrote no results; rank 0 said:\n{f.read()[-3000:]}")
        out: dict[str, dict[str, str]] = {"passed": {}, "failed": {}, "skipped": {}}
        for test in per_rank[0]:
            seen = [ranks.get(test, ("failed", "no result")) for ranks in per_rank]
            kinds = {kind for kind, _ in seen}
            kind = "failed" if "failed" in kinds else "skipped" if kinds == {"skipped"} else "passed"
            failing = [f"rank {r}: {message}" for r, (k, message) in enumerate(seen) if k == "failed"]
            deselected = sorted(read[0][1].get(test, set()) & UPSTREAM_DESELECTS)
            upstream = f"; megatron-core's CI deselects it (marked {', '.join(deselected)})" if deselected else ""
            out[kind][test] = "" if kind == "passed" else (
                f"{failing[0] if failing else seen[0][1]}; {len(failing)} of {WORLD} ranks failed{upstream}")
        return out
    finally:
        shutil.rmtree(where, ignore_errors=True)


def suite(name: str, extra: list[str] | None = None) -> tuple[int, str]:
    """The project's differential tests in the release's environment: pytest's exit code and summary line."""
    cmd = [environments.python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE, *(extra or [])]
    print(f"[oracles] megatron-core {RELEASES[name]}: {' '.join(cmd)}", flush=True)
    run = subprocess.run(cmd, cwd=environments.REPO, env=environments.env(name), capture_output=True, text=True,
                         timeout=TIMEOUT)
    log = os.path.join(environments.root(), "logs", f"suite-{RELEASES[name]}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        f.write(run.stdout + run.stderr)
    lines = run.stdout.strip().splitlines()
    print("\n".join(line for line in lines if re.match(r"(FAILED|ERROR) ", line)), flush=True)
    return run.returncode, (lines[-1] if lines else run.stderr[-2000:]) + f" (pytest's output: {log})"


def main(names: list[str], parts: list[str]) -> int:
    """Run ``parts`` for each release in ``names``; print one summary line per part; 1 if anything failed."""
    failed = False
    for name in names:
        why = environments.missing(name)
        if why:
            print(f"[oracles] {name}: not run: {why}")
            failed = True
            continue
        if "suite" in parts:
            code, summary = suite(name)
            print(f"[oracles] {RELEASES[name]} suite: {summary}", flush=True)
            failed |= code != 0
        files = {}
        for mode in ("ours", "theirs"):
            if mode not in parts:
                continue
            out = files[mode] = megatron_test_file(name, mode)
            total = sum(map(len, out.values()))
            print(f"[oracles] {RELEASES[name]} megatron-core's test_parallel_state.py on "
                  f"{'parallel_state' if mode == 'ours' else 'its own parallel_state'}: {len(out['passed'])} of "
                  f"{total} passed, {len(out['failed'])} failed, {len(out['skipped'])} skipped"
                  + "".join(f"\n    {kind}: {t} ({why})" for kind in ("failed", "skipped") for t, why in out[kind].items()),
                  flush=True)
        if "ours" in files:
            regressions = _regressions(files["ours"]["failed"], files.get("theirs", {}).get("failed"))
            if regressions:
                print(f"[oracles] {RELEASES[name]} fails on parallel_state: {', '.join(regressions)}", flush=True)
            failed |= bool(regressions)
    return 1 if failed else 0


def _regressions(ours: dict[str, str], theirs: dict[str, str] | None) -> list[str]:
    """The tests of megatron-core's file that fail on parallel_state and count against it: all of them, but
    those megatron-core's CI deselects that fail on megatron-core's own module on the same ranks, for the
    reason parallel_state's error quotes (``theirs``: None when that was not run)."""
    def same_refusal(test: str, why: str) -> bool:
        if theirs is None or test not in theirs or "megatron-core's CI deselects it" not in why:
            return False
        ranks = re.compile(r"; (\d+ of \d+) ranks failed")
        their_message = ranks.split(theirs[test])[0]
        # "rank 0: AssertionError: <megatron-core's message>": ours names our error and quotes that message
        quoted = their_message.split(": ", 2)[-1]
        return ranks.findall(why) == ranks.findall(theirs[test]) and f'"{quoted}"' in why

    return [t for t, why in ours.items() if not same_refusal(t, why)]


if __name__ == "__main__":
    sys.exit(main(list(RELEASES), ["suite", "ours", "theirs"]))
